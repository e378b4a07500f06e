"""Capture memory is bounded: peak RSS with a 10x larger corpus vs the base corpus, same model.

Each run is a fresh child process (so peaks don't mix) doing exactly what `kvcal calibrate` does
before the search: load the model, capture statistics and the bounded reservoirs over N samples.
Target (issue 7): peak(10x) <= 1.1 x peak(base). Prints both side by side. The base corpus must be
large enough to fill the bounded reservoirs (CLI defaults: 8 calibration + 4 held-out sequences),
otherwise the comparison measures the reservoir filling up, not growth with the corpus.

  .venv/bin/python benchmarks/bench_capture_memory.py [--base 32] [--seq-len 256]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, resource, sys, time, torch
from kvcal.calibrate import CalibrateConfig
from kvcal.capture.run import run_capture, split_heldout
from kvcal.evaluate.windows import text_windows
from kvcal.models import load_model, load_tokenizer
n, T, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
tok, model = load_tokenizer(None), load_model(None)
text = open(path, encoding="utf-8").read()
ids = text_windows(tok, text, T, n, skip_windows=0)
if len(ids) < n:  # repeat the text if the 10x corpus needs more windows than it has
    reps = -(-n // len(ids))
    ids = ids.repeat(reps, 1)[:n]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
d = CalibrateConfig(corpus="-")  # the CLI's defaults
cap = run_capture(model, list(ids), split_heldout(n, d.heldout_fraction, d.seed), num_layers=30, num_kv_heads=3,
                  num_q_heads=9, head_dim=64, batch_size=d.batch_size, reservoir=d.reservoir,
                  heldout_reservoir=d.heldout_reservoir, search_tokens=T, progress=False)
print(json.dumps({"samples": n, "tokens": int(ids.numel()), "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "rss_before_capture_kib": before, "seconds": time.perf_counter() - t,
                  "reservoir": [len(cap.calib.sequences()), len(cap.heldout.sequences())]}))
"""


def run(n: int, T: int, data: Path) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, str(n), str(T), str(data)], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(r.stderr[-3000:])
    return json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("{")][-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    args = ap.parse_args()
    data = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext2_valid.txt"
    base = run(args.base, args.seq_len, data)
    big = run(10 * args.base, args.seq_len, data)
    ratio = big["peak_rss_kib"] / base["peak_rss_kib"]
    print("| corpus | samples | tokens | peak RSS (MiB) | capture s | reservoir (calib, held-out) |")
    print("|---|---|---|---|---|---|")
    for name, r in (("base", base), ("10x", big)):
        print(f"| {name} | {r['samples']} | {r['tokens']} | {r['peak_rss_kib'] / 1024:.0f} | {r['seconds']:.1f} | {r['reservoir']} |")
    print(f"\npeak RSS ratio 10x / base = {ratio:.3f} (target <= 1.10): {'PASS' if ratio <= 1.10 else 'FAIL'}")
    out = Path(__file__).resolve().parents[1] / "bench_out" / "bench_capture_memory.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"base": base, "10x": big, "ratio": ratio}, indent=1))


if __name__ == "__main__":
    main()
