"""Per-channel payload widths (``channel_bits``): packing, quantization, allocation, plan, runtime."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvcal.formats.codes import rounding_matrix, unit_rounding
from kvcal.formats.granularity import PerChannel, PerChannelTokenGroup, PerToken
from kvcal.formats.packing import pack, pack_channels, unpack_channels
from kvcal.formats.quant import dequantize, fake_quant, quantize
from kvcal.formats.spec import TensorQuantSpec
from kvcal.formats.variants import ChannelWidths, QuantTables
from kvcal.search.objectives import SequenceCache
from kvcal.search.tables import channel_bit_allocation, water_fill_bits

K4 = TensorQuantSpec("int4", PerChannelTokenGroup(16), symmetric=False)


# ---- packing --------------------------------------------------------------------------------------

def test_pack_channels_hand_worked_bytes():
    """Hand-worked: widths [4,4,4,4] pack codes 1,2,3,4 into bytes 33, 67; widths [1,3,8,4] pack 1,5,200,9
    into 40075 (little-endian bytes); unpack_channels restores the codes."""
    w = torch.tensor([[4, 4, 4, 4], [1, 3, 8, 4]])
    codes = torch.tensor([[[[1, 2, 3, 4]], [[1, 5, 200, 9]]]])
    p = pack_channels(codes, w)
    # head 0: 1 | 2<<4 = 33, 3 | 4<<4 = 67 (the 4-bit layout); head 1: 1 | 5<<1 | 200<<4 | 9<<12 = 40075
    assert p.tolist() == [[[[33, 67]], [[40075 & 255, 40075 >> 8]]]]
    assert torch.equal(unpack_channels(p, w), codes.to(torch.uint8))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_pack_channels_with_equal_widths_is_the_plain_layout(bits):
    """pack_channels with every width = b is byte-identical to the plain pack(codes, b) for b = 2, 3, 4."""
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (2, 3, 5, 16), generator=g)
    w = torch.full((3, 16), bits)
    assert torch.equal(pack_channels(codes, w), pack(codes, bits))


def test_pack_channels_round_trip_random_widths():
    """Mixed widths summing to 32 bits per row pack into 4 bytes per row and unpack to the same codes."""
    g = torch.Generator().manual_seed(0)
    w = torch.tensor([[8, 1, 1, 6, 4, 4, 3, 5], [4] * 8, [2, 2, 7, 5, 4, 4, 4, 4]])
    codes = torch.randint(0, 256, (2, 3, 9, 8), generator=g) % (2 ** w)[None, :, None, :]
    p = pack_channels(codes, w)
    assert p.shape == (2, 3, 9, 4)  # 32 bits per row
    assert torch.equal(unpack_channels(p, w), codes.to(torch.uint8))


def test_pack_channels_refuses_bad_tables():
    """pack_channels refuses widths outside 1..8, heads with unequal total bits, a code that does not fit
    its width, non-integer widths or codes, and a table of the wrong shape."""
    c = torch.zeros(1, 2, 1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="1..8"):
        pack_channels(c, torch.tensor([[0, 4, 6, 6], [4, 4, 4, 4]]))
    with pytest.raises(ValueError, match="same number of bits"):
        pack_channels(c, torch.tensor([[4, 4, 4, 5], [4, 4, 4, 4]]))
    with pytest.raises(ValueError, match="does not fit"):
        pack_channels(c + 4, torch.tensor([[2, 2, 6, 6], [4, 4, 4, 4]]))
    with pytest.raises(ValueError, match="integers"):
        pack_channels(c, torch.tensor([[4.5, 3.5, 4, 4], [4, 4, 4, 4]]))
    with pytest.raises(ValueError, match="integers"):
        pack_channels(c.float() + 0.7, torch.full((2, 4), 4))
    with pytest.raises(ValueError, match="do not match"):
        pack_channels(c, torch.full((2, 3), 4))


# ---- quantize / dequantize ----------------------------------------------------------------------------

def test_channel_bits_hand_worked_codes():
    """One head, 2 tokens, D=4, widths [8, 4, 2, 2] (16 bits = the int4 row). Channel 0 spans
    [0, 255] (step 1), channel 2 spans [0, 3] (step 1): 100.3 -> 100, 1.6 -> 2."""
    spec = TensorQuantSpec("int4", PerChannelTokenGroup(2), symmetric=False)
    x = torch.tensor([[[[0.0, 0.0, 0.0, 0.0], [255.0, 15.0, 3.0, 3.0]]]])
    x3 = torch.tensor([[[[0.0, 0.0, 0.0, 0.0], [255.0, 15.0, 3.0, 3.0], [100.3, 7.4, 1.6, 0.4]]]])
    w = torch.tensor([[8, 4, 2, 2]])
    y = fake_quant(x, spec, tables=QuantTables(channel_bits=w))
    assert torch.equal(y, x)  # the extremes are codes
    spec3 = TensorQuantSpec("int4", PerChannelTokenGroup(3), symmetric=False)
    y3 = fake_quant(x3, spec3, tables=QuantTables(channel_bits=w))
    assert y3[0, 0, 2].tolist() == [100.0, 7.0, 2.0, 0.0]
    qt = quantize(x3, spec3, tables=QuantTables(channel_bits=w))
    assert qt.data.shape == (1, 1, 3, 2) and qt.payload_nbytes == quantize(x3, spec3).payload_nbytes
    # row 2: 100 | 7<<8 | 2<<12 | 0<<14 = 100 + 1792 + 8192
    assert qt.data[0, 0, 2].tolist() == [100, (1792 + 8192) >> 8]


def test_channel_bits_against_float64_reference_and_round_trip():
    """Channel-width fake-quant equals dequantize(quantize) and stays within half a float64 step
    (max−min)/(2^w−1) (+fp16 slack); uniform widths equal plain fake-quant; also with query-aware rounding."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 40, 8, generator=g) * torch.tensor([5.0, 1, 0.1, 2, 3, 0.5, 1, 1]) + 3
    w = torch.tensor([[8, 6, 1, 4, 4, 3, 3, 3], [4] * 8, [2, 2, 2, 2, 6, 6, 6, 6]])
    y = fake_quant(x, K4, tables=QuantTables(channel_bits=w))
    qt = quantize(x, K4, tables=QuantTables(channel_bits=w))
    assert torch.equal(dequantize(qt), y)
    assert torch.equal(qt.tables.channel_bits, w)
    # float64 reference: step = (max - min) / (2^w - 1) per 16-token group and channel
    xp = torch.cat([x, x[:, :, -1:].expand(2, 3, 8, 8)], 2).double().reshape(2, 3, 3, 16, 8)
    step = (xp.amax(3, keepdim=True) - xp.amin(3, keepdim=True)) / (2.0 ** w.double() - 1)[None, :, None, None]
    step = step.expand_as(xp).reshape(2, 3, 48, 8)[:, :, :40]
    err = (y.double() - x.double()).abs() / step
    # within half a step: the scale is rounded up to fp16 (≤ 2⁻¹⁰ relative), the fp16 zero point only shifts the
    # grid (and cannot push a group's extreme past the top code while |zp| < 1024), plus float32 rounding ≪ 1e-3
    assert float(err.max()) <= 0.5 * (1 + 2e-3)
    # uniform widths reproduce the plain quantizer bit for bit
    assert torch.equal(fake_quant(x, K4, tables=QuantTables(channel_bits=torch.full((3, 8), 4))), fake_quant(x, K4))
    # with query-aware rounding: still the packed round trip
    a = torch.randn(3, 8, 8, generator=g)
    U = unit_rounding(rounding_matrix(a @ a.transpose(1, 2)))
    assert torch.equal(dequantize(quantize(x, K4, tables=QuantTables(channel_bits=w, rounding=U))), fake_quant(x, K4, tables=QuantTables(channel_bits=w, rounding=U)))


def test_channel_bits_refused_for_static_ranges():
    """Per-channel bit widths are refused for static per-channel ranges: those scales are calibrated for the
    spec's own top code, so widths would only clamp them (1-bit channels saturate, 8-bit ones gain nothing)."""
    spec = TensorQuantSpec("int4", PerChannel(), symmetric=False)
    x = torch.linspace(0, 1, 2 * 8 * 4).reshape(1, 2, 8, 4)
    w = torch.tensor([[6, 6, 2, 2], [4, 4, 4, 4]])
    with pytest.raises(ValueError, match="per-channel token groups"):
        fake_quant(x, spec, tables=QuantTables(channel_bits=w))
    with pytest.raises(ValueError, match="per-channel token groups"):
        quantize(x, spec, scale=torch.full((1, 2, 1, 4), 0.1), zero_point=torch.zeros(1, 2, 1, 4), tables=QuantTables(channel_bits=w))


def test_channel_bits_refused_where_undefined():
    """channel_bits refused for symmetric or per-token specs, non-integer/boolean/string widths, widths
    not summing to 4·D, widths outside 1..8, and a table of the wrong head count."""
    x = torch.randn(1, 2, 8, 4)
    w = torch.full((2, 4), 4)
    with pytest.raises(ValueError, match="asymmetric int"):
        fake_quant(x, TensorQuantSpec("int4", PerChannelTokenGroup(4), symmetric=True), tables=QuantTables(channel_bits=w))
    with pytest.raises(ValueError, match="per-channel token groups"):
        fake_quant(x, TensorQuantSpec("int4", PerToken(), symmetric=False), tables=QuantTables(channel_bits=w))
    with pytest.raises(ValueError, match="integers"):
        fake_quant(x, K4, tables=QuantTables(channel_bits=torch.full((2, 4), 4.7)))
    with pytest.raises(ValueError, match="integers"):
        fake_quant(x, K4, tables=QuantTables(channel_bits=torch.tensor([[4.5, 3.5, 4, 4], [4, 4, 4, 4]])))
    with pytest.raises(ValueError, match="integers"):
        fake_quant(x, K4, tables=QuantTables(channel_bits=torch.ones(2, 4, dtype=torch.bool)))
    with pytest.raises(ValueError, match="integer tensor"):
        fake_quant(x, K4, tables=QuantTables(channel_bits="4"))
    with pytest.raises(ValueError, match="do not sum to 4·D"):
        fake_quant(x, K4, tables=QuantTables(channel_bits=torch.tensor([[4, 4, 4, 4], [5, 4, 4, 4]])))
    with pytest.raises(ValueError, match="1..8"):
        fake_quant(x, K4, tables=QuantTables(channel_bits=torch.tensor([[0, 8, 4, 4], [4, 4, 4, 4]])))
    with pytest.raises(ValueError, match="does not fit"):
        fake_quant(x, K4, tables=QuantTables(channel_bits=torch.full((3, 4), 4)))


# ---- allocation ----------------------------------------------------------------------------------------

def _objective(weight, widths):
    return sum(float(wt) / (2.0 ** b - 1) ** 2 for wt, b in zip(weight, widths, strict=True))


def test_water_fill_bits_hand_worked_and_exhaustive():
    """water_fill_bits: hand-worked allocations (dominant channel gets the bits, ties stay uniform) and the
    objective of brute force over all width vectors summing to 15; negative weights or min_bits > 8 are refused."""
    # channel 0's next-bit gains (1e6·(1/(2^b-1)^2 - 1/(2^(b+1)-1)^2)) all beat channel 1's first (0.889)
    assert water_fill_bits(torch.tensor([[1e6, 1.0, 1.0, 1e-6]]), 2).tolist() == [[5, 1, 1, 1]]
    assert water_fill_bits(torch.ones(2, 4), 4).tolist() == [[4] * 4] * 2
    assert water_fill_bits(torch.zeros(1, 4), 4).tolist() == [[4] * 4]  # ties go to the fewest bits: uniform
    assert water_fill_bits(torch.tensor([[0.0, 0.0, 0.0, 1e6]]), 2).tolist() == [[1, 1, 1, 5]]
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        wt = torch.rand(5, generator=g).double() ** 4 * 100
        got = water_fill_bits(wt[None], 3)[0].tolist()
        best = min((c for c in itertools.product(range(1, 9), repeat=5) if sum(c) == 15),
                   key=lambda c: _objective(wt, c))
        assert sum(got) == 15 and _objective(wt, got) == pytest.approx(_objective(wt, best), rel=1e-12)
    with pytest.raises(ValueError, match="non-negative"):
        water_fill_bits(torch.tensor([[1.0, -1.0]]), 4)
    with pytest.raises(ValueError, match="min_bits"):
        water_fill_bits(torch.ones(1, 2), 9)


def test_channel_bit_allocation_follows_query_weight_times_range():
    """Channel 0 is read by large queries, channel 3 by none: 0 gets the most bits, 3 the fewest;
    the weight is Σ q_c² · mean over token groups of range_c² (hand-computable here)."""
    g = torch.Generator().manual_seed(0)
    T, D = 32, 4
    q = torch.randn(2, T, D, generator=g) * torch.tensor([10.0, 1.0, 1.0, 0.0])  # 2 query heads, 1 KV head
    k = torch.randn(1, T, D, generator=g)
    c = SequenceCache(q, k, k.clone(), D**-0.5, None)
    w = channel_bit_allocation([c], K4, sinks=0)
    assert w.shape == (1, D) and int(w.sum()) == 16
    assert int(w[0, 0]) == int(w.max()) and int(w[0, 3]) == 1
    wq = (q.double() ** 2).sum((0, 1))
    kg = k[0].double().reshape(2, 16, D)
    r2 = ((kg.amax(1) - kg.amin(1)) ** 2).mean(0)
    assert torch.equal(w, water_fill_bits((wq * r2)[None], 4))
    with pytest.raises(ValueError, match="asymmetric int"):
        channel_bit_allocation([c], TensorQuantSpec("int4", PerToken(), symmetric=True))


# ---- plan, artifact, runtime -----------------------------------------------------------------------------

def test_plan_artifact_round_trip_and_validation(tmp_path):
    """Key channel widths survive KVPlan -> tensors -> from_artifact (same fake_quant); widths not summing
    to 4·D, or widths on the symmetric per-token value side, are refused naming the tensor."""
    from kvcal.plan import KVPlan, LayerPlan, SidePlan

    H, D = 2, 8
    spec = TensorQuantSpec("int4", PerChannelTokenGroup(4), symmetric=False)
    w = torch.tensor([[8, 4, 4, 4, 4, 4, 2, 2], [4] * 8])
    plan = KVPlan([LayerPlan(SidePlan(spec, clip_ratio=torch.ones(H), tables=QuantTables(channel_bits=w)),
                             SidePlan(TensorQuantSpec("int4", PerToken(), symmetric=True)))])
    meta = {"model": {"num_layers": 1, "num_kv_heads": H, "head_dim": D}, "kv": plan.kv_metadata()}
    t = plan.to_tensors()
    back = KVPlan.from_artifact(t, meta)
    assert torch.equal(back.layers[0].k.channel_bits, w)
    x = torch.randn(1, H, 12, D)
    assert torch.equal(back.fake_quant(0, "k", x), plan.fake_quant(0, "k", x))
    assert plan.kv_config(0).key_variant.channel_widths is ChannelWidths.ALLOCATED
    assert plan.kv_config(0).value_variant.channel_widths is ChannelWidths.SPEC
    bad = dict(t)
    bad["model.layers.0.self_attn.k_channel_bits"] = torch.full((H, D), 5.0)
    with pytest.raises(ValueError, match="k_channel_bits"):
        KVPlan.from_artifact(bad, meta)
    bad = dict(t)
    bad["model.layers.0.self_attn.v_channel_bits"] = torch.full((H, D), 4.0)  # values are per-token symmetric
    with pytest.raises(ValueError, match=r"v_channel_bits \(int4 token sym side\): per-channel bit widths need an asym"):
        KVPlan.from_artifact(bad, meta)


def test_runtime_with_channel_bits_equals_protocol_a_and_accounting():
    """Runtime cache with key channel widths and rounding: prefill logits equal Protocol A exactly; the cache
    holds exactly L·H·D more bytes (uint8 widths table), as cache_bytes says; and every one of 28 decode steps
    stores exactly quantize() of the keys/values it handed the cache (helpers.plans.decode_stores_quantize_of_inputs:
    the new token's packed codes and its token group's scale / zero point). Decode logits are not compared with
    Protocol A here: the keys are per-channel token groups, whose open group is re-quantized as it fills."""
    from helpers.plans import decode_stores_quantize_of_inputs
    from helpers.transforms import D as TD
    from helpers.transforms import H as TH
    from helpers.transforms import L as TL
    from helpers.transforms import prefill_matches_protocol_a, tiny_model, transform_plan

    from kvcal.formats.memory import cache_bytes
    from kvcal.runtime import QuantizedKVCache

    model = tiny_model()
    plan = transform_plan(model, sinks=1)
    g = torch.Generator().manual_seed(2)
    w = water_fill_bits(torch.rand(TH, TD, generator=g) ** 4, 4)
    assert int(w.max()) > 4
    a = torch.randn(TH, TD, TD, generator=g)
    for lp in plan.layers:
        lp.k.channel_bits = w
        lp.k.rounding = rounding_matrix(a @ a.transpose(1, 2))
    ids = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(6))
    cache = prefill_matches_protocol_a(model, plan, ids)
    plain = transform_plan(model, sinks=1)
    for lp in plain.layers:
        lp.k.rounding = plan.layers[0].k.rounding
    c2 = QuantizedKVCache(plain, model.config)
    with torch.no_grad():
        model(ids, cache=c2, use_cache=True)
    assert cache.allocated_bytes() - c2.allocated_bytes() == TL * TH * TD  # the uint8 widths table
    mc = {"num_hidden_layers": TL, "num_key_value_heads": TH, "head_dim": TD, "num_attention_heads": TH}
    assert cache_bytes(mc, plan.kv_config(0), 64) - cache_bytes(mc, plain.kv_config(0), 64) == TL * TH * TD
    assert decode_stores_quantize_of_inputs(model, plan, ids, 5, 33) == 28 * TL * 2  # steps x layers x sides
