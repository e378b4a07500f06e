"""Pre-RoPE keys on a model with one RoPE per layer type (Gemma 3: base 10k on sliding layers, 1M on global
ones): ``kvcal.models.rope_tables`` gives each layer the table its keys were rotated with, checked against the
model's own pre-RoPE keys (the ``k_norm`` output, hooked independently of kvcal's capture)."""

from __future__ import annotations

import pytest
import torch
from helpers.models import TINY_GEMMA3


@pytest.fixture(scope="module")
def tiny_gemma():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=64, bos_token_id=1, **{**TINY_GEMMA3, "max_position_embeddings": 64},
                           rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    return Gemma3ForCausalLM(cfg).eval()


def test_each_layer_gets_its_types_table(tiny_gemma):
    """Un-rotating each layer's captured post-RoPE keys with its table recovers the model's pre-RoPE keys (the
    k_norm output) to float32 rounding: each output element is a 4-term sum of products of values bounded by
    max|x| with cos/sin in [-1, 1] (and cos/sin computed as transformers does), so |error| <= 16·u·max|x| with
    margin. The other type's table misses by O(max|x|) at every position > 0 (different angles), which the
    test checks too, so a table assigned to the wrong layer type fails."""
    from kvcal.capture.hooks import capture_kv
    from kvcal.models import rope_tables

    m = tiny_gemma
    tables = rope_tables(m)
    types = m.config.layer_types
    assert len(tables) == len(types)
    assert tables[0] is tables[1] and tables[0] is not tables[2]  # layers of one type share one table
    pre, post = {}, {}
    hooks = [a.self_attn.k_norm.register_forward_hook(lambda mod, i, o, idx=j: pre.__setitem__(idx, o.detach()))
             for j, a in enumerate(m.model.layers)]
    ids = torch.randint(2, 64, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), capture_kv(m, lambda i, q, k, v, mod: post.__setitem__(i, k)):
        m(ids, use_cache=False)
    for h in hooks:
        h.remove()
    u = torch.finfo(torch.float32).eps
    for i, t in enumerate(types):
        x = pre[i].float()
        bound = 16 * u * float(x.abs().max())
        assert float((tables[i].to_pre_rope(post[i]) - x).abs().max()) <= bound, (i, t)
        other = next(tables[j] for j, tt in enumerate(types) if tt != t)
        assert float((other.to_pre_rope(post[i])[..., 1:, :] - x[..., 1:, :]).abs().max()) > 1000 * bound, (i, t)


def test_single_rope_models_share_one_table(smollm_model):
    """A model with one rotary embedding: every layer gets the same table, equal to rope_table's."""
    from kvcal.models import rope_table, rope_tables

    tables = rope_tables(smollm_model)
    assert len(tables) == smollm_model.config.num_hidden_layers
    assert all(t is tables[0] for t in tables)
    assert torch.equal(tables[0].inv_freq, rope_table(smollm_model).inv_freq)
