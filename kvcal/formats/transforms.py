"""Orthogonal transforms applied to one side of the cache before quantizing (torch only).

A side's ``transform`` (a :class:`Transform`; see :class:`kvcal.plan.SidePlan`) maps what attention reads into the
domain that is quantized, and back after dequantizing. Both are exact inverses up to float32
rounding, so the transform itself changes nothing; it only changes which values share a range.

* ``"none"``: quantize the cached tensor as attention reads it (post-RoPE keys; what engines do).
* ``"pre_rope"`` (keys): undo the rotary embedding, quantize the pre-RoPE key, re-apply RoPE after
  dequantizing. Pre-RoPE channels keep a fixed sign and scale over positions, so a per-channel
  range is not smeared by the rotation (KVQuant, Hooper et al. 2024, §3.2 "Pre-RoPE Key
  Quantization"). Measured on the embedded model (``shared/docs/prior-art.md``): 4-bit keys in
  32-token groups with a 16-bit sink, K-only mean KL 7.0e-3 post-RoPE vs 5.1e-3 pre-RoPE.
* ``"hadamard"`` (values, any side): multiply by the normalized ``D × D`` Sylvester–Hadamard
  matrix ``H/√D`` over the head dimension, quantize, multiply back (``H`` is symmetric and
  ``(H/√D)² = I``). Spreads outlier channels over the head so a per-token range fits better
  (QuaRot, Ashkboos et al. 2024, §4; prior-art: values per-token g64, 4-bit, V-only KL 5.6e-3 →
  4.1e-3).

RoPE convention: transformers' ``rotate_half`` layout (Llama, Mistral, Qwen2, Phi-3, Gemma):
``x_post = a·(x·cos(pθ) + rotate_half(x)·sin(pθ))`` with ``θ = inv_freq`` repeated twice over the
head dimension and ``a`` the rotary module's ``attention_scaling`` (1.0 for default RoPE).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import torch


class Transform(str, Enum):
    """A side's transform (module docstring); the value is the string configs and artifact metadata
    (``kv.transforms``) hold, and ``str()`` / f-strings give it too."""

    NONE = "none"
    PRE_ROPE = "pre_rope"
    HADAMARD = "hadamard"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def of(cls, value) -> Transform:
        """``value`` (a member or its string) as a member; ``ValueError`` naming the choices otherwise."""
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown transform {value!r}; choose one of {[t.value for t in cls]}") from None


def hadamard_matrix(d: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Normalized Sylvester–Hadamard matrix ``H_d / √d`` ``[d, d]`` (symmetric, orthogonal).

    Raises ``ValueError`` when ``d`` is not a power of two (no Sylvester construction)."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"the Hadamard transform needs a power-of-two head_dim, got {d}; use transform 'none'")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(d)).to(dtype)


def walsh_hadamard(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized Walsh–Hadamard transform (Sylvester order) over the last dim: ``x @ H_D`` for
    ``x [..., D]``, ``H_D`` the ±1 Sylvester matrix (``√D ·`` :func:`hadamard_matrix`), by log2(D) stages of
    elementwise radix-2 butterflies in ``x``'s dtype (same shape and dtype). kvcal's one Hadamard: the
    ``hadamard`` transform (:func:`fwht`) and vLLM's rotations (``int4_per_token_head``'s blockwise randomized
    Hadamard, TurboQuant's rotation; :mod:`kvcal.engines.vllm.dtypes`) all run these butterflies.
    Raises ``ValueError`` when ``D`` is not a power of two."""
    d = x.shape[-1]
    if d < 1 or d & (d - 1):
        raise ValueError(f"the Hadamard transform needs a power-of-two head_dim, got {d}; use transform 'none'")
    lead = x.shape[:-1]
    h = 1
    while h < d:
        y = x.reshape(*lead, d // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        x = torch.stack([a + b, a - b], dim=-2).reshape(*lead, d)
        h *= 2
    return x


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Normalized fast Walsh–Hadamard transform over the last dim: ``x @ hadamard_matrix(D)`` for
    ``x [..., D]`` (same shape and dtype): :func:`walsh_hadamard`, then one multiply by ``1/√D``.

    Why not the matrix product: a matmul's summation order depends on the BLAS kernel, which
    differs between a 1-token decode step and a whole sequence and between CPUs (AVX2 / AVX-512 /
    default), and an ulp of difference can move a quantized code across a rounding boundary.
    Elementwise IEEE adds are exactly rounded, so every token row comes out bit-identical whatever
    the batch, sequence length or CPU. Raises ``ValueError`` when ``D`` is not a power of two."""
    return walsh_hadamard(x) * (1.0 / math.sqrt(x.shape[-1]))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[-x2, x1]`` for ``x = [x1, x2]`` split in halves over the last dim (transformers' layout)."""
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


@dataclass(frozen=True)
class RopeTable:
    """What is needed to undo / re-apply a model's rotary embedding at known positions.

    ``inv_freq``: float32 ``[D/2]`` (the rotary module's buffer, rope scaling already applied);
    ``attention_scaling``: float multiplier of cos/sin (1.0 unless YaRN-style scaling)."""

    inv_freq: torch.Tensor
    attention_scaling: float = 1.0

    def __post_init__(self):
        f = self.inv_freq
        if not isinstance(f, torch.Tensor) or f.ndim != 1 or f.numel() == 0 or not torch.isfinite(f).all():
            raise ValueError("RopeTable.inv_freq must be a finite 1-D tensor [head_dim/2]")
        if not (math.isfinite(self.attention_scaling) and self.attention_scaling > 0):
            raise ValueError(f"RopeTable.attention_scaling must be > 0, got {self.attention_scaling}")

    @property
    def head_dim(self) -> int:
        return 2 * self.inv_freq.numel()

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` float32 ``[S, D]`` for integer ``positions [S]``; angles in float32 as
        transformers' rotary modules compute them, so un-rotating recovers the model's pre-RoPE key."""
        ang = positions.float()[:, None] * self.inv_freq.float()[None, :].to(positions.device)
        emb = torch.cat([ang, ang], dim=-1)
        return emb.cos(), emb.sin()

    def _cs(self, x: torch.Tensor, start: int):
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"RoPE table covers head_dim {self.head_dim}, tensor has {x.shape[-1]}")
        c, s = self.cos_sin(torch.arange(start, start + x.shape[-2], device=self.inv_freq.device))
        return c.to(x.device), s.to(x.device)

    def to_pre_rope(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Undo RoPE on post-RoPE keys ``x [..., S, D]`` at positions ``start .. start+S-1``
        (float32 result): ``(x·cos − rotate_half(x)·sin) / a``."""
        c, s = self._cs(x, start)
        x = x.float()
        return (x * c - rotate_half(x) * s) / self.attention_scaling

    def to_post_rope(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Apply RoPE to pre-RoPE keys ``x [..., S, D]`` at positions ``start ..`` (float32):
        ``a·(x·cos + rotate_half(x)·sin)``."""
        c, s = self._cs(x, start)
        x = x.float()
        return (x * c + rotate_half(x) * s) * self.attention_scaling


def apply_transform(name: Transform, x: torch.Tensor, *, rope: RopeTable | None = None, start: int = 0,
                    inverse: bool = False) -> torch.Tensor:
    """Map ``x [B, H, S, D]`` into the quantized domain of transform ``name`` (``inverse=True``: back).

    Returns float32. ``start``: position of ``x``'s first token (``pre_rope`` only). Raises
    ``ValueError`` for an unknown transform, a ``pre_rope`` without ``rope``, or a head_dim the
    transform does not support."""
    match Transform.of(name):
        case Transform.NONE:
            return x.float()
        case Transform.HADAMARD:
            return fwht(x.float())  # symmetric and involutive: the inverse is the same transform
        case Transform.PRE_ROPE:
            if rope is None:
                raise ValueError("transform 'pre_rope' needs the model's RoPE table (rope=)")
            return rope.to_post_rope(x, start) if inverse else rope.to_pre_rope(x, start)


__all__ = ["Transform", "RopeTable", "fwht", "hadamard_matrix", "rotate_half", "apply_transform"]
