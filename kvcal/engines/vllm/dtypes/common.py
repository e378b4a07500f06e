"""Constants and helpers shared by the vLLM dtype emulations: format maxima and block size, the kernels'
minimum scales and seeds, input checks, static scales, the float32 ``a·b + c`` of :data:`TRITON_FP_FUSION`, the
saturating fp8 cast and the Walsh–Hadamard butterfly."""

from __future__ import annotations

import torch

from kvcal.engines.vllm.dtypes import choices as _choices  # the GPU-only choices, read at call time
from kvcal.engines.vllm.dtypes.registry import VllmDTypeError

FP8_E4M3_MAX = 448.0
FP8_E5M2_MAX = 57344.0
E2M1_MAX = 6.0
NVFP4_BLOCK = 16
_PER_TOKEN_HEAD_MIN_SCALE = 1e-6  # triton_reshape_and_cache_flash.py, _reshape_cache_per_token_head
_INT4_MIN_SCALE = 1e-6  # int4_per_token_head.py, _reshape_cache_int4_kernel
_TQ_VALUE_MIN_SCALE = 1e-8  # triton_turboquant_store.py, _store_quantized_value
_TQ_NORM_EPS = 1e-8  # triton_turboquant_store.py, triton_turboquant_store: k / (norm + 1e-8)
_TQ_NC_EPS = 1e-16  # triton_turboquant_decode.py: 1 / sqrt(sum c^2 + 1e-16)
_RHT_SEED = 0x9E3779B9  # int4_per_token_head.py, _get_rht_signs(d, round_idx=0)


def _check_4d(x: torch.Tensor, what: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point():
        raise VllmDTypeError(f"{what} must be a floating-point tensor [B, H, S, D], got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")


def _f32(x) -> torch.Tensor:
    return x.to(torch.float32) if isinstance(x, torch.Tensor) else torch.tensor(float(x), dtype=torch.float32)


def _static_scale(scale, H: int, what: str) -> torch.Tensor:
    """A static scale (python float, scalar, ``[1]``, ``[H]`` or ``[H,1,1]``) as fp32 ``[1,H|1,1,1]``."""
    s = _f32(scale).reshape(-1)
    if s.numel() not in (1, H):
        raise VllmDTypeError(f"{what} must be a scalar (per tensor) or have {H} entries (one per KV head), "
                             f"got {s.numel()}")
    if not bool(torch.isfinite(s).all()) or bool((s <= 0).any()):
        raise VllmDTypeError(f"{what} must be positive and finite, got {s.tolist()}")
    return s.view(1, -1, 1, 1)


def _fma(a: torch.Tensor, b, c) -> torch.Tensor:
    """float32 ``a·b + c`` as :data:`TRITON_FP_FUSION` says the kernel computes it: two roundings, or
    one (the product of two float32 numbers is exact in float64, so only the float64 sum's rounding
    can differ from a true FMA — a tie after that rounding, probability ~2^-29)."""
    if not _choices.TRITON_FP_FUSION:
        return a * b + c
    bb = b.double() if isinstance(b, torch.Tensor) else b
    cc = c.double() if isinstance(c, torch.Tensor) else c
    return (a.double() * bb + cc).to(torch.float32)


def _cast_fp8(y: torch.Tensor, fmt_max: float, dtype: torch.dtype) -> torch.Tensor:
    """float32 → fp8 with round-to-nearest-even, saturating (see :data:`FP8_CAST_SATURATES`)."""
    if _choices.FP8_CAST_SATURATES:
        y = y.clamp(-fmt_max, fmt_max)
    return y.to(dtype)


