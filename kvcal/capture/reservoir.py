"""Bounded reservoir of real captured (q, k, v) sequences for the optimizer.

Bottom-k priority sampling: every sample index ``i`` gets a pseudo-random priority
``u(seed, i) ∈ [0, 1)`` (splitmix64 hash) and the reservoir keeps the ``capacity`` samples with
the smallest priorities. That is a uniform random subset of fixed size (like Vitter's Algorithm
R) but it does not depend on the order samples arrive in, so reservoirs filled by different
data-parallel ranks, or before and after a resumed run, merge into exactly the one a single pass
would keep. Memory is bounded by ``capacity`` sequences of at most ``max_tokens`` tokens,
whatever the corpus size. Each kept entry holds, per layer, ``q [H_q, T, D]``,
``k [H_kv, T, D]``, ``v [H_kv, T, D]`` (float32, CPU) for one sample's first
``T <= max_tokens`` real tokens (causal attention within the prefix is exact).
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def priority(seed: int, index: int) -> float:
    """splitmix64 of ``(seed, index)`` mapped to ``[0, 1)`` (53 bits)."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


class SequenceReservoir:
    """Keeps the ``capacity`` samples of lowest priority: ``{sample index: per-layer tensors}``."""

    def __init__(self, capacity: int, max_tokens: int, seed: int = 0):
        if capacity <= 0 or max_tokens <= 1:
            raise ValueError("reservoir capacity must be > 0 and max_tokens > 1")
        self.capacity, self.max_tokens, self.seed = capacity, max_tokens, seed
        self.items: dict[int, list] = {}
        self.seen = 0

    def priority(self, index: int) -> float:
        return priority(self.seed, index)

    def offer(self, index: int) -> bool:
        """Would sample ``index`` be kept now? (Callers then capture it and :meth:`put` it.)"""
        self.seen += 1
        if len(self.items) < self.capacity:
            return True
        return self.priority(index) < max(self.priority(i) for i in self.items)

    def put(self, index: int, layers: list) -> None:
        """Insert a sample's per-layer ``(q, k, v)``; evicts the highest priority beyond capacity."""
        self.items[index] = layers
        while len(self.items) > self.capacity:
            del self.items[max(self.items, key=self.priority)]

    def merge(self, other: SequenceReservoir) -> SequenceReservoir:
        """Union then keep the lowest priorities: equals one reservoir over both sample sets."""
        for i, layers in other.items.items():
            self.put(i, layers)
        self.seen += other.seen
        return self

    def sequences(self) -> list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
        """Kept sequences in sample order: ``[seq][layer] -> (q, k, v)``."""
        return [self.items[i] for i in sorted(self.items)]

    def indices(self) -> list[int]:
        return sorted(self.items)

    def state_dict(self) -> dict:
        return {"items": self.items, "seen": self.seen, "seed": self.seed,
                "capacity": self.capacity, "max_tokens": self.max_tokens}

    def load_state_dict(self, sd: dict) -> None:
        if (sd["capacity"], sd["max_tokens"], sd["seed"]) != (self.capacity, self.max_tokens, self.seed):
            raise ValueError("reservoir checkpoint was made with different capacity/max_tokens/seed")
        self.items, self.seen = dict(sd["items"]), sd["seen"]
