"""The optimizer's Targets table (issue 4), side by side in one run on the embedded model.

Calibration: ``--calib-samples`` 512-token windows of ``wikitext2_valid.txt`` taken *after* the
evaluation region (the first 8 × 1024 tokens are never seen by calibration; a quarter of the
calibration windows is held out for the guards). Evaluation: Protocol A
(:func:`kvcal.evaluate.teacher_forced`, every K/V attention reads fake-quantized) on the first
``--windows`` 1024-token windows. Also: objective-vs-model-KL rank correlation (which objective
best predicts the logit KL when one layer's keys or values are quantized with one candidate
setting), and data efficiency (absmax with 64 samples vs kvcal with 16).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_optimizer.py            # ~15-25 min on 2 CPU cores
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_optimizer.py --quick    # smoke run
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_optimizer.py --only int4  # the int4 rows (~45 min)

``--only int4`` re-measures just the int4 target's rows (KIVI-4, the ``int4`` preset with its K/V split,
``--bits 4.25`` with the probe) on the same calibration and windows, into ``bench_optimizer_int4.json``.

Writes ``bench_out/bench_optimizer.json`` (gitignored) and prints the table with ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "wikitext2_valid.txt"


def fp8_plan(rows_or_scales, L, granularity="tensor", fmt="fp8_e4m3"):
    """KVPlan with static FP8 scales: ``rows_or_scales`` = list of (k_scale, v_scale) tensors."""
    from kvcal.formats.spec import TensorQuantSpec
    from kvcal.plan import KVPlan, LayerPlan, SidePlan

    spec = TensorQuantSpec(fmt, granularity)
    layers = []
    for ks, vs in rows_or_scales:
        shape = (1, 1, 1, 1) if granularity == "tensor" else (1, -1, 1, 1)
        layers.append(LayerPlan(SidePlan(spec, scale=ks.reshape(shape).float()),
                                SidePlan(spec, scale=vs.reshape(shape).float())))
    return KVPlan(layers)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calib-samples", type=int, default=64)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--max-queries", type=int, default=64)
    ap.add_argument("--corr-layers", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="2 eval windows, 16 samples, fewer probes")
    ap.add_argument("--out", default=str(REPO / "bench_out" / "bench_optimizer.json"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", choices=["int4"], default=None, help="just the rows of one target")
    a = ap.parse_args()
    if a.only and a.out == str(REPO / "bench_out" / "bench_optimizer.json"):
        a.out = str(REPO / "bench_out" / f"bench_optimizer_{a.only}.json")
    if a.quick:
        a.calib_samples, a.windows, a.corr_layers = 16, 2, 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(a.threads)
    from scipy.stats import spearmanr

    from kvcal.capture.run import run_capture, split_heldout
    from kvcal.evaluate.protocol_a import plans_kl, side_only, side_sensitivity, teacher_forced
    from kvcal.evaluate.windows import text_windows
    from kvcal.formats.granularity import PerToken, PerTokenGroup
    from kvcal.formats.spec import TensorQuantSpec, preset
    from kvcal.models import head_dim_of, load_model, load_tokenizer
    from kvcal.plan import KVPlan, LayerPlan, SidePlan
    from kvcal.search.fp8 import plan_from_choices, search_scales
    from kvcal.search.integer import search_int
    from kvcal.search.objectives import SequenceCache
    from kvcal.search.optimizer import make_plan, side_error

    t_all = time.perf_counter()
    tok, model = load_tokenizer("smollm2-135m"), load_model("smollm2-135m")
    c = model.config
    L, Hk, Hq, D = c.num_hidden_layers, c.num_key_value_heads, c.num_attention_heads, head_dim_of(c)
    text = DATA.read_text(encoding="utf-8")
    eval_w = text_windows(tok, text, 1024, a.windows)
    # calibration windows start after the 8 x 1024 evaluation tokens (16 windows of 512)
    calib_w = text_windows(tok, text, 512, a.calib_samples, skip_windows=16)
    assert len(calib_w) == a.calib_samples, "wikitext2_valid.txt too short for --calib-samples"
    samples = list(calib_w)
    out: dict = {"model": "smollm2-135m", "eval": {"windows": len(eval_w), "tokens_per_window": 1024},
                 "calibration": {"samples": len(samples), "tokens_per_sample": 512, "source": "wikitext2_valid.txt "
                                 "512-token windows 16.. (after the evaluation region)"}}

    def capture(samps):
        held = split_heldout(len(samps), 0.25, 0)
        return run_capture(model, samps, held, num_layers=L, num_kv_heads=Hk, num_q_heads=Hq, head_dim=D,
                           reservoir=8, heldout_reservoir=4, search_tokens=512, progress=False, sink_stats_skip=1)

    t0 = time.perf_counter()
    cap = capture(samples)
    out["capture_seconds"] = time.perf_counter() - t0
    print(f"capture {len(samples)} x 512 tokens: {out['capture_seconds']:.0f} s", flush=True)

    plans: dict[str, object] = {}
    timings = {}
    # ---- FP8 ----------------------------------------------------------------------------------
    full = a.only is None
    absmax_name = "fp8 absmax (llm-compressor) @64" if a.calib_samples == 64 else "fp8 absmax"
    if full:
        unity = [(torch.ones(1), torch.ones(1))] * L
        absmax = [(cap.stats.k[i].finalize()["tensor_absmax"].reshape(1) / 448,
                   cap.stats.v[i].finalize()["tensor_absmax"].reshape(1) / 448) for i in range(L)]
        plans["fp8 unity"] = fp8_plan(unity, L)
        plans[absmax_name] = fp8_plan(absmax, L)
        for gran in ("tensor", "head"):
            t0 = time.perf_counter()
            rows = search_scales(cap, "fp8_e4m3", gran == "head", a.max_queries, progress=False)
            timings[f"fp8 {gran}"] = time.perf_counter() - t0
            plans[f"fp8 kvcal {gran}"] = plan_from_choices(rows, "fp8_e4m3", gran, Hk)[0]
        for base in ("fp8 unity", absmax_name, "fp8 kvcal tensor"):
            for side in ("k", "v"):
                plans[f"{base} [{side.upper()} only]"] = side_only(plans[base], side)
    # ---- integer presets and budgets --------------------------------------------------------------
    plans["KIVI-4 g32 (baseline)"] = KVPlan.uniform(L, preset("kivi4"))
    if full:
        plans["int8 g64 min/max (baseline)"] = KVPlan.uniform(L, preset("int8"))
        plans["KIVI-2 g32 (baseline)"] = KVPlan.uniform(L, preset("kivi2"))
    shared: dict = {}
    summaries = {}
    # --bits as `kvcal calibrate` runs it: layer errors weighted by the single-side model KL measured on the
    # first 1024 held-out calibration tokens (never the evaluation windows); "(no probe)": summed layer errors
    held_w = [samples[i] for i in sorted(split_heldout(len(samples), 0.25, 0))[:2]]
    probe_memo: dict = {}

    def sink_probe_on(held):
        def sink_probe(plans):  # as `kvcal calibrate` chooses the sink count (default --probe-tokens 1024)
            return plans_kl(model, held, plans, progress=False)
        return sink_probe

    def probe(plan):
        key = tuple(id(lp.k) for lp in plan.layers)
        if key not in probe_memo:
            t_p = time.perf_counter()
            probe_memo[key] = side_sensitivity(model, held_w, plan, progress=False)
            print(f"sensitivity probe: {time.perf_counter() - t_p:.0f} s", flush=True)
        return probe_memo[key]

    int_runs = [("int8", {"preset": "int8"}), ("int4", {"preset": "int4"}), ("int2", {"preset": "int2"}),
                ("k4v2", {"preset": "k4v2"}), ("bits 4.25", {"bits": 4.25, "probe": probe}),
                ("bits 4.25 (no probe)", {"bits": 4.25}), ("bits 3", {"bits": 3.0, "probe": probe}),
                ("bits 3 (no probe)", {"bits": 3.0}),
                ("bits 2.5", {"bits": 2.5, "probe": probe})]
    if a.quick:
        int_runs = int_runs[:3]
    if a.only == "int4":
        int_runs = [r for r in int_runs if r[0] in ("int4", "bits 4.25")]
    for name, kw in int_runs:
        t0 = time.perf_counter()
        r = search_int(cap, max_queries=a.max_queries, cache=shared, progress=False, sink_probe=sink_probe_on(held_w),
                       **kw)
        timings[name] = time.perf_counter() - t0
        plans[f"kvcal {name}"] = r.plan
        if name == "int4":
            for side in ("k", "v"):
                plans[f"kvcal int4 [{side.upper()} only]"] = side_only(r.plan, side)
        s = r.summary
        summaries[name] = {k: s[k] for k in ("average_bits", "key_bits_mean", "value_bits_mean", "sinks", "heldout",
                                             "centered_layers")}
        if "allocation" in s:
            summaries[name]["chosen"] = [t["chosen"] for t in s["allocation"]["table"]]
        print(f"kvcal {name}: {timings[name]:.0f} s, avg bits {s['average_bits']:.4f}, sinks {r.plan.sink_tokens}",
              flush=True)
    # ---- data efficiency: kvcal FP8 from 16 samples ---------------------------------------------
    if a.calib_samples >= 64 and full:
        cap16 = capture(samples[:16])
        rows = search_scales(cap16, "fp8_e4m3", False, a.max_queries, progress=False)
        plans["fp8 kvcal tensor @16"] = plan_from_choices(rows, "fp8_e4m3", "tensor", Hk)[0]
        held16 = [samples[i] for i in sorted(split_heldout(16, 0.25, 0))[:2]]
        r16 = search_int(cap16, preset="int4", max_queries=a.max_queries, progress=False,
                         sink_probe=sink_probe_on(held16))
        plans["kvcal int4 @16"] = r16.plan
        # the int4 layout with plain min/max ranges and nearest rounding (no calibration at all)
        from kvcal.search.presets import INT_PRESETS

        (ck, cv) = INT_PRESETS["int4"]
        # no calibration: no log8 base and no levels table, so values keep fp16 scales on the uniform grid
        v_spec = dataclasses.replace(cv.spec, scale_dtype=None)
        plans["int4 layout min/max, no calibration (fp16 value scales)"] = KVPlan(
            [LayerPlan(SidePlan(ck.spec, transform=ck.transform, rope=cap.rope), SidePlan(v_spec, transform=cv.transform))
             for i in range(L)], sink_tokens=plans["kvcal int4"].sink_tokens)
    print(f"evaluating {len(plans)} plans on {len(eval_w)} windows ...", flush=True)
    t0 = time.perf_counter()
    res = teacher_forced(model, eval_w, plans, progress=False)
    out["eval_seconds"] = time.perf_counter() - t0
    out["results"] = res
    out["search_seconds"] = timings
    out["int_summaries"] = summaries

    # ---- print -------------------------------------------------------------------------------------
    ref = res["16-bit"]
    print(f"\n16-bit reference ppl {ref['ppl']:.3f} ({ref['tokens']} predicted tokens)")
    print(f"{'method':44s} {'avg bits':>8s} {'dPPL':>9s} {'mean KL':>10s} {'p99.9 KL':>9s} {'top1':>6s}")
    for n, r in res.items():
        if n == "16-bit":
            continue
        bits = next((summaries[k]["average_bits"] for k in summaries if n == f"kvcal {k}"), None)
        b = f"{bits:.3f}" if bits else ""
        print(f"{n:44s} {b:>8s} {r['delta_ppl']:+9.4f} {r['kl_mean']:10.3e} {r['kl_p999']:9.4f} {r['top1_agree']:6.3f}")

    def ratio(a_, b_, key):
        return res[a_][key] / res[b_][key] if res[b_][key] else float("nan")

    checks = {} if not full else {
        "fp8 kvcal tensor KL / absmax": ratio("fp8 kvcal tensor", absmax_name, "kl_mean"),
        "fp8 kvcal tensor KL / unity": ratio("fp8 kvcal tensor", "fp8 unity", "kl_mean"),
        "fp8 kvcal head KL / absmax": ratio("fp8 kvcal head", absmax_name, "kl_mean"),
        "fp8 kvcal head KL / unity": ratio("fp8 kvcal head", "fp8 unity", "kl_mean"),
        "int8 KL / int8 g64 min-max (target <= 0.7)": ratio("kvcal int8", "int8 g64 min/max (baseline)", "kl_mean"),
        "int2 dPPL / KIVI-2 (target <= 1/4)": ratio("kvcal int2", "KIVI-2 g32 (baseline)", "delta_ppl"),
    }
    checks["int4 dPPL / KIVI-4 (target <= 1/3)"] = ratio("kvcal int4", "KIVI-4 g32 (baseline)", "delta_ppl")
    checks["int4 KL / KIVI-4 KL"] = ratio("kvcal int4", "KIVI-4 g32 (baseline)", "kl_mean")
    if "kvcal bits 4.25" in res:
        checks["bits 4.25 dPPL / KIVI-4 (target <= 1/3)"] = ratio("kvcal bits 4.25", "KIVI-4 g32 (baseline)", "delta_ppl")
        checks["bits 4.25 KL / KIVI-4 KL"] = ratio("kvcal bits 4.25", "KIVI-4 g32 (baseline)", "kl_mean")
    if "kvcal bits 3" in res:
        checks["bits 4.25 (no probe) dPPL / KIVI-4"] = ratio("kvcal bits 4.25 (no probe)", "KIVI-4 g32 (baseline)",
                                                            "delta_ppl")
        checks["bits 3 dPPL / KIVI-2 (same 3.0 bits)"] = ratio("kvcal bits 3", "KIVI-2 g32 (baseline)", "delta_ppl")
        checks["bits 3 (no probe) dPPL / KIVI-2"] = ratio("kvcal bits 3 (no probe)", "KIVI-2 g32 (baseline)", "delta_ppl")
        checks["bits 2.5 dPPL / KIVI-2 (target <= 1/4)"] = ratio("kvcal bits 2.5", "KIVI-2 g32 (baseline)", "delta_ppl")
        checks["k4v2 dPPL / KIVI-2"] = ratio("kvcal k4v2", "KIVI-2 g32 (baseline)", "delta_ppl")
    if "fp8 kvcal tensor @16" in res:
        checks["fp8 kvcal@16 KL / absmax@64 (target <= 1)"] = ratio("fp8 kvcal tensor @16", absmax_name, "kl_mean")
        checks["int4 kvcal@16 KL / same layout uncalibrated"] = ratio("kvcal int4 @16", "int4 layout min/max, no calibration (fp16 value scales)",
                                                                     "kl_mean")
    out["ratios"] = checks
    print("\nratios:")
    for k, v in checks.items():
        print(f"  {k:50s} {v:.3f}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1, default=float), encoding="utf-8")
    print(f"wrote {a.out}", flush=True)
    if not full:
        return
    # ---- objective vs model KL rank correlation --------------------------------------------------
    t0 = time.perf_counter()
    corr_layers = torch.linspace(0, L - 1, a.corr_layers).round().long().tolist()
    one_w = eval_w[:1]
    cands = {"k": [("int4 tok c1", TensorQuantSpec("int4", PerTokenGroup(64), symmetric=False), 1.0),
                   ("int4 tok c.85", TensorQuantSpec("int4", PerTokenGroup(64), symmetric=False), 0.85),
                   ("int3 tok c1", TensorQuantSpec("int3", PerTokenGroup(64), symmetric=False), 1.0),
                   ("int2 tok c.7", TensorQuantSpec("int2", PerTokenGroup(64), symmetric=False), 0.7)],
             "v": [("int4 tok c1", TensorQuantSpec("int4", PerToken(), symmetric=True), 1.0),
                   ("int3 tok c.8", TensorQuantSpec("int3", PerToken(), symmetric=True), 0.8),
                   ("int2 tok c.6", TensorQuantSpec("int2", PerTokenGroup(32), symmetric=False), 0.6)]}
    probe_plans, probe_obj = {}, []
    for layer in corr_layers:
        held = [SequenceCache(*s[layer], cap.scaling[layer], a.max_queries) for s in cap.heldout.sequences()]
        for side, lst in cands.items():
            for lab, spec, cr in lst:
                sp = make_plan(spec, torch.full((Hk,), cr))
                objs = {}
                for o in (("kl", "centered", "out", "mse") if side == "k" else ("out", "mse")):
                    n, d_ = side_error(held, side, sp, o)
                    objs[o] = float(n.sum() / d_.sum())
                name = f"L{layer} {side} {lab}"
                layers = [LayerPlan(SidePlan(TensorQuantSpec("bf16")), SidePlan(TensorQuantSpec("bf16")))
                          for _ in range(L)]
                if side == "k":
                    layers[layer] = LayerPlan(sp, SidePlan(TensorQuantSpec("bf16")))
                else:
                    layers[layer] = LayerPlan(SidePlan(TensorQuantSpec("bf16")), sp)
                probe_plans[name] = KVPlan(layers)
                probe_obj.append((name, side, objs))
    pres = teacher_forced(model, one_w, probe_plans, progress=False)
    corr = {}
    for side in ("k", "v"):
        rows = [(o, pres[n]["kl_mean"]) for n, s, o in probe_obj if s == side]
        kl = [r[1] for r in rows]
        corr[side] = {o: float(spearmanr([r[0][o] for r in rows], kl).statistic) for o in rows[0][0]}
    # pooled over sides: only objectives defined for both (out, mse)
    rows = [(o, pres[n]["kl_mean"]) for n, s, o in probe_obj]
    corr["k+v"] = {o: float(spearmanr([r[0][o] for r in rows], [r[1] for r in rows]).statistic) for o in ("out", "mse")}
    out["objective_rank_correlation"] = {"spearman": corr, "layers": corr_layers, "probes": len(probe_obj),
                                         "seconds": time.perf_counter() - t0,
                                         "probe_model_kl": {n: pres[n]["kl_mean"] for n, _, _ in probe_obj}}
    out["total_seconds"] = time.perf_counter() - t_all
    print("\nobjective vs model logit KL, Spearman rank correlation over", len(probe_obj), "probes:")
    for side, d in corr.items():
        print(f"  {side}: " + ", ".join(f"{k} {v:+.3f}" for k, v in d.items()))
    print(f"\ntotal {out['total_seconds']:.0f} s (capture {out['capture_seconds']:.0f}, eval {out['eval_seconds']:.0f})")

    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1, default=float), encoding="utf-8")
    print(f"wrote {a.out}", flush=True)


if __name__ == "__main__":
    main()

