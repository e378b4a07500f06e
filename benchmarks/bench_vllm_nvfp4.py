"""vLLM 0.33 ``--kv-cache-dtype nvfp4``: which NVFP4 outer scales (and q_scale), measured on held-out text.

Embedded SmolLM2-135M (fp32). Calibration: ``--calib`` windows of ``--seq-len`` tokens of
``../shared/data/wikitext2_valid.txt`` taken after the evaluation region (kvcal's capture, reservoir and
held-out split defaults). Evaluation: the first ``--eval`` windows of ``--eval-len`` tokens of the same file
(never seen by calibration), teacher-forced (Protocol A): every layer's K/V stored as vLLM stores NVFP4
(E2M1 in 16-channel blocks, e4m3 block scales computed at write time, the static outer scale) and, on
the SM100 path, the queries FP8-quantized with the layer's ``q_scale`` (:class:`kvcal.engines.vllm.plan.VllmKVPlan`).

Rows (outer scales = vLLM's per-layer ``k_scale``/``v_scale`` for an NVFP4 cache):
(a) amax rule: outer = calibration amax / 2688 (e4m3 max x E2M1 max), no q_scale → vLLM's 1.0;
(b) unity: no checkpoint scales (every scale 1.0, vLLM's default);
(c) kvcal ``calibrate --engine vllm --kv-cache-dtype nvfp4``: searched outer scales and q_scale;
(d) amax rule outer scales with kvcal's q_scale (isolates what the outer-scale search buys at equal q).
Each also with queries left in the model dtype (what SM80/90/120's FlashInfer fa2 path serves; q_scale
unused there, so only the outer scales differ).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_vllm_nvfp4.py [--calib 8] [--eval 4]
"""

from __future__ import annotations

import time

import torch


def main(argv=None):
    from _common import load_and_capture, window_parser

    a = window_parser(__doc__, calib=8).parse_args(argv)

    from kvcal.engines.vllm.plan import VllmKVPlan
    from kvcal.engines.vllm.search_nvfp4 import NVFP4_AMAX_DIVISOR, search_vllm_nvfp4
    from kvcal.evaluate.protocol_a import teacher_forced

    t0 = time.perf_counter()
    s = load_and_capture(a)
    model, ev, cal, held, cap, d, L = s.model, s.ev, s.cal, s.held, s.cap, s.cfg, s.num_layers
    t1 = time.perf_counter()
    rows = search_vllm_nvfp4(cap, d.max_queries, progress=False)
    t_search = time.perf_counter() - t1

    amax = {s: [float(getattr(cap.stats, s)[i].finalize()["tensor_absmax"]) / NVFP4_AMAX_DIVISOR for i in range(L)]
            for s in "kv"}
    kq = [float(r["q"].scale.reshape(-1)[0]) for r in rows]
    configs = {
        "(a) amax/2688 outer, q_scale 1.0": dict(k_scales=amax["k"], v_scales=amax["v"]),
        "(b) unity (no checkpoint scales)": {},
        "(c) kvcal outer + q (--engine vllm)": dict(k_scales=[float(r["k"].scale[0]) for r in rows],
                                                    v_scales=[float(r["v"].scale[0]) for r in rows], q_scales=kq),
        "(d) amax/2688 outer, kvcal q_scale": dict(k_scales=amax["k"], v_scales=amax["v"], q_scales=kq),
    }
    plans = {}
    for name, kw in configs.items():
        plans[name] = VllmKVPlan("nvfp4", L, quantize_query=True, **kw)
        plans[name + " [fa2: queries 16-bit]"] = VllmKVPlan("nvfp4", L, quantize_query=False, **kw)
    res = teacher_forced(model, ev, plans, batch_size=1, progress=False)
    names = list(configs)
    print(f"model: SmolLM2-135M fp32, {L} layers; calibration {len(cal)} windows of {a.seq_len} tokens of "
          f"wikitext2_valid ({len(cal) - len(held)} calib / {len(held)} held-out); evaluation {ev.shape[0]} x "
          f"{ev.shape[1]} tokens (first windows, disjoint); search {t_search:.1f} s; total "
          f"{time.perf_counter() - t0:.0f} s\n")
    print("| scales (vLLM nvfp4) | mean KL, FP8 queries (SM100) | ΔPPL | mean KL, 16-bit queries (fa2) | ΔPPL "
          "| vs (a) SM100 / fa2 | vs (b) SM100 / fa2 |")
    print("|---|---|---|---|---|---|---|")
    ra, rb = res[names[0]], res[names[1]]
    ra0, rb0 = res[names[0] + " [fa2: queries 16-bit]"], res[names[1] + " [fa2: queries 16-bit]"]
    for name in names:
        r, r0 = res[name], res[name + " [fa2: queries 16-bit]"]
        print(f"| {name} | {r['kl_mean']:.4e} | {r['delta_ppl']:+.4f} | {r0['kl_mean']:.4e} | {r0['delta_ppl']:+.4f} | "
              f"{r['kl_mean'] / ra['kl_mean']:.3f}x / {r0['kl_mean'] / ra0['kl_mean']:.3f}x | "
              f"{r['kl_mean'] / rb['kl_mean']:.3f}x / {r0['kl_mean'] / rb0['kl_mean']:.3f}x |")
    for s in "kv":
        lab = [r[s].label[0] for r in rows]
        ratio = torch.tensor([float(r[s].clip_ratio[0]) for r in rows])
        print(f"\n{s.upper()} outer scale / (amax/2688) per layer: min {ratio.min():.3f} median {ratio.median():.3f} "
              f"max {ratio.max():.3f}; picks: " + ", ".join(f"{x} x{lab.count(x)}" for x in sorted(set(lab))))
    worse = [(r["layer"], s) for r in rows for s in "qkv"
             if r[s].heldout["chosen"] > min(r[s].heldout["absmax"], r[s].heldout["unity"])]
    print(f"layers whose held-out check is worse than amax rule or unity: {worse or 'none'}")
    for s, what in (("k", "attention KL per query"), ("v", "relative output error")):
        m = {w: sum(r[s].heldout[w] for r in rows) / L for w in ("chosen", "absmax", "unity")}
        print(f"{s.upper()} held-out {what}, mean over layers: chosen {m['chosen']:.4e}, amax rule {m['absmax']:.4e}, "
              f"unity {m['unity']:.4e}")
    print(f"attention-level held-out KL per query, mean over layers: FP8 queries alone "
          f"{sum(r['q_only'] for r in rows) / L:.3e}, NVFP4 keys alone {sum(r['kv_only'] for r in rows) / L:.3e}, "
          f"joint {sum(r['q'].heldout['chosen'] for r in rows) / L:.3e}")


if __name__ == "__main__":
    main()
