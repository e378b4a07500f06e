"""Runtime cache (kvcal.runtime.QuantizedKVCache) on tiny random Llama models.

"Identical" means: a prefill through the cache with ``residual_window = 0`` gives logits
``torch.equal`` to Protocol A (``KVPlan.fake_quant`` through the attention hook) — the same K/V
values reach the same attention call. Decoding token by token reads the same quantized values, but
attention then runs on a 1-token query instead of the full causal matmul, so logits agree to fp32
reassociation only (documented bound ``1e-5`` absolute on logits of magnitude ~1).
"""

from __future__ import annotations

import pytest
import torch
from helpers.runtime import D, H, L, make_plan, prefill_and_protocol_a, tiny_model, write_tiny_artifact

from kvcal.capture.hooks import attention_hook
from kvcal.errors import ArtifactError
from kvcal.evaluate.protocol_a import plan_hook
from kvcal.formats.memory import cache_bytes
from kvcal.formats.spec import KVCacheConfig, TensorQuantSpec
from kvcal.plan import KVPlan
from kvcal.runtime import QuantizedKVCache

DECODE_TOL = 1e-5


PREFILL_PRESETS = ["fp8", "fp8_head", "int8", "int4_static", "kivi4", "kivi2", "kivi3", "nvfp4", "bf16"]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.mark.parametrize("name", PREFILL_PRESETS)
def test_prefill_equals_protocol_a(model, name):
    """For each preset, prefill logits through QuantizedKVCache equal Protocol A's (attention hook with the
    same plan) exactly, and the cache reports 45 tokens."""
    plan = make_plan(name, sinks=0 if name == "bf16" else 3)
    ids = torch.randint(0, 128, (2, 45), generator=torch.Generator().manual_seed(1))
    cache, a, b = prefill_and_protocol_a(model, plan, ids)
    assert torch.equal(a, b)
    assert cache.get_seq_length() == 45


@pytest.mark.parametrize("name", ["fp8", "fp8_head", "int8", "int4_static", "bf16"])
def test_decode_equals_protocol_a_per_token_formats(model, name):
    """Token-by-token decode reads exactly the quantized values Protocol A uses (per-token and static
    formats quantize each token independently), so logits agree to fp32 reassociation."""
    plan = make_plan(name, sinks=0 if name == "bf16" else 2)
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(2))
    cache = QuantizedKVCache(plan, model.config)
    with torch.no_grad():
        outs = [model(ids[:, :8], cache=cache, use_cache=True).logits[:, -1]]
        for t in range(8, 39):
            outs.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits[:, -1])
        a = torch.stack(outs, 1)
        with attention_hook(model, plan_hook(plan)):
            b = model(ids[:, :39], use_cache=False).logits[:, 7:]
    assert (a - b).abs().max().item() <= DECODE_TOL


@pytest.mark.parametrize("clip", [1.0, 0.9])
def test_decode_open_key_group_keeps_its_raw_range(clip):
    """Keys in 8-token groups, decoded one token at a time (no residual window, so each group fills
    up while it is read). The first two tokens of every group are its per-channel min and max, so
    the group's range is final from its second token on: every later member is quantized once, with
    Protocol A's parameters, and the whole decode equals Protocol A bit for bit. Before the open
    group kept its raw range, each step re-ranged it from dequantized values, shrinking a clipped
    range again at every token (clip 0.9: key MSE 38× Protocol A's on random keys)."""
    from kvcal.formats.granularity import PerChannelTokenGroup
    from kvcal.formats.quant import fake_quant
    from kvcal.plan import SidePlan
    from kvcal.runtime.side import SideStorage

    g, T = 8, 40
    spec = TensorQuantSpec("int4", PerChannelTokenGroup(g), symmetric=False)
    x = torch.rand(1, H, T, D, generator=torch.Generator().manual_seed(5)) * 2 - 1
    x[:, :, 0::g] = -1.5  # each group's min, first
    x[:, :, 1::g] = 1.5  # and max, second
    sp = SidePlan(spec, clip_ratio=torch.full((H,), clip))
    side = SideStorage(sp, H, D, 0, 0)
    side.init(1, "cpu", torch.float32)
    side.reserve(T)
    for t in range(T):
        side.append(x[:, :, t : t + 1])
        assert torch.equal(side.read(), fake_quant(x[:, :, : t + 1], spec, clip_ratio=sp.clip_ratio)) or t % g == 0
    assert torch.equal(side.read(), fake_quant(x, spec, clip_ratio=sp.clip_ratio))
    # random keys (ranges keep growing): at most one extra rounding per member, no compounding
    y = torch.randn(1, H, T, D, generator=torch.Generator().manual_seed(6))
    side = SideStorage(sp, H, D, 0, 0)
    side.init(1, "cpu", torch.float32)
    side.reserve(T)
    for t in range(T):
        side.append(y[:, :, t : t + 1])
    mse = float(((side.read() - y) ** 2).mean())
    ref = float(((fake_quant(y, spec, clip_ratio=sp.clip_ratio) - y) ** 2).mean())
    # each element is rounded at most twice (once on append, once when its group closes), each to a step ≤ the final one:
    # ≤ 2 independent uniform roundings, ≤ 2·ref in expectation; 2.5 leaves room for sampling over 2·40·16
    # elements. Re-quantizing every step (compounding) would grow with the 8 appends per group
    assert mse < 2.5 * ref


def test_stored_representation(model):
    """The cache stores fp8 keys as float8_e4m3fn [B, H, T, D]; kivi4 keys as uint8 two-codes-per-byte with
    fp16 scales and zero points; 70 tokens with window 32 leave 64 keys quantized + 6 in the window, values 38 + 32."""
    plan = make_plan("fp8")
    cache = QuantizedKVCache(plan, model.config)
    with torch.no_grad():
        model(torch.randint(0, 128, (2, 10)), cache=cache, use_cache=True)
    side = cache.layers[0].k
    assert side.data.dtype == torch.float8_e4m3fn and tuple(side.data.shape) == (2, H, 10, D)
    plan4 = make_plan("kivi4", window=32)
    c4 = QuantizedKVCache(plan4, model.config)
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 70)), cache=c4, use_cache=True)
    k, v = c4.layers[1].k, c4.layers[1].v
    assert k.data.dtype == torch.uint8 and k.data.shape[-1] == D // 2  # two int4 codes per byte
    assert k.scale.dtype == torch.float16 and k.zp is not None
    # keys: 70 tokens, window 32, groups of 32 -> one full group quantized, 38 in 16 bits? no: the
    # window never holds more than 32, so two groups (64) are quantized and 6 stay in the window
    assert (k.n_q, k.n_win) == (64, 6)
    assert (v.n_q, v.n_win) == (38, 32)  # values quantize token by token


def test_kivi_window_holds_incomplete_groups(model):
    """Decoding 115 tokens one by one: quantized keys are whole 32-token groups and the window holds
    between 9 and 40 tokens (or nothing is quantized yet); the length tracks the tokens seen."""
    plan = make_plan("kivi4", window=40)
    cache = QuantizedKVCache(plan, model.config)
    ids = torch.randint(0, 128, (1, 120), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(ids[:, :5], cache=cache, use_cache=True)
        for t in range(5, 120):
            model(ids[:, t : t + 1], cache=cache, use_cache=True)
            k = cache.layers[0].k
            assert k.n_q % 32 == 0 and 40 - 32 < k.n_win <= 40 or k.n_q == 0
            assert k.length == t + 1


CASES = [
    ("fp8", 0, 0), ("fp8_head", 4, 16), ("int8", 1, 8), ("int4_static", 0, 0), ("kivi4", 0, 0), ("kivi4", 4, 32),
    ("kivi2", 2, 64), ("kivi3", 0, 0), ("nvfp4", 0, 0), ("bf16", 0, 0), ("fp16", 0, 0),
]


@pytest.mark.parametrize("name,sinks,window", CASES)
@pytest.mark.parametrize("batch", [1, 3])
def test_allocated_bytes_equal_accounting(model, name, sinks, window, batch):
    """Allocated bytes of growing and static (max_cache_len 77) caches equal cache_bytes at every step of
    prefill and decode, batch 1 and 3, and equal expected_bytes."""
    plan = make_plan(name, sinks, window)
    ids = torch.randint(0, 128, (batch, 50), generator=torch.Generator().manual_seed(4))
    grow = QuantizedKVCache(plan, model.config)
    assert grow.allocated_bytes() == cache_bytes(model.config, grow.kv_configs(), 0, 1)
    static = QuantizedKVCache(plan, model.config, max_cache_len=77)
    with torch.no_grad():
        for cache in (grow, static):
            model(ids[:, :37], cache=cache, use_cache=True)
    assert grow.allocated_bytes() == cache_bytes(model.config, grow.kv_configs(), 37, batch)
    assert static.allocated_bytes() == cache_bytes(model.config, static.kv_configs(), 77, batch)
    with torch.no_grad():
        for t in range(37, 50):
            for cache in (grow, static):
                model(ids[:, t : t + 1], cache=cache, use_cache=True)
            assert grow.allocated_bytes() == cache_bytes(model.config, grow.kv_configs(), t + 1, batch)
    assert static.allocated_bytes() == cache_bytes(model.config, static.kv_configs(), 77, batch)
    assert static.allocated_bytes() == static.expected_bytes() and grow.allocated_bytes() == grow.expected_bytes()


def test_allocated_bytes_mixed_layers(model):
    """Per-layer specs (bit allocation): layer 0 int8/int4 static keys, layer 1 kivi2."""
    p8, p2 = make_plan("int4_static", 2, 8), make_plan("kivi2", 2, 8)
    plan = KVPlan([p8.layers[0], p2.layers[1]], residual_window=8, sink_tokens=2)
    cache = QuantizedKVCache(plan, model.config)
    with torch.no_grad():
        model(torch.randint(0, 128, (2, 61)), cache=cache, use_cache=True)
    assert cache.allocated_bytes() == cache_bytes(model.config, cache.kv_configs(), 61, 2)


def test_allocated_bytes_include_key_centering(model):
    """Key-centering means are per-layer metadata: held by the cache and counted by the accounting
    (hand-worked: 2 layers x H=2 x D=16 x 4 bytes = 256 bytes more than without centering)."""
    plan = make_plan("int8", 1, 0)
    plan.layers[0].k.mean = torch.randn(1, H, 1, D)
    plan.layers[1].k.mean = torch.randn(1, H, 1, D)
    cache = QuantizedKVCache(plan, model.config)
    with torch.no_grad():
        model(torch.randint(0, 128, (2, 19)), cache=cache, use_cache=True)
    assert cache.allocated_bytes() == cache_bytes(model.config, cache.kv_configs(), 19, 2)
    plain = cache_bytes(model.config, make_plan("int8", 1, 0).kv_config(), 19, 2)
    assert cache.allocated_bytes() - plain == 2 * H * D * 4


def test_generate_batch2_left_padding(model):
    """Batch-2 left-padded greedy generation matches each prompt alone per step (logits within 1e-2, same
    token unless a near-tie; bound argued in the comment) for bf16, fp8 and int8; with kivi4 and a residual
    window the unpadded row does too, and the preallocated cache holds exactly the contract's bytes."""
    g = torch.Generator().manual_seed(5)
    p1, p2 = torch.randint(1, 128, (1, 12), generator=g), torch.randint(1, 128, (1, 7), generator=g)
    ids = torch.zeros(2, 12, dtype=torch.long)
    ids[0], ids[1, 5:] = p1[0], p2[0]
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :5] = 0
    # Batch 2 is not the arithmetic of batch 1 (another GEMM blocking): logits differ by float reassociation
    # (~1e-7 here), and an ulp at a rounding tie can move one bf16/fp8/int8 code by a step (one element by
    # ≤ 1/8 of it: one score by ~q·Δk/√D ≈ 0.03, damped by this model's 0.02-std projections to ~1e-3 on a
    # logit). So per step: logits within 1e-2 (the padding defect — pads attended — moves them by 0.13 at the
    # first step, measured), and the same greedy token unless the batch-1 top-2 margin is within twice the
    # difference (a near-tie: both continuations are right and the sequences may part there; seen: margins
    # ≥ 5e-4 vs differences ~1e-7, so they agree to the end on this machine).
    kw = dict(max_new_tokens=12, do_sample=False, output_scores=True, return_dict_in_generate=True)
    for name in ("bf16", "fp8", "int8"):
        plan = make_plan(name)
        both = model.generate(ids, attention_mask=mask, cache=QuantizedKVCache(plan, model.config), **kw)
        for r, p in ((0, p1), (1, p2)):
            one = model.generate(p, cache=QuantizedKVCache(plan, model.config), **kw)
            for t, (sb, sa) in enumerate(zip(both.scores, one.scores, strict=True)):
                d = float((sb[r] - sa[0]).abs().max())
                assert d <= 1e-2, (name, r, t, d)
                if int(both.sequences[r, 12 + t]) != int(one.sequences[0, p.shape[1] + t]):
                    top2 = sa[0].topk(2).values
                    assert float(top2[0] - top2[1]) <= 2 * d, (name, r, t)
                    break
    # grouped keys with a window: the unpadded row reads what it reads alone (same bound as above), and the
    # preallocated cache holds exactly the contract's bytes for 64 tokens. (The padded row's first key group
    # holds its pads, so its group ranges differ from the lone prompt's: no equality is claimed for it.)
    kw40 = dict(kw, max_new_tokens=40)
    plan = make_plan("kivi4", sinks=0, window=32)
    cache = QuantizedKVCache(plan, model.config, max_cache_len=64)
    both = model.generate(ids, attention_mask=mask, cache=cache, **kw40)
    one = model.generate(p1, cache=QuantizedKVCache(plan, model.config, max_cache_len=64), **kw40)
    for t, (sb, sa) in enumerate(zip(both.scores, one.scores, strict=True)):
        d = float((sb[0] - sa[0]).abs().max())
        assert d <= 1e-2, ("kivi4", t, d)
        if int(both.sequences[0, 12 + t]) != int(one.sequences[0, 12 + t]):
            top2 = sa[0].topk(2).values
            assert float(top2[0] - top2[1]) <= 2 * d, ("kivi4", t)
            break
    assert cache.get_seq_length() == 51
    assert cache.allocated_bytes() == cache_bytes(model.config, plan.kv_config(), 64, 2)


def test_sinks_refuse_a_left_padded_batch(model):
    """Attention sinks are a row's first cache slots: a left-padded batch (position ids differ from the slots)
    is refused with a one-line ValueError naming sinks and left padding, since the pads, not the prompt's
    first tokens, would stay 16-bit; the same plan generates an equal-length batch, and a plan without sinks
    generates the padded one."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, 128, (2, 10), generator=g)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0
    plan = make_plan("kivi4", sinks=4, window=32)
    with pytest.raises(ValueError, match=r"attention sinks .*left padding") as e:
        model.generate(ids, attention_mask=mask, cache=QuantizedKVCache(plan, model.config), max_new_tokens=2,
                       do_sample=False)
    assert "\n" not in str(e.value)
    out = model.generate(ids, cache=QuantizedKVCache(plan, model.config), max_new_tokens=2, do_sample=False)
    assert out.shape == (2, 12)
    out = model.generate(ids, attention_mask=mask, cache=QuantizedKVCache(make_plan("kivi4", window=32),
                                                                          model.config),
                         max_new_tokens=2, do_sample=False)
    assert out.shape == (2, 12)


BATCH_BUFFERS = ("sink", "win", "data", "scale", "zp", "open_rng")  # SideStorage's per-sequence tensors (dim 0 = batch)


def _cache_state(cache: QuantizedKVCache) -> dict:
    """Copies of every per-sequence buffer of every layer's K and V side, and the region counters."""
    state = {}
    for i, layer in enumerate(cache.layers):
        for s in ("k", "v"):
            side = getattr(layer, s)
            for name in BATCH_BUFFERS:
                t = getattr(side, name)
                state[i, s, name] = None if t is None else t.clone()
            state[i, s, "counts"] = (side.n_sink, side.n_q, side.n_win, side.B)
    return state


def _assert_rows_taken_from(after: dict, before: dict, beam_idx: torch.Tensor) -> None:
    """``after`` holds, for every beam ``b``, exactly the rows ``before`` held for beam ``beam_idx[b]``
    (index_select semantics, checked row by row), with the same region counters and the new batch size."""
    src = beam_idx.tolist()
    for key, old in before.items():
        new = after[key]
        if key[2] == "counts":
            assert new == old[:3] + (len(src),), key
        elif old is None:
            assert new is None, key
        else:
            assert new.shape == (len(src),) + old.shape[1:], key
            for b, j in enumerate(src):
                assert torch.equal(new[b], old[j]), (key, b, j)


@pytest.mark.parametrize("name, window", [("int8", 4), ("kivi4", 0)])
def test_beam_reorder_takes_each_beams_stored_codes_from_its_source(model, name, window):
    """cache.reorder_cache(beam_idx) (what transformers' beam search calls): afterwards every beam's stored
    codes, scales, zero points, sinks, 16-bit window and open-group ranges equal those of its source beam
    exactly (index_select semantics, compared row by row with a copy taken before), and the dequantized
    keys/values attention reads equal the source beam's. Three prompts of different tokens; beam_idx
    [2, 0, 0] both permutes and duplicates. int8 with a 4-token window (sinks / codes / window) and kivi4 with
    none (open token groups keep their raw range: open_rng)."""
    plan = make_plan(name, sinks=1, window=window)
    ids = torch.randint(1, 128, (3, 12), generator=torch.Generator().manual_seed(6))
    cache = QuantizedKVCache(plan, model.config)
    with torch.no_grad():
        model(ids[:, :9], cache=cache, use_cache=True)
        for t in range(9, 12):  # decode steps, so that codes come from both prefill and decode
            model(ids[:, t : t + 1], cache=cache, use_cache=True)
    before = _cache_state(cache)
    reads = [(layer.k.read(), layer.v.read()) for layer in cache.layers]
    assert not torch.equal(before[0, "k", "data"][0], before[0, "k", "data"][2])  # beams differ: a no-op would fail
    if window == 0:
        assert before[0, "k", "open_rng"] is not None  # 11 quantized keys: an open group (g = 32)
    beam_idx = torch.tensor([2, 0, 0])
    cache.reorder_cache(beam_idx)
    _assert_rows_taken_from(_cache_state(cache), before, beam_idx)
    for layer, (k, v) in zip(cache.layers, reads, strict=True):
        for b, j in enumerate(beam_idx.tolist()):
            assert torch.equal(layer.k.read()[b], k[j]) and torch.equal(layer.v.read()[b], v[j])


def test_beam_search_reorders(model):
    """Beam search (3 beams, 6 new tokens) through the quantized cache: every reorder transformers' beam
    search makes leaves each beam with exactly its source beam's stored codes, scales, sinks and window
    (rows compared with copies taken before each call), at least one reorder is not the identity, and
    generate returns the prompt and 6 new tokens; with a bf16 plan on a bf16 copy of the model, beam search
    returns exactly the tokens it returns with transformers' own cache."""
    plan = make_plan("int8", sinks=1, window=4)
    ids = torch.randint(1, 128, (1, 9), generator=torch.Generator().manual_seed(6))
    cache = QuantizedKVCache(plan, model.config)
    calls = []
    reorder = cache.reorder_cache

    def spy(beam_idx):
        before = _cache_state(cache)
        reorder(beam_idx)
        calls.append((beam_idx.clone(), before, _cache_state(cache)))

    cache.reorder_cache = spy
    out = model.generate(ids, cache=cache, num_beams=3, max_new_tokens=6, do_sample=False)
    assert out.shape == (1, 15) and torch.equal(out[:, :9], ids)
    assert calls and any(not torch.equal(idx, torch.arange(len(idx))) for idx, _, _ in calls)
    for beam_idx, before, after in calls:
        _assert_rows_taken_from(after, before, beam_idx)
    # independent reference: on a bf16 copy of the model, a bf16 (unquantized) plan stores exactly the bf16
    # tensors transformers' own DynamicCache stores and hands attention the same values, so beam search through
    # it — every reorder included — must choose exactly the tokens it chooses with transformers' cache
    import copy

    m16 = copy.deepcopy(model).to(torch.bfloat16)
    kw = dict(num_beams=3, max_new_tokens=6, do_sample=False)
    ids = torch.randint(1, 128, (1, 9), generator=torch.Generator().manual_seed(7))
    ref = m16.generate(ids, **kw)
    assert torch.equal(m16.generate(ids, cache=QuantizedKVCache(make_plan("bf16"), m16.config), **kw), ref)
    # the premise that makes this a check of the reorders: on this prompt, a cache that ignores them (every beam
    # keeps its own rows) changes what beam search returns
    ignoring = QuantizedKVCache(make_plan("bf16"), m16.config)
    ignoring.reorder_cache = lambda beam_idx: None
    assert not torch.equal(m16.generate(ids, cache=ignoring, **kw), ref), "premise: the reorders matter here"


def test_capacity_and_shape_errors(model):
    """Refusals: a 9th token in a max_cache_len 8 cache, a plan with the wrong layer count, a scale that
    does not fit the heads, and an fp8 plan without scales."""
    cache = QuantizedKVCache(make_plan("fp8"), model.config, max_cache_len=8)
    with torch.no_grad(), pytest.raises(ValueError, match="max_cache_len 8"):
        model(torch.randint(0, 128, (1, 9)), cache=cache, use_cache=True)
    with pytest.raises(ValueError, match="3 layers"):
        QuantizedKVCache(make_plan("fp8", num_layers=3), model.config)
    bad = make_plan("fp8_head")
    bad.layers[0].k.scale = torch.ones(1, H + 1, 1, 1)
    with pytest.raises(ValueError, match="does not fit"):
        QuantizedKVCache(bad, model.config)
    unscaled = KVPlan.uniform(L, KVCacheConfig(TensorQuantSpec("fp8_e4m3"), TensorQuantSpec("fp8_e4m3")))
    with pytest.raises(ValueError, match="no scale"):
        QuantizedKVCache(unscaled, model.config)


def test_from_artifact_roundtrip(tmp_path, model):
    """QuantizedKVCache.from_artifact of a written fp8 per-head artifact gives logits equal to Protocol A
    with the source plan exactly."""
    plan = make_plan("fp8_head", sinks=2)
    path = write_tiny_artifact(tmp_path, model, plan)
    cache = QuantizedKVCache.from_artifact(path, model)
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        a = model(ids, cache=cache, use_cache=True).logits
        with attention_hook(model, plan_hook(plan)):
            b = model(ids, use_cache=False).logits
    assert torch.equal(a, b)


@pytest.mark.parametrize("field,value", [("num_layers", 3), ("num_kv_heads", 4), ("head_dim", 32),
                                         ("config_sha256", "0" * 64)])
def test_from_artifact_refuses_other_model(tmp_path, model, field, value):
    """from_artifact refuses an artifact whose model field (layers, heads, head_dim, config hash) differs
    from the model, with an ArtifactError naming the field."""
    plan = make_plan("fp8", num_layers=value if field == "num_layers" else L)  # a complete 3-layer file
    path = write_tiny_artifact(tmp_path, model, plan, **{field: value})
    with pytest.raises(ArtifactError, match=field):
        QuantizedKVCache.from_artifact(path, model)


def test_from_artifact_refuses_other_config(tmp_path, model):
    """Same layer/head/dim numbers, different architecture (hidden size): the config hash catches it."""
    path = write_tiny_artifact(tmp_path, model, make_plan("fp8"))
    other = tiny_model()
    other.config.hidden_size = 96  # only the hashed config differs
    with pytest.raises(ArtifactError, match="config_sha256"):
        QuantizedKVCache.from_artifact(path, other)
