"""llama.cpp's fp16 ``P · V`` accumulator (``kvcal/engines/llamacpp/attention.py``) against a scalar transcription of
``ggml_compute_forward_flash_attn_ext_f16_one_chunk`` where the arithmetic is the same (equal scores: every ``expf``
is ``exp(0) = 1`` or ``exp(-inf) = 0`` exactly), against float64 attention within the bound fp16 rounding allows
elsewhere, and wired into Protocol A through the plan (``own_attention``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcal.engines.llamacpp.attention import allowed_keys, flash_attn_f16_accumulator
from kvcal.engines.llamacpp.plan import LlamaCppKVPlan


def _values(shape, seed):
    """fp16 values in [1, 2) with 4 fraction bits beyond fp16's 10 dropped: sums of a few of them leave fp16's
    precision (so an fp16 accumulator rounds where a float32 one does not) while staying exact in float32."""
    g = torch.Generator().manual_seed(seed)
    return (1 + torch.randint(0, 1024, shape, generator=g) / 1024.0).half().float()


def _one_row(v_rows: np.ndarray) -> np.ndarray:
    """One query row of the kernel with every score equal (``s == M`` after the first key): ``VKQ16 = v_0``, then
    ``VKQ16 = fp16(fp32(VKQ16) · 1)`` (exact) and ``VKQ16 = fp16(fp32(VKQ16) + fp32(v_t) · 1)``; ``S`` counts the
    keys; the output is ``fp32(VKQ16) · (1/S)`` in float32."""
    acc = np.zeros(v_rows.shape[-1], np.float16)
    S = np.float32(0)
    for vt in v_rows:
        acc = (acc.astype(np.float32) + vt.astype(np.float32)).astype(np.float16)
        S = np.float32(S + np.float32(1))
    if S == 0:
        return np.zeros(v_rows.shape[-1], np.float32)
    return acc.astype(np.float32) * (np.float32(1) / S)


@pytest.mark.parametrize("kind", ["causal", "window", "float", "holes"])
def test_equal_scores_give_the_kernels_fp16_sums_exactly(kind):
    """Zero queries make every score 0, so the kernel's ``expf`` calls are exact and the output is the sequential fp16
    sum of the values each row reads, divided by their count: compared exactly, for GQA (4 query heads on 2 KV
    heads), a causal mask (``None``, as sdpa passes it), a sliding window (bool), an additive float mask (0 / the
    dtype's minimum) and a mask with holes (rows between a key's first and last reader that skip it)."""
    B, Hq, Hkv, S, D = 1, 4, 2, 24, 16
    q = torch.zeros(B, Hq, S, D)
    k = torch.randn(B, Hkv, S, D, generator=torch.Generator().manual_seed(1))
    v = _values((B, Hkv, S, D), 2)
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    read = {"causal": causal, "window": causal & ~torch.ones(S, S, dtype=torch.bool).tril(-5),
            "float": causal, "holes": causal & (torch.arange(S)[:, None] + torch.arange(S)[None] * 3) % 4 != 1}[kind]
    read[:, 0] |= kind == "holes"  # every row reads something
    mask = {"causal": None, "window": read[None, None], "holes": read[None, None],
            "float": torch.where(read, 0.0, torch.finfo(torch.float32).min)[None, None]}[kind]
    got = flash_attn_f16_accumulator(q, k, v, allowed_keys(mask, S, S), 0.125)
    vn = v.numpy()
    for h in range(Hq):
        for i in range(S):
            want = _one_row(vn[0, h // (Hq // Hkv), read[i].numpy()])
            assert np.array_equal(got[0, h, i].numpy(), want), (h, i)
    # and it is not the float32 mean: the fp16 accumulator rounded somewhere
    f32 = (read.float() @ v[0].repeat_interleave(2, 0)) / read.float().sum(-1, keepdim=True)
    assert not torch.equal(got[0], f32)


def test_random_scores_within_the_fp16_rounding_bound():
    """Random scores (new maxima along the way): the output is within what fp16 rounding allows of float64
    attention. Each key rounds the accumulator twice (the rescale on a new maximum, then the add), each rounding
    moves it by at most 2^-11 of its magnitude, which is at most S_t · max|v|; later rescales only shrink
    those errors and the output divides by S >= S_t: at most 2 · n · 2^-11 · max|v| for a row of n keys (plus
    float32 terms far below). A kernel that skipped the fp16 rounding would be inside too; one that dropped a
    rescale or read a masked key would not."""
    g = torch.Generator().manual_seed(3)
    B, Hq, Hkv, S, D = 2, 6, 3, 40, 32
    q, k = torch.randn(B, Hq, S, D, generator=g) * 2, torch.randn(B, Hkv, S, D, generator=g)
    v = (torch.randn(B, Hkv, S, D, generator=g) * 3).half().float()
    got = flash_attn_f16_accumulator(q, k, v, allowed_keys(None, S, S), D**-0.5).double()
    want = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1), is_causal=True,
        scale=D**-0.5)
    n = torch.arange(1, S + 1, dtype=torch.float64)[None, None, :, None]
    bound = 2 * n * 2.0**-11 * v.abs().max() + 1e-5 * v.abs().max()
    assert ((got - want).abs() <= bound).all()
    assert (got - want).abs().max() > 1e-6  # the fp16 accumulator is not float32's


def test_allowed_keys_reads_transformers_masks_and_refuses_a_bias():
    """``None`` is causal over the last ``s_q`` of ``s_k`` positions; a float mask of 0/min is read as bool; a float
    mask carrying any other value (a positional bias) is refused rather than dropped."""
    a = allowed_keys(None, 2, 5)[0, 0]
    assert a.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
    m = torch.tensor([[0.0, torch.finfo(torch.float32).min], [0.0, 0.0]])[None, None]
    assert allowed_keys(m, 2, 2)[0, 0].tolist() == [[True, False], [True, True]]
    with pytest.raises(ValueError, match="bias"):
        allowed_keys(torch.tensor([[0.0, -0.5], [0.0, 0.0]])[None, None], 2, 2)


def test_own_attention_where_llamacpp_accumulates_in_fp16():
    """``-ctv f16`` with a non-f16 K, or any f16 V in decode steps: the one-chunk kernel's fp16 accumulator; f16/f16
    prefill is tiled (f32); a quantized V accumulates in f32; the switch turns it off."""
    assert LlamaCppKVPlan("q8_0", "f16", 2).own_attention()
    assert LlamaCppKVPlan("q4_0", "f16", 2).describe()["f16_accumulator"] is True
    assert not LlamaCppKVPlan("f16", "f16", 2).own_attention()
    assert LlamaCppKVPlan("f16", "f16", 2, prefill=False).own_attention()
    assert not LlamaCppKVPlan("q8_0", "q8_0", 2).own_attention()
    off = LlamaCppKVPlan("q8_0", "f16", 2, emulate_f16_accumulator=False)
    assert not off.own_attention() and off.describe()["not_emulated"]


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).eval()


def test_protocol_a_runs_the_plans_attention(tiny_llama):
    """Through Protocol A's hook a ``q8_0/f16`` plan's logits are those of the model whose attention is
    :func:`flash_attn_f16_accumulator` on the plan's query/key/value (checked layer by layer by capturing what
    the hook hands over), and they differ from the f32 attention's."""
    from kvcal.capture.hooks import attention_hook
    from kvcal.evaluate.protocol_a import plan_hook

    model = tiny_llama
    L = model.config.num_hidden_layers
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(4))
    on, off = LlamaCppKVPlan("q8_0", "f16", L), LlamaCppKVPlan("q8_0", "f16", L, emulate_f16_accumulator=False)
    seen = []

    def spy(plan):
        inner = plan_hook(plan)

        def cb(module, q, k, v, mask, kwargs):
            out = inner(module, q, k, v, mask, kwargs)
            seen.append((module, q, k, v, mask, kwargs, out))
            return out
        return cb

    with torch.no_grad(), attention_hook(model, spy(on)):
        lo_on = model(ids).logits
    for module, q, k, v, mask, kwargs, out in seen:
        qq, kk, vv = on.fake_quant_query(module.layer_idx, q), on.fake_quant(module.layer_idx, "k", k), \
            on.fake_quant(module.layer_idx, "v", v)
        assert torch.equal(out.output, on.attention(module, qq, kk, vv, mask, kwargs))
    with torch.no_grad(), attention_hook(model, plan_hook(off)):
        lo_off = model(ids).logits
    assert not torch.equal(lo_on, lo_off)
