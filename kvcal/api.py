"""kvcal's Python API: a function for each command in the table below, the same work the CLI does, no printing.

Each function takes the command's options as keyword arguments (the CLI's defaults), runs it and
returns its result; bad input raises :class:`kvcal.errors.KvcalError` with a one-line message (the CLI
prints it as ``error: ...``). Every CLI command (:mod:`kvcal.cli`) runs through the function here; the CLI
adds only option parsing and printing.

The preflight: :func:`calibrate`, :func:`evaluate`, :func:`recommend` and :func:`verify` check the corpus first
(:func:`kvcal.inputs.check_corpus_input`, no torch imported: a bad corpus is reported in a fraction of a second),
then the options (the command's config object, or ``config=`` built by the caller), then call
``check_outputs(config)`` when given (the CLI checks its ``--json`` file there), and hand the checked corpus to
the command, whose :func:`kvcal.inputs.preflight` resolves the model once and reads every later answer from it.

======================  =========================================  ==============================
function                CLI                                        returns
======================  =========================================  ==============================
:func:`calibrate`       ``kvcal calibrate``                        ``{"out", "metadata", "table"}``
:func:`evaluate`        ``kvcal evaluate``                         the ``kvcal-eval/1`` document
:func:`export`          ``kvcal export``                           :class:`kvcal.export.ExportResult`
:func:`inspect`         ``kvcal inspect``                          :class:`kvcal.inspect.Inspection`
:func:`report`          ``kvcal report``                           ``{"markdown", "html", "figures"}``
:func:`memory`          ``kvcal memory``                           :class:`MemoryResult`
:func:`capacity`        ``kvcal plan``                             :class:`kvcal.capacity.CapacityPlan`
:func:`recommend`       ``kvcal recommend``                        the ``kvcal-recommend/1`` document
:func:`verify`          ``kvcal verify``                           the ``kvcal-verify/1`` document
======================  =========================================  ==============================
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from kvcal.errors import KvcalError


def _checked_corpus(corpus, config, options: dict):
    """The preflight's first step, before torch imports: ``corpus`` (or ``config.corpus``) checked with the
    corpus field options of ``config`` or ``options`` (:func:`kvcal.inputs.check_corpus_input`)."""
    from kvcal.inputs import CORPUS_OPTIONS, check_corpus_input

    opts = {k: getattr(config, k) if config is not None else options.get(k) for k in CORPUS_OPTIONS}
    return check_corpus_input(config.corpus if config is not None else corpus, **opts)


def _config(cls, config, check_outputs, **fields):
    """``config`` (built by the caller), else ``cls(**fields)`` (its option checks); then ``check_outputs``."""
    cfg = config if config is not None else cls(**fields)
    if check_outputs is not None:
        check_outputs(cfg)
    return cfg


def calibrate(corpus: str | None = None, *, config=None, log: Callable[[str], None] = print, progress: bool = True,
              model_obj=None, tokenizer=None, check_outputs: Callable | None = None, **options) -> dict:
    """``kvcal calibrate --corpus CORPUS ...``: options are :class:`kvcal.calibrate.CalibrateConfig` fields
    (``out``, ``model``, ``preset``, ``bits``, ``engine``, ...), or ``config`` the config itself.
    ``model_obj``/``tokenizer``: already-loaded objects for ``options["model"]``. Writes the artifact
    directory; returns ``{"out", "metadata", "table"}``."""
    checked = _checked_corpus(corpus, config, options)  # before torch imports
    from kvcal.calibrate import CalibrateConfig
    from kvcal.calibrate import calibrate as run

    cfg = _config(CalibrateConfig, config, check_outputs, corpus=corpus, **options)
    return run(cfg, log=log, progress=progress, model=model_obj, tokenizer=tokenizer, corpus=checked)


def evaluate(artifact: str | None = None, corpus: str | None = None, *, config=None,
             log: Callable[[str], None] = print, progress: bool = True, check_outputs: Callable | None = None,
             **options) -> dict:
    """``kvcal evaluate``: options are :class:`kvcal.evaluate.EvalConfig` fields, or ``config`` the config
    itself. Returns the ``kvcal-eval/1`` document (:func:`kvcal.evaluate.to_json` serializes it)."""
    checked = _checked_corpus(corpus, config, options)  # before torch imports
    from kvcal.evaluate import EvalConfig
    from kvcal.evaluate import evaluate as run

    cfg = _config(EvalConfig, config, check_outputs, artifact=artifact, corpus=corpus, **options)
    return run(cfg, log=log, progress=progress, corpus=checked)


def export(artifact: str, target: str, out: str, **options):
    """``kvcal export``: :func:`kvcal.export.export` (``model_dir``, ``tp``, ``headroom``, ``overwrite``,
    ``clipped_scales``, ``clip_free``). Writes ``out`` atomically; returns its :class:`~kvcal.export.ExportResult`."""
    from kvcal.export import export as run

    return run(artifact, target, out, **options)


def inspect(path: str, tp: int | None = None):
    """``kvcal inspect PATH``: what an artifact, export or checkpoint holds and what each engine would load
    (:func:`kvcal.inspect.inspect_path`; :func:`kvcal.inspect.render` prints it). Reads only."""
    from kvcal.inspect import inspect_path

    return inspect_path(path, tp=tp)


def report(artifact: str, eval_json: str | dict | None = None, out: str | None = None) -> dict:
    """``kvcal report``: render report.md (+ figures) and report.html for an artifact
    (:func:`kvcal.report.disclosure.write_report`); returns ``{"markdown", "html", "figures"}`` paths."""
    from kvcal.report.disclosure import write_report

    return write_report(artifact, eval_json, out)


def capacity(model: str, gpu_mem: str | int, **options):
    """``kvcal plan``: max context per concurrency for 16-bit and each cache precision. ``options``:
    :class:`kvcal.capacity.PlanConfig` fields besides ``gpu_mem`` (``weights_dtype``, ``reserve``,
    ``kv_configs``, ``params``). No weights are loaded."""
    from kvcal.capacity import PlanConfig, load_config, plan_capacity

    return plan_capacity(load_config(model), PlanConfig(gpu_mem=gpu_mem, **options), model_id=model)


def recommend(corpus: str | None = None, engine: str | None = None, out: str | None = None, *, config=None,
              log: Callable[[str], None] = print, progress: bool = True, check_outputs: Callable | None = None,
              **options) -> dict:
    """``kvcal recommend``: options are :class:`kvcal.recommend.RecommendConfig` fields, or ``config`` the config
    itself. Writes ``out`` (deploy.md, deploy.json, the artifact); returns the ``kvcal-recommend/1`` document."""
    checked = _checked_corpus(corpus, config, options)  # before torch imports
    from kvcal.recommend import RecommendConfig
    from kvcal.recommend import recommend as run

    cfg = _config(RecommendConfig, config, check_outputs, corpus=corpus, engine=engine, out=out, **options)
    return run(cfg, log=log, progress=progress, corpus=checked)


def verify(checkpoint: str | None = None, corpus: str | None = None, engine_python: str | None = None, *,
           config=None, log: Callable[[str], None] = print, check_outputs: Callable | None = None,
           **options) -> dict:
    """``kvcal verify``: serve ``checkpoint`` in the engine (its own interpreter ``engine_python``) and compare
    with kvcal's prediction; options are :class:`kvcal.verify.VerifyConfig` fields (``skip_layers`` also as
    the ``--skip-layers`` string), or ``config`` the config itself. Returns the ``kvcal-verify/1`` document
    (``doc["passed"]``)."""
    checked = _checked_corpus(corpus, config, options)  # before torch imports
    from kvcal.verify import VerifyConfig
    from kvcal.verify import verify as run

    cfg = _config(VerifyConfig, config, check_outputs, checkpoint=checkpoint, corpus=corpus,
                  engine_python=engine_python, **options)
    return run(cfg, log=log, corpus=checked)


@dataclass(frozen=True)
class MemoryResult:
    """What ``kvcal memory`` prints. ``shape``: :class:`kvcal.formats.memory.ModelShape`; ``context``
    (tokens) and ``batch`` (sequences) of the total; ``bytes_16bit``: 16-bit K+V bytes per token.
    kvcal formats: ``kv`` (:class:`kvcal.formats.spec.KVCacheConfig`) and ``report``
    (:class:`kvcal.formats.memory.MemoryReport`). ``vllm:<dtype>``: ``vllm`` = ``{"dtype", "version",
    "skip_layers", "bytes_per_token", "total", "block_size"}`` (pages as vLLM allocates them). ``engine``: the
    allocation of an engine that sizes its own cache (``llamacpp:<types>``: that engine's ``kv_memory`` dict). ``peak``:
    ``(bytes, tokens)`` where the cache needs more on the way to ``context`` than at it (sliding-window layers
    with token-group keys, :func:`kvcal.formats.memory.peak_cache_bytes`), else ``None``."""

    model: str
    format: str
    shape: object
    context: int
    batch: int
    bytes_16bit: int
    kv: object = None
    report: object = None
    vllm: dict | None = None
    peak: tuple | None = None
    engine: dict | None = None

    def to_dict(self) -> dict:
        """The ``kvcal memory --json`` document."""
        if self.engine is not None:
            return {"model_id": self.model, "format": self.format, "context": self.context, "batch": self.batch,
                    "bytes_16bit_per_token": self.bytes_16bit, **{k: v for k, v in self.engine.items()}}
        if self.vllm is not None:
            v = self.vllm
            return {"model_id": self.model, "format": self.format, "vllm_version": v["version"],
                    "skip_layers": v["skip_layers"], "context": self.context, "batch": self.batch,
                    "block_size": v["block_size"], "bytes_per_token": v["bytes_per_token"],
                    "bytes": {"total": v["total"]}}
        doc = {"model_id": self.model, "format": self.format, **self.report.to_dict()}
        if self.peak is not None:
            doc["peak"] = {"bytes": self.peak[0], "context": self.peak[1]}
        return doc


def model_shape_of(model: str):
    """:class:`kvcal.formats.memory.ModelShape` of ``model``: a ``config.json`` file (read with the checked
    reader, :func:`kvcal.export.checkpoint_json.read_config`), or anything
    :func:`kvcal.models.load_model_config` takes (no weights load). Raises :class:`KvcalError`."""
    from kvcal.formats.memory import model_shape

    p = Path(model).expanduser()
    try:
        if p.suffix == ".json" and p.is_file():
            from kvcal.export.checkpoint_json import read_config

            return model_shape(read_config(p))
        from kvcal.models import gguf_config_fields, load_model_config

        return model_shape(gguf_config_fields(model) or load_model_config(model))
    except ValueError as e:
        raise KvcalError(f"{model}: {e}") from None


def memory(model: str = "smollm2-135m", fmt: str = "fp8", *, granularity: str | None = None,
           group_size: int | None = None, symmetric: bool | None = None, residual_window: int = 0, sinks: int = 0,
           context: int | None = None, batch: int = 1, skip_layers: str | None = None) -> MemoryResult:
    """``kvcal memory``: exact KV-cache bytes for ``model`` stored as ``fmt`` — a preset / named layout
    (:func:`kvcal.search.presets.named_cache_config`), a storage format applied to K and V (``int4``,
    ``fp8_e4m3fnuz``, ...; ``granularity``/``group_size``/``symmetric`` override), or ``vllm:<dtype>`` (the
    pages vLLM 0.33 allocates; ``skip_layers``: comma-separated layer indices kept at 16 bits). ``context``
    (tokens; default the model's max positions) and ``batch`` (sequences) size the total. Raises
    :class:`KvcalError` (one line) for a bad format, option combination or model."""
    try:
        return _memory(model, fmt, granularity, group_size, symmetric, residual_window, sinks, context, batch,
                       skip_layers)
    except (ValueError, json.JSONDecodeError, OSError) as e:
        raise KvcalError(str(e)) from None


def _memory(model, fmt, granularity, group_size, symmetric, residual_window, sinks, context, batch, skip_layers):
    from kvcal.engines import with_attr
    from kvcal.formats.granularity import granularity_from_name
    from kvcal.formats.memory import memory_report, peak_cache_bytes
    from kvcal.formats.spec import KVCacheConfig, TensorQuantSpec
    from kvcal.search.presets import named_cache_config

    shape = model_shape_of(model)
    b16 = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 2
    engine_name, colon, engine_dtype = fmt.partition(":")
    if colon and engine_name in with_attr("kv_memory"):  # <engine>:<types>: an engine that sizes its own cache
        given = [name for name, v in (("--granularity", granularity is not None),
                                      ("--group-size", group_size is not None),
                                      ("--symmetric/--asymmetric", symmetric is not None),
                                      ("--residual-window", bool(residual_window)), ("--sinks", bool(sinks)),
                                      ("--skip-layers", skip_layers is not None)) if v]
        if given:
            raise ValueError(f"{', '.join(given)}: not with --format {fmt}: its cache types fix the layout (blocks "
                             "of 32 with their own scale, every layer, no 16-bit window); drop them")
        return _memory_sized_by_engine(engine_name, model, shape, engine_dtype, context, batch, b16)
    if colon and engine_name in with_attr("cache_bytes"):  # <engine>:<dtype>: the pages that engine allocates
        given = [name for name, v in (("--granularity", granularity is not None),
                                      ("--group-size", group_size is not None),
                                      ("--symmetric/--asymmetric", symmetric is not None),
                                      ("--residual-window", bool(residual_window)), ("--sinks", bool(sinks))) if v]
        if given:
            raise ValueError(f"{', '.join(given)}: not with --format {fmt}: vLLM's --kv-cache-dtype fixes the page "
                             "layout (no residual window or sink tokens kept at 16 bits), so the bytes printed would "
                             "leave them out; drop them (--skip-layers names the layers vLLM keeps at 16 bits)")
        return _memory_engine(engine_name, model, shape, engine_dtype, skip_layers, context, batch, b16)
    if skip_layers is not None:
        raise ValueError("--skip-layers applies to vllm:<dtype> formats only (e.g. --format vllm:fp8)")
    if group_size is not None and group_size < 1:
        raise ValueError(f"--group-size must be >= 1 channels/tokens, got {group_size}")
    named = named_cache_config(fmt)
    if named is not None:
        cfg = named
    else:
        kind_int = fmt.startswith("int")
        gran = granularity or ("token_group" if kind_int else "tensor")
        side = TensorQuantSpec(fmt, granularity_from_name(gran, group_size), symmetric=not kind_int)
        cfg = KVCacheConfig(side, side)
    if (granularity is not None or group_size is not None) and "nvfp4" in (cfg.key.format.value, cfg.value.format.value):
        raise ValueError("--granularity / --group-size do not apply to nvfp4: its 16-element blocks along head_dim "
                         "with e4m3 block scales are fixed by the format (NVIDIA); drop them")
    sides = []
    for s in (cfg.key, cfg.value):
        if s.is_quantized and granularity is not None and s.format.value != "nvfp4":
            s = replace(s, granularity=granularity_from_name(granularity, group_size), scale_dtype=None)
        elif group_size is not None:
            s = s.with_group_size(group_size)
        if symmetric is not None and s.format.kind == "int":
            s = replace(s, symmetric=symmetric)
        sides.append(s)
    cfg = replace(cfg, key=sides[0], value=sides[1], residual_window=residual_window, sink_tokens=sinks)
    ctx = context if context is not None else shape.max_position_embeddings
    if ctx is None:
        raise ValueError("the model config has no max_position_embeddings; pass --context")
    if context is not None:
        from kvcal.models import check_max_positions

        check_max_positions(context, shape.max_position_embeddings, "--context")
    too_long = [sp.granularity.group_size for sp in (cfg.key, cfg.value)
                if getattr(sp.granularity, "name", "") == "channel_token_group" and sp.granularity.group_size > ctx]
    if too_long:
        raise ValueError(f"a key group of {too_long[0]} tokens is longer than --context {ctx}: such a cache never "
                         "closes a group; choose --group-size <= the context")
    rep = memory_report(shape, cfg, ctx, batch)
    peak = peak_cache_bytes(shape, cfg, ctx, batch)
    return MemoryResult(model, fmt, shape, ctx, batch, b16, kv=cfg, report=rep,
                        peak=peak if peak[0] > rep.total else None)


def _memory_sized_by_engine(name, model, shape, spec, context, batch, b16) -> MemoryResult:
    """``kvcal memory --format <engine>:<spec>`` for an engine whose facade sizes its cache (``kv_memory``:
    llama.cpp, :func:`kvcal.engines.llamacpp.plan.kv_memory`). ``context`` defaults to the model's max positions;
    a longer one is allowed (llama.cpp allocates it and warns) and noted."""
    from kvcal.engines import engine

    ctx = context if context is not None else shape.max_position_embeddings
    if ctx is None:
        raise ValueError("the model config has no max_position_embeddings; pass --context")
    if batch < 1 or ctx < 1:
        raise ValueError(f"--batch and --context must be >= 1, got {batch} and {ctx}")
    alloc = engine(name).kv_memory(shape, spec, ctx, batch)
    if shape.max_position_embeddings is not None and ctx > shape.max_position_embeddings:
        alloc["note"] = (f"context {ctx} is past the model's {shape.max_position_embeddings} trained positions: "
                         f"{alloc['engine']} allocates it (and warns); quality there is not the model's")
    return MemoryResult(model, f"{name}:{spec}", shape, ctx, batch, b16, engine=alloc)


def _memory_engine(name, model, shape, dtype, skip_layers, context, batch, b16) -> MemoryResult:
    """``kvcal memory --format <engine>:<dtype>`` (``vllm:fp8``): the pages engine ``name`` allocates (its facade,
    :mod:`kvcal.engines`: ``bytes_per_token``, ``cache_bytes``, ``boundary_skip_layers``; vLLM 0.33's,
    :mod:`kvcal.engines.vllm.memory`). Raises ValueError (the engine's ``DTypeError`` for an unknown dtype)."""
    from kvcal.engines import engine

    eng = engine(name)
    eng.dtype(dtype)
    from kvcal.options import split_list

    skip = []
    for tok in (split_list(skip_layers, "--skip-layers", "layer index", "0,1,29", item="layer") if skip_layers is not None else ()):
        try:
            skip.append(int(tok))
        except ValueError:
            raise ValueError(f"--skip-layers takes comma-separated layer indices, got {tok!r}") from None
    ctx = context if context is not None else shape.max_position_embeddings
    if ctx is None:
        raise ValueError("the model config has no max_position_embeddings; pass --context")
    if context is not None:  # the same check as the other formats: vLLM refuses a max_model_len past it too
        from kvcal.models import check_max_positions

        check_max_positions(context, shape.max_position_embeddings, "--context")
    if batch < 1 or ctx < 0:
        raise ValueError(f"--batch must be >= 1 and --context >= 0, got {batch} and {ctx}")
    bpt = eng.bytes_per_token(shape, dtype, skip)
    total = eng.cache_bytes(shape, dtype, ctx, batch, skip_layers=skip)
    all_skip = sorted(set(skip) | set(eng.boundary_skip_layers(dtype, shape.num_layers)))
    return MemoryResult(model, f"{name}:{dtype}", shape, ctx, batch, b16,
                        vllm={"dtype": dtype, "version": eng.VERSION, "skip_layers": all_skip, "bytes_per_token": bpt,
                              "total": total, "block_size": 16})
