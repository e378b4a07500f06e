"""vLLM's 16-bit layers chosen by a measured probe (``--skip-layers auto``) vs vLLM's fixed first-2/last-2 rule.

For each ``--kv-cache-dtype`` (default ``turboquant_4bit_nc``) on the embedded model: the per-layer
sensitivity ``s_l`` (Protocol-A KL with only layer ``l`` quantized, :func:`kvcal.engines.vllm.probe.layer_sensitivity`)
on ``--probe-windows`` WikiText windows; then Protocol A (:func:`kvcal.evaluate.teacher_forced`) on the
next ``--windows`` windows (disjoint) for

* the rule: first 2 + last 2 layers at 16 bits (what vLLM 0.33 always does for turboquant);
* auto at the same 4 layers (:func:`kvcal.search.skip_layers.choose_skip_layers`, no forced layers —
  for turboquant not deployable on stock vLLM 0.33, which always adds the rule's layers);
* the memory/quality curve: auto with 0..6 layers at 16 bits.

Every row at equal count has equal bytes per token (uniform layers). Prints one markdown table per dtype.

The additive model the choice rests on (keeping layer ``l`` at 16 bits removes ``s_l`` from the all-layers
KL) also bounds what any choice can reach: with ``K_all`` the probe KL when every layer goes through the dtype,
no 4-layer set is predicted below ``K_all − Σ(top-4 s_l)`` (auto's own set), so the benchmark prints the
predicted KL ratio of auto (4) to the rule — the best ratio any 4 layers can give under that model, measured
on the probe windows — beside the measured one (how far the model holds on the evaluation windows).

``--oracle`` also measures every layer's sensitivity on the *evaluation* windows themselves (KL and ΔNLL
with only that layer through the dtype — information no deployable probe has) and evaluates the 4 layers they
rank highest ("oracle-KL (4)", "oracle-ΔNLL (4)"), with the additive model's ΔPPL prediction for the best
4-layer set on those windows: an upper bound on what any probe of single-layer sensitivities could reach.

``--scales-from DIR``: a ``kvcal calibrate --engine vllm --kv-cache-dtype nvfp4`` (or fp8) artifact whose
static scales every plan of that dtype uses (probe and evaluation alike) instead of vLLM's default 1.0.

Each evaluation window is its own Protocol-A run, so the benchmark also gives the paired standard error of
the ΔNLL (nats/token) between auto (4) and the rule across windows — how far a ΔPPL ratio is from noise —
and ``ΔPPL ≈ PPL_16 · ΔNLL`` for the ratio's spread.

    .venv/bin/python benchmarks/bench_vllm_skip.py [--dtypes turboquant_4bit_nc,int4_per_token_head]
        [--tokens 512] [--probe-windows 2] [--windows 16] [--max-skip 6] [--no-curve] [--oracle]
        [--scales-from ARTIFACT_DIR]
"""

from __future__ import annotations

import argparse
import math
import time

import torch


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--text", default="../shared/data/wikitext2_valid.txt")
    ap.add_argument("--dtypes", default="turboquant_4bit_nc")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--probe-windows", type=int, default=2)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--max-skip", type=int, default=6)
    ap.add_argument("--no-curve", action="store_true", help="only the rule and auto at 4 layers (no 0..max-skip curve)")
    ap.add_argument("--oracle", action="store_true",
                    help="also rank layers by their sensitivity on the evaluation windows (an upper bound)")
    ap.add_argument("--scales-from", default=None, help="calibrated kvcal artifact (nvfp4 or fp8) for static scales")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)

    from kvcal.engines.vllm.memory import vllm_bytes_per_token
    from kvcal.engines.vllm.plan import VllmKVPlan
    from kvcal.engines.vllm.probe import layer_sensitivity, vllm_scales
    from kvcal.engines.vllm.skip_layers import probe_plans, rule_skip_layers, skip_costs
    from kvcal.evaluate.protocol_a import plans_kl, plans_kl_nll, teacher_forced
    from kvcal.evaluate.windows import cut_windows
    from kvcal.formats.memory import model_shape
    from kvcal.models import load_model, load_tokenizer
    from kvcal.search.skip_layers import choose_skip_layers

    tok = load_tokenizer(a.model)
    model = load_model(a.model)
    shp = model_shape(model.config)
    L = shp.num_layers
    text = open(a.text, encoding="utf-8").read()
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    probe = cut_windows(ids, a.tokens, a.probe_windows)
    ev = cut_windows(ids, a.tokens, a.windows, skip=a.probe_windows)
    b16 = vllm_bytes_per_token(model.config, "fp8", range(L))
    print(f"model {a.model}: {L} layers; probe {len(probe)} x {a.tokens} tokens, evaluation {len(ev)} x {a.tokens} "
          f"tokens of {a.text} (after the probe windows); 16-bit cache {b16} bytes/token")
    for d in [x.strip() for x in a.dtypes.split(",") if x.strip()]:
        t0 = time.perf_counter()
        sc = {}
        if a.scales_from:
            from kvcal.artifact import load_artifact

            art = load_artifact(a.scales_from)
            sc = vllm_scales(d, art.tensors, art.metadata, L)
            print(f"{d}: static scales from {a.scales_from}")
        sens = layer_sensitivity(model, list(probe), d, L, progress=False, **sc)
        k_all = plans_kl(model, list(probe), {"all": VllmKVPlan(d, L, add_boundary=False, **sc)}, progress=False)["all"]
        costs = skip_costs(d, L, shp.num_kv_heads, shp.head_dim)
        plans = {"rule (4)": tuple(rule_skip_layers(L, 4))}
        for n in ((4,) if a.no_curve else range(a.max_skip + 1)):
            plans[f"auto ({n})"] = tuple(choose_skip_layers(sens, costs, max_skip=n))
        if a.oracle:
            ev_plans = {**probe_plans(d, L, **sc), "all": VllmKVPlan(d, L, add_boundary=False, **sc)}
            kl_e, nll_e = plans_kl_nll(model, list(ev), ev_plans, progress=False)
            dnll_e = {i: nll_e[i] - nll_e["16-bit"] for i in range(L)}
            plans["oracle-KL (4)"] = tuple(sorted(sorted(range(L), key=lambda i: -kl_e[i])[:4]))
            plans["oracle-ΔNLL (4)"] = tuple(sorted(sorted(range(L), key=lambda i: -dnll_e[i])[:4]))
        vplans = {k: VllmKVPlan(d, L, skip_layers=s, add_boundary=False, **sc) for k, s in plans.items()}
        per = [teacher_forced(model, ev[w:w + 1], vplans, progress=False) for w in range(len(ev))]
        res = _pool(per)
        order = sorted(range(L), key=lambda i: -sens[i])
        print(f"\n### {d}  ({time.perf_counter() - t0:.0f} s)\n")
        print("most sensitive layers (probe KL, nats): "
              + ", ".join(f"{i}: {sens[i]:.2e}" for i in order[:8]))
        print(f"16-bit PPL {res['16-bit']['ppl']:.4f}\n")
        print("| 16-bit layers | choice | bytes/token | vs 16-bit | KL mean | ΔPPL | top-1 |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for k, s in plans.items():
            r = res[k]
            nb = vllm_bytes_per_token(model.config, d, s, add_boundary=False)
            print(f"| {','.join(map(str, s)) or '-'} | {k} | {nb} | {nb / b16:.3f} | {r['kl_mean']:.3e} | "
                  f"{r['delta_ppl']:+.4f} | {r['top1_agree']:.4f} |")
        pred = {k: k_all - sum(sens[i] for i in plans[k]) for k in ("rule (4)", "auto (4)")}
        print(f"\nadditive model on the probe windows: all layers {k_all:.3e}; predicted rule {pred['rule (4)']:.3e}, "
              f"best 4 layers (auto) {pred['auto (4)']:.3e} -> the lowest 4-layer KL ratio it predicts "
              f"{pred['auto (4)'] / pred['rule (4)']:.2f} (measured on the evaluation windows: "
              f"{res['auto (4)']['kl_mean'] / res['rule (4)']['kl_mean']:.2f})")
        if a.oracle:
            p16 = res["16-bit"]["ppl"]
            all_d = nll_e["all"] - nll_e["16-bit"]
            top = plans["oracle-ΔNLL (4)"]
            pred_ppl = p16 * math.exp(all_d - sum(dnll_e[i] for i in top))
            rule_pred = p16 * math.exp(all_d - sum(dnll_e[i] for i in plans["rule (4)"]))
            print("oracle (layer sensitivities measured on the evaluation windows): ΔNLL per layer (nats/token) "
                  + ", ".join(f"{i}: {dnll_e[i]:+.2e}" for i in sorted(range(L), key=lambda i: -dnll_e[i])[:8])
                  + f"; all layers {all_d:+.3e}")
            print(f"additive ΔNLL model on the evaluation windows: rule ΔPPL {rule_pred - p16:+.4f}, best 4 layers "
                  f"{top} ΔPPL {pred_ppl - p16:+.4f} -> predicted best ratio to the measured rule "
                  f"{(pred_ppl - p16) / res['rule (4)']['delta_ppl']:.2f}, to the predicted rule "
                  f"{(pred_ppl - p16) / (rule_pred - p16):.2f}")
            for k in ("oracle-KL (4)", "oracle-ΔNLL (4)"):
                print(f"{k} {plans[k]}: ΔPPL ratio to the rule {res[k]['delta_ppl'] / res['rule (4)']['delta_ppl']:.2f}, "
                      f"KL ratio {res[k]['kl_mean'] / res['rule (4)']['kl_mean']:.2f}")
        rd, ad = res["rule (4)"]["delta_ppl"], res["auto (4)"]["delta_ppl"]
        # paired difference of per-window mean NLL (equal tokens per window): auto (4) minus rule
        diff = [math.log(p["auto (4)"]["ppl"]) - math.log(p["rule (4)"]["ppl"]) for p in per]
        m = sum(diff) / len(diff)
        se = (sum((x - m) ** 2 for x in diff) / (len(diff) - 1)) ** 0.5 / len(diff) ** 0.5 if len(diff) > 1 else float("nan")
        print(f"auto vs rule at 4 layers: ΔPPL {ad:+.4f} vs {rd:+.4f} (ratio {ad / rd if rd else float('nan'):.2f}); "
              f"KL {res['auto (4)']['kl_mean']:.3e} vs {res['rule (4)']['kl_mean']:.3e} "
              f"(ratio {res['auto (4)']['kl_mean'] / res['rule (4)']['kl_mean']:.2f}); ΔNLL(auto - rule) {m:+.2e} "
              f"± {se:.1e} nats/token (paired s.e. over {len(diff)} windows; ≈ ±{res['16-bit']['ppl'] * se:.3f} PPL)")


def _pool(per: list[dict]) -> dict:
    """Pool per-window :func:`kvcal.evaluate.protocol_a.teacher_forced` results (equal window lengths):
    PPL from the mean NLL, KL and top-1 as token-weighted means, ΔPPL against the pooled 16-bit PPL."""
    out = {}
    for k in per[0]:
        n = sum(p[k]["tokens"] for p in per)
        nll = sum(math.log(p[k]["ppl"]) * p[k]["tokens"] for p in per) / n
        out[k] = {"ppl": math.exp(nll), "tokens": n,
                  "kl_mean": sum(p[k]["kl_mean"] * p[k]["tokens"] for p in per) / n,
                  "top1_agree": sum(p[k]["top1_agree"] * p[k]["tokens"] for p in per) / n}
    for k in out:
        out[k]["delta_ppl"] = out[k]["ppl"] - out["16-bit"]["ppl"]
    return out


if __name__ == "__main__":
    main()
