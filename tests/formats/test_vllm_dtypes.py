"""vLLM 0.33 KV-cache dtype emulations against independent float64 re-statements of vLLM's source.

Each reference below is written from the vLLM file named in its docstring, in float64 with an
explicit rounding to float32 (``f32``) after every operation the kernel does in float32 (exact:
float64 holds 2·24+2 bits, so a float64 op rounded to float32 equals the float32 op). FP8, E2M1
and fp16 roundings are re-stated from their value grids, not with torch casts. Where the
emulation's arithmetic order cannot be matched (matmul / butterfly sums), the tolerance is the
float32 summation bound written next to the check.
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import pytest
import torch
from click.testing import CliRunner

from kvcal.engines.vllm import dtypes as V
from kvcal.engines.vllm.memory import vllm_bytes_per_token, vllm_cache_bytes
from kvcal.formats.memory import ModelShape

F64 = torch.float64
EPS32 = 2.0 ** -24  # float32 unit roundoff


def f32(t):
    return t.to(torch.float32).to(F64)


def _grid_round(a, grid):
    """Nearest element of ``grid`` (float64 [n], index = code) to each ``a``, ties to the even code;
    ``a`` beyond the last element saturates to it (callers pass |a|)."""
    a = a.clamp(max=float(grid[-1]))
    dist = (a[..., None] - grid).abs()
    best = dist == dist.amin(dim=-1, keepdim=True)
    even = (torch.arange(len(grid)) % 2 == 0)
    pick = (best.to(torch.int64) * (1 + even.to(torch.int64))).argmax(dim=-1)
    return grid[pick]


def _e4m3_grid():
    vals = [m * 2.0 ** -9 for m in range(8)]  # subnormals (code 0..7)
    vals += [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8)]
    return torch.tensor(vals[:127], dtype=F64)  # code 127 (e=15, m=7) is NaN; max 448


def _e5m2_grid():
    vals = [m * 2.0 ** -16 for m in range(4)]
    vals += [(1 + m / 4) * 2.0 ** (e - 15) for e in range(1, 31) for m in range(4)]
    return torch.tensor(vals, dtype=F64)  # max 57344


E4M3, E5M2 = _e4m3_grid(), _e5m2_grid()
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=F64)


def fp8_round(y, grid=E4M3):
    """Saturating round-to-nearest-even onto an FP8 grid (float64 in, float64 out)."""
    return torch.sign(y) * _grid_round(y.abs(), grid)


def fp16_round(y):
    """IEEE binary16 round-to-nearest-even of float64 values (finite range), from its grid."""
    a = y.abs()
    e = torch.floor(torch.log2(a.clamp(min=2.0 ** -14))).clamp(-14, 15)
    step = 2.0 ** (e - 10)
    q = a / step
    r = torch.floor(q)
    frac = q - r
    r = torch.where((frac > 0.5) | ((frac == 0.5) & (r % 2 == 1)), r + 1, r)
    out = r * step
    return torch.sign(y) * torch.where(out > 65504, torch.full_like(out, math.inf), out)


def gaussian_outlier(shape, seed=0, outlier=20.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x[..., 0, 3] = outlier  # one outlier channel value per (batch, head)
    return x


def sqnr_db(x, y):
    return float(10 * torch.log10(x.double().pow(2).sum() / (x.double() - y.double()).pow(2).sum()))


# ---- fp8 static + query quantization -------------------------------------------------------------
def ref_fp8_static(x, scale, grid=E4M3):
    """triton_reshape_and_cache_flash.py: code = fp8(key / k_scale) (saturating), read as code·scale."""
    s = scale.to(F64)
    return f32(fp8_round(f32(x.to(F64) / s), grid) * s)


@pytest.mark.parametrize("scale", [torch.tensor(0.01), torch.tensor([0.5, 0.02, 1.0])], ids=["tensor", "head"])
def test_fp8_static_matches_reference(scale):
    """fp8 static fake-quant (per-tensor and per-KV-head scale) equals the float64 re-statement bit for bit,
    and every |x| > 448·scale saturates to exactly ±448·scale."""
    x = gaussian_outlier((2, 3, 16, 64)) * 3
    s4 = scale.reshape(1, -1, 1, 1)
    got = V.fp8_static_fake_quant(x, scale)
    assert torch.equal(got.double(), ref_fp8_static(x, s4))
    # saturation: every |x| > 448·scale comes back as exactly ±448·scale
    sat = x.abs() > 448 * s4
    assert sat.any()
    assert torch.equal(got[sat].abs().double(), f32(448 * s4.double()).expand_as(x)[sat])


def test_fp8_e5m2_matches_reference():
    """fp8_e5m2 key fake-quant at k_scale 0.003 equals the float64 re-statement on the e5m2 grid bit for bit."""
    x = gaussian_outlier((1, 3, 8, 64), seed=1)
    got = V.fake_quant_kv("fp8_e5m2", x, x, k_scale=0.003)[0]
    assert torch.equal(got.double(), ref_fp8_static(x, torch.tensor(0.003), E5M2))


def test_query_fp8_per_tensor_and_per_group():
    """Query fp8: no q_scale rounds q itself to e4m3; per-KV-head q_scale is shared by each GQA group and
    matches x·(1/scale) rounded; non-fp8 dtypes leave q untouched; a q_scale/num_kv_heads mismatch is refused."""
    q = gaussian_outlier((1, 6, 8, 64), seed=2) * 4
    # missing q_scale = 1.0: the code is the e4m3 rounding of q itself
    assert torch.equal(V.fake_quant_query("fp8", q).double(), fp8_round(q.double()))
    # per KV head: q heads 0,1 share scale 0.01, 2,3 share 0.05, 4,5 share 1.0 (GQA group of 2)
    qs = torch.tensor([0.01, 0.05, 1.0])
    got = V.fake_quant_query("fp8_e4m3", q, q_scale=qs, num_kv_heads=3)
    s = qs.repeat_interleave(2).reshape(1, 6, 1, 1).to(F64)
    inv = f32(1.0 / s)  # QuantFP8.forward_native: x * scale.reciprocal()
    assert torch.equal(got.double(), f32(fp8_round(f32(q.double() * inv)) * s))
    # dtypes that do not quantize queries leave them alone
    assert torch.equal(V.fake_quant_query("fp8_e5m2", q), q)
    assert torch.equal(V.fake_quant_query("turboquant_k8v4", q), q)
    with pytest.raises(V.VllmDTypeError, match="num_kv_heads"):
        V.fake_quant_query("fp8", q, q_scale=qs, num_kv_heads=4)


# ---- per-token-head ------------------------------------------------------------------------------
def ref_per_token_head(x, kind):
    """_reshape_cache_per_token_head: scale = max(amax/QMAX, 1e-6); x·(1/scale); int8: ±0.5,
    clamp [-128,127], truncate; fp8: clamp ±448, RTNE."""
    xd = x.to(F64)
    qmax = 448.0 if kind == "fp8" else 127.0
    scale = torch.maximum(f32(xd.abs().amax(-1, keepdim=True) / qmax), f32(torch.tensor(1e-6, dtype=F64)))
    y = f32(xd * f32(1.0 / scale))
    if kind == "int8":
        code = torch.trunc(torch.where(y >= 0, f32(y + 0.5), f32(y - 0.5)).clamp(-128, 127))
    else:
        code = fp8_round(y)
    return f32(code * scale)


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_per_token_head_matches_reference(kind):
    """fp8/int8 per-token-head fake-quant equals the float64 re-statement bit for bit; an all-zero row
    reads back as zeros."""
    x = gaussian_outlier((2, 3, 16, 64), seed=3)
    x[0, 1, 5] = 0.0  # all-zero row: scale 1e-6, codes 0, reads back 0
    got = V.per_token_head_fake_quant(x, kind)
    assert torch.equal(got.double(), ref_per_token_head(x, kind))
    assert torch.equal(got[0, 1, 5], torch.zeros(64))


def test_int8_per_token_head_rounds_half_away_from_zero():
    """Hand-worked: at scale 1.0 the values 2.5, -2.5, 0.5 get codes 3, -3, 1 (round half away from zero,
    not to even)."""
    x = torch.zeros(1, 1, 1, 64)
    x[..., :4] = torch.tensor([127.0, 2.5, -2.5, 0.5])  # amax 127 -> scale 1.0 exactly
    codes, scale = V.per_token_head_quantize(x, "int8")
    assert float(scale) == 1.0
    assert codes[0, 0, 0, :4].tolist() == [127, 3, -3, 1]  # RTNE would give 2, -2, 0


# ---- int4_per_token_head -------------------------------------------------------------------------
RHT_SIGNS_64 = "+-++----+--++-+-++--+++-+-+--++-+---++-++-+-++---------+-------+"  # torch seed 0x9E3779B9


def _sylvester(d):
    i = torch.arange(d)
    bits = torch.bitwise_and(i[:, None], i[None, :])
    pop = sum(((bits >> k) & 1) for k in range(int(math.log2(d))))
    return (1 - 2 * (pop % 2)).to(F64)  # H[i,j] = (-1)^popcount(i&j)


def _f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def _bits_f32(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b))[0]


def test_rht_signs_are_vllms():
    """The 64 Hadamard-transform signs equal the published vLLM sign string (torch seed 0x9E3779B9)."""
    assert "".join("+" if s > 0 else "-" for s in V.rht_signs(64).tolist()) == RHT_SIGNS_64


def test_int4_per_token_head_matches_reference():
    """int4_per_token_head.py: RHT (H·diag(s)·x, rounded to the model dtype), then per row
    scale = max((max−min)/15, 1e-6), zp = clamp(rha(−min/scale)), codes = clamp(rha(r·(1/scale)+zp)),
    zp hidden in the scale's 4 low mantissa bits; read as (code − zp)·scale_truncated."""
    g = torch.Generator().manual_seed(4)
    # dyadic bf16 inputs (k/16, |k| <= 48): the transform is exact in any summation order
    x = (torch.randint(-48, 49, (1, 2, 8, 64), generator=g) / 16.0).to(torch.bfloat16)
    x[0, 1, 3] = 0  # all-zero row
    codes, stored = V.int4_per_token_head_quantize(x)
    s = torch.tensor([1.0 if c == "+" else -1.0 for c in RHT_SIGNS_64], dtype=F64)
    H = _sylvester(64)
    r = ((x.to(F64) * s) @ H.T).to(torch.bfloat16).to(F64)  # r = H·(s⊙x), stored in bf16
    for (b, h, t) in [(0, i, j) for i in range(2) for j in range(8)]:
        row = r[b, h, t]
        lo, hi = float(row.min()), float(row.max())
        scale = max(float(f32(torch.tensor((hi - lo) / 15.0, dtype=F64))), float(f32(torch.tensor(1e-6, dtype=F64))))

        def rha(v):
            v32 = float(f32(torch.tensor(v + (0.5 if v >= 0 else -0.5), dtype=F64)))
            return float(math.trunc(v32))

        zp = min(max(rha(float(f32(torch.tensor(-lo / scale, dtype=F64)))), 0.0), 15.0)
        inv = float(f32(torch.tensor(1.0 / scale, dtype=F64)))
        want = [min(max(rha(float(f32(f32(torch.tensor(v * inv, dtype=F64)) + zp))), 0.0), 15.0) for v in row.tolist()]
        assert codes[b, h, t].tolist() == want, (b, h, t)
        bits = (_f32_bits(scale) & ~0xF) | int(zp)
        assert _f32_bits(float(stored[b, h, t])) == bits
        # dequantize in the rotated basis: exact; back to the original basis: fp32 butterfly bound
        s_t = _bits_f32(_f32_bits(scale) & ~0xF)
        rhat = f32((torch.tensor(want, dtype=F64) - zp) * s_t)
        got_rot = V.int4_per_token_head_dequantize(codes[b, h, t].view(1, 1, 1, 64), stored[b, h, t].view(1, 1, 1, 1),
                                                   rotated=True)
        assert torch.equal(got_rot.reshape(64).double(), rhat)
        want_x = (H @ rhat) * s / 64
        got_x = V.int4_per_token_head_dequantize(codes[b, h, t].view(1, 1, 1, 64), stored[b, h, t].view(1, 1, 1, 1))
        bound = 6 * EPS32 * float(rhat.abs().sum()) / 64 + 1e-30  # 6 butterfly levels, each <= eps·Σ|terms|
        assert float((got_x.reshape(64).double() - want_x).abs().max()) <= bound
    assert torch.equal(V.int4_per_token_head_fake_quant(x)[0, 1, 3], torch.zeros(64))


# ---- nvfp4 ---------------------------------------------------------------------------------------
def ref_nvfp4(x, outer, e2m1_max=6.0):
    """nvfp4_emulation_utils.py ref_nvfp4_quant with global_scale = 1/outer: block scale
    e4m3(gs·(amax·(1/6))), values e2m1(clamp(x·1/(s·(1/gs)), ±6)); read as e2m1·s·outer."""
    B, H, S, D = x.shape
    xb = x.to(F64).reshape(B, H, S, D // 16, 16)
    gs = f32(1.0 / torch.tensor(outer, dtype=F64))
    vmax = xb.abs().amax(-1, keepdim=True)
    s8 = fp8_round(f32(gs * f32(vmax * f32(torch.tensor(1.0 / e2m1_max, dtype=F64)))))
    denom = f32(s8 * f32(1.0 / gs))
    out_scale = torch.where(denom == 0, f32(torch.tensor(1e-8, dtype=F64)), f32(1.0 / torch.where(denom == 0, 1.0, denom)))
    y = f32(xb * out_scale).clamp(-6, 6)
    e = torch.sign(y) * _grid_round(y.abs(), E2M1)
    deq = f32(f32(e * s8) * float(f32(torch.tensor(outer, dtype=F64))))
    return deq, s8


def test_nvfp4_matches_reference():
    """nvfp4 block scales and fake-quant values equal the float64 re-statement bit for bit at three
    outer scales."""
    x = gaussian_outlier((2, 3, 8, 64), seed=5)
    for outer in (1.0, 20.0 / (448 * 6), 0.37):
        want, s8 = ref_nvfp4(x, outer)
        vals, scales = V.nvfp4_quantize(x, outer)
        assert torch.equal(scales.to(F64).reshape(s8.shape), s8)
        assert torch.equal(V.nvfp4_fake_quant(x, outer).double(), want.reshape(x.shape))


def test_nvfp4_subnormal_and_zero_block_scales():
    """Hand-worked: block amax 0.01 gets the e4m3 subnormal scale 2^-9 (top value saturates at 6·2^-9);
    block amax 0.004 gets scale 0 and reads back 0; the rest matches the float64 re-statement."""
    x = torch.zeros(1, 1, 1, 32)
    x[..., :16] = torch.linspace(-0.01, 0.01, 16)  # amax 0.01: scale 0.01/6 = 0.00167 -> e4m3 subnormal 2^-9
    x[..., 16:] = torch.linspace(-0.004, 0.004, 16)  # 0.004/6 = 0.00067 < 2^-10: scale 0, block reads back 0
    vals, scales = V.nvfp4_quantize(x, 1.0)
    assert scales.to(torch.float32).tolist() == [[[[2.0 ** -9, 0.0]]]]
    deq = V.nvfp4_dequantize(vals, scales, 1.0)
    assert torch.equal(deq[..., 16:], torch.zeros(1, 1, 1, 16))
    assert torch.equal(deq[..., :16].double(), ref_nvfp4(x, 1.0)[0].reshape(1, 1, 1, 32)[..., :16])
    assert float(deq[..., :16].abs().max()) == 6 * 2.0 ** -9  # 0.01 / 2^-9 = 5.12 -> e2m1 6 (saturates at the top)


def test_nvfp4_saturates_at_448_block_scale():
    """At outer scale 1e-4 the block scale clamps to 448, so 6.0 reads back as 6·448·1e-4 (within 2 fp32
    ulps); the whole block equals the float64 re-statement."""
    x = torch.full((1, 1, 1, 16), 6.0)
    x[..., 0] = 3.0
    # outer 1e-4: block scale 1e4 -> clamped to 448; values saturate at 6·448·1e-4 = 0.2688
    got = V.nvfp4_fake_quant(x, 1e-4)
    assert torch.allclose(got[..., 1:].double(), torch.full((15,), 6 * 448 * float(torch.tensor(1e-4))).double(),
                          rtol=2 * EPS32)
    assert torch.equal(got.double(), ref_nvfp4(x, 1e-4)[0].reshape(x.shape))


# nvfp4_4over6: vLLM 0.33 csrc/libtorch_stable/quantization/fp4/nvfp4_kv_cache_kernels.cu
# (nvfp4_candidate_scale, nvfp4_reconstruction_error, cvt_warp_fp16_to_fp4_4over6), re-stated below
# per block in exact rational arithmetic: r32 rounds each float32 operation the kernel does, once per
# fused multiply-add (the wheel's sm_100 SASS: FFMA(q, dq, -x), FFMA(dx, dx, FMUL(dy, dy)), FADD).
def r32(v):
    """Fraction ``v`` rounded to float32 (nearest, ties to even, subnormal quantum 2^-149), from integers."""
    if v == 0:
        return Fraction(0)
    a = abs(v)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1  # 2^e <= a < 2^(e+1)
    quantum = Fraction(2) ** (max(e, -126) - 23)
    n = a / quantum
    f = n.numerator // n.denominator
    rem = n - f
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and f % 2 == 1):
        f += 1
    return f * quantum if v > 0 else -f * quantum


_E2M1_FR = [Fraction(v) for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)]


def e2m1_fr(v):
    """round_to_nearest_e2m1 / cvt.rn.satfinite.e2m1x2: nearest E2M1 magnitude, ties to the even code,
    saturating at 6."""
    a = min(abs(v), Fraction(6))
    i = min(range(8), key=lambda k: (abs(a - _E2M1_FR[k]), k % 2))
    return _E2M1_FR[i] if v >= 0 else -_E2M1_FR[i]


def ref_nvfp4_4over6_block(xs, outer):
    """One 16-value block (float32 values as python floats) and the outer scale (a float32 value):
    ``(chosen e4m3 block scale, 16 E2M1 values, err6, err4)`` as Fractions."""
    gs = r32(1 / Fraction(outer))  # global_scale = 1.0f / k_scale
    vmax = max(abs(Fraction(v)) for v in xs)
    cand = []
    for div in (6, 4):
        sf = r32(gs * r32(vmax * r32(Fraction(1, div))))
        s = Fraction(float(fp8_round(torch.tensor([float(sf)], dtype=F64))[0]))  # e4m3, saturating
        out = r32(1 / r32(s * r32(1 / gs))) if s else Fraction(0)
        dq = r32(1 / out) if out else Fraction(0)
        q = [e2m1_fr(r32(Fraction(v) * out)) for v in xs]
        d = [r32(qi * dq - Fraction(v)) for qi, v in zip(q, xs, strict=True)]
        err = Fraction(0)
        for k in range(8):
            err = r32(err + r32(d[2 * k] * d[2 * k] + r32(d[2 * k + 1] * d[2 * k + 1])))
        cand.append((err, s, q))
    (e6, s6, q6), (e4, s4, q4) = cand
    s, q = (s4, q4) if e4 < e6 else (s6, q6)
    return s, q, e6, e4


def ref_nvfp4_4over6(x, outer):
    """[B,H,S,D] float32 -> (block scales float64 [B,H,S,D/16], E2M1 values float64 [B,H,S,D])."""
    B, H, S, D = x.shape
    xb = x.reshape(-1, 16).tolist()
    res = [ref_nvfp4_4over6_block(b, outer) for b in xb]
    scales = torch.tensor([float(r[0]) for r in res], dtype=F64).reshape(B, H, S, D // 16)
    vals = torch.tensor([[float(v) for v in r[1]] for r in res], dtype=F64).reshape(B, H, S, D)
    return scales, vals


def _one_block(vals):
    return torch.tensor(vals, dtype=torch.float32).reshape(1, 1, 1, 16)


def test_r32_and_ffma_hand_worked():
    """r32 on hand-worked points; kvcal's FFMA rounds once where float64-then-float32 rounds twice:
    (1+2^-23)·2^-24·(1-2^-23) + (1+2^-23) = 1 + 2^-23 + 2^-24 - 2^-70 lies just below the midpoint
    1 + 3·2^-24, so the fused result is 1 + 2^-23; float64 rounds onto the midpoint, which then goes to
    the even 1 + 2^-22."""
    assert r32(Fraction(1, 3)) == Fraction(11184811, 2 ** 25)  # 0x3EAAAAAB
    assert r32(1 + Fraction(3, 2 ** 25)) == 1 + Fraction(2, 2 ** 24)  # tie -> even
    assert r32(Fraction(2) ** -150 * 3) == Fraction(2) ** -148  # subnormal 1.5 quanta -> 2
    a = torch.tensor([1 + 2.0 ** -23])
    b = torch.tensor([2.0 ** -24 * (1 - 2.0 ** -23)])
    assert float((a.double() * b.double() + a.double()).float()) == 1 + 2.0 ** -22
    assert float(V._ffma(a, b, a)) == 1 + 2.0 ** -23
    want = r32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(a)))
    assert Fraction(float(V._ffma(a, b, a))) == want


@pytest.mark.parametrize("outer", [1.0, float(torch.tensor(0.37)), 2.0 ** -3])
def test_nvfp4_4over6_matches_kernel_restatement(outer):
    """nvfp4_4over6 block scales and values equal the exact per-block re-statement of vLLM's kernel bit
    for bit (bf16 inputs, as the kernel reads them), and its SQNR is no worse than plain nvfp4."""
    x = gaussian_outlier((1, 2, 8, 64), seed=6).to(torch.bfloat16).to(torch.float32)
    want_s, want_v = ref_nvfp4_4over6(x, outer)
    vals, scales = V.nvfp4_quantize(x, outer, four_over_six=True)
    assert torch.equal(scales.to(F64), want_s)
    assert torch.equal(vals.double(), want_v)
    assert sqnr_db(x, V.nvfp4_fake_quant(x, outer, four_over_six=True)) >= sqnr_db(x, V.nvfp4_fake_quant(x, outer))


def test_nvfp4_4over6_picks_max4_when_it_is_better():
    """Hand-worked: block [1.0]*15 + [1.25]. max/6: scale e4m3(1.25/6) = 0.203125, 1.0 -> 4.92 -> 4
    (0.8125, error 0.1875 each). max/4: scale 0.3125, 1.0 -> 3.2 -> 3 (0.9375), 1.25 -> 4 (exact):
    smaller error, so max/4 is stored."""
    x = torch.ones(1, 1, 1, 16)
    x[..., 15] = 1.25
    six = V.nvfp4_fake_quant(x)
    assert six[..., 0].item() == 0.8125
    four = V.nvfp4_fake_quant(x, four_over_six=True)
    assert four[0, 0, 0].tolist() == [0.9375] * 15 + [1.25]
    assert V.nvfp4_quantize(x, four_over_six=True)[1].float().item() == 0.3125


def test_nvfp4_4over6_keeps_max6_when_it_is_better():
    """Hand-worked: [1.0]*15 + [1.5]. max/6: scale 1.5/6 = 0.25 (exact e4m3), every value exact (error
    0). max/4: scale 0.375, 1.0 -> 2.67 -> 3 (1.125, error 0.125² each): max/6 is stored."""
    x = torch.ones(1, 1, 1, 16)
    x[..., 15] = 1.5
    vals, scales = V.nvfp4_quantize(x, four_over_six=True)
    assert scales.float().item() == 0.25
    assert torch.equal(V.nvfp4_fake_quant(x, four_over_six=True), x)


def test_nvfp4_4over6_exact_tie_keeps_max6():
    """Hand-worked tie: [1.5] + [0]*15. max/6: scale 0.25, 1.5 -> 6 exactly. max/4: scale 0.375 (e4m3
    1.5·2^-2), output scale 1/0.375 = 2.6666667f, 1.5·2.6666667f = 4.0000000 -> 4, dequant multiplier
    1/2.6666667f = 0.375f: 4·0.375 - 1.5 = 0. Both errors are exactly 0; the kernel's ``err4 < err6``
    keeps max/6, so the stored scale is 0.25, not 0.375."""
    x = _one_block([1.5] + [0.0] * 15)
    s, q, e6, e4 = ref_nvfp4_4over6_block(x.flatten().tolist(), 1.0)
    assert e6 == e4 == 0 and s == Fraction(1, 4)
    vals, scales = V.nvfp4_quantize(x, four_over_six=True)
    assert scales.float().item() == 0.25
    assert vals.flatten().tolist() == [6.0] + [0.0] * 15


def test_nvfp4_4over6_all_zero_block():
    """All-zero block: both candidate scales are e4m3(0) = 0, output scales 0, errors 0: scale byte 0
    and zero values (no division by zero)."""
    x = torch.zeros(1, 1, 1, 32)
    x[..., 16:] = _one_block([1.0] * 15 + [1.25])  # a non-zero neighbour block is unaffected
    vals, scales = V.nvfp4_quantize(x, four_over_six=True)
    assert scales.float().flatten().tolist() == [0.0, 0.3125]
    assert torch.equal(vals[..., :16], torch.zeros(1, 1, 1, 16))
    assert bool(torch.isfinite(V.nvfp4_fake_quant(x, four_over_six=True)).all())


def test_nvfp4_4over6_saturated_max4_scale():
    """Hand-worked, outer 2^-10 (global scale 1024): block [2.0] + [0.875]*15. max/6: 1024·2/6 =
    341.3 -> e4m3 352 (multiplier 352/1024 = 0.34375): 0.875 -> 2.55 -> 3 (1.03125, error 0.15625²
    each), 2.0 -> 5.82 -> 6 (2.0625): err6 = 15·0.0244140625 + 0.00390625. max/4: 1024·2/4 = 512
    saturates to 448 (0.4375): 0.875 -> 2 (exact), 2.0 -> 4.57 -> 4 (1.75): err4 = 0.0625, up to the
    error's float32 dequantization multiplier 1/(1/0.4375) (within 2 ulps of 0.4375, so err4 is within
    2^-20 of 1/16). The saturated max/4 scale 448 is stored (no 256 cap)."""
    x = _one_block([2.0] + [0.875] * 15)
    outer = 2.0 ** -10
    s, q, e6, e4 = ref_nvfp4_4over6_block(x.flatten().tolist(), outer)
    assert e6 == 15 * Fraction(5, 32) ** 2 + Fraction(1, 16) ** 2
    assert abs(e4 - Fraction(1, 16)) < Fraction(1, 2 ** 20) and s == 448
    vals, scales = V.nvfp4_quantize(x, outer, four_over_six=True)
    assert scales.float().item() == 448.0
    assert V.nvfp4_fake_quant(x, outer, four_over_six=True).flatten().tolist() == [1.75] + [0.875] * 15


def test_nvfp4_4over6_underflowed_max6_scale():
    """Hand-worked: block [0.005] + [0]*15, outer 1. max/6: 0.005/6 = 0.00083 < 2^-10 -> e4m3 0, so
    the block would be stored as zeros (err6 = 0.005²). max/4: 0.00125 -> e4m3 2^-9 (nearest of
    {0, 2^-9}), 0.005·512 = 2.56 -> 3, dequantized 3·2^-9 = 0.005859: err4 = 0.00086² < err6, so
    max/4 keeps the block."""
    x = _one_block([0.005] + [0.0] * 15)
    assert V.nvfp4_quantize(x)[1].float().item() == 0.0
    vals, scales = V.nvfp4_quantize(x, four_over_six=True)
    assert scales.float().item() == 2.0 ** -9
    assert V.nvfp4_fake_quant(x, four_over_six=True).flatten().tolist() == [3 * 2.0 ** -9] + [0.0] * 15


def test_nvfp4_4over6_rounding_decides_a_true_tie():
    """A bf16 block (from seeded data) whose two candidates tie in exact arithmetic (both squared
    errors 0.22812020778656006...), but the kernel's float32 FFMA/FADD order makes err4 one ulp
    smaller (0x1.d330aep-3 < 0x1.d330b0p-3): vLLM stores the max/4 scale 0.875, not max/6's 0.625.
    The previous emulation (exact-looking torch sum, max/4 only when strictly smaller) kept 0.625."""
    blk = [3.59375, 1.3125, 0.87109375, 1.4453125, 0.2431640625, -0.2373046875, -1.78125, 0.671875,
           -1.875, -0.8984375, -0.306640625, 3.421875, -0.060302734375, -1.15625, 0.008056640625,
           -0.11865234375]
    s, q, e6, e4 = ref_nvfp4_4over6_block(blk, 1.0)
    q6 = [e2m1_fr(v / Fraction(5, 8)) for v in map(Fraction, blk)]
    q4 = [e2m1_fr(v / Fraction(7, 8)) for v in map(Fraction, blk)]
    exact6 = sum((qi * Fraction(5, 8) - Fraction(v)) ** 2 for qi, v in zip(q6, blk, strict=True))
    exact4 = sum((qi * Fraction(7, 8) - Fraction(v)) ** 2 for qi, v in zip(q4, blk, strict=True))
    assert exact6 == exact4 and e4 < e6 and s == Fraction(7, 8)
    vals, scales = V.nvfp4_quantize(_one_block(blk), four_over_six=True)
    assert scales.float().item() == 0.875
    assert vals.flatten().tolist() == [float(v) for v in q]


def test_e2m1_ties_go_to_even():
    """Hand-worked: e2m1 rounding sends each midpoint (0.25, 0.75, ..., 7.0) to the even neighbour."""
    y = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.75, -5.0])
    assert V.e2m1_round(y).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -1.0, -4.0]


# ---- turboquant ----------------------------------------------------------------------------------
# vLLM 0.33.0 turboquant/centroids.py get_centroids(64, b), printed as float.hex (positive half;
# the codebook is symmetric)
TQ_CENTROIDS_64 = {
    3: ["0x1.f5b9f6p-6", "0x1.82e3f8p-4", "0x1.57daa6p-3", "0x1.133ea8p-2"],
    4: ["0x1.070514p-6", "0x1.8d73fep-5", "0x1.505290p-4", "0x1.e28894p-4",
        "0x1.419a18p-3", "0x1.9e2d80p-3", "0x1.08c2e0p-2", "0x1.5d8edcp-2"],
}


def _centroids(bits):
    pos = [float.fromhex(h) for h in TQ_CENTROIDS_64[bits]]
    return torch.tensor([-p for p in reversed(pos)] + pos, dtype=F64)


@pytest.mark.parametrize("bits", [3, 4])
def test_lloyd_max_centroids_are_vllms(bits):
    """3- and 4-bit Lloyd-Max centroids for d=64 equal vLLM 0.33's get_centroids values (float.hex constants)."""
    assert torch.equal(V.lloyd_max_centroids(64, bits).double(), _centroids(bits))


def ref_tq_value(v, bits):
    """_store_quantized_value: scale=(max−min)/(2^b−1) floored at 1e-8, code=⌊(v−min)/scale+0.5⌋
    clamped; read as code·fp16(scale) + fp16(min)."""
    vd = v.to(F64)
    lo, hi = vd.amin(-1, keepdim=True), vd.amax(-1, keepdim=True)
    scale = f32(f32(hi - lo) / (2 ** bits - 1))
    scale = torch.where(scale > f32(torch.tensor(1e-8, dtype=F64)), scale, f32(torch.tensor(1e-8, dtype=F64)))
    code = torch.floor(f32(f32(f32(vd - lo) / scale) + 0.5)).clamp(0, 2 ** bits - 1)
    return f32(f32(code * fp16_round(scale)) + fp16_round(lo))


@pytest.mark.parametrize("bits", [3, 4])
def test_turboquant_values_match_reference(bits):
    """TurboQuant value quantize/dequantize equals the float64 re-statement bit for bit; a constant row
    (scale -> fp16 0) reads back fp16(0.3)."""
    v = gaussian_outlier((2, 3, 16, 64), seed=7)
    v[0, 0, 2] = 0.3  # constant row: scale 1e-8 -> fp16 0; reads back fp16(0.3)
    got = V.turboquant_value_dequantize(*V.turboquant_value_quantize(v, bits))
    assert torch.equal(got.double(), ref_tq_value(v, bits))
    assert torch.equal(got[0, 0, 2], torch.full((64,), 0.3).half().float())


@pytest.mark.parametrize("name", ["turboquant_4bit_nc", "turboquant_k3v4_nc"])
def test_turboquant_keys_match_reference(name):
    """triton_turboquant_store.py: y = (k/(‖k‖+1e-8)) @ H/8, code = #{fp32 midpoints <= y};
    decode (triton_turboquant_decode.py): fp16 norm · (c/‖c‖) @ H/8."""
    bits = V.TQ_PRESETS[name][0]
    k = gaussian_outlier((2, 3, 32, 64), seed=8)
    codes, norm16 = V.turboquant_key_quantize(k, bits)
    Hn = _sylvester(64) / 8
    kd = k.to(F64)
    n = kd.norm(dim=-1, keepdim=True)
    y = (kd / (n + 1e-8)) @ Hn
    c = _centroids(bits)
    mid = f32(f32(c[:-1] + c[1:]) / 2)
    want = (mid <= y[..., None]).sum(-1)
    # fp32 y differs from float64 by <= 64·eps·Σ|x̂_i||H_ij| + normalisation (< 1e-5 for unit rows)
    far = (y[..., None] - mid).abs().amin(-1) > 1e-5
    assert far.float().mean() > 0.99
    assert torch.equal(codes[far], want[far])
    ulp16 = 2.0 ** (torch.floor(torch.log2(n)) - 10)
    assert bool(((norm16.double() - n).abs() <= ulp16).all())  # fp16 rounding of the fp32 norm
    # dequantization from the emulation's codes and norms, re-stated
    cs = c[codes]
    cs = cs / torch.sqrt((cs * cs).sum(-1, keepdim=True) + 1e-16)
    want_k = norm16.double() * (cs @ Hn)
    got_k = V.turboquant_key_dequantize(codes, norm16, bits, True).double()
    assert float(((got_k - want_k).abs() / norm16.double()).max()) <= 64 * 8 * EPS32  # fp32 dot of 64 terms
    # the preset's fake quant is these two halves
    kh, vh = V.fake_quant_kv(name, k, k)
    assert torch.equal(kh, V.turboquant_key_dequantize(codes, norm16, bits, True))


def test_turboquant_k8v4_keys_are_raw_saturating_e4m3():
    """turboquant_k8v4 keys are the unscaled e4m3 rounding of k (float64 grid re-statement), so a 500
    outlier saturates to 448."""
    k = gaussian_outlier((1, 3, 8, 64), seed=9, outlier=500.0)
    kh, _ = V.fake_quant_kv("turboquant_k8v4", k, k)
    assert torch.equal(kh.double(), fp8_round(k.double()))
    assert float(kh[0, 0, 0, 3]) == 448.0


def test_turboquant_edge_cases():
    """TurboQuant keys: a zero row stores norm 0 and reads back zeros, a norm beyond fp16 stores inf, and
    head_dim 96 is refused with a one-line 'power-of-two' error."""
    k = torch.zeros(1, 1, 2, 64)
    k[0, 0, 1, 0] = 70000.0  # norm beyond fp16: vLLM stores inf
    codes, norm16 = V.turboquant_key_quantize(k, 3)
    assert float(norm16[0, 0, 0]) == 0.0 and math.isinf(float(norm16[0, 0, 1]))
    assert torch.equal(V.turboquant_key_dequantize(codes, norm16, 3, True)[0, 0, 0], torch.zeros(64))
    with pytest.raises(V.VllmDTypeError, match="power-of-two"):
        V.turboquant_key_quantize(torch.zeros(1, 1, 1, 96), 3)


# ---- registry, errors, SQNR floors ---------------------------------------------------------------
def test_errors_are_one_line_and_name_the_fix():
    """Bad input refused with VllmDTypeError: unknown dtype 'fp4' (names the choices), a checkpoint scale
    for int8_per_token_head, scale 0, wrong per-head scale count, nvfp4 head_dim 40 (not a multiple of 16)."""
    x = torch.zeros(1, 1, 1, 64)
    with pytest.raises(V.VllmDTypeError, match="unknown or unemulated.*turboquant_4bit_nc"):
        V.fake_quant_kv("fp4", x, x)
    with pytest.raises(V.VllmDTypeError, match="ignores checkpoint"):
        V.fake_quant_kv("int8_per_token_head", x, x, k_scale=0.5)
    with pytest.raises(V.VllmDTypeError, match="positive and finite"):
        V.fake_quant_kv("fp8", x, x, k_scale=0.0)
    with pytest.raises(V.VllmDTypeError, match="one per KV head"):
        V.fake_quant_kv("fp8", x, x, k_scale=torch.ones(2))
    with pytest.raises(V.VllmDTypeError, match="multiple of 16"):
        V.nvfp4_quantize(torch.zeros(1, 1, 1, 40))


# Floors for N(0,1) data (no outlier), from each format's step: fp8 e4m3 at scale 1 has 3 mantissa
# bits (uniform relative error, SQNR ~ 6.02·4 + 10.8 ≈ 35 dB → floor 30); int8 per row of 64
# Gaussians (amax ≈ 2.5σ, step amax/127 → ~44 dB → floor 38); 4-bit formats ~20 dB → floor 17;
# 3-bit (Lloyd-Max 3-bit Gaussian: 14.6 dB → floor 13).
FLOORS = {"fp8": 30, "fp8_per_token_head": 30, "int8_per_token_head": 38, "int4_per_token_head": 17,
          "nvfp4": 17, "nvfp4_4over6": 17, "turboquant_4bit_nc": 17, "turboquant_3bit_nc": 13}


@pytest.mark.parametrize("name", sorted(FLOORS))
def test_sqnr_floors(name):
    """Each emulated dtype reaches its SQNR floor on N(0,1) keys (values 4 dB lower), floors derived from
    each format's step in the comment above FLOORS."""
    g = torch.Generator().manual_seed(10)
    k = torch.randn(1, 3, 64, 64, generator=g)
    kh, vh = V.fake_quant_kv(name, k, k)
    assert sqnr_db(k, kh) >= FLOORS[name] and sqnr_db(k, vh) >= FLOORS[name] - 4


# ---- memory: hand-worked for SmolLM2-135M (30 layers, 3 KV heads, head_dim 64) ---------------------
SMOL = ModelShape(num_layers=30, num_kv_heads=3, head_dim=64, max_position_embeddings=8192)
B16_LAYER = 3 * 2 * 64 * 2  # 768 bytes per token per layer at 16 bits
HAND = {
    "fp8": 30 * 3 * (64 + 64),  # 11520: 1-byte K and V, scales are layer parameters
    "fp8_e5m2": 11520,
    "fp8_per_token_head": 30 * 3 * (64 + 64 + 4 + 4),  # 12240: fp32 scale inline after K and after V
    "int8_per_token_head": 12240,
    "int4_per_token_head": 30 * 3 * (32 + 32 + 4 + 4),  # 6480: two nibbles a byte + fp32 scale(+zp)
    "nvfp4": 30 * 3 * 2 * (32 + 4),  # 6480: D/2 data + D/16 e4m3 block scales, K and V slots
    "nvfp4_4over6": 6480,
    # turboquant: slot = key + value bytes per head, rounded to even; 26 layers + 4 boundary at 16 bits
    "turboquant_k8v4": 26 * 3 * (64 + 32 + 4) + 4 * B16_LAYER,  # 7800 + 3072 = 10872
    "turboquant_4bit_nc": 26 * 3 * ((32 + 2) + (32 + 4)) + 4 * B16_LAYER,  # 5460 + 3072 = 8532
    "turboquant_k3v4_nc": 26 * 3 * ((24 + 2) + (32 + 4)) + 4 * B16_LAYER,  # 4836 + 3072 = 7908
    "turboquant_3bit_nc": 26 * 3 * ((24 + 2) + (24 + 4)) + 4 * B16_LAYER,  # 4212 + 3072 = 7284
}


@pytest.mark.parametrize("name", sorted(HAND))
def test_vllm_bytes_per_token_smollm2(name):
    """vLLM bytes per token for SmolLM2-135M equals the hand-worked figure per dtype (HAND)."""
    assert vllm_bytes_per_token(SMOL, name) == HAND[name]


def test_vllm_memory_skip_layers_and_blocks():
    """Hand-worked bytes with/without boundary layers and with skipped layers at 16 bits; 100 tokens take
    7 blocks of 16; an out-of-range skip layer is refused."""
    assert vllm_bytes_per_token(SMOL, "turboquant_3bit_nc", add_boundary=False) == 30 * 3 * 54  # 4860
    assert vllm_bytes_per_token(SMOL, "fp8", [0, 29]) == 28 * 384 + 2 * B16_LAYER
    assert vllm_bytes_per_token(SMOL, "turboquant_3bit_nc", [0, 5]) == 25 * 162 + 5 * B16_LAYER
    # 100 tokens occupy 7 blocks of 16 = 112 token slots per sequence
    assert vllm_cache_bytes(SMOL, "nvfp4", 100, 2) == 2 * 112 * 6480
    with pytest.raises(ValueError, match="out of range"):
        vllm_bytes_per_token(SMOL, "fp8", [30])


def test_memory_cli_vllm_format(tmp_path):
    """`kvcal memory --format vllm:turboquant_3bit_nc` prints the hand-worked 7284 bytes/token, boundary
    layers and cache bytes; vllm:fp4 and --skip-layers with a non-vllm format get one-line errors (exit 2)."""
    from kvcal.cli import main

    cfg = tmp_path / "config.json"
    cfg.write_text('{"num_hidden_layers": 30, "num_key_value_heads": 3, "num_attention_heads": 9, '
                   '"hidden_size": 576, "max_position_embeddings": 8192}')
    r = CliRunner().invoke(main, ["memory", "--model", str(cfg), "--format", "vllm:turboquant_3bit_nc",
                                  "--context", "4096"])
    assert r.exit_code == 0, r.output
    assert "bytes per token: 7284" in r.output and "[0, 1, 28, 29]" in r.output
    assert f"cache bytes (context 4096, batch 1, 16-token blocks): {4096 * 7284}" in r.output
    r = CliRunner().invoke(main, ["memory", "--model", str(cfg), "--format", "vllm:fp4"])
    assert r.exit_code == 2 and r.output.startswith("error: unknown or unemulated") and r.output.count("\n") == 1
    r = CliRunner().invoke(main, ["memory", "--model", str(cfg), "--format", "fp8", "--skip-layers", "0"])
    assert r.exit_code == 2 and "vllm:<dtype> formats only" in r.output


# ---- Protocol A: a plan kvcal's evaluation runs, query quantization included -----------------------
def _tiny_llama(layers=6):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def test_vllm_plan_runs_fp8_with_query_quantization_in_protocol_a():
    """The plan hook hands attention e4m3(q·(1/q_scale))·q_scale and e4m3(k/k_scale)·k_scale —
    checked against a callback written from the float64 grids above, logits bit-identical."""
    from kvcal.capture.hooks import attention_hook
    from kvcal.engines.vllm.plan import VllmKVPlan
    from kvcal.evaluate.protocol_a import plan_hook, teacher_forced

    model = _tiny_llama()
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(1))
    ks = [0.01 * (i + 1) for i in range(6)]
    qs = [torch.tensor([0.02, 0.05])] * 6  # per KV head: query heads {0,1} and {2,3}
    plan = VllmKVPlan("fp8", 6, k_scales=ks, v_scales=[0.004] * 6, q_scales=qs, skip_layers=(2,))

    def reference(module, q, k, v, mask, kwargs):
        i = module.layer_idx
        if i == 2:
            return None
        qsc = qs[i].repeat_interleave(2).reshape(1, 4, 1, 1).to(F64)
        qh = f32(fp8_round(f32(q.double() * f32(1.0 / qsc))) * qsc)
        return qh.to(q.dtype), ref_fp8_static(k, torch.tensor(ks[i])).to(k.dtype), \
            ref_fp8_static(v, torch.tensor(0.004)).to(v.dtype)

    with torch.no_grad():
        with attention_hook(model, plan_hook(plan)):
            got = model(ids, use_cache=False).logits
        with attention_hook(model, reference):
            want = model(ids, use_cache=False).logits
        with attention_hook(model, plan_hook(VllmKVPlan("fp8", 6, k_scales=ks, v_scales=[0.004] * 6,
                                                        skip_layers=(2,), quantize_query=False))):
            kv_only = model(ids, use_cache=False).logits
    assert torch.equal(got, want)
    assert not torch.equal(got, kv_only)  # the query quantization reaches attention
    res = teacher_forced(model, ids, {"vllm:fp8": plan}, progress=False)
    assert res["vllm:fp8"]["kl_mean"] > 0 and res["vllm:fp8"]["tokens"] == 23
    assert plan.describe() == {"engine": "vllm", "backend": "cuda",
                               "backend_detail": "FLASH_ATTN / FLASHINFER / TRITON_ATTN (GPU): FP8 written by "
                                                 "rounding to nearest even",
                               "kv_cache_dtype": "fp8", "skip_layers": [2],
                               "query_quantization": "fp8", "k_scale": "per-tensor", "v_scale": "per-tensor",
                               "q_scale": "per-head"}


@pytest.mark.parametrize("name", ["turboquant_k3v4_nc", "nvfp4", "int4_per_token_head", "int8_per_token_head"])
def test_vllm_plan_layers_and_sides(name):
    """VllmKVPlan skips turboquant's boundary layers only and applies fake_quant_kv / fake_quant_query on
    the others; a checkpoint scale for int8_per_token_head and a wrong scale count are refused."""
    from kvcal.engines.vllm.plan import VllmKVPlan

    plan = VllmKVPlan(name, 6)
    x = gaussian_outlier((1, 2, 8, 16), seed=11)
    want_k, want_v = V.fake_quant_kv(name, x, x)
    quantized = [i for i in range(6) if i not in plan.skipped]
    assert plan.skipped == ((0, 1, 4, 5) if name.startswith("turboquant") else ())
    for i in range(6):
        for side, want in (("k", want_k), ("v", want_v)):
            got = plan.fake_quant(i, side, x)
            assert torch.equal(got, want if i in quantized else x)
    q = gaussian_outlier((1, 4, 8, 16), seed=12)
    assert torch.equal(plan.fake_quant_query(3, q, 2), V.fake_quant_query(name, q, num_kv_heads=2))
    with pytest.raises(V.VllmDTypeError, match="ignores checkpoint"):
        VllmKVPlan("int8_per_token_head", 6, k_scales=[0.5] * 6)
    with pytest.raises(V.VllmDTypeError, match="one per layer"):
        VllmKVPlan("fp8", 6, k_scales=[0.5] * 5)


def test_kvcal_evaluate_runs_vllm_dtypes(tmp_path):
    """`kvcal evaluate --vllm-dtype`: teacher-forced rows vllm:<dtype>; fp8 takes the artifact's k/v
    scales (q_scale 1.0) — the same figures as the plan built by hand; vLLM's page bytes."""
    from helpers.runtime import make_plan, tiny_model, write_tiny_artifact
    from helpers.tokenizers import CharTok

    from kvcal.engines.vllm.plan import VllmKVPlan
    from kvcal.evaluate import EvalConfig, evaluate, teacher_forced, text_windows

    model = tiny_model()
    kv = make_plan("fp8")
    art = write_tiny_artifact(tmp_path, model, kv)
    corpus = tmp_path / "c.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 12)
    cfg = EvalConfig(str(art), str(corpus), contexts=(32,), batches=(1,), windows=2, decode_tokens=2,
                     greedy_tokens=0, baselines=False, per_layer_tokens=0,
                     vllm_dtypes=("fp8", "nvfp4", "turboquant_4bit_nc"))
    doc = evaluate(cfg, log=lambda s: None, progress=False, model=model, tokenizer=CharTok())
    rows = {(r["method"], r["mode"]): r for r in doc["results"]}
    assert ("vllm:fp8", "teacher_forced") in rows and ("vllm:fp8", "decode") not in rows
    assert ("artifact", "decode") in rows
    by_hand = VllmKVPlan("fp8", 2, k_scales=[float(lp.k.scale) for lp in kv.layers],
                         v_scales=[float(lp.v.scale) for lp in kv.layers])
    wins = text_windows(CharTok(), corpus.read_text(), 32, 2)
    want = teacher_forced(model, wins, {"x": by_hand}, progress=False)["x"]
    assert rows[("vllm:fp8", "teacher_forced")]["kl_mean"] == want["kl_mean"] > 0
    # the tiny model has 2 layers: vLLM's turboquant boundary rule keeps both in 16 bits
    assert rows[("vllm:turboquant_4bit_nc", "teacher_forced")]["kl_mean"] == 0.0
    m = doc["methods"]
    assert m["vllm:fp8"]["role"] == "vllm" and m["vllm:fp8"]["query_quantization"] == "fp8"
    assert m["vllm:fp8"]["k_scale"] == "per-tensor" and m["vllm:nvfp4"]["k_scale"] == "1.0"
    assert m["vllm:turboquant_4bit_nc"]["skip_layers"] == [0, 1]
    bpt = doc["memory"]["bytes_per_token"]
    assert bpt["vllm:fp8"] == 2 * 2 * 2 * 16 and bpt["vllm:nvfp4"] == 2 * 2 * 2 * (8 + 1)  # L·H·2 sides·(D/2+D/16)
    assert bpt["vllm:turboquant_4bit_nc"] == doc["memory"]["bytes_per_token_16bit"]
    assert any("teacher-forced only" in n for n in doc["notes"])
    from kvcal.errors import KvcalError

    with pytest.raises(KvcalError, match="--vllm-dtype: unknown"):
        EvalConfig("a", "c", vllm_dtypes=("fp4",))


@pytest.mark.parametrize("name", sorted(V.VLLM_DTYPES))
def test_each_token_is_quantized_on_its_own(name):
    """Every vLLM dtype writes each token's K/V independently (static or per-token scales): one decode
    step's row equals that row of a whole-sequence write, bit for bit (what makes Protocol A rows
    equal decode-time reads)."""
    k = gaussian_outlier((1, 3, 40, 64), seed=13)
    v = gaussian_outlier((1, 3, 40, 64), seed=14)
    kh, vh = V.fake_quant_kv(name, k, v)
    k1, v1 = V.fake_quant_kv(name, k[:, :, 17:18], v[:, :, 17:18])
    assert torch.equal(kh[:, :, 17:18], k1) and torch.equal(vh[:, :, 17:18], v1)


def test_evaluate_cli_refuses_an_unknown_vllm_dtype_before_loading(tmp_path):
    """`kvcal evaluate --vllm-dtype fp8,turboquant_2bit` exits 2 with one line naming 'turboquant_2bit',
    before the (missing) artifact is loaded."""
    from kvcal.cli import main

    corpus = tmp_path / "c.txt"
    corpus.write_text("some text " * 20)
    r = CliRunner().invoke(main, ["evaluate", "--artifact", str(tmp_path / "none"), "--corpus", str(corpus),
                                  "--vllm-dtype", "fp8,turboquant_2bit"])
    assert r.exit_code == 2 and r.output.startswith("error: --vllm-dtype: unknown or unemulated vLLM --kv-cache-dtype "
                                                    "'turboquant_2bit'") and r.output.count("\n") == 1


def test_triton_fp_fusion_switch(monkeypatch):
    """TRITON_FP_FUSION=True (kvcal.engines.vllm.dtypes.choices, read by the emulations at call time): ``a·b + c``
    rounds once (FMA). Re-stated in float64, where the product of two float32 numbers and its sum with an fp16 /
    small-integer addend are exact."""
    from kvcal.engines.vllm.dtypes import choices

    monkeypatch.setattr(choices, "TRITON_FP_FUSION", True)
    v = gaussian_outlier((2, 3, 16, 64), seed=15)
    codes, s16, z16 = V.turboquant_value_quantize(v, 4)
    got = V.turboquant_value_dequantize(codes, s16, z16)
    assert torch.equal(got.double(), f32(codes.double() * s16.double() + z16.double()))
    xd = v.double()
    scale = torch.maximum(f32(xd.abs().amax(-1, keepdim=True) / 127.0), f32(torch.tensor(1e-6, dtype=F64)))
    inv = f32(1.0 / scale)
    y = f32(xd * inv)
    code = torch.trunc(torch.where(y >= 0, f32(xd * inv + 0.5), f32(xd * inv - 0.5)).clamp(-128, 127))
    assert torch.equal(V.per_token_head_fake_quant(v, "int8").double(), f32(code * scale))
    # the two modes differ only where an unfused rounding lands on the other side of a boundary
    monkeypatch.setattr(choices, "TRITON_FP_FUSION", False)
    unfused = V.turboquant_value_dequantize(codes, s16, z16)
    # two roundings vs one: |Δ| <= ½ulp(code·scale) + ½ulp(result) <= eps32·(|code·scale| + |result|)
    bound = EPS32 * 2 * ((codes.double() * s16.double()).abs() + got.double().abs())
    assert bool(((unfused.double() - got.double()).abs() <= bound).all())
