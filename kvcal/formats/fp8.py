"""FP8 formats: saturating quantize / dequantize with a dequantization-multiplier ``scale``.

``q = saturate(x / scale)`` cast to the FP8 dtype; ``x̂ = q * scale``. Saturation clamps to
±max before the cast (torch's cast of an out-of-range value is not saturating). Maxima from the
OCP 8-bit floating point spec (e4m3fn 448, e5m2 57344) and AMD's FNUZ variant (e4m3fnuz 240).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FP8Format:
    """An FP8 storage format: ``name`` (kvcal/CLI string), torch ``dtype`` and finite ``max``."""

    name: str
    dtype: torch.dtype
    max: float


FP8_E4M3 = FP8Format("fp8_e4m3", torch.float8_e4m3fn, 448.0)
FP8_E4M3FNUZ = FP8Format("fp8_e4m3fnuz", torch.float8_e4m3fnuz, 240.0)
FP8_E5M2 = FP8Format("fp8_e5m2", torch.float8_e5m2, 57344.0)
FP8_FORMATS = {f.name: f for f in (FP8_E4M3, FP8_E4M3FNUZ, FP8_E5M2)}


#: How a serving engine writes FP8 cache values, which decides whether a clipped scale is safe there. A static
#: scale is searched for one of these (``calibration.cache_write`` in an artifact); sources: vLLM 0.33
#: ``csrc/quantization/fp8`` (GPU: round to nearest, clamped to ±448), ``csrc/cpu/cpu_attn_fp8.hpp`` (CPU build:
#: truncation toward zero), SGLang 0.5 ``(x / scale).to(float8)`` with no clamp (runtime-formats.md).
CACHE_WRITES = {
    "saturating": "round to nearest, saturating at the format's max (vLLM's GPU kernels, TensorRT-LLM, kvcal's "
                  "runtime)",
    "truncating": "round toward zero (vLLM's CPU build)",
    "non-saturating": "round to nearest without saturating: a value above max x scale becomes NaN (SGLang)",
}


def get_fp8_format(name: str) -> FP8Format:
    """Look up an FP8 format by name; raises ``ValueError`` listing the valid names."""
    try:
        return FP8_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown FP8 format {name!r}; choose one of {sorted(FP8_FORMATS)}") from None


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format = FP8_E4M3) -> torch.Tensor:
    """Quantize ``x`` (any float dtype, any shape) to FP8 storage.

    ``scale`` broadcasts against ``x`` (e.g. ``[1,1,1,1]`` or ``[1,H,1,1]`` for ``[B,H,S,D]``),
    positive and finite. Returns a tensor of ``fmt.dtype`` with ``x``'s shape. NaN inputs stay NaN
    (e4m3fn) — callers that must refuse them check first.
    """
    y = x.float() / scale.float()
    y = y.clamp(-fmt.max, fmt.max)
    return y.to(fmt.dtype)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize FP8 storage: ``q.float() * scale``, returned in ``dtype``."""
    return (q.float() * scale.float()).to(dtype)


def fake_quant_fp8(x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format = FP8_E4M3) -> torch.Tensor:
    """Quantize then dequantize (same shape and dtype as ``x``)."""
    return dequantize_fp8(quantize_fp8(x, scale, fmt), scale, x.dtype)
