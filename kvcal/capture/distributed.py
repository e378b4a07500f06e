"""Data-parallel capture under ``torchrun``: process-group setup and the all-reduce of a capture.

Rank ``r`` of ``N`` captures batches ``r, r+N, ...`` (:func:`kvcal.capture.run.run_capture`);
:func:`all_reduce_capture` combines the statistics (MAX/MIN exact, SUM for sums, counts and
histograms) and merges the reservoirs by priority, so every rank ends with one full pass.
"""

from __future__ import annotations

import torch

from kvcal.capture.reservoir import SequenceReservoir
from kvcal.capture.result import CaptureResult


def dist_info() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce_capture(result: CaptureResult) -> None:
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
    wins = [None] * dist.get_world_size()
    dist.all_gather_object(wins, result.windows)
    for d in wins:
        result.windows.update(d)
    toks = [None] * dist.get_world_size()
    dist.all_gather_object(toks, result.tokens)
    result.tokens = sum(toks)


def _ar(t: torch.Tensor, op) -> torch.Tensor:
    import torch.distributed as dist

    x = t.clone()
    dist.all_reduce(x, op=op)
    return x


def init_distributed(device: str) -> tuple[int, int]:
    """Join the ``torchrun`` process group when ``WORLD_SIZE > 1`` (gloo on CPU, nccl on CUDA)."""
    import torch.distributed as dist

    from kvcal.options import check_distributed_environment

    if check_distributed_environment() > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    return dist_info()


def finish_distributed() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
