"""One attention layer of llama.cpp against kvcal's emulation of it, tensor by tensor (not part of CI).

Served-vs-predicted KLs compare two chaotic end-to-end runs: a cache rounding that flips in one run moves every
later activation, so per-window KLs differ by +-10% even when the emulation is exact, and an emulation error hides
in that noise. This check takes llama.cpp's own tensors instead (``kvcal/engines/llamacpp/layer_runner.py``, run in
llama-cpp-python's venv, captures layer L's post-RoPE ``Qcur``/``Kcur``/``Vcur``, the query flash attention read, the
K/V cache bytes and the flash-attention output) and asks, for each ``-ctk/-ctv`` pair:

1. **order**: does kvcal's model (the GGUF's weights, matmul inputs rounded as llama.cpp rounds them) compute the
   same key/query heads, in the order of :func:`kvcal.engines.llamacpp.plan.kq_interleaved`? (relative error, with
   and without the permutation);
2. **cache write**: do kvcal's rotation and block quantizer, applied to llama.cpp's own ``Kcur``/``Vcur``, give the
   values llama.cpp's cache holds (its bytes dequantized by gguf-py)? (count of differing elements: 0 = bit-exact);
3. **query**: does kvcal's rotation give the query flash attention read? (max abs difference, after the scale a
   model applies to the query before attention, ``q_fa_scale``: 1 for Llama, 1/16 for Gemma 3 270M);
4. **attention**: does the plan's attention (its query conversion, K/V cache, float64 softmax and sums) on
   llama.cpp's inputs give llama.cpp's flash-attention output (rotated back)? (max abs difference / max |output|;
   ``cache_effect_rel``: the same figure for unquantized attention, i.e. what the cache moves the output by).

    HF_HUB_OFFLINE=1 PYTHONPATH=. .venv/bin/python diagnostics/llamacpp_layer_check.py \\
        --engine-python .venv-llamacpp/bin/python --model smollm2-135m --pairs q4_0/q4_0,q8_0/f16 --layer 0
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch


def run_layer(engine_python: str, gguf: Path, tokens: list[int], type_k: str, type_v: str, layer: int,
              workdir: Path, threads: int = 2) -> dict:
    """Run the layer runner in ``engine_python``; its arrays as a dict. ``RuntimeError`` with its refusal."""
    from kvcal.engines import engine

    req, out = workdir / f"req-{type_k}-{type_v}.json", workdir / f"layer-{type_k}-{type_v}.npz"
    req.write_text(json.dumps({"gguf": str(gguf), "tokens": tokens, "type_k": type_k, "type_v": type_v,
                               "layer": layer, "threads": threads}))
    r = subprocess.run([engine_python, str(engine("llamacpp").LAYER_RUNNER), str(req), str(out)],
                       capture_output=True, text=True)
    err = Path(str(out) + ".json")
    if r.returncode or not out.exists():
        why = json.loads(err.read_text())["error"] if err.exists() else (r.stderr.strip().splitlines() or ["?"])[-1]
        raise RuntimeError(f"layer runner -ctk {type_k} -ctv {type_v}: {why}")
    with np.load(out) as z:
        return {k: z[k] for k in z.files}


def cache_values(rows: np.ndarray, type_id: int, D: int) -> np.ndarray:
    """gguf-py's dequantization of cache rows uint8 ``[T, H, row_bytes]`` -> float32 ``[T, H, D]``."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    T, H, _ = rows.shape
    return dequantize(rows.reshape(T * H, -1), GGMLQuantizationType(int(type_id))).reshape(T, H, D)


def kvcal_side(plan, layer: int, x: torch.Tensor, side: str) -> torch.Tensor:
    """What the plan writes for ``x`` ``[T, H, D]`` in llama.cpp's order, rotated as stored (no back-rotation)."""
    from kvcal.engines.llamacpp.quants import fake_quant
    from kvcal.engines.llamacpp.rotation import ggml_fwht

    t = plan.k_type if side == "k" else plan.v_type
    n = plan._rot(side, x.shape[-1])
    return fake_quant(ggml_fwht(x, n) if n else x, t.name, plan.impl)


def attention64(q, k, v, n_rep: int) -> np.ndarray:
    """Causal softmax attention in float64: q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` -> ``[T, Hq, D]``."""
    T, Hq, D = q.shape
    kk, vv = np.repeat(k, n_rep, axis=1), np.repeat(v, n_rep, axis=1)
    s = np.einsum("thd,shd->hts", q, kk) / np.sqrt(D)
    s = s + np.triu(np.full((T, T), -np.inf), 1)[None]
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hts,shd->thd", p, vv)


def check_pair(model, arch: str, gguf: Path, tokens: list[int], pair: tuple[str, str], layer: int, engine_python: str,
               workdir: Path, mine: dict) -> dict:
    from kvcal.engines.llamacpp.plan import _from_gguf_order, _to_gguf_order, pair_plan
    from kvcal.engines.llamacpp.rotation import ggml_fwht

    L = model.config.num_hidden_layers
    plan = pair_plan(pair[0], pair[1], L, architecture=arch)
    got = run_layer(engine_python, gguf, tokens, pair[0], pair[1], layer, workdir)
    ql, kl, vl = (torch.from_numpy(got[n]) for n in ("q", "k", "v"))  # [T, H, D], llama.cpp's order
    T, Hkv, D = kl.shape
    out = {"pair": "/".join(pair), "kq_interleaved": plan.kq_interleaved}
    # 1. order: kvcal's own post-RoPE heads vs llama.cpp's
    km, qm = mine["k"], mine["q"]  # [T, H, D] model order

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max())

    out["k_rel_err_gguf_order"] = rel(_to_gguf_order(km), kl)
    out["k_rel_err_model_order"] = rel(km, kl)
    out["q_rel_err_gguf_order"] = rel(_to_gguf_order(qm), ql)
    # 2. cache write, on llama.cpp's own Kcur/Vcur
    for side, x in (("k", kl), ("v", vl)):
        want = cache_values(got[f"{side}_cache"], got[f"{side}_type"], D)
        mine_c = kvcal_side(plan, layer, x, side).numpy()
        out[f"{side}_cache_mismatches"] = int((mine_c != want).sum())
        out[f"{side}_cache_elements"] = int(want.size)
    # 3. the query flash attention read
    n = plan._rot("k", D)
    qr, qfa = (ggml_fwht(ql, n) if n else ql), torch.from_numpy(got["q_fa"]).transpose(0, 1)
    # a model that scales the query after RoPE (Gemma: 1/sqrt(query_pre_attn_scalar), kq_scale 1) hands flash
    # attention the scaled query: the scale is read off, then the rest must be exact
    big = qr.abs() > 1e-3 * qr.abs().max()
    scale = float((qfa[big] / qr[big]).median())
    out["q_fa_scale"] = scale
    out["q_fa_max_abs_diff"] = float((qr * scale - qfa).abs().max())
    # 4. attention output on llama.cpp's inputs, in the model's basis
    to_m = _from_gguf_order if plan.kq_interleaved else (lambda t: t)
    qh = plan.fake_quant_query(layer, to_m(ql).permute(1, 0, 2)[None]).double()[0].permute(1, 0, 2)
    kh = plan.fake_quant(layer, "k", to_m(kl).permute(1, 0, 2)[None]).double()[0].permute(1, 0, 2)
    vh = plan.fake_quant(layer, "v", vl.permute(1, 0, 2)[None]).double()[0].permute(1, 0, 2)
    mine_o = attention64(qh.numpy(), kh.numpy(), vh.numpy(), ql.shape[1] // Hkv)
    fa = torch.from_numpy(got["kqv_out"].reshape(T, -1, D))
    nv = plan._rot("v", D)
    fa_m = (ggml_fwht(fa, nv) if nv else fa).double().numpy()
    out["attn_rel_err"] = float(np.abs(mine_o - fa_m).max() / np.abs(fa_m).max())
    # what the cache itself moves the output by (same inputs, no quantization): the scale attn_rel_err is read on
    ref_o = attention64(to_m(ql).double().numpy(), to_m(kl).double().numpy(), vl.double().numpy(), ql.shape[1] // Hkv)
    out["cache_effect_rel"] = float(np.abs(ref_o - fa_m).max() / np.abs(fa_m).max())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine-python", required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--corpus", default=str(Path(__file__).resolve().parents[1].parent / "shared/data/wikitext2_valid.txt"))
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--pairs", default="q4_0/q4_0,q8_0/q8_0,q4_1/q5_1,iq4_nl/q5_0,f16/q4_0,q8_0/f16")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    from kvcal.capture.hooks import capture_kv
    from kvcal.engines import engine
    from kvcal.evaluate.windows import corpus_stream, cut_windows, served_bos
    from kvcal.models import load_model, load_tokenizer
    from kvcal.models.gguf import gguf_architecture, gguf_tensor_types
    from kvcal.verify.pairs import _gguf

    src, gguf = _gguf(a.model)
    arch = gguf_architecture(gguf)
    tok = load_tokenizer(src)
    ids, _ = corpus_stream(a.corpus, tok)
    tokens = cut_windows(ids, a.context, 1, bos=served_bos(tok))[0].tolist()
    model = load_model(src)
    eng = engine("llamacpp")
    mine = {}
    with eng.MatmulInputs(model, eng.gguf_matmul_inputs(gguf_tensor_types(gguf))), torch.no_grad(), capture_kv(
            model, lambda i, q, k, v, m: mine.update(q=q[0].permute(1, 0, 2).float(), k=k[0].permute(1, 0, 2).float())
            if i == a.layer else None):
        model(torch.tensor([tokens]), use_cache=False)
    rows = []
    with tempfile.TemporaryDirectory() as td:
        for p in a.pairs.split(","):
            r = check_pair(model, arch, gguf, tokens, tuple(p.split("/")), a.layer, a.engine_python, Path(td), mine)
            rows.append(r)
            print(json.dumps(r), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"model": a.model, "architecture": arch, "layer": a.layer,
                                            "context": a.context, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
