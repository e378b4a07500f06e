"""The probes reuse the unquantized pass's outputs of the layers below a plan's first quantized layer
(evaluate.protocol_a._mean_kl): same numbers, fewer layer computations."""

import pytest
import torch
from helpers.models import TINY_LLAMA_16, save_tiny_llama

from kvcal.evaluate.protocol_a import (
    decoder_layers,
    first_quantized_layer,
    plans_kl,
    side_only,
    side_sensitivity,
)

L = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm_tokenizer):
    from kvcal.models import load_model

    d = save_tiny_llama(tmp_path_factory, smollm_tokenizer, "tiny-prefix", vocab_size=49152,
                        **{**TINY_LLAMA_16, "num_hidden_layers": L})
    return load_model(str(d))


def _samples():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 49152, (n,), generator=g) for n in (40, 23)]


def _count_mlp_calls(model):
    """Counts real decoder-layer computations: the MLP runs only inside a layer's own forward."""
    calls = [0]
    handles = [layer.mlp.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
               for layer in decoder_layers(model)]
    return calls, handles


def test_vllm_layer_probe_is_unchanged_and_cheaper(tiny, one_thread):
    """layer_sensitivity's plans (only layer l through the dtype) give exactly the KL of full passes — the
    layers below l see the same inputs either way, so the arithmetic is shared and the comparison is exact —
    and the reusing run computes L layers for the reference plus L - l for plan l (sum over samples)."""
    from kvcal.engines.vllm.skip_layers import probe_plans

    plans = probe_plans("int4_per_token_head", L)
    assert [first_quantized_layer(plans[i]) for i in range(L)] == list(range(L))
    calls, handles = _count_mlp_calls(tiny)
    try:
        reused = plans_kl(tiny, _samples(), plans, progress=False)
        n_reuse = calls[0]
        calls[0] = 0
        full = plans_kl(tiny, _samples(), plans, progress=False, reuse_prefix=False)
        n_full = calls[0]
    finally:
        for h in handles:
            h.remove()
    assert reused == full
    assert all(v > 0 for v in full.values())
    assert n_full == 2 * (L + L * L) and n_reuse == 2 * (L + sum(L - i for i in range(L)))
    assert all("forward" not in layer.__dict__ for layer in decoder_layers(tiny))  # restored


def test_side_sensitivity_is_unchanged(tiny, one_thread):
    """The --bits probe (one side of one layer at a time, a KVPlan with sinks) gives exactly the same KLs with
    and without reuse; a plan that may quantize any layer (a whole KVPlan) reuses nothing (first layer 0)."""
    from kvcal.formats.spec import preset
    from kvcal.plan import KVPlan

    plan = KVPlan(KVPlan.uniform(L, preset("kivi4")).layers, sink_tokens=1)
    assert first_quantized_layer(plan) == 0 and first_quantized_layer(side_only(plan, "v", 2)) == 2
    a = side_sensitivity(tiny, _samples(), plan, progress=False)
    b = side_sensitivity(tiny, _samples(), plan, progress=False, reuse_prefix=False)
    assert a == b and len(a) == 2 * L


def test_plans_kl_nll_matches_an_independent_float64_nll(tiny, one_thread):
    """plans_kl_nll's NLL is the mean of -log p(next token) over every predicted position, computed here
    independently from the model's logits in float64 (the same logits and log_softmax, so the per-sample sums
    agree exactly; only the order of the final sum over samples may differ: 2 terms, 1 rounding, so the
    comparison allows 4 ulp of the mean). Its KLs are plans_kl's, bit for bit, with and without prefix reuse."""
    from kvcal.engines.vllm.skip_layers import probe_plans
    from kvcal.evaluate.protocol_a import plans_kl_nll, protocol_a_logits

    plans = {i: p for i, p in probe_plans("int4_per_token_head", L).items() if i in (0, 2)}
    kl, nll = plans_kl_nll(tiny, _samples(), plans, progress=False)
    kl_full, nll_full = plans_kl_nll(tiny, _samples(), plans, progress=False, reuse_prefix=False)
    assert kl == plans_kl(tiny, _samples(), plans, progress=False) and kl == kl_full and nll == nll_full
    assert set(nll) == {0, 2, "16-bit"}
    with torch.no_grad():
        for name, plan in [("16-bit", None), (0, plans[0]), (2, plans[2])]:
            tot, n = 0.0, 0
            for ids in _samples():
                logp = torch.log_softmax(protocol_a_logits(tiny, ids[None], plan).double(), -1)[0]
                tot += -float(logp[torch.arange(len(ids) - 1), ids[1:]].sum())
                n += len(ids) - 1
            assert nll[name] == pytest.approx(tot / n, rel=4 * 2.0**-52, abs=0)
    assert nll[0] != nll["16-bit"] and nll[2] != nll["16-bit"]  # the int4 cache moves the NLL
