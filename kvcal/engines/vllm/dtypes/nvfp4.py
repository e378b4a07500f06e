"""``nvfp4`` / ``nvfp4_4over6``: E2M1 values in 16-channel blocks with e4m3 block scales computed at write
time and a static outer scale, as vLLM 0.33's SM100 store kernel writes them (4over6's error-based choice
included), and their read-back."""

from __future__ import annotations

import math

import torch

from kvcal.engines.vllm.dtypes import choices as _choices  # the GPU-only choices, read at call time
from kvcal.engines.vllm.dtypes.common import (
    E2M1_MAX,
    FP8_E4M3_MAX,
    NVFP4_BLOCK,
    _cast_fp8,
    _check_4d,
    _static_scale,
)
from kvcal.engines.vllm.dtypes.registry import VllmDTypeError

# ---- nvfp4 / nvfp4_4over6 ------------------------------------------------------------------------
_E2M1_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e2m1_round(y: torch.Tensor) -> torch.Tensor:
    """Round fp32 ``y`` to FP4 E2M1 (±{0, .5, 1, 1.5, 2, 3, 4, 6}), nearest, ties to the even code,
    saturating at ±6 — vLLM's ``cast_to_fp4`` (``nvfp4_emulation_utils.py``) and the hardware's
    ``cvt.rn.satfinite.e2m1x2.f32``. Returns the E2M1 values as fp32."""
    a = y.abs().contiguous()
    idx = torch.bucketize(a, _E2M1_BOUNDS.to(a.device), right=False)  # ties go down
    on_bound = (idx < 7) & (a == _E2M1_BOUNDS.to(a.device)[idx.clamp(max=6)])
    idx = idx + (on_bound & (idx % 2 == 1)).to(idx.dtype)  # a tie goes up when the upper code is even
    return _E2M1_GRID.to(a.device)[idx] * torch.sign(y)


def _rcp(x: torch.Tensor) -> torch.Tensor:
    """``reciprocal_approximate_ftz`` (``rcp.approx.ftz.f32``) as :data:`NVFP4_RCP` says: the
    correctly rounded float32 ``1/x``. Callers keep ``x`` nonzero."""
    if _choices.NVFP4_RCP != "ieee":
        raise VllmDTypeError(f"NVFP4_RCP={_choices.NVFP4_RCP!r}: only 'ieee' is emulated")
    return 1.0 / x


def _ffma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """SASS ``FFMA``: float32 ``a·b + c`` rounded once (nearest even), exactly, for finite float32
    inputs whose results stay in range. ``a·b`` is exact in float64 (24+24 bits); the float64 sum
    ``t`` carries its own rounding error ``r`` (TwoSum: ``a·b + c == t + r`` exactly). Rounding ``t``
    to float32 equals rounding the exact sum unless ``t`` lies exactly halfway between two float32
    numbers and ``r != 0``; then the exact sum is on ``r``'s side of that midpoint."""
    p = a.double() * b.double()
    c64 = c.double()
    t = p + c64
    bp = t - p
    r = (p - (t - bp)) + (c64 - bp)
    t32 = t.to(torch.float32)
    away = torch.where(t > t32.double(), math.inf, -math.inf).to(torch.float32)
    nb = torch.nextafter(t32, away)  # the float32 neighbour on t's other side
    mid = (t != t32.double()) & (2.0 * t == t32.double() + nb.double())
    fix = mid & (r != 0)
    hi, lo = torch.maximum(t32, nb), torch.minimum(t32, nb)
    return torch.where(fix, torch.where(r > 0, hi, lo), t32)


def _nvfp4_candidate(xb: torch.Tensor, inv_outer: torch.Tensor, divisor: float):
    """One NVFP4 block-scale candidate for blocks ``xb`` [..., nb, 16] (fp32): ``(e4m3 block scale s
    fp32 [..., nb, 1], output scale fp32 [..., nb, 1], E2M1 values fp32 [..., nb, 16])``.

    ``s = e4m3_sat(global·(amax·(1/divisor)))`` with ``global = 1/outer`` (``inv_outer``), output
    scale ``1/(s·(1/global))``, 0 where ``s == 0``; values ``e2m1(x·output scale)``. This is
    ``cvt_warp_fp16_to_fp4`` (divisor 6) and ``nvfp4_candidate_scale`` (divisor 6 or 4) of vLLM
    0.33's store kernel (see :func:`nvfp4_quantize`); ``ref_nvfp4_quant`` (the wheel's Python) differs
    only in its zero guard (output scale 1e-8 instead of 0, the same values unless a zero-scale
    block holds |x| > 2.5e7, which needs an outer scale > 4e9)."""
    vec_max = xb.abs().amax(dim=-1, keepdim=True)
    s = inv_outer * (vec_max * (1.0 / divisor))  # 1/6 -> float32 0x3E2AAAAB (folded by ptxas); 1/4 exact
    s8 = _cast_fp8(s, FP8_E4M3_MAX, torch.float8_e4m3fn).to(torch.float32)
    nz = s8 != 0
    out_scale = torch.where(nz, _rcp(torch.where(nz, s8 * _rcp(inv_outer), 1.0)), 0.0)
    e = e2m1_round((xb * out_scale).clamp(-E2M1_MAX, E2M1_MAX))
    return s8, out_scale, e


def _nvfp4_block_sse(xb: torch.Tensor, e: torch.Tensor, out_scale: torch.Tensor) -> torch.Tensor:
    """``nvfp4_reconstruction_error`` of vLLM 0.33's store kernel for blocks ``xb`` [..., nb, 16]
    (fp32), their E2M1 values ``e`` and output scale [..., nb, 1]: fp32 [..., nb, 1].

    Per element ``d = q·dq − x`` with ``dq = 1/output scale`` (0 where the output scale is 0, so
    ``d = −x``), per pair ``(x, y) = (elements 2k, 2k+1)`` ``p = dx·dx + dy·dy``, summed in order
    ``((0 + p0) + p1) + … + p7`` in float32 (16 elements per thread, ``CVT_FP4_PACK16``: CUDA 13
    build, no shuffle). The wheel's sm_100 SASS contracts ``d`` to ``FFMA(q, dq, −x)`` and ``p`` to
    ``FFMA(dx, dx, FMUL(dy, dy))``; the sum is plain ``FADD``."""
    nz = out_scale != 0
    dq = torch.where(nz, _rcp(torch.where(nz, out_scale, 1.0)), 0.0).expand_as(e)
    d = _ffma(e, dq, -xb)
    dx, dy = d[..., 0::2], d[..., 1::2]
    p = _ffma(dx, dx, dy * dy)  # [..., nb, 8]
    err = p[..., 0:1]  # FADD(0, p0) = p0
    for k in range(1, p.shape[-1]):
        err = err + p[..., k:k + 1]
    return err


def nvfp4_quantize(x: torch.Tensor, outer_scale=1.0, *, four_over_six: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``nvfp4`` (or ``nvfp4_4over6``) cache write.

    ``x`` [B, H_kv, S, D], D a multiple of 16 (blocks of 16 consecutive channels of one token and
    head; vLLM's page holds ``D/2`` data bytes + ``D/16`` scale bytes per head,
    ``utils/torch_utils.py`` ``nvfp4_kv_cache_full_dim``), values as the model dtype holds them
    (the kernel reads bf16/fp16). ``outer_scale``: the static ``k_scale``/``v_scale`` (a scalar; 1.0
    when the checkpoint has none), a dequantization multiplier: the kernel's ``global_scale`` is
    ``1.0f / k_scale``. Per block, fp32: ``s = e4m3_sat(global·(amax·(1/6)))`` (round to nearest
    even, saturating at 448; small blocks give subnormal or zero scales), values
    ``e2m1(x·1/(s·(1/global)))`` (:func:`_nvfp4_candidate`).

    ``four_over_six`` (``nvfp4_4over6``): a second candidate with ``amax·(1/4)`` (same global
    scale, same e4m3 range: no 256 cap as in TransformerEngine's 4over6), each candidate's error
    computed as :func:`_nvfp4_block_sse` (squared error in the input's units, outer scale included,
    float32), and max/4 kept only when its error is strictly smaller (``use4 = err4 < err6``:
    equal errors keep max/6). The stored values are the chosen candidate's.

    Source: vLLM 0.33 writes both through ``torch.ops._C_cache_ops.reshape_and_cache_flash`` with
    the dtype string (``v1/attention/backends/flashinfer.py`` ``do_kv_cache_update``, SM100 /
    trtllm-gen path; nvfp4_4over6 runs nowhere else), compiled from vLLM's
    ``csrc/libtorch_stable/quantization/fp4/nvfp4_kv_cache_kernels.cu`` (the revision whose enum
    ``NVFP4KVScaleSearch`` is ``{DEFAULT, FOUR_OVER_SIX}`` and whose error reads "Unsupported NVFP4
    KV cache dtype", as the 0.33 binary's symbols and strings do; line numbers of that revision):
    ``reshape_and_cache_nvfp4_dispatch`` maps "nvfp4" / "nvfp4_4over6" to
    ``NVFP4KVScaleSearch::DEFAULT`` / ``FOUR_OVER_SIX``; ``round_to_nearest_e2m1`` (lines 51-73, ties
    to even as ``cvt.rn.satfinite.e2m1x2``), ``nvfp4_candidate_scale`` (75-89),
    ``nvfp4_reconstruction_error`` (91-116), ``cvt_warp_fp16_to_fp4_4over6`` (118-161);
    ``cvt_warp_fp16_to_fp4`` and ``reciprocal_approximate_ftz`` in ``nvfp4_utils.cuh``. Checked
    against the wheel's compiled kernel (``_C_stable_libtorch.abi3.so``, sm_100 cubin of
    ``reshape_and_cache_nvfp4_kernel<BFloat16, FOUR_OVER_SIX>``, nvdisasm 13.5): the enum has only
    the two values, the E2M1 compares are ≤ at 0.25/1.25/2.5/5 and < at 0.75/1.75/3.5, the choice
    is ``FSETP.GEU err4, err6`` selecting max/6 on ≥. The reciprocals are the one GPU-only detail
    (:data:`NVFP4_RCP`).

    Returns ``(e2m1 values fp32 [B,H,S,D], block scales float8_e4m3fn [B,H,S,D/16])``. Raises
    :class:`VllmDTypeError` for D % 16 or a non-scalar / non-positive outer scale."""
    _check_4d(x, "x")
    B, H, S, D = x.shape
    if D % NVFP4_BLOCK:
        raise VllmDTypeError(f"nvfp4 needs head_dim a multiple of {NVFP4_BLOCK}, got {D}")
    o = _static_scale(outer_scale, 1, "nvfp4 outer scale (k_scale/v_scale)").reshape(())
    inv = 1.0 / o  # global_scale = 1.0f / k_scale (IEEE division)
    xb = x.to(torch.float32).reshape(B, H, S, D // NVFP4_BLOCK, NVFP4_BLOCK)
    s8, out6, e = _nvfp4_candidate(xb, inv, E2M1_MAX)
    if four_over_six:
        s4, out4, e4 = _nvfp4_candidate(xb, inv, 4.0)
        use4 = _nvfp4_block_sse(xb, e4, out4) < _nvfp4_block_sse(xb, e, out6)  # ties keep max/6
        s8 = torch.where(use4, s4, s8)
        e = torch.where(use4, e4, e)
    return e.reshape(B, H, S, D), s8.reshape(B, H, S, D // NVFP4_BLOCK).to(torch.float8_e4m3fn)


def nvfp4_dequantize(values: torch.Tensor, block_scales: torch.Tensor, outer_scale=1.0) -> torch.Tensor:
    """``e2m1 · block_scale · outer`` (fp32 [B,H,S,D]); the attention folds ``outer`` into its
    softmax / output scale (FlashInfer ``bmm1_scale = sm_scale·k_scale``, ``bmm2_scale = v_scale``)."""
    B, H, S, D = values.shape
    o = _static_scale(outer_scale, 1, "nvfp4 outer scale").reshape(())
    s = block_scales.to(torch.float32).reshape(B, H, S, D // NVFP4_BLOCK, 1)
    return (values.reshape(B, H, S, D // NVFP4_BLOCK, NVFP4_BLOCK) * s * o).reshape(B, H, S, D)


def nvfp4_fake_quant(x: torch.Tensor, outer_scale=1.0, *, four_over_six: bool = False) -> torch.Tensor:
    """:func:`nvfp4_quantize` then :func:`nvfp4_dequantize` (fp32 [B,H,S,D])."""
    v, s = nvfp4_quantize(x, outer_scale, four_over_six=four_over_six)
    return nvfp4_dequantize(v, s, outer_scale)
