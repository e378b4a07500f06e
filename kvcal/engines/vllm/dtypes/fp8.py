"""Static-scale FP8 (``fp8`` / ``fp8_e4m3`` / ``fp8_e5m2``): the cache write and read-back on the GPU and CPU
backends, and vLLM's static FP8 query quantization."""

from __future__ import annotations

import torch

from kvcal.engines.vllm.dtypes import choices as _choices  # the GPU-only choices, read at call time
from kvcal.engines.vllm.dtypes.common import (
    FP8_E4M3_MAX,
    FP8_E5M2_MAX,
    _cast_fp8,
    _check_4d,
    _f32,
    _static_scale,
)
from kvcal.engines.vllm.dtypes.cpu import _cpu_inv_scale, fp8_e4m3_truncate, fp8_e5m2_truncate
from kvcal.engines.vllm.dtypes.registry import VllmBackend, VllmDTypeError, vllm_backend

# ---- fp8 / fp8_e4m3 / fp8_e5m2 (static scales) ---------------------------------------------------


def fp8_static_quantize(x: torch.Tensor, scale, *, e5m2: bool = False, backend: str | VllmBackend = "cuda"
                        ) -> torch.Tensor:
    """Static-scale FP8 cache write of vLLM's ``fp8``/``fp8_e4m3``/``fp8_e5m2``.

    ``backend``: ``"cuda"`` (default, the GPU kernels: round to nearest even, saturating) or
    ``"cpu"`` (vLLM's CPU build: ``x · float32(1/scale)`` then :func:`fp8_e4m3_truncate` /
    :func:`fp8_e5m2_truncate`), see :data:`VLLM_BACKENDS`.

    ``x`` [B, H_kv, S, D] (any float dtype, converted to fp32 as the kernel loads it); ``scale``
    per tensor (float or one element) or per KV head (``[H_kv]``/``[H_kv,1,1]``), the
    dequantization multiplier (checkpoint ``k_scale``/``v_scale``; 1.0 when absent). Returns the
    fp8 codes (``float8_e4m3fn`` or ``float8_e5m2``), ``sat(x / scale)`` rounded to nearest even.
    Follows ``v1/attention/ops/triton_reshape_and_cache_flash.py`` (``key_load / k_scale``, then
    the store's implicit fp8 cast) and csrc ``scaled_convert`` (``__NV_SATFINITE``). Raises
    :class:`VllmDTypeError` for a bad shape or a non-positive scale."""
    _check_4d(x, "x")
    s = _static_scale(scale, x.shape[1], "scale")
    xf = x.to(torch.float32)
    if vllm_backend(backend).fp8_rounding == "truncate":
        y = xf * _cpu_inv_scale(s)
        return fp8_e5m2_truncate(y) if e5m2 else fp8_e4m3_truncate(y)
    y = xf / s if _choices.KV_FP8_STORE_OP == "divide" else xf * (1.0 / s)
    if e5m2:
        return _cast_fp8(y, FP8_E5M2_MAX, torch.float8_e5m2)
    return _cast_fp8(y, FP8_E4M3_MAX, torch.float8_e4m3fn)


def fp8_static_fake_quant(x: torch.Tensor, scale, *, e5m2: bool = False, backend: str | VllmBackend = "cuda"
                          ) -> torch.Tensor:
    """``fp8_static_quantize`` then dequantize (``code · scale`` in fp32, as the attention kernels
    fold ``k_scale`` into the softmax scale and ``v_scale`` into the output): fp32 [B,H,S,D]."""
    q = fp8_static_quantize(x, scale, e5m2=e5m2, backend=backend)
    return q.to(torch.float32) * _static_scale(scale, x.shape[1], "scale")


def query_fp8_fake_quant(q: torch.Tensor, q_scale=1.0, num_kv_heads: int | None = None) -> torch.Tensor:
    """vLLM's static FP8 query quantization, quantize + dequantize.

    ``q`` [B, H_q, S, D]; ``q_scale`` a scalar (per tensor; vLLM's default is 1.0 when the
    checkpoint has none) or ``[H_kv]`` (one per KV head: it scales the group of ``H_q/H_kv``
    consecutive query heads that share the KV head — ``Attention.__init__`` builds
    ``QuantFP8(static=True, group_shape=GroupShape(-1, head_size·H_q/H_kv))``; a compressed-tensors
    ``attn_head`` checkpoint stores ``[H_q,1,1]`` and vLLM keeps the max of each group,
    ``CompressedTensorsKVCacheMethod``). A compressed-tensors checkpoint without ``q_scale`` loads
    1.0 (``create_weights`` initializes ones); the generic ``BaseKVCacheMethod`` logs "Setting it
    to k_scale" but then overwrites ``_q_scale`` with 1.0 (``kv_cache.py``). Code =
    e4m3fn ``sat(q · (1/q_scale))`` (``QuantFP8.forward_native``, see :data:`QUERY_FP8_OP`);
    the attention multiplies ``q_scale`` back into the softmax scale. Returns fp32
    [B, H_q, S, D]. Raises :class:`VllmDTypeError` for a bad shape/scale or ``H_q`` not a
    multiple of ``num_kv_heads``."""
    _check_4d(q, "q")
    Hq = q.shape[1]
    s = _f32(q_scale).reshape(-1)
    if s.numel() > 1:
        if num_kv_heads is None or s.numel() != num_kv_heads or Hq % num_kv_heads:
            raise VllmDTypeError(f"a per-head q_scale needs num_kv_heads = its length ({s.numel()}) dividing "
                                 f"the {Hq} query heads; got num_kv_heads={num_kv_heads}")
        s = s.repeat_interleave(Hq // num_kv_heads)
    s = _static_scale(s, Hq, "q_scale")
    qf = q.to(torch.float32)
    y = qf * (1.0 / s) if _choices.QUERY_FP8_OP == "reciprocal" else qf / s
    return _cast_fp8(y, FP8_E4M3_MAX, torch.float8_e4m3fn).to(torch.float32) * s
