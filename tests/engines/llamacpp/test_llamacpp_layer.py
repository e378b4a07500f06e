"""Engine tier: layer 0 of the embedded model as llama.cpp runs it (``layer_runner.py`` in llama-cpp-python's own
venv) against kvcal's emulation, tensor by tensor — no end-to-end KL, so no chaotic noise to hide an error in.
Skips without a llama-cpp-python interpreter (``make llamacpp-venv`` or ``KVCAL_LLAMACPP_PYTHON``)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from test_llamacpp_verify import CORPUS, engine_python

from kvcal.engines import engine
from kvcal.engines.llamacpp.plan import _from_gguf_order, _to_gguf_order, pair_plan
from kvcal.engines.llamacpp.quants import fake_quant, quantize
from kvcal.engines.llamacpp.rotation import ggml_fwht

T = 64  # tokens: one ubatch, one block of flash-attention rows


@pytest.fixture(scope="module")
def layer0(tmp_path_factory):
    """kvcal's layer-0 post-RoPE q/k ``[T, H, D]`` of the embedded GGUF (matmul inputs rounded as llama.cpp rounds
    them), the GGUF path, its architecture and the token window."""
    from kvcal.capture.hooks import capture_kv
    from kvcal.evaluate.windows import corpus_stream, cut_windows, served_bos
    from kvcal.models import load_model, load_tokenizer
    from kvcal.models.gguf import gguf_architecture, gguf_tensor_types
    from kvcal.verify.pairs import _gguf

    py = engine_python()
    if py is None:
        pytest.skip("no llama-cpp-python interpreter: set KVCAL_LLAMACPP_PYTHON or run `make llamacpp-venv`")
    src, gguf = _gguf("smollm2-135m")
    tok = load_tokenizer(src)
    ids, _ = corpus_stream(str(CORPUS), tok)
    tokens = cut_windows(ids, T, 1, bos=served_bos(tok))[0].tolist()
    model = load_model(src)
    eng = engine("llamacpp")
    mine = {}
    with eng.MatmulInputs(model, eng.gguf_matmul_inputs(gguf_tensor_types(gguf))), torch.no_grad(), capture_kv(
            model, lambda i, q, k, v, m: mine.update(q=q[0].transpose(0, 1).float(), k=k[0].transpose(0, 1).float())
            if i == 0 else None):
        model(torch.tensor([tokens]), use_cache=False)
    return {"py": py, "gguf": gguf, "arch": gguf_architecture(gguf), "tokens": tokens, "L": model.config.num_hidden_layers,
            "dir": tmp_path_factory.mktemp("layer"), **mine}


def _served_layer(ctx, type_k, type_v) -> dict:
    req, out = ctx["dir"] / f"{type_k}-{type_v}.json", ctx["dir"] / f"{type_k}-{type_v}.npz"
    req.write_text(json.dumps({"gguf": str(ctx["gguf"]), "tokens": ctx["tokens"], "type_k": type_k, "type_v": type_v,
                               "layer": 0, "threads": 2}))
    r = subprocess.run([ctx["py"], str(engine("llamacpp").LAYER_RUNNER), str(req), str(out)], capture_output=True,
                       text=True, timeout=600)
    err = Path(str(out) + ".json")
    assert r.returncode == 0, err.read_text() if err.exists() else r.stderr[-2000:]
    with np.load(out) as z:
        return {k: z[k] for k in z.files}


@pytest.mark.engine
@pytest.mark.parametrize("type_k,type_v", [("q4_0", "q4_0"), ("q4_1", "q5_1"), ("iq4_nl", "q8_0"), ("q5_0", "q4_1")])
def test_layer0_as_llamacpp_runs_it(layer0, type_k, type_v):
    """(1) llama.cpp holds each key/query head in the GGUF's interleaved order: kvcal's head put in that order
    matches llama.cpp's ``Kcur``/``Qcur`` within the two implementations' activation roundings (a q8_1 input code
    that flips moves a product by one step, amax/127 of its block: relative differences of order 1e-3; bound 2e-2),
    while the model's own order is off by O(1) (the permutation moves other elements into place). (2) kvcal's
    rotation and block quantizer on llama.cpp's own ``Kcur``/``Vcur`` give exactly the values its cache holds
    (bytes dequantized by gguf-py): both are the same f32 operations. (3) The query flash attention read is
    kvcal's rotation of ``Qcur``, exactly. (4) The plan's attention on llama.cpp's inputs — query conversion,
    dequantized cache, softmax and sums in float64 — equals llama.cpp's flash-attention output rotated back, to
    float32 accumulation (online softmax and 64 f32 sums over <= 64 keys: relative 64·2^-23 ≈ 7.6e-6; bound 1e-5)."""
    ctx = layer0
    plan = pair_plan(type_k, type_v, ctx["L"], architecture=ctx["arch"])
    assert plan.kq_interleaved  # a llama GGUF
    got = _served_layer(ctx, type_k, type_v)
    ql, kl, vl = (torch.from_numpy(got[n]) for n in ("q", "k", "v"))  # [T, H, D], llama.cpp's order
    D, Hkv = kl.shape[-1], kl.shape[1]

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max())

    assert rel(_to_gguf_order(ctx["k"]), kl) < 2e-2 and rel(_to_gguf_order(ctx["q"]), ql) < 2e-2
    assert rel(ctx["k"], kl) > 0.3
    for side, x, t in (("k", kl, plan.k_type), ("v", vl, plan.v_type)):
        rows = got[f"{side}_cache"]
        want = gguf_dequantize(rows.reshape(T * Hkv, -1), GGMLQuantizationType(int(got[f"{side}_type"])))
        assert int(got[f"{side}_type"]) == GGMLQuantizationType[t.name.upper()].value
        mine = fake_quant(ggml_fwht(x, plan._rot(side, D)), t.name, plan.impl).numpy().reshape(T * Hkv, D)
        assert np.array_equal(mine, want), f"{side}: {(mine != want).sum()} of {mine.size} values differ"
    assert torch.equal(ggml_fwht(ql, plan._rot("k", D)), torch.from_numpy(got["q_fa"]).transpose(0, 1))
    qh = plan.fake_quant_query(0, _from_gguf_order(ql).transpose(0, 1)[None]).double()[0].transpose(0, 1).numpy()
    kh = plan.fake_quant(0, "k", _from_gguf_order(kl).transpose(0, 1)[None]).double()[0].transpose(0, 1).numpy()
    vh = plan.fake_quant(0, "v", vl.transpose(0, 1)[None]).double()[0].transpose(0, 1).numpy()
    n_rep = ql.shape[1] // Hkv
    kk, vv = np.repeat(kh, n_rep, axis=1), np.repeat(vh, n_rep, axis=1)
    s = np.einsum("thd,shd->hts", qh, kk) / np.sqrt(D) + np.triu(np.full((T, T), -np.inf), 1)[None]
    p = np.exp(s - s.max(-1, keepdims=True))
    mine_o = np.einsum("hts,shd->thd", p / p.sum(-1, keepdims=True), vv)
    fa = torch.from_numpy(got["kqv_out"].reshape(T, -1, D))
    served_o = ggml_fwht(fa, plan._rot("v", D)).double().numpy()
    bound = 1e-5 * np.abs(served_o).max()
    if plan.k_type.vec_dot_type == "q8_1":
        # q4_1/q5_1 keys: the engine's score adds m_k · s_q with s_q = fp16(d_f32 · Σ codes) (quantize_row_q8_1),
        # the plan's dot product m_k · fp16(d)·Σ codes: per block at most 2^-10 · |m_k · s_q| apart (two fp16
        # roundings, each <= 2^-11 relative), times the softmax scale; softmax moves each output by at most
        # 2 · max|Δscore| · max|v| (first order)
        kb = quantize(ggml_fwht(kl, plan._rot("k", D)), plan.k_type.name)
        qb = quantize(ggml_fwht(ql, plan._rot("k", D)), "q8_1")
        m_k = kb.m.double().abs().numpy()  # [T, Hkv, nb]
        s_q = qb.s.double().abs().numpy()  # [T, H, nb]
        ds = 2.0**-10 * np.einsum("thb,shb->hts", s_q, np.repeat(m_k, n_rep, axis=1)).max() / np.sqrt(D)
        bound += 2 * ds * np.abs(vh).max()
    assert np.abs(mine_o - served_o).max() <= bound


@pytest.mark.engine
@pytest.mark.parametrize("type_k", ["q8_0", "q4_0"])
def test_layer0_f16_values_accumulate_in_fp16(layer0, type_k):
    """An ``f16`` V cache with a quantized K: llama.cpp's kernel accumulates ``P · V`` in fp16, rounding the
    accumulator at every key. The plan's own attention (``own_attention``) replays those roundings; the f32
    attention does not. Each of the f32 attention's differences is the sum of every step's rounding (rms about
    sqrt(n)·2^-11/sqrt(3) of the accumulator over n keys); the emulation differs only where a float32-level
    difference in a score or an exp (about 1e-7 relative, against an fp16 step of 2^-10) moves one rounding,
    a few in 10^4 steps: its rms difference is far below, bound here at a quarter of the f32 attention's (the
    ratio expected is about 2·sqrt(1e-7/2^-10), 0.02); its largest difference at one fp16 step of the output."""
    ctx = layer0
    plan = pair_plan(type_k, "f16", ctx["L"], architecture=ctx["arch"])
    assert plan.own_attention()
    got = _served_layer(ctx, type_k, "f16")
    ql, kl, vl = (torch.from_numpy(got[n]) for n in ("q", "k", "v"))  # [T, H, D], llama.cpp's order
    D = kl.shape[-1]
    q = plan.fake_quant_query(0, _from_gguf_order(ql).transpose(0, 1)[None])
    k = plan.fake_quant(0, "k", _from_gguf_order(kl).transpose(0, 1)[None])
    v = plan.fake_quant(0, "v", vl.transpose(0, 1)[None])
    served = torch.from_numpy(got["kqv_out"].reshape(T, -1, D)).double()  # [T, H_q, D]; f16 V is not rotated

    class _Mod:
        scaling = D**-0.5

    emul = plan.attention(_Mod(), q, k, v, None, {})[0].double()  # [T, H_q, D]
    n_rep = q.shape[1] // k.shape[1]
    f32 = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(n_rep, 1), v.double().repeat_interleave(n_rep, 1), is_causal=True,
        scale=D**-0.5)[0].transpose(0, 1)

    def rms(a):
        return float(a.pow(2).mean().sqrt())

    e_emul, e_f32 = rms(emul - served), rms(f32 - served)
    assert e_f32 > 0 and e_emul <= 0.25 * e_f32, (e_emul, e_f32)
    assert float((emul - served).abs().max()) <= 2.0**-10 * float(served.abs().max())
