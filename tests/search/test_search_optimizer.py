"""Clip-ratio and static-range search: beats min/max where it should, never worse on held-out;
bit allocation respects the byte budget exactly."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from kvcal.formats.granularity import PerChannel, PerToken, PerTokenGroup
from kvcal.formats.memory import cache_bytes
from kvcal.formats.spec import KVCacheConfig, TensorQuantSpec
from kvcal.search import allocate as al
from kvcal.search.objectives import SequenceCache
from kvcal.search.optimizer import search_side
from kvcal.search.presets import ALLOC_MENU, SideChoice


def _outlier_seqs(n, seed, Hq=4, Hk=2, T=48, D=16):
    """Heavy-tailed values (rare huge elements) and keys with channel offsets."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        q = torch.randn(Hq, T, D, generator=g)
        k = torch.randn(Hk, T, D, generator=g) + torch.linspace(-3, 3, D)
        v = torch.randn(Hk, T, D, generator=g)
        spikes = torch.rand(Hk, T, D, generator=g) < 0.02
        v = torch.where(spikes, v * 25, v)
        out.append(SequenceCache(q, k, v, D**-0.5, 16))
    return out


def _stats(caches, side):
    x = torch.cat([(c.k if side == "k" else c.v) for c in caches], dim=1).double()
    return {"min": x.amin(1), "max": x.amax(1), "mean": x.mean(1), "std": x.std(1)}


def _laplace_seqs(n, seed, Hq=4, Hk=2, T=48, D=64):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    return [SequenceCache(torch.randn(Hq, T, D, generator=g), torch.randn(Hk, T, D, generator=g),
                          torch.distributions.Laplace(0.0, 1.0).sample((Hk, T, D)), D**-0.5, 16) for _ in range(n)]


@pytest.mark.parametrize("fmt,gain", [("int4", 0.97), ("int2", 0.6)])
def test_clip_search_beats_minmax_on_heavy_tails(fmt, gain):
    """On seeded Laplace values the clip search learns clips < 0.95 and beats min-max held-out by the
    margins in the comment (int4 < 0.97x, int2 < 0.6x; ACIQ's MSE-optimal clipping)."""
    cal, held = _laplace_seqs(4, 0), _laplace_seqs(2, 1)
    r = search_side(cal, held, "v", SideChoice(TensorQuantSpec(fmt, PerToken(), symmetric=True)))
    # seeded Laplace rows (the same up to ulps on any CPU): MSE-optimal clipping of Laplace data at 4 / 2 bits
    # sits well inside the per-token absmax (ACIQ, Banner et al. 2019); seen: clips 0.92/0.89 (int4),
    # 0.42/0.45 (int2), held-out ratios 0.950 and 0.515 against 0.97 and 0.6. Neighbouring grid clips differ by
    # < 1 % in error, so an ulp-level change of choice stays inside; no clip search gives ratio 1
    assert (r.param < 0.95).all()  # learned a real clip, not min/max
    assert r.heldout < gain * r.heldout_minmax


def test_clip_search_never_worse_than_minmax_when_outliers_matter():
    """When rare value spikes carry the attention output, the held-out guard keeps the search no worse
    than min-max."""
    # rare huge value spikes carry attention output: clipping them hurts, the guard keeps min/max
    cal, held = _outlier_seqs(4, 0), _outlier_seqs(2, 1)
    r = search_side(cal, held, "v", SideChoice(TensorQuantSpec("int4", PerToken(), symmetric=True)))
    assert r.heldout <= r.heldout_minmax


def test_centering_and_static_ranges_guarded_on_heldout():
    """Dynamic group keys with offsets get centering and static per-channel int2 keys get [1, H, 1, D]
    scale/zero point, both no worse than min-max held-out; an fp8 spec is refused ('integer')."""
    cal, held = _outlier_seqs(2, 2, T=32), _outlier_seqs(1, 3, T=32)
    dyn = search_side(cal, held, "k", SideChoice(TensorQuantSpec("int4", PerTokenGroup(64), symmetric=False)),
                      stats=_stats(cal, "k"))
    assert dyn.heldout <= dyn.heldout_minmax
    assert dyn.plan.mean is not None and dyn.extra["centered_heads"]  # offsets make centering pay
    st = search_side(cal, held, "k", SideChoice(TensorQuantSpec("int2", PerChannel(), symmetric=False)), stats=_stats(cal, "k"))
    assert st.heldout <= st.heldout_minmax
    assert st.plan.scale.shape == (1, 2, 1, 16) and st.plan.zero_point.shape == (1, 2, 1, 16)
    with pytest.raises(ValueError, match="integer"):
        search_side(cal, held, "k", SideChoice(TensorQuantSpec("fp8_e4m3")))


def test_allocation_respects_budget_exactly():
    """For several --bits budgets the allocation's bytes equal cache_bytes of the chosen specs, fit the
    budget, and leave no single error-lowering upgrade that fits; 2.0 bits is refused."""
    L, H, D, ctx, sinks = 5, 2, 64, 512, 1
    g = torch.Generator().manual_seed(0)
    items = []
    for layer in range(L):
        for side in ("k", "v"):
            menu = tuple(c.spec for c in ALLOC_MENU[side])
            costs = tuple(al.side_cost(s, H, D, ctx, sinks) for s in menu)
            base = float(torch.rand(1, generator=g)) * (10 if side == "k" else 1)
            errs = tuple(base * 2.0 ** (-s.bits) for s in menu)
            items.append(al.Item(layer, side, menu, costs, errs))
    for bits in (2.5, 3.3, 4.0, 4.25, 6.0):
        budget = al.budget_bytes(bits, L, H, D, ctx)
        choice = al.allocate(items, budget)
        cfgs = []
        for layer in range(L):
            k = items[2 * layer].specs[choice[2 * layer]]
            v = items[2 * layer + 1].specs[choice[2 * layer + 1]]
            cfgs.append(KVCacheConfig(k, v, sink_tokens=sinks))
        total = cache_bytes({"num_hidden_layers": L, "num_key_value_heads": H, "head_dim": D,
                             "num_attention_heads": H}, cfgs, ctx)
        assert total == sum(it.costs[j] for it, j in zip(items, choice, strict=True))
        assert Fraction(total) <= budget
        assert al.average_bits(total, L, H, D, ctx) <= bits
        # nothing cheaper left on the table: no single upgrade fits and lowers the error
        for it, j in zip(items, choice, strict=True):
            for j2 in range(len(it.costs)):
                if it.errors[j2] < it.errors[j]:
                    assert total - it.costs[j] + it.costs[j2] > budget
    with pytest.raises(ValueError, match="budget"):
        al.allocate(items, al.budget_bytes(2.0, L, H, D, ctx))
