"""A tiny random Llama with transformed plans (pre-RoPE keys, Hadamard values), and the checks that a
prefill or a decode through the runtime cache matches Protocol A."""

from __future__ import annotations

import torch

from kvcal.capture.hooks import attention_hook
from kvcal.evaluate.protocol_a import plan_hook
from kvcal.formats.granularity import PerChannelTokenGroup, PerToken
from kvcal.formats.spec import TensorQuantSpec
from kvcal.models import rope_table
from kvcal.plan import KVPlan, LayerPlan, SidePlan
from kvcal.runtime import QuantizedKVCache

H, D, L = 2, 16, 2
K_SPEC = TensorQuantSpec("int4", PerChannelTokenGroup(8), symmetric=False)
V_SPEC = TensorQuantSpec("int4", PerToken(), symmetric=True)


def tiny_model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=L,
                      num_attention_heads=4, num_key_value_heads=H, max_position_embeddings=256,
                      pad_token_id=0, bos_token_id=None, eos_token_id=None, rope_theta=500.0)
    return LlamaForCausalLM(cfg).eval()


def transform_plan(model, sinks=1, k_tr="pre_rope", v_tr="hadamard", clip=0.9, k_spec=K_SPEC) -> KVPlan:
    rope = rope_table(model)
    layers = [LayerPlan(SidePlan(k_spec, clip_ratio=torch.full((H,), clip), transform=k_tr,
                                 rope=rope if k_tr == "pre_rope" else None),
                        SidePlan(V_SPEC, transform=v_tr)) for _ in range(L)]
    return KVPlan(layers, sink_tokens=sinks)


def prefill_matches_protocol_a(model, plan, ids) -> QuantizedKVCache:
    """Prefill ``ids`` through the runtime cache: logits equal Protocol A's (fp32 rounding of the
    rotations) and the allocated bytes equal the accounting. Returns the cache."""
    with torch.no_grad():
        cache = QuantizedKVCache(plan, model.config)
        a = model(ids, cache=cache, use_cache=True).logits
        with attention_hook(model, plan_hook(plan)):
            b = model(ids, use_cache=False).logits
    assert torch.equal(a, b)  # same [B, T] forward, same fake-quant on the same K/V: shared arithmetic
    assert cache.allocated_bytes() == cache.expected_bytes()
    return cache


def decode_and_protocol_a(model, plan, ids, prefill: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill ``ids[:, :prefill]`` through the runtime cache, then decode token by token up to
    ``end``; returns ``(decode logits, Protocol A logits)`` for positions ``prefill-1 .. end-1``.

    The Protocol A reference reads, at the decoded positions, the keys/values the decode steps
    themselves handed the cache (substituted before fake-quantization). A decode step computes its
    token's K/V with a 1-row matmul and the reference with a whole-sequence one; an ulp between
    them can cross a rounding boundary and move a code by a whole step on one CPU and not another.
    With the same inputs, per-token quantization (and the elementwise RoPE / butterfly Hadamard
    transforms) gives the same codes, so what is left between the two logits is fp32 reassociation
    of the attention and MLP sums — the tolerance callers use (5e-5 on this 2-layer, hidden-64
    model's O(1) logits: ~n·2⁻²⁴·Σ|terms| with n ≤ 256) covers that and not a single moved code."""
    received: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    with torch.no_grad():
        cache = QuantizedKVCache(plan, model.config)
        outs = [model(ids[:, :prefill], cache=cache, use_cache=True).logits[:, -1]]
        for i, layer in enumerate(cache.layers):
            def update(k, v, *args, _orig=layer.update, _i=i, **kwargs):
                received.setdefault(_i, []).append((k.clone(), v.clone()))
                return _orig(k, v, *args, **kwargs)

            layer.update = update
        for t in range(prefill, end):
            outs.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits[:, -1])

        def substituted(module, q, k, v, mask, kwargs):
            i = module.layer_idx
            k, v = k.clone(), v.clone()
            k[:, :, prefill:] = torch.cat([r[0] for r in received[i]], dim=2)
            v[:, :, prefill:] = torch.cat([r[1] for r in received[i]], dim=2)
            return plan.fake_quant(i, "k", k), plan.fake_quant(i, "v", v)

        with attention_hook(model, substituted):
            ref = model(ids[:, :end], use_cache=False).logits[:, prefill - 1 :]
    return torch.stack(outs, 1), ref
