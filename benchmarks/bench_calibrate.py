"""Calibration time: kvcal FP8 vs one plain forward pass vs llm-compressor `oneshot`, one run.

Same model (embedded SmolLM2-135M, fp32), same 64 × 512 tokens (wikitext2_valid windows after the
first 8 × 1024 evaluation windows). Timed: only the calibration work, not model loading or
tokenization, for all three. Prints ratios against the plain forward measured in this process.

  .venv/bin/python benchmarks/bench_calibrate.py [--llmc-python /tmp/llmc/bin/python] [--samples 64]

llm-compressor is not a dependency: create its venv once with
  python3 -m venv /tmp/llmc && /tmp/llmc/bin/pip install torch==2.13.0 && /tmp/llmc/bin/pip install llmcompressor gguf
The script writes an HF checkpoint of the embedded model to bench_out/smollm2-hf (≈540 MB) for it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "wikitext2_valid.txt"


def hf_checkpoint(model, tok, out: Path) -> Path:
    """Plain HF checkpoint of the GGUF model (recipe from shared/docs/verified-facts.md)."""
    if (out / "config.json").exists():
        return out
    from transformers import LlamaForCausalLM

    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    plain = LlamaForCausalLM(cfg)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--llmc-python", default="/tmp/llmc/bin/python")
    args = ap.parse_args()

    from kvcal.artifact import write_artifact
    from kvcal.calibrate import CalibrateConfig
    from kvcal.capture.run import run_capture, split_heldout
    from kvcal.evaluate.windows import text_windows
    from kvcal.models import load_model, load_tokenizer
    from kvcal.search.fp8 import plan_from_choices, search_scales

    tok, model = load_tokenizer(None), load_model(None)
    ids = text_windows(tok, DATA.read_text(encoding="utf-8"), args.seq_len, args.samples, skip_windows=16)
    n, T = ids.shape
    print(f"data: {n} x {T} tokens of wikitext2_valid (after the first 8x1024 evaluation windows)")
    torch.set_num_threads(torch.get_num_threads())

    with torch.no_grad():
        t = time.perf_counter()
        for i in range(0, n, 8):
            model(ids[i : i + 8], use_cache=False)
        fwd = time.perf_counter() - t
    print(f"plain forward (LM head included, batch 8): {fwd:.1f} s")

    samples = list(ids)
    d = CalibrateConfig(corpus="-")  # the CLI's defaults
    held = split_heldout(n, d.heldout_fraction, d.seed)
    t = time.perf_counter()
    cap = run_capture(model, samples, held, num_layers=30, num_kv_heads=3, num_q_heads=9, head_dim=64,
                      batch_size=d.batch_size, reservoir=d.reservoir, heldout_reservoir=d.heldout_reservoir,
                      search_tokens=d.search_tokens, progress=False)
    t_cap = time.perf_counter() - t
    rows = search_scales(cap, "fp8_e4m3", False, d.max_queries, progress=False)
    plan, _ = plan_from_choices(rows, "fp8_e4m3", "tensor", 3)
    with tempfile.TemporaryDirectory() as d:
        write_artifact(Path(d) / "a", plan.to_tensors(), {"model": {"num_layers": 30}, "kv": plan.kv_metadata()})
    kv = time.perf_counter() - t
    print(f"kvcal calibrate fp8 (capture {t_cap:.1f} s + search/write {kv - t_cap:.1f} s): {kv:.1f} s")

    llmc = None
    if Path(args.llmc_python).exists():
        ckpt = hf_checkpoint(model, tok, REPO / "bench_out" / "smollm2-hf")
        tok_file = REPO / "bench_out" / "tokens.pt"
        torch.save(ids, tok_file)
        del model
        r = subprocess.run([args.llmc_python, str(REPO / "benchmarks" / "llmc_oneshot.py"), str(ckpt), str(tok_file)],
                           capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        if r.returncode == 0 and lines:
            llmc = json.loads(lines[-1])
            print(f"llm-compressor oneshot (kv_cache_scheme fp8): {llmc['seconds']:.1f} s, {llmc['num_scales']} scales")
        else:
            print("llm-compressor run failed:\n" + r.stderr[-2000:])
    else:
        print(f"llm-compressor venv not found at {args.llmc_python}; skipped (see module docstring)")

    print("\n| what | seconds | ratio to plain forward | ratio to llm-compressor |")
    print("|---|---|---|---|")
    print(f"| plain forward (floor) | {fwd:.1f} | 1.00 | {fwd / llmc['seconds']:.2f} |" if llmc else f"| plain forward | {fwd:.1f} | 1.00 | - |")
    print(f"| kvcal calibrate fp8 | {kv:.1f} | {kv / fwd:.2f} | {kv / llmc['seconds']:.2f} |" if llmc else f"| kvcal calibrate fp8 | {kv:.1f} | {kv / fwd:.2f} | - |")
    if llmc:
        print(f"| llm-compressor oneshot | {llmc['seconds']:.1f} | {llmc['seconds'] / fwd:.2f} | 1.00 |")
    out = REPO / "bench_out" / "bench_calibrate.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"forward_s": fwd, "kvcal_s": kv, "capture_s": t_cap, "llmc": llmc, "samples": n, "seq_len": T}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
