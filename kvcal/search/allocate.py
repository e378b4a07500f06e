"""Per-layer K/V format allocation under an average bit budget that counts every byte (torch only).

Each layer ``l`` and side ``s`` picks one candidate spec ``c`` from a menu. Its cost is the exact
number of bytes the runtime cache allocates for that layer's side at a reference context ``T``
(:func:`kvcal.formats.memory.side_cache_bytes`: packed payload, per-token / per-group scales and
zero points, 16-bit sink tokens and residual window, per-layer metadata such as static scales,
clip ratios and centering means), so the average

    bits = 8 · Σ_{l,s} cost(l, s, c_ls) / (T · L · 2 · H · D)

(a sliding-window layer holds at most ``W − 1`` tokens whatever ``T``: its cost and its share of the
denominator count those, :func:`held_elements`) is exactly what :func:`kvcal.formats.memory.cache_bytes` reports for the chosen per-layer configs.
Its sensitivity ``e(l, s, c)`` is the measured held-out relative attention-output error of that
layer and side with that spec after its own parameter search (one unit for keys and values, see
:mod:`kvcal.search.objectives`), and the allocation minimizes ``Σ e`` subject to
``bits <= budget``: a multiple-choice knapsack solved by Lagrangian relaxation (bisection on the
price of a byte: each item independently minimizes ``e + λ·cost``), followed by greedy upgrades
with the best error reduction per extra byte while they fit. Keys may end up with more bits than
values (KVTuner, KV-AdaQuant); nothing forces it.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from kvcal.formats.memory import side_cache_bytes
from kvcal.formats.spec import TensorQuantSpec


@dataclass(frozen=True)
class Item:
    """One (layer, side) with its candidate specs, their exact costs (bytes) and errors."""

    layer: int
    side: str
    specs: tuple[TensorQuantSpec, ...]
    costs: tuple[int, ...]
    errors: tuple[float, ...]


def side_cost(spec: TensorQuantSpec, H: int, D: int, context: int, sinks: int = 0, residual_window: int = 0,
              static_extra: int = 0, sliding_window: int = 0) -> int:
    """Exact bytes of one layer's side at ``context`` tokens, batch 1 (``static_extra``: bytes of
    per-layer metadata the spec's accounting does not include, e.g. a key-centering mean;
    ``sliding_window`` ``W > 0``: a sliding-window layer, which holds at most about ``W - 1`` tokens,
    :func:`kvcal.formats.memory.sliding_held`)."""
    b = side_cache_bytes(spec, H, D, context, 1, residual_window, sinks, sliding_window=sliding_window)
    return sum(b.values()) + static_extra


def held_elements(num_layers: int, H: int, D: int, context: int, windows=None) -> int:
    """Cached K and V elements at ``context`` tokens, batch 1: ``context`` tokens per full-attention layer, at
    most ``W - 1`` per sliding-window layer (``windows``: per-layer ``W``, 0 for full attention; ``None``: all
    full) — what a 16-bit cache holds (:func:`kvcal.formats.memory.sliding_held`), the unit of ``--bits``."""
    if not windows:
        return context * num_layers * 2 * H * D
    if len(windows) != num_layers:
        raise ValueError(f"{len(windows)} layer windows for {num_layers} layers")
    return sum(min(context, w - 1) if w else context for w in windows) * 2 * H * D


def budget_bytes(bits: float, num_layers: int, H: int, D: int, context: int, windows=None) -> Fraction:
    """Bytes allowed by an average of ``bits`` per cached element at ``context`` tokens (elements the cache
    holds: :func:`held_elements`, so a sliding-window layer's budget is its window's, not the context's)."""
    return Fraction(str(bits)) * held_elements(num_layers, H, D, context, windows) / 8


def average_bits(total_bytes: int, num_layers: int, H: int, D: int, context: int, windows=None) -> float:
    """Bits per cached element (:func:`held_elements`) of ``total_bytes`` at ``context`` tokens."""
    return 8.0 * total_bytes / held_elements(num_layers, H, D, context, windows)


def allocate(items: list[Item], budget: Fraction | int) -> list[int]:
    """Choice index per item minimizing ``Σ errors`` with ``Σ costs <= budget``.

    Raises ``ValueError`` when even the cheapest choices exceed the budget, or for a non-finite error."""
    import math

    for it in items:
        if not all(math.isfinite(e) for e in it.errors):
            raise ValueError(f"layer {it.layer} {it.side.upper()}: allocation errors must be finite, got {it.errors}")
    cheapest = sum(min(it.costs) for it in items)
    if cheapest > budget:
        raise ValueError(f"the bit budget is below the cheapest allocation ({cheapest} > {float(budget):.0f} bytes)")

    def pick(lam: float) -> list[int]:
        return [min(range(len(it.costs)), key=lambda j, it=it: (it.errors[j] + lam * it.costs[j], it.costs[j]))
                for it in items]

    def cost(ch):
        return sum(it.costs[j] for it, j in zip(items, ch, strict=True))

    lo, hi = 0.0, 1.0
    while cost(pick(hi)) > budget:
        hi *= 4.0
        if hi > 1e30:
            break
    best = pick(hi)
    if cost(pick(lo)) <= budget:
        best = pick(lo)
    else:
        for _ in range(100):
            mid = (lo + hi) / 2
            ch = pick(mid)
            if cost(ch) <= budget:
                hi, best = mid, ch
            else:
                lo = mid
    # greedy upgrades that still fit
    total = cost(best)
    while True:
        cand = None
        for i, it in enumerate(items):
            j0 = best[i]
            for j in range(len(it.costs)):
                dc, de = it.costs[j] - it.costs[j0], it.errors[j0] - it.errors[j]
                if de <= 0 or total + dc > budget:
                    continue
                score = de / max(dc, 1e-9) if dc > 0 else float("inf")
                if cand is None or score > cand[0]:
                    cand = (score, i, j, dc)
        if cand is None:
            break
        _, i, j, dc = cand
        best[i] = j
        total += dc
    assert total <= budget
    return best


__all__ = ["Item", "allocate", "side_cost", "budget_bytes", "average_bits"]
