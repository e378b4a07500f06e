"""Side variants as typed values (kvcal.formats.variants, SidePlan, SideChoice): invalid combinations
are refused when the value is built, with a one-line error."""

from __future__ import annotations

import pytest
import torch

from kvcal.formats.codes import rounding_matrix
from kvcal.formats.granularity import PerChannel, PerChannelTokenGroup, PerToken, PerTokenGroup
from kvcal.formats.quant import fake_quant
from kvcal.formats.spec import TensorQuantSpec
from kvcal.formats.variants import ChannelWidths, Codebook, QuantTables, Rounding, ScaleCoding
from kvcal.plan import SidePlan
from kvcal.search.objectives import SequenceCache
from kvcal.search.presets import ALLOC_MENU, INT_PRESETS, SideChoice, spec_label

H, D = 2, 8
V4 = TensorQuantSpec("int4", PerToken(), symmetric=True)
V4_LOG8 = TensorQuantSpec("int4", PerToken(), symmetric=True, scale_dtype="log8")
K4 = TensorQuantSpec("int4", PerChannelTokenGroup(4), symmetric=False)
LEVELS = torch.linspace(-1, 1, 16).expand(H, 16).contiguous()
TRELLIS = torch.zeros(256)  # 2^(4+4) entries: nu = 4 for int4 codes
U = torch.eye(D).repeat(H, 1, 1)
W = torch.full((H, D), 4)


def _refused(exc, match, build):
    """``build()`` raises ``exc`` matching ``match`` with a one-line message."""
    with pytest.raises(exc, match=match) as e:
        build()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("tables,match", [
    (dict(levels=LEVELS, rounding=U), "non-uniform levels do not combine"),
    (dict(levels=LEVELS, channel_bits=W), "non-uniform levels do not combine"),
    (dict(trellis=TRELLIS, levels=LEVELS), "trellis table does not combine"),
    (dict(trellis=TRELLIS, rounding=U), "trellis table does not combine"),
    (dict(trellis=TRELLIS, channel_bits=W), "trellis table does not combine"),
])
def test_quant_tables_refuse_undefined_combinations_at_construction(tables, match):
    """A levels or trellis codebook with query-aware rounding or per-channel widths (or levels with
    trellis) cannot be built as QuantTables: one-line ValueError at construction."""
    _refused(ValueError, match, lambda: QuantTables(**tables))


def test_quant_tables_name_their_variants():
    """The typed views of QuantTables follow the tables present: codebook, rounding, channel widths."""
    assert QuantTables().codebook is Codebook.UNIFORM and QuantTables().rounding_mode is Rounding.NEAREST
    assert QuantTables(levels=LEVELS).codebook is Codebook.LEVELS
    assert QuantTables(trellis=TRELLIS).codebook is Codebook.TRELLIS
    assert QuantTables(rounding=U, channel_bits=W).rounding_mode is Rounding.QUERY_AWARE
    assert QuantTables(channel_bits=W).channel_widths is ChannelWidths.ALLOCATED
    assert ScaleCoding.of(V4_LOG8) is ScaleCoding.LOG8 and ScaleCoding.of(V4) is ScaleCoding.FLOAT



@pytest.mark.parametrize("build,match", [
    (lambda: SidePlan(V4, scale=torch.ones(1, 1, 1, 1), tables=QuantTables(levels=LEVELS)), "pass clip_ratio, not a calibrated scale"),
    (lambda: SidePlan(V4, clip_ratio=torch.ones(H), tables=QuantTables(trellis=TRELLIS)), "takes no clip_ratio"),
    (lambda: SidePlan(TensorQuantSpec("fp8_e4m3"), scale=torch.ones(1, 1, 1, 1), tables=QuantTables(rounding=U)), "need an int spec"),
    (lambda: SidePlan(V4, clip_ratio=torch.ones(H), tables=QuantTables(scale_base=torch.ones(H))), "scale_base is for log8"),
    (lambda: SidePlan(V4, tables=QuantTables(levels=LEVELS, rounding=U)), "do not combine"),
    (lambda: SidePlan(V4, transform="pre_rope"), "RoPE table"),
])
def test_side_plan_refuses_invalid_combinations_at_construction(build, match):
    """SidePlan(...) with an undefined combination of variant tables, scale parameters, spec and
    transform raises a one-line ValueError at construction (before any use)."""
    _refused(ValueError, match, build)


def test_side_plan_assignment_is_checked_and_leaves_the_plan_unchanged():
    """Assigning a table that makes an undefined combination is refused and the plan keeps its tables;
    a valid assignment shows in the typed views."""
    sp = SidePlan(V4, clip_ratio=torch.ones(H), tables=QuantTables(levels=LEVELS))
    assert sp.codebook is Codebook.LEVELS and sp.rounding_mode is Rounding.NEAREST
    _refused(ValueError, "do not combine", lambda: setattr(sp, "rounding", U))
    assert sp.rounding is None and sp.levels is LEVELS
    sp.levels = None
    sp.rounding = U
    assert sp.codebook is Codebook.UNIFORM and sp.rounding_mode is Rounding.QUERY_AWARE


@pytest.mark.parametrize("build,match", [
    (lambda: SideChoice(V4, rounding=False), "rounding must be one of"),  # the recorded slip: a bool flag
    (lambda: SideChoice(V4, codebook=True), "codebook must be one of"),
    (lambda: SideChoice(K4, channel_widths="some"), "channel_widths must be one of"),
    (lambda: SideChoice(V4, transform="rotate"), "unknown transform"),
    (lambda: SideChoice(V4, codebook=Codebook.LEVELS, rounding=Rounding.QUERY_AWARE), "does not combine"),
    (lambda: SideChoice(TensorQuantSpec("int4", PerTokenGroup(8), symmetric=True), codebook=Codebook.TRELLIS,
                        trellis_nu=6), "symmetric per-token int2–int4"),
    (lambda: SideChoice(V4, codebook=Codebook.TRELLIS), "trellis_nu in 4..10"),
    (lambda: SideChoice(V4, codebook=Codebook.LEVELS, trellis_nu=6), "needs codebook=Codebook.TRELLIS"),
    (lambda: SideChoice(TensorQuantSpec("int4", PerToken(), symmetric=False), codebook=Codebook.LEVELS),
     "symmetric per-token"),
    (lambda: SideChoice(TensorQuantSpec("int8", PerToken(), symmetric=True), codebook=Codebook.LEVELS), "int2–int6"),
    (lambda: SideChoice(TensorQuantSpec("int4", PerChannel(), symmetric=False), rounding=Rounding.QUERY_AWARE),
     "dynamic key specs only"),
    (lambda: SideChoice(TensorQuantSpec("int4", PerTokenGroup(8), symmetric=False),
                        channel_widths=ChannelWidths.ALLOCATED), "per-channel token groups"),
    (lambda: SideChoice(TensorQuantSpec("fp8_e4m3")), "integer specs"),
])
def test_side_choice_refuses_invalid_combinations_at_construction(build, match):
    """SideChoice(...) with an undefined combination of spec and variants raises a one-line ValueError at
    construction — among them a bool where an enum is expected, the slip that once searched value clips
    for the int4 preset (docs/design.md)."""
    _refused(ValueError, match, build)


def test_side_choice_variants_are_keyword_only_and_side_checked():
    """Variants cannot be passed by position (TypeError), and check_side refuses query-aware rounding or
    allocated widths on values and a levels codebook on keys."""
    _refused(TypeError, "positional", lambda: SideChoice(V4, "hadamard"))
    k = SideChoice(K4, rounding=Rounding.QUERY_AWARE, channel_widths=ChannelWidths.ALLOCATED)
    k.check_side("k")
    _refused(ValueError, "defined for keys", lambda: k.check_side("v"))
    v = SideChoice(V4, codebook="levels")
    assert v.codebook is Codebook.LEVELS  # a member's value is accepted and normalized
    _refused(ValueError, "fitted for values", lambda: v.check_side("k"))


def test_every_shipped_choice_is_valid_for_its_side_and_keeps_its_label():
    """Every preset and menu entry builds (its checks pass) and is defined for its side; the int4 preset's
    labels, written into artifacts' metadata, keep their published form."""
    for side, menu in ALLOC_MENU.items():
        for c in menu:
            c.check_side(side)
    for k, v in INT_PRESETS.values():
        k.check_side("k")
        v.check_side("v")
    k, v = INT_PRESETS["int4"]
    assert spec_label(k) == "int4/channel_token_group128/asym/pre_rope/qround/chbits"
    assert spec_label(v) == "int4/token/sym/hadamard/levels/trellis6/log8"


def _value_cache(v: torch.Tensor, seed: int) -> SequenceCache:
    h, T, d = v.shape
    g = torch.Generator().manual_seed(seed)
    return SequenceCache(torch.randn(2 * h, T, d, generator=g), torch.randn(h, T, d, generator=g), v, d**-0.5, None)


def test_search_side_takes_only_a_side_choice():
    """search_side with a SideChoice searches the variants it names (a levels codebook here); a bare
    TensorQuantSpec is refused in one line naming the type it needs."""
    from kvcal.search.optimizer import search_side

    g = torch.Generator().manual_seed(3)
    cal = [_value_cache(torch.randn(H, 24, 16, generator=g), 1)]
    held = [_value_cache(torch.randn(H, 24, 16, generator=g), 2)]
    spec = TensorQuantSpec("int4", PerToken(), symmetric=True)
    a = search_side(cal, held, "v", SideChoice(spec, codebook=Codebook.LEVELS, clip_search=False), refine=False)
    assert a.plan.levels is not None and torch.equal(a.plan.clip_ratio, torch.ones(H))
    _refused(ValueError, "search_side needs a SideChoice", lambda: search_side(cal, held, "v", spec))


def test_artifact_side_with_tables_that_do_not_combine_is_refused_on_load():
    """KVPlan.from_artifact refuses a side holding a levels table next to a rounding matrix (written by
    hand; kvcal never writes both) in one line naming the tensor, instead of loading a plan that fails
    only when used."""
    from kvcal.plan import KVPlan, LayerPlan

    plan = KVPlan([LayerPlan(SidePlan(K4, clip_ratio=torch.ones(H)),
                             SidePlan(V4, clip_ratio=torch.ones(H), tables=QuantTables(levels=LEVELS)))])
    meta = {"model": {"num_layers": 1, "num_kv_heads": H, "head_dim": D}, "kv": plan.kv_metadata()}
    t = plan.to_tensors()
    assert KVPlan.from_artifact(t, meta).layers[0].v.codebook is Codebook.LEVELS
    t["model.layers.0.self_attn.v_rounding"] = U.clone()
    _refused(ValueError, r"^model\.layers\.0\.self_attn\.v_levels: non-uniform levels do not combine",
             lambda: KVPlan.from_artifact(t, meta))


def test_kernel_dispatcher_takes_tables_and_keeps_the_reference_contract():
    """kvcal.kernels.quantize with tables= runs the torch reference for a side with variant tables, so a
    trellis-coded or query-aware-rounded side (no keyword for them in the dispatcher before) reads back
    exactly as formats.quant.fake_quant computes it."""
    from kvcal import kernels
    from kvcal.search.tables import uniform_levels

    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, H, 6, D, generator=g)
    T = (torch.randn(256, generator=g) * 32).round().clamp(-127, 127) / 32  # nu = 4, int8 multiples of 1/32
    tt = QuantTables(trellis=T)
    assert torch.equal(kernels.dequantize(kernels.quantize(x, V4, tables=tt)), fake_quant(x, V4, tables=tt))
    a = torch.randn(H, D, D, generator=g)
    tr = QuantTables(rounding=rounding_matrix(a @ a.transpose(1, 2)))
    assert torch.equal(kernels.dequantize(kernels.quantize(x, K4, tables=tr)), fake_quant(x, K4, tables=tr))
    tl = QuantTables(levels=uniform_levels(4))
    assert torch.equal(kernels.dequantize(kernels.quantize(x, V4, tables=QuantTables(levels=tl.levels))), fake_quant(x, V4, tables=tl))
