"""Non-uniform levels (``levels``): quantization, fitting, search guard, plan/artifact, runtime."""

from __future__ import annotations

import pytest
import torch

from kvcal.formats.codes import check_levels
from kvcal.formats.granularity import PerChannelTokenGroup, PerToken, PerTokenGroup
from kvcal.formats.quant import dequantize, fake_quant, quant_step, quantize
from kvcal.formats.spec import TensorQuantSpec
from kvcal.formats.variants import ChannelWidths, Codebook, QuantTables, Rounding
from kvcal.search.objectives import SequenceCache
from kvcal.search.optimizer import search_side
from kvcal.search.presets import SideChoice
from kvcal.search.tables import fit_levels, uniform_levels

V4 = TensorQuantSpec("int4", PerToken(), symmetric=True)
#: 16 levels exactly representable in binary (so midpoints and ties are exact)
EXACT = torch.tensor([-1, -0.75, -0.5, -0.375, -0.25, -0.125, -0.0625, 0, 0.0625, 0.125, 0.25, 0.375, 0.5,
                      0.625, 0.75, 1.0])


def test_levels_hand_worked_codes_bytes_and_values():
    """Hand-worked: [1, -0.3, 0.1, -0.03125] with the EXACT levels gives codes 15, 4, 9, 6 (a midpoint
    goes to the lower level), packed bytes [79, 105], scale 1 and values [1, -0.25, 0.125, -0.0625]."""
    x = torch.tensor([1.0, -0.3, 0.1, -0.03125]).reshape(1, 1, 1, 4)
    qt = quantize(x, V4, tables=QuantTables(levels=EXACT))
    # scale = absmax = 1; -0.3 lies above the -0.3125 midpoint -> -0.25 (code 4); 0.1 above 0.09375 -> 0.125
    # (code 9); -0.03125 is exactly the midpoint of -0.0625 / 0 -> the lower level (code 6). Codes are
    # unsigned, element 0 in the low nibble: 15 | 4<<4 = 79, 9 | 6<<4 = 105.
    assert qt.data.flatten().tolist() == [79, 105]
    assert qt.scale.flatten().tolist() == [1.0]
    assert dequantize(qt).flatten().tolist() == [1.0, -0.25, 0.125, -0.0625]
    assert torch.equal(fake_quant(x, V4, tables=QuantTables(levels=EXACT)), dequantize(qt))


@pytest.mark.parametrize("spec", [V4, TensorQuantSpec("int2", PerTokenGroup(8), symmetric=True),
                                  TensorQuantSpec("int3", PerToken(), symmetric=True),
                                  TensorQuantSpec("int5", PerToken(), symmetric=True),
                                  TensorQuantSpec("int6", PerTokenGroup(8), symmetric=True)])
def test_levels_against_float64_reference_and_round_trip(spec):
    """Level quantization equals the float64 reference (fp16-rounded-up clip·absmax scale, nearest level)
    except within float32 rounding of a midpoint, where it is the neighbouring level; fake_quant == dequantize."""
    g = torch.Generator().manual_seed(spec.bits)
    H, D = 3, 16
    n = 2**spec.bits
    L = torch.sort(torch.rand(H, n, generator=g) * 2 - 1).values
    x = torch.randn(2, H, 7, D, generator=g) * torch.tensor([0.1, 1.0, 30.0]).reshape(1, H, 1, 1)
    clip = torch.tensor([1.0, 0.9, 0.8])
    qt = quantize(x, spec, tables=QuantTables(levels=L), clip_ratio=clip)
    y = dequantize(qt)
    assert torch.equal(fake_quant(x, spec, tables=QuantTables(levels=L), clip_ratio=clip), y)
    # reference: scale = clip * group absmax rounded up to fp16; nearest level (argmin, first on ties)
    gsz = D if isinstance(spec.granularity, PerToken) else spec.granularity.group_size
    xg = x.double().reshape(2, H, 7, D // gsz, gsz)
    a = xg.abs().amax(-1, keepdim=True) * clip.double().reshape(1, H, 1, 1, 1)
    s = a.float().half()
    s = torch.where(s.float() < a.float(), torch.nextafter(s, torch.tensor(float("inf"), dtype=torch.half)), s).double()
    assert torch.equal(qt.scale.double().reshape(s.shape), s)
    u = xg / s
    idx = (u.unsqueeze(-1) - L.double().reshape(1, H, 1, 1, 1, n)).abs().argmin(-1)
    ref = torch.gather(L.double().reshape(1, H, 1, 1, n).expand(2, H, 7, D // gsz, n), -1, idx) * s
    # the library divides and forms the midpoints in float32 (each within eps32/2 of its size, |mid| ≤ 1):
    # a level can differ from the float64 one only where u lies that close to a midpoint, and then it is
    # the neighbouring level. Elsewhere equal up to the float32 product level·scale (rtol eps32)
    eps32 = torch.finfo(torch.float32).eps
    mids = (L.double()[:, 1:] + L.double()[:, :-1]).reshape(1, H, 1, 1, 1, n - 1) / 2
    near = ((u.unsqueeze(-1) - mids).abs() <= 2 * eps32 * (u.abs().unsqueeze(-1) + 1)).any(-1).reshape(2, H, 7, D)
    gap = (L.double().diff(dim=-1).amax(-1).reshape(1, H, 1, 1, 1) * s).expand(-1, -1, -1, -1, gsz).reshape(2, H, 7, D)
    diff = (y.double() - ref.reshape(2, H, 7, D)).abs()
    off = diff > 2 * eps32 * ref.reshape(2, H, 7, D).abs()
    assert not bool((off & ~near).any()) and bool((diff[off] <= gap[off] * (1 + 1e-6)).all())


def test_uniform_levels_row_is_plain_symmetric_quantization():
    """uniform_levels(4) reproduces plain symmetric int4 fake-quant exactly (values kept away from
    midpoints), and its first entries are -1, -1, -6/7 within float32 rounding."""
    # absmax 7 -> plain scale 1 and levels scale 7 are exact; values sit 0.2 / 0.3 away from midpoints
    g = torch.Generator().manual_seed(0)
    k = torch.randint(-7, 7, (1, 2, 5, 16), generator=g).float()
    x = k + torch.where(torch.rand(k.shape, generator=g) < 0.5, 0.2, 0.7)
    x[..., 0] = 7.0
    assert torch.equal(fake_quant(x, V4, tables=QuantTables(levels=uniform_levels(4))), fake_quant(x, V4))
    # float32 k/7: within eps32/2 relative of the float64 value (assert_close's float64 rtol 1e-7 > 6e-8)
    torch.testing.assert_close(uniform_levels(4)[:3].double(), torch.tensor([-1.0, -1.0, -6 / 7], dtype=torch.float64))


def test_levels_refused_where_undefined():
    """Levels refused with a one-line ValueError for asymmetric/int8 specs, per-channel groups, wrong
    shape, entries outside [-1, 1], decreasing, NaN or integer tables, an explicit scale, a rounding matrix, quant_step."""
    x = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="symmetric int2–int6"):
        fake_quant(x, TensorQuantSpec("int4", PerToken(), symmetric=False), tables=QuantTables(levels=EXACT))
    with pytest.raises(ValueError, match="symmetric int2–int6"):
        fake_quant(x, TensorQuantSpec("int8", PerToken(), symmetric=True), tables=QuantTables(levels=torch.linspace(-1, 1, 256)))
    with pytest.raises(ValueError, match="per-token or per-token-group"):
        fake_quant(x, TensorQuantSpec("int4", PerChannelTokenGroup(4), symmetric=True), tables=QuantTables(levels=EXACT))
    with pytest.raises(ValueError, match=r"do not fit \[H, 2\^b\]"):
        fake_quant(x, V4, tables=QuantTables(levels=EXACT[:8]))
    with pytest.raises(ValueError, match="lie in"):
        fake_quant(x, V4, tables=QuantTables(levels=EXACT * 1.5))
    with pytest.raises(ValueError, match="non-decreasing"):
        fake_quant(x, V4, tables=QuantTables(levels=EXACT.flip(0)))
    with pytest.raises(ValueError, match="finite"):
        fake_quant(x, V4, tables=QuantTables(levels=torch.where(EXACT == 0, float("nan"), EXACT)))
    with pytest.raises(ValueError, match="float tensor"):
        fake_quant(x, V4, tables=QuantTables(levels=torch.arange(16)))
    with pytest.raises(ValueError, match="pass clip_ratio, not scale"):
        quantize(x, V4, tables=QuantTables(levels=EXACT), scale=torch.ones(1, 2, 4, 1))
    with pytest.raises(ValueError, match="do not combine"):
        fake_quant(x, V4, tables=QuantTables(levels=EXACT, rounding=torch.eye(8).repeat(2, 1, 1)))
    with pytest.raises(ValueError, match="uniform grids"):
        quant_step(quantize(x, V4, tables=QuantTables(levels=EXACT)))
    # a [16] table is every head's table: the [3, 16] result is EXACT (float32 already) in each row, exactly
    assert torch.equal(check_levels(EXACT, V4, 3), EXACT.float().expand(3, 16))


def _value_cache(v: torch.Tensor, G: int = 2, seed: int = 0) -> SequenceCache:
    H, T, D = v.shape
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(H * G, T, D, generator=g), torch.randn(H, T, D, generator=g)
    return SequenceCache(q, k, v, D**-0.5, None)


def test_fit_levels_recovers_a_discrete_grid():
    """Rows drawn from 16 known levels (times a per-token scale): fit_levels returns those levels within
    1e-6 and quantizing with them is lossless within one fp16 scale ulp (1e-3)."""
    # every value row holds the 16 target levels (times a per-token scale): the weighted Lloyd fit must
    # return exactly those levels, and quantizing with them is then lossless
    g = torch.Generator().manual_seed(1)
    H, T, D = 2, 24, 64
    rows = []
    for _ in range(H * T):
        rows.append(EXACT.repeat(4)[torch.randperm(D, generator=g)])
    v = torch.stack(rows).reshape(H, T, D) * (torch.rand(H, T, 1, generator=g) + 0.5)
    caches = [_value_cache(v)]
    L = fit_levels(caches, V4)
    assert L.shape == (H, 16)
    # each point is its level up to the fp32 division by the row's absmax (≤ eps32/2, |level| ≤ 1), and a
    # weighted mean of such points is too (8 eps32 ≈ 1e-6 of slack); a wrong Lloyd step moves a level by ≥ 1/16
    torch.testing.assert_close(L, EXACT.expand(H, 16), rtol=0, atol=1e-6)
    # lossless up to the per-token scale, absmax < 2 rounded up to fp16 (≤ one fp16 ulp = 2⁻¹⁰ absolute
    # below 2, times |level| ≤ 1): 9.8e-4 < 1e-3; one wrong level is ≥ 1/16 off
    torch.testing.assert_close(fake_quant(v[None], V4, tables=QuantTables(levels=L)), v[None], rtol=0, atol=1e-3)


def test_fit_levels_beats_uniform_grid_on_gaussian_rows():
    """On fresh Gaussian rows the uniform int4 MSE lies in 0.0116 ± 0.0006 (float64 simulation) and fitted
    Lloyd levels cut it below 0.75× (statistical bound in the comment)."""
    # Gaussian rows of 64 scaled by their absmax: Lloyd levels cut the MSE of the plain symmetric grid
    # by about a third (0.0116 -> 0.0080 sigma^2 in a float64 simulation of 2e5 rows)
    g = torch.Generator().manual_seed(2)
    v = torch.randn(2, 512, 64, generator=g)
    L = fit_levels([_value_cache(v)], V4)
    x = torch.randn(1, 2, 4096, 64, generator=g)
    mse_l = float(((fake_quant(x, V4, tables=QuantTables(levels=L)) - x) ** 2).mean())
    mse_u = float(((fake_quant(x, V4) - x) ** 2).mean())
    # statistical: 5.2e5 elements, per-element squared error sd ≈ 1.5·mse -> the sample mean's sd ≈ 2.4e-5, so
    # the window 0.0116 ± 0.0006 is > 20 sd (and the data are seeded); a wrong grid (int3/int5) is 4x off
    assert 0.0110 < mse_u < 0.0122
    assert mse_l < 0.75 * mse_u  # expected ratio 0.0080 / 0.0116 = 0.69, the same sampling sd


def test_search_side_levels_guard_and_fallback_rows():
    """search_side(levels=True) keeps per head either the fitted levels or uniform levels (label 'minmax'),
    never worse held-out than min-max; levels for keys or asymmetric values are refused."""
    g = torch.Generator().manual_seed(3)
    calib = [_value_cache(torch.randn(3, 96, 64, generator=g), seed=i) for i in range(2)]
    held = [_value_cache(torch.randn(3, 96, 64, generator=g), seed=5)]
    r = search_side(calib, held, "v", SideChoice(V4, codebook=Codebook.LEVELS), grid=(1.0,))
    assert r.plan.levels is not None and r.plan.levels.shape == (3, 16)
    assert r.heldout <= r.heldout_minmax
    for h, lab in enumerate(r.label):
        want = uniform_levels(4) if lab == "minmax" else fit_levels(calib, V4)[h]
        assert torch.equal(r.plan.levels[h], want)
    assert "levels" in r.to_meta()
    with pytest.raises(ValueError, match="fitted for values"):
        search_side(calib, held, "k", SideChoice(V4, codebook=Codebook.LEVELS))
    with pytest.raises(ValueError, match="symmetric per-token"):
        search_side(calib, held, "v", SideChoice(TensorQuantSpec("int4", PerToken(), symmetric=False), codebook=Codebook.LEVELS))


def test_plan_artifact_round_trip_and_validation():
    """Value levels survive KVPlan -> tensors -> from_artifact (same fake_quant); decreasing levels, a wrong
    shape, or levels on the asymmetric key side are refused naming the tensor."""
    from kvcal.plan import KVPlan, LayerPlan, SidePlan

    H, D = 2, 8
    kspec = TensorQuantSpec("int4", PerChannelTokenGroup(4), symmetric=False)
    plan = KVPlan([LayerPlan(SidePlan(kspec, clip_ratio=torch.ones(H)),
                             SidePlan(V4, clip_ratio=torch.ones(H), tables=QuantTables(levels=EXACT.expand(H, 16).clone())))])
    meta = {"model": {"num_layers": 1, "num_kv_heads": H, "head_dim": D}, "kv": plan.kv_metadata()}
    t = plan.to_tensors()
    assert t["model.layers.0.self_attn.v_levels"].shape == (H, 16)
    back = KVPlan.from_artifact(t, meta)
    x = torch.randn(1, H, 12, D)
    assert torch.equal(back.fake_quant(0, "v", x), plan.fake_quant(0, "v", x))
    assert plan.kv_config(0).value_variant.codebook is Codebook.LEVELS
    assert plan.kv_config(0).key_variant.codebook is Codebook.UNIFORM
    bad = dict(t)
    bad["model.layers.0.self_attn.v_levels"] = EXACT.flip(0).expand(H, 16).clone()
    with pytest.raises(ValueError, match=r"v_levels \(int4 token sym side\): levels must be non-decreasing"):
        KVPlan.from_artifact(bad, meta)
    bad["model.layers.0.self_attn.v_levels"] = EXACT[:8].expand(H, 8).clone()
    with pytest.raises(ValueError, match=r"v_levels has shape \(2, 8\), expected"):
        KVPlan.from_artifact(bad, meta)
    bad = dict(t)
    bad["model.layers.0.self_attn.k_levels"] = EXACT.expand(H, 16).clone()  # keys are asymmetric
    with pytest.raises(ValueError, match="k_levels"):
        KVPlan.from_artifact(bad, meta)


def test_runtime_with_levels_equals_protocol_a_and_accounting():
    """Runtime cache with value levels: prefill logits equal Protocol A exactly, decode within 1e-5, every
    decode step stores exactly quantize() of the keys/values it handed the cache (codes and scales;
    helpers.plans.decode_stores_quantize_of_inputs), and the cache holds exactly L·H·16·4 bytes more (float32
    tables), as cache_bytes says."""
    from helpers.plans import decode_stores_quantize_of_inputs
    from helpers.transforms import H as TH
    from helpers.transforms import L as TL
    from helpers.transforms import (
        decode_and_protocol_a,
        prefill_matches_protocol_a,
        tiny_model,
        transform_plan,
    )

    from kvcal.formats.memory import cache_bytes
    from kvcal.runtime import QuantizedKVCache

    model = tiny_model()
    plan = transform_plan(model, sinks=1, k_spec=TensorQuantSpec("int4", PerToken(), symmetric=False))
    g = torch.Generator().manual_seed(4)
    for lp in plan.layers:
        lp.v.levels = torch.sort(torch.rand(TH, 16, generator=g) * 2 - 1).values
    ids = torch.randint(0, 128, (2, 29), generator=torch.Generator().manual_seed(6))
    cache = prefill_matches_protocol_a(model, plan, ids)
    plain = transform_plan(model, sinks=1, k_spec=TensorQuantSpec("int4", PerToken(), symmetric=False))
    c2 = QuantizedKVCache(plain, model.config)
    with torch.no_grad():
        model(ids, cache=c2, use_cache=True)
    assert cache.allocated_bytes() - c2.allocated_bytes() == TL * TH * 16 * 4  # the float32 levels tables
    mc = {"num_hidden_layers": TL, "num_key_value_heads": TH, "head_dim": 16, "num_attention_heads": TH}
    assert cache_bytes(mc, plan.kv_config(0), 64) - cache_bytes(mc, plain.kv_config(0), 64) == TL * TH * 16 * 4
    # decode token by token (per-token values and keys): every step reads what Protocol A reads
    got, ref = decode_and_protocol_a(model, plan, ids, 5, 20)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    assert decode_stores_quantize_of_inputs(model, plan, ids, 5, 20) == 15 * TL * 2  # steps x layers x sides


def test_search_side_refuses_undefined_combinations():
    """search_side refuses rounding or channel_bits for values, channel_bits for static per-channel keys,
    and empty calibration sets, each with a one-line ValueError."""
    from kvcal.formats.granularity import PerChannel

    g = torch.Generator().manual_seed(7)
    calib = [_value_cache(torch.randn(2, 32, 16, generator=g))]
    k4 = TensorQuantSpec("int4", PerChannelTokenGroup(8), symmetric=False)
    with pytest.raises(ValueError, match="query-aware rounding is defined for keys"):
        search_side(calib, [], "v", SideChoice(V4, rounding=Rounding.QUERY_AWARE))
    with pytest.raises(ValueError, match="per-channel bit widths are defined for keys"):
        search_side(calib, [], "v", SideChoice(k4, channel_widths=ChannelWidths.ALLOCATED))
    with pytest.raises(ValueError, match="per-channel bit widths are searched for dynamic key specs only"):
        search_side(calib, [], "k", SideChoice(TensorQuantSpec("int4", PerChannel(), symmetric=False), channel_widths=ChannelWidths.ALLOCATED))
    with pytest.raises(ValueError, match="no calibration sequences"):
        search_side([], [], "v", SideChoice(TensorQuantSpec("int4", PerToken(), symmetric=True, scale_dtype="log8")))
    with pytest.raises(ValueError, match="no calibration sequences"):
        search_side([], [], "v", SideChoice(V4, codebook=Codebook.LEVELS))
