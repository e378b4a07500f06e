"""``kvcal recommend --engine vllm`` on the chat corpus, judged on held-out WikiText (issue 18's third target).

Runs the exact command (printed first)::

    kvcal recommend --corpus calibration_sets/chat.jsonl --engine vllm --accept "kl_mean<=1e-2"
        --eval-corpus ../shared/data/wikitext2_valid.txt --context C --windows W --probe-tokens P --out OUT

so fp8's scales are calibrated and every dtype's 16-bit layers are probed on the chat corpus only, and every
candidate is judged on the first ``W`` WikiText windows (never seen by calibration or the probe). Then prints
the candidate table (bytes/token as vLLM allocates pages — skipped layers at 16 bits, inline per-token scales,
block scales and norms included; ×16-bit; KL; ΔPPL; PASS/FAIL), the chosen configuration, whether it meets the
target (a PASS at ≤ 0.6× the bytes per token of 16-bit), and re-measures the chosen configuration (its
calibrated scales when the chosen row uses them, vLLM's 1.0 otherwise) on the next ``--recheck-windows`` WikiText windows, which recommend did not see.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_vllm_recommend.py [--context 256] [--windows 4]
        [--probe-tokens 256] [--recheck-windows 8] [--out /tmp/kvcal-bench-recommend]
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET_RATIO = 0.6


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="kvcal recommend --model (default: the embedded SmolLM2-135M)")
    ap.add_argument("--corpus", default="calibration_sets/chat.jsonl")
    ap.add_argument("--eval-corpus", default="../shared/data/wikitext2_valid.txt")
    ap.add_argument("--accept", default="kl_mean<=1e-2")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--probe-tokens", type=int, default=256)
    ap.add_argument("--dtypes", default=None, help="kvcal recommend --dtypes (default: its whole menu)")
    ap.add_argument("--recheck-windows", type=int, default=8)
    ap.add_argument("--out", default="/tmp/kvcal-bench-recommend")
    ap.add_argument("--reuse", action="store_true", help="read an existing --out/deploy.json instead of running")
    a = ap.parse_args(argv)

    out = Path(a.out)
    cmd = ["kvcal", "recommend", "--corpus", a.corpus, "--engine", "vllm", "--accept", a.accept,
           "--eval-corpus", a.eval_corpus, "--context", str(a.context), "--windows", str(a.windows),
           "--probe-tokens", str(a.probe_tokens), "--out", str(out), "--quiet"]
    if a.model:
        cmd += ["--model", a.model]
    if a.dtypes:
        cmd += ["--dtypes", a.dtypes]
    print("$ " + shlex.join(cmd), flush=True)
    wall = None
    if not a.reuse:
        if out.exists():
            shutil.rmtree(out)
        t0 = time.perf_counter()
        rc = subprocess.run([sys.executable, "-m", "kvcal", *cmd[1:]], cwd=REPO).returncode
        wall = time.perf_counter() - t0
        print(f"exit {rc}, {wall:.0f} s wall")
    doc = json.loads((REPO / out / "deploy.json").read_text())
    ev = doc["data"]["evaluation"]
    print(f"\nevaluation: {ev['windows']} x {ev['context']} tokens of {ev['corpus']} (16-bit PPL "
          f"{doc['data']['reference_ppl']:.4f}); probe {doc['data']['probe']['windows']} x "
          f"{doc['data']['probe']['context']} tokens of {doc['data']['probe']['corpus']}; 16-bit "
          f"{doc['bytes_per_token_16bit']} bytes/token\n")
    print("| --kv-cache-dtype | scales | 16-bit layers | choice | bytes/token | ×16-bit | KL mean | ΔPPL | status |")
    print("|---|---|---|---|---:|---:|---:|---:|---|")
    for c in doc["candidates"]:
        kl = f"{c['kl_mean']:.3e}" if "kl_mean" in c else "-"
        dp = f"{c['delta_ppl']:+.4f}" if "delta_ppl" in c else "-"
        mark = " **← chosen**" if c == doc["chosen"] else ""
        print(f"| {c['dtype']} | {c.get('scales', '-')} | {','.join(map(str, c['skip_layers'])) or '-'} | {c['choice']}"
              f"{'' if c['deployable'] else ' (not deployable)'} | {c['bytes_per_token']} | {c['vs_16bit']:.3f} | "
              f"{kl} | {dp} | {c['status']}{mark} |")
    ch = doc["chosen"]
    if ch is None:
        print("\nno configuration passes: target NOT met")
        return 1
    met = ch["vs_16bit"] <= TARGET_RATIO
    print(f"\nchosen: --kv-cache-dtype {ch['dtype']} ({ch.get('scales', '-')} scales), 16-bit layers {ch['skip_layers'] or 'none'}: "
          f"{ch['bytes_per_token']} bytes/token = {ch['vs_16bit']:.3f}× 16-bit, KL {ch['kl_mean']:.3e}, "
          f"ΔPPL {ch['delta_ppl']:+.4f} -> target (PASS at <= {TARGET_RATIO}× 16-bit) {'met' if met else 'NOT met'}")
    for line in (doc["commands"] or {}).values():
        if line:
            print(line)
    if a.recheck_windows:
        recheck(doc, a, out)
    return 0 if met else 1


def recheck(doc: dict, a, out: Path) -> None:
    """The chosen configuration on ``--recheck-windows`` WikiText windows after the evaluated ones."""
    import torch

    from kvcal.engines.vllm.plan import VllmKVPlan
    from kvcal.evaluate.accept import judge, parse_accept
    from kvcal.evaluate.protocol_a import teacher_forced
    from kvcal.evaluate.windows import corpus_stream, cut_windows
    from kvcal.models import load_model, load_tokenizer
    from kvcal.recommend import _artifact_scales

    torch.set_num_threads(1)
    ch = doc["chosen"]
    tok = load_tokenizer(a.model)
    model = load_model(a.model)
    L = model.config.num_hidden_layers
    ids, _ = corpus_stream(str(REPO / a.eval_corpus), tok)
    ev = cut_windows(ids, a.context, a.recheck_windows, skip=a.windows)
    # the chosen row's calibrated artifact (fp8, nvfp4), none for a row at vLLM's default scales (1.0)
    art = doc.get("artifact") if ch.get("scales", "calibrated") == "calibrated" else None
    sc = _artifact_scales(ch["dtype"], REPO / out / art, L) if art else {}
    plan = VllmKVPlan(ch["dtype"], L, skip_layers=tuple(ch["skip_layers"]), **sc)
    t0 = time.perf_counter()
    r = teacher_forced(model, ev, {"chosen": plan}, progress=False)["chosen"]
    status, failed = judge(r, parse_accept(a.accept))
    print(f"\nrecheck on {len(ev)} more WikiText windows x {a.context} tokens (after the {a.windows} evaluated): "
          f"KL {r['kl_mean']:.3e}, ΔPPL {r['delta_ppl']:+.4f}, top-1 {r['top1_agree']:.4f} -> {status}"
          f"{' ' + '; '.join(failed) if failed else ''} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    sys.exit(main())
