"""Edge cases of non-uniform levels and log8 scales: all-zero groups, groups that do not divide head_dim,
log8 encode/decode round trips on code values, the kernels' contract, and a log8 plan without its base."""

from __future__ import annotations

import pytest
import torch

from kvcal.formats.granularity import PerToken, PerTokenGroup
from kvcal.formats.quant import fake_quant
from kvcal.formats.scales import log8_decode, log8_encode
from kvcal.formats.spec import TensorQuantSpec
from kvcal.formats.variants import Codebook, QuantTables
from kvcal.search.objectives import SequenceCache
from kvcal.search.optimizer import search_side
from kvcal.search.presets import SideChoice
from kvcal.search.tables import fit_levels, log8_scale_base

V4 = TensorQuantSpec("int4", PerToken(), symmetric=True)
V8 = TensorQuantSpec("int4", PerToken(), symmetric=True, scale_dtype="log8")


def _cache(v, seed=0):
    H, T, D = v.shape
    g = torch.Generator().manual_seed(seed)
    return SequenceCache(torch.randn(2 * H, T, D, generator=g), torch.randn(H, T, D, generator=g), v, D**-0.5, None)


def test_levels_all_zero_group_dequantizes_to_zero():
    """An all-zero row reads back as exact zeros with the uniform grid, with a levels table lacking 0
    (linspace(-1, 1, 16)), and with fitted levels plus calibrated log8 scales."""
    # A zero group gets the fallback scale 1 and then the level nearest 0 — a table without an exact 0
    # (linspace(-1, 1, 16), or any even-count Lloyd fit) turns an all-zero row into +-L*1 regardless of the
    # data's magnitude. The uniform grid returns exact zeros.
    x = torch.zeros(1, 1, 2, 8)
    x[0, 0, 1] = 1e-3 * torch.arange(8)
    assert torch.equal(fake_quant(x, V4)[0, 0, 0], torch.zeros(8))
    y = fake_quant(x, V4, tables=QuantTables(levels=torch.linspace(-1, 1, 16)))
    assert torch.equal(y[0, 0, 0], torch.zeros(8)), y[0, 0, 0]  # actual: all -0.0667 (66x the row-1 max)
    # same with calibrated log8 scales: the zero row's fallback scale 1 is log8-coded too
    g = torch.Generator().manual_seed(0)
    cal = [_cache(1e-3 * torch.randn(1, 64, 8, generator=g))]
    L = fit_levels(cal, V4)
    base = log8_scale_base(cal, "v", V8, levels=True)
    y = fake_quant(x, V8, tables=QuantTables(levels=L, scale_base=base))
    assert torch.equal(y[0, 0, 0], torch.zeros(8)), y[0, 0, 0]


@pytest.mark.parametrize("g,D", [(12, 16), (32, 80)])
def test_fit_levels_and_search_with_group_not_dividing_head_dim(g, D):
    """With a group size that does not divide head_dim (12 | 16, 32 | 80), fake_quant, fit_levels and
    search_side(levels=True) run (no raw torch error) and search stays no worse than min-max held-out."""
    # quantize / fake_quant pad the last channel group (replicate); fit_levels reshapes [H,T,-1,g] and dies
    # with a raw torch RuntimeError (search_side(levels=True) too). The shipped menu pairs these entries with
    # Hadamard, which already refuses non-power-of-two head_dim, so only direct API use reaches this.
    spec = TensorQuantSpec("int4", PerTokenGroup(g), symmetric=True)
    v = torch.randn(2, 16, D, generator=torch.Generator().manual_seed(1))
    assert fake_quant(v[None], spec, tables=QuantTables(levels=torch.linspace(-1, 1, 16))).shape == (1, 2, 16, D)  # supported
    assert fit_levels([_cache(v)], spec).shape == (2, 16)
    r = search_side([_cache(v)], [_cache(v, 1)], "v", SideChoice(spec, codebook=Codebook.LEVELS), grid=(1.0,))
    assert r.heldout <= r.heldout_minmax


def test_log8_encode_is_the_smallest_covering_code_on_code_values():
    """log8_encode(log8_decode(c)) == c for all 256 codes at base 1e-2 (a code's own value is covered by
    that code, not the next)."""
    # documented: "the smallest code whose log8_decode is >= s". For a scale equal to a code's own
    # decoded value the double-precision ceil lands one code too high (95 of 254 codes at base 1e-2):
    # encode(decode(c)) != c, a 4.4% larger step than needed.
    b = torch.tensor(1e-2)
    c = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(log8_encode(log8_decode(c, b), b), c)


def test_kernels_quantize_keeps_the_reference_contract_for_levels_and_log8():
    """kernels.quantize accepts levels= and scale_base= and, dequantized, equals formats.quant.fake_quant
    exactly for a log8 spec with levels."""
    # kernels.quantize claims "same contract as kvcal.formats.quant.quantize" but has no levels= /
    # scale_base= parameters: log8 specs cannot be quantized through the dispatcher at all.
    from kvcal import kernels

    x = torch.randn(1, 2, 3, 16)
    L = torch.linspace(-1, 1, 16)
    base = torch.tensor([1e-3, 1e-3])
    assert torch.equal(kernels.dequantize(kernels.quantize(x, V8, tables=QuantTables(levels=L, scale_base=base))),
                       fake_quant(x, V8, tables=QuantTables(levels=L, scale_base=base)))


def test_log8_plan_without_base_is_refused_when_written(tmp_path):
    """Writing an artifact from a log8 plan without scale_base is refused with a ValueError naming
    scale_base, instead of writing a file the loader would refuse."""
    # KVPlan.to_tensors / write_artifact accept a log8 side without scale_base and write an artifact
    # that KVPlan.from_artifact (and the runtime) then refuse.
    from kvcal.artifact import write_artifact
    from kvcal.plan import KVPlan, LayerPlan, SidePlan

    k = TensorQuantSpec("int4", PerToken(), symmetric=False)
    plan = KVPlan([LayerPlan(SidePlan(k, clip_ratio=torch.ones(2)), SidePlan(V8, clip_ratio=torch.ones(2)))])
    meta = {"model": {"num_layers": 1, "num_kv_heads": 2, "head_dim": 16}, "kv": plan.kv_metadata()}
    with pytest.raises(ValueError, match="scale_base"):
        write_artifact(tmp_path / "a", plan.to_tensors(), meta)
