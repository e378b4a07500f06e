"""The candidates of one dtype: the 16-bit layer sets evaluated (:func:`candidate_sets`), the calibrations the
menu needs (:func:`calibrations`) and where each row's scales come from (:func:`scales_source`,
:func:`row_scales`)."""

from __future__ import annotations

from kvcal.recommend.config import (
    CALIBRATIONS,
    DEFAULT_ENGINE,
    RULE_COUNT,
    SCALES_CALIBRATED,
    SCALES_DEFAULT,
    SCALES_WRITE_TIME,
)


def candidate_sets(kv_cache_dtype: str, sensitivity: list[float] | None, costs: list[int], num_layers: int,
                   max_skip: int, engine: str = DEFAULT_ENGINE) -> list[dict]:
    """The skip sets evaluated for one dtype: ``{"choice", "skip", "deployable"}`` with ``choice``
    ``"auto"`` (probe-chosen, vLLM's forced boundary layers included for turboquant) for every count up to
    ``max_skip``, ``"rule"`` (first 2 + last 2) at :data:`RULE_COUNT` when ``max_skip`` allows it, and
    for turboquant also ``"auto-free"``: the probe's choice at the rule's count *without* the forced
    boundary — the measured alternative to the rule at equal memory, not deployable on stock vLLM 0.33
    (``engine/arg_utils.py`` always adds the boundary layers). Duplicates are dropped (first kept), and so is
    every set that keeps all ``num_layers`` layers at 16 bits (counts above ``num_layers - 1`` are not tried;
    the rule on a model of 4 layers or fewer is such a set): it stores nothing in the dtype. A dtype whose
    forced boundary alone covers every layer (``engine``'s ``not_applicable``,
    :func:`kvcal.engines.vllm.skip_layers.not_applicable`; ``sensitivity`` may then be ``None``) gives one row,
    ``{"choice": "rule", "skip": every layer, "deployable": False, "not_applicable": reason}``, which is not
    evaluated. ``engine``: whose boundary layers, rule and count range (:mod:`kvcal.engines`)."""
    from kvcal.engines import engine as engine_of
    from kvcal.search.skip_layers import choose_skip_layers

    eng = engine_of(engine)
    forced = eng.boundary_skip_layers(kv_cache_dtype, num_layers)
    na = eng.not_applicable(kv_cache_dtype, num_layers)
    if na:
        return [{"choice": "rule", "skip": list(forced), "deployable": False, "not_applicable": na}]
    hi = min(max_skip, eng.skip_count_range(kv_cache_dtype, num_layers)[1])
    out, seen = [], set()

    def add(choice, skip, deployable=True):
        key = (tuple(skip), deployable)
        if key not in seen and len(skip) < num_layers:
            seen.add(key)
            out.append({"choice": choice, "skip": list(skip), "deployable": deployable})

    rule_n = min(RULE_COUNT, num_layers)
    if rule_n <= max_skip or forced:
        add("rule", eng.rule_skip_layers(num_layers, rule_n) if not forced else forced)
    for n in range(len(forced), hi + 1):
        add("auto", choose_skip_layers(sensitivity, costs, max_skip=n, forced=forced))
    if forced:
        add("auto-free", choose_skip_layers(sensitivity, costs, max_skip=len(forced)), deployable=False)
    return out


def calibrations(dtypes) -> list[tuple[str, tuple[str, ...], str, str]]:
    """The rows of :data:`CALIBRATIONS` a menu ``dtypes`` needs (one of their dtypes is in it), in order, each
    with the ``kvcal calibrate --kv-cache-dtype`` replaced by the menu's own spelling (``fp8_e4m3`` when the menu
    names it rather than ``fp8``; :func:`check_options` refuses both), so that the calibrated artifact, its
    report and its ``kvcal export`` line name the dtype as deploy.md's ``vllm serve`` line does."""
    out = []
    for _, uses, name, what in CALIBRATIONS:
        named = [d for d in uses if d in dtypes]
        if named:
            out.append((named[0], uses, name, what))
    return out


#: :func:`scales_source` of a dtype whose scales vLLM computes when it writes the cache.
WRITE_TIME = "scales computed by vLLM at write time (nothing to calibrate)"


def scales_source(kv_cache_dtype: str, calibrated: bool, engine: str = DEFAULT_ENGINE) -> str:
    """The scales the ``kv_cache_dtype`` rows of recommend run with, as one phrase: calibrated
    (:data:`CALIBRATIONS`, ``calibrated`` True), vLLM's defaults (1.0) for a static-scale dtype kvcal does
    not calibrate (nvfp4_4over6, fp8_e5m2), or :data:`WRITE_TIME`. Raises ``ValueError`` for a dtype
    marked ``calibrated`` that :data:`CALIBRATIONS` does not name. ``engine``: whose dtype (:mod:`kvcal.engines`)."""
    from kvcal.engines import engine as engine_of

    spec = engine_of(engine).dtype(kv_cache_dtype)
    if calibrated:
        row = next((c for c in CALIBRATIONS if kv_cache_dtype in c[1]), None)
        if row is None:
            raise ValueError(f"kvcal recommend does not calibrate {kv_cache_dtype}")
        _, _, name, what = row  # calibrated under the menu's own spelling (calibrations)
        return (f"{what} calibrated on the corpus (kvcal calibrate --engine vllm --kv-cache-dtype {kv_cache_dtype}, "
                f"{name}/)")
    if spec.static_scales:
        kv = "outer scales" if spec.family == "nvfp4" else "k_scale/v_scale"
        return (f"vLLM's defaults: {kv} 1.0{' and q_scale 1.0' if spec.quantizes_query else ''}, not calibrated "
                f"(kvcal calibrate --engine vllm calibrates {', '.join(d for c in CALIBRATIONS for d in c[1])} only)")
    return WRITE_TIME


def row_scales(kv_cache_dtype: str, calibrated: bool, engine: str = DEFAULT_ENGINE) -> str:
    """A candidate row's ``scales`` label: :data:`SCALES_CALIBRATED` for a row run with kvcal's calibrated scales,
    else :data:`SCALES_DEFAULT` for a dtype with static scales (vLLM's 1.0) or :data:`SCALES_WRITE_TIME`.
    Raises the engine's ``DTypeError`` (:class:`~kvcal.engines.vllm.dtypes.VllmDTypeError`) for an unknown dtype."""
    from kvcal.engines import engine as engine_of

    if calibrated:
        return SCALES_CALIBRATED
    return SCALES_DEFAULT if engine_of(engine).dtype(kv_cache_dtype).static_scales else SCALES_WRITE_TIME
