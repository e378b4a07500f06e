"""``kvcal calibrate --engine vllm``: what the engine-agnostic calibration (:mod:`kvcal.calibrate`) asks of vLLM.

The floor finds these through the facade (``calibrate_check``, ``calibrate_preflight``, ``calibrate_search``,
``calibrate_finish``, ``cache_write``) and calls them at the points its own steps run: the option checks when the
config is built (:func:`check_options`), the checks that need the model's config before the weights load
(:func:`check_model`), the scale search that replaces kvcal's static FP8 search (:func:`search`: k/v/q scales for
``fp8``/``fp8_e4m3``, :mod:`kvcal.engines.vllm.search_fp8`; NVFP4 outer scales and q_scale for ``nvfp4``,
:mod:`kvcal.engines.vllm.search_nvfp4`), and the artifact's ``vllm`` section with the 16-bit layers
(:func:`add_to_artifact`). Holding the option check here, above both searches, is what cut the import circle
between them (``search_fp8`` asked ``search_nvfp4`` for its dtypes while ``search_nvfp4`` builds on ``search_fp8``).
"""

from __future__ import annotations

from collections.abc import Callable

from kvcal.errors import KvcalError


def check_engine_options(engine, kv_cache_dtype, preset, bits, fmt, granularity=None) -> None:
    """Validate ``kvcal calibrate --engine/--kv-cache-dtype`` against the other options (``granularity``: the
    ``--granularity`` given, ``None`` if none); raises :class:`~kvcal.errors.KvcalError` with a one-line fix.
    Calibrated dtypes: :data:`kvcal.engines.vllm.search_fp8.SUPPORTED_DTYPES` (static FP8 k/v/q scales) and
    :data:`kvcal.engines.vllm.search_nvfp4.SUPPORTED_DTYPES` (NVFP4 outer scales and q_scale, per tensor only)."""
    from kvcal.engines.vllm.dtypes import VllmDTypeError, vllm_dtype
    from kvcal.engines.vllm.search_fp8 import SUPPORTED_DTYPES
    from kvcal.engines.vllm.search_nvfp4 import SUPPORTED_DTYPES as NVFP4_DTYPES

    if engine != "vllm":
        if engine is None:
            raise KvcalError(f"--kv-cache-dtype {kv_cache_dtype} applies with --engine vllm; add --engine vllm")
        raise KvcalError(f"--engine {engine!r}: kvcal calibrates for vllm only; use --engine vllm or drop --engine")
    if kv_cache_dtype is None:
        raise KvcalError("--engine vllm needs --kv-cache-dtype (the dtype vLLM will run), e.g. --kv-cache-dtype fp8")
    try:
        vllm_dtype(kv_cache_dtype)
    except VllmDTypeError as e:
        raise KvcalError(f"--kv-cache-dtype: {e}") from None
    if kv_cache_dtype not in SUPPORTED_DTYPES + NVFP4_DTYPES:
        raise KvcalError(f"--kv-cache-dtype {kv_cache_dtype}: kvcal calibrate --engine vllm calibrates "
                         f"{'/'.join(SUPPORTED_DTYPES + NVFP4_DTYPES)} scales; measure {kv_cache_dtype} with kvcal "
                         f"evaluate --vllm-dtype {kv_cache_dtype}")
    if kv_cache_dtype in NVFP4_DTYPES:
        extra = [o for o, v in (("--bits", bits is not None), ("--preset", preset is not None),
                                ("--format", fmt is not None), ("--granularity head", granularity == "head")) if v]
        if extra:
            raise KvcalError(f"{', '.join(extra)} conflict{'s' if len(extra) == 1 else ''} with --engine vllm "
                             f"--kv-cache-dtype {kv_cache_dtype}, which stores NVFP4 blocks with one static outer "
                             f"scale per layer and side (vLLM loads per-tensor scales only); drop "
                             f"{'it' if len(extra) == 1 else 'them'}")
        return
    extra = [o for o, v in (("--bits", bits is not None), ("--preset", preset not in (None, "fp8")),
                            ("--format", fmt not in (None, "fp8_e4m3"))) if v]
    if extra:
        raise KvcalError(f"{', '.join(extra)} conflict{'s' if len(extra) == 1 else ''} with --engine vllm "
                         f"--kv-cache-dtype {kv_cache_dtype}, which stores static fp8_e4m3 scales; drop "
                         f"{'it' if len(extra) == 1 else 'them'}")


def check_options(cfg) -> dict:
    """The checks of a :class:`kvcal.calibrate.CalibrateConfig` whose vLLM options are given (``engine``,
    ``kv_cache_dtype``, ``backend``, ``skip_layers``/``max_skip``/``max_bytes_per_token``), in this order:
    :func:`check_engine_options`, the backend (normalized: ``vllm-cpu`` -> ``cpu``; it must serve the dtype; no
    per-head scales on ``cpu``), then ``--skip-layers`` (parsed: :func:`kvcal.search.skip_layers.parse_skip_layers`,
    and :func:`kvcal.engines.vllm.skip.check_skip_config`). Also run with ``cfg.engine`` None, when only the
    engine's options are given: it names what to add. Returns the normalized values to set on the (frozen) config,
    ``{"backend": str, "skip_layers": ...}`` for those given. Raises :class:`~kvcal.errors.KvcalError`."""
    from kvcal.engines.vllm.dtypes import VllmDTypeError, check_backend_serves, vllm_backend

    out: dict = {}
    if cfg.engine is not None or cfg.kv_cache_dtype is not None:
        check_engine_options(cfg.engine, cfg.kv_cache_dtype, cfg.preset, cfg.bits, cfg.format, cfg.granularity)
    if cfg.backend is not None:
        if cfg.engine != "vllm":
            raise KvcalError("--backend applies with --engine vllm --kv-cache-dtype fp8; add them or drop --backend")
        try:
            out["backend"] = vllm_backend(cfg.backend).name
            check_backend_serves(out["backend"], cfg.kv_cache_dtype)
        except VllmDTypeError as e:
            raise KvcalError(f"--backend: {e}") from None
        if out["backend"] == "cpu" and cfg.granularity == "head":
            raise KvcalError("--granularity head: vLLM's CPU backend reads one k_scale/v_scale per layer "
                             "(layer._k_scale_float); drop --granularity head for --backend cpu")
    if cfg.skip_layers is not None or cfg.max_skip is not None or cfg.max_bytes_per_token is not None:
        from kvcal.engines.vllm.skip import check_skip_config
        from kvcal.search.skip_layers import parse_skip_layers

        out["skip_layers"] = parse_skip_layers(cfg.skip_layers)
        check_skip_config(cfg.engine, cfg.kv_cache_dtype, out["skip_layers"], cfg.max_skip, cfg.max_bytes_per_token)
    return out


def check_model(cfg, model_config) -> None:
    """The checks that need the model's config (``model_config``: a transformers config), run before the weights
    load: a head_dim the dtype cannot store (nvfp4: a multiple of 16), then the ``--skip-layers`` range and byte
    budget (:func:`kvcal.engines.vllm.skip.check_skip_model`). Raises :class:`~kvcal.errors.KvcalError`."""
    from kvcal.engines.vllm.dtypes import VllmDTypeError, check_head_dim
    from kvcal.formats.memory import model_shape

    try:
        check_head_dim(cfg.kv_cache_dtype, model_shape(model_config).head_dim)
    except VllmDTypeError as e:
        raise KvcalError(f"--kv-cache-dtype {cfg.kv_cache_dtype}: {e}; choose fp8") from None
    if cfg.skip_layers is not None:  # layer range and byte budget are known from the config alone
        from kvcal.engines.vllm.skip import check_skip_model

        check_skip_model(cfg.skip_layers, cfg.kv_cache_dtype, model_config, cfg.max_skip, cfg.max_bytes_per_token)


def cache_write(cfg) -> str:
    """The FP8 cache write the static scales are searched for (:data:`kvcal.formats.fp8.CACHE_WRITES`):
    ``truncating`` on vLLM's CPU backend, ``saturating`` (the GPU kernels) otherwise."""
    return "truncating" if (cfg.backend or "cuda") == "cpu" else "saturating"


def search(cfg, cap, mmeta: dict, progress: bool) -> tuple[list[dict], object, list[dict]]:
    """The scale search of ``--engine vllm --kv-cache-dtype D`` on capture ``cap``
    (:class:`~kvcal.capture.run.CaptureResult`): NVFP4 outer scales and q_scale for an nvfp4 dtype
    (:func:`kvcal.engines.vllm.search_nvfp4.search_vllm_nvfp4`), else FP8 k/v/q scales for ``cfg.backend``
    (:func:`kvcal.engines.vllm.search_fp8.search_vllm_fp8`). Returns ``(rows, plan, layers_meta)``: the search's
    per-layer rows, the artifact's :class:`~kvcal.plan.KVPlan` and its ``layers`` metadata."""
    from kvcal.engines.vllm.dtypes import vllm_dtype

    if vllm_dtype(cfg.kv_cache_dtype).family == "nvfp4":  # outer scales (kvcal.engines.vllm.search_nvfp4)
        from kvcal.engines.vllm import search_nvfp4

        rows = search_nvfp4.search_vllm_nvfp4(cap, cfg.max_queries, progress)
        plan, layers_meta = search_nvfp4.plan_from_rows(rows)
        return rows, plan, layers_meta
    from kvcal.engines.vllm.search_fp8 import search_vllm_fp8
    from kvcal.search.fp8 import plan_from_choices

    # k/v/q scales for vLLM's FP8 queries (kvcal.engines.vllm.search_fp8)
    rows = search_vllm_fp8(cap, cfg.granularity == "head", cfg.max_queries, progress, backend=cfg.backend or "cuda")
    plan, layers_meta = plan_from_choices(rows, cfg.format, cfg.granularity, mmeta["num_kv_heads"])
    return rows, plan, layers_meta


def add_to_artifact(cfg, rows: list[dict], tensors: dict, meta: dict, model, mmeta: dict, probe: Callable,
                    progress: bool, log: Callable[[str], None]) -> None:
    """The ``vllm`` metadata section and q_scale / NVFP4 outer-scale tensors of the artifact being written
    (:func:`kvcal.engines.vllm.search_fp8.add_to_artifact`, :func:`kvcal.engines.vllm.search_nvfp4.add_to_artifact`),
    then the 16-bit layers of ``--skip-layers`` (:func:`kvcal.engines.vllm.skip.choose_skip_layers_for_artifact`).
    ``probe()``: the calibration's held-out probe (its ``samples``, ``meta`` and ``why_empty``), asked only for
    ``--skip-layers auto``. Mutates ``tensors`` and ``meta``."""
    from kvcal.engines.vllm.dtypes import vllm_dtype
    from kvcal.engines.vllm.skip import choose_skip_layers_for_artifact

    if vllm_dtype(cfg.kv_cache_dtype).family == "nvfp4":
        from kvcal.engines.vllm import search_nvfp4

        search_nvfp4.add_to_artifact(rows, tensors, meta, cfg.kv_cache_dtype)
    else:
        from kvcal.engines.vllm.search_fp8 import add_to_artifact as add_fp8

        add_fp8(rows, tensors, meta, cfg.kv_cache_dtype, cfg.granularity == "head", mmeta["num_kv_heads"],
                cfg.backend or "cuda")
    pr = probe() if cfg.skip_layers == "auto" else None  # the probe reads the scales just calibrated
    if pr is not None and not pr.samples:
        raise KvcalError(f"--skip-layers auto: {pr.why_empty}, or name the layers (--skip-layers 0,1,...)")
    if cfg.skip_layers is not None:  # --skip-layers: the 16-bit layers, recorded in meta["vllm"]
        choose_skip_layers_for_artifact(model, pr.samples if pr else [], pr.meta if pr else {}, tensors, meta,
                                        cfg.skip_layers, cfg.max_skip, cfg.max_bytes_per_token,
                                        progress=progress, log=log)


__all__ = ["check_engine_options", "check_options", "check_model", "cache_write", "search", "add_to_artifact"]
