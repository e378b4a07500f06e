"""The dtypes that compute their scales per token and KV head when vLLM writes the cache:
``fp8_per_token_head`` / ``int8_per_token_head`` (fp32 scale per token-head) and ``int4_per_token_head``
(randomized Hadamard transform, asymmetric 4-bit codes, the zero point in the scale's low mantissa)."""

from __future__ import annotations

from functools import lru_cache

import torch

from kvcal.engines.vllm.dtypes import choices as _choices  # the GPU-only choices, read at call time
from kvcal.engines.vllm.dtypes.common import (
    _INT4_MIN_SCALE,
    _PER_TOKEN_HEAD_MIN_SCALE,
    _RHT_SEED,
    FP8_E4M3_MAX,
    _cast_fp8,
    _check_4d,
    _fma,
)
from kvcal.engines.vllm.dtypes.registry import VllmDTypeError
from kvcal.formats.transforms import walsh_hadamard


# ---- fp8 / int8 per token-head (dynamic) --------------------------------------------------------
def per_token_head_quantize(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_per_token_head`` / ``int8_per_token_head`` cache write.

    ``x`` [B, H_kv, S, D]; ``kind`` ``"fp8"`` or ``"int8"``. Per (token, head):
    ``scale = max(amax / QMAX, 1e-6)`` in fp32 (QMAX 448 for e4m3fn, 127 for int8), codes =
    ``x · (1/scale)``; int8 adds ±0.5 (round half away from zero), clamps to [-128, 127] and
    truncates (the int store); fp8 clamps to ±448 and casts (round to nearest even). Returns
    ``(codes [B,H,S,D] float8_e4m3fn|int8, scale fp32 [B,H,S,1])``. Follows
    ``v1/attention/ops/triton_reshape_and_cache_flash.py`` ``_reshape_cache_per_token_head``."""
    _check_4d(x, "x")
    if kind not in ("fp8", "int8"):
        raise VllmDTypeError(f"kind must be 'fp8' or 'int8', got {kind!r}")
    qmax, qmin = (FP8_E4M3_MAX, -FP8_E4M3_MAX) if kind == "fp8" else (127.0, -128.0)
    xf = x.to(torch.float32)
    scale = torch.clamp_min(xf.abs().amax(dim=-1, keepdim=True) / qmax, _PER_TOKEN_HEAD_MIN_SCALE)
    inv = 1.0 / scale
    y = xf * inv
    if kind == "int8":
        y = torch.where(y >= 0, _fma(xf, inv, 0.5), _fma(xf, inv, -0.5)).clamp(qmin, qmax)
        return y.trunc().to(torch.int8), scale
    return _cast_fp8(y, qmax, torch.float8_e4m3fn), scale


def per_token_head_fake_quant(x: torch.Tensor, kind: str) -> torch.Tensor:
    """:func:`per_token_head_quantize` then ``code · scale`` (fp32 [B,H,S,D])."""
    codes, scale = per_token_head_quantize(x, kind)
    return codes.to(torch.float32) * scale


# ---- int4_per_token_head (RHT + asymmetric 4-bit, zero point in the scale's mantissa) ------------
def _largest_pow2_divisor(n: int) -> int:
    return n & (-n)


@lru_cache(maxsize=16)
def rht_signs(d: int) -> torch.Tensor:
    """The ±1 sign vector of vLLM's int4 RHT for a block of ``d`` channels (fp32 [d]):
    ``2·bernoulli(0.5) − 1`` from a CPU ``torch.Generator`` seeded ``0x9E3779B9``
    (``int4_per_token_head.py`` ``_get_rht_signs``, round 0)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(_RHT_SEED)
    return 2.0 * torch.bernoulli(torch.full((d,), 0.5), generator=gen) - 1.0


def rht(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """vLLM's single randomized Hadamard transform ``H·diag(s)·x`` along the last dim
    (``int4_per_token_head.py`` ``single_rht``): blockwise over ``b`` = the largest power-of-2
    divisor of ``D``, unnormalized (norm ``sqrt(b)``); ``inverse`` gives ``diag(s)·H·x`` (so
    ``rht(rht(x), inverse=True) = b·x``). Computed in :data:`INT4_RHT_WORK_DTYPE`."""
    d = x.shape[-1]
    b = _largest_pow2_divisor(d)
    y = x.to(_choices.INT4_RHT_WORK_DTYPE).reshape(*x.shape[:-1], d // b, b)
    s = rht_signs(b).to(y.dtype)
    y = walsh_hadamard(y) * s if inverse else walsh_hadamard(y * s)
    return y.reshape(x.shape)


def int4_per_token_head_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``int4_per_token_head`` cache write.

    ``x`` [B, H_kv, S, D] (D even). The RHT'd row ``r = rht(x)`` is rounded back to ``x``'s dtype
    (``reshape_and_cache_int4``), then per (token, head), all fp32: ``scale = max((max−min)/15,
    1e-6)``, ``zp = clamp(round_half_away(−min/scale), 0, 15)``, codes
    ``clamp(round_half_away(r·(1/scale) + zp), 0, 15)``; the stored scale is the fp32 scale with
    its 4 low mantissa bits replaced by ``zp`` (``_reshape_cache_int4_kernel``). Returns
    ``(codes uint8 [B,H,S,D] in [0,15] (unpacked), stored_scale fp32 [B,H,S,1])``."""
    _check_4d(x, "x")
    if x.shape[-1] % 2:
        raise VllmDTypeError(f"int4_per_token_head needs an even head_dim, got {x.shape[-1]}")
    r = rht(x).to(x.dtype).to(torch.float32)
    lo = r.amin(dim=-1, keepdim=True)
    hi = r.amax(dim=-1, keepdim=True)
    scale = torch.clamp_min((hi - lo) / 15.0, _INT4_MIN_SCALE)

    def round_half_away(t):
        return torch.where(t >= 0, t + 0.5, t - 0.5).trunc()

    zp = round_half_away(-lo / scale).clamp(0.0, 15.0)
    codes = round_half_away(_fma(r, 1.0 / scale, zp)).clamp(0.0, 15.0)
    bits = scale.view(torch.int32)
    stored = ((bits & -16) | zp.to(torch.int32)).view(torch.float32)
    return codes.to(torch.uint8), stored


def int4_per_token_head_dequantize(codes: torch.Tensor, stored_scale: torch.Tensor, *, rotated: bool = False
                                   ) -> torch.Tensor:
    """Inverse of :func:`int4_per_token_head_quantize`: ``(code − zp) · scale`` with ``zp`` the
    stored scale's 4 low mantissa bits and ``scale`` the stored scale with them cleared (as the
    attention kernel ``_attn_packed`` reads them), in the rotated basis if ``rotated``; otherwise
    mapped back to the original basis by ``rht(·, inverse=True) / b`` (what attention does to the
    output; the query is rotated by the same RHT). fp32 [B,H,S,D]."""
    bits = stored_scale.view(torch.int32)
    zp = (bits & 0xF).to(torch.float32)
    scale = (bits & -16).view(torch.float32)
    r = (codes.to(torch.float32) - zp) * scale
    if rotated:
        return r
    return rht(r, inverse=True) / _largest_pow2_divisor(r.shape[-1])


def int4_per_token_head_fake_quant(x: torch.Tensor) -> torch.Tensor:
    """Quantize + dequantize ``int4_per_token_head`` in the original basis (fp32 [B,H,S,D])."""
    codes, s = int4_per_token_head_quantize(x)
    return int4_per_token_head_dequantize(codes, s)


def int4_query_fake_quant(q: torch.Tensor) -> torch.Tensor:
    """What ``unified_attention_int4`` does to the query: ``rht(q)`` rounded to ``q``'s dtype,
    mapped back to the original basis (so ``q̂·k̂`` equals the kernel's rotated-basis score).
    The identity (up to one float32 rounding) for float32 queries. fp32 [B,H_q,S,D]."""
    _check_4d(q, "q")
    r = rht(q).to(q.dtype).to(torch.float32)
    return rht(r, inverse=True) / _largest_pow2_divisor(q.shape[-1])
