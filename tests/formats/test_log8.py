"""8-bit log-coded per-token scales (``scale_dtype="log8"``): coding, quantization, accounting, plan, runtime."""

from __future__ import annotations

import pytest
import torch

from kvcal.formats.granularity import PerChannel, PerToken, PerTokenGroup
from kvcal.formats.quant import dequantize, fake_quant, quantize
from kvcal.formats.scales import log8_base, log8_decode, log8_encode
from kvcal.formats.spec import TensorQuantSpec
from kvcal.formats.variants import QuantTables

V8 = TensorQuantSpec("int4", PerToken(), symmetric=True, scale_dtype="log8")


def test_log8_codes_hand_worked():
    """Hand-worked log8 codes at base 1: 1.5 -> 10, 2^(1/16) -> 1, 0.25 -> 1, 16 -> 64, 1e6 -> 255 (top), 0 -> 0;
    decoded values equal 2^(c/16) in float64; log8_base puts the top code 16x above the largest scale."""
    base = torch.tensor(1.0)
    # 16·log2(1.5) = 9.36 -> code 10, 2^(10/16) = 1.54221; exactly 2^(1/16) -> 1 (code 0 is reserved for
    # scale 0); below the base -> 1; 2^4 -> 64; 2^(255/16) = 62 757 is the top code, larger is clipped to it
    s = torch.tensor([1.5, 2 ** (1 / 16), 0.25, 2.0**4, 1e6, 0.0])
    e = log8_encode(s, base)
    assert e.dtype == torch.uint8 and e.tolist() == [10, 1, 1, 64, 255, 0]
    ref = 2.0 ** (torch.tensor([10, 1, 1, 64, 255], dtype=torch.float64) / 16)
    torch.testing.assert_close(log8_decode(e, base)[:5].double(), ref, rtol=1e-7, atol=0)
    assert float(log8_decode(e, base)[5]) == 0.0
    # the base puts the top code 16x above the largest calibration scale
    torch.testing.assert_close(log8_base(torch.tensor([3.0])).double() * 2 ** (255 / 16),
                               torch.tensor([48.0], dtype=torch.float64), rtol=1e-6, atol=0)


def test_log8_codes_are_the_smallest_that_cover_the_scale():
    """For 20,000 log-uniform scales, each code decodes to >= the scale and the code below decodes to less
    (or the code is 0)."""
    g = torch.Generator().manual_seed(0)
    base = torch.tensor(1e-2)  # codes span [0.01, 627.6]
    s = torch.exp(torch.rand(20000, generator=g, dtype=torch.float64) * 10 - 4).float()  # [e^-4, e^6]
    e = log8_encode(s, base)
    d, d_prev = log8_decode(e, base), log8_decode(e.long() - 1, base)
    assert bool((d >= s).all()) and bool(((e == 0) | (d_prev < s)).all())


@pytest.mark.parametrize("spec", [V8, TensorQuantSpec("int2", PerTokenGroup(16), symmetric=True, scale_dtype="log8")])
def test_log8_quantization_against_float64_reference(spec):
    """log8-scaled int8/int2 quantization: each scale is within one log8 step above clip·absmax/qmax, and
    the values equal the float64 reference up to float32 ties; fake_quant == dequantize."""
    g = torch.Generator().manual_seed(1)
    H, D = 3, 32
    x = torch.randn(2, H, 9, D, generator=g) * torch.tensor([0.01, 1.0, 50.0]).reshape(1, H, 1, 1)
    base = torch.tensor([1e-5, 1e-3, 1e-1])
    qt = quantize(x, spec, tables=QuantTables(scale_base=base), clip_ratio=torch.tensor([1.0, 0.9, 1.0]))
    assert qt.scale.dtype == torch.uint8 and torch.equal(qt.tables.scale_base, base)
    y = dequantize(qt)
    assert torch.equal(y, fake_quant(x, spec, tables=QuantTables(scale_base=base), clip_ratio=torch.tensor([1.0, 0.9, 1.0])))
    gs = D if isinstance(spec.granularity, PerToken) else spec.granularity.group_size
    xg = x.double().reshape(2, H, 9, D // gs, gs)
    a = xg.abs().amax(-1, keepdim=True) * torch.tensor([1.0, 0.9, 1.0], dtype=torch.float64).reshape(1, H, 1, 1, 1)
    s_exact = a / spec.qmax
    s = base.double().reshape(1, H, 1, 1, 1) * 2.0 ** (qt.scale.double().reshape(s_exact.shape) / 16)
    assert bool((s >= s_exact.float().double() * (1 - 1e-6)).all()) and bool((s < s_exact * 2 ** (1 / 16) * (1 + 1e-6)).all())
    ref = (xg / s).round().clamp(-spec.qmax, spec.qmax) * s
    # codes equal except within float32 rounding of a tie (the library divides in float32)
    from helpers.codes import assert_codes_match_up_to_ties

    t = xg / s
    assert_codes_match_up_to_ties(y.double(), ref.reshape(2, H, 9, D), t.reshape(2, H, 9, D),
                                  s.expand_as(xg).reshape(2, H, 9, D), torch.finfo(torch.float32).eps * t.abs().reshape(2, H, 9, D))
    # MSE costs about 4.5% over fp16 scales on Gaussian rows (2^(1/16) steps, rounded up)


def test_log8_refusals_and_spec_round_trip():
    """log8 specs round-trip through to_dict/from_dict; log8 is refused for asymmetric or per-channel specs,
    and a missing, misplaced, wrong-length, non-positive, non-numeric or overflowing scale_base is refused."""
    assert V8.to_dict()["scale_dtype"] == "log8" and TensorQuantSpec.from_dict(V8.to_dict()) == V8
    with pytest.raises(ValueError, match="log8 scales"):
        TensorQuantSpec("int4", PerToken(), symmetric=False, scale_dtype="log8")
    with pytest.raises(ValueError, match="log8 scales"):
        TensorQuantSpec("int4", PerChannel(), symmetric=True, scale_dtype="log8")
    x = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="scale_base="):
        quantize(x, V8)
    with pytest.raises(ValueError, match="scale_base is for log8"):
        quantize(x, TensorQuantSpec("int4", PerToken(), symmetric=True), tables=QuantTables(scale_base=torch.ones(2)))
    with pytest.raises(ValueError, match="one value per KV head"):
        quantize(x, V8, tables=QuantTables(scale_base=torch.ones(3)))
    with pytest.raises(ValueError, match="finite and > 0"):
        quantize(x, V8, tables=QuantTables(scale_base=torch.tensor([1.0, 0.0])))
    with pytest.raises(ValueError, match="scale_base must be a number or a float tensor"):
        quantize(x, V8, tables=QuantTables(scale_base="a"))
    with pytest.raises(ValueError, match="overflows float32 at the top log8 code"):
        quantize(x, V8, tables=QuantTables(scale_base=torch.tensor([3e38, 1.0])))


def test_log8_memory_accounting():
    """Hand-worked cache_bytes: log8 value scales save one byte per token, head and layer against fp16
    scales, and cost a float32 base per head and layer."""
    from kvcal.formats.memory import cache_bytes
    from kvcal.formats.spec import KVCacheConfig

    mc = {"num_hidden_layers": 2, "num_key_value_heads": 3, "head_dim": 64, "num_attention_heads": 3}
    fp16 = TensorQuantSpec("int4", PerToken(), symmetric=True)
    a = cache_bytes(mc, KVCacheConfig(fp16, V8), 100, batch=2)
    b = cache_bytes(mc, KVCacheConfig(fp16, fp16), 100, batch=2)
    # one byte instead of two per token, head and layer; plus the float32 base per head and layer
    assert b - a == 2 * 3 * 100 * 2 - 2 * 3 * 4


def test_log8_plan_artifact_and_runtime_equal_protocol_a():
    """log8 values with levels: runtime prefill equals Protocol A exactly; hand-worked byte difference vs fp16
    scales; the plan survives from_artifact; a missing, misplaced (key) or negative scale_base is refused by name."""
    from helpers.plans import artifact_round_trip, assert_refused
    from helpers.transforms import H as TH
    from helpers.transforms import L as TL
    from helpers.transforms import prefill_matches_protocol_a, tiny_model, transform_plan

    from kvcal.runtime import QuantizedKVCache

    model = tiny_model()
    kspec = TensorQuantSpec("int4", PerToken(), symmetric=False)
    plan = transform_plan(model, sinks=1, k_spec=kspec)
    plain = transform_plan(model, sinks=1, k_spec=kspec)
    for lp in plan.layers:
        lp.v.spec = TensorQuantSpec("int4", PerToken(), symmetric=True, scale_dtype="log8")
        lp.v.scale_base = torch.tensor([1e-4, 3e-4])
        lp.v.levels = torch.linspace(-1, 1, 16)
    ids = torch.randint(0, 128, (2, 21), generator=torch.Generator().manual_seed(3))
    cache = prefill_matches_protocol_a(model, plan, ids)
    c2 = QuantizedKVCache(plain, model.config)
    with torch.no_grad():
        model(ids, cache=c2, use_cache=True)
    # per layer: -1 byte per token (2 sequences × 20 quantized tokens × H heads), +4H base, +64H levels
    assert c2.allocated_bytes() - cache.allocated_bytes() == TL * (2 * 20 * TH - 4 * TH - 64 * TH)
    t, meta = artifact_round_trip(plan, TH, 16)
    assert_refused(t, meta, "lacks model.layers.1.self_attn.v_scale_base",
                   "model.layers.1.self_attn.v_scale_base", None)
    assert_refused(t, meta, "k_scale_base is only for log8", "model.layers.0.self_attn.k_scale_base", torch.ones(TH))
    assert_refused(t, meta, "v_scale_base: scale_base must be finite and > 0",
                   "model.layers.0.self_attn.v_scale_base", torch.tensor([1.0, -1.0]))
