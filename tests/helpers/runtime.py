"""A tiny random Llama, uniform plans with seeded static scales, and an artifact written from a plan
(the runtime-cache tests and the tests that decode through it)."""

from __future__ import annotations

import torch

from kvcal.formats.spec import preset
from kvcal.plan import KVPlan

H, D, L = 2, 16, 2


def tiny_model(seed: int = 0, **kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=L,
                      num_attention_heads=4, num_key_value_heads=H, max_position_embeddings=256,
                      pad_token_id=0, bos_token_id=None, eos_token_id=None, **kw)
    return LlamaForCausalLM(cfg).eval()


def make_plan(name: str, sinks: int = 0, window: int = 0, num_layers: int = L, seed: int = 0,
              num_kv_heads: int = H, head_dim: int = D, fp8_scale: float = 0.004) -> KVPlan:
    """A uniform plan of preset ``name``; static sides get seeded positive scales of the right shape for
    ``num_kv_heads`` x ``head_dim`` — ``fp8_scale`` x U[1, 2) for FP8, 0.1 x U[1, 2) otherwise — and
    asymmetric ones the mid-range zero point."""
    kv = preset(name) if name in ("bf16", "fp16") else preset(name, sink_tokens=sinks, residual_window=window)
    plan = KVPlan.uniform(num_layers, kv)
    g = torch.Generator().manual_seed(seed)
    for lp in plan.layers:
        for sp in (lp.k, lp.v):
            if sp.spec.is_quantized and not sp.spec.dynamic:
                shape = sp.spec.granularity.scale_shape(1, num_kv_heads, 1, head_dim)
                if sp.spec.format.kind == "fp8":
                    sp.scale = fp8_scale * (1 + torch.rand(shape, generator=g))
                else:
                    sp.scale = 0.1 * (1 + torch.rand(shape, generator=g))
                if sp.spec.has_zero_point:
                    sp.zero_point = torch.full(shape, float(sp.spec.qmax // 2))
    return plan


# ---- strict loading from artifacts -----------------------------------------------------------------

def write_tiny_artifact(tmp_path, model, plan, name="art", **model_overrides):
    from kvcal.artifact import write_artifact
    from kvcal.models import model_metadata

    mm = model_metadata(model.config)
    mm.update(model_overrides)
    meta = {"model": mm, "kv": plan.kv_metadata(), "layers": []}
    return write_artifact(tmp_path / name, plan.to_tensors(), meta)


def prefill_and_protocol_a(model, plan, ids):
    """``(cache, a, b)``: the prefill logits ``a`` of ``ids`` through a fresh :class:`QuantizedKVCache` of ``plan``
    (left in ``cache``), and Protocol A's ``b`` (the model without a cache, ``plan`` fake-quantizing through the
    attention hook)."""
    from kvcal.capture.hooks import attention_hook
    from kvcal.evaluate.protocol_a import plan_hook
    from kvcal.runtime import QuantizedKVCache

    cache = QuantizedKVCache(plan, model.config)
    with torch.no_grad():
        a = model(ids, cache=cache, use_cache=True).logits
        with attention_hook(model, plan_hook(plan)):
            b = model(ids, use_cache=False).logits
    return cache, a, b
