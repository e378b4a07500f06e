"""Choosing vLLM's 16-bit layers (kvcal.search.skip_layers): exact knapsack vs brute force, costs by hand,
vLLM's rule, and a constructed model whose sensitive middle layer the probe finds and the rule misses."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from kvcal.engines.vllm.skip_layers import probe_plans, rule_skip_layers, skip_costs
from kvcal.search.skip_layers import choose_skip_layers

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run faster single-threaded


def brute_force(sens, costs, max_skip, max_bytes, forced=()):
    """Every subset; the best value, then fewest layers, then the smallest sorted index tuple."""
    L = len(sens)
    best = None
    for r in range(L + 1):
        for s in itertools.combinations(range(L), r):
            if not set(forced) <= set(s):
                continue
            if max_skip is not None and len(s) > max_skip:
                continue
            if max_bytes is not None and sum(costs[i] for i in s) > max_bytes:
                continue
            key = (-sum(sens[i] for i in s), len(s), s)
            if best is None or key < best:
                best = key
    return list(best[2])


@pytest.mark.parametrize("seed", range(40))
def test_choice_is_the_exact_optimum(seed):
    """choose_skip_layers equals brute force over every subset (best value, fewest layers, smallest
    indices) on 40 random cases with ties, zeros, layer/byte budgets and forced layers; over-budget forced sets are refused."""
    rng = random.Random(seed)
    L = rng.randint(1, 8)
    sens = [rng.choice([0.0, rng.random(), round(rng.random(), 1)]) for _ in range(L)]  # ties and zeros
    uniform = seed % 2 == 0
    c = rng.randint(1, 300)
    costs = [c] * L if uniform else [rng.choice([64, 96, 128, 200]) for _ in range(L)]
    max_skip = rng.choice([None, rng.randint(0, L)])
    max_bytes = rng.choice([None, rng.randint(0, sum(costs))])
    forced = sorted(rng.sample(range(L), rng.randint(0, min(2, L)))) if seed % 3 == 0 else []
    if (max_skip is not None and len(forced) > max_skip) or (
            max_bytes is not None and sum(costs[i] for i in forced) > max_bytes):
        with pytest.raises(ValueError, match="already exceed"):
            choose_skip_layers(sens, costs, max_skip=max_skip, max_extra_bytes=max_bytes, forced=forced)
        return
    got = choose_skip_layers(sens, costs, max_skip=max_skip, max_extra_bytes=max_bytes, forced=forced)
    assert got == brute_force(sens, costs, max_skip, max_bytes, forced)


def test_bad_bounds_are_refused():
    """choose_skip_layers refuses mismatched sensitivity/cost lengths, a negative max_skip and an
    out-of-range forced layer."""
    with pytest.raises(ValueError, match="2 sensitivities but 1 costs"):
        choose_skip_layers([0.1, 0.2], [1])
    with pytest.raises(ValueError, match=">= 0"):
        choose_skip_layers([0.1], [1], max_skip=-1)
    with pytest.raises(ValueError, match="out of range"):
        choose_skip_layers([0.1], [1], forced=[3])


def test_rule_is_vllms_boundary_rule():
    """rule_skip_layers(L, 4) equals vllm_dtypes.boundary_skip_layers for turboquant; hand-worked sets for 0, 3
    and 5 layers of 30; a rule larger than the model is refused."""
    from kvcal.engines.vllm.dtypes import boundary_skip_layers

    for L in (4, 5, 30):
        assert rule_skip_layers(L, 4) == boundary_skip_layers("turboquant_4bit_nc", L)
    assert rule_skip_layers(30, 0) == [] and rule_skip_layers(30, 3) == [0, 1, 29] and rule_skip_layers(30, 5) == [0, 1, 2, 28, 29]
    with pytest.raises(ValueError):
        rule_skip_layers(3, 4)


def test_skip_costs_by_hand():
    """Hand-worked extra bytes per token of skipping a layer: fp8 (1 byte vs 2) and int8_per_token_head
    (plus a 4-byte scale per token, head and side) for H_kv=3, D=64."""
    # 16-bit slot: H_kv * D * 2 bytes * (K and V); fp8: 1 byte each; int8_per_token_head adds a float32 scale
    # per token and head on each side (vLLM's inline scale: 4 bytes); SmolLM2 shape H_kv=3, D=64.
    assert skip_costs("fp8", 30, 3, 64) == [3 * 64 * 2 * 2 - 3 * 64 * 2] * 30
    assert skip_costs("int8_per_token_head", 2, 3, 64) == [3 * 64 * 4 - 3 * (64 + 4) * 2] * 2


def test_probe_plans_quantize_one_layer_each():
    """Each probe plan quantizes exactly one layer and keeps the others at 16 bits; turboquant probes do
    not add the boundary rule."""
    plans = probe_plans("int4_per_token_head", 3)
    for layer, p in plans.items():
        assert set(p.skipped) == {0, 1, 2} - {layer}
    x = torch.randn(1, 2, 5, 16)
    assert torch.equal(plans[0].fake_quant(1, "k", x), x) and not torch.equal(plans[0].fake_quant(0, "k", x), x)
    tq = probe_plans("turboquant_4bit_nc", 6)  # no boundary rule in the probe
    assert tq[0].skipped == (1, 2, 3, 4, 5)


def test_probe_finds_a_sensitive_middle_layer_the_rule_misses(smollm_tokenizer):
    """Six-layer random Llama; layer 3's queries and keys are scaled up 16x (scores 256x sharper, so
    int4 key errors move attention far more there) and its o_proj 8x. The probe's choice of 2 layers must
    include layer 3, and the model-level KL with those 2 layers at 16 bits must be ≤ the rule's
    ([0, 5]) — measured independently with plans_kl on other tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvcal.engines.vllm.plan import VllmKVPlan
    from kvcal.engines.vllm.probe import layer_sensitivity
    from kvcal.evaluate.protocol_a import plans_kl

    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        att = model.model.layers[3].self_attn
        att.q_proj.weight.mul_(16.0)
        att.k_proj.weight.mul_(16.0)
        att.o_proj.weight.mul_(8.0)
    g = torch.Generator().manual_seed(1)
    probe = [torch.randint(0, 512, (64,), generator=g) for _ in range(2)]
    held = [torch.randint(0, 512, (64,), generator=g) for _ in range(2)]
    d = "int4_per_token_head"
    sens = layer_sensitivity(model, probe, d, 6, progress=False)
    assert max(range(6), key=sens.__getitem__) == 3
    auto = choose_skip_layers(sens, skip_costs(d, 6, 2, 16), max_skip=2)
    rule = rule_skip_layers(6, 2)
    assert 3 in auto and 3 not in rule
    kl = plans_kl(model, held, {"auto": VllmKVPlan(d, 6, skip_layers=tuple(auto)),
                                "rule": VllmKVPlan(d, 6, skip_layers=tuple(rule))}, progress=False)
    assert kl["auto"] <= kl["rule"]  # seen 6.0e-5 vs 2.4e-4: a 4x margin, not an ulp-level comparison
