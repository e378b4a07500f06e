"""``turboquant_*``: keys as a Hadamard-rotated unit vector coded against a Lloyd–Max codebook (or raw e4m3 for
k8) with an fp16 norm, values as 3/4-bit min/max codes with an fp16 scale and zero."""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from kvcal.engines.vllm.dtypes.common import (
    _TQ_NC_EPS,
    _TQ_NORM_EPS,
    _TQ_VALUE_MIN_SCALE,
    FP8_E4M3_MAX,
    _cast_fp8,
    _check_4d,
    _fma,
)
from kvcal.engines.vllm.dtypes.registry import TQ_PRESETS, VllmDTypeError
from kvcal.formats.transforms import walsh_hadamard


# ---- turboquant ---------------------------------------------------------------------------------
def _gaussian_pdf(x: float, var: float) -> float:
    return math.exp(-x * x / (2.0 * var)) / math.sqrt(2.0 * math.pi * var)


def _trapezoid(f, a: float, b: float, n: int = 200) -> float:
    h = (b - a) / n
    acc = 0.5 * (f(a) + f(b))
    for i in range(1, n):
        acc += f(a + i * h)
    return acc * h


@lru_cache(maxsize=16)
def lloyd_max_centroids(d: int, bits: int) -> torch.Tensor:
    """TurboQuant's Lloyd–Max codebook for N(0, 1/d), fp32 [2^bits], as ``turboquant/centroids.py``
    ``solve_lloyd_max`` computes it: start from the midpoints of ``2^bits`` equal cells on
    ±3.5σ; iterate (≤ 200 times) boundaries = centroid midpoints, outer edges ±10.5σ, new
    centroid = ∫x·p / ∫p by the trapezoid rule with 200 intervals (float64), until no centroid
    moves by 1e-10 (the centroids kept are the ones before that last, sub-tolerance update);
    cast to fp32."""
    n = 2 ** bits
    var = 1.0 / d
    sigma = math.sqrt(var)
    lo, hi = -3.5 * sigma, 3.5 * sigma
    c = [lo + (hi - lo) * (i + 0.5) / n for i in range(n)]
    for _ in range(200):
        edges = [3 * lo] + [(c[i] + c[i + 1]) / 2.0 for i in range(n - 1)] + [3 * hi]
        new = []
        for i in range(n):
            a, b = edges[i], edges[i + 1]
            num = _trapezoid(lambda t: t * _gaussian_pdf(t, var), a, b)
            den = _trapezoid(lambda t: _gaussian_pdf(t, var), a, b)
            new.append(num / den if den > 1e-15 else c[i])
        if max(abs(new[i] - c[i]) for i in range(n)) < 1e-10:
            break
        c = new
    return torch.tensor(c, dtype=torch.float32)


def _rotate(x: torch.Tensor) -> torch.Tensor:
    """TurboQuant's rotation ``x @ H/sqrt(D)`` (fp32): the Sylvester Hadamard matrix over ``sqrt(D)``, shared by
    every layer, no random signs (``turboquant_attn.py`` ``_build_hadamard_cached``), computed as butterflies
    (:func:`kvcal.formats.transforms.walsh_hadamard`) times ``1/sqrt(D)`` so each row's result
    does not depend on how many rows are rotated together (a BLAS matmul's rounding can). vLLM
    rotates with a cuBLAS fp32 GEMM; the two differ by float32 summation order only (GPU detail)."""
    D = x.shape[-1]
    if D < 1 or D & (D - 1):
        raise VllmDTypeError(f"turboquant needs a power-of-two head_dim (its Hadamard rotation), got {D}")
    return walsh_hadamard(x) * torch.tensor(1.0 / math.sqrt(D), dtype=torch.float32)


def turboquant_key_quantize(k: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """TurboQuant MSE key write (3 or 4 bits): ``n = ‖k‖`` (fp32), ``y = (k/(n+1e-8)) @ H``,
    code = number of codebook midpoints ``≤ y`` (the kernel's binary search; midpoints in fp32
    from the sorted fp32 centroids), norm stored as fp16 (RTNE; > 65504 becomes inf, as in the
    kernel). The rotation is :func:`_rotate`. Follows ``triton_turboquant_store.py`` (``triton_turboquant_store`` +
    ``_tq_fused_store_mse``). Returns ``(codes int64 [B,H,S,D], norm float16 [B,H,S,1])``."""
    _check_4d(k, "k")
    if bits not in (3, 4):
        raise VllmDTypeError(f"turboquant key bits must be 3 or 4 (8 = FP8 keys), got {bits}")
    D = k.shape[-1]
    kf = k.to(torch.float32)
    norm = torch.linalg.vector_norm(kf, dim=-1, keepdim=True)
    y = _rotate(kf / (norm + _TQ_NORM_EPS))
    c = lloyd_max_centroids(D, bits).sort().values
    mid = (c[:-1] + c[1:]) / 2
    codes = torch.searchsorted(mid, y.contiguous(), right=True).clamp(max=2 ** bits - 1)
    return codes, norm.to(torch.float16)


def turboquant_key_dequantize(codes: torch.Tensor, norm: torch.Tensor, bits: int, norm_correction: bool
                              ) -> torch.Tensor:
    """``norm · ĉ @ H`` with ``ĉ`` = the codes' centroids, rescaled to unit norm
    (``1/sqrt(Σc² + 1e-16)``) when ``norm_correction`` (``triton_turboquant_decode.py``). The
    decode kernel scores ``norm·(q @ H)·ĉ``, the same product. fp32 [B,H,S,D]."""
    D = codes.shape[-1]
    c = lloyd_max_centroids(D, bits).sort().values[codes]
    if norm_correction:
        c = c * (1.0 / torch.sqrt((c * c).sum(dim=-1, keepdim=True) + _TQ_NC_EPS))
    return norm.to(torch.float32) * _rotate(c)


def turboquant_value_quantize(v: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TurboQuant value write (``_store_quantized_value``): per (token, head), fp32
    ``scale = (max − min)/(2^bits − 1)``, floored at 1e-8; code ``clamp(⌊(v − min)/scale + 0.5⌋,
    0, 2^bits − 1)``; ``scale`` and ``min`` stored as fp16. Returns ``(codes int32 [B,H,S,D],
    scale float16 [B,H,S,1], zero float16 [B,H,S,1])``."""
    _check_4d(v, "v")
    if bits not in (3, 4):
        raise VllmDTypeError(f"turboquant value bits must be 3 or 4, got {bits}")
    vf = v.to(torch.float32)
    lo = vf.amin(dim=-1, keepdim=True)
    hi = vf.amax(dim=-1, keepdim=True)
    scale = (hi - lo) / float(2 ** bits - 1)
    scale = torch.where(scale > _TQ_VALUE_MIN_SCALE, scale, torch.full_like(scale, _TQ_VALUE_MIN_SCALE))
    codes = ((vf - lo) / scale + 0.5).trunc().clamp(0, 2 ** bits - 1).to(torch.int32)
    return codes, scale.to(torch.float16), lo.to(torch.float16)


def turboquant_value_dequantize(codes: torch.Tensor, scale16: torch.Tensor, zero16: torch.Tensor) -> torch.Tensor:
    """``code · scale + zero`` in fp32 from the fp16-stored scale and zero (``v_idx * v_scales +
    v_zeros`` in ``triton_turboquant_decode.py``). fp32 [B,H,S,D]."""
    return _fma(codes.to(torch.float32), scale16.to(torch.float32), zero16.to(torch.float32))


def turboquant_fake_quant(name: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize + dequantize K and V with TurboQuant preset ``name`` (``TQ_PRESETS``): k8 keys
    are cast raw to e4m3 (no scale, saturating; ``_tq_fused_store_fp8``), 3/4-bit keys go through
    :func:`turboquant_key_quantize`. fp32 ``(k̂, v̂)`` [B,H,S,D]. Remember vLLM reads the quantized
    cache only in decode (see :class:`VllmKVDType` ``prefill_reads_cache``)."""
    if name not in TQ_PRESETS:
        raise VllmDTypeError(f"unknown turboquant preset {name!r}; choose one of {sorted(TQ_PRESETS)}")
    kb, vb, nc = TQ_PRESETS[name]
    _check_4d(k, "k")
    if kb == 8:
        k_hat = _cast_fp8(k.to(torch.float32), FP8_E4M3_MAX, torch.float8_e4m3fn).to(torch.float32)
    else:
        k_hat = turboquant_key_dequantize(*turboquant_key_quantize(k, kb), kb, nc)
    return k_hat, turboquant_value_dequantize(*turboquant_value_quantize(v, vb))
