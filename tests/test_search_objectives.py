"""Objectives vs float64 brute force; centering invariance; one-head views."""

from __future__ import annotations

import math

import torch

from kvcal.formats.granularity import PerTokenGroup
from kvcal.formats.spec import TensorQuantSpec
from kvcal.search.objectives import SequenceCache
from kvcal.search.optimizer import make_plan, quantize_seq, side_error


def _seq(seed=0, Hq=4, Hk=2, T=9, D=8):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(Hq, T, D, generator=g), torch.randn(Hk, T, D, generator=g) * 1.5,
            torch.randn(Hk, T, D, generator=g))


def _brute(q, k, v, kh, vh, scaling):
    """Loops in float64: per KV head (KL, centered, key-out num, value-out num, out den)."""
    Hq, T, D = q.shape
    Hk = k.shape[0]
    G = Hq // Hk
    res = torch.zeros(5, Hk, dtype=torch.float64)
    for hq in range(Hq):
        h = hq // G
        for i in range(T):
            s = [float(q[hq, i].double() @ k[h, j].double()) * scaling for j in range(i + 1)]
            sh = [float(q[hq, i].double() @ kh[h, j].double()) * scaling for j in range(i + 1)]
            lse, lseh = math.log(sum(math.exp(x) for x in s)), math.log(sum(math.exp(x) for x in sh))
            p = [math.exp(x - lse) for x in s]
            ph = [math.exp(x - lseh) for x in sh]
            res[0, h] += sum(pj * ((a - lse) - (b - lseh)) for pj, a, b in zip(p, s, sh, strict=True))
            d = [b - a for a, b in zip(s, sh, strict=True)]
            m = sum(d) / len(d)
            res[1, h] += sum((x - m) ** 2 for x in d)
            o = sum(pj * v[h, j].double() for j, pj in enumerate(p))
            ok = sum((phj - pj) * v[h, j].double() for j, (pj, phj) in enumerate(zip(p, ph, strict=True)))
            ov = sum(pj * (vh[h, j].double() - v[h, j].double()) for j, pj in enumerate(p))
            res[2, h] += float(ok @ ok)
            res[3, h] += float(ov @ ov)
            res[4, h] += float(o @ o)
    return res


def test_objectives_match_float64_brute_force():
    q, k, v = _seq()
    g = torch.Generator().manual_seed(1)
    kh, vh = k + 0.1 * torch.randn(k.shape, generator=g), v + 0.1 * torch.randn(v.shape, generator=g)
    c = SequenceCache(q, k, v, 8**-0.5, None)
    ref = _brute(q, k, v, kh, vh, 8**-0.5)
    # SequenceCache computes in float32 (scores: D = 8-term dots; softmax over ≤ 9 keys), the reference in
    # float64. Rounding errors of such short sums behave as independent ±eps32/2 terms (Higham §2.8): the
    # results' relative errors are ~√(D + T)·eps32 ≈ 5e-7 times the cancellation in the KL / centered
    # differences (~3 here) — 1.5e-6 (KL) and ≤ 4e-7 (the rest) measured, on every CPU capability. rtol 1e-4 is
    # 65x that; the first-order worst case (all roundings aligned, ~9e-3 for the KL) is not a realistic event.
    # A real defect — reverse KL, a missing causal mask, a 1/D instead of 1/√D scaling — is ≥ 1e-2 off.
    torch.testing.assert_close(c.key_kl(kh), ref[0], rtol=1e-4, atol=1e-8)
    torch.testing.assert_close(c.key_centered(kh), ref[1], rtol=1e-4, atol=1e-8)
    num, den = c.key_output_error(kh)
    torch.testing.assert_close(num, ref[2], rtol=1e-4, atol=1e-8)
    torch.testing.assert_close(den, ref[4], rtol=1e-4, atol=1e-8)
    num, den = c.value_error(vh)
    torch.testing.assert_close(num, ref[3], rtol=1e-4, atol=1e-8)


def test_key_centering_is_exact_under_softmax():
    q, k, v = _seq(2, T=24, D=16)
    # dyadic keys (multiples of 2⁻¹²) and offsets (of 1/8): (k + μ) − μ == k exactly in float32, so the
    # centered plan sees the same keys and picks the same codes (an ulp could move a code at a tie)
    k = (k * 4096).round() / 4096
    mu = (torch.linspace(-5, 5, 16) * 8).round().div(8).repeat(2, 1)  # [H, D] per-channel offsets
    assert torch.equal((k + mu[:, None]) - mu[:, None], k)
    c = SequenceCache(q, k, v, 0.25, None)
    c_shift = SequenceCache(q, k + mu[:, None], v, 0.25, None)
    # exact keys with a per-channel mean added: attention is unchanged (KL 0 between the two)
    # float32 scores of k and k + μ differ only by rounding (q·μ is a per-row constant that softmax removes):
    # KL ≈ Σ p·(δs)² ≲ (γ_D·Σ|q·k|)² ≈ 1e-10 per row; 1e-5 is the float32 log-softmax floor 8·eps32·(|s|+log T)
    assert float(c.key_kl(k + mu[:, None]).abs().max()) < 1e-5
    # quantizing (k + mu) with centering mu gives the same attention KL as quantizing k uncentered
    spec = TensorQuantSpec("int4", PerTokenGroup(64), symmetric=False, scale_dtype=torch.float32)
    plain = make_plan(spec, torch.ones(2))
    centered = make_plan(spec, torch.ones(2), mean=mu)
    kl_plain = side_error([c], "k", plain, "kl")[0]
    kl_centered = side_error([c_shift], "k", centered, "kl")[0]
    # the same codes (dyadic data above); what differs is the float32 rounding of the shifted scores q·(k̂ + μ)
    # (|q·μ| ≲ 20: γ_D·20 ≈ 4e-5 absolute per score, cancelling in the KL's log-prob differences to ~1e-4
    # relative at worst); a centering that is not removed after quantizing changes the KL by O(1)
    torch.testing.assert_close(kl_centered, kl_plain, rtol=1e-3, atol=1e-7)
    # and centering beats quantizing the offset keys directly
    assert float(side_error([c_shift], "k", plain, "kl")[0].sum()) > 2 * float(kl_centered.sum())


def test_head_view_and_sinks():
    q, k, v = _seq(3, T=12)
    c = SequenceCache(q, k, v, 0.3, 6)
    spec = TensorQuantSpec("int2", PerTokenGroup(8), symmetric=False)
    plan = make_plan(spec, torch.tensor([0.8, 0.9]))
    full = side_error([c], "k", plan, "kl")[0]
    one = side_error([c.head(1)], "k", make_plan(spec, torch.tensor([0.9])), "kl")[0]
    torch.testing.assert_close(one[0], full[1])  # a view of the same head: float32 default rtol 1.3e-6 (sum order)
    xh = quantize_seq(plan, k, sinks=2)
    assert torch.equal(xh[:, :2], k[:, :2].to(torch.bfloat16).float())
    assert not torch.equal(xh[:, 2:], k[:, 2:])
