"""The held-out guard of a per-tensor static-scale search (torch only).

Shared by the vLLM searches (:mod:`kvcal.engines.vllm.search_fp8` per tensor, :mod:`kvcal.engines.vllm.search_nvfp4`):
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
    num_c: torch.Tensor | None = None  # [C, H] float64: every row's calibration-split errors


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
    num_c = errors(calib, scales)
    tot_c = num_c.sum(1)
    best = int(tot_c.argmin())
    cand = [best, 0, 1]
    tot_h = errors(held, scales[cand]).sum(1)
    pick = int(tot_h.argmin())
    final = cand[pick]
    fig_h = {"chosen": float(tot_h[pick] / den_h), "absmax": float(tot_h[1] / den_h), "unity": float(tot_h[2] / den_h)}
    fig_c = {"chosen": float(tot_c[final] / den_c), "absmax": float(tot_c[0] / den_c), "unity": float(tot_c[1] / den_c)}
    return GuardedPick(index=final, heldout=fig_h, calib=fig_c, num_c=num_c)


@dataclass
class ClipFreePick:
    """The clip-free scale of one layer and side: what an engine that casts to FP8 *without saturating*
    (SGLang: a value above ``448 x scale`` becomes NaN) can serve. ``index`` ``[H]``: the chosen candidate row
    per column; ``scale`` float32 ``[H]``; ``heldout`` / ``calib``: summed (un-normalized) errors of that choice
    on the guard / calibration split, summed over the columns (the caller normalizes them as it normalizes its
    own figures)."""

    index: torch.Tensor
    scale: torch.Tensor
    heldout: float
    calib: float


def clip_free_choice(errors: Callable[[list, torch.Tensor], torch.Tensor], calib: list, heldout: list,
                     scales: torch.Tensor, amax: torch.Tensor, fmt_max: float, num_c: torch.Tensor,
                     per_head: bool) -> ClipFreePick:
    """The searched scale restricted to candidates that clip nothing the calibration observed.

    ``scales`` ``[C, H]`` candidate rows (row 0 the amax rule ``amax / fmt_max``, which never clips);
    ``amax`` ``[H]`` the absmax each column's scale covers (per-tensor: the same value in every column);
    ``num_c`` ``[C, H]`` float64, the calibration-split errors of every row (already computed by the search);
    ``errors(caches, rows)`` as :func:`guarded_tensor_choice` takes it. A row is clip-free in a column when
    ``scale x fmt_max >= amax`` (relative tolerance 1e-6 for the float32 rounding of ``amax / fmt_max``).
    Selection as the search's own: the best clip-free row on the calibration split (per column for
    ``per_head``, by the column sum otherwise), then the lower held-out error of {that row, the amax rule}
    (ties keep the calibration best). ``heldout`` empty: the guard runs on ``calib``."""
    held = heldout if heldout else calib
    C, H = scales.shape
    free = scales.double() * fmt_max >= amax.double().reshape(1, H) * (1 - 1e-6)  # [C, H]
    free[0] = True  # the amax rule itself
    masked = torch.where(free, num_c, torch.full_like(num_c, float("inf")))
    if per_head:
        best = masked.argmin(0)  # [H]
        cand = torch.stack([best, torch.zeros(H, dtype=torch.long)])  # [2, H]
        num_h = errors(held, scales.gather(0, cand))  # [2, H]
        pick = num_h.argmin(0)
        index = cand.gather(0, pick[None])[0]
        h = float(num_h.gather(0, pick[None])[0].sum())
        c = float(num_c.gather(0, index[None])[0].sum())
    else:
        best = int(masked.sum(1).argmin())
        num_h = errors(held, scales[[best, 0]]).sum(1)
        pick = int(num_h.argmin())
        index = torch.full((H,), [best, 0][pick], dtype=torch.long)
        h, c = float(num_h[pick]), float(num_c[index[0]].sum())
    return ClipFreePick(index=index, scale=scales.gather(0, index[None])[0].float(), heldout=h, calib=c)


__all__ = ["GuardedPick", "guarded_tensor_choice", "ClipFreePick", "clip_free_choice"]
