"""What each export target deploys, measured: a fresh calibration, `kvcal export` per target with default flags,
and each exported file's scales evaluated on text the calibration never saw, against no scales and absmax.

Embedded SmolLM2-135M (fp32). Calibration: `kvcal calibrate` (the API, default options: FP8 e4m3 per tensor) on
``--calib`` samples of at most ``--seq-len`` tokens of ``../shared/data/wikitext2_valid.txt`` *after* the
evaluation region (the text from the first character past the evaluation tokens, written to a temporary .txt
corpus). Export: `kvcal export --target T` with no other flag, for every target, standalone (no --model-dir).
Each export's scales are read back from the files it wrote (safetensors / JSON, by the names each engine loads,
independently of kvcal's exporters) and evaluated teacher-forced (Protocol A) on the first ``--eval`` windows of
``--eval-len`` tokens, one window at a time, with two cache writes:

* ``gpu``: kvcal's emulation (not an engine run) of vLLM 0.33's GPU write, FP8 e4m3 rounded to nearest with saturation and the queries FP8 at q_scale 1.0
  (:class:`kvcal.engines.vllm.plan.VllmKVPlan`, ``--kv-cache-dtype fp8``, backend ``cuda``) — what a vLLM user serves;
* ``kvcal``: kvcal's own runtime write (the same rounding, queries exact).

Rows: no scales (1.0, what vLLM does without a checkpoint scale), absmax (calibration amax / 448: llm-compressor's
rule), the artifact as searched, each target's default export, and — for comparison with kvcal before issue 38 —
the scales that `export --target vllm` used to write (every clipped scale raised to calibration max / 448).
Per row: mean KL over windows, the ratio to no scales with a 95% paired t-interval over windows (per-window KL
differences, Student t, n - 1 degrees of freedom, divided by the no-scale mean), and the ratio to the artifact.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/deployed_gain.py [--calib 64] [--eval 8] [--json out.json]

About 22 min on 2 CPU cores (calibration ~5.5 min; evaluation 16 min: 8 windows x 6 distinct scale sets x 2 writes).
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DATA  # noqa: E402  (benchmarks/ on the path)

TARGETS = ("vllm", "modelopt", "trtllm-legacy", "sglang-json")


def read_back(out: Path, target: str, num_layers: int) -> dict[str, list[float]]:
    """The per-layer K and V scales an export directory holds, read by the names each engine loads: ``{"k": [L],
    "v": [L]}`` floats (one shared value per layer for trtllm-legacy and sglang-json, used for both sides)."""
    from safetensors.torch import load_file

    if target == "sglang-json":
        doc = json.loads((out / "kv_cache_scales.json").read_text())
        s = [float(doc["kv_cache"]["scaling_factor"]["0"][str(i)]) for i in range(num_layers)]
        return {"k": s, "v": list(s)}
    t = {}
    for f in sorted(out.glob("*.safetensors")):
        t.update(load_file(str(f)))
    if target == "trtllm-legacy":
        s = [float(t[f"transformer.layers.{i}.attention.kv_cache_scaling_factor"]) for i in range(num_layers)]
        return {"k": s, "v": list(s)}
    name = ("model.layers.{i}.self_attn.{s}_scale" if target == "vllm" else "model.layers.{i}.self_attn.{s}_proj.{s}_scale")
    return {s: [float(t[name.format(i=i, s=s)].reshape(-1)[0]) for i in range(num_layers)] for s in "kv"}


def fp8_plan(scales: dict[str, list[float]]):
    """A per-tensor FP8 e4m3 :class:`~kvcal.plan.KVPlan` with these per-layer scales."""
    from kvcal.formats.spec import preset
    from kvcal.plan import KVPlan

    plan = KVPlan.uniform(len(scales["k"]), preset("fp8"))
    for i, lp in enumerate(plan.layers):
        lp.k.scale = torch.tensor(scales["k"][i], dtype=torch.float32).reshape(1, 1, 1, 1)
        lp.v.scale = torch.tensor(scales["v"][i], dtype=torch.float32).reshape(1, 1, 1, 1)
    return plan


def t_interval(diffs: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """Mean and two-sided ``level`` Student-t interval of paired per-window differences."""
    from scipy import stats

    n = len(diffs)
    m = sum(diffs) / n
    if n < 2:
        return m, -math.inf, math.inf
    sd = math.sqrt(sum((d - m) ** 2 for d in diffs) / (n - 1))
    h = stats.t.ppf(0.5 + level / 2, n - 1) * sd / math.sqrt(n)
    return m, m - h, m + h


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calib", type=int, default=64, help="calibration samples (kvcal calibrate --max-samples)")
    ap.add_argument("--seq-len", type=int, default=512, help="kvcal calibrate --max-seq-len")
    ap.add_argument("--eval", type=int, default=8, help="evaluation windows (never seen by calibration)")
    ap.add_argument("--eval-len", type=int, default=1024)
    ap.add_argument("--json", default=None, help="also write the figures here")
    a = ap.parse_args(argv)

    from kvcal.artifact import load_artifact
    from kvcal.calibrate import CalibrateConfig, calibrate
    from kvcal.engines.vllm.plan import VllmKVPlan
    from kvcal.evaluate.protocol_a import teacher_forced
    from kvcal.evaluate.windows import cut_windows
    from kvcal.export import export
    from kvcal.models import load_model, load_tokenizer

    t0 = time.perf_counter()
    tok, model = load_tokenizer(None), load_model(None)
    text = DATA.read_text(encoding="utf-8")
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = torch.tensor(enc["input_ids"], dtype=torch.long)
    ev = cut_windows(ids, a.eval_len, a.eval)
    n_eval_tok = ev.numel()
    cut = enc["offset_mapping"][n_eval_tok][0]  # first character after the evaluation tokens
    work = Path(tempfile.mkdtemp(prefix="kvcal-deployed-"))
    corpus = work / "wikitext2_after_eval.txt"
    corpus.write_text(text[cut:], encoding="utf-8")
    art_dir = work / "artifact"
    calibrate(CalibrateConfig(corpus=str(corpus), out=str(art_dir), max_samples=a.calib, max_seq_len=a.seq_len),
              model=model, tokenizer=tok, log=lambda s: None, progress=False)
    t_cal = time.perf_counter() - t0
    art = load_artifact(art_dir)
    L = art.num_layers
    sets: dict[str, dict[str, list[float]]] = {}
    sets["no scales (1.0)"] = {"k": [1.0] * L, "v": [1.0] * L}
    amax = {s: [max(lm[s]["amax"]) for lm in art.metadata["layers"]] for s in "kv"}
    sets["absmax (amax/448)"] = {s: [x / 448.0 for x in amax[s]] for s in "kv"}
    searched = {s: [float(art.scale(i, s).reshape(-1)[0]) for i in range(L)] for s in "kv"}
    sets["artifact (as searched)"] = searched
    sets["old export --target vllm (raised)"] = {s: [max(searched[s][i], amax[s][i] / 448.0) for i in range(L)]
                                                  for s in "kv"}
    manifests = {}
    for t in TARGETS:
        out = work / f"export-{t}"
        export(str(art_dir), t, str(out))
        sets[f"export {t}"] = read_back(out, t, L)
        manifests[t] = json.loads((out / "kvcal-export.json").read_text())["scales"]
    # one evaluation per distinct scale set and write path; identical sets share it
    distinct: dict[tuple, str] = {}
    for name, sc in sets.items():
        distinct.setdefault((tuple(sc["k"]), tuple(sc["v"])), name)
    plans = {}
    for name in distinct.values():
        p = fp8_plan(sets[name])
        plans[("kvcal", name)] = p
        plans[("gpu", name)] = VllmKVPlan.from_kvcal_plan("fp8", p, backend="cuda")[0]
    per_window: dict[tuple, list[float]] = {k: [] for k in plans}
    t1 = time.perf_counter()
    for w in range(len(ev)):
        res = teacher_forced(model, ev[w:w + 1], {f"{k[0]}|{k[1]}": p for k, p in plans.items()}, progress=False)
        for k in plans:
            per_window[k].append(res[f"{k[0]}|{k[1]}"]["kl_mean"])
    t_eval = time.perf_counter() - t1
    rows = []
    for write in ("gpu", "kvcal"):
        base = per_window[(write, distinct[(tuple(sets["no scales (1.0)"]["k"]), tuple(sets["no scales (1.0)"]["v"]))])]
        artw = per_window[(write, "artifact (as searched)")]
        for name, sc in sets.items():
            kl = per_window[(write, distinct[(tuple(sc["k"]), tuple(sc["v"]))])]
            m0 = sum(base) / len(base)
            d, lo, hi = t_interval([x - y for x, y in zip(kl, base, strict=True)])
            km = sum(kl) / len(kl)
            rows.append({"write": write, "scales": name, "kl_mean": km, "vs_none": km / m0,
                         "vs_none_ci95": [1 + lo / m0, 1 + hi / m0], "vs_artifact": km / (sum(artw) / len(artw)),
                         "changed_vs_artifact": sum(1 for s in "kv" for i in range(L) if sc[s][i] != searched[s][i])})
    doc = {"model": "smollm2-135m", "calibration": {"corpus": f"{DATA.name} after the first {n_eval_tok} tokens",
                                                    "max_samples": a.calib, "max_seq_len": a.seq_len,
                                                    "seconds": round(t_cal, 1)},
           "evaluation": {"windows": len(ev), "tokens_per_window": a.eval_len, "seconds": round(t_eval, 1)},
           "export_scales": manifests, "rows": rows}
    print(f"calibration {t_cal:.0f} s; evaluation {len(ev)} x {a.eval_len} tokens, {len(distinct)} distinct scale sets, "
          f"{t_eval:.0f} s")
    print(f"{'write':6} {'scales':36} {'changed':>7} {'KL mean':>10} {'vs none [95% CI]':>24} {'vs artifact':>11}")
    for r in rows:
        lo, hi = r["vs_none_ci95"]
        print(f"{r['write']:6} {r['scales']:36} {r['changed_vs_artifact']:>7} {r['kl_mean']:>10.4e} "
              f"{r['vs_none']:>8.3f}x [{lo:.3f}, {hi:.3f}] {r['vs_artifact']:>10.4f}x")
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
