"""int5 / int6 payloads (kvcal's runtime only): quantization against a float64 reference, packed
bytes, accounting, plan/artifact and runtime cache equal to Protocol A, and the ``--bits`` menu."""

from __future__ import annotations

import pytest
import torch

from kvcal.formats.granularity import PerChannelTokenGroup, PerToken, PerTokenGroup
from kvcal.formats.quant import dequantize, fake_quant, quantize
from kvcal.formats.spec import TensorQuantSpec
from kvcal.formats.variants import Codebook, SideVariant


@pytest.mark.parametrize("bits", [5, 6])
@pytest.mark.parametrize("sym", [True, False])
def test_uniform_int56_against_float64_reference(bits, sym):
    """int5/int6 group quantization (sym and asym) packs 10/12 bytes per 16 codes and equals the float64
    reference up to float32 ties; fake_quant == dequantize; worst error below int4's / 1.5."""
    spec = TensorQuantSpec(f"int{bits}", PerTokenGroup(8), symmetric=sym, scale_dtype=torch.float32)
    g = torch.Generator().manual_seed(bits + 10 * sym)
    x = torch.randn(2, 3, 5, 16, generator=g, dtype=torch.float64).float()
    qt = quantize(x, spec)
    # packed payload: 16 codes per row -> int5: 2 units of 8 codes in 5 bytes; int6: 4 units of 4 in 3 bytes
    assert qt.data.dtype == torch.uint8 and qt.data.shape[-1] == {5: 10, 6: 12}[bits]
    y = dequantize(qt)
    assert torch.equal(fake_quant(x, spec), y)
    xg = x.double().reshape(2, 3, 5, 2, 8)
    if sym:
        qmax = 2 ** (bits - 1) - 1  # 15 / 31
        s = (xg.abs().amax(-1, keepdim=True) / qmax).float().double()
        ref = torch.round(xg / s).clamp(-qmax, qmax) * s
    else:
        qmax = 2**bits - 1  # 31 / 63
        lo, hi = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
        s = ((hi - lo) / qmax).float().double()
        zp = (-lo / s).float().double()  # floating-point zero point, stored like the scale (fp32)
        ref = (torch.round(xg / s + zp).clamp(0, qmax) - zp) * s
    # float32 library vs float64 reference: codes equal except within float32 rounding of a tie
    from helpers.codes import assert_codes_match_up_to_ties

    t = xg / s + (0 if sym else zp)
    eps32 = torch.finfo(torch.float32).eps
    assert_codes_match_up_to_ties(y.double(), ref.reshape(x.shape), t.reshape(x.shape),
                                  s.expand_as(xg).reshape(x.shape), (eps32 * (t.abs() + (xg / s).abs())).reshape(x.shape))
    # the error shrinks as the grid refines: each extra bit about halves the worst-case error
    err = (y - x).abs().max()
    err4 = (fake_quant(x, TensorQuantSpec("int4", PerTokenGroup(8), symmetric=sym, scale_dtype=torch.float32)) - x).abs().max()
    assert err < err4 / 1.5


def test_int56_memory_accounting_and_levels_tables():
    """Hand-worked cache_bytes: int5/int6 per-token values cost 40/48 payload + 2 scale bytes per token and
    head (less 128 fp16 bytes) plus float32 clip ratios; levels add H·2^b·4 bytes per layer."""
    from kvcal.formats.memory import cache_bytes
    from kvcal.formats.spec import KVCacheConfig

    mc = {"num_hidden_layers": 2, "num_key_value_heads": 3, "head_dim": 64, "num_attention_heads": 3}
    fp = TensorQuantSpec("fp16")
    for bits, row in ((5, 40), (6, 48)):  # 64 codes: 8 units × 5 bytes / 16 units × 3 bytes
        v = TensorQuantSpec(f"int{bits}", PerToken(), symmetric=True)
        got = cache_bytes(mc, KVCacheConfig(fp, v), 100) - cache_bytes(mc, KVCacheConfig(fp, fp), 100)
        # payload + fp16 scale per token and head, minus the 16-bit values they replace, plus the
        # float32 clip ratio per head and layer of a dynamic side
        assert got == 2 * 3 * 100 * (row + 2 - 128) + 2 * 3 * 4
        lv = cache_bytes(mc, KVCacheConfig(fp, v, value_variant=SideVariant(Codebook.LEVELS)), 100) - cache_bytes(mc, KVCacheConfig(fp, v), 100)
        assert lv == 2 * 3 * 2**bits * 4  # float32 [H, 2^b] per layer


def test_int56_levels_plan_artifact_and_runtime_equal_protocol_a():
    """int5/int6 log8 values with levels: runtime prefill equals Protocol A exactly, decode within 1e-5;
    the plan survives to_tensors/from_artifact; an int4-sized levels table is refused naming its shape."""
    from helpers.transforms import H as TH
    from helpers.transforms import L as TL
    from helpers.transforms import (
        decode_and_protocol_a,
        prefill_matches_protocol_a,
        tiny_model,
        transform_plan,
    )

    from kvcal.plan import KVPlan

    model = tiny_model()
    kspec = TensorQuantSpec("int4", PerToken(), symmetric=False)
    plan = transform_plan(model, sinks=1, k_spec=kspec)
    g = torch.Generator().manual_seed(5)
    for i, lp in enumerate(plan.layers):
        bits = 5 + i % 2  # layer 0 int5, layer 1 int6 values
        lp.v.spec = TensorQuantSpec(f"int{bits}", PerToken(), symmetric=True, scale_dtype="log8")
        lp.v.scale_base = torch.tensor([1e-4, 3e-4])
        lp.v.levels = torch.sort(torch.rand(TH, 2**bits, generator=g) * 2 - 1).values
    ids = torch.randint(0, 128, (2, 23), generator=torch.Generator().manual_seed(8))
    prefill_matches_protocol_a(model, plan, ids)
    got, ref = decode_and_protocol_a(model, plan, ids, 6, 18)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    meta = {"model": {"num_layers": TL, "num_kv_heads": TH, "head_dim": 16}, "kv": plan.kv_metadata()}
    t = plan.to_tensors()
    assert t["model.layers.1.self_attn.v_levels"].shape == (TH, 64)
    back = KVPlan.from_artifact(t, meta)
    x = torch.randn(1, TH, 12, 16)
    for layer in range(TL):
        assert torch.equal(back.fake_quant(layer, "v", x), plan.fake_quant(layer, "v", x))
    bad = dict(t)
    bad["model.layers.0.self_attn.v_levels"] = torch.linspace(-1, 1, 16).expand(TH, 16).clone()  # an int4 table
    with pytest.raises(ValueError, match=r"v_levels has shape \(2, 16\), expected"):
        KVPlan.from_artifact(bad, meta)


def test_int56_kernels_fall_back_to_the_reference():
    """int5 is reported as running on the torch reference, and kernels quantize/dequantize equal fake_quant
    exactly."""
    from kvcal import kernels

    spec = TensorQuantSpec("int5", PerChannelTokenGroup(4), symmetric=False)
    assert "torch reference" in kernels.triton_supports(spec, (1, 2, 8, 16))
    x = torch.randn(1, 2, 8, 16, generator=torch.Generator().manual_seed(0))
    assert torch.equal(kernels.dequantize(kernels.quantize(x, spec, backend="triton"
                                                           if kernels.triton_available() else "torch")),
                       fake_quant(x, spec))


def test_bits_menu_offers_int56_values_with_levels():
    """The --bits allocation menu offers int5 and int6 per-token Hadamard values with levels."""
    from kvcal.search.presets import ALLOC_MENU, spec_label

    labels = [spec_label(c) for c in ALLOC_MENU["v"]]
    assert any(lab.startswith("int5/token/sym/hadamard") and "/levels" in lab for lab in labels)
    assert any(lab.startswith("int6/token/sym/hadamard") and "/levels" in lab for lab in labels)


def test_triton_entry_points_refuse_int56():
    """The Triton quantize/dequantize entry points refuse int5 with 'int5 runs on the torch reference'."""
    pytest.importorskip("triton")
    from kvcal.kernels.triton_quant import dequantize_triton, quantize_triton

    spec = TensorQuantSpec("int5", PerToken(), symmetric=True)
    x = torch.randn(1, 1, 4, 16)
    with pytest.raises(ValueError, match="int5 runs on the torch reference"):
        quantize_triton(x, spec, torch.ones(1))
    with pytest.raises(ValueError, match="int5 runs on the torch reference"):
        dequantize_triton(quantize(x, spec), torch.float32)


@pytest.mark.parametrize("dtype16", ["fp16", "bf16"])
def test_unquantized_side_sinks_keep_the_side_dtype(dtype16):
    """Protocol A == runtime when one side is kept in 16 bits and sinks are on: the sink tokens of an
    unquantized side are in that side's own dtype (fp16 or bf16), as the runtime cache stores them."""
    from helpers.transforms import H as TH
    from helpers.transforms import L as TL
    from helpers.transforms import prefill_matches_protocol_a, tiny_model

    from kvcal.plan import KVPlan, LayerPlan, SidePlan

    model = tiny_model()
    k = SidePlan(TensorQuantSpec("int4", PerToken(), symmetric=False), clip_ratio=torch.ones(TH))
    plan = KVPlan([LayerPlan(k, SidePlan(TensorQuantSpec(dtype16))) for _ in range(TL)], sink_tokens=2)
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(1))
    prefill_matches_protocol_a(model, plan, ids)


def test_plan_and_report_count_an_artifacts_per_layer_metadata(tmp_path):
    """``kvcal plan --kv-config ARTIFACT`` and the report's memory section count the per-layer tables an
    artifact carries (levels, rounding, widths, centering means) exactly: the same bytes as the runtime plan's
    configs, more than the specs alone by exactly those tables."""
    from helpers.transforms import H as TH
    from helpers.transforms import L as TL
    from helpers.transforms import tiny_model, transform_plan

    from kvcal.artifact import load_artifact, write_artifact
    from kvcal.capacity import artifact_kv_config, resolve_option
    from kvcal.formats.memory import ModelShape, cache_bytes
    from kvcal.report.data import memory_summary

    model = tiny_model()
    plan = transform_plan(model, sinks=1, k_spec=TensorQuantSpec("int4", PerToken(), symmetric=False))
    for lp in plan.layers:
        lp.v.spec = TensorQuantSpec("int5", PerToken(), symmetric=True, scale_dtype="log8")
        lp.v.scale_base = torch.tensor([1e-4, 3e-4])
        lp.v.levels = torch.linspace(-1, 1, 32).expand(TH, 32).clone()
    meta = {"model": {"num_layers": TL, "num_kv_heads": TH, "head_dim": 16}, "kv": plan.kv_metadata()}
    write_artifact(tmp_path / "a", plan.to_tensors(), meta)
    art = load_artifact(tmp_path / "a")
    mc = {"num_hidden_layers": TL, "num_key_value_heads": TH, "head_dim": 16, "num_attention_heads": TH}
    exact = cache_bytes(mc, [plan.kv_config(i) for i in range(TL)], 100)
    assert cache_bytes(mc, artifact_kv_config(art.metadata, art.tensors), 100) == exact
    specs_only = cache_bytes(mc, artifact_kv_config(art.metadata), 100)
    # float32 levels [H, 32] per layer (the log8 base follows from the spec, so both count it)
    assert exact - specs_only == TL * TH * 32 * 4
    opt = resolve_option(str(tmp_path / "a"), ModelShape(TL, TH, 16, None))
    assert cache_bytes(mc, opt.kv_config, 100) == exact
    mem = memory_summary(art.metadata, contexts=[100], batches=[1], tensors=art.tensors)
    assert mem["cache_bytes"][1] == [exact]
