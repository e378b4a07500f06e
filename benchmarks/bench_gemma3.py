"""Gemma 3 270M per layer type (issue 30): what the calibrator's per-type choices do on the real model.

Stages (each writes ``OUT/<stage>.json``; ``--stages`` picks some):

* ``skip``: ``kvcal calibrate --engine vllm --kv-cache-dtype fp8 --backend cpu --skip-layers auto --max-skip 3``
  on ``calibration_sets/text.jsonl``: the per-layer sensitivity probe (model-level KL with only that layer in
  fp8), summarised per layer type, the 16-bit layers chosen by count, and by a byte budget that averages bytes
  per token over the model's maximum context (a 16-bit sliding layer costs 0.079 of a global one there).
* ``window``: FP8 per-tensor calibration on 2,048-token samples (so sliding layers' queries reach past their
  512-token window) taken from WikiText-2 validation *after* the evaluated windows, twice: with each layer's
  objective masked as its attention reads (kvcal) and with the sliding windows ignored (every layer searched as
  full attention: ``kvcal.capture.run.attention_window`` patched to 0). Each artifact's per-layer attention
  errors (evaluate's per-layer pass, masked as the model reads) per type, and Protocol A at 2,048 tokens.
* ``int4``: ``--preset int4`` (pre-RoPE keys, one RoPE table per layer type) on ``text.jsonl`` and Protocol A
  at 8 x 1,024 WikiText tokens with every baseline (KIVI-4 among them).

    .venv/bin/python benchmarks/bench_gemma3.py [--out bench_out/gemma3] [--stages skip,window,int4] [--reuse]

Needs ``make gemma``. About 40 minutes on 2 shared CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
WIKI = REPO.parent / "shared" / "data" / "wikitext2_valid.txt"
MODEL = "gemma3-270m"
REUSE = False  # --reuse: a stage whose artifact exists evaluates it instead of calibrating again


def types_of(model) -> list[str]:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return list(cfg.layer_types)


def by_type(values, types) -> dict:
    out = {}
    for t in sorted(set(types)):
        xs = [float(v) for v, tt in zip(values, types, strict=True) if tt == t]
        out[t] = {"layers": [i for i, tt in enumerate(types) if tt == t], "mean": sum(xs) / len(xs),
                  "min": min(xs), "max": max(xs)}
    return out


def stage_skip(out: Path, model, tok) -> dict:
    from kvcal.artifact import load_artifact
    from kvcal.calibrate import CalibrateConfig, calibrate
    from kvcal.engines.vllm.memory import vllm_bytes_per_token, vllm_token_shares
    from kvcal.engines.vllm.skip_layers import budget_skip_layers, skip_costs

    types = types_of(model)
    t0 = time.perf_counter()
    calibrate(CalibrateConfig(corpus=str(REPO / "calibration_sets" / "text.jsonl"), out=str(out / "fp8-skip"),
                              model=MODEL, engine="vllm", kv_cache_dtype="fp8", backend="cpu", skip_layers="auto",
                              max_skip=3, overwrite=True), log=print, progress=False, model=model, tokenizer=tok)
    meta = load_artifact(out / "fp8-skip").metadata
    ch = meta["vllm"]["skip_layers_choice"]
    sens = ch["sensitivity"]
    cfg = model.config
    shares = vllm_token_shares(cfg)
    L = len(types)
    costs = skip_costs("fp8", L, 1, 256, shares)
    base = vllm_bytes_per_token(cfg, "fp8", (), context=cfg.max_position_embeddings)
    budgets = {}
    for extra in (costs[0], 3 * costs[0], costs[types.index("full_attention")]):
        skip = budget_skip_layers(sens, "fp8", L, 1, 256, max_bytes_per_token=base + extra, shares=shares)
        budgets[str(base + extra)] = {"skip": skip, "types": [types[i] for i in skip],
                                      "bytes_per_token": vllm_bytes_per_token(cfg, "fp8", skip,
                                                                              context=cfg.max_position_embeddings)}
    return {"seconds": round(time.perf_counter() - t0, 1), "sensitivity": sens, "by_type": by_type(sens, types),
            "chosen_max_skip_3": meta["vllm"]["skip_layers"], "chosen_types": [types[i] for i in meta["vllm"]["skip_layers"]],
            "bytes_per_token": ch["bytes_per_token"], "bytes_per_token_16bit": ch["bytes_per_token_16bit"],
            "bytes_per_token_context": ch.get("bytes_per_token_context"), "fp8_bytes_per_token": base,
            "skip_costs": costs, "by_budget": budgets}


def _tail_corpus(path: Path, start_char: int = 120_000, chars: int = 160_000) -> Path:
    """WikiText-2 validation text after the evaluated windows (8 x 2,048 tokens end well before character
    120,000), written to a temporary .txt for calibration."""
    text = WIKI.read_text(encoding="utf-8")[start_char:start_char + chars]
    path.write_text(text, encoding="utf-8")
    return path


def stage_window(out: Path, model, tok) -> dict:
    import kvcal.capture.run as run_mod
    from kvcal.calibrate import CalibrateConfig, calibrate
    from kvcal.evaluate.run import EvalConfig, evaluate

    types = types_of(model)
    corpus = _tail_corpus(out / "calib_tail.txt")
    res = {}
    real = run_mod.attention_window
    for name, blind in (("masked", False), ("blind", True)):
        t0 = time.perf_counter()
        if blind:
            run_mod.attention_window = lambda module: 0
        try:
            calibrate(CalibrateConfig(corpus=str(corpus), out=str(out / f"fp8-{name}"), model=MODEL, max_samples=12,
                                      max_seq_len=2048, search_tokens=2048, reservoir=4, heldout_reservoir=2,
                                      batch_size=1, overwrite=True), log=print, progress=False, model=model,
                      tokenizer=tok)
        finally:
            run_mod.attention_window = real
        doc = evaluate(EvalConfig(artifact=str(out / f"fp8-{name}"), corpus=str(WIKI), model=MODEL, contexts=(2048,),
                                  windows=4, modes=("teacher_forced",), baselines=False, per_layer_tokens=2048,
                                  accept="kl_mean<=1"), log=print, progress=False, model=model, tokenizer=tok)
        row = next(r for r in doc["results"] if r["method"] == "artifact")
        pl = doc["per_layer"]["artifact"]
        res[name] = {"seconds": round(time.perf_counter() - t0, 1), "kl_mean": row["kl_mean"],
                     "delta_ppl": row["delta_ppl"], "ppl": row["ppl"],
                     "k_attention_kl": by_type(pl["k_attention_kl"], types),
                     "v_output_error": by_type(pl["v_output_error"], types)}
    return res


def stage_int4(out: Path, model, tok) -> dict:
    from kvcal.calibrate import CalibrateConfig, calibrate
    from kvcal.evaluate.run import EvalConfig, evaluate

    t0 = time.perf_counter()
    if REUSE and (out / "int4" / "kv_scales.safetensors").is_file():
        print(f"--reuse: evaluating the existing {out / 'int4'}")
    else:
        calibrate(CalibrateConfig(corpus=str(REPO / "calibration_sets" / "text.jsonl"), out=str(out / "int4"),
                                  model=MODEL, preset="int4", overwrite=True), log=print, progress=False, model=model,
                  tokenizer=tok)
    t1 = time.perf_counter()
    doc = evaluate(EvalConfig(artifact=str(out / "int4"), corpus=str(WIKI), model=MODEL, contexts=(1024,), windows=8,
                              modes=("teacher_forced",), accept="kl_mean<=1"), log=print, progress=False,
                   model=model, tokenizer=tok)
    rows = {r["method"]: {k: r.get(k) for k in ("ppl", "delta_ppl", "kl_mean", "kl_p999", "top1_agree",
                                                  "bytes_per_token")} for r in doc["results"]}
    return {"calibrate_seconds": round(t1 - t0, 1), "evaluate_seconds": round(time.perf_counter() - t1, 1),
            "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_out/gemma3")
    ap.add_argument("--stages", default="skip,window,int4")
    ap.add_argument("--reuse", action="store_true", help="int4: evaluate an existing OUT/int4 artifact")
    a = ap.parse_args()
    global REUSE
    REUSE = a.reuse
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from kvcal.models import load_model, load_tokenizer

    model, tok = load_model(MODEL), load_tokenizer(MODEL)
    stages = {"skip": stage_skip, "window": stage_window, "int4": stage_int4}
    for s in a.stages.split(","):
        print(f"== {s}", flush=True)
        r = stages[s](out, model, tok)
        (out / f"{s}.json").write_text(json.dumps(r, indent=1))
        print(json.dumps(r, indent=1)[:3000], flush=True)


if __name__ == "__main__":
    main()
