"""The calibration job: corpus → capture → scale search (K and V separately) → artifact.

``calibrate(CalibrateConfig)`` is what ``kvcal calibrate`` runs; this module orchestrates the stages
and assembles the artifact metadata. The stages live in their own modules:

1. inputs: the model and tokenizer (offline, :mod:`kvcal.models`) and the corpus (chat template
   applied, :mod:`kvcal.corpus`), whose deployment shape is printed;
2. :func:`kvcal.capture.run.split_heldout`: calibration / held-out samples (seeded);
3. :func:`kvcal.capture.run.run_capture`: one forward pass through the decoder layers with the
   attention hook — streaming statistics and two bounded reservoirs of real (q, k, v) sequences
   (data parallel: :mod:`kvcal.capture.distributed`; resumable: :mod:`kvcal.capture.checkpoint`);
4. the search: :mod:`kvcal.search.fp8` (static FP8 scales, K by attention KL, V by attention-output
   error, guarded on held-out), the engine's (``--engine NAME``: ``calibrate_search`` of its facade,
   :mod:`kvcal.engines`; vLLM's k/v/q scales or NVFP4 outer scales) or :mod:`kvcal.search.integer` (integer
   presets and ``--bits`` allocation) — every one returns a :class:`~kvcal.search.result.SearchResult`;
5. the artifact, written atomically (``kv_scales.safetensors`` + ``report.md`` from
   :func:`kvcal.report.markdown.render_report`, :mod:`kvcal.artifact`).

Nothing is written unless the whole run succeeds. Raises :class:`kvcal.errors.KvcalError` (one line)
for bad options, inputs or output locations.
"""

from __future__ import annotations

import datetime as _dt
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvcal import __version__
from kvcal.capture.checkpoint import Checkpointing
from kvcal.capture.distributed import finish_distributed, init_distributed
from kvcal.capture.run import CaptureResult, run_capture, split_heldout
from kvcal.errors import KvcalError
from kvcal.search.fp8 import plan_from_choices, search_scales
from kvcal.search.integer import bits_precheck, search_int
from kvcal.search.result import SearchResult

# The stages live in their own modules (kvcal.capture.run / checkpoint, kvcal.search.fp8 / integer,
# kvcal.report.markdown); import them from there.
__all__ = ["CalibrateConfig", "calibrate", "output_dir", "checkpoint_path", "save_checkpoint", "FORMATS",
           "GRANULARITIES", "PRESET_NAMES"]

FORMATS = ("fp8_e4m3", "fp8_e4m3fnuz", "fp8_e5m2")
GRANULARITIES = ("tensor", "head")
PRESET_NAMES = ("fp8", "int8", "int4", "int2", "k4v2")


@dataclass(frozen=True)
class CalibrateConfig:
    """Options of ``kvcal calibrate`` (defaults in one place).

    ``max_seq_len`` (tokens) caps each sample; ``reservoir`` / ``heldout_reservoir`` bound how many
    captured sequences (each at most ``search_tokens`` tokens) the search sees; ``max_queries`` is
    how many query positions per sequence the attention objectives evaluate.

    ``preset``: ``fp8`` (default: static FP8 scales, ``format``/``granularity`` apply) or an
    integer preset from :data:`kvcal.search.presets.INT_PRESETS` (``int8``, ``int4``, ``int2``,
    ``k4v2``); ``bits``: an average budget in bits per cached element *including* every scale,
    zero point, 16-bit sink and per-layer metadata at ``budget_context`` tokens — per-layer K/V
    formats are then allocated from measured sensitivity (overrides ``preset``).
    ``engine`` (``--engine``): calibrate what that engine serves (:mod:`kvcal.engines`; its facade checks
    ``kv_cache_dtype``, ``backend`` and the 16-bit layers, and runs the search). ``skip_layers`` (``--engine vllm``):
    ``"auto"`` or the layer indices vLLM keeps at 16 bits; ``auto`` chooses them under ``max_skip`` /
    ``max_bytes_per_token`` by a per-layer probe on the ``probe_tokens`` held-out tokens
    (:mod:`kvcal.engines.vllm.skip`); recorded in the ``vllm`` metadata section.
    ``probe_tokens`` (integer paths, ``--skip-layers auto``): tokens of held-out samples (in order; the last one cut to fit;
    calibration samples when there is no held-out split) on which, with ``bits``, each layer's K and
    V are quantized alone to measure the model-level KL that weights the allocation
    (:func:`kvcal.evaluate.side_sensitivity`; ``1 + 2·L`` forward passes over them), and the whole
    plan is run with each sink count of :data:`kvcal.search.integer.SINK_CANDIDATES` to keep the one with the lowest
    model KL (:func:`kvcal.evaluate.plans_kl`; 4 more passes; only when ``sink_tokens`` is ``None``);
    0 allocates on the summed attention-level errors alone and chooses sinks by them.
    ``sink_tokens``: first tokens kept in 16 bits and excluded from statistics (``None``: 0, 1 or 4,
    chosen on held-out data as above; integer paths only). ``residual_window``: recent tokens
    kept in 16 bits by the runtime cache (recorded, counted in the budget; not used by Protocol A).
    ``key_centering``: per-channel key mean for dynamic keys (``auto`` keeps it per head where it
    helps on held-out). ``objective_k``: key objective of the integer search (``kl``,
    ``centered``, ``out``, ``mse``).
    ``device_map``: ``"auto"`` spreads a model that does not fit one device over GPUs and CPU
    (accelerate). ``checkpoint_every``: save the capture state every N batches next to ``out``
    (``<out>.checkpoint.pt``, atomic); ``resume``: continue from it — the artifact is identical to
    an uninterrupted run.
    """

    corpus: str
    out: str | None = None
    model: str | None = None
    max_samples: int | None = 64
    max_seq_len: int = 512
    format: str | None = None  # None: fp8_e4m3 (given explicitly, it is refused on integer paths)
    granularity: str | None = None  # None: tensor
    device: str = "cpu"
    seed: int = 0
    heldout_fraction: float = 0.25
    batch_size: int = 8
    reservoir: int = 8
    heldout_reservoir: int = 4
    search_tokens: int = 512
    max_queries: int = 96
    strict: bool = False
    overwrite: bool = False
    preset: str | None = None  # None: fp8 (given together with ``bits``, refused)
    bits: float | None = None
    sink_tokens: int | None = None
    residual_window: int = 0
    key_centering: str = "auto"
    objective_k: str = "kl"
    budget_context: int = 4096
    probe_tokens: int = 1024
    device_map: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    text_field: str | None = None  # corpus field holding raw text (kvcal.corpus; default: detected)
    messages_field: str | None = None  # corpus field holding the conversation
    split: str | None = None  # dataset split of a save_to_disk / hub corpus
    engine: str | None = None  # "vllm": calibrate what vLLM serves for ``kv_cache_dtype`` (kvcal.engines.vllm)
    kv_cache_dtype: str | None = None  # vLLM --kv-cache-dtype (fp8 / fp8_e4m3: k/v/q scales)
    skip_layers: str | tuple[int, ...] | None = None  # --skip-layers: "auto" or 16-bit layer indices (kvcal.engines.vllm.skip)
    max_skip: int | None = None  # --skip-layers auto: most layers at 16 bits
    max_bytes_per_token: int | None = None  # --skip-layers auto: KV bytes per token, all layers, as vLLM allocates
    backend: str | None = None  # --engine vllm: the attention backend's write path searched (cuda default; cpu)

    def __post_init__(self):
        if self.batch_size < 1:
            raise KvcalError(f"--batch-size must be at least 1, got {self.batch_size}")
        if any(v is not None for v in (self.engine, self.kv_cache_dtype, self.backend, self.skip_layers, self.max_skip,
                                       self.max_bytes_per_token)):  # the engine's options: its facade checks them
            from kvcal.engines import engine, with_attr

            calibrating = with_attr("calibrate_check")  # the engines kvcal calibrates for
            if self.engine is not None and self.engine not in calibrating:
                raise KvcalError(f"--engine {self.engine!r}: kvcal calibrates for {'/'.join(calibrating)} only; use "
                                 f"--engine {calibrating[0]} or drop --engine")
            # with no --engine, the engine that takes these options says what to add
            for name, value in engine(self.engine or calibrating[0]).calibrate_check(self).items():
                object.__setattr__(self, name, value)  # frozen dataclass: normalized backend, parsed skip_layers
        # options given explicitly (not None) are never dropped silently, even when equal to their defaults
        if self.bits is not None and self.preset is not None:
            raise KvcalError(f"--bits {self.bits:g} allocates formats per layer and replaces --preset; give one of them")
        given = "/".join(o for o, v in (("--format", self.format), ("--granularity", self.granularity)) if v is not None)
        if given and (self.bits is not None or self.preset not in (None, "fp8")):
            raise KvcalError(f"{given} appl{'ies' if '/' not in given else 'y'} to --preset fp8 only; "
                             + (f"--preset {self.preset} chooses its own formats" if self.bits is None
                                else f"--bits {self.bits:g} allocates integer formats per layer") + f" (drop {given})")
        for name, default in (("preset", "fp8"), ("format", "fp8_e4m3"), ("granularity", "tensor")):
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)  # frozen dataclass
        if self.out is not None and not str(self.out).strip():
            raise KvcalError("--out is empty; give a directory path, or omit --out for kvcal_out/<model>-<preset>")
        if self.out is not None and Path(self.out).exists() and not Path(self.out).is_dir():
            raise KvcalError(f"--out {self.out} exists and is not a directory; choose a directory path")
        if self.search_tokens < 2:
            raise KvcalError("--search-tokens must be at least 2")
        if self.checkpoint_every < 0:
            raise KvcalError("--checkpoint-every must be >= 0 batches")
        if self.preset not in PRESET_NAMES:
            raise KvcalError(f"--preset {self.preset!r}: choose one of {', '.join(PRESET_NAMES)}")
        if self.bits is not None and not 2.0 <= self.bits <= 16.0:
            raise KvcalError(f"--bits {self.bits}: choose an average between 2 and 16 bits per cached element")
        if self.sink_tokens is not None and self.sink_tokens < 0:
            raise KvcalError("--sinks must be >= 0")
        if self.residual_window < 0:
            raise KvcalError("--residual-window must be >= 0")
        if self.key_centering not in ("auto", "on", "off"):
            raise KvcalError(f"--key-centering {self.key_centering!r}: choose auto, on or off")
        if self.objective_k not in ("kl", "centered", "out", "mse"):
            raise KvcalError(f"objective_k {self.objective_k!r}: choose kl, centered, out or mse")
        if self.probe_tokens < 0:
            raise KvcalError("--probe-tokens must be >= 0 (0: no model-level sensitivity probe)")
        if self.budget_context < 1:
            raise KvcalError(f"--budget-context must be >= 1 token, got {self.budget_context}")
        if self.format not in FORMATS:
            raise KvcalError(f"--format {self.format!r} is not supported by this calibrator; choose one of {', '.join(FORMATS)}")
        if self.granularity not in GRANULARITIES:
            raise KvcalError(f"--granularity {self.granularity!r}: choose one of {', '.join(GRANULARITIES)}")
        if self.max_seq_len < 2:
            raise KvcalError("--max-seq-len must be at least 2 tokens")
        if self.max_samples is not None and self.max_samples < 1:
            raise KvcalError("--max-samples must be at least 1")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise KvcalError("heldout_fraction must be in [0, 1)")
        from kvcal.models import check_device

        check_device(self.device)
        int_path = self.bits is not None or self.preset != "fp8"
        if not int_path:
            ignored = [f for f, on in (("--sinks", self.sink_tokens is not None), ("--residual-window", self.residual_window),
                                       ("--key-centering", self.key_centering != "auto")) if on]
            if ignored:
                raise KvcalError(f"{', '.join(ignored)} appl{'ies' if len(ignored) == 1 else 'y'} to integer presets and "
                                 "--bits only (FP8 quantizes every token with static scales); drop "
                                 f"{'it' if len(ignored) == 1 else 'them'} or choose --preset int8/int4/int2/k4v2")
        if self.sink_tokens is not None and self.sink_tokens >= self.max_seq_len - 1:
            raise KvcalError(f"--sinks {self.sink_tokens} leaves no quantized token in a --max-seq-len "
                             f"{self.max_seq_len} sample; choose fewer sinks (e.g. 4) or a longer --max-seq-len")


def save_checkpoint(path: str, state: dict, inputs: dict | None = None) -> None:
    """Write ``state`` (tensors, numbers, strings, containers only: it must load with ``weights_only=True``)
    to ``path`` atomically; refuses a file there that is not a kvcal checkpoint, or an input
    (:class:`KvcalError`). The writer :func:`calibrate` binds into :class:`Checkpointing`."""
    from kvcal.artifact import write_file_atomically

    write_file_atomically(path, lambda tmp: torch.save(state, tmp), "checkpoint", inputs, KvcalError, "--out",
                          hint="free space or drop --checkpoint-every")


def calibrate(cfg: CalibrateConfig, log: Callable[[str], None] = print, progress: bool = True,
              model=None, tokenizer=None, corpus=None, captures: dict | None = None) -> dict:
    """Run the whole calibration and write the artifact; returns ``{"out", "metadata", "table"}``.

    ``model`` / ``tokenizer``: already-loaded objects for ``cfg.model`` (tests, notebooks);
    loaded offline when None. ``corpus``: ``cfg.corpus`` already checked (:class:`kvcal.inputs.CorpusInput`,
    :mod:`kvcal.api`'s preflight); checked here when None. ``captures``: a dict shared by several calls
    (``kvcal recommend``'s fp8, nvfp4 and per-KV-head calibrations): a capture is reused when everything it
    depends on is equal (the model's weights fingerprint and config, the token ids of every corpus sample, the
    held-out split, the model's shape, batch, reservoirs, search tokens, seed, padding id, the first positions
    left out of the statistics), else run and stored; the searches read a capture and never write it, so the
    artifact's scales are the ones a fresh capture gives (its recorded capture time is the first run's).
    Raises :class:`KvcalError` (bad corpus, model, options, or output location); nothing is written unless the
    whole run succeeds.
    """
    from kvcal.corpus import format_shape, load_corpus
    from kvcal.models import head_dim_of, load_model, load_tokenizer, model_metadata

    int_path = cfg.bits is not None or cfg.preset != "fp8"
    rank, world = init_distributed(cfg.device)
    if rank != 0:
        log, progress = (lambda s: None), False
    out, pre = preflight(cfg, model, corpus)
    torch.manual_seed(cfg.seed)
    tok = tokenizer if tokenizer is not None else load_tokenizer(pre.model.source or cfg.model, vocab_size=pre.model.vocab_size)
    corpus = load_corpus(cfg.corpus, tok, max_seq_len=cfg.max_seq_len, max_samples=cfg.max_samples,
                         strict=cfg.strict, seed=cfg.seed, **pre.corpus.options)
    shape = corpus.shape()
    log(format_shape(shape))
    if model is None:
        model = load_model(pre.model.source or cfg.model, device=cfg.device, device_map=cfg.device_map)
    conf = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    mmeta = model_metadata(model.config, getattr(model, "kvcal_source", None), architecture=type(model).__name__)
    from kvcal.weights import weights_fingerprint

    mmeta["weights"] = weights_fingerprint(model)  # export --model-dir refuses a checkpoint with other weights
    held_idx = split_heldout(len(corpus.samples), cfg.heldout_fraction, cfg.seed)
    log(f"model: {mmeta['id']} ({mmeta['architecture']}, {mmeta['num_layers']} layers, "
        f"{mmeta['num_kv_heads']} KV heads × head_dim {mmeta['head_dim']}); weights: {mmeta['weight_precision']}")
    log(f"split: {len(corpus.samples) - len(held_idx)} calibration / {len(held_idx)} held-out samples (seed {cfg.seed})"
        + (f"; data-parallel over {world} ranks" if world > 1 else ""))
    if int_path:  # fail before the capture when a pre-RoPE preset cannot work on this model
        from kvcal.models import rope_tables
        from kvcal.search.presets import INT_PRESETS, NEEDS_ROPE

        try:
            rope_tables(model)
        except ValueError as e:
            if cfg.bits is None and any(c.transform in NEEDS_ROPE for c in INT_PRESETS[cfg.preset]):
                raise KvcalError(f"--preset {cfg.preset} quantizes keys pre-RoPE, which this model does not "
                                 f"allow: {e}. Use --preset int8 or --bits.") from None
            log(f"pre-RoPE key choices left out of the allocation menu: {e}")
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    skip = (1 if cfg.sink_tokens is None else cfg.sink_tokens) if int_path else 0
    ckpt = None
    if cfg.checkpoint_every or cfg.resume:
        import hashlib
        import json as _json

        fp = {"corpus": corpus.sha256, "model": mmeta["config_sha256"], "skip": skip,
              **{k: getattr(cfg, k) for k in ("max_samples", "max_seq_len", "seed", "heldout_fraction", "batch_size",
                                              "reservoir", "heldout_reservoir", "search_tokens")}}
        ckpt = Checkpointing(checkpoint_path(out), cfg.checkpoint_every, cfg.resume,
                             hashlib.sha256(_json.dumps(fp, sort_keys=True).encode()).hexdigest(), save=save_checkpoint)
    args = dict(num_layers=mmeta["num_layers"], num_kv_heads=mmeta["num_kv_heads"],
                num_q_heads=int(conf.num_attention_heads), head_dim=head_dim_of(conf), batch_size=cfg.batch_size,
                reservoir=cfg.reservoir, heldout_reservoir=cfg.heldout_reservoir, search_tokens=cfg.search_tokens,
                seed=cfg.seed, pad_id=pad, stats_skip_first=skip)
    key = None
    if captures is not None and ckpt is None and world == 1:  # a checkpointed or distributed capture is never shared
        import hashlib

        ids = hashlib.sha256()
        for smp in corpus.samples:
            ids.update(str(smp.numel()).encode() + b":" + smp.to(torch.int64).numpy().tobytes())
        key = (json.dumps(mmeta["weights"], sort_keys=True), mmeta["config_sha256"], ids.hexdigest(),
               tuple(sorted(held_idx)), tuple(sorted(args.items())))
    if key is not None and key in captures:
        cap = captures[key]
        log("capture: reused (the same model, corpus samples and capture settings as an earlier calibration)")
    else:
        cap = run_capture(model, corpus.samples, held_idx, progress=progress, checkpoint=ckpt, **args)
        if key is not None:
            captures[key] = cap
    if rank != 0:
        finish_distributed()
        return {"out": str(out), "rank": rank}
    try:
        res = _search_and_write(cfg, cap, corpus, shape, held_idx, mmeta, out, log, progress, int_path, model)
    finally:
        finish_distributed()
    if ckpt is not None:
        Path(ckpt.path).unlink(missing_ok=True)
    return res


def preflight(cfg: CalibrateConfig, model=None, corpus=None):
    """Every check ``calibrate`` can make before the tokenizer or any weight loads, in one place, each input
    resolved once (:func:`kvcal.inputs.preflight`): the output location (and checkpoint file), the corpus's
    format and fields, the context against the model's maximum, an infeasible ``--bits`` budget, a head_dim the
    vLLM dtype cannot store, the ``--skip-layers`` range and byte budget. Returns ``(out, pre)``: the artifact
    directory and the :class:`kvcal.inputs.Preflight` (model config, shape, maximum positions, vocabulary size;
    the checked corpus and its field options). ``model``: an already-loaded model (its config is used; nothing
    else loads). ``corpus``: the :class:`kvcal.inputs.CorpusInput` :mod:`kvcal.api` checked (not checked
    again). Raises :class:`KvcalError` with a one-line fix."""
    from kvcal.artifact import check_output_dir, check_output_file
    from kvcal.inputs import corpus_input
    from kvcal.inputs import preflight as resolve_inputs
    from kvcal.models import check_max_positions

    out = output_dir(cfg)
    check_output_dir(out, cfg.overwrite, _out_inputs(cfg), KvcalError, kind="artifact")
    corpus = corpus_input(cfg.corpus, corpus, text_field=cfg.text_field, messages_field=cfg.messages_field,
                          split=cfg.split)
    if cfg.checkpoint_every and not cfg.resume:  # its checkpoint file is an output too (--resume checks it on load)
        check_output_file(checkpoint_path(out), "checkpoint", _out_inputs(cfg), KvcalError, "--out")
    # the full config only where a check below reads more than the shape (a GGUF's header suffices otherwise)
    full = cfg.bits is not None or cfg.engine is not None or cfg.skip_layers is not None
    pre = resolve_inputs(cfg.model, corpus, loaded=model, full=full)
    check_max_positions(cfg.max_seq_len, pre.model.max_positions, "--max-seq-len")
    if not full:
        return out, pre
    mconf = pre.model.config
    if cfg.bits is not None:  # an infeasible budget is known from the config alone
        bits_precheck(cfg.bits, mconf, cfg.budget_context, cfg.sink_tokens, cfg.residual_window)
    if cfg.engine is not None:  # the engine's: a head_dim the dtype cannot store, the 16-bit layers' range and bytes
        from kvcal.engines import engine

        engine(cfg.engine).calibrate_preflight(cfg, mconf)
    return out, pre


def output_dir(cfg: CalibrateConfig) -> str:
    """The artifact directory ``cfg`` writes: ``cfg.out``, else ``kvcal_out/<model name>-<tag>`` under the
    current directory, ``<tag>`` being the preset, ``bits<B>``, or the FP8 format family (``fp8``).

    The default is never a directory of committed files: the worked example lives in ``artifacts/``
    (tracked by git) and ``kvcal_out/`` is gitignored; :func:`kvcal.artifact.check_output_dir` also refuses
    any directory git tracks. ``<model name>``: a local directory's or file's name (``.gguf`` stem), else
    the hub id with ``/`` as ``_``."""
    from pathlib import Path

    if cfg.out:
        return str(cfg.out)
    int_path = cfg.bits is not None or cfg.preset != "fp8"
    tag = (f"bits{cfg.bits:g}" if cfg.bits is not None else cfg.preset) if int_path else cfg.format.split("_")[0]
    name = cfg.model or "smollm2-135m"
    p = Path(name).expanduser()
    if p.exists():
        name = p.resolve().stem if p.is_file() else p.resolve().name
    return str(Path("kvcal_out") / f"{name.replace('/', '_')}-{tag}")


def checkpoint_path(out: str) -> str:
    """Where ``--checkpoint-every`` saves the capture state for artifact directory ``out``."""
    return str(out).rstrip("/") + ".checkpoint.pt"


def _channel_ranges(cap: CaptureResult, layers_meta: list[dict]) -> None:
    """Per layer/side per-channel absmax ``[H][D]`` from the calibration statistics (for the report)."""
    for lm in layers_meta:
        i = lm["layer"]
        for side in ("k", "v"):
            lm[side]["channel_absmax"] = getattr(cap.stats, side)[i].finalize()["absmax"].float().tolist()


def _search(cfg, cap, mmeta, progress, log, probe, int_path: bool) -> SearchResult:
    """Run the search the options name: integer presets / ``--bits`` (:func:`search_int`), the engine's
    (``--engine``: vLLM's NVFP4 outer scales or FP8 k/v/q scales), or kvcal's static FP8 scales — one
    :class:`~kvcal.search.result.SearchResult` whichever it is."""
    from kvcal.search.fp8 import static_result

    if int_path:
        return search_int(cap, preset=None if cfg.bits is not None else cfg.preset, bits=cfg.bits,
                          sinks=cfg.sink_tokens, residual_window=cfg.residual_window,
                          key_centering=cfg.key_centering, objective_k=cfg.objective_k,
                          max_queries=cfg.max_queries, budget_context=cfg.budget_context, progress=progress,
                          log=log, probe=probe if cfg.bits is not None else None,
                          sink_probe=probe.plans_kl if probe is not None and cfg.sink_tokens is None else None)
    t1 = time.perf_counter()
    if cfg.engine is not None:  # what the engine reads (kvcal.engines.<name>: calibrate_search)
        from kvcal.engines import engine

        rows, plan, layers_meta = engine(cfg.engine).calibrate_search(cfg, cap, mmeta, progress)
    else:
        rows = search_scales(cap, cfg.format, cfg.granularity == "head", cfg.max_queries, progress)
        plan, layers_meta = plan_from_choices(rows, cfg.format, cfg.granularity, mmeta["num_kv_heads"])
    return static_result(rows, plan, layers_meta, time.perf_counter() - t1)


def _search_and_write(cfg, cap, corpus, shape, held_idx, mmeta, out, log, progress, int_path, model=None) -> dict:
    """Search (:func:`_search`), assemble the artifact's metadata, add the engine's sections (vLLM
    q_scale / NVFP4 outer scales / 16-bit layers), render ``report.md`` and write the artifact."""
    from kvcal.artifact import write_artifact
    from kvcal.report.markdown import console_summary, render_report

    probe = None
    if int_path and cfg.probe_tokens > 0 and (cfg.bits is not None or cfg.sink_tokens is None):
        probe = _held_out_probe(model, corpus, held_idx, cfg.probe_tokens, progress, log)
    res = _search(cfg, cap, mmeta, progress, log, probe, int_path)
    _channel_ranges(cap, res.layers_meta)
    tensors = res.plan.to_tensors()
    common = _calibration_common(cfg, cap, corpus, held_idx)
    if not int_path:  # the cache write the static scales were searched for (kvcal.formats.fp8.CACHE_WRITES)
        common["cache_write"] = "saturating" if cfg.engine is None else _engine(cfg).cache_write(cfg)
    meta = {
        **_meta_head(mmeta, res.plan),
        "calibration": res.calibration_meta(common, bool(held_idx)),
        "corpus": _corpus_meta(corpus, shape),
        "layers": res.layers_meta,
    }
    if cfg.engine is not None:  # the engine's section (vLLM: q_scale / NVFP4 outer scales / 16-bit layers)
        _engine(cfg).calibrate_finish(cfg, res.rows, tensors, meta, model, mmeta,
                                      lambda: _held_out_probe(model, corpus, held_idx, cfg.probe_tokens, progress, log),
                                      progress, log)
    path = write_artifact(out, tensors, meta, extra_files={"report.md": render_report(meta)},
                          overwrite=cfg.overwrite, inputs=_out_inputs(cfg))
    return {"out": str(path), "metadata": meta, "table": console_summary(meta), "config": asdict(cfg),
            "plan": res.plan}


def _engine(cfg):
    """The facade of ``cfg.engine`` (:mod:`kvcal.engines`)."""
    from kvcal.engines import engine

    return engine(cfg.engine)


def _meta_head(mmeta: dict, plan) -> dict:
    """The artifact metadata fields shared by the FP8 and integer paths: version, time, model, kv."""
    return {
        "kvcal_version": __version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "model": mmeta,
        "kv": plan.kv_metadata(),
    }


def _calibration_common(cfg, cap, corpus, held_idx) -> dict:
    """The ``calibration`` metadata fields shared by the FP8 and integer paths. ``error_data`` says what
    the guard and every per-layer "held-out" figure were measured on: the calibration samples when there
    is no held-out split (one sample, or ``heldout_fraction`` 0), never silently called held-out."""
    from kvcal.report.data import error_data_text

    return {
        "seed": cfg.seed, "max_seq_len": cfg.max_seq_len, "heldout_fraction": cfg.heldout_fraction,
        "calib_samples": len(corpus.samples) - len(held_idx), "heldout_samples": len(held_idx),
        "error_data": error_data_text(len(corpus.samples) - len(held_idx), len(held_idx)),
        "reservoir_sequences": {"calib": len(cap.calib.items), "heldout": len(cap.heldout.items)},
        "search_tokens": cfg.search_tokens, "max_queries": cfg.max_queries,
        "capture_seconds": round(cap.seconds, 2), "device": cfg.device,
        "context_regime": f"prefill of samples up to {cfg.max_seq_len} tokens, batch {cfg.batch_size}",
    }


def _corpus_meta(corpus, shape) -> dict:
    return {"path": str(corpus.path), "sha256": corpus.sha256, "format": corpus.format,
            "source": corpus.source, "split": corpus.split, "samples": shape["samples"], "tokens": shape["tokens"],
            "length_percentiles": {k: shape[k] for k in ("p50", "p90", "p99", "max")},
            "truncated": shape["truncated"]}


def _held_out_probe(model, corpus, held_idx, probe_tokens: int, progress: bool, log) -> Callable:
    """The ``probe`` of :func:`search_int`: single-side model KL on held-out samples (in corpus
    order until ``probe_tokens`` is reached, the last one cut to fit; the calibration samples when
    there is no held-out split). Its ``plans_kl`` attribute is the ``sink_probe``: whole-plan model
    KL (:func:`kvcal.evaluate.plans_kl`) on the same samples."""
    from kvcal.evaluate import plans_kl, side_sensitivity

    source = "held-out" if held_idx else "calibration (no held-out split)"
    order = sorted(held_idx) or list(range(len(corpus.samples)))
    picked, n = [], 0
    for i in order:
        room = probe_tokens - n
        if room < 3:  # a sink, one quantized token and one predicted position at least
            break
        x = corpus.samples[i][:room]
        if len(x) >= 3:
            picked.append(x)
            n += len(x)

    # why nothing was picked: the first sample gets all of probe_tokens, so only a budget under 3 tokens or samples
    # all under 3 tokens leave the probe empty — and raising --probe-tokens helps only in the first case
    short = probe_tokens >= 3
    why = (f"every {source} sample is shorter than 3 tokens (a probe needs a sink, a quantized token and a predicted "
           "one); give longer samples" if short else
           f"--probe-tokens {probe_tokens}: no {source} sample of 3 or more tokens fits; raise --probe-tokens")

    def probe(plan):
        if not picked:
            raise KvcalError(f"{why} or use --probe-tokens 0 (no probe)" if short else
                             f"--probe-tokens {probe_tokens}: no {source} sample of 3 or more tokens fits; raise "
                             "--probe-tokens or use 0 (no probe)")
        log(f"sensitivity probe on {len(picked)} {source} samples ({n} tokens; {1 + 2 * plan.num_layers} forward "
            "passes over each)")
        try:
            return side_sensitivity(model, picked, plan, progress=progress)
        except ValueError as e:
            raise KvcalError(f"sensitivity probe: {e}; raise --probe-tokens or use 0 (no probe)") from None

    def sink_probe(plans):
        if not picked:
            raise KvcalError(f"{why}, give --sinks N, or use --probe-tokens 0" if short else
                             f"--probe-tokens {probe_tokens}: no {source} sample of 3 or more tokens fits to choose the "
                             "sink count on; raise --probe-tokens, give --sinks N, or use --probe-tokens 0")
        return plans_kl(model, picked, plans, progress=progress)

    probe.meta = {"source": source, "samples": len(picked), "tokens": n, "probe_tokens": probe_tokens}
    probe.samples = picked  # --skip-layers auto probes these too (kvcal.engines.vllm.skip)
    probe.why_empty = why  # what to fix when picked is empty (not in meta: the artifact records meta)
    sink_probe.meta = {"probe": dict(probe.meta)}
    probe.plans_kl = sink_probe
    return probe


def _out_inputs(cfg) -> dict:
    """Paths ``calibrate`` reads, which its ``--out`` must not be or contain."""
    from pathlib import Path

    return {"--corpus": cfg.corpus, "--model": cfg.model if cfg.model and Path(cfg.model).exists() else None}
