"""Where an integer plan's model-level error comes from (issue 4 diagnostics), on the embedded model.

For a calibrated integer artifact (e.g. ``kvcal calibrate --preset int4``), on ``--windows``
1024-token windows of ``wikitext2_valid.txt`` (Protocol A: every key and value attention reads is
fake-quantized; mean logit KL against the 16-bit model, nats):

1. all sides vs K-only vs V-only;
2. one (layer, side) quantized at a time (:func:`kvcal.evaluate.side_sensitivity`): the values'
   share of the summed single-side KL, the largest single sides, and how close the sum comes to
   the all-sides KL;
3. the same plan with 0 / 1 / 4 / 16 sink tokens kept in 16 bits.

    HF_HUB_OFFLINE=1 .venv/bin/kvcal calibrate --corpus calibration_sets/chat.jsonl --preset int4 \\
        --out bench_out/int4
    HF_HUB_OFFLINE=1 .venv/bin/python diagnostics/probe_int4.py --artifact bench_out/int4   # ~6 min here

The windows are the benchmark's evaluation windows by default (``--skip-windows 0``); these are
diagnostics of one plan, not a tuning split. Writes nothing; prints the tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "wikitext2_valid.txt"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", required=True, help="integer kvcal artifact directory")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--skip-windows", type=int, default=0)
    ap.add_argument("--top", type=int, default=6, help="largest single sides to list")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="model to probe (default: the one the artifact was calibrated on)")
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(a.threads)

    from _probe import load_probe

    from kvcal.evaluate.protocol_a import plans_kl, side_only, side_sensitivity
    from kvcal.evaluate.windows import text_windows

    _, plan, tok, model = load_probe(a.artifact, a.model)
    windows = text_windows(tok, DATA.read_text(encoding="utf-8"), 1024, a.windows, skip_windows=a.skip_windows)
    samples = list(windows)
    print(f"artifact {a.artifact}: {plan.num_layers} layers, {plan.sink_tokens} sink tokens; "
          f"{len(samples)} x 1024-token windows of {DATA.name} from window {a.skip_windows}")

    kl = plans_kl(model, samples, {"all": plan, "K only": side_only(plan, "k"), "V only": side_only(plan, "v")})
    print("\n| quantized | mean KL (nats) |\n|---|---|")
    for name, v in kl.items():
        print(f"| {name} | {v:.3e} |")

    sens = side_sensitivity(model, samples, plan)
    total = sum(sens.values())
    v_share = sum(v for (_, s), v in sens.items() if s == "v") / total
    print(f"\nsingle-side KLs sum to {total:.3e} ({total / kl['all']:.2f}x the all-sides KL); "
          f"values hold {v_share:.0%} of the sum")
    print("\n| layer | side | single-side KL | share of sum |\n|---|---|---|---|")
    for (layer, side), v in sorted(sens.items(), key=lambda kv: -kv[1])[: a.top]:
        print(f"| {layer} | {side.upper()} | {v:.3e} | {v / total:.1%} |")

    variants = {n: dataclasses.replace(plan, sink_tokens=n) for n in (0, 1, 4, 16)}
    sink_kl = plans_kl(model, samples, variants)
    print("\n| sink tokens | mean KL (nats) |\n|---|---|")
    for n, v in sink_kl.items():
        print(f"| {n} | {v:.3e} |")


if __name__ == "__main__":
    main()
