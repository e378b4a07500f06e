"""The held-out guard of a per-tensor static-scale search (torch only).

Shared by the vLLM searches (:mod:`kvcal.search.vllm_fp8` per tensor, :mod:`kvcal.search.vllm_nvfp4`):
candidates are scored on the calibration split, the best one is compared on the held-out split with
the two baselines (candidate 0, the amax rule, and candidate 1, unity = 1.0, the scale an engine uses
without checkpoint scales), and the lowest held-out error wins (the first of equal errors, so the
calibration best is kept on a tie). So the chosen scale is never worse on the held-out check than
either baseline. (:func:`kvcal.search.static_scales.choose_static_fp8` applies the same rule.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class GuardedPick:
    """Outcome of :func:`guarded_tensor_choice`. ``index``: the chosen candidate row; ``heldout`` /
    ``calib``: normalized errors ``{"chosen", "absmax", "unity"}`` on each split."""

    index: int
    heldout: dict[str, float]
    calib: dict[str, float]


def guarded_tensor_choice(errors: Callable[[list, torch.Tensor], torch.Tensor], calib: list, heldout: list,
                          scales: torch.Tensor, den_c: float, den_h: float) -> GuardedPick:
    """Choose one per-tensor scale among candidate rows ``scales`` ``[C, H]`` (row 0 the amax rule, row 1
    unity; for a per-tensor scale every column holds the same value).

    ``errors(caches, rows)``: summed (not yet normalized) error of each row of ``rows`` ``[c, H]`` over
    ``caches``, float64 ``[c, H]`` (summed over the columns for the per-tensor total). ``heldout`` empty:
    the guard runs on ``calib``. ``den_c``/``den_h``: the normalizers of the calibration / guard split
    (queries for a KL, ``Σ‖PV‖²`` for the output error). Errors compare as float64; ties keep the lower
    row index of ``[best, absmax, unity]``."""
    held = heldout if heldout else calib
    tot_c = errors(calib, scales).sum(1)
    best = int(tot_c.argmin())
    cand = [best, 0, 1]
    tot_h = errors(held, scales[cand]).sum(1)
    pick = int(tot_h.argmin())
    final = cand[pick]
    fig_h = {"chosen": float(tot_h[pick] / den_h), "absmax": float(tot_h[1] / den_h), "unity": float(tot_h[2] / den_h)}
    fig_c = {"chosen": float(tot_c[final] / den_c), "absmax": float(tot_c[0] / den_c), "unity": float(tot_c[1] / den_c)}
    return GuardedPick(index=final, heldout=fig_h, calib=fig_c)


__all__ = ["GuardedPick", "guarded_tensor_choice"]
