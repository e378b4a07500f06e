"""Attention objectives vs float64 brute force, and the FP8 static scale search."""

from __future__ import annotations

import math

import torch

from kvcal.formats.fp8 import FP8_E4M3, fake_quant_fp8
from kvcal.search.objectives import SequenceCache, query_positions
from kvcal.search.static_scales import candidate_scales, choose_static_fp8


def brute(q, k, v, k_hat, v_hat, scaling):
    """float64 per-KV-head: Σ KL(P‖P̂) over all queries, Σ‖PΔV‖², Σ‖PV‖²."""
    Hq, T, _ = q.shape
    Hkv = k.shape[0]
    G = Hq // Hkv
    kl = torch.zeros(Hkv, dtype=torch.float64)
    num = torch.zeros(Hkv, dtype=torch.float64)
    den = torch.zeros(Hkv, dtype=torch.float64)
    for j in range(Hq):
        h = j // G
        for t in range(T):
            s = q[j, t].double() @ k[h, : t + 1].double().T * scaling
            sh = q[j, t].double() @ k_hat[h, : t + 1].double().T * scaling
            p, ph = torch.softmax(s, 0), torch.softmax(sh, 0)
            kl[h] += (p * (p.log() - ph.log())).sum()
            o = p @ v[h, : t + 1].double()
            do = p @ (v_hat[h, : t + 1].double() - v[h, : t + 1].double())
            num[h] += (do * do).sum()
            den[h] += (o * o).sum()
    return kl, num, den


def test_objectives_match_float64_reference():
    """SequenceCache key KL and value error sums equal the float64 brute-force restatement within the
    derived worst-case float32 bounds; 12 tokens × 3 query heads per KV head are counted."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(6, 12, 8, generator=g), torch.randn(2, 12, 8, generator=g), torch.randn(2, 12, 8, generator=g)
    k_hat = k + 0.05 * torch.randn(k.shape, generator=g)
    v_hat = v + 0.05 * torch.randn(v.shape, generator=g)
    c = SequenceCache(q, k, v, 8**-0.5, max_queries=None)
    kl_ref, num_ref, den_ref = brute(q, k, v, k_hat, v_hat, 8**-0.5)
    # float32 library vs float64 reference within the worst-case float32 bounds computed from the data
    # (helpers.objectives.fp32_bounds; rtol 1e-4 / 1e-5 stood here without an argument)
    from helpers.objectives import fp32_bounds

    bound = fp32_bounds(q, k, v, k_hat, v_hat, 8**-0.5)
    num, den = c.value_error(v_hat)
    assert bool(((c.key_kl(k_hat) - kl_ref).abs() <= bound[0]).all())
    assert bool(((num - num_ref).abs() <= bound[3]).all()) and bool(((den - den_ref).abs() <= bound[4]).all())
    assert c.num_queries == 12 * 3


def test_key_error_invariant_to_per_channel_shift():
    """Adding the same vector to every key shifts each query's scores by a constant: KL and the
    centered score error are zero (why key centering is exact under softmax)."""
    g = torch.Generator().manual_seed(1)

    def dyadic(x, bits):  # multiples of 2^-bits
        return (x * 2**bits).round() / 2**bits

    q, k, v = dyadic(torch.randn(4, 10, 8, generator=g), 6), dyadic(torch.randn(2, 10, 8, generator=g), 6), \
        torch.randn(2, 10, 8, generator=g)
    shifted = k + dyadic(torch.randn(2, 1, 8, generator=g), 3)
    # dyadic q, k, shift and scaling 1/4: every product, partial sum and scaled score is a multiple of 2⁻¹⁴
    # below 2⁹, exact in float32 in any summation order, so the shifted scores are the plain ones plus a
    # per-row constant, exactly, and softmax removes it exactly: both errors are 0 on any CPU
    c = SequenceCache(q, k, v, 0.25, None)
    assert float(c.key_kl(shifted).abs().max()) == 0.0
    assert float(c.key_centered(shifted).max()) == 0.0
    assert float(c.key_centered(k + 0.1 * torch.randn(k.shape, generator=g)).max()) > 1e-3


def test_query_positions():
    """Hand-worked: query_positions(5, None) is all positions; (100, 10) gives 10 positions from 0 to 99."""
    assert query_positions(5, None).tolist() == [0, 1, 2, 3, 4]
    p = query_positions(100, 10)
    assert p[0] == 0 and p[-1] == 99 and len(p) == 10


def test_candidates_include_baselines():
    """The first candidate scales are absmax (amax/448), unity (1) and otf (amax/200), by hand for amax
    448 and 224."""
    labels, s = candidate_scales(torch.tensor([448.0, 224.0]), FP8_E4M3, "k")
    assert labels[:3] == ["absmax", "unity", "otf"]
    assert torch.equal(s[0], torch.tensor([1.0, 0.5]))
    assert torch.equal(s[1], torch.ones(2))
    torch.testing.assert_close(s[2], torch.tensor([448 / 200, 224 / 200]))


def _seqs(seed, n, outlier=0.0, T=24):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        q = torch.randn(4, T, 16, generator=g)
        k = torch.randn(2, T, 16, generator=g) * 1e-3  # tiny keys: unity scale underflows
        v = torch.randn(2, T, 16, generator=g) * 1e-3
        if outlier:
            k[0, 0, 0] = outlier
        out.append(SequenceCache(q * 300, k, v, 0.25, None))
    return out


def test_choice_never_worse_than_absmax_or_unity_on_heldout():
    """The chosen static FP8 scale (per tensor and per head) is never worse held-out than absmax or unity,
    finite and positive; unity loses by > 10x on keys ~1e-3 (below e4m3's smallest subnormal)."""
    calib, held = _seqs(0, 4), _seqs(1, 2)
    amax = torch.stack([torch.stack([c.k[h].abs().max() for c in calib]).max() for h in range(2)])
    for per_head in (False, True):
        ch = choose_static_fp8(calib, held, amax, "k", FP8_E4M3, per_head)
        assert ch.heldout["chosen"] <= ch.heldout["absmax"] + 1e-15
        assert ch.heldout["chosen"] <= ch.heldout["unity"] + 1e-15
        assert torch.isfinite(ch.scale).all() and (ch.scale > 0).all()
        assert ch.scale.numel() == (2 if per_head else 1)
    # unity underflows tiny keys into FP8 subnormals/zero: it must lose clearly here
    assert ch.heldout["unity"] > 10 * ch.heldout["chosen"]  # keys ~1e-3 at scale 1: below e4m3's 2⁻⁹ subnormal step


def test_heldout_figures_are_recomputable():
    """The recorded held-out error of the chosen value scale equals the error recomputed from
    value_error sums within rel 1e-6 (float64 summation order plus one float32 rounding)."""
    calib, held = _seqs(2, 3), _seqs(3, 2)
    amax = torch.tensor([float(max(c.v.abs().max() for c in calib))] * 2)
    ch = choose_static_fp8(calib, held, amax, "v", FP8_E4M3, per_head=False)
    num = den = 0.0
    for c in held:
        e, r = c.value_error(fake_quant_fp8(c.v, ch.scale.view(1, 1, 1), FP8_E4M3))
        num, den = num + float(e.sum()), den + float(r.sum())
    # the same float32 per-sequence errors, summed in float64 in another order: ≤ a few eps64 apart; 1e-6 also
    # absorbs the float32 → Python float path (one rounding, eps32/2 = 6e-8). Another scale is ≥ 1e-2 off
    assert math.isclose(ch.heldout["chosen"], num / den, rel_tol=1e-6)


# ---- the clip-free choice (what a non-saturating engine, SGLang, is exported) ----------------------------------


def test_clip_free_choice_by_hand():
    """clip_free_choice keeps only rows whose scale x 448 covers each column's amax (the amax rule always), takes
    the calibration best among them, then the lower held-out error of {that, the amax rule}. Hand-made errors:
    per tensor the calibration best overall (row 2, clips) is excluded and row 3 (headroom, clip-free) wins over
    the amax rule on held-out; per head, column 1's best clip-free row loses to the amax rule on held-out."""
    from kvcal.search.guard import clip_free_choice

    amax = torch.tensor([448.0, 448.0])
    scales = torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.9, 0.9], [1.25, 1.25]], dtype=torch.float64)  # [C=4, H=2]
    scales[1] = 0.5  # a clipping row
    num_c = torch.tensor([[4.0, 4.0], [9.0, 9.0], [1.0, 1.0], [2.0, 2.0]], dtype=torch.float64)
    held_err = {1.0: torch.tensor([3.0, 1.0]), 1.25: torch.tensor([2.0, 5.0])}  # per scale, per column

    def errors(caches, rows):
        return torch.stack([held_err[float(r[0])] for r in rows]).double()

    p = clip_free_choice(errors, ["c"], [], scales, amax, 448.0, num_c, per_head=False)
    # per tensor: rows 0 (sum 8) and 3 (sum 4) are clip-free; 3 wins on calibration; held-out 7 (row 3) vs 4 (row 0)
    assert p.index.tolist() == [0, 0] and p.heldout == 4.0 and p.calib == 8.0
    assert torch.equal(p.scale, torch.tensor([1.0, 1.0]))
    p = clip_free_choice(errors, ["c"], [], scales, amax, 448.0, num_c, per_head=True)
    # per head: row 3 best clip-free in each column; held-out column 0: 2 (row 3) < 3 (row 0); column 1: 5 > 1
    assert p.index.tolist() == [3, 0] and p.heldout == 2.0 + 1.0 and p.calib == 2.0 + 4.0
    assert torch.equal(p.scale, torch.tensor([1.25, 1.0]))


def test_clip_free_scale_never_clips_and_its_figure_is_recomputable():
    """With one key outlier the search may clip it; the recorded clip-free scale never clips the calibration amax
    (scale x 448 >= amax), equals the chosen scale wherever that clips nothing, and its recorded held-out KL
    equals the KL recomputed from key_kl sums with that scale (rel 1e-6: float32 per-sequence sums added in
    float64 in another order plus one float32 rounding, as test_heldout_figures_are_recomputable). The caches make
    clipping win: key channel 0 carries a 50.0 outlier that no query reads (their channel 0 is 0), so saturating it
    costs no score while the other keys (~1e-3, e4m3 subnormals at amax / 448) gain resolution."""
    def seqs(seed, n):
        out = []
        for c in _seqs(seed, n):
            q, k = c.q.clone(), c.k.clone()
            q[:, :, 0] = 0.0
            k[:, :, 0] = 50.0
            out.append(SequenceCache(q, k, c.v, 0.25, None))
        return out

    calib, held = seqs(4, 4), seqs(5, 2)
    amax = torch.stack([torch.stack([c.k[h].abs().max() for c in calib]).max() for h in range(2)])
    for per_head in (False, True):
        ch = choose_static_fp8(calib, held, amax, "k", FP8_E4M3, per_head)
        assert any(lab.startswith("clip") for lab in ch.label), ch.label  # the searched scale clips here
        cf = ch.clip_free
        cover = amax if per_head else amax.max().reshape(1)
        assert bool((cf["scale"].double() * 448 >= cover.double() * (1 - 1e-6)).all())
        if bool((ch.scale.double() * 448 >= cover.double() * (1 - 1e-6)).all()):
            assert torch.equal(cf["scale"], ch.scale)
        num = 0.0
        s = cf["scale"].view(-1, 1, 1) if per_head else cf["scale"].view(1, 1, 1)
        for c in held:
            num += float(c.key_kl(fake_quant_fp8(c.k, s, FP8_E4M3)).sum())
        assert math.isclose(cf["heldout"], num / (sum(c.num_queries for c in held) * 2), rel_tol=1e-6)
    assert ch.candidates is None  # per-head searches record no per-candidate table
    ch = choose_static_fp8(calib, held, amax, "k", FP8_E4M3, False)
    assert not any(lab.startswith("clip") for lab in ch.clip_free["label"])
    labels, s = candidate_scales(amax.max().expand(2).double(), FP8_E4M3, "k")
    assert ch.candidates["label"] == labels and ch.candidates["scale"] == [float(x) for x in s[:, 0].float()]
