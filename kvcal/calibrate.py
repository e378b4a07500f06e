"""The main job: corpus → capture → static scale search (K and V separately) → artifact.

``calibrate(CalibrateConfig)`` is what ``kvcal calibrate`` runs. Steps:

1. load the model and tokenizer (offline) and the corpus (chat template applied), print its
   deployment shape;
2. split samples into a calibration part and a held-out part (seeded);
3. one forward pass through the decoder layers (no LM head) with the attention hook: streaming
   statistics over every calibration token and two bounded reservoirs of real (q, k, v)
   sequences (calibration and held-out);
4. per layer, choose the K scale by attention KL and the V scale by attention-output error,
   never worse than absmax or unity on the held-out part;
5. write the artifact atomically (``kv_scales.safetensors`` + ``report.md``).
"""

from __future__ import annotations

import datetime as _dt
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kvcal import __version__
from kvcal.capture.hooks import attention_scaling, capture_kv
from kvcal.capture.reservoir import SequenceReservoir
from kvcal.capture.stats import LayerStats
from kvcal.errors import KvcalError

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
    ``probe_tokens`` (integer paths): tokens of held-out samples (in order; the last one cut to fit;
    calibration samples when there is no held-out split) on which, with ``bits``, each layer's K and
    V are quantized alone to measure the model-level KL that weights the allocation
    (:func:`kvcal.evaluate.side_sensitivity`; ``1 + 2·L`` forward passes over them), and the whole
    plan is run with each sink count of :data:`SINK_CANDIDATES` to keep the one with the lowest
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
    engine: str | None = None  # "vllm": calibrate what vLLM serves for ``kv_cache_dtype`` (kvcal.search.vllm_fp8)
    kv_cache_dtype: str | None = None  # vLLM --kv-cache-dtype (fp8 / fp8_e4m3: k/v/q scales)

    def __post_init__(self):
        if self.batch_size < 1:
            raise KvcalError(f"--batch-size must be at least 1, got {self.batch_size}")
        if self.engine is not None or self.kv_cache_dtype is not None:
            from kvcal.search.vllm_fp8 import check_engine_options

            check_engine_options(self.engine, self.kv_cache_dtype, self.preset, self.bits, self.format)
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


@dataclass
class CaptureResult:
    """What one capture pass produced (all on CPU)."""

    stats: LayerStats
    calib: SequenceReservoir
    heldout: SequenceReservoir
    scaling: dict[int, float] = field(default_factory=dict)
    seconds: float = 0.0
    tokens: int = 0
    sink_stats: LayerStats | None = None  # statistics without the first tokens (see run_capture)
    rope: object = None  # the model's RopeTable, set by calibrate() for pre-RoPE key choices


#: Sink-token counts ``search_int`` chooses from when ``sinks`` is not given: none, the first token
#: (the BOS / attention-sink position), or StreamingLLM's four initial tokens (Xiao et al., "Efficient
#: Streaming Language Models with Attention Sinks", ICLR 2024). Each costs ``2·L·H·D`` 16-bit values
#: (counted in the average bits); at 4096 tokens four sinks add about 0.009 bit to an int4 cache.
SINK_CANDIDATES = (0, 1, 4)


def split_heldout(n: int, fraction: float, seed: int) -> set[int]:
    """Indices of held-out samples: ``round(n·fraction)`` (at least 1 when n ≥ 2 and fraction > 0)."""
    if n < 2 or fraction <= 0:
        return set()
    k = min(n - 1, max(1, round(n * fraction)))
    g = torch.Generator().manual_seed(seed)
    return set(torch.randperm(n, generator=g)[:k].tolist())


def _batches(samples: list[torch.Tensor], batch_size: int, max_batch_tokens: int | None = None) -> list[list[int]]:
    """Sample indices grouped by similar length (less padding), in a deterministic order.

    A batch holds at most ``batch_size`` samples and, when ``max_batch_tokens`` is set, at most
    that many padded tokens (long samples, e.g. 8192 tokens, then go one per batch). The list
    depends only on the samples, so data-parallel ranks and resumed runs see the same batches.
    """
    order = sorted(range(len(samples)), key=lambda i: (len(samples[i]), i))
    out, cur = [], []
    for i in order:
        L = len(samples[i])  # sorted ascending: the new sample is the longest of the batch
        if cur and (len(cur) >= batch_size or (max_batch_tokens and L * (len(cur) + 1) > max_batch_tokens)):
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


@dataclass(frozen=True)
class Checkpointing:
    """Resumable capture: save every ``every`` batches to ``path`` (atomic), ``resume`` from it.

    ``fingerprint`` identifies the run (corpus sha256, model config hash, options that change
    what is captured); a checkpoint with another fingerprint is refused.
    """

    path: str
    every: int = 0
    resume: bool = False
    fingerprint: str = ""


def _save_checkpoint(ck: Checkpointing, state: dict, inputs: dict | None = None) -> None:
    """Write ``state`` (tensors, numbers, strings, containers only: it must load with ``weights_only=True``)
    to ``ck.path`` atomically; refuses a file there that is not a kvcal checkpoint, or an input."""
    from kvcal.artifact import write_file_atomically

    write_file_atomically(ck.path, lambda tmp: torch.save(state, tmp), "checkpoint", inputs, KvcalError, "--out",
                          hint="free space or drop --checkpoint-every")


def _load_checkpoint(ck: Checkpointing) -> dict:
    """The capture state saved at ``ck.path``, after checking it is a kvcal checkpoint of this run.

    Loaded with ``torch.load(weights_only=True)``: only tensors, numbers, strings and containers are
    rebuilt, so a planted file cannot run code (``weights_only=False`` would unpickle anything); its
    ``fingerprint`` is compared before any of its state is used. Raises :class:`KvcalError` (one line)."""
    from pathlib import Path

    p = Path(ck.path)
    if not p.exists():
        raise KvcalError(f"--resume: no checkpoint at {p}; run without --resume (add --checkpoint-every N to make one)")
    try:
        st = torch.load(p, weights_only=True, map_location="cpu")
    except Exception as e:  # UnpicklingError for any object that is not plain data; others for damaged files
        raise KvcalError(f"--resume: {p} is not a kvcal checkpoint (it does not load as plain tensors and numbers: "
                         f"{type(e).__name__}; nothing in it was run); delete it and start over") from None
    if not isinstance(st, dict) or not isinstance(st.get("fingerprint"), str):
        raise KvcalError(f"--resume: {p} is not a kvcal checkpoint (no run fingerprint); delete it and start over")
    if st["fingerprint"] != ck.fingerprint:
        raise KvcalError(f"--resume: checkpoint {p} belongs to a different run (corpus, model or options changed); "
                         "delete it or restore the original options")
    return st


def _restore_checkpoint(ck: dict, path: str, n_batches: int, result, res_c, res_h) -> tuple[int, object]:
    """Restore the capture state from checkpoint dict ``ck`` (already identified by :func:`_load_checkpoint`)
    into ``result`` and the reservoirs; returns ``(next batch, stats)``. A state of the wrong shape or type
    raises :class:`KvcalError` naming the checkpoint, never a traceback later in the run."""
    try:
        start = ck["next_batch"]
        if not isinstance(start, int) or isinstance(start, bool) or not 0 < start < n_batches:
            raise ValueError(f"next_batch {start!r} is not a batch index in 1..{n_batches - 1}")
        if not isinstance(ck["tokens"], int) or not isinstance(ck["rng"], torch.Tensor):
            raise ValueError("tokens / rng have the wrong type")
        stats = LayerStats.from_state_dict(ck["stats"])
        sink_stats = LayerStats.from_state_dict(ck["sink_stats"]) if ck.get("sink_stats") is not None else None
        res_c.load_state_dict(ck["calib"])
        res_h.load_state_dict(ck["heldout"])
        scaling = {int(k): float(v) for k, v in dict(ck["scaling"]).items()}
        torch.set_rng_state(ck["rng"])
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as e:
        raise KvcalError(f"--resume: checkpoint {path} is malformed ({type(e).__name__}: {e}); delete it and start "
                         "over") from None
    result.stats = stats
    if sink_stats is not None:
        result.sink_stats = sink_stats
    result.scaling.update(scaling)
    result.tokens = ck["tokens"]
    return start, stats


def _dist_info() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_reduce_capture(result: CaptureResult) -> None:
    """Combine per-rank statistics (MAX/MIN exact, SUM for sums/counts/histograms) and reservoirs
    (gathered, then merged by priority: identical to one process)."""
    import torch.distributed as dist

    def red(ts):
        for t in ts:
            t.absmax, t.max = _ar(t.absmax, dist.ReduceOp.MAX), _ar(t.max, dist.ReduceOp.MAX)
            t.min = _ar(t.min, dist.ReduceOp.MIN)
            t.sum, t.sumsq = _ar(t.sum, dist.ReduceOp.SUM), _ar(t.sumsq, dist.ReduceOp.SUM)
            t.count, t.hist = _ar(t.count, dist.ReduceOp.SUM), _ar(t.hist, dist.ReduceOp.SUM)

    for st in (result.stats, result.sink_stats):
        if st is None:
            continue
        for side in ("q", "k", "v"):
            red(getattr(st, side))
        st.fired = _ar(st.fired, dist.ReduceOp.SUM)
    for res in (result.calib, result.heldout):
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, res.state_dict())
        merged = SequenceReservoir(res.capacity, res.max_tokens, res.seed)
        for sd in gathered:
            other = SequenceReservoir(res.capacity, res.max_tokens, res.seed)
            other.load_state_dict(sd)
            merged.merge(other)
        res.items, res.seen = merged.items, merged.seen
    scal = [None] * dist.get_world_size()
    dist.all_gather_object(scal, result.scaling)
    for d in scal:
        result.scaling.update(d)
    toks = [None] * dist.get_world_size()
    dist.all_gather_object(toks, result.tokens)
    result.tokens = sum(toks)


def _release_freed_memory() -> None:
    """Return freed heap pages to the OS (glibc ``malloc_trim``), once per batch.

    glibc raises its mmap threshold after large blocks are freed, so later activation-sized blocks
    come from the heap and fragment it; without trimming, peak RSS creeps up with the number of
    batches although nothing is kept (measured: 1.74x RSS for a 10x corpus; benchmarks/
    bench_capture_memory.py). No-op where glibc is absent.
    """
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        try:
            import ctypes

            libc = ctypes.CDLL("libc.so.6")
            _MALLOC_TRIM = libc.malloc_trim
            # fixed mmap threshold (M_MMAP_THRESHOLD = -3): blocks >= 32 MiB always come from mmap and
            # go back to the OS when freed, instead of fragmenting the heap (glibc mallopt(3))
            libc.mallopt(-3, 32 * 1024 * 1024)
        except (OSError, AttributeError):
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM = None


def _ar(t: torch.Tensor, op) -> torch.Tensor:
    import torch.distributed as dist

    x = t.clone()
    dist.all_reduce(x, op=op)
    return x


class _LastLayerDone(Exception):
    """Raised by the capture hook after the last attention layer: the rest of the forward pass
    (the last attention's output projection, the last MLP, the final norm) feeds no cache."""


def run_capture(
    model,
    samples: list[torch.Tensor],
    heldout_idx: set[int],
    *,
    num_layers: int,
    num_kv_heads: int,
    num_q_heads: int,
    head_dim: int,
    batch_size: int = 8,
    reservoir: int = 12,
    heldout_reservoir: int = 6,
    search_tokens: int = 512,
    seed: int = 0,
    pad_id: int = 0,
    progress: bool = True,
    stats_skip_first: int = 0,
    sink_stats_skip: int = 0,
    max_batch_tokens: int | None = 8192,
    checkpoint: Checkpointing | None = None,
) -> CaptureResult:
    """One forward pass over ``samples`` (1-D int64 token ids) through the decoder, stopped right
    after the last layer's attention call (no LM head, no last MLP).

    Statistics cover calibration samples only (held-out samples are seen by the held-out
    reservoir alone). Padding positions are masked out of every statistic. Raises
    ``FloatingPointError`` (layer named) on NaN/Inf activations and ``KvcalError`` if some
    attention layer never fired. ``stats_skip_first``: the first tokens of every sample (attention
    sinks kept in 16 bits) are left out of the statistics (the reservoirs keep them).
    ``sink_stats_skip > 0`` additionally fills ``result.sink_stats`` with statistics that leave out
    that many first tokens (one capture serving both FP8 and integer searches).

    Data parallel: inside an initialized ``torch.distributed`` group (``torchrun``), rank ``r`` of
    ``N`` captures batches ``r, r+N, ...`` of the deterministic batch list and the results are
    all-reduced, so every rank ends with the statistics and reservoirs of one full pass (max/min/
    counts exact, sums to float64 rounding). ``checkpoint``: save every N batches / resume
    (single process only). Inputs go to the device of the input embeddings, so models spread
    with ``device_map="auto"`` work; captured tensors are moved to the CPU.
    """
    from tqdm.auto import tqdm

    rank, world = _dist_info()
    stats = LayerStats(num_layers, num_kv_heads, num_q_heads, head_dim)
    res_c = SequenceReservoir(max(reservoir, 1), search_tokens, seed)
    res_h = SequenceReservoir(max(heldout_reservoir, 1), search_tokens, seed + 1)
    result = CaptureResult(stats, res_c, res_h)
    try:  # the RoPE table for pre-RoPE key choices (None for models without a full rotary embedding)
        from kvcal.models import rope_table

        result.rope = rope_table(model)
    except ValueError:
        result.rope = None
    if sink_stats_skip > 0:
        result.sink_stats = LayerStats(num_layers, num_kv_heads, num_q_heads, head_dim)
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    device = emb.weight.device if emb is not None and emb.weight.device.type != "meta" else next(model.parameters()).device
    base = model.base_model if hasattr(model, "base_model") else model
    state: dict = {}

    def on_layer(layer, q, k, v, module):
        if layer >= num_layers:
            raise KvcalError(f"attention layer index {layer} >= num_hidden_layers {num_layers}")
        result.scaling.setdefault(layer, attention_scaling(module, head_dim))
        q, k, v = q.cpu(), k.cpu(), v.cpu()
        mask = state["mask"]
        stats.update(layer, q, k, v, mask & state["is_calib"][:, None] & state["pos_ok"][None, :])
        if result.sink_stats is not None:
            pos = torch.arange(mask.shape[1]) >= sink_stats_skip
            result.sink_stats.k[layer].update(k, mask & state["is_calib"][:, None] & pos[None, :])
            result.sink_stats.v[layer].update(v, mask & state["is_calib"][:, None] & pos[None, :])
        for row, T in state["keep"].items():
            state["pending"][row][layer] = (
                q[row, :, :T].float().clone(), k[row, :, :T].float().clone(), v[row, :, :T].float().clone(),
            )
        if layer == num_layers - 1:
            raise _LastLayerDone  # nothing after the last attention call feeds the cache: skip it

    t0 = time.perf_counter()
    batches = _batches(samples, batch_size, max_batch_tokens)
    start = 0
    if checkpoint is not None and checkpoint.resume:
        if world > 1:
            raise KvcalError("--resume is not supported under torchrun; resume with a single process")
        start, stats = _restore_checkpoint(_load_checkpoint(checkpoint), checkpoint.path, len(batches), result,
                                           res_c, res_h)
    mine = [b for j, b in enumerate(batches) if j % world == rank]
    total_tokens = sum(len(samples[i]) for b in mine for i in b)
    done_tokens = sum(len(samples[i]) for j, b in enumerate(batches) if j < start and j % world == rank for i in b)
    bar = tqdm(total=total_tokens, initial=done_tokens, unit="tok", desc="capture", disable=not progress or rank != 0)
    with torch.no_grad(), capture_kv(model, on_layer):
        for j, idx in enumerate(batches):
            if j < start or j % world != rank:
                continue
            L = max(len(samples[i]) for i in idx)
            ids = torch.full((len(idx), L), pad_id, dtype=torch.long)
            mask = torch.zeros(len(idx), L, dtype=torch.bool)
            for r, i in enumerate(idx):
                ids[r, : len(samples[i])] = samples[i]
                mask[r, : len(samples[i])] = True
            is_calib = torch.tensor([i not in heldout_idx for i in idx])
            keep = {}
            for r, i in enumerate(idx):
                if (res_h if i in heldout_idx else res_c).offer(i):
                    keep[r] = min(len(samples[i]), search_tokens)
            state.update(mask=mask, is_calib=is_calib, pos_ok=torch.arange(L) >= stats_skip_first, keep=keep,
                         pending={r: [None] * num_layers for r in keep})
            try:
                # no padding in this batch: let attention take its causal fast path (no mask tensor)
                am = None if bool(mask.all()) else mask.long().to(device)
                base(input_ids=ids.to(device), attention_mask=am, use_cache=False)
            except _LastLayerDone:
                pass
            for r in keep:
                i = idx[r]
                (res_h if i in heldout_idx else res_c).put(i, state["pending"][r])
            result.tokens += int(mask.sum())
            bar.update(int(mask.sum()))
            del state["pending"]
            _release_freed_memory()
            if checkpoint is not None and checkpoint.every and world == 1 and (j + 1) % checkpoint.every == 0 \
                    and j + 1 < len(batches):
                _save_checkpoint(checkpoint, {
                    "fingerprint": checkpoint.fingerprint, "next_batch": j + 1, "stats": stats.state_dict(),
                    "sink_stats": None if result.sink_stats is None else result.sink_stats.state_dict(),
                    "calib": res_c.state_dict(), "heldout": res_h.state_dict(), "scaling": dict(result.scaling),
                    "tokens": result.tokens, "rng": torch.get_rng_state(),
                })
    bar.close()
    if world > 1:
        _all_reduce_capture(result)
        stats = result.stats
    missing = [i for i in range(num_layers) if int(stats.fired[i]) == 0]
    if missing:
        raise KvcalError(f"attention layers {missing} never fired during capture; this architecture's "
                         "attention does not go through transformers' attention interface (no KV cache?)")
    result.seconds = time.perf_counter() - t0
    return result


def _sequence_caches(res: SequenceReservoir, layer: int, scaling: float, max_queries: int):
    from kvcal.search.objectives import SequenceCache

    return [SequenceCache(*seq[layer], scaling, max_queries) for seq in res.sequences()]


def search_scales(cap: CaptureResult, fmt_name: str, per_head: bool, max_queries: int = 128,
                  progress: bool = True) -> list[dict]:
    """Per layer: choose K and V static scales. Returns ``[{"layer", "k": SideChoice, "v": SideChoice}]``."""
    from tqdm.auto import tqdm

    from kvcal.formats.fp8 import get_fp8_format
    from kvcal.search.static_scales import choose_static_fp8

    fmt = get_fp8_format(fmt_name)
    out = []
    n = len(cap.stats.k)
    for layer in tqdm(range(n), desc="search", disable=not progress):
        calib = _sequence_caches(cap.calib, layer, cap.scaling[layer], max_queries)
        held = _sequence_caches(cap.heldout, layer, cap.scaling[layer], max_queries) if cap.heldout.items else []
        row = {"layer": layer}
        for side in ("k", "v"):
            st = getattr(cap.stats, side)[layer].finalize()
            row[side] = choose_static_fp8(calib, held, st["head_absmax"], side, fmt, per_head)
        out.append(row)
    return out


def plan_from_choices(rows: list[dict], fmt: str, granularity: str, num_kv_heads: int):
    """Build the :class:`~kvcal.plan.KVPlan` and the per-layer metadata from :func:`search_scales` rows."""
    from kvcal.formats.spec import TensorQuantSpec
    from kvcal.plan import KVPlan, LayerPlan, SidePlan

    spec = TensorQuantSpec(fmt, granularity)
    layers, layers_meta = [], []
    for r in rows:
        lm, sides = {"layer": r["layer"]}, {}
        for side in ("k", "v"):
            ch = r[side]
            shape = (1, 1, 1, 1) if granularity == "tensor" else (1, num_kv_heads, 1, 1)
            sides[side] = SidePlan(spec, scale=ch.scale.reshape(shape).float())
            lm[side] = {"scale": ch.scale.tolist(), "amax": ch.amax.tolist(), "clip_ratio": ch.clip_ratio.tolist(),
                        "candidate": ch.label, "heldout": ch.heldout, "calib": ch.calib}
        layers.append(LayerPlan(sides["k"], sides["v"]))
        layers_meta.append(lm)
    return KVPlan(layers), layers_meta


# ---- integer presets and bit allocation ---------------------------------------------------------

@dataclass
class IntSearchResult:
    """What :func:`search_int` chose: the plan, per-layer metadata and a summary for the artifact."""

    plan: object
    layers_meta: list[dict]
    summary: dict


def _reference_index(menu: tuple, side: str) -> tuple[int, bool]:
    """``(index, fallback)`` in ``menu`` of the sensitivity probe's reference choice: the ``int4``
    preset's side when the menu has it; else (``fallback=True``, e.g. no RoPE table, so no pre-RoPE
    entries) the entry with the same spec without its transform / rounding, else the first 4-bit
    entry, else the first entry."""
    from kvcal.search.presets import ALLOC_REFERENCE

    ref = ALLOC_REFERENCE[side]
    if ref in menu:
        return menu.index(ref), False
    same = [i for i, c in enumerate(menu) if c.spec == ref.spec]
    if same:
        return same[-1], True
    return next((i for i, c in enumerate(menu) if c.spec.bits == 4), 0), True


def _probe_weights(kl: dict, items: list, ref_idx: dict, log) -> tuple[dict, dict]:
    """Per (layer, side) weight ``KL / error(reference)`` from the probe's KLs (nats).

    KLs at or below a floor of 1e-3 × the mean positive KL (below what the probe resolves, e.g. a
    side whose quantized tokens no probed position reads) are raised to it and listed. Raises
    :class:`KvcalError` for missing / non-finite values or a probe that measured nothing."""
    keys = [(it.layer, it.side) for it in items]
    bad = [k for k in keys if k not in kl or not math.isfinite(float(kl[k]))]
    if bad:
        raise KvcalError(f"the sensitivity probe returned no finite KL for {len(bad)} (layer, side) pairs (first: "
                         f"layer {bad[0][0]} {bad[0][1].upper()}) — the model's logits overflow or are -inf on the probe "
                         "samples; use other held-out samples or --probe-tokens 0 (no probe)")
    pos = [float(kl[k]) for k in keys if float(kl[k]) > 0]
    if not pos:
        raise KvcalError("the sensitivity probe measured no effect of any layer (every KL <= 0): the probe samples are "
                         "too short to read a quantized token; raise --probe-tokens / --max-seq-len or use --probe-tokens 0")
    floor = 1e-3 * sum(pos) / len(pos)
    floored = [k for k in keys if float(kl[k]) < floor]
    if floored:
        log(f"sensitivity probe: {len(floored)} (layer, side) pairs below its resolution, weighted at the floor "
            f"{floor:.3g} nats")
    weights = {}
    for it in items:
        k = (it.layer, it.side)
        v = max(float(kl[k]), floor)
        weights[k] = (v / max(it.errors[ref_idx[it.side]], 1e-12), float(kl[k]))
    return weights, {"floor_nats": floor, "floored": [f"{layer}{side.upper()}" for layer, side in floored]}


def search_int(cap: CaptureResult, *, preset: str | None = None, bits: float | None = None, sinks: int | None = None,
               residual_window: int = 0, key_centering: str = "auto", objective_k: str = "kl",
               max_queries: int = 128, budget_context: int = 4096, progress: bool = True,
               cache: dict | None = None, log: Callable[[str], None] = lambda s: None,
               rope=None, probe: Callable | None = None, sink_probe: Callable | None = None) -> IntSearchResult:
    """Integer KV plan from a capture: fixed ``preset`` specs, or per-layer specs under ``bits``.

    Per layer and side the parameters come from :func:`kvcal.search.optimizer.search_side`
    (clip ratios / static ranges / centering, guarded on held-out). With ``bits``, every menu spec
    (:data:`kvcal.search.presets.ALLOC_MENU`) is first searched on a coarse grid to measure its
    held-out attention-output error, :func:`kvcal.search.allocate.allocate` picks per-layer specs
    under the exact byte budget at ``budget_context`` tokens, and the chosen specs are refined.
    ``sinks``: ``None`` searches with 1 sink token and then keeps the count in
    :data:`SINK_CANDIDATES` (0, 1 or 4 first tokens in 16 bits) with the lowest held-out
    model-level KL when ``sink_probe`` is given — a callable taking ``{count: KVPlan}`` and
    returning ``{count: KL in nats}`` (:func:`kvcal.evaluate.plans_kl` on held-out samples) —, else
    with the lowest summed held-out attention-output error (ties: fewer sinks; ``--bits`` budgets
    count the largest, so any choice fits). The attention-level sum is recorded either way (why the
    model is asked when one is at hand: ``docs/design.md``, "Sink count"). ``cache``: dict reused across calls on the same capture (benchmarks).
    ``rope``: the model's :class:`~kvcal.formats.transforms.RopeTable`
    (:func:`kvcal.models.rope_table`; default ``cap.rope``), needed by pre-RoPE key choices (``int4``, ``int2``, ``k4v2`` presets; with
    ``bits`` the pre-RoPE menu entries are skipped when it is ``None``).
    ``probe`` (with ``bits``): a callable taking a :class:`~kvcal.plan.KVPlan` and returning the
    model-level KL (nats) of quantizing each ``(layer, side)`` alone with it
    (:func:`kvcal.evaluate.side_sensitivity` on held-out samples). It is called once with the
    reference plan (every side at its ``int4``-preset choice, :data:`~kvcal.search.presets.ALLOC_REFERENCE`),
    and each (layer, side)'s attention-level errors are multiplied by ``KL / error(reference)``, so
    the allocation minimizes an estimate of the model-level KL instead of the sum of layer errors
    (``docs/design.md``, "Bit allocation"). Raises
    :class:`KvcalError` for an infeasible budget or a pre-RoPE preset without ``rope``.
    """
    from tqdm.auto import tqdm

    from kvcal.formats.memory import cache_bytes, side_extra_bytes
    from kvcal.plan import KVPlan, LayerPlan
    from kvcal.search import allocate as al
    from kvcal.search.optimizer import search_side, side_error
    from kvcal.search.presets import ALLOC_MENU, INT_PRESETS, NEEDS_ROPE, spec_label

    cache = {} if cache is None else cache
    rope = rope if rope is not None else cap.rope
    L = len(cap.stats.k)
    H, D = cap.stats.k[0].num_heads, cap.stats.k[0].head_dim
    s_try = 1 if sinks is None else sinks
    s_cost = max(SINK_CANDIDATES) if sinks is None else sinks  # sink tokens the --bits costs count
    obj = {"k": objective_k, "v": "out"}

    def caches(layer):
        key = ("caches", layer, max_queries)
        if key not in cache:
            cache[key] = (_sequence_caches(cap.calib, layer, cap.scaling[layer], max_queries),
                          _sequence_caches(cap.heldout, layer, cap.scaling[layer], max_queries) if cap.heldout.items else [])
        return cache[key]

    def run(layer, side, choice, refine):
        spec, tr, rounding, clip_search, chbits, lv, tnu = choice
        key = ("search", layer, side, spec, tr, rounding, clip_search, chbits, lv, tnu, refine, s_try, key_centering,
               obj[side], max_queries)
        if key not in cache:
            cal, held = caches(layer)
            st = getattr(cap.sink_stats if cap.sink_stats is not None else cap.stats, side)[layer].finalize()
            cache[key] = search_side(cal, held, side, spec, stats=st, sinks=s_try, objective=obj[side],
                                     centering=key_centering if side == "k" else "off", refine=refine,
                                     transform=tr, rope=rope if tr in NEEDS_ROPE else None, rounding=rounding,
                                     grid=None if clip_search else (1.0,), channel_bits=chbits, levels=lv,
                                     trellis_nu=tnu)
        return cache[key]

    menu = {s: tuple(c for c in ALLOC_MENU[s] if rope is not None or c.transform not in NEEDS_ROPE)
            for s in ("k", "v")}
    if bits is None and rope is None and any(c.transform in NEEDS_ROPE for c in INT_PRESETS[preset]):
        raise KvcalError(f"preset {preset} quantizes keys pre-RoPE and needs the model's RoPE table (rope=)")

    t0 = time.perf_counter()
    alloc_meta = None
    if bits is not None:
        items = []
        for layer in tqdm(range(L), desc="sensitivity", disable=not progress):
            for side in ("k", "v"):
                rs = [run(layer, side, c, False) for c in menu[side]]
                costs = tuple(al.side_cost(c.spec, H, D, budget_context, s_cost, residual_window,
                                           side_extra_bytes(c.spec, H, D, centering=r.plan.mean is not None,
                                                            rounding=c.rounding, channel_bits=c.channel_bits,
                                                            levels=r.plan.levels is not None,
                                                            trellis=_trellis_entries(r.plan)))
                              for c, r in zip(menu[side], rs, strict=True))
                items.append(al.Item(layer, side, tuple(c.spec for c in menu[side]), costs,
                                     tuple(r.heldout_out for r in rs)))
        weights = probe_meta = None
        if probe is not None:
            refs = {s: _reference_index(menu[s], s) for s in ("k", "v")}
            ref_idx = {s: refs[s][0] for s in ("k", "v")}
            ref_plan = KVPlan([LayerPlan(run(layer, "k", menu["k"][ref_idx["k"]], False).plan,
                                         run(layer, "v", menu["v"][ref_idx["v"]], False).plan) for layer in range(L)],
                              sink_tokens=s_try)
            log("sensitivity probe: model-level KL of each layer's K and V alone at "
                + ", ".join(spec_label(menu[s][ref_idx[s]]) + (" (fallback: the int4 preset's choice is not in the "
                                                               "menu)" if refs[s][1] else "") for s in ("k", "v")))
            weights, probe_meta = _probe_weights(probe(ref_plan), items, ref_idx, log)
            probe_meta.update(getattr(probe, "meta", {}))
            items = [al.Item(it.layer, it.side, it.specs, it.costs,
                             tuple(weights[(it.layer, it.side)][0] * e for e in it.errors)) for it in items]
        budget = al.budget_bytes(bits, L, H, D, budget_context)
        _check_bits_feasible(bits, sum(min(it.costs) for it in items), L, H, D, budget_context, s_cost)
        try:
            choice = al.allocate(items, budget)
        except ValueError as e:
            raise KvcalError(f"--bits {bits}: {e}") from None
        specs = [[None, None] for _ in range(L)]
        for it, j in zip(items, choice, strict=True):
            specs[it.layer][0 if it.side == "k" else 1] = menu[it.side][j]
        alloc_meta = {"budget_bits": bits, "budget_context": budget_context, "budget_bytes": float(budget),
                      "sensitivity": ("held-out relative attention-output error per (layer, side, spec)"
                                      + ("" if weights is None else " × model-level KL of that (layer, side) alone "
                                         "at the reference spec / its error at the reference spec (nats)")),
                      "menu": {s: [spec_label(c) for c in menu[s]] for s in ("k", "v")},
                      "table": [{"layer": it.layer, "side": it.side, "errors": [float(e) for e in it.errors],
                                 "bytes": list(it.costs), "chosen": spec_label(menu[it.side][j]),
                                 **({} if weights is None else {"probe_kl": weights[(it.layer, it.side)][1],
                                                                "weight": weights[(it.layer, it.side)][0]})}
                                for it, j in zip(items, choice, strict=True)]}
        if weights is not None:
            alloc_meta["reference"] = {s: spec_label(menu[s][ref_idx[s]]) for s in ("k", "v")}
            alloc_meta["probe"] = probe_meta
    else:
        specs = [list(INT_PRESETS[preset]) for _ in range(L)]
    results = []
    for layer in tqdm(range(L), desc="search", disable=not progress):
        results.append({side: run(layer, side, specs[layer][i], True) for i, side in enumerate(("k", "v"))})
        for i, side in enumerate(("k", "v")):
            results[-1][side].extra["transform"] = specs[layer][i].transform
    # sinks: the count with the lowest summed held-out output error (ties: fewer)
    word = "held-out" if cap.heldout.items else "calibration-data"  # no held-out split: say what was measured
    sink_meta = {"tried": list(SINK_CANDIDATES) if sinks is None else [s_try]}
    final_sinks = s_try
    if sinks is None:
        tot = dict.fromkeys(SINK_CANDIDATES, 0.0)
        for layer, r in enumerate(results):
            cal, held = caches(layer)
            for side in ("k", "v"):
                for n in SINK_CANDIDATES:
                    a, b = side_error(held or cal, side, r[side].plan, "out", n)
                    tot[n] += float(a.sum() / b.sum())
        sink_meta["heldout_out_sum"] = {str(n): tot[n] for n in SINK_CANDIDATES}
        if sink_probe is None:
            final_sinks = min(SINK_CANDIDATES, key=lambda n: (tot[n], n))
            sink_meta["chosen_by"] = f"{word} attention-output error (summed over layers and sides)"
        else:
            kl = sink_probe({n: KVPlan([LayerPlan(r["k"].plan, r["v"].plan) for r in results],
                                       residual_window=residual_window, sink_tokens=n) for n in SINK_CANDIDATES})
            bad = [n for n in SINK_CANDIDATES if n not in kl or not math.isfinite(float(kl[n])) or float(kl[n]) < -1e-9]
            if bad:
                raise KvcalError(f"the sink probe returned no finite, non-negative KL for {bad[0]} sink tokens (the "
                                 "model's logits overflow on the probe samples); use other held-out samples, "
                                 "--sinks N, or --probe-tokens 0")
            final_sinks = min(SINK_CANDIDATES, key=lambda n: (float(kl[n]), n))
            sink_meta["heldout_model_kl"] = {str(n): float(kl[n]) for n in SINK_CANDIDATES}
            sink_meta["chosen_by"] = f"{word} model-level KL (nats/token)"
            sink_meta.update(getattr(sink_probe, "meta", {}))
            log(f"sink tokens by {word} model KL: " + ", ".join(f"{n}: {float(kl[n]):.4e}" for n in SINK_CANDIDATES)
                + f" nats -> {final_sinks}")
    sink_meta["kept"] = final_sinks
    plan = KVPlan([LayerPlan(r["k"].plan, r["v"].plan) for r in results], residual_window=residual_window,
                  sink_tokens=final_sinks)
    total = cache_bytes({"num_hidden_layers": L, "num_key_value_heads": H, "head_dim": D, "num_attention_heads": H},
                        [plan.kv_config(i) for i in range(L)], budget_context)
    avg = al.average_bits(total, L, H, D, budget_context)
    if bits is not None:
        assert avg <= bits + 1e-12, (avg, bits)
    layers_meta = [{"layer": i, "k": r["k"].to_meta(), "v": r["v"].to_meta()} for i, r in enumerate(results)]
    summary = {
        "preset": preset if bits is None else None, "bits_budget": bits, "sinks": sink_meta,
        "average_bits": avg, "average_bits_context": budget_context, "cache_bytes_at_context": total,
        "key_bits_mean": sum(r["k"].spec.bits for r in results) / L,
        "value_bits_mean": sum(r["v"].spec.bits for r in results) / L,
        "centered_layers": [i for i, r in enumerate(results) if r["k"].plan.mean is not None],
        "objective_k": obj["k"], "objective_v": "out", "search_seconds": round(time.perf_counter() - t0, 2),
        "heldout": {s: {"chosen": sum(r[s].heldout for r in results) / L,
                        "minmax": sum(r[s].heldout_minmax for r in results) / L} for s in ("k", "v")},
    }
    if alloc_meta is not None:
        summary["allocation"] = alloc_meta
    return IntSearchResult(plan, layers_meta, summary)


def _alloc_line(cal: dict) -> str:
    from kvcal.report.data import heldout_word

    a = cal.get("allocation")
    if not a:
        return ""
    p = a.get("probe")
    w = heldout_word({"calibration": cal})
    how = (f"summed {w} attention-level errors (no model-level probe)" if p is None else
           f"{w} attention-level errors weighted by each layer's K / V model-level KL, measured alone at "
           f"{a['reference']['k']} / {a['reference']['v']} on {p.get('samples')} {p.get('source')} samples "
           f"({p.get('tokens')} tokens)")
    return f"- Per-layer formats allocated under {a['budget_bits']} bits at {a['budget_context']} tokens from {how}.\n"


def _sink_note(cal: dict) -> str:
    from kvcal.report.data import heldout_word

    sk = cal.get("sinks") or {}
    if len(sk.get("tried", [])) < 2:
        return " (given)"
    if "heldout_model_kl" in sk:
        p = sk.get("probe", {})
        vals = ", ".join(f"{n}: {float(v):.3e}" for n, v in sk["heldout_model_kl"].items())
        return (f" (of {sk['tried']}, the lowest model KL on {p.get('samples', '?')} {p.get('source', 'held-out')} "
                f"samples ({p.get('tokens', '?')} tokens): {vals} nats/token)")
    return f" (of {sk['tried']}, the lowest summed {heldout_word({'calibration': cal})} attention-output error)"


def render_int_report(meta: dict) -> str:
    """``report.md`` for integer artifacts: specs, parameters chosen per layer, held-out errors."""
    kv, cal, m = meta["kv"], meta["calibration"], meta["model"]
    rows = []

    def spec_cell(side: dict) -> str:
        sp = side["spec"]
        out = f"{sp['format']} {sp['granularity']}{sp.get('group_size') or ''} {'sym' if sp.get('symmetric') else 'asym'}"
        if side.get("transform", "none") != "none":
            out += f", {side['transform'].replace('_', '-')}"
        out += ", query-aware rounding" if side.get("rounding") else ""
        out += ", non-uniform levels" if side.get("levels") else ""
        out += f", trellis-coded (nu={side['trellis']['nu']})" if side.get("trellis") else ""
        return out + (", per-channel bit widths" if side.get("channel_bits") else "")

    def pick_cell(side: dict) -> str:
        """What each head got: clip ratios of dynamic sides (``min/max`` where every ratio is 1 or the
        baseline won), per-head family and parameter of static ones."""
        labels, param = side["label"], side.get("param")
        if param is None or not side["spec"].get("dynamic", True):
            return ", ".join(sorted(set(labels)))
        center = " + centering" if any(lb.endswith("center") for lb in labels) else ""
        if all(abs(float(x) - 1.0) < 1e-9 for x in param):
            return "min/max ranges" + center + (" (baseline)" if set(labels) == {"minmax"} else "")
        return "clip " + "/".join(f"{float(x):.3g}" for x in param) + center

    for lm in meta["layers"]:
        k, v = lm["k"], lm["v"]
        rows.append(f"| {lm['layer']} | {spec_cell(k)} | {pick_cell(k)} | "
                    f"{k['heldout']:.3e} | {k['heldout_minmax']:.3e} | {spec_cell(v)} | "
                    f"{pick_cell(v)} | {v['heldout']:.3e} | {v['heldout_minmax']:.3e} |")
    from kvcal.report.data import error_data_label, has_heldout, heldout_word
    from kvcal.report.markdown import corpus_section

    w = heldout_word(meta)
    budget = (f"--bits {cal['bits_budget']:g} (per-layer allocation)" if cal.get("bits_budget") is not None
              else "none (fixed preset layout)")
    return f"""# KV-cache calibration report (integer)

- Model `{m["id"]}` ({m["num_layers"]} layers × {m["num_kv_heads"]} KV heads × head_dim {m["head_dim"]}); weights {m["weight_precision"]}.
- Preset: {cal.get("preset")}; bit budget: {budget}; average bits per cached element including all
  metadata at {cal["average_bits_context"]} tokens: **{cal["average_bits"]:.4f}**.
- Keys quantized {kv["key_position"].replace("_", "-")}; sink tokens in 16 bits: {kv["sink_tokens"]}{_sink_note(cal)}; residual window (runtime): {kv["residual_window"]}.
- Key objective: {cal["objective_k"]} (attention KL, nats/query, when `kl`); value objective: relative attention-output error.
- Every choice is compared with plain min/max (same transform; uniform grid, nearest rounding, uniform widths:
  the "min/max" columns) on {error_data_label(meta)} and kept only where it is lower. "pick" gives each KV head's clip ratio.
{_alloc_line(cal)}
{corpus_section(meta, "Integer parameters are per token / group at run time or per layer from calibration: batch "
                      "size changes neither; evaluate a serving regime with `kvcal evaluate`.")}
## {"Held-out error per layer" if has_heldout(meta) else f"Error per layer on {error_data_label(meta)}"}

| layer | K spec | K pick | K {w} | K min/max | V spec | V pick | V {w} | V min/max |
|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}
"""


def calibrate(cfg: CalibrateConfig, log: Callable[[str], None] = print, progress: bool = True,
              model=None, tokenizer=None) -> dict:
    """Run the whole calibration and write the artifact; returns ``{"out", "metadata", "table"}``.

    ``model`` / ``tokenizer``: already-loaded objects for ``cfg.model`` (tests, notebooks);
    loaded offline when None. Raises :class:`KvcalError` (bad corpus, model, options, or output
    location); nothing is written unless the whole run succeeds.
    """
    from kvcal.corpus import format_shape, load_corpus
    from kvcal.models import head_dim_of, load_model, load_tokenizer, model_metadata

    int_path = cfg.bits is not None or cfg.preset != "fp8"
    out = output_dir(cfg)
    from pathlib import Path

    rank, world = _init_distributed(cfg.device)
    if rank != 0:
        log, progress = (lambda s: None), False
    from kvcal.artifact import check_output_dir

    check_output_dir(out, cfg.overwrite, _out_inputs(cfg), KvcalError, kind="artifact")  # before the model loads: nothing to wait for
    from kvcal.corpus import check_corpus

    corpus_opts = {"text_field": cfg.text_field, "messages_field": cfg.messages_field, "split": cfg.split}
    check_corpus(cfg.corpus, **corpus_opts)  # format and fields, before the tokenizer or model loads
    if cfg.checkpoint_every and not cfg.resume:  # its checkpoint file is an output too (--resume checks it on load)
        from kvcal.artifact import check_output_file

        check_output_file(checkpoint_path(out), "checkpoint", _out_inputs(cfg), KvcalError, "--out")
    from kvcal.models import check_max_positions, load_model_config, max_positions

    if model is not None:
        tconf = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        max_pos = getattr(tconf, "max_position_embeddings", None)
    else:
        max_pos = max_positions(cfg.model)  # from the config / GGUF header: before any weight loads
    check_max_positions(cfg.max_seq_len, max_pos, "--max-seq-len")
    if cfg.bits is not None:  # an infeasible budget is known from the config alone
        bits_precheck(cfg.bits, model.config if model is not None else load_model_config(cfg.model),
                      cfg.budget_context, cfg.sink_tokens, cfg.residual_window)
    torch.manual_seed(cfg.seed)
    tok = tokenizer if tokenizer is not None else load_tokenizer(cfg.model)
    corpus = load_corpus(cfg.corpus, tok, max_seq_len=cfg.max_seq_len, max_samples=cfg.max_samples,
                         strict=cfg.strict, seed=cfg.seed, **corpus_opts)
    shape = corpus.shape()
    log(format_shape(shape))
    if model is None:
        model = load_model(cfg.model, device=cfg.device, device_map=cfg.device_map)
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
        from kvcal.models import rope_table
        from kvcal.search.presets import INT_PRESETS, NEEDS_ROPE

        try:
            rope_table(model)
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
                             hashlib.sha256(_json.dumps(fp, sort_keys=True).encode()).hexdigest())
    cap = run_capture(
        model, corpus.samples, held_idx, num_layers=mmeta["num_layers"], num_kv_heads=mmeta["num_kv_heads"],
        num_q_heads=int(conf.num_attention_heads), head_dim=head_dim_of(conf), batch_size=cfg.batch_size,
        reservoir=cfg.reservoir, heldout_reservoir=cfg.heldout_reservoir, search_tokens=cfg.search_tokens,
        seed=cfg.seed, pad_id=pad, progress=progress, stats_skip_first=skip, checkpoint=ckpt,
    )
    if rank != 0:
        _finish_distributed()
        return {"out": str(out), "rank": rank}
    try:
        res = _search_and_write(cfg, cap, corpus, shape, held_idx, mmeta, out, log, progress, int_path, model)
    finally:
        _finish_distributed()
    if ckpt is not None:
        Path(ckpt.path).unlink(missing_ok=True)
    return res


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


def _init_distributed(device: str) -> tuple[int, int]:
    """Join the ``torchrun`` process group when ``WORLD_SIZE > 1`` (gloo on CPU, nccl on CUDA)."""
    import os

    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    return _dist_info()


def _finish_distributed() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _channel_ranges(cap: CaptureResult, layers_meta: list[dict]) -> None:
    """Per layer/side per-channel absmax ``[H][D]`` from the calibration statistics (for the report)."""
    for lm in layers_meta:
        i = lm["layer"]
        for side in ("k", "v"):
            lm[side]["channel_absmax"] = getattr(cap.stats, side)[i].finalize()["absmax"].float().tolist()


def _search_and_write(cfg, cap, corpus, shape, held_idx, mmeta, out, log, progress, int_path, model=None) -> dict:
    from kvcal.artifact import write_artifact
    from kvcal.report.markdown import layer_table, render_calibration_report
    from kvcal.search.static_scales import DEFAULT_CLIP_RATIOS, DEFAULT_HEADROOM

    if int_path:
        return _calibrate_int(cfg, cap, corpus, shape, held_idx, mmeta, out, log, progress, model)
    t1 = time.perf_counter()
    if cfg.engine == "vllm":  # k/v/q scales for vLLM's FP8 queries (kvcal.search.vllm_fp8)
        from kvcal.search.vllm_fp8 import search_vllm_fp8

        rows = search_vllm_fp8(cap, cfg.granularity == "head", cfg.max_queries, progress)
    else:
        rows = search_scales(cap, cfg.format, cfg.granularity == "head", cfg.max_queries, progress)
    search_s = time.perf_counter() - t1

    plan, layers_meta = plan_from_choices(rows, cfg.format, cfg.granularity, mmeta["num_kv_heads"])
    _channel_ranges(cap, layers_meta)
    tensors = plan.to_tensors()
    meta = {
        **_meta_head(mmeta, plan),
        "calibration": {
            "method": "attention-aware static scale search",
            "objective_k": "attention KL (nats per query, causal, real captured queries of every GQA head)",
            "objective_v": "relative attention-output error sum|P(V^-V)|^2 / sum|PV|^2",
            "candidates": "absmax, unity, otf (amax/200 K, amax/100 V), clip "
                          + ", ".join(f"{r:g}" for r in DEFAULT_CLIP_RATIOS) + ", headroom "
                          + ", ".join(f"{m:g}" for m in DEFAULT_HEADROOM),
            "selection": "best on calibration split, then lowest "
                         + ("held-out error" if held_idx else "error on the calibration data (no held-out split)")
                         + " among {best, absmax, unity}",
            **_calibration_common(cfg, cap, corpus, held_idx),
            "search_seconds": round(search_s, 2),
        },
        "corpus": _corpus_meta(corpus, shape),
        "layers": layers_meta,
    }
    if cfg.engine == "vllm":
        from kvcal.search.vllm_fp8 import add_to_artifact

        add_to_artifact(rows, tensors, meta, cfg.kv_cache_dtype, cfg.granularity == "head", mmeta["num_kv_heads"])
    report = render_calibration_report(meta)
    path = write_artifact(out, tensors, meta, extra_files={"report.md": report}, overwrite=cfg.overwrite,
                          inputs=_out_inputs(cfg))
    table = layer_table(meta)
    return {"out": str(path), "metadata": meta, "table": table, "config": asdict(cfg)}


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

    def probe(plan):
        if not picked:
            raise KvcalError(f"--probe-tokens {probe_tokens}: no {source} sample of 3 or more tokens fits; raise "
                             "--probe-tokens or use 0 (no probe)")
        log(f"sensitivity probe on {len(picked)} {source} samples ({n} tokens; {1 + 2 * plan.num_layers} forward "
            "passes over each)")
        try:
            return side_sensitivity(model, picked, plan, progress=progress)
        except ValueError as e:
            raise KvcalError(f"sensitivity probe: {e}; raise --probe-tokens or use 0 (no probe)") from None

    def sink_probe(plans):
        if not picked:
            raise KvcalError(f"--probe-tokens {probe_tokens}: no {source} sample of 3 or more tokens fits to choose the "
                             "sink count on; raise --probe-tokens, give --sinks N, or use --probe-tokens 0")
        return plans_kl(model, picked, plans, progress=progress)

    probe.meta = {"source": source, "samples": len(picked), "tokens": n, "probe_tokens": probe_tokens}
    sink_probe.meta = {"probe": dict(probe.meta)}
    probe.plans_kl = sink_probe
    return probe


def _out_inputs(cfg) -> dict:
    """Paths ``calibrate`` reads, which its ``--out`` must not be or contain."""
    from pathlib import Path

    return {"--corpus": cfg.corpus, "--model": cfg.model if cfg.model and Path(cfg.model).exists() else None}


def _check_bits_feasible(bits: float, cheapest: int, L: int, H: int, D: int, context: int, sinks: int) -> None:
    """Raise :class:`KvcalError` naming the smallest feasible ``--bits`` when ``cheapest`` (bytes of
    the cheapest menu choice of every layer's K and V at ``context`` tokens, batch 1, ``sinks``
    16-bit sink tokens counted) exceeds the ``bits`` budget."""
    from kvcal.search import allocate as al

    if cheapest > al.budget_bytes(bits, L, H, D, context):
        avg = al.average_bits(cheapest, L, H, D, context)
        if avg > 16.0:  # no allowed --bits can fit: the 16-bit tokens alone exceed the context's budget
            raise KvcalError(f"--bits {bits}: the cheapest plan needs {avg:.4f} bits per element at --budget-context "
                             f"{context} tokens, above any allowed --bits (2-16): the 16-bit sink tokens ({sinks}) and "
                             "residual window take most of that context; lower --residual-window / --sinks or raise "
                             "--budget-context")
        raise KvcalError(f"--bits {bits}: even the cheapest choice for every layer needs {avg:.4f} bits per "
                         f"element at {context} tokens (payload, scales, tables and {sinks} 16-bit sink tokens); "
                         f"raise --bits to at least {math.ceil(avg * 100) / 100:.2f}")


def _trellis_entries(sp) -> int:
    """Entries (= bytes, int8) of a side plan's trellis table, 0 without one."""
    return 0 if sp.trellis is None else int(sp.trellis.numel())


def bits_precheck(bits: float, config, context: int, sinks: int | None, residual_window: int) -> None:
    """Refuse an infeasible ``--bits`` from the model's config alone, before any weight loads or
    capture runs (the allocation itself comes after a capture, a search and a sensitivity probe).

    Lower bound of the cheapest plan: every layer's K and V at the cheapest
    :data:`~kvcal.search.presets.ALLOC_MENU` entry, without key centering (which only adds bytes),
    with the sink tokens the allocation counts (``--sinks``, else ``max(SINK_CANDIDATES)``), at
    ``context`` tokens, batch 1. ``config``: a transformers config. Raises :class:`KvcalError`
    (as the allocation would) when even that exceeds the budget."""
    from kvcal.formats.memory import model_shape, side_extra_bytes
    from kvcal.search import allocate as al
    from kvcal.search.presets import ALLOC_MENU

    try:
        shape = model_shape(config.get_text_config() if hasattr(config, "get_text_config") else config)
    except ValueError as e:
        raise KvcalError(str(e)) from None
    L, H, D = shape.num_layers, shape.num_kv_heads, shape.head_dim
    s_cost = max(SINK_CANDIDATES) if sinks is None else sinks
    cheapest = L * sum(
        min(al.side_cost(c.spec, H, D, context, s_cost, residual_window,
                         side_extra_bytes(c.spec, H, D, rounding=c.rounding, channel_bits=c.channel_bits, levels=c.levels))
            for c in ALLOC_MENU[side])
        for side in ("k", "v"))
    _check_bits_feasible(bits, cheapest, L, H, D, context, s_cost)


def _calibrate_int(cfg, cap, corpus, shape, held_idx, mmeta, out, log, progress, model=None) -> dict:
    """Integer preset / ``--bits`` branch of :func:`calibrate` (after capture)."""
    from kvcal.artifact import write_artifact

    probe = None
    if cfg.probe_tokens > 0 and (cfg.bits is not None or cfg.sink_tokens is None):
        probe = _held_out_probe(model, corpus, held_idx, cfg.probe_tokens, progress, log)
    res = search_int(cap, preset=None if cfg.bits is not None else cfg.preset, bits=cfg.bits,
                     sinks=cfg.sink_tokens, residual_window=cfg.residual_window, key_centering=cfg.key_centering,
                     objective_k=cfg.objective_k, max_queries=cfg.max_queries, budget_context=cfg.budget_context,
                     progress=progress, log=log, probe=probe if cfg.bits is not None else None,
                     sink_probe=probe.plans_kl if probe is not None and cfg.sink_tokens is None else None)
    plan = res.plan
    _channel_ranges(cap, res.layers_meta)
    meta = {
        **_meta_head(mmeta, plan),
        "calibration": {
            "method": "attention-aware integer search (clip ratios, static per-channel ranges, key centering, "
                      "sinks, pre-RoPE / Hadamard transforms" + (", bit allocation" if cfg.bits is not None else "")
                      + ")",
            **res.summary,
            "selection": "coarse grid + scipy bounded refinement per KV head on the calibration split (errors "
                         "summed over all sequences), then the lower "
                         + ("held-out error" if held_idx else "error on the calibration data (no held-out split)")
                         + " of {chosen, plain min/max}",
            **_calibration_common(cfg, cap, corpus, held_idx),
        },
        "corpus": _corpus_meta(corpus, shape),
        "layers": res.layers_meta,
    }
    report = render_int_report(meta)
    path = write_artifact(out, plan.to_tensors(), meta, extra_files={"report.md": report}, overwrite=cfg.overwrite,
                          inputs=_out_inputs(cfg))
    s = res.summary
    head = f"preset {s['preset']}" if s["bits_budget"] is None else f"per-layer allocation under {s['bits_budget']} bits"
    table = (f"{head}: average {s['average_bits']:.4f} bits/element incl. "
             f"metadata at {s['average_bits_context']} tokens; K bits {s['key_bits_mean']:.2f}, V bits "
             f"{s['value_bits_mean']:.2f}; sinks {plan.sink_tokens}; {'held-out' if held_idx else 'calibration-data (no held-out split)'} "
             f"K {s['heldout']['k']['chosen']:.3e} "
             f"(min/max {s['heldout']['k']['minmax']:.3e}), V {s['heldout']['v']['chosen']:.3e} "
             f"(min/max {s['heldout']['v']['minmax']:.3e})")
    return {"out": str(path), "metadata": meta, "table": table, "config": asdict(cfg), "plan": plan}

