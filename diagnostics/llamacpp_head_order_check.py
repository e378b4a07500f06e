"""Served (llama.cpp) KL of every -ctk/-ctv pair against kvcal's prediction with and without llama.cpp's key/query
head order, on the same windows (not part of CI; the figures in docs/results.md "head order").

A llama GGUF stores each query/key head interleaved (llama.cpp's converter permutes the projections for its
consecutive-pair RoPE; transformers' loader permutes them back), so llama.cpp's blocks of 32 hold other elements
than kvcal's model order (:func:`kvcal.engines.llamacpp.plan.kq_interleaved`). This script serves every pair once
(``kvcal/engines/llamacpp/runner.py`` in llama-cpp-python's venv) and predicts each twice (``kq_interleaved`` False
and True, every weight matmul's input rounded as llama.cpp rounds it), judging each with verify's paired t-interval.

    HF_HUB_OFFLINE=1 PYTHONPATH=. .venv/bin/python diagnostics/llamacpp_head_order_check.py \\
        --engine-python .venv-llamacpp/bin/python --model smollm2-135m --windows 6 --json out.json
    .venv/bin/python diagnostics/llamacpp_head_order_check.py --table out.json     # the docs/results.md table

``--compare accumulator --served out.json --pairs q8_0/f16,...`` predicts the pairs of an earlier run again with the
fp16 ``P · V`` accumulator emulated and not (``emulate_f16_accumulator``), against the same served figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

TYPES = ["f16", "q8_0", "q5_1", "q5_0", "q4_1", "iq4_nl", "q4_0"]

#: --compare: the plan switch each pair is predicted both ways with (True, False), and the table's labels
LABELS = {"order": ("GGUF order", "model order"), "accumulator": ("fp16 P·V accumulator", "f32 attention"),
          "reference": ("f16/f16 reference", "unquantized reference"), "none": ("kvcal's plan", "")}


def table(doc: dict) -> str:
    """The markdown table and summary of a run's JSON (docs/results.md): per pair served KL, predicted KL in the GGUF's
    head order (what kvcal predicts now) and in the model's order (before), each with verify's diff, tolerance and
    verdict; then how often served exceeds predicted (keys quantized: the pairs the order changes)."""
    import math
    import statistics

    from scipy import stats

    from kvcal.verify.figures import agreement

    n = len(doc["served"]["pairs"][0]["kl"])
    if doc.get("compare") == "none":
        return _single_table(doc, n, agreement)
    on, off = LABELS[doc.get("compare", "order")]
    out = [f"| -ctk/-ctv | served KL | predicted, {on} | diff | tolerance | verdict | predicted, {off} | diff "
           "| tolerance | verdict |", "|---|---:|---:|---:|---:|---|---:|---:|---:|---|"]
    summ = {0: [], 1: []}
    for p in doc["served"]["pairs"]:
        pair, s = f"{p['type_k']}/{p['type_v']}", p["kl"]
        if f"{pair}/1" not in doc["pred"]:
            continue
        cells = [pair, f"{sum(s) / n:.3e}"]
        for il in (1, 0):
            pw = doc["pred"][f"{pair}/{il}"]
            ag = agreement(s, pw)
            ok = "PASS" if ag["ok"] else "**FAIL**"
            cells += [f"{sum(pw) / n:.3e}", f"{ag['diff']:+.2e}", f"±{ag['tol']:.2e}", ok]
            summ[il].append((p["type_k"] != "f16", sum(s) / sum(pw), ag["ok"], ag["diff"] / ag["tol"]))
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    for il, name in ((1, on), (0, off)):
        rows = [r for r in summ[il] if r[0]]
        if len(rows) < 2:
            continue
        above = sum(r[1] > 1 for r in rows)
        lr = [math.log(r[1]) for r in rows]
        out.append(f"- {name}: {sum(r[2] for r in summ[il])} of {len(summ[il])} PASS; quantized-K pairs: served above "
                   f"predicted in {above} of {len(rows)} (two-sided binomial p {stats.binomtest(above, len(rows)).pvalue:.2f}), "
                   f"median served/predicted {statistics.median(r[1] for r in rows):.3f}, sd of log(served/predicted) "
                   f"{statistics.stdev(lr):.3f}, rms diff/tolerance {math.sqrt(statistics.mean(r[3] ** 2 for r in rows)):.2f}")
    return "\n".join(out)


def _single_table(doc: dict, n: int, agreement) -> str:
    """``--compare none``: per pair bytes per token, served and predicted KL, verify's diff/tolerance/verdict, served
    and predicted ΔNLL (each against its own reference), rows by bytes; then the count of PASS and of served above
    predicted."""
    out = ["| -ctk/-ctv | bytes/token | served KL | predicted KL | diff | tolerance | served ΔNLL | predicted ΔNLL "
           "| verdict |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    rows = []
    for p in doc["served"]["pairs"]:
        pair = f"{p['type_k']}/{p['type_v']}"
        if f"{pair}/1" not in doc["pred"]:
            continue
        s, pw = p["kl"], doc["pred"][f"{pair}/1"]
        nll, ref = doc["pred_nll"][f"{pair}/1"]
        ref_s = doc["served"]["reference"]["nll"]
        ag = agreement(s, pw)
        rows.append((doc["bytes_per_token"][pair], sum(s) / n, pair, sum(pw) / n, ag,
                     (sum(p["nll"]) - sum(ref_s)) / n, (sum(nll) - sum(ref)) / n))
    rows.sort()
    for b, sk, pair, pk, ag, dn_s, dn_p in rows:
        out.append(f"| {pair} | {b:,} | {sk:.3e} | {pk:.3e} | {ag['diff']:+.2e} | ±{ag['tol']:.2e} | {dn_s:+.4f} | "
                   f"{dn_p:+.4f} | {'PASS' if ag['ok'] else '**FAIL**'} |")
    above = sum(r[1] > r[3] for r in rows)
    out += ["", f"{sum(r[4]['ok'] for r in rows)} of {len(rows)} PASS; served above predicted in {above} of {len(rows)}"]
    return "\n".join(out)


def main(argv=None) -> int:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--table":
        print(table(json.loads(Path(sys.argv[2]).read_text())))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine-python", help="llama-cpp-python's interpreter (not with --served)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--corpus", default=str(Path(__file__).resolve().parents[1].parent / "shared/data/wikitext2_valid.txt"))
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--windows", type=int, default=6)
    ap.add_argument("--pairs", help="K/V,K/V,... (default: all 48 ordered pairs)")
    ap.add_argument("--json", required=True)
    ap.add_argument("--compare", choices=sorted(LABELS), default="order",
                    help="order: kq_interleaved on/off; accumulator: emulate_f16_accumulator on/off (GGUF order); "
                    "reference: kvcal's reference run under llama.cpp's f16/f16 plan or unquantized; none: only "
                    "the plan kvcal builds now (its table adds bytes and ΔNLL)")
    ap.add_argument("--served", help="reuse the served run of an earlier --json output (same model, windows, pairs)")
    a = ap.parse_args(argv)
    from kvcal.engines import engine
    from kvcal.engines.llamacpp.plan import LlamaCppKVPlan, kq_interleaved
    from kvcal.evaluate.sequential import WindowedRows
    from kvcal.evaluate.windows import corpus_stream, cut_windows, served_bos
    from kvcal.formats.memory import model_shape
    from kvcal.models import load_model, load_tokenizer
    from kvcal.models.gguf import gguf_architecture, gguf_tensor_types
    from kvcal.verify.engine import run_engine
    from kvcal.verify.figures import agreement
    from kvcal.verify.pairs import _gguf

    pairs = ([tuple(p.split("/")) for p in a.pairs.split(",")] if a.pairs else
             [(k, v) for k in TYPES for v in TYPES if (k, v) != ("f16", "f16")])
    eng = engine("llamacpp")
    src, gguf = _gguf(a.model)
    tok = load_tokenizer(src)
    ids, _ = corpus_stream(a.corpus, tok)
    wins = cut_windows(ids, a.context, a.windows, bos=served_bos(tok))[:a.windows]
    n = len(wins)
    t0 = time.time()
    if a.served:
        served = json.loads(Path(a.served).read_text())["served"]
        by_pair = {f"{p['type_k']}/{p['type_v']}": p for p in served["pairs"]}
        served = {**served, "pairs": [by_pair[f"{k}/{v}"] for k, v in pairs if f"{k}/{v}" in by_pair]}
        if (served["windows"], served["n_ctx"]) != (n, a.context) or len(served["pairs"]) != len(pairs):
            raise SystemExit(f"--served {a.served}: other windows, context or pairs than this run's")
    else:
        with tempfile.TemporaryDirectory() as td:
            served = run_engine(Path(a.engine_python).absolute(), {"gguf": str(gguf), "windows": wins.tolist(),
                                "reference": ["f16", "f16"], "pairs": [list(p) for p in pairs], "threads": 2},
                                Path(td), 7200, runner=eng.RUNNER)
        print(f"served {len(pairs)} pairs x {n} windows in {time.time() - t0:.0f}s", flush=True)
    model = load_model(src)
    L = model.config.num_hidden_layers
    doc = {"model": a.model, "context": a.context, "windows": n, "served": served, "pred": {}, "compare": a.compare}
    il_order = kq_interleaved(gguf_architecture(gguf))
    shp = model_shape(model.config)
    doc["bytes_per_token"] = {f"{k}/{v}": eng.pair_bytes_per_token(shp, k, v) for k, v in pairs}
    with eng.MatmulInputs(model, eng.gguf_matmul_inputs(gguf_tensor_types(gguf))):
        rows = WindowedRows(model, wins)
        ref16 = WindowedRows(model, wins, reference_plan=LlamaCppKVPlan("f16", "f16", L, kq_interleaved=il_order))

        def variants(k: str, v: str) -> list:
            """(1/0, the rows measuring it, plan) of each prediction --compare asks for."""
            now = LlamaCppKVPlan(k, v, L, kq_interleaved=il_order)
            return {"order": [(1, rows, now), (0, rows, LlamaCppKVPlan(k, v, L, kq_interleaved=not il_order))],
                    "accumulator": [(1, rows, now), (0, rows, LlamaCppKVPlan(k, v, L, kq_interleaved=il_order,
                                                                             emulate_f16_accumulator=False))],
                    "reference": [(1, ref16, now), (0, rows, now)],
                    "none": [(1, rows, now)]}[a.compare]

        for p, s in zip(pairs, served["pairs"], strict=True):
            for il, rw, plan in variants(*p):
                rw.measure((p, il), plan, n)
                r = rw.result((p, il))["per_window"]
                pw = r["kl_mean"]
                doc["pred"][f"{p[0]}/{p[1]}/{il}"] = pw
                doc.setdefault("pred_nll", {})[f"{p[0]}/{p[1]}/{il}"] = [r["nll"], r["ref_nll"]]
                ag = agreement(s["kl"], pw)
                print(f"{p[0]}/{p[1]} {a.compare}={il} served {sum(s['kl']) / n:.4e} predicted {sum(pw) / n:.4e} "
                      f"diff {ag['diff']:+.2e} tol {ag['tol']:.2e} {'ok' if ag['ok'] else 'FAIL'} "
                      f"({time.time() - t0:.0f}s)", flush=True)
            Path(a.json).write_text(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
