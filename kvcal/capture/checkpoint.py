"""Resumable capture: the checkpoint identity, its checked load and the state restore (torch only).

A checkpoint is a ``torch.save`` of plain data (tensors, numbers, strings, containers) written every N
capture batches by :func:`kvcal.capture.run.run_capture` through :attr:`Checkpointing.save` (the caller
binds the atomic, output-safe writer: ``kvcal.calibrate.save_checkpoint``); it is read back with
``weights_only=True``, so a planted file cannot run code, and refused unless its run fingerprint matches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvcal.capture.stats import LayerStats
from kvcal.errors import KvcalError


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
    #: ``save(path, state)`` writes ``state`` to ``path`` atomically (required when ``every > 0``)
    save: Callable[[str, dict], None] | None = None


def load_checkpoint(ck: Checkpointing) -> dict:
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


def restore_checkpoint(ck: dict, path: str, n_batches: int, result, res_c, res_h) -> tuple[int, object]:
    """Restore the capture state from checkpoint dict ``ck`` (already identified by :func:`load_checkpoint`)
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
        windows = {int(k): int(v) for k, v in dict(ck.get("windows", {})).items()}
        torch.set_rng_state(ck["rng"])
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as e:
        raise KvcalError(f"--resume: checkpoint {path} is malformed ({type(e).__name__}: {e}); delete it and start "
                         "over") from None
    result.stats = stats
    if sink_stats is not None:
        result.sink_stats = sink_stats
    result.scaling.update(scaling)
    result.windows.update(windows)
    result.tokens = ck["tokens"]
    return start, stats
