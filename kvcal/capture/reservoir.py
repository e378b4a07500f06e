"""Bounded reservoir of real captured (q, k, v) sequences for the optimizer.

Algorithm R (Vitter 1985) over calibration samples with a seeded generator: after ``n`` samples
each one is kept with probability ``capacity / n``, so memory is bounded by ``capacity`` sequences
of at most ``max_tokens`` tokens whatever the corpus size. Each kept entry holds, per layer,
``q [H_q, T, D]``, ``k [H_kv, T, D]``, ``v [H_kv, T, D]`` (float32, CPU) for one sample's first
``T <= max_tokens`` real tokens (causal attention within the prefix is exact).
"""

from __future__ import annotations

import torch


class SequenceReservoir:
    """``capacity`` sequences (samples), each a list over layers of ``(q, k, v)`` tuples."""

    def __init__(self, capacity: int, max_tokens: int, seed: int = 0):
        if capacity <= 0 or max_tokens <= 1:
            raise ValueError("reservoir capacity must be > 0 and max_tokens > 1")
        self.capacity, self.max_tokens = capacity, max_tokens
        self.gen = torch.Generator().manual_seed(seed)
        self.items: list[tuple[int, list] | None] = []  # slot -> (sample index, per-layer tensors)
        self.seen = 0

    def offer(self) -> int | None:
        """Decide for the next sample: return the slot to fill (or append), or None to skip."""
        self.seen += 1
        if len(self.items) < self.capacity:
            self.items.append(None)  # reserved until put()
            return len(self.items) - 1
        j = int(torch.randint(0, self.seen, (1,), generator=self.gen))
        return j if j < self.capacity else None

    def put(self, slot: int, sample_index: int, layers: list) -> None:
        """Fill a slot returned by :meth:`offer` (several offers may precede their puts)."""
        self.items[slot] = (sample_index, layers)

    def sequences(self) -> list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
        """Kept sequences in sample order: ``[seq][layer] -> (q, k, v)``."""
        kept = [it for it in self.items if it is not None]
        return [layers for _, layers in sorted(kept, key=lambda t: t[0])]

    def state_dict(self) -> dict:
        return {"items": self.items, "seen": self.seen, "gen": self.gen.get_state(),
                "capacity": self.capacity, "max_tokens": self.max_tokens}

    def load_state_dict(self, sd: dict) -> None:
        self.items, self.seen = sd["items"], sd["seen"]
        self.gen.set_state(sd["gen"])
