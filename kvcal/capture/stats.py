"""Streaming statistics of K/V (and Q) activations: update / merge / state_dict / finalize.

Per layer and side, over every valid (unpadded) token, per head and channel (``[H, D]``):
absmax, min, max, sum, sum of squares, count; plus a per-head histogram of ``|x|`` on fixed
log2-spaced bins (so histograms from different chunks/ranks merge exactly). Memory is
``O(layers · H · D + layers · H · bins)``: it does not grow with the corpus. Chunked updates
merged together equal one pass exactly for max/min/counts/histograms; sums to float64 rounding.
(Habit from torchao observers, minus their keep-the-last-batch bug.)
"""

from __future__ import annotations

import torch

# |x| histogram bin edges: 0, then 2^-24 .. 2^24 in quarter-octave steps (193 edges)
HIST_EDGES = torch.cat([torch.zeros(1, dtype=torch.float64), torch.exp2(torch.arange(-24, 24.001, 0.25, dtype=torch.float64))])


def histogram_abs(x: torch.Tensor, bins: int) -> torch.Tensor:
    """Counts of ``|x|`` per row on :data:`HIST_EDGES` (bin 0 = [0, 2^-24), then quarter octaves).

    ``x`` ``[H, N]`` float; returns int64 ``[H, bins]``. Uses ``floor(4·log2|x|) + 97`` which equals
    bucketizing on the edges (edges are exact powers of 2^(1/4) in float64 but the floor is taken
    in float32: a value within float32 rounding of an edge may land one bin over).
    """
    a = x.abs().float()
    idx = torch.floor(torch.log2(a) * 4).add_(97).clamp_(0, bins - 1).long()  # log2(0) = -inf -> bin 0
    return torch.zeros(x.shape[0], bins, dtype=torch.int64).scatter_add_(1, idx, torch.ones_like(idx))


class TensorStats:
    """Running statistics of one activation tensor family (e.g. layer 3 keys).

    ``update(x, mask)``: ``x`` ``[B, H, S, D]`` float; ``mask`` ``[B, S]`` bool (True = real token)
    or None. Statistics are float64 ``[H, D]`` (histogram int64 ``[H, bins]``).
    """

    FIELDS = ("absmax", "min", "max", "sum", "sumsq", "count", "hist")

    def __init__(self, num_heads: int, head_dim: int, track_hist: bool = True, track_moments: bool = True):
        H, D = num_heads, head_dim
        self.track_hist = track_hist
        self.track_moments = track_moments
        self.num_heads, self.head_dim = H, D
        self.absmax = torch.zeros(H, D, dtype=torch.float64)
        self.min = torch.full((H, D), float("inf"), dtype=torch.float64)
        self.max = torch.full((H, D), float("-inf"), dtype=torch.float64)
        self.sum = torch.zeros(H, D, dtype=torch.float64)
        self.sumsq = torch.zeros(H, D, dtype=torch.float64)
        self.count = torch.zeros((), dtype=torch.int64)
        self.hist = torch.zeros(H, len(HIST_EDGES) - 1, dtype=torch.int64)

    def update(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        B, H, S, D = x.shape
        if (H, D) != (self.num_heads, self.head_dim):
            raise ValueError(f"expected [B,{self.num_heads},S,{self.head_dim}], got {list(x.shape)}")
        xt = x.detach().to("cpu", torch.float32).permute(1, 0, 2, 3).reshape(H, B * S, D)  # [H, N, D]
        if mask is not None:
            keep = mask.to("cpu").reshape(B * S).bool()
            if not bool(keep.all()):
                xt = xt[:, keep]
        if xt.shape[1] == 0:
            return
        # min/max/absmax are exact in the input precision; sums accumulate in float64
        mn, mx = xt.amin(1).double(), xt.amax(1).double()
        self.absmax = torch.maximum(self.absmax, torch.maximum(mx.abs(), mn.abs()))
        self.min = torch.minimum(self.min, mn)
        self.max = torch.maximum(self.max, mx)
        if self.track_moments:
            xd = xt.double()
            self.sum += xd.sum(1)
            self.sumsq += (xd * xd).sum(1)
        self.count += xt.shape[1]
        if self.track_hist:
            self.hist += histogram_abs(xt.reshape(H, -1), self.hist.shape[1])

    def merge(self, other: TensorStats) -> TensorStats:
        self.absmax = torch.maximum(self.absmax, other.absmax)
        self.min = torch.minimum(self.min, other.min)
        self.max = torch.maximum(self.max, other.max)
        self.sum += other.sum
        self.sumsq += other.sumsq
        self.count += other.count
        self.hist += other.hist
        return self

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f: getattr(self, f).clone() for f in self.FIELDS}

    @classmethod
    def from_state_dict(cls, sd: dict[str, torch.Tensor]) -> TensorStats:
        H, D = sd["absmax"].shape
        s = cls(H, D, track_hist=bool(sd["hist"].any()), track_moments=bool(sd["sumsq"].any()))
        for f in cls.FIELDS:
            setattr(s, f, sd[f].clone())
        return s

    def finalize(self) -> dict[str, torch.Tensor]:
        """Summary: per [H, D] absmax/min/max/mean/std, per-head absmax ``[H]``, tensor absmax ``[]``."""
        n = max(int(self.count), 1)
        mean = self.sum / n
        var = (self.sumsq / n - mean * mean).clamp_min(0)
        return {
            "absmax": self.absmax, "min": self.min, "max": self.max, "mean": mean, "std": var.sqrt(),
            "head_absmax": self.absmax.amax(1), "tensor_absmax": self.absmax.amax(),
            "count": self.count, "hist": self.hist,
        }


class LayerStats:
    """:class:`TensorStats` for keys, values and queries of every layer: ``stats[side][layer]``."""

    def __init__(self, num_layers: int, num_kv_heads: int, num_q_heads: int, head_dim: int):
        self.k = [TensorStats(num_kv_heads, head_dim) for _ in range(num_layers)]
        self.v = [TensorStats(num_kv_heads, head_dim) for _ in range(num_layers)]
        # queries: ranges only (q_scale export, reports); moments and histograms are for K/V
        self.q = [TensorStats(num_q_heads, head_dim, track_hist=False, track_moments=False) for _ in range(num_layers)]
        self.fired = torch.zeros(num_layers, dtype=torch.int64)

    def update(self, layer: int, q, k, v, mask=None) -> None:
        self.q[layer].update(q, mask)
        self.k[layer].update(k, mask)
        self.v[layer].update(v, mask)
        self.fired[layer] += 1

    def merge(self, other: LayerStats) -> LayerStats:
        for side in ("q", "k", "v"):
            for a, b in zip(getattr(self, side), getattr(other, side), strict=True):
                a.merge(b)
        self.fired += other.fired
        return self

    def state_dict(self) -> dict:
        return {
            "fired": self.fired.clone(),
            **{side: [s.state_dict() for s in getattr(self, side)] for side in ("q", "k", "v")},
        }

    @classmethod
    def from_state_dict(cls, sd: dict) -> LayerStats:
        L = len(sd["k"])
        Hk, D = sd["k"][0]["absmax"].shape
        Hq = sd["q"][0]["absmax"].shape[0]
        obj = cls(L, Hk, Hq, D)
        for side in ("q", "k", "v"):
            setattr(obj, side, [TensorStats.from_state_dict(s) for s in sd[side]])
        obj.fired = sd["fired"].clone()
        return obj
