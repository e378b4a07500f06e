"""``LlamaCppKVPlan`` (what flash attention reads under ``-fa on -ctk/-ctv``) and ``kv_bytes`` (what llama.cpp
allocates), against hand computations and an independent float64 computation of one attention layer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from helpers.llamacpp import q8_0_avx_block, sylvester
from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

from kvcal.engines.llamacpp import LlamaCppKVPlan, kv_bytes
from kvcal.errors import KvcalError

SMOLLM = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
          "hidden_size": 576}


# -- memory --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("t,n_ctx,side_bytes,line", [
    # n_embd_k_gqa = 3 x 64 = 192; q8_0: 192/32 blocks x 34 B = 204 B per cell; f16: 384 B per cell; 30 layers
    ("q8_0", 4096, 30 * 204 * 4096, "size =   47.81 MiB (  4096 cells,  30 layers,  1/1 seqs), "
                                    "K (q8_0):   23.91 MiB, V (q8_0):   23.91 MiB"),
    ("f16", 4096, 30 * 384 * 4096, "size =   90.00 MiB (  4096 cells,  30 layers,  1/1 seqs), "
                                   "K (f16):   45.00 MiB, V (f16):   45.00 MiB"),
    ("q8_0", 32768, 30 * 204 * 32768, "size =  382.50 MiB ( 32768 cells,  30 layers,  1/1 seqs), "
                                      "K (q8_0):  191.25 MiB, V (q8_0):  191.25 MiB"),
    ("f16", 32768, 30 * 384 * 32768, "size =  720.00 MiB ( 32768 cells,  30 layers,  1/1 seqs), "
                                     "K (f16):  360.00 MiB, V (f16):  360.00 MiB"),
])
def test_smollm_cache_bytes_by_hand(t, n_ctx, side_bytes, line):
    """SmolLM2-135M (30 layers, 3 KV heads x 64): bytes per side = 30 x 192 / blck x type_size x cells; the log
    line's MiB figures worked by hand (25,067,520 B = 23.906 MiB -> "23.91"; 47,185,920 B = 45 MiB)."""
    m = kv_bytes(SMOLLM, t, t, n_ctx)
    assert (m.k_bytes, m.v_bytes, m.total) == (side_bytes, side_bytes, 2 * side_bytes)
    assert m.log_line() == "llama_kv_cache: " + line


def test_context_padding_and_streams():
    """``n_ctx`` is padded to 256 (1000 -> 1024 cells); 3 non-unified sequences at 4096 get
    PAD(4096 / 3 = 1365, 256) = 1536 cells in each of 3 streams; unified: 4096 cells, one stream; mixed K/V types
    are sized per side (q4_0: 192/32 x 18 = 108 B per cell)."""
    assert kv_bytes(SMOLLM, "q8_0", "q8_0", 1000).kv_size == 1024
    m = kv_bytes(SMOLLM, "q8_0", "q4_0", 4096, 3)
    assert (m.kv_size, m.n_stream, m.k_bytes, m.v_bytes) == (1536, 3, 30 * 204 * 1536 * 3, 30 * 108 * 1536 * 3)
    assert "(  1536 cells,  30 layers,  3/3 seqs)" in m.log_line()
    u = kv_bytes(SMOLLM, "q8_0", "q8_0", 4096, 3, unified=True)
    assert (u.kv_size, u.n_stream, u.total) == (4096, 1, 2 * 30 * 204 * 4096)


@pytest.mark.parametrize("args", [("q3_k", "f16", 4096), ("f16", "f16", 0), ("f16", "f16", 4096, 0)])
def test_memory_bad_input(args):
    """Unknown cache type, non-positive context or sequence count: one KvcalError."""
    with pytest.raises(KvcalError):
        kv_bytes(SMOLLM, *args)


# -- the plan ------------------------------------------------------------------------------------------------

def _tiny_llama(seed: int = 0):
    """A random 2-layer Llama with head_dim 64 (llama.cpp rotates only multiples of 64), 2 query heads, 1 KV head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=256,
                      pad_token_id=0, bos_token_id=None, eos_token_id=None)
    return LlamaForCausalLM(cfg).eval()


def test_plan_kl_is_positive_and_ordered():
    """Protocol A on a tiny random Llama: each llama.cpp cache changes the logits (KL > 0), q4_0 K+V more than
    q8_0 (a 16x coarser step), with and without the rotation; f16/f16 changes them far less than q8_0."""
    from kvcal.evaluate.protocol_a import teacher_forced

    model = _tiny_llama()
    windows = torch.randint(1, 128, (2, 48), generator=torch.Generator().manual_seed(0))
    plans = {f"{t}-{r}": LlamaCppKVPlan(t, t, 2, rotation=r) for t in ("q8_0", "q4_0") for r in (True, False)}
    plans["f16"] = LlamaCppKVPlan("f16", "f16", 2)
    res = teacher_forced(model, windows, plans, progress=False)
    for r in (True, False):
        assert 0 < res[f"q8_0-{r}"]["kl_mean"] < res[f"q4_0-{r}"]["kl_mean"]
    assert res["f16"]["kl_mean"] < res["q8_0-True"]["kl_mean"]


def _gguf_q4_0(x: np.ndarray) -> np.ndarray:
    """gguf-py's numpy ``quantize_row_q4_0_ref`` + ``dequantize_row_q4_0`` (bit-exact with ggml's C, see
    test_llamacpp_quants), rows of 64."""
    flat = x.reshape(-1, 64).astype(np.float32)
    return gguf_dequantize(gguf_quantize(flat, T.Q4_0), T.Q4_0).reshape(x.shape).astype(np.float64)


def _q8_0_avx(x: np.ndarray) -> np.ndarray:
    out = np.empty(x.shape, dtype=np.float64)
    for idx in np.ndindex(*x.shape[:-1]):
        for b in range(x.shape[-1] // 32):
            d, q = q8_0_avx_block(x[idx][32 * b:32 * b + 32])
            out[idx][32 * b:32 * b + 32] = np.float64(d) * q
    return out


def test_one_layer_equals_a_float64_computation():
    """Layer 0 of the tiny Llama under ``-ctk q4_0 -ctv q4_0`` (rotation on): the attention output from the plan's
    query, key and value equals a float64 computation written from the engine's description —
    ``out = H · softmax(q8_0(Hq) · q4_0(Hk) / 8) · q4_0(Hv)`` with gguf-py's q4_0, the numpy AVX q8_0 and a float64
    Sylvester ``H``. Inputs are the layer's real q/k/v snapped to a 1/64 grid so that ``Hx`` is exact in both
    (sums of 64 values of < 2^15 units), making every quantization code identical. What remains is the plan's f32
    back-rotation ``H·x̂`` (6 butterfly stages on values of two block scales): elementwise error
    <= 6·2^-24·Σ|x̂_row|/8, asserted first; it moves each score by at most ``(Σ|Δq|·max|k| + Σ|Δk|·max|q|)/8``
    and the output by at most ``2·max|Δs|·max|v| + max|Δv|``."""
    from kvcal.capture.hooks import capture_kv
    from kvcal.evaluate.protocol_a import plan_hook

    model = _tiny_llama(1)
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    got = {}
    with torch.no_grad(), capture_kv(model, lambda i, q, k, v, m: got.setdefault(i, (q, k, v, m))):
        model(ids, use_cache=False)
    q, k, v, module = got[0]
    q, k, v = ((t * 64).round() / 64 for t in (q, k, v))
    plan = LlamaCppKVPlan("q4_0", "q4_0", 2, rotation=True)
    qp, kp, vp = (t.double() for t in plan_hook(plan)(module, q, k, v, None, {}))

    h = sylvester(64)
    rot = lambda t: np.einsum("ij,...j->...i", h, t.double().numpy())  # noqa: E731  (exact on the grid)
    q_hat, k_hat, v_hat = _q8_0_avx(rot(q).astype(np.float32)), _gguf_q4_0(rot(k)), _gguf_q4_0(rot(v))

    def back(x):
        return np.einsum("ij,...j->...i", h, x)

    for mine, ref in ((qp, q_hat), (kp, k_hat), (vp, v_hat)):
        tol = 6 * 2**-24 * np.abs(ref).sum(-1, keepdims=True) / 8
        assert (np.abs(mine.numpy() - back(ref)) <= tol).all()

    S = q.shape[2]
    causal = np.triu(np.full((S, S), -np.inf), 1)

    def attn(qq, kk, vv):  # [1, 2, S, 64] query heads share the one KV head
        s = np.einsum("bhsd,btd->bhst", qq, kk[:, 0]) / 8 + causal
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        return np.einsum("bhst,btd->bhsd", p, vv[:, 0])

    ref_out = back(attn(q_hat, k_hat, v_hat))  # the engine rotates the output back
    mine_out = attn(qp.numpy(), kp.numpy(), vp.numpy())
    dq, dk, dv = (np.abs(a.numpy() - back(b)).max() for a, b in ((qp, q_hat), (kp, k_hat), (vp, v_hat)))
    ds = (64 * dq * np.abs(k_hat).max() * 2 + 64 * dk * np.abs(q_hat).max() * 2) / 8  # |H x| <= 8·max|x| per element
    bound = 2 * ds * 8 * np.abs(v_hat).max() + dv + 1e-12
    assert np.abs(mine_out - ref_out).max() <= bound
    assert np.abs(mine_out - ref_out).max() < 1e-4 * np.abs(ref_out).max()  # and the bound is a small one


def test_query_type_follows_the_flash_attention_kernel():
    """Q is converted to the K type's vec_dot_type (one_chunk kernel): q8_0 for q8_0/q4_0/q5_0/iq4_nl keys, q8_1
    for q4_1/q5_1, fp16 for f16 keys with a quantized V or in decode steps; f32 in the tiled f16/f16 prefill."""
    qt = {t: LlamaCppKVPlan(t, "q8_0", 1).query_type() for t in ("q8_0", "q4_0", "q5_0", "iq4_nl", "q4_1", "q5_1",
                                                                    "f16", "f32")}
    assert qt == {"q8_0": "q8_0", "q4_0": "q8_0", "q5_0": "q8_0", "iq4_nl": "q8_0", "q4_1": "q8_1", "q5_1": "q8_1",
                  "f16": "f16", "f32": "f32"}
    assert LlamaCppKVPlan("f16", "f16", 1).query_type() == "f32"
    assert LlamaCppKVPlan("f16", "f16", 1, prefill=False).query_type() == "f16"
    q = torch.randn(1, 2, 3, 64)
    assert LlamaCppKVPlan("f16", "f16", 1).fake_quant_query(0, q) is q


def test_rotation_default_and_env(monkeypatch):
    """``rotation=None`` takes llama.cpp's default: on, off under ``LLAMA_ATTN_ROT_DISABLE=1``; an f16 side is
    never rotated (only fp16 rounding: equal to ``x.half()``)."""
    monkeypatch.delenv("LLAMA_ATTN_ROT_DISABLE", raising=False)
    assert LlamaCppKVPlan("q4_0", "q4_0", 1).rotation is True
    monkeypatch.setenv("LLAMA_ATTN_ROT_DISABLE", "1")
    assert LlamaCppKVPlan("q4_0", "q4_0", 1).rotation is False
    x = torch.randn(1, 1, 4, 64)
    assert torch.equal(LlamaCppKVPlan("q4_0", "f16", 1, rotation=True).fake_quant(0, "v", x), x.half().float())


def test_plan_bits_and_serve_args():
    """Payload bits per quantized (layer, side) and the llama-server arguments."""
    p = LlamaCppKVPlan("q8_0", "q4_0", 2)
    assert p.quantized_bits() == [8, 4, 8, 4]
    assert LlamaCppKVPlan("f16", "q5_1", 1).quantized_bits() == [5]
    assert p.serve_args() == "-fa on -ctk q8_0 -ctv q4_0"


@pytest.mark.parametrize("call", [
    lambda: LlamaCppKVPlan("q3_k", "f16", 1), lambda: LlamaCppKVPlan("f16", "f16", 0),
    lambda: LlamaCppKVPlan("q8_0", "q8_0", 1, impl="neon"),
    lambda: LlamaCppKVPlan("q8_0", "q8_0", 1).fake_quant(0, "k", torch.zeros(1, 1, 2, 48)),
    lambda: LlamaCppKVPlan("q8_0", "q8_0", 1).fake_quant(1, "k", torch.zeros(1, 1, 2, 64)),
    lambda: LlamaCppKVPlan("q8_0", "q8_0", 1).fake_quant(0, "q", torch.zeros(1, 1, 2, 64)),
])
def test_plan_bad_input(call):
    """Unknown type or impl, no layers, a head_dim the block does not divide (llama.cpp refuses the context),
    a layer out of range or a bad side: one KvcalError."""
    with pytest.raises(KvcalError):
        call()


def test_head_dim_refused_alike_by_every_entry():
    """head_dim 48 is not a multiple of a quantized type's block of 32: llama.cpp refuses the context
    (``src/llama-context.cpp``), and so do kvcal's byte counts and its plan, with one message naming the side; f16
    sides pass (block 1)."""
    from transformers import LlamaConfig

    from kvcal.engines.llamacpp.plan import kv_bytes, pair_bytes_per_token, pair_plan

    cfg = LlamaConfig(hidden_size=96, num_attention_heads=2, num_key_value_heads=1, head_dim=48, num_hidden_layers=2)
    for call in (lambda: kv_bytes(cfg, "f16", "q4_0", 512), lambda: pair_bytes_per_token(cfg, "f16", "q4_0"),
                 lambda: pair_plan("f16", "q4_0", 2, head_dim=48)):
        with pytest.raises(KvcalError, match=r"^V cache type q4_0 with block size 32 does not divide head_dim=48 "):
            call()
    # f16/f16: 2 layers x (48 x 2 bytes) x 2 sides per token, hand-counted
    assert pair_bytes_per_token(cfg, "f16", "f16") == 2 * 2 * 48 * 2


def _gemma3_like(**kw):
    from transformers import Gemma3TextConfig

    # Gemma 3 270M's cache shape: 18 layers (every 6th full attention: 5, 11, 17), 1 KV head, head_dim 256, window 512
    return Gemma3TextConfig(num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                            hidden_size=640, sliding_window=512, **kw)


def test_kv_bytes_iswa_by_hand():
    """llama.cpp's iSWA cache (src/llama-kv-cache-iswa.cpp): the 3 full-attention layers in n_ctx_seq cells, the 15
    sliding ones in PAD(min(size, n_swa * (unified ? n_seq : 1) + n_ubatch), 256) cells, or the full size with
    swa_full; a q8_0 row of 256 values is 8 blocks x 34 B = 272 B. Worked by hand."""
    from kvcal.engines.llamacpp.plan import kv_bytes, kv_memory

    cfg = _gemma3_like()
    b = kv_bytes(cfg, "q8_0", "q8_0", 4096)  # llama-server defaults: -ub 512, no --swa-full
    assert (b.n_layers, b.kv_size, b.swa.n_layers, b.swa.kv_size) == (3, 4096, 15, 1024)  # min(4096, 512 + 512)
    assert b.k_bytes == 3 * 272 * 4096 and b.swa.k_bytes == 15 * 272 * 1024
    assert b.total == 2 * (3 * 272 * 4096 + 15 * 272 * 1024) == 15_040_512
    assert b.log_lines() == [
        "llama_kv_cache: size =    6.38 MiB (  4096 cells,   3 layers,  1/1 seqs), K (q8_0):    3.19 MiB, V (q8_0):    3.19 MiB",
        "llama_kv_cache: size =    7.97 MiB (  1024 cells,  15 layers,  1/1 seqs), K (q8_0):    3.98 MiB, V (q8_0):    3.98 MiB"]
    # 32k: the sliding cache stays at 1024 cells
    assert kv_bytes(cfg, "q8_0", "q8_0", 32768).total == 2 * (3 * 272 * 32768 + 15 * 272 * 1024)
    # llama-cpp-python (swa_full true) at 512 with -ub 512: the line llama.cpp logged serving Gemma 3 (docs/results.md)
    s = kv_bytes(cfg, "q8_0", "q8_0", 512, n_ubatch=512, swa_full=True)
    assert s.log_lines()[1] == ("llama_kv_cache: size =    3.98 MiB (   512 cells,  15 layers,  1/1 seqs), "
                                "K (q8_0):    1.99 MiB, V (q8_0):    1.99 MiB")
    # 4 sequences: per stream PAD(8192 / 4, 256) = 2048 cells, sliding min(2048, 512 + 512) = 1024;
    # unified: 8192 cells in one stream, sliding PAD(min(8192, 512 * 4 + 512), 256) = 2560
    p = kv_bytes(cfg, "q8_0", "q4_0", 8192, 4)
    assert (p.kv_size, p.n_stream, p.swa.kv_size) == (2048, 4, 1024)
    assert p.v_total == 4 * (3 * 144 * 2048 + 15 * 144 * 1024)  # q4_0 row: 8 x 18 B
    u = kv_bytes(cfg, "q8_0", "q8_0", 8192, 4, unified=True)
    assert (u.kv_size, u.n_stream, u.swa.kv_size) == (8192, 1, 2560)
    m = kv_memory(cfg, "q8_0", 4096)
    assert (m["total"], m["k_bytes"], m["cells"], m["swa_cells"]) == (15_040_512, 7_520_256, 4096, 1024)
    assert m["log_line"].splitlines() == b.log_lines()


def test_kv_bytes_refuses_all_sliding_models():
    from kvcal.engines.llamacpp.plan import kv_bytes

    with pytest.raises(KvcalError, match="18 of 18 layers sliding"):
        kv_bytes(_gemma3_like(layer_types=["sliding_attention"] * 18), "q8_0", "q8_0", 4096)


# -- the order llama.cpp holds a query/key head in (llama GGUFs) ---------------------------------------------------

def _converter_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """``LlamaModel.permute`` of llama.cpp's ``conversion/llama.py``, restated: the rows of a q/k projection as the
    GGUF stores them (so that llama.cpp's "normal" RoPE on consecutive pairs equals the checkpoint's rotate-half)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope(x: np.ndarray, pos: int, interleaved: bool) -> np.ndarray:
    """float64 RoPE of one head ``[D]`` at ``pos`` (base 10000): pairs ``(2i, 2i+1)`` (ggml's NORM mode) or
    ``(i, i + D/2)`` (transformers' rotate-half), angle ``pos · 10000^(-2i/D)``."""
    D = x.shape[-1]
    ang = pos * 10000.0 ** (-2 * np.arange(D // 2) / D)
    c, s = np.cos(ang), np.sin(ang)
    a, b = (x[0::2], x[1::2]) if interleaved else (x[:D // 2], x[D // 2:])
    ra, rb = a * c - b * s, a * s + b * c
    out = np.empty_like(x)
    if interleaved:
        out[0::2], out[1::2] = ra, rb
    else:
        out[:D // 2], out[D // 2:] = ra, rb
    return out


def test_kq_interleaved_is_the_converters_order():
    """The permutation the plan applies for a llama GGUF is the one llama.cpp's converter writes: a key head
    projected with the permuted weight and roped in NORM mode equals the checkpoint's rotate-half-roped head put in
    the plan's GGUF order (float64, both sides exact up to rounding of the same products: tolerance 1e-12 on
    values of order 10)."""
    from kvcal.engines.llamacpp.plan import _from_gguf_order, _to_gguf_order

    rng = np.random.default_rng(0)
    n_kv, D, hidden = 3, 64, 32
    w = rng.standard_normal((n_kv * D, hidden))
    x = rng.standard_normal(hidden)
    k_model = (w @ x).reshape(n_kv, D)
    k_gguf = (_converter_permute(w, n_kv) @ x).reshape(n_kv, D)
    for h in range(n_kv):
        want = _rope(k_gguf[h], 7, interleaved=True)
        got = _to_gguf_order(torch.from_numpy(_rope(k_model[h], 7, interleaved=False))).numpy()
        assert np.abs(got - want).max() <= 1e-12
    t = torch.from_numpy(k_model)
    assert torch.equal(_from_gguf_order(_to_gguf_order(t)), t)


def test_kq_interleaved_quantizes_the_gguf_blocks():
    """With ``kq_interleaved`` a key head is quantized in llama.cpp's blocks: for the head ``x_m = m`` (m = 0..63,
    no rotation, q8_0 reference path) block 0 holds model elements 0..15 and 32..47 (amax 47), block 1 holds 16..31
    and 48..63 (amax 63) — each element's value is ``fp16(amax/127) · round(m · 127/amax)``, written out here in
    float32 as ``quantize_row_q8_0_ref``. The model's own blocks (0..31, 32..63) give other values; the query
    (q8_0 for q4_0 keys) follows the same order; values are never permuted."""
    x = torch.arange(64, dtype=torch.float32).reshape(1, 1, 1, 64)
    plan = LlamaCppKVPlan("q8_0", "q8_0", 1, rotation=False, impl="ref", kq_interleaved=True)
    want = np.empty(64)
    for m in range(64):
        amax = np.float32(47 if m % 32 < 16 else 63)
        d = np.float32(amax / np.float32(127))
        idm = np.float32(np.float32(1) / d)
        want[m] = np.float64(np.float16(d)) * np.round(np.float32(np.float32(m) * idm))
    got = plan.fake_quant(0, "k", x).reshape(64).double().numpy()
    assert np.array_equal(got, want)
    plain = LlamaCppKVPlan("q8_0", "q8_0", 1, rotation=False, impl="ref").fake_quant(0, "k", x)
    assert not torch.equal(plain, plan.fake_quant(0, "k", x))
    plain_v = LlamaCppKVPlan("q8_0", "q8_0", 1, rotation=False, impl="ref").fake_quant(0, "v", x)
    assert torch.equal(plan.fake_quant(0, "v", x), plain_v)
    q_plan = LlamaCppKVPlan("q4_0", "q4_0", 1, rotation=False, impl="ref", kq_interleaved=True)
    assert np.array_equal(q_plan.fake_quant_query(0, x).reshape(64).double().numpy(), want)


def test_kq_interleaved_with_rotation_equals_gguf_py_in_gguf_order():
    """Rotation on, q4_0 keys (the engine's path): the plan's key equals, in the model's order, ``H · q4_0(H ·
    k_gguf)`` computed from the GGUF-ordered head with gguf-py's q4_0 and a float64 Sylvester ``H``. Inputs on a
    1/64 grid keep ``H·k`` exact in both, so every code is identical; what remains is the plan's f32
    back-rotation, bounded elementwise by 6·2^-24·Σ|x̂|/8 as in the one-layer test above."""
    from kvcal.engines.llamacpp.plan import _from_gguf_order, _to_gguf_order

    k = (torch.randn(1, 3, 5, 64, generator=torch.Generator().manual_seed(3)) * 64).round() / 64
    plan = LlamaCppKVPlan("q4_0", "q8_0", 1, rotation=True, kq_interleaved=True)
    h = sylvester(64)
    kg = _to_gguf_order(k).double().numpy()
    ref_g = _gguf_q4_0(np.einsum("ij,...j->...i", h, kg))
    back = np.einsum("ij,...j->...i", h, ref_g)
    want = _from_gguf_order(torch.from_numpy(back)).numpy()
    tol = 6 * 2**-24 * np.abs(ref_g).sum(-1, keepdims=True) / 8
    got = plan.fake_quant(0, "k", k).double().numpy()
    assert (np.abs(got - want) <= tol).all()
    # the model's own order quantizes other blocks: a difference far above that bound
    other = LlamaCppKVPlan("q4_0", "q8_0", 1, rotation=True).fake_quant(0, "k", k).double().numpy()
    assert np.abs(other - want).max() > 100 * tol.max()


def test_kq_interleaved_follows_the_architecture():
    """llama GGUFs (and llama/mistral/mixtral checkpoints, which the converter writes as llama) are interleaved;
    Gemma 3 keeps the model's order; a checkpoint whose conversion kvcal has not read is refused, not guessed;
    ``pair_plan`` passes it on."""
    from kvcal.engines.llamacpp.plan import kq_interleaved, pair_plan

    assert kq_interleaved("llama") and kq_interleaved(model_type="mistral") and kq_interleaved(model_type="llama")
    assert not kq_interleaved("gemma3") and not kq_interleaved(model_type="gemma3_text") and not kq_interleaved()
    with pytest.raises(KvcalError, match="model_type 'granite': .*pass the .gguf that llama.cpp serves"):
        kq_interleaved(model_type="granite")
    with pytest.raises(KvcalError, match="model_type 'granite'"):
        pair_plan("q8_0", "q8_0", 2, model_type="granite")
    assert pair_plan("q4_0", "q4_0", 2, architecture="llama").kq_interleaved
    assert not pair_plan("q4_0", "q4_0", 2, architecture="gemma3").kq_interleaved
    assert pair_plan("q4_0", "q4_0", 2, architecture="llama").describe()["kq_interleaved"] is True


@pytest.mark.parametrize("arch", sorted(set(GGUF_CONFIG_MAPPING) - {"general", "tokenizer"}))
def test_kq_interleaved_is_what_transformers_gguf_loader_undoes(arch):
    """For every GGUF architecture transformers loads (the model kvcal runs from a .gguf), kvcal calls the heads
    interleaved exactly when transformers' tensor processor reorders ``attn_q``/``attn_k`` rows while loading
    (run here on a [2 heads x 8, 3] weight of distinct integers; the same rows come back in the same order when it
    does not); a transformers upgrade that changes this fails here."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    from kvcal.engines.llamacpp.plan import kq_interleaved

    proc = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config={"num_attention_heads": 2, "num_key_value_heads": 2})
    w = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    reordered = []
    for name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight"):
        got = proc.process(w.copy(), name).weights
        reordered.append(got.shape == w.shape and not np.array_equal(got, w))
    assert reordered[0] == reordered[1] == kq_interleaved(arch)
