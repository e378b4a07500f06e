"""What serving K and V with one scale per layer costs, and what SGLang's unclipped default costs: a probe on
the committed SmolLM2 example (issue 22, "Single-scale exports hide a quality cost" / "SGLang serving line").

Four variants of ``artifacts/smollm2-135m-fp8``, each written as an artifact and measured with
:func:`kvcal.evaluate.evaluate` (Protocol A, teacher-forced, every K/V read quantized; paired: same model,
windows and tokens): the separate K/V scales as calibrated (what ``--target vllm --clipped-scales`` serves),
the same unclipped to at least the calibration max / 448 (``--target vllm`` default, SGLang-safe),
``max(K, V)`` per layer as calibrated (``sglang-json`` / ``trtllm-legacy --clipped-scales``) and ``max(K, V)``
of the unclipped scales (``sglang-json`` default). kvcal's FP8 fake-quantization saturates, so the clipped
rows are what a saturating engine (vLLM, TensorRT-LLM) computes; in SGLang their clipped values become NaN.

    HF_HUB_OFFLINE=1 .venv/bin/python diagnostics/probe_shared_scale.py --out bench_out/shared_scale  # ~40 min here
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvcal.artifact import load_artifact, write_artifact
from kvcal.evaluate import EvalConfig, evaluate
from kvcal.models import load_model, load_tokenizer
from kvcal.plan import tensor_name


def variants(src) -> dict[str, dict[str, torch.Tensor]]:
    """name -> tensors of the four variants (module docstring)."""
    n, meta = src.num_layers, src.metadata
    t = dict(src.tensors)
    unc = dict(t)
    for i in range(n):
        for side in "kv":
            amax = max(meta["layers"][i][side]["amax"])
            unc[tensor_name(i, side)] = torch.maximum(t[tensor_name(i, side)], torch.tensor([amax / 448]))

    def tied(x):
        out = dict(x)
        for i in range(n):
            s = torch.maximum(x[tensor_name(i, "k")], x[tensor_name(i, "v")])
            out[tensor_name(i, "k")], out[tensor_name(i, "v")] = s.clone(), s.clone()
        return out

    return {"separate": t, "separate_unclipped": unc, "maxKV": tied(t), "maxKV_unclipped": tied(unc)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", default="artifacts/smollm2-135m-fp8")
    ap.add_argument("--corpus", default="../shared/data/wikitext2_valid.txt")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--out", default="bench_out/shared_scale")
    a = ap.parse_args()
    src = load_artifact(a.artifact)
    meta = {k: v for k, v in src.metadata.items() if k not in ("content_sha256", "tensor_names")}
    tok, model = load_tokenizer(None), load_model(None)
    out, rows = Path(a.out), {}
    for name, t in variants(src).items():
        d = out / name
        if not d.exists():
            write_artifact(d, t, meta)
        cfg = EvalConfig(artifact=str(d), corpus=a.corpus, contexts=(a.context,), windows=a.windows, baselines=False,
                         modes=("teacher_forced",), greedy_tokens=0, decode_tokens=1, per_layer_tokens=0)
        doc = evaluate(cfg, model=model, tokenizer=tok, progress=False, log=lambda *x, **k: None)
        r = next(r for r in doc["results"] if r["method"] == "artifact")
        rows[name] = r
        print(f"{name:20s} KL {r['kl_mean']:.3e}  p99.9 {r['kl_p999']:.4f}  dPPL {r['delta_ppl']:+.4f}  "
              f"top-1 {r['top1_agree']:.4f}  ({r['tokens']} tokens)", flush=True)
    (out / "probe_shared_scale.json").write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
