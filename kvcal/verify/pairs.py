"""``kvcal verify --engine E`` for an engine that takes no calibrated scale (llama.cpp): serve the same windows with
each K/V cache-type pair and check served = predicted, pair by pair.

llama.cpp loads no KV-cache scale from a model file: ``-ctk``/``-ctv`` pick a ggml block format whose per-block
fp16 scale is computed when a row is written. There is no checkpoint to verify, only kvcal's *emulation* of each
pair's cache (:class:`kvcal.engines.llamacpp.plan.LlamaCppKVPlan`), which is what ``kvcal recommend --engine
llamacpp`` ranks pairs by. This module reaches the engine only through its facade
(``kvcal.engines.engine(name)``: ``RUNNER``, ``pair_plan``, ``parse_pair``, ``kv_bytes``, ``gguf_matmul_inputs``,
``MatmulInputs``, ``BUILD_HINT``).

Pipeline (:func:`verify_pairs`):

1. Cut the windows as ``kvcal evaluate`` does (:func:`kvcal.evaluate.windows.corpus_stream`,
   :func:`~kvcal.evaluate.windows.cut_windows`, the BOS of :func:`~kvcal.evaluate.windows.served_bos`).
2. Serve them in the engine's own Python (its ``RUNNER``, a subprocess: llama-cpp-python, ``flash_attn`` on,
   ``logits_all``, ``n_ctx = n_batch = n_ubatch =`` the window): the engine's ``f16``/``f16`` cache is the
   reference; per pair and window the served mean ``KL(P_ref ‖ P_pair)`` (nats per token) and the NLLs.
3. Predict: kvcal's Protocol A KL of ``pair_plan(type_k, type_v, L, architecture=...)`` (the GGUF's
   ``general.architecture`` sets the order llama.cpp holds each query/key head in) against kvcal's unquantized run of the same
   model (the GGUF's weights dequantized) on the same token ids (:class:`kvcal.evaluate.sequential.WindowedRows`,
   per-window ``kl_mean``), with every weight matmul's input rounded as llama.cpp's CPU backend rounds it (the
   facade's ``MatmulInputs``: ``ggml_compute_forward_mul_mat`` converts each input row to the weight type's
   ``vec_dot_type`` — ``q8_1`` for Q4_1 weights, ``q8_0`` for Q8_0/Q4_0/Q5_0, ``q8_K`` for K-quants — before the dot
   products). A cache error moves activations across those roundings, so on a quantized-weight GGUF the rounding
   is part of what a cache type costs (``docs/results.md``, llama.cpp section). The float32-input prediction is
   reported beside it (``--floor-windows`` windows, default 2).
4. Judge each pair with :func:`kvcal.verify.figures.agreement` (tolerance below).

**Tolerance** (``docs/serving.md#llamacpp-served-vs-predicted``). Per window ``w`` the paired difference
``d_w = served_w − predicted_w`` (same windows, same tokens). When the emulation is right, ``d`` is non-zero
because the quantization errors of the two runs are different draws — llama.cpp's K/V values are not kvcal's to
the last bit (f32 summation orders), so each block can round differently — which varies from window to window and
averages out; the windows are independent samples of the corpus, so the mean ``d̄`` has the 99% paired t-interval
``h = t_{0.995, N−1} · sd(d_w) / √N``, and the tolerance is ``h``. A missing emulation detail moves every window the
same way and lands outside it. FAIL when ``|d̄| > h``. A pair that agrees is INCONCLUSIVE (agreeing, but not a test
of the emulation) when the tolerance is not below the predicted KL itself (``resolve``: the check could not tell
this cache from no cache quantization at all), else PASS.

Where some weight matmul takes an input type kvcal does not emulate (listed in ``prediction.not_emulated``), the
float32-input prediction is judged instead, with ``tolerance = h + floor`` and ``floor = |mean_w KL_pred,matmul(w)
− mean_w KL_pred(w)|`` on ``--floor-windows`` windows: how far kvcal's prediction moves when the matmuls it can
emulate run as llama.cpp runs them.
"""

from __future__ import annotations

import math
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvcal.errors import KvcalError

#: schema of the document :func:`verify_pairs` returns
SCHEMA = "kvcal-verify-pairs/1"


@dataclass(frozen=True)
class PairsConfig:
    """Options of ``kvcal verify --engine E`` (E an engine without scales). ``model``: a ``.gguf`` file or a name
    kvcal resolves to one (``smollm2-135m``); ``cache_types``: ``"q8_0/q8_0,q4_0/q4_0"`` (K/V per pair, comma
    separated; one type alone means K and V); ``threads``: the engine's threads (default: this machine's CPUs);
    ``floor_windows``: windows the floor's second prediction runs on (``None``: all)."""

    model: str
    corpus: str
    engine_python: str
    cache_types: str
    engine: str = "llamacpp"
    context: int = 512
    windows: int = 8
    threads: int | None = None
    floor_windows: int | None = None
    timeout_s: int = 1800
    text_field: str | None = None
    messages_field: str | None = None
    split: str | None = None

    def __post_init__(self):
        if self.context < 2:
            raise KvcalError("--context must be at least 2")
        if self.windows < 2:
            raise KvcalError("--windows must be at least 2 (the served-vs-predicted interval needs two windows)")
        if self.threads is not None and self.threads < 1:
            raise KvcalError("--threads must be at least 1")
        if self.floor_windows is not None and self.floor_windows < 1:
            raise KvcalError("--floor-windows must be at least 1")


def parse_pairs(spec: str, eng) -> list[tuple[str, str]]:
    """``[(type_k, type_v), ...]`` of ``--cache-types`` (``"q8_0/q8_0,q4_0/f16"``; ``"q8_0"`` alone is
    ``q8_0/q8_0``), each checked by the engine's ``parse_pair``; duplicates dropped. One-line ``KvcalError``
    naming the bad pair."""
    out: list[tuple[str, str]] = []
    items = [p.strip() for p in str(spec or "").split(",")]
    if not any(items):
        raise KvcalError("--cache-types is required: K/V cache-type pairs, e.g. q8_0/q8_0,q4_0/q4_0")
    for item in items:
        if not item:
            raise KvcalError(f"--cache-types {spec}: an empty pair; give K/V pairs separated by commas")
        parts = item.split("/")
        if len(parts) > 2 or not all(p.strip() for p in parts):
            raise KvcalError(f"--cache-types {item}: give a pair as TYPE_K/TYPE_V (e.g. q8_0/q4_0) or one type")
        pair = eng.parse_pair(",".join(p.strip() for p in parts), what="--cache-types ")
        if pair not in out:
            out.append(pair)
    return out


def check_engine_python(path: str | None, eng) -> Path:
    """The engine interpreter ``path`` if it is an executable Python whose environment imports the engine's
    module (``llama_cpp``); else a one-line ``KvcalError`` saying how to build one."""
    hint = getattr(eng, "BUILD_HINT", "")
    if not path:
        raise KvcalError(f"--engine-python is required (or KVCAL_ENGINE_PYTHON): the Python of {eng.DISPLAY_NAME}'s "
                         f"own venv; {hint}")
    p = Path(os.path.abspath(path))
    if not p.is_file() or not os.access(p, os.X_OK):
        raise KvcalError(f"--engine-python {path}: no executable Python there; {hint}")
    module = getattr(eng, "PYTHON_MODULE", None)
    if module:
        try:
            r = subprocess.run([str(p), "-c", f"import {module}"], capture_output=True, text=True, timeout=120,
                               env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        except (OSError, subprocess.TimeoutExpired) as e:
            raise KvcalError(f"--engine-python {path}: cannot run it ({e})") from None
        if r.returncode:
            last = ([ln for ln in r.stderr.splitlines() if ln.strip()] or ["no message"])[-1]
            raise KvcalError(f"--engine-python {path}: {module} is not importable there ({last.strip()[:200]}); "
                             f"{hint}")
    return p


def _gguf(model: str):
    """``(ModelSource, gguf path)`` of ``--model``; one-line ``KvcalError`` unless it is a GGUF."""
    from kvcal.errors import ModelLoadError
    from kvcal.models import resolve_model

    try:
        src = resolve_model(model)
    except ModelLoadError as e:
        raise KvcalError(f"--model {model}: {e}") from None
    if not src.gguf_file:
        raise KvcalError(f"--model {model}: llama.cpp serves a .gguf file; pass one (or smollm2-135m)")
    return src, Path(src.path) / src.gguf_file


def verify_pairs(cfg: PairsConfig, log=print, model=None) -> dict:
    """Run ``kvcal verify --engine E`` for cache-type pairs (module doc); returns the ``kvcal-verify-pairs/1``
    document. ``doc["agree"]``: no pair FAILs; ``doc["verdict"]``: FAIL, else inconclusive when a pair is,
    else PASS."""
    import datetime as _dt

    from kvcal import __version__
    from kvcal.engines import engine, has
    from kvcal.evaluate.sequential import WindowedRows
    from kvcal.evaluate.windows import corpus_stream, cut_windows, served_bos
    from kvcal.inputs import corpus_input
    from kvcal.models import load_model, load_tokenizer, max_positions
    from kvcal.models.gguf import gguf_architecture, gguf_tensor_types
    from kvcal.verify.engine import run_engine
    from kvcal.verify.figures import CONFIDENCE, agreement, resolve_check

    eng = engine(cfg.engine)
    if not (has(cfg.engine, "RUNNER") and has(cfg.engine, "parse_pair") and has(cfg.engine, "pair_plan")):
        raise KvcalError(f"--engine {cfg.engine}: kvcal cannot serve cache-type pairs in {eng.DISPLAY_NAME}")
    pairs = parse_pairs(cfg.cache_types, eng)
    src, gguf = _gguf(cfg.model)
    engine_python = check_engine_python(cfg.engine_python, eng)
    corpus = corpus_input(cfg.corpus, None, text_field=cfg.text_field, messages_field=cfg.messages_field,
                          split=cfg.split)
    tok = load_tokenizer(src)
    ids, corpus_info = corpus_stream(cfg.corpus, tok, **corpus.options, checked=True)
    bos = served_bos(tok)
    wins = cut_windows(ids, cfg.context, cfg.windows, bos=bos)
    if len(wins) < cfg.windows:
        log(f"note: --windows {cfg.windows}: the corpus holds {len(wins)} windows of {cfg.context} tokens; "
            f"verifying on those {len(wins)}")
    if len(wins) < 2:
        raise KvcalError(f"corpus {cfg.corpus} has {ids.numel()} tokens: fewer than 2 windows of {cfg.context} "
                         "(use a longer corpus or a smaller --context)")
    max_pos = max_positions(src)
    if max_pos is not None and cfg.context > max_pos:
        raise KvcalError(f"--context {cfg.context}: beyond the model's {max_pos} positions (use --context {max_pos} "
                         "or less)")
    if model is None:
        model = load_model(src)
    L = model.config.num_hidden_layers
    # llama.cpp's order of each query/key head (interleaved in a llama GGUF): what its blocks of 32 hold
    arch = gguf_architecture(gguf)
    plans = {p: eng.pair_plan(p[0], p[1], L, architecture=arch) for p in pairs}
    threads = cfg.threads or os.cpu_count() or 1
    log(f"engine: {eng.DISPLAY_NAME} f16/f16 + {len(pairs)} pairs x {len(wins)} windows x {cfg.context} tokens in "
        f"{engine_python}")
    with tempfile.TemporaryDirectory(prefix="kvcal-verify-") as td:
        served = run_engine(engine_python, {"gguf": str(gguf), "windows": wins.tolist(), "reference": ["f16", "f16"],
                                            "pairs": [list(p) for p in pairs], "threads": threads}, Path(td),
                            cfg.timeout_s, runner=eng.RUNNER)
    n = len(wins)
    inputs = eng.gguf_matmul_inputs(gguf_tensor_types(gguf))
    with eng.MatmulInputs(model, inputs) as mm:
        # every weight matmul's input rounded as llama.cpp rounds it: that prediction is the one judged, on every
        # window (the float32 one, only reported, on --floor-windows, default 2); else the float32 one is, with
        # the floor measured on --floor-windows (default all)
        emulated = not mm.left
        nf = min(n, cfg.floor_windows or (2 if emulated else n))
        n_mm = n if emulated else nf
        log(f"kvcal prediction, matmul inputs rounded as {eng.DISPLAY_NAME} rounds them: {len(pairs)} pairs x {n_mm} "
            f"windows" + ("" if emulated else f" (not emulated: {len(mm.left)} matmuls, e.g. {mm.left[0]})"))
        rows_mm = WindowedRows(model, wins[:n_mm])
        for p, plan in plans.items():
            rows_mm.measure(p, plan, n_mm)
    n_f = nf if emulated else n
    log(f"kvcal prediction, float32 matmul inputs: {len(pairs)} pairs x {n_f} windows")
    rows = WindowedRows(model, wins[:n_f])
    for p, plan in plans.items():
        rows.measure(p, plan, n_f)
    judged, other = (rows_mm, rows) if emulated else (rows, rows_mm)  # ``other`` ran on the first nf windows
    doc_rows = []
    for p, s in zip(pairs, served["pairs"], strict=True):
        r, o = judged.result(p), other.result(p)
        pred_w = r["per_window"]["kl_mean"]
        # the two predictions on the windows both ran on: the floor when the judged one is float32, else reported
        f_o = sum(pred_w[:nf]) / nf
        floor = 0.0 if emulated else abs(o["kl_mean"] - f_o)
        ag = agreement(s["kl"], pred_w, floor)
        # what the check must tell apart: this pair's cache from no quantization at all (the predicted KL itself)
        resolve_check(ag, r["kl_mean"], n, floor)
        verdict = "FAIL" if not ag["ok"] else "PASS" if ag["decided"] else "INCONCLUSIVE"
        want = None
        try:
            # llama-cpp-python: one ubatch of the window, llama_context_default_params' swa_full (true)
            want = "\n".join(eng.kv_bytes(model.config, p[0], p[1], cfg.context, n_ubatch=cfg.context,
                                          swa_full=True).log_lines())
        except KvcalError:
            pass
        served_nll, ref_nll = s["nll"], served["reference"]["nll"]
        mm_r, f_r = (r, o) if emulated else (o, r)
        doc_rows.append({
            "type_k": p[0], "type_v": p[1], "setting": eng.serve_line("MODEL.gguf", *p),
            "prediction": "matmul-emulated" if emulated else "float32",
            "served_kl": sum(s["kl"]) / n, "predicted_kl": r["kl_mean"], "diff": ag["diff"], "tol": ag["tol"],
            "t_half_width": ag["tol"] - floor, "floor": floor,
            "predicted_kl_matmul_emulated": mm_r["kl_mean"], "predicted_kl_float32": f_r["kl_mean"],
            "other_windows": nf, "served_kl_other_windows": sum(s["kl"][:nf]) / nf,
            "resolve": ag["resolve"], "windows_needed": ag["windows_needed"], "verdict": verdict,
            "served_dnll": sum(a - b for a, b in zip(served_nll, ref_nll, strict=True)) / n,
            "predicted_dnll": sum(a - b for a, b in zip(r["per_window"]["nll"], r["per_window"]["ref_nll"],
                                                        strict=True)) / n,
            "served_top1_agree": sum(s["top1"]) / n,
            "per_window": {"served_kl": s["kl"], "predicted_kl": pred_w,
                           "predicted_kl_matmul_emulated": mm_r["per_window"]["kl_mean"],
                           "predicted_kl_float32": f_r["per_window"]["kl_mean"]},
            "kv_log": {"served": s.get("kv_log"), "kvcal": want,
                       "match": (s.get("kv_log") == want) if s.get("kv_log") and want else None},
            "plan": plans[p].describe()})
    verdicts = [r["verdict"] for r in doc_rows]
    verdict = "FAIL" if "FAIL" in verdicts else "inconclusive" if "INCONCLUSIVE" in verdicts else "PASS"
    ref = served["reference"]
    return {
        "schema": SCHEMA, "kvcal_version": __version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "engine": {"name": cfg.engine, "display": eng.DISPLAY_NAME, "python": str(engine_python),
                   "version": served.get("llama_cpp_version"), "emulated": eng.VERSION,
                   "threads": served.get("threads"),
                   "reference": f"{ref['type_k']}/{ref['type_v']}", "flash_attn": True,
                   "calibrated_scales": False,
                   "seconds": {"reference": ref.get("eval_s"),
                               **{f"{s['type_k']}/{s['type_v']}": s.get("eval_s") for s in served["pairs"]}}},
        "model": {"id": src.model_id, "gguf": str(gguf), "layers": L},
        "corpus": {**corpus_info, "context": cfg.context, "windows": n, "bos_token_id": bos},
        "reference": {"served_ppl": math.exp(sum(ref["nll"]) / n),
                      "predicted_ppl": judged.reference_ppl(n)},
        "prediction": {"judged": "matmul-emulated" if emulated else "float32",
                       "matmul_inputs": sorted(set(mm.emulated.values())), "not_emulated": mm.left,
                       "gelu_f16_table": len(mm.activations),
                       "other_windows": nf,
                       "floor": None if emulated else "|kvcal's predicted KL with llama.cpp's matmul input rounding "
                                                      "emulated - without|"},
        "confidence": CONFIDENCE, "rows": doc_rows, "verdict": verdict, "agree": verdict != "FAIL",
        "passed": verdict == "PASS",
    }


def _kv_cell(kv: dict) -> str:
    if kv["match"] is not None:
        return "as kvcal sizes it" if kv["match"] else "DIFFERS"
    if kv["served"] and not kv["kvcal"]:
        return "kvcal does not size it"  # kv_bytes refuses a cache it cannot size (e.g. every layer sliding)
    return "not logged"


def render_pairs(doc: dict) -> str:
    """The table ``kvcal verify --engine llamacpp`` prints, and its notes."""
    e, c, pr = doc["engine"], doc["corpus"], doc["prediction"]
    mm = pr["judged"] == "matmul-emulated"
    lines = [f"engine: {e['display']} ({e['version']}, flash attention, {e['threads']} threads), reference "
             f"{e['reference']}; model {doc['model']['id']}; {c['windows']} x {c['context']} tokens of {c['path']}; "
             f"PPL served {doc['reference']['served_ppl']:.4f}, kvcal {doc['reference']['predicted_ppl']:.4f}",
             f"note: {e['display']} takes no calibrated scale: -ctk/-ctv pick a block format whose scales are "
             "computed as each row is written; what is verified is kvcal's emulation of each pair",
             f"predicted: kvcal's KL with every weight matmul's input rounded as {e['display']} rounds it "
             f"({', '.join(pr['matmul_inputs']) or 'none'})"
             + (f", GELU through ggml's fp16 table ({pr['gelu_f16_table']} layers)" if pr.get("gelu_f16_table") else "")
             if mm else
             f"predicted: kvcal's KL with float32 matmul inputs ({len(pr['not_emulated'])} of the model's matmuls take "
             f"inputs kvcal does not emulate, e.g. {(pr['not_emulated'] or ['-'])[0]}); the floor is how far "
             "emulating the others moves it",
             *([] if f"llama-cpp-python {e['version']}" == e.get("emulated", "") else
               [f"note: kvcal emulates {e['display']} as {e.get('emulated')} vendors it; this engine is "
                f"llama-cpp-python {e['version']}: a row outside its tolerance may be the two builds' difference, "
                "not kvcal's emulation of the pair"]),
             "",
             "| -ctk/-ctv | served KL | predicted KL | diff | tol | "
             + ("float32 prediction" if mm else "predicted, matmuls as llama.cpp") + " | served ΔNLL | predicted ΔNLL "
             "| KV size | served = predicted |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in doc["rows"]:
        tol = f"±{r['tol']:.2e}" + ("" if mm else f" ({r['t_half_width']:.1e} + floor {r['floor']:.1e})")
        o = r["predicted_kl_float32"] if mm else r["predicted_kl_matmul_emulated"]
        lines.append(f"| {r['type_k']}/{r['type_v']} | {r['served_kl']:.3e} | {r['predicted_kl']:.3e} | "
                     f"{r['diff']:+.2e} | {tol} | {o:.3e} (served {r['served_kl_other_windows']:.3e}, "
                     f"{r['other_windows']} windows) | "
                     f"{r['served_dnll']:+.4f} | {r['predicted_dnll']:+.4f} | "
                     f"{_kv_cell(r['kv_log'])} | {r['verdict']} |")
    for r in doc["rows"]:
        if r["verdict"] == "INCONCLUSIVE":
            need = r.get("windows_needed")
            lines.append(f"note: {r['type_k']}/{r['type_v']}: agrees, but the tolerance ±{r['tol']:.2e} is not below "
                         f"the predicted KL itself ({r['resolve']:.2e}: it cannot tell this cache from none); "
                         + (f"about {need} windows would decide it" if need else "more windows would not decide it"))
        if r["kv_log"]["match"] is False:
            lines.append(f"note: {r['type_k']}/{r['type_v']}: llama.cpp logged "
                         + " / ".join(f"`{x}`" for x in r['kv_log']['served'].splitlines()) + "; kvcal sizes "
                         + " / ".join(f"`{x}`" for x in r['kv_log']['kvcal'].splitlines()))
    lines.append(f"tolerance: {int(doc['confidence'] * 100)}% paired t-interval over windows"
                 + ("" if mm else f" + floor (on {pr['other_windows']} windows)")
                 + "; docs/serving.md#llamacpp-served-vs-predicted")
    lines.append("verify: " + doc["verdict"])
    return "\n".join(lines)


__all__ = ["SCHEMA", "PairsConfig", "check_engine_python", "parse_pairs", "render_pairs", "verify_pairs"]
