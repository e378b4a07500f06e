"""vLLM 0.33 ``--kv-cache-dtype fp8`` with FP8 queries: which k/v/q scales, measured on held-out text.

Embedded SmolLM2-135M (fp32). Calibration: ``--calib`` windows of ``--seq-len`` tokens of
``../shared/data/wikitext2_valid.txt`` taken after the evaluation region (kvcal's capture, reservoir and
held-out split defaults). Evaluation: the first ``--eval`` windows of ``--eval-len`` tokens of the same
file (never seen by calibration), teacher-forced (Protocol A) with every layer's K/V stored as vLLM
stores them and the queries FP8-quantized with the layer's ``q_scale`` (:class:`kvcal.engines.vllm.plan.VllmKVPlan`).

Rows: (a) llm-compressor-style checkpoint (k/v = calibration amax/448 per tensor, no q_scale → vLLM's 1.0);
(b) no checkpoint scales (unity); (c) kvcal ``calibrate --engine vllm --kv-cache-dtype fp8`` k/v/q scales;
(d) kvcal's K/V-only search (exact queries in the key objective) with q_scale 1.0 — what an artifact
without q_scale gives vLLM. Each also without query quantization, so the difference is the KL the
query quantization adds.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_vllm_fp8.py [--calib 32] [--eval 4] [--granularity tensor|head]

(OMP_NUM_THREADS=1: on a shared 2-core machine torch's 2-thread pool spin-waits; the search ran ~20x slower.)
About 10 min wall (3.5 min CPU) on the shared 2-core CPU at load average ~14.
"""

from __future__ import annotations

import time

import torch


def main(argv=None):
    from _common import load_and_capture, window_parser

    ap = window_parser(__doc__, calib=32)
    ap.add_argument("--granularity", default="tensor", choices=("tensor", "head"))
    ap.add_argument("--calib-corpus", default=None,
                    help="calibrate on this kvcal corpus instead (e.g. calibration_sets/chat.jsonl: how it transfers)")
    a = ap.parse_args(argv)

    from kvcal.engines.vllm.plan import VllmKVPlan
    from kvcal.engines.vllm.search_fp8 import search_vllm_fp8
    from kvcal.evaluate.protocol_a import teacher_forced
    from kvcal.search.fp8 import search_scales

    t0 = time.perf_counter()
    s = load_and_capture(a, a.calib_corpus)
    model, ev, cal, held, cap, d, L = s.model, s.ev, s.cal, s.held, s.cap, s.cfg, s.num_layers
    per_head = a.granularity == "head"
    t1 = time.perf_counter()
    rows = search_vllm_fp8(cap, per_head, d.max_queries, progress=False)
    t_search = time.perf_counter() - t1
    kvrows = search_scales(cap, "fp8_e4m3", per_head, d.max_queries, progress=False)

    def sc(t):
        t = t.float().reshape(-1)
        return float(t[0]) if t.numel() == 1 else t

    amax = {s: [float(getattr(cap.stats, s)[i].finalize()["tensor_absmax"]) / 448.0 for i in range(L)] for s in "kv"}
    configs = {
        "(a) llm-compressor k/v=amax/448, q_scale 1.0": dict(k_scales=amax["k"], v_scales=amax["v"]),
        "(b) unity (no checkpoint scales)": {},
        "(c) kvcal k/v/q (--engine vllm)": dict(k_scales=[sc(r["k"].scale) for r in rows],
                                                v_scales=[sc(r["v"].scale) for r in rows],
                                                q_scales=[sc(r["q"].scale) for r in rows]),
        "(d) kvcal k/v search, q_scale 1.0": dict(k_scales=[sc(r["k"].scale) for r in kvrows],
                                                  v_scales=[sc(r["v"].scale) for r in kvrows]),
    }
    plans = {}
    for name, kw in configs.items():
        plans[name] = VllmKVPlan("fp8", L, quantize_query=True, **kw)
        plans[name + " [no q quant]"] = VllmKVPlan("fp8", L, quantize_query=False, **kw)
    res = teacher_forced(model, ev, plans, batch_size=1, progress=False)
    ra, rb = res[list(configs)[0]]["kl_mean"], res[list(configs)[1]]["kl_mean"]
    print(f"model: SmolLM2-135M fp32, {L} layers; calibration {len(cal)} samples of <= {a.seq_len} tokens "
          f"({a.calib_corpus or 'wikitext2_valid windows'}, {sum(len(x) for x in cal)} tokens) "
          f"({len(cal) - len(held)} calib / {len(held)} held-out samples); evaluation {ev.shape[0]} x {ev.shape[1]} "
          f"tokens (first windows, disjoint); granularity {a.granularity}; search {t_search:.1f} s; "
          f"total {time.perf_counter() - t0:.0f} s\n")
    print("| scales (vLLM fp8, FP8 queries) | mean KL (nats) | ΔPPL | KL without query quant | added by query quant "
          "| vs (a) | vs (b) |")
    print("|---|---|---|---|---|---|---|")
    for name in configs:
        r, r0 = res[name], res[name + " [no q quant]"]
        print(f"| {name} | {r['kl_mean']:.3e} | {r['delta_ppl']:+.4f} | {r0['kl_mean']:.3e} | "
              f"{r['kl_mean'] - r0['kl_mean']:+.3e} ({100 * (r['kl_mean'] - r0['kl_mean']) / r['kl_mean']:.0f}%) "
              f"| {r['kl_mean'] / ra:.2f}x | {r['kl_mean'] / rb:.2f}x |")
    qs = torch.tensor([float(r["q"].scale.max()) for r in rows])
    qa = torch.tensor([float(r["q"].amax.max()) for r in rows])
    print(f"\nq_scale per layer: min {qs.min():.4g} median {qs.median():.4g} max {qs.max():.4g} "
          f"(query absmax/448: median {(qa / 448).median():.4g}); q labels: "
          + ", ".join(sorted({lab for r in rows for lab in r["q"].label})))
    worse = [r["layer"] for r in rows for s in "qk" if r[s].heldout["chosen"] > min(r[s].heldout["absmax"],
                                                                                    r[s].heldout["unity"])]
    print(f"layers whose held-out attention KL is worse than absmax or unity (q or k): {worse or 'none'}")
    print(f"attention-level held-out KL per query, mean over layers: query quant alone "
          f"{sum(r['q_only'] for r in rows) / L:.3e}, K/V alone {sum(r['kv_only'] for r in rows) / L:.3e}, "
          f"joint {sum(r['q'].heldout['chosen'] for r in rows) / L:.3e}")


if __name__ == "__main__":
    main()
