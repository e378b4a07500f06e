"""The capture pass: one forward pass over the corpus with the attention hook (torch + transformers).

:func:`run_capture` streams statistics over every calibration token and fills two bounded reservoirs
of real post-RoPE (q, k, v) sequences (calibration and held-out) that the searches read through
:func:`kvcal.search.objectives.sequence_caches`. Data parallel (:mod:`kvcal.capture.distributed`) and resumable
(:mod:`kvcal.capture.checkpoint`).
"""

from __future__ import annotations

import time

import torch

from kvcal.capture.checkpoint import Checkpointing, load_checkpoint, restore_checkpoint
from kvcal.capture.distributed import all_reduce_capture, dist_info
from kvcal.capture.hooks import attention_scaling, attention_window, capture_kv
from kvcal.capture.reservoir import SequenceReservoir
from kvcal.capture.result import CaptureResult
from kvcal.capture.stats import LayerStats
from kvcal.errors import KvcalError


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

    rank, world = dist_info()
    stats = LayerStats(num_layers, num_kv_heads, num_q_heads, head_dim)
    res_c = SequenceReservoir(max(reservoir, 1), search_tokens, seed)
    res_h = SequenceReservoir(max(heldout_reservoir, 1), search_tokens, seed + 1)
    result = CaptureResult(stats, res_c, res_h)
    try:  # per-layer RoPE tables for pre-RoPE key choices (None for models without a full rotary embedding)
        from kvcal.models import rope_tables

        result.rope = rope_tables(model)
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
        result.windows.setdefault(layer, attention_window(module))
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

    if checkpoint is not None and checkpoint.every and checkpoint.save is None:
        raise ValueError("Checkpointing.save is not set: give the writer that saves the state every N batches")
    t0 = time.perf_counter()
    batches = _batches(samples, batch_size, max_batch_tokens)
    start = 0
    if checkpoint is not None and checkpoint.resume:
        if world > 1:
            raise KvcalError("--resume is not supported under torchrun; resume with a single process")
        start, stats = restore_checkpoint(load_checkpoint(checkpoint), checkpoint.path, len(batches), result,
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
                checkpoint.save(checkpoint.path, {
                    "fingerprint": checkpoint.fingerprint, "next_batch": j + 1, "stats": stats.state_dict(),
                    "sink_stats": None if result.sink_stats is None else result.sink_stats.state_dict(),
                    "calib": res_c.state_dict(), "heldout": res_h.state_dict(), "scaling": dict(result.scaling),
                    "windows": dict(result.windows), "tokens": result.tokens, "rng": torch.get_rng_state(),
                })
    bar.close()
    if world > 1:
        all_reduce_capture(result)
        stats = result.stats
    missing = [i for i in range(num_layers) if int(stats.fired[i]) == 0]
    if missing:
        raise KvcalError(f"attention layers {missing} never fired during capture; this architecture's "
                         "attention does not go through transformers' attention interface (no KV cache?)")
    result.seconds = time.perf_counter() - t0
    return result
