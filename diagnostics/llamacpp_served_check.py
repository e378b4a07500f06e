"""Served = predicted for llama.cpp's quantized KV cache, on the embedded model (not part of CI).

Question: does kvcal's emulation (``kvcal.engines.llamacpp.LlamaCppKVPlan``) predict the KL that llama.cpp itself
shows when its cache is quantized? For each ``-ctk/-ctv`` pair, llama-cpp-python (its own venv, built from the
0.3.36 sdist: ``/work/llama-venv``) runs teacher-forced windows with ``flash_attn`` on and ``logits_all``, and the
mean KL of its next-token distributions against its own ``f16``/``f16`` run is compared with kvcal's Protocol A KL
of the same pair against the unquantized model on the same token ids. The two references differ (llama.cpp
multiplies Q4_1 weights with q8_1-quantized activations; kvcal runs dequantized float32 weights), so the
comparison is of KLs, not of logits.

    HF_HUB_OFFLINE=1 PYTHONPATH=. .venv/bin/python diagnostics/llamacpp_served_check.py \
        --engine-python /work/llama-venv/bin/python --windows 2 --context 512 --pairs q8_0/q8_0,q4_0/q4_0
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

# GGML type ids (ggml.h enum ggml_type)
GGML_IDS = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "iq4_nl": 20, "bf16": 30}

RUNNER = r'''
import json, sys
import numpy as np
from llama_cpp import Llama
args = json.loads(sys.argv[1])
ids = np.load(args["ids"])
out = {}
def run(tk, tv):
    llm = Llama(model_path=args["gguf"], n_ctx=ids.shape[1], n_batch=ids.shape[1], n_ubatch=ids.shape[1],
                logits_all=True, flash_attn=True, type_k=tk, type_v=tv, n_threads=args["threads"], verbose=False,
                seed=0)
    res = []
    for w in ids:
        llm.reset()
        llm.eval(w.tolist())
        s = np.asarray(llm.scores[: len(w) - 1], dtype=np.float64)
        s = s - s.max(-1, keepdims=True)
        res.append(s - np.log(np.exp(s).sum(-1, keepdims=True)))
    del llm
    return res
ref = run(args["types"]["f16"], args["types"]["f16"])
for pair in args["pairs"]:
    k, v = pair.split("/")
    got = run(args["types"][k], args["types"][v])
    kl = [float((np.exp(r) * (r - g)).sum(-1).mean()) for r, g in zip(ref, got)]
    out[pair] = kl
print(json.dumps(out))
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine-python", default="/work/llama-venv/bin/python")
    ap.add_argument("--corpus", default=str(Path(__file__).resolve().parents[2] / "shared/data/wikitext2_valid.txt"))
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--pairs", default="q8_0/q8_0,q4_0/q4_0,q4_0/f16,f16/q4_0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-rotation", action="store_true", help="also set LLAMA_ATTN_ROT_DISABLE=1 for the engine")
    a = ap.parse_args()

    from kvcal.engines.llamacpp import LlamaCppKVPlan
    from kvcal.evaluate.protocol_a import teacher_forced
    from kvcal.models import EMBEDDED_GGUF, embedded_model_dir
    from kvcal.models.load import load_model, load_tokenizer

    tok = load_tokenizer(None)
    text = Path(a.corpus).read_text(encoding="utf-8")
    ids = tok(text[: 400 * a.context * a.windows])["input_ids"]
    need = a.windows * a.context
    if len(ids) < need:
        print(f"corpus too short: {len(ids)} tokens < {need}", file=sys.stderr)
        return 2
    windows = torch.tensor(ids[:need], dtype=torch.int64).reshape(a.windows, a.context)
    pairs = [p.strip() for p in a.pairs.split(",") if p.strip()]

    gguf = str(embedded_model_dir() / EMBEDDED_GGUF)
    with tempfile.TemporaryDirectory() as tmp:
        np.save(Path(tmp) / "ids.npy", windows.numpy())
        env = None
        if a.no_rotation:
            import os
            env = {**os.environ, "LLAMA_ATTN_ROT_DISABLE": "1"}
        cfg = {"ids": str(Path(tmp) / "ids.npy"), "gguf": gguf, "threads": a.threads, "pairs": pairs,
               "types": GGML_IDS}
        r = subprocess.run([a.engine_python, "-c", RUNNER, json.dumps(cfg)], capture_output=True, text=True, env=env)
        if r.returncode:
            print(r.stderr[-3000:], file=sys.stderr)
            return 1
        served = json.loads(r.stdout.strip().splitlines()[-1])

    model = load_model(None)
    plans = {p: LlamaCppKVPlan(*p.split("/"), model.config.num_hidden_layers, rotation=not a.no_rotation)
             for p in pairs}
    pred = teacher_forced(model, windows, plans, progress=False)
    print(f"{'pair':>14} {'served KL':>11} {'predicted KL':>13} {'ratio':>7}   per-window served / predicted")
    for p in pairs:
        s, w = float(np.mean(served[p])), pred[p]["kl_mean"]
        pw = pred[p]["per_window"]["kl_mean"]
        print(f"{p:>14} {s:11.3e} {w:13.3e} {s / w if w else float('nan'):7.3f}   "
              + " ".join(f"{x:.2e}/{y:.2e}" for x, y in zip(served[p], pw, strict=True)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
