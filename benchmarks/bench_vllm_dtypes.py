"""SQNR and Protocol-A KL of vLLM 0.33's KV-cache dtypes, as kvcal emulates them.

Per ``--kv-cache-dtype`` (static scales at vLLM's default 1.0, no checkpoint):

1. SQNR (dB) of K and V on a seeded Gaussian tensor ``[1, 3, 512, 64]`` (N(0,1), plus one outlier
   channel at 20σ in the keys) — format behaviour alone;
2. with ``--model``: SQNR on post-RoPE K/V captured from WikiText windows, and the Protocol-A mean
   KL (nats) and ΔPPL of the model with every layer's cache under that dtype (FP8 query
   quantization with q_scale 1.0 where vLLM applies it; turboquant with vLLM's 4 boundary layers
   in 16 bits), and bytes/token as vLLM allocates them.

    .venv/bin/python benchmarks/bench_vllm_dtypes.py [--model smollm2-135m] [--windows 2] [--tokens 512]
        [--dtypes nvfp4,nvfp4_4over6]
"""

from __future__ import annotations

import argparse
import time

import torch

from kvcal.engines.vllm import dtypes as V


def sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return float(10 * torch.log10(x.pow(2).sum() / (x - y).pow(2).sum().clamp_min(1e-300)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="also measure captured K/V and Protocol-A KL on this model")
    ap.add_argument("--text", default="../shared/data/wikitext2_valid.txt")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--dtypes", default=",".join(V.VLLM_DTYPES),
                    help="comma-separated --kv-cache-dtype names to measure (default: all)")
    a = ap.parse_args(argv)
    names = [n.strip() for n in a.dtypes.split(",") if n.strip()]
    unknown = [n for n in names if n not in V.VLLM_DTYPES]
    if unknown:
        ap.error(f"unknown --dtypes {unknown}; choose from {', '.join(V.VLLM_DTYPES)}")

    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 3, 512, 64, generator=g)
    v = torch.randn(1, 3, 512, 64, generator=g)
    k[..., 7] *= 20.0  # one outlier channel in the keys
    synth = {n: tuple(map(sqnr_db, (k, v), V.fake_quant_kv(n, k, v))) for n in names}

    captured, kl = {}, {}
    if a.model:
        from pathlib import Path

        from kvcal.capture.hooks import capture_kv
        from kvcal.engines.vllm.memory import vllm_bytes_per_token
        from kvcal.engines.vllm.plan import VllmKVPlan
        from kvcal.evaluate.protocol_a import teacher_forced
        from kvcal.evaluate.windows import text_windows
        from kvcal.models import load_model, load_tokenizer

        model, tok = load_model(a.model), load_tokenizer(a.model)
        wins = text_windows(tok, Path(a.text).read_text(encoding="utf-8"), a.tokens, a.windows)
        L = model.config.num_hidden_layers
        ks, vs = {}, {}

        def on_layer(i, q, kk, vv, module):
            ks.setdefault(i, []).append(kk.float())
            vs.setdefault(i, []).append(vv.float())

        with torch.no_grad(), capture_kv(model, on_layer):
            model(wins[:1], use_cache=False)
        for n in names:
            num = {"k": 0.0, "v": 0.0}
            den = {"k": 0.0, "v": 0.0}
            for i in range(L):
                kk, vv = ks[i][0], vs[i][0]
                kh, vh = V.fake_quant_kv(n, kk, vv)
                for s, x, y in (("k", kk, kh), ("v", vv, vh)):
                    num[s] += float(x.double().pow(2).sum())
                    den[s] += float((x.double() - y.double()).pow(2).sum())
            captured[n] = tuple(10 * torch.log10(torch.tensor(num[s] / den[s])).item() for s in ("k", "v"))
        plans = {n: VllmKVPlan(n, L) for n in names}
        if "fp8" in names:
            plans["fp8 (K/V only, queries 16-bit)"] = VllmKVPlan("fp8", L, quantize_query=False)
        t0 = time.perf_counter()
        res = teacher_forced(model, wins, plans, progress=False)
        kl = {n: (res[n]["kl_mean"], res[n]["delta_ppl"]) for n in plans}
        bpt = {n: vllm_bytes_per_token(model.config, n) for n in names}
        print(f"# {a.model}: {len(wins)} WikiText windows x {a.tokens} tokens, Protocol A in "
              f"{time.perf_counter() - t0:.0f}s; captured K/V = layer-summed SQNR on window 1")

    print("| --kv-cache-dtype | synth K dB | synth V dB |" + (" captured K dB | captured V dB | KL mean | ΔPPL |"
                                                           " bytes/token |" if a.model else ""))
    print("|---|---|---|" + ("---|---|---|---|---|" if a.model else ""))
    for n in [*names, *(["fp8 (K/V only, queries 16-bit)"] if a.model and "fp8" in names else [])]:
        row = f"| {n} | " + (" | ".join(f"{x:.2f}" for x in synth[n]) if n in synth else "= fp8 | = fp8")
        if a.model:
            c = captured.get(n)
            row += " | " + (" | ".join(f"{x:.2f}" for x in c) if c else "= fp8 | = fp8")
            row += f" | {kl[n][0]:.3e} | {kl[n][1]:+.4f} | {bpt[n] if n in bpt else bpt['fp8']}"
        print(row + " |")


if __name__ == "__main__":
    main()
