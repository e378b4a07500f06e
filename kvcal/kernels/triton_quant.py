"""Triton kernels for dynamic integer quantize / dequantize with fused bit packing.

The torch implementation in :mod:`kvcal.formats.quant` is the spec; these kernels reproduce it bit
for bit (same operation order, IEEE division via ``div_rn``, round-half-even, scales rounded up
to their storage dtype by bit increment). Imported only through :mod:`kvcal.kernels` (lazily),
so kvcal works without triton. Covered layouts (others fall back to torch in the dispatcher):

* per-token / per-token-group (``[B,H,S,D] -> scale [B,H,S,D/g]``): one program per block of
  ``ROWS`` token rows and one channel group; ``g`` a power of two dividing ``D``.
* per-channel-token-group (KIVI keys, ``scale [B,H,ceil(S/g),D]``): one program per
  ``(b, h, token group)``; ``g`` and ``D`` powers of two; the partial last group replicates its
  last token like the torch reference's padding.

Bits 8/4/3/2, symmetric or asymmetric, scale dtype fp16/bf16/fp32. Inputs must be contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcal.formats.granularity import PerChannelTokenGroup
from kvcal.formats.quant import QuantizedTensor
from kvcal.formats.scales import zero_point_limit
from kvcal.formats.spec import PACK_UNITS, TensorQuantSpec

_SCALE_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@triton.jit
def _rne(y):
    """Round half to even, exact for |y| < 2^23 (floor, then compare the exact fraction)."""
    f = tl.floor(y)
    frac = y - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    return tl.where(up, f + 1.0, f)


@triton.jit
def _to_bf16_rne(v):
    """fp32 -> bf16 round-to-nearest-even by integer arithmetic on the bits (finite inputs). The
    interpreter's bf16 cast truncates; this is exact on every backend."""
    b = v.to(tl.int32, bitcast=True)
    b = b + 0x7FFF + ((b >> 16) & 1)
    return (b >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _round_up(s, SCALE_KIND: tl.constexpr):
    """fp32 scale -> value in the storage dtype, rounded up (returned in that dtype)."""
    if SCALE_KIND == 1:
        r = s.to(tl.float16)
        bumped = (r.to(tl.int16, bitcast=True) + 1).to(tl.float16, bitcast=True)
        r = tl.where(r.to(tl.float32) < s, bumped, r)
    elif SCALE_KIND == 2:
        r = _to_bf16_rne(s)
        bumped = (r.to(tl.int16, bitcast=True) + 1).to(tl.bfloat16, bitcast=True)
        r = tl.where(r.to(tl.float32) < s, bumped, r)
    else:
        r = s
    return r


@triton.jit
def _cast_out(y, OUT_BF16: tl.constexpr, out_ptr):
    if OUT_BF16:
        return _to_bf16_rne(y)
    return y.to(out_ptr.dtype.element_ty)


@triton.jit
def _params(mn, mx, amax, c, QMAX: tl.constexpr, SYM: tl.constexpr, ZPL: tl.constexpr, SCALE_KIND: tl.constexpr):
    """Group statistics -> (stored scale, stored zero point) like ``params_from_range``."""
    if SYM:
        a = amax * c
        s = tl.math.div_rn(a, tl.full(a.shape, QMAX, tl.float32))
        s = tl.where(s > 0, s, 1.0)
        s_r = _round_up(s, SCALE_KIND)
        zp_r = s_r
    else:
        t = (1.0 - c) * 0.5 * (mx - mn)
        lo = mn + t
        hi = mx - t
        s = tl.math.div_rn(hi - lo, tl.full(lo.shape, QMAX, tl.float32))
        s = tl.maximum(s, tl.math.div_rn(tl.abs(lo), tl.full(lo.shape, ZPL, tl.float32)))
        s = tl.where(s > 0, s, 1.0)
        s_r = _round_up(s, SCALE_KIND)
        zp = tl.math.div_rn(-lo, s_r.to(tl.float32))
        if SCALE_KIND == 1:
            zp_r = zp.to(tl.float16)
        elif SCALE_KIND == 2:
            zp_r = _to_bf16_rne(zp)
        else:
            zp_r = zp
    return s_r, zp_r


@triton.jit
def _codes(x, s, zp, QMAX: tl.constexpr, SYM: tl.constexpr, BITS: tl.constexpr):
    """fp32 values -> unsigned storage codes (int32); symmetric codes offset by 2^(b-1) (b < 8)."""
    y = tl.math.div_rn(x, s)
    if SYM:
        q = tl.minimum(tl.maximum(_rne(y), -QMAX), QMAX)
        if BITS < 8:
            q = q + (QMAX + 1)
    else:
        q = tl.minimum(tl.maximum(_rne(y + zp), 0.0), QMAX)
    return q.to(tl.int32)


@triton.jit
def _store_packed(out_ptr, base, q, VPU: tl.constexpr, BPU: tl.constexpr, BITS: tl.constexpr,
                  SYM: tl.constexpr, mask):
    """q: int32 [..., NU, VPU] codes; base: byte offset of each unit [..., NU]."""
    if BITS == 8:
        w = tl.sum(q, axis=2)  # VPU == 1
        if SYM:
            tl.store(out_ptr + base, w.to(tl.int8), mask=mask)
        else:
            tl.store(out_ptr + base, w.to(tl.uint8), mask=mask)
    else:
        shifts = tl.arange(0, VPU) * BITS
        w = tl.sum(q << shifts, axis=2)
        tl.store(out_ptr + base, (w & 255).to(tl.uint8), mask=mask)
        if BPU == 3:
            tl.store(out_ptr + base + 1, ((w >> 8) & 255).to(tl.uint8), mask=mask)
            tl.store(out_ptr + base + 2, ((w >> 16) & 255).to(tl.uint8), mask=mask)


@triton.jit
def _load_codes(data_ptr, base, VPU: tl.constexpr, BPU: tl.constexpr, BITS: tl.constexpr,
                QMAX: tl.constexpr, SYM: tl.constexpr, mask):
    """Inverse of _store_packed: -> signed integer codes as fp32 [..., NU, VPU]."""
    if BITS == 8:
        q = tl.load(data_ptr + base, mask=mask, other=0).to(tl.float32)
        q = tl.expand_dims(q, 2)
    else:
        w = tl.load(data_ptr + base, mask=mask, other=0).to(tl.int32)
        if BPU == 3:
            w = w | (tl.load(data_ptr + base + 1, mask=mask, other=0).to(tl.int32) << 8)
            w = w | (tl.load(data_ptr + base + 2, mask=mask, other=0).to(tl.int32) << 16)
        shifts = tl.arange(0, VPU) * BITS
        q = ((tl.expand_dims(w, 2) >> shifts) & ((1 << BITS) - 1)).to(tl.float32)
        if SYM:
            q = q - (QMAX + 1)
    return q


@triton.jit
def _quant_token_group_kernel(
    x_ptr, clip_ptr, data_ptr, scale_ptr, zp_ptr, n_rows, S, H,
    D: tl.constexpr, G: tl.constexpr, GS: tl.constexpr, ROWS: tl.constexpr, VPU: tl.constexpr,
    BPU: tl.constexpr, BITS: tl.constexpr, QMAX: tl.constexpr, SYM: tl.constexpr, ZPL: tl.constexpr,
    SCALE_KIND: tl.constexpr,
):
    pid = tl.program_id(0)
    gi = tl.program_id(1)
    NU: tl.constexpr = GS // VPU
    rows = pid * ROWS + tl.arange(0, ROWS)  # [ROWS]
    rmask = rows < n_rows
    u = tl.arange(0, NU)
    j = tl.arange(0, VPU)
    offs = rows[:, None, None] * D + gi * GS + u[None, :, None] * VPU + j[None, None, :]  # [ROWS, NU, VPU]
    m3 = rmask[:, None, None]
    x = tl.load(x_ptr + offs, mask=m3, other=0.0).to(tl.float32)
    head = (rows // S) % H
    c = tl.load(clip_ptr + head, mask=rmask, other=1.0)
    if SYM:
        amax = tl.max(tl.max(tl.abs(x), axis=2), axis=1)
        mn = amax
        mx = amax
    else:
        mx = tl.max(tl.max(x, axis=2), axis=1)
        mn = tl.min(tl.min(x, axis=2), axis=1)
        amax = mx
    s_r, zp_r = _params(mn, mx, amax, c, QMAX, SYM, ZPL, SCALE_KIND)
    tl.store(scale_ptr + rows * G + gi, s_r, mask=rmask)
    s3 = s_r.to(tl.float32)[:, None, None]
    if SYM:
        zp3 = s3
    else:
        tl.store(zp_ptr + rows * G + gi, zp_r, mask=rmask)
        zp3 = zp_r.to(tl.float32)[:, None, None]
    q = _codes(x, s3, zp3, QMAX, SYM, BITS)
    base = rows[:, None] * (D // VPU * BPU) + gi * (NU * BPU) + u[None, :] * BPU
    _store_packed(data_ptr, base, q, VPU, BPU, BITS, SYM, rmask[:, None])


@triton.jit
def _dequant_token_group_kernel(
    data_ptr, scale_ptr, zp_ptr, out_ptr, n_rows,
    D: tl.constexpr, G: tl.constexpr, GS: tl.constexpr, ROWS: tl.constexpr, VPU: tl.constexpr,
    BPU: tl.constexpr, BITS: tl.constexpr, QMAX: tl.constexpr, SYM: tl.constexpr, OUT_BF16: tl.constexpr,
):
    pid = tl.program_id(0)
    gi = tl.program_id(1)
    NU: tl.constexpr = GS // VPU
    rows = pid * ROWS + tl.arange(0, ROWS)
    rmask = rows < n_rows
    u = tl.arange(0, NU)
    j = tl.arange(0, VPU)
    base = rows[:, None] * (D // VPU * BPU) + gi * (NU * BPU) + u[None, :] * BPU
    q = _load_codes(data_ptr, base, VPU, BPU, BITS, QMAX, SYM, rmask[:, None])
    s = tl.load(scale_ptr + rows * G + gi, mask=rmask, other=1.0).to(tl.float32)[:, None, None]
    if SYM:
        y = q * s
    else:
        zp = tl.load(zp_ptr + rows * G + gi, mask=rmask, other=0.0).to(tl.float32)[:, None, None]
        y = (q - zp) * s
    offs = rows[:, None, None] * D + gi * GS + u[None, :, None] * VPU + j[None, None, :]
    tl.store(out_ptr + offs, _cast_out(y, OUT_BF16, out_ptr), mask=rmask[:, None, None])


@triton.jit
def _quant_channel_token_group_kernel(
    x_ptr, clip_ptr, data_ptr, scale_ptr, zp_ptr, S, SG, H,
    D: tl.constexpr, GS: tl.constexpr, VPU: tl.constexpr, BPU: tl.constexpr, BITS: tl.constexpr,
    QMAX: tl.constexpr, SYM: tl.constexpr, ZPL: tl.constexpr, SCALE_KIND: tl.constexpr,
):
    pid = tl.program_id(0)  # over B*H*SG
    bh = pid // SG
    tg = pid % SG
    NU: tl.constexpr = D // VPU
    t = tg * GS + tl.arange(0, GS)  # token index inside the sequence (may exceed S in the last group)
    t_src = tl.minimum(t, S - 1)  # replicate the last token, like the reference's padding
    u = tl.arange(0, NU)
    j = tl.arange(0, VPU)
    offs = (bh * S + t_src)[:, None, None] * D + u[None, :, None] * VPU + j[None, None, :]  # [GS, NU, VPU]
    x = tl.load(x_ptr + offs).to(tl.float32)
    c = tl.load(clip_ptr + (bh % H))
    if SYM:
        amax = tl.max(tl.abs(x), axis=0)  # [NU, VPU]
        mn = amax
        mx = amax
    else:
        mx = tl.max(x, axis=0)
        mn = tl.min(x, axis=0)
        amax = mx
    s_r, zp_r = _params(mn, mx, amax, c, QMAX, SYM, ZPL, SCALE_KIND)
    ch = u[:, None] * VPU + j[None, :]
    tl.store(scale_ptr + pid * D + ch, s_r)
    s3 = s_r.to(tl.float32)[None, :, :]
    if SYM:
        zp3 = s3
    else:
        tl.store(zp_ptr + pid * D + ch, zp_r)
        zp3 = zp_r.to(tl.float32)[None, :, :]
    q = _codes(x, s3, zp3, QMAX, SYM, BITS)
    base = (bh * (SG * GS) + t)[:, None] * (NU * BPU) + u[None, :] * BPU  # padded token rows
    _store_packed(data_ptr, base, q, VPU, BPU, BITS, SYM, (t >= 0)[:, None])


@triton.jit
def _dequant_channel_token_group_kernel(
    data_ptr, scale_ptr, zp_ptr, out_ptr, S, SG,
    D: tl.constexpr, GS: tl.constexpr, VPU: tl.constexpr, BPU: tl.constexpr, BITS: tl.constexpr,
    QMAX: tl.constexpr, SYM: tl.constexpr, OUT_BF16: tl.constexpr,
):
    pid = tl.program_id(0)
    bh = pid // SG
    tg = pid % SG
    NU: tl.constexpr = D // VPU
    t = tg * GS + tl.arange(0, GS)
    u = tl.arange(0, NU)
    j = tl.arange(0, VPU)
    base = (bh * (SG * GS) + t)[:, None] * (NU * BPU) + u[None, :] * BPU
    q = _load_codes(data_ptr, base, VPU, BPU, BITS, QMAX, SYM, (t >= 0)[:, None])
    ch = u[:, None] * VPU + j[None, :]
    s = tl.load(scale_ptr + pid * D + ch).to(tl.float32)[None, :, :]
    if SYM:
        y = q * s
    else:
        zp = tl.load(zp_ptr + pid * D + ch).to(tl.float32)[None, :, :]
        y = (q - zp) * s
    offs = (bh * S + t)[:, None, None] * D + u[None, :, None] * VPU + j[None, None, :]
    tl.store(out_ptr + offs, _cast_out(y, OUT_BF16, out_ptr), mask=(t < S)[:, None, None])


def _meta(spec: TensorQuantSpec):
    vpu, bpu = PACK_UNITS[spec.bits]
    return dict(VPU=vpu, BPU=bpu, BITS=spec.bits, QMAX=spec.qmax, SYM=spec.symmetric)


def _check_width(spec: TensorQuantSpec) -> None:
    from kvcal.kernels.widths import TRITON_WIDTHS

    if spec.bits not in TRITON_WIDTHS:
        raise ValueError(f"the Triton kernels pack 8/4/3/2-bit codes; {spec.format.value} runs on the torch reference")


def quantize_triton(x: torch.Tensor, spec: TensorQuantSpec, clip: torch.Tensor) -> QuantizedTensor:
    """Dynamic int quantization on the Triton path. ``clip``: float32 ``[H]`` on ``x.device``.
    The caller (:mod:`kvcal.kernels`) has checked support and finiteness; widths outside the
    kernels' packing units (int5/int6) raise ``ValueError``."""
    _check_width(spec)
    B, H, S, D = x.shape
    x = x.contiguous()
    m = _meta(spec)
    zpl = zero_point_limit(spec.scale_dtype)
    kind = _SCALE_KIND[spec.scale_dtype]
    dt = torch.int8 if (spec.bits == 8 and spec.symmetric) else torch.uint8
    g = spec.granularity
    if isinstance(g, PerChannelTokenGroup):
        gs = g.group_size
        sg = -(-S // gs)
        data = torch.empty(B, H, sg * gs, spec.row_bytes(D), dtype=dt, device=x.device)
        scale = torch.empty(B, H, sg, D, dtype=spec.scale_dtype, device=x.device)
        zp = torch.empty_like(scale) if not spec.symmetric else scale
        _quant_channel_token_group_kernel[(B * H * sg,)](
            x, clip, data, scale, zp, S, sg, H, D=D, GS=gs, ZPL=zpl, SCALE_KIND=kind, **m)
    else:
        gs = spec.effective_channel_group(D) if spec.channel_group else D
        G = D // gs
        data = torch.empty(B, H, S, spec.row_bytes(D), dtype=dt, device=x.device)
        scale = torch.empty(B, H, S, G, dtype=spec.scale_dtype, device=x.device)
        zp = torch.empty_like(scale) if not spec.symmetric else scale
        n_rows = B * H * S
        rows = 16
        _quant_token_group_kernel[(triton.cdiv(n_rows, rows), G)](
            x, clip, data, scale, zp, n_rows, S, H, D=D, G=G, GS=gs, ROWS=rows, ZPL=zpl, SCALE_KIND=kind, **m)
    if not torch.isfinite(scale).all():
        raise ValueError(
            f"a scale overflows {spec.scale_dtype}; use scale_dtype=torch.float32 or check the input's range"
        )
    return QuantizedTensor(data, scale, None if spec.symmetric else zp, (B, H, S, D), spec, x.dtype)


def dequantize_triton(qt: QuantizedTensor, dtype: torch.dtype) -> torch.Tensor:
    """Triton dequantization of a tensor produced by either path (same storage layout); int5/int6
    raise ``ValueError`` (torch reference only)."""
    spec = qt.spec
    _check_width(spec)
    B, H, S, D = qt.shape
    m = _meta(spec)
    out = torch.empty(B, H, S, D, dtype=dtype, device=qt.data.device)
    zp = qt.zero_point if qt.zero_point is not None else qt.scale
    g = spec.granularity
    if isinstance(g, PerChannelTokenGroup):
        gs = g.group_size
        sg = -(-S // gs)
        _dequant_channel_token_group_kernel[(B * H * sg,)](
            qt.data, qt.scale.contiguous(), zp.contiguous(), out, S, sg, D=D, GS=gs,
            OUT_BF16=dtype == torch.bfloat16, **m)
    else:
        gs = spec.effective_channel_group(D) if spec.channel_group else D
        G = D // gs
        n_rows = B * H * S
        rows = 16
        _dequant_token_group_kernel[(triton.cdiv(n_rows, rows), G)](
            qt.data, qt.scale.contiguous(), zp.contiguous(), out, n_rows, D=D, G=G, GS=gs, ROWS=rows,
            OUT_BF16=dtype == torch.bfloat16, **m)
    return out
