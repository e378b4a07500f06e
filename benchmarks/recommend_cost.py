"""Wall time and evaluation windows of `kvcal recommend`, against an earlier implementation in the same run.

    .venv/bin/python benchmarks/recommend_cost.py [--baseline-ref 5f01cf1] [--dtypes fp8,int8_per_token_head]
        [--context 512] [--windows 4] [--max-windows 16] [--probe-tokens 1024] [--model smollm2-135m]
        [--corpus calibration_sets/chat.jsonl] [--accept ...] [--skip-baseline]

Runs the current checkout's `kvcal recommend --engine vllm` and, unless --skip-baseline, the same command from the
git revision --baseline-ref (default 5f01cf1: the implementation before bounded, cheapest-first measurement;
extracted with `git archive` into a temporary directory and run with this .venv's Python, PYTHONPATH pointing at
it), one after the other on the same machine. Prints each run's wall time, the ratio, the candidate table of the
current run with the windows each row was measured on, its forward passes, and which rows the two runs chose.
Both runs start from a cold process (model load included). The issue-39 target: the default menu on the embedded
model in <= 10 min wall on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(cmd: list[str], env: dict, cwd: Path) -> tuple[float, int, str]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    return time.perf_counter() - t0, p.returncode, p.stdout + p.stderr


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-ref", default="5f01cf1")
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--model", default=None)
    ap.add_argument("--corpus", default=str(REPO / "calibration_sets" / "chat.jsonl"))
    ap.add_argument("--dtypes", default=None)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--max-windows", type=int, default=16)
    ap.add_argument("--probe-tokens", type=int, default=1024)
    ap.add_argument("--accept", default=None)
    ap.add_argument("--eval-corpus", default=None)
    a = ap.parse_args()
    common = ["recommend", "--engine", "vllm", "--corpus", a.corpus, "--context", str(a.context),
              "--windows", str(a.windows), "--probe-tokens", str(a.probe_tokens), "--quiet"]
    for opt, val in (("--model", a.model), ("--dtypes", a.dtypes), ("--accept", a.accept),
                     ("--eval-corpus", a.eval_corpus)):
        if val is not None:
            common += [opt, val]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    tmp = Path(tempfile.mkdtemp(prefix="kvcal-recommend-cost-"))
    try:
        out_new = tmp / "new"
        t_new, rc_new, log_new = run([sys.executable, "-m", "kvcal", *common, "--max-windows", str(a.max_windows),
                                      "--out", str(out_new)], {**env, "PYTHONPATH": str(REPO)}, REPO)
        print(f"current checkout: {t_new:.0f} s wall, exit {rc_new}")
        if rc_new not in (0, 1):
            print(log_new[-3000:])
            return 2
        doc = json.loads((out_new / "deploy.json").read_text())
        ev = doc["data"]["evaluation"]
        print(f"  forward passes of {a.context} tokens: {ev['forward_passes']}; windows per row: first {ev['windows_first']}, "
              f"cap {ev['windows_cap']}; chosen: {_name(doc['chosen'])}")
        print("  | dtype | scales | 16-bit layers | bytes/token | windows | KL mean [bound] | status |")
        for c in doc["candidates"]:
            b = (c.get("bounds") or {}).get("kl_mean") or {}
            kl = f"{c['kl_mean']:.3e} [{b.get('bound', float('nan')):.3e}]" if "kl_mean" in c else "-"
            print(f"  | {c['dtype']} | {c['scales']} | {','.join(map(str, c['skip_layers'])) or '-'} | "
                  f"{c['bytes_per_token']} | {c.get('windows', 0)} | {kl} | {c['status']} |")
        if a.skip_baseline:
            return 0
        base = tmp / "baseline-src"
        base.mkdir()
        arch = subprocess.run(["git", "-C", str(REPO), "archive", a.baseline_ref], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(base)], input=arch.stdout, check=True)
        out_old = tmp / "old"
        t_old, rc_old, log_old = run([sys.executable, "-m", "kvcal", *common, "--out", str(out_old)],
                                     {**env, "PYTHONPATH": str(base)}, base)
        print(f"baseline {a.baseline_ref}: {t_old:.0f} s wall, exit {rc_old}")
        if rc_old not in (0, 1):
            print(log_old[-3000:])
            return 2
        old = json.loads((out_old / "deploy.json").read_text())
        n_old = sum(1 for c in old["candidates"] if "kl_mean" in c)
        print(f"  rows measured: {n_old}, each on {old['data']['evaluation']['windows']} windows; chosen: "
              f"{_name(old['chosen'])}")
        print(f"wall time: current / baseline = {t_new / t_old:.3f} ({t_new:.0f} s vs {t_old:.0f} s)")
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _name(c: dict | None) -> str:
    if c is None:
        return "none"
    return (f"{c['dtype']} ({c['scales']}), 16-bit layers {','.join(map(str, c['skip_layers'])) or 'none'}, "
            f"{c['bytes_per_token']} B/token, KL {c['kl_mean']:.3e}")


if __name__ == "__main__":
    sys.exit(main())
