"""The capture records each layer's sliding window, so the searches mask each layer's objective as the model's
attention reads (Gemma 3: sliding layers read the current token and the W - 1 before it, the global one all)."""

from __future__ import annotations

import torch
from helpers.models import TINY_GEMMA3


def test_capture_records_layer_windows_and_the_objective_uses_them():
    """On a tiny Gemma 3 (W = 8; layers sliding, sliding, full, sliding) with 20-token samples: the capture's
    windows are the config's, and the sequence caches the searches build from the reservoir hold the model's
    own attention probabilities — checked against the attention weights transformers' eager attention returns
    (output_attentions), which apply the model's sliding mask. float32 softmax of the same scores in a
    different kernel: |Δp| ≤ 1e-5 (a probability's relative float32 error after a D=32 dot product and a
    softmax over ≤ 20 terms is below 100·u ≈ 1.2e-5·p); a causal-only mask would put ~O(1/T) mass on the
    12 dropped keys of a sliding layer."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from kvcal.capture.run import run_capture
    from kvcal.search.objectives import sequence_caches

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=64, bos_token_id=1, **TINY_GEMMA3)
    cfg._attn_implementation = "eager"
    m = Gemma3ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(2)
    samples = [torch.randint(2, 64, (20,), generator=g) for _ in range(3)]
    cap = run_capture(m, samples, set(), num_layers=4, num_kv_heads=1, num_q_heads=2, head_dim=32, batch_size=1,
                      reservoir=3, heldout_reservoir=1, search_tokens=20, progress=False)
    assert cap.windows == {0: 8, 1: 8, 2: 0, 3: 8}
    i0 = sorted(cap.calib.items)[0]
    with torch.no_grad():
        att = m(samples[i0][None], output_attentions=True, use_cache=False).attentions  # per layer [1, H_q, T, T]
    for layer in range(4):
        caches = sequence_caches(cap.calib, layer, cap.scaling[layer], None, cap.windows[layer])
        c = caches[sorted(cap.calib.items).index(i0)]
        p = c.p.reshape(2, 20, 20)  # [H_kv=1, G=2, Tq, T] -> [H_q, T, T]
        assert float((p - att[layer][0].float()).abs().max()) <= 1e-5, layer
        if cap.windows[layer]:
            assert float(p[:, 19, :12].sum()) == 0.0  # query 19 reads keys 12..19 only
