"""Runtime cache on sliding-window layers (Gemma 3 shape: sliding + global layers, 1 KV head, q/k-norm).

A sliding layer's query at position p reads keys p-W+1..p; transformers keeps W-1 tokens between steps
(``DynamicSlidingWindowLayer``). References:

* **transformers' own cache**: a bf16 model with a bf16 (unquantized) plan stores exactly the bf16 tensors
  ``DynamicCache`` stores and returns the same W-1+s tokens, so logits are ``torch.equal``;
* **Protocol A** (``KVPlan.fake_quant`` through the attention hook, the model's own sliding mask): a prefill
  returns every token, so logits are ``torch.equal``;
* **the same cache with dropping switched off** (every sliding layer's ``drop_before`` a no-op: it keeps every
  token yet returns the same last ``W - 1 + s``): attention receives the same tensors only if dropping never
  changed a kept value, so logits are ``torch.equal`` for every layout, with sinks and residual windows.
  (An unbounded cache masked by the model is not a bit-exact reference: its softmax sums over masked keys
  reassociate in the last bit, and on this q/k-normed model a later layer's quantization rounding flips on
  it — 1e-4 on the logits for KIVI-4 —, as a 1-token decode projection against Protocol A's 39-token one does.)
"""

from __future__ import annotations

import pytest
import torch
from helpers.runtime import make_plan as runtime_plan
from helpers.runtime import prefill_and_protocol_a

from kvcal.formats.granularity import PerChannelTokenGroup
from kvcal.formats.memory import memory_report, model_shape, sliding_held
from kvcal.formats.spec import TensorQuantSpec
from kvcal.plan import KVPlan
from kvcal.runtime import QuantizedKVCache

H, D, L, W = 1, 16, 4, 8
TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def tiny_gemma3(dtype=torch.float32):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=L,
                           num_attention_heads=2, num_key_value_heads=H, head_dim=D, sliding_window=W,
                           layer_types=TYPES, query_pre_attn_scalar=D, max_position_embeddings=256,
                           pad_token_id=0, bos_token_id=None, eos_token_id=None)
    return Gemma3ForCausalLM(cfg).to(dtype).eval()


pytestmark = pytest.mark.usefixtures("one_thread")


def make_plan(name: str, sinks: int = 0, window: int = 0, seed: int = 0) -> KVPlan:
    """helpers.runtime.make_plan for this module's model: L layers, H KV heads x head_dim D, FP8 scales
    0.02 x U[1, 2)."""
    return runtime_plan(name, sinks, window, num_layers=L, seed=seed, num_kv_heads=H, head_dim=D, fp8_scale=0.02)


def decode(model, cache, ids, P, check=None):
    """Logits of a prefill of ``P`` tokens then one token at a time ``[B, T, V]``; ``check()`` must hold after
    every step."""
    with torch.no_grad():
        out = [model(ids[:, :P], cache=cache, use_cache=True).logits]
        assert check is None or check(), P
        for t in range(P, ids.shape[1]):
            out.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits)
            assert check is None or check(), t
    return torch.cat(out, 1)


@pytest.fixture(scope="module")
def model():
    return tiny_gemma3()


def test_model_is_gemma3_shaped(model):
    """The fixture has what the issue names: sliding + global layers, 1 KV head, q/k-norm."""
    attn = model.model.layers[0].self_attn
    assert hasattr(attn, "q_norm") and hasattr(attn, "k_norm")
    assert model_shape(model.config).layer_windows == (W, W, 0, W)
    assert model.config.num_key_value_heads == 1


def test_bf16_equals_transformers_cache():
    """A bf16 model through a bf16 plan: the same stored tensors and the same W-1+s returned tokens as
    transformers' DynamicCache, so every logit is bit-identical (prefill 5 < W, then 30 single tokens)."""
    from transformers import DynamicCache

    m = tiny_gemma3(torch.bfloat16)
    ids = torch.randint(0, 128, (2, 35), generator=torch.Generator().manual_seed(3))
    a = decode(m, QuantizedKVCache(make_plan("bf16"), m.config), ids, 5)
    b = decode(m, DynamicCache(config=m.config), ids, 5)
    assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["fp8", "fp8_head", "int8", "int4_static", "kivi4", "kivi2", "nvfp4", "bf16"])
def test_prefill_longer_than_window_equals_protocol_a(model, name):
    """A 45-token prefill (W = 8) returns every token; the model's sliding mask does the rest: logits equal
    Protocol A's exactly. Afterwards each sliding layer holds what sliding_held says, the global layer all 45."""
    sinks = 0 if name == "bf16" else 3
    plan = make_plan(name, sinks=sinks)
    ids = torch.randint(0, 128, (2, 45), generator=torch.Generator().manual_seed(1))
    cache, a, b = prefill_and_protocol_a(model, plan, ids)
    assert torch.equal(a, b)
    kv = plan.kv_config(0)
    for i, layer in enumerate(cache.layers):
        held = layer.k.n_sink + layer.k.n_q + layer.k.n_win
        if TYPES[i] == "full_attention":
            assert held == 45
        else:
            assert (layer.k.n_sink, layer.k.n_q, layer.k.n_win)[:3] == sliding_held(
                kv.key, 45, W, kv.residual_window, kv.sink_tokens)[:3]


@pytest.mark.parametrize(("name", "sinks", "window"), [
    ("fp8", 0, 0), ("fp8", 3, 0), ("int8", 2, 5), ("int8", 0, 12), ("kivi4", 0, 0), ("kivi4", 2, 32),
    ("kivi2", 1, 4), ("nvfp4", 0, 3), ("int4_static", 2, 0),
])
def test_dropping_changes_no_kept_value(model, name, sinks, window):
    """Dropping what the window hides never changes a kept value, for every layout (token groups, sinks,
    residual windows shorter and longer than W): logits equal the no-drop reference's, prefill then 40
    single tokens, and after every step the cache allocates exactly memory_report's sliding count."""
    plan = make_plan(name, sinks=sinks, window=window)
    ids = torch.randint(0, 128, (2, 47), generator=torch.Generator().manual_seed(4))
    c = QuantizedKVCache(plan, model.config)
    a = decode(model, c, ids, 7, check=lambda: c.allocated_bytes() == c.expected_bytes())
    ref = QuantizedKVCache(plan, model.config)
    for layer in ref.layers:
        for side in (layer.k, layer.v):
            side.drop_before = lambda first: None
    b = decode(model, ref, ids, 7)
    assert torch.equal(a, b)
    held = [side.n_sink + side.n_q + side.n_win for side in (ref.layers[0].k, ref.layers[0].v)]
    assert held == [47, 47]  # the reference really kept everything
    g = plan.kv_config(0).key.token_group or 1
    for i in (0, 1, 3):  # sliding layers hold W-1 tokens, up to g-1 more (whole groups) or the 16-bit window
        k = c.layers[i].k
        assert c.layers[i].is_sliding and not c.layers[2].is_sliding
        assert k.n_sink + k.n_q <= W - 1 + g - 1
        assert k.n_sink + k.n_q + k.n_win <= max(W - 1 + g - 1, window + g)


def test_fp8_bytes_hand_count(model):
    """fp8 per-tensor, 1 KV head x 16: a token costs 16 bytes per side; sliding layers hold min(t, 7) tokens,
    the global layer t; 2 fp32 scales per layer. At t = 30, batch 2: 2*(3*7 + 30)*16*2 + 4*2*4 = 3296 bytes."""
    plan = make_plan("fp8")
    ids = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(5))
    c = QuantizedKVCache(plan, model.config)
    decode(model, c, ids, 4)
    assert c.allocated_bytes() == 2 * (3 * 7 + 30) * 16 * 2 + 4 * 2 * 4 == 3296
    shape = model_shape(model.config)
    assert memory_report(shape, plan.kv_config(0), 30, 2).total == 3296
    # preallocated global layer: max_cache_len sizes it, sliding layers still hold what they hold
    c2 = QuantizedKVCache(plan, model.config, max_cache_len=64)
    decode(model, c2, ids, 4)
    assert c2.allocated_bytes() == c2.expected_bytes() == 2 * (3 * 7 + 64) * 16 * 2 + 32


@pytest.mark.parametrize(("ctx", "R", "S", "g", "want"), [
    (5, 0, 0, None, (0, 5, 0, 5)),        # under the window: everything is held
    (30, 0, 0, None, (0, 7, 0, 30)),      # per-token: the last W-1 = 7
    (30, 0, 3, None, (0, 7, 0, 27)),      # sinks leave first
    (9, 0, 3, None, (1, 6, 0, 6)),        # a = 2: sinks 0,1 leave, sink 2 stays
    (30, 10, 0, None, (0, 0, 7, 20)),     # residual window longer than W-1: its oldest 16-bit tokens leave
    (30, 0, 0, 4, (0, 10, 0, 30)),        # groups of 4: a = 23 falls in group [20,24): 20..29 stay
    (30, 8, 0, 4, (0, 4, 6, 24)),         # window 8 >= g: 24 quantized (6 groups), 6 in 16 bits; a = 23: 20..23 stay
    (30, 32, 0, 4, (0, 0, 30, 0)),        # all in the 16-bit window, never dropped on a token-group side
])
def test_sliding_held_hand_examples(ctx, R, S, g, want):
    """Hand-worked (W = 8, so a = ctx - 7 is the first position a later query reads)."""
    spec = TensorQuantSpec("int4", PerChannelTokenGroup(g)) if g else TensorQuantSpec("fp8_e4m3")
    assert sliding_held(spec, ctx, W, R, S) == want
