"""``kvcal verify``: serve an exported checkpoint in a real engine and compare with kvcal's prediction.

Pipeline (:func:`verify`):

1. Read the checkpoint as vLLM would: ``config.json``'s ``kv_cache_scheme`` names the FP8 dtype and the
   ``model.layers.{i}.self_attn.{k,v,q}_scale`` tensors of its safetensors files are the static scales
   (:func:`read_checkpoint`). A ``kvcal recommend`` output is recognised and pointed at its export line.
2. Build a scale-free view of the checkpoint (:func:`no_scale_view`: the same weight files, linked, with
   ``quantization_config`` and the scale tensors left out): what a user serves without kvcal's scales.
3. Cut the evaluation windows exactly as ``kvcal evaluate`` does (:func:`kvcal.evaluate.windows.corpus_stream`,
   :func:`~kvcal.evaluate.windows.cut_windows`) and serve them in the engine's own Python
   (``kvcal/engines/vllm/runner.py``, a subprocess): the engine's 16-bit cache (``auto`` on the view) is
   the reference, then the dtype with the checkpoint's scales, then the dtype at 1.0 (the view).
4. Predict the same runs with kvcal's emulation of that engine backend (:class:`~kvcal.engines.vllm.plan.VllmKVPlan`,
   the backend the engine reports: ``CPUAttentionBackendImpl`` → ``cpu``) on kvcal's own 16-bit model
   (transformers, same weights), per token.
5. Judge: PASS/FAIL against ``--accept`` on the *served* figures; the served gain of the checkpoint's scales over
   the dtype at 1.0 from the same run (:func:`~kvcal.verify.figures.served_gain`: KL ratio and ΔPPL difference with
   paired t-intervals over windows; ``served_gain`` in the document; a checkpoint that serves worse than 1.0
   beyond its interval fails verify); and served = predicted within the
   tolerance of :func:`agreement` (derived in ``docs/serving.md``: a paired t-interval over windows plus
   the two implementations' 16-bit disagreement). Scales applied: every layer's loaded scale equals the
   checkpoint's, and the served run differs from the run at 1.0.

Raises :class:`~kvcal.errors.KvcalError` (one line) for every input or environment problem, including
an engine that refuses the model or the dtype on this CPU.

Modules: :mod:`~kvcal.verify.config` (options, ``--accept``), :mod:`~kvcal.verify.checkpoint` (reading the
checkpoint, its scale-free view, a recommend output), :mod:`~kvcal.verify.engine` (running the engine) and
:mod:`~kvcal.verify.figures` (kvcal's prediction and the agreement test); :func:`verify` and :func:`render` are
here. :mod:`~kvcal.verify.pairs` is ``kvcal verify --engine llamacpp``: an engine that takes no calibrated scale,
verified per K/V cache-type pair (served KL vs kvcal's prediction).
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

from kvcal.errors import KvcalError
from kvcal.evaluate.bounds import LEVEL
from kvcal.verify.checkpoint import Checkpoint, from_recommend, no_scale_view, read_checkpoint
from kvcal.verify.config import VERIFY_METRICS, VerifyConfig, check_accept
from kvcal.verify.engine import (
    ALIGN_TOL,
    ENGINE,
    IMPL_BACKEND,
    RUNNER,
    check_engine_python,
    cpu_fp8_support,
    name_setting,
    run_engine,
)
from kvcal.verify.figures import (
    CONFIDENCE,
    _window_means,
    agreement,
    gain_line,
    predict,
    resolve_check,
    served_gain,
    summarize,
    t_quantile,
)


def verify(cfg: VerifyConfig, log=print, model=None, corpus=None) -> dict:
    """Run ``kvcal verify`` (module doc). Returns the ``kvcal-verify/1`` document; ``doc["passed"]`` is
    False when a served row fails ``--accept``, served ≠ predicted, or the scales were not applied.
    ``corpus``: ``cfg.corpus`` already checked (:class:`kvcal.inputs.CorpusInput`, :mod:`kvcal.api`'s
    preflight); checked here when None. The model's inputs come from the checkpoint's ``config.json``, read
    once (:func:`kvcal.inputs.preflight`)."""
    import datetime as _dt

    from kvcal import __version__
    from kvcal.engines import engine
    from kvcal.evaluate.accept import DEFAULT_ACCEPT
    from kvcal.evaluate.bounds import judge_bounded

    eng = engine(ENGINE)  # the served engine's facade (kvcal.engines): backends and the plan kvcal predicts with

    crit_str = cfg.accept or DEFAULT_ACCEPT[8]
    crit = check_accept(crit_str)
    engine_python = check_engine_python(cfg.engine_python)
    rec_tmp = None
    skip = tuple(cfg.skip_layers)
    if (Path(cfg.checkpoint) / "deploy.json").is_file() and not (Path(cfg.checkpoint) / "config.json").is_file():
        rec_tmp = tempfile.TemporaryDirectory(prefix="kvcal-verify-recommend-")
        path, rec_dtype, rec_skip = from_recommend(Path(cfg.checkpoint), cfg.model_dir, Path(rec_tmp.name), log)
        if cfg.kv_cache_dtype is not None and cfg.kv_cache_dtype != rec_dtype:
            raise KvcalError(f"--kv-cache-dtype {cfg.kv_cache_dtype}: the recommend output chose {rec_dtype}; drop "
                             "--kv-cache-dtype")
        ck, dtype, skip = read_checkpoint(path), rec_dtype, skip or rec_skip
    else:
        ck = read_checkpoint(cfg.checkpoint)
        dtype = cfg.kv_cache_dtype or ck.kv_cache_dtype
    if dtype is None:
        raise KvcalError(f"checkpoint {ck.path} has no kv_cache_scheme; pass --kv-cache-dtype (fp8 or fp8_e5m2) to "
                         "verify it at vLLM's default scales")
    if dtype not in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        raise KvcalError(f"--kv-cache-dtype {dtype}: verify checks the static-scale FP8 dtypes (fp8, fp8_e4m3, "
                         "fp8_e5m2)")
    if dtype == "fp8_e5m2" and ck.kv_cache_dtype is not None:  # vLLM's attention.py, before any weight loads
        what = f"--kv-cache-dtype {dtype}" if cfg.kv_cache_dtype else f"{cfg.checkpoint}'s choice {dtype}"
        raise KvcalError(f"{what}: {ck.path} declares an FP8 kv_cache_scheme (e4m3, the dtype its scales were "
                         "calibrated for), and vLLM refuses fp8_e5m2 on a checkpoint that declares one (\"fp8_e5m2 "
                         "kv-cache is not supported with fp8 checkpoints\"); verify it with --kv-cache-dtype fp8 (or "
                         "without --kv-cache-dtype), or verify the model it was exported from with --kv-cache-dtype "
                         "fp8_e5m2")
    if dtype == "fp8_e5m2" and any(s is not None for s in ck.k_scales):
        log("note: the checkpoint's scales were calibrated for e4m3; served here with fp8_e5m2 as vLLM would")
    backend = cfg.backend
    if backend is not None:
        try:
            backend = eng.backend(backend).name
            eng.check_backend_serves(backend, dtype, ck.head_dim)
        except eng.DTypeError as e:
            raise KvcalError(f"--backend: {e}") from None
    if backend in (None, "cpu"):
        why = cpu_fp8_support()
        if why is not None and backend == "cpu":
            raise KvcalError(f"vLLM's CPU backend cannot serve --kv-cache-dtype {dtype} here: {why}")
    if ck.num_layers < 1:
        raise KvcalError(f"{ck.path / 'config.json'}: no num_hidden_layers")
    bad = [i for i in skip if not 0 <= i < ck.num_layers]
    if bad or len(skip) >= ck.num_layers:
        raise KvcalError(f"--skip-layers {','.join(map(str, skip))}: the model has {ck.num_layers} layers (0 to "
                         f"{ck.num_layers - 1}) and at least one must stay in {dtype}")
    if any(s is None for s in ck.k_scales + ck.v_scales) and any(s is not None for s in ck.k_scales + ck.v_scales):
        missing = [i for i, (a, b) in enumerate(zip(ck.k_scales, ck.v_scales, strict=True)) if a is None or b is None]
        raise KvcalError(f"checkpoint {ck.path}: layers {missing[:8]} have no k_scale/v_scale while others do "
                         "(vLLM would serve them at 1.0); re-export the checkpoint")
    has_scales = all(s is not None for s in ck.k_scales + ck.v_scales)

    from kvcal.evaluate.windows import corpus_stream, cut_windows, served_bos
    from kvcal.inputs import corpus_input, preflight
    from kvcal.models import load_model, load_tokenizer

    corpus = corpus_input(cfg.corpus, corpus, text_field=cfg.text_field, messages_field=cfg.messages_field,
                          split=cfg.split)
    pre = preflight(str(ck.path), corpus, config=ck.config)  # the checkpoint's config.json, read once
    max_pos = pre.model.max_positions
    if max_pos is not None and cfg.context + 1 > max_pos:  # the engine's max_model_len: the window + 1 token
        raise KvcalError(f"--context {cfg.context}: the engine serves each window and the one token it generates "
                         f"({cfg.context + 1} positions), beyond the model's max_position_embeddings {max_pos}; use "
                         f"--context {max_pos - 1} or less")
    with tempfile.TemporaryDirectory(prefix="kvcal-verify-") as td:
        work = Path(td)
        view = no_scale_view(ck, work / "no-scales")
        tok = load_tokenizer(str(view), vocab_size=pre.model.vocab_size)
        ids, corpus_info = corpus_stream(cfg.corpus, tok, **pre.corpus.options, checked=True)
        bos = served_bos(tok)  # as kvcal evaluate: a window starts with the BOS the tokenizer adds, if any
        wins = cut_windows(ids, cfg.context, cfg.windows, bos=bos)
        if len(wins) < cfg.windows:  # said, never silently fewer (issue 40)
            log(f"note: --windows {cfg.windows}: the corpus holds {len(wins)} windows of {cfg.context} tokens; "
                f"verifying on those {len(wins)}")
        if len(wins) < 2:
            raise KvcalError(f"corpus {cfg.corpus} has {ids.numel()} tokens: fewer than 2 windows of {cfg.context} "
                             "(use a longer corpus or a smaller --context)")
        sk = [str(i) for i in skip]
        # what the engine's messages call the directories it serves: never a temporary path, gone once verify ends
        shown = (f"the export of {cfg.checkpoint}'s choice" if rec_tmp is not None and
                 Path(rec_tmp.name) in Path(ck.path).parents else str(ck.path))
        shown_view = f"{shown} without its k/v scales"
        runs = [{"name": "16-bit", "model_dir": str(view), "kv_cache_dtype": "auto", "label": shown_view}]
        if has_scales:
            runs.append({"name": f"{dtype} checkpoint scales", "model_dir": os.path.abspath(ck.path), "kv_cache_dtype": dtype,
                         "skip_layers": sk, "label": shown})
        runs.append({"name": f"{dtype} scales 1.0", "model_dir": str(view), "kv_cache_dtype": dtype, "skip_layers": sk,
                     "label": shown_view})
        log(f"engine: {len(runs)} runs x {len(wins)} windows x {cfg.context} tokens in {engine_python}")
        try:
            served = run_engine(engine_python, {"windows": wins.tolist(), "max_model_len": cfg.context, "dtype": "float32",
                                                "runs": runs, "reference": "16-bit", "top_k": 5}, work, cfg.timeout_s)
        except KvcalError as e:  # the engine's words, with the kvcal option behind the engine argument they name
            msg = str(e).replace(str(view), shown_view).replace(os.path.abspath(ck.path), shown)
            raise KvcalError(name_setting(msg, {
                "max_model_len": f"vLLM's max_model_len is --context + 1 = {cfg.context + 1} (each window and the one "
                                 "token it generates): use a smaller --context",
                "kv_cache_dtype_skip_layers": f"--skip-layers {','.join(sk)} sets it; drop --skip-layers to serve "
                                              f"every layer in {dtype}"})) from None
        impls = {i for r in served["runs"].values() for i in r.get("attention_impl", [])}
        engine_backend = next((IMPL_BACKEND[i] for i in impls if i in IMPL_BACKEND), "cuda")
        if backend is not None and backend != engine_backend:
            raise KvcalError(f"--backend {backend}, but the engine ran {', '.join(sorted(impls))} ({engine_backend}); "
                             "drop --backend or pass the engine's")
        backend = engine_backend
        align = max(r["align_max_abs"] for r in served["runs"].values())
        if not align <= ALIGN_TOL:
            raise KvcalError(f"the observed engine logits reproduce its served log-probabilities only to {align:.3g} "
                             f"nats (> {ALIGN_TOL}); this vLLM computes prompt log-probabilities differently")
        log(f"kvcal prediction: backend {backend}, {len(wins)} windows")
        if model is None:
            model = load_model(str(view))
        L = ck.num_layers
        plans = {}
        qs = ck.q_scales if all(s is not None for s in ck.q_scales) else None  # read only where queries are FP8
        # the engine's backend, and the other write path (for a backend that truncates: the same cache written by
        # rounding to nearest with the queries left unquantized, the write path alone, what truncation costs) (truncation for a GPU run, rounding for the CPU build): the difference the
        # served = predicted check exists to resolve, so a tolerance wider than it is called inconclusive
        other = "cpu" if backend == "cuda" else "cuda"
        try:  # a write path that cannot hold this model (the CPU build: head_dim a multiple of 32) is not a rival
            eng.check_backend_serves(other, dtype, ck.head_dim)
        except eng.DTypeError:
            other = None
        for alt in dict.fromkeys([b for b in (backend, other) if b is not None]):
            qq = None if alt == backend or alt == "cpu" else False
            if has_scales:
                plans[(f"{dtype} checkpoint scales", alt)] = eng.Plan(
                    dtype, L, k_scales=ck.k_scales, v_scales=ck.v_scales, q_scales=qs, backend=alt, quantize_query=qq,
                    skip_layers=skip)
            plans[(f"{dtype} scales 1.0", alt)] = eng.Plan(dtype, L, backend=alt, quantize_query=qq,
                                                           skip_layers=skip)
        pred = predict(model, wins, {f"{n}@{b}": p for (n, b), p in plans.items()})
    if rec_tmp is not None:
        rec_tmp.cleanup()
    rows = []
    s_ref, p_ref = served["runs"]["16-bit"], pred["16-bit"]
    ref_served, ref_pred = summarize(s_ref, s_ref), summarize(p_ref, p_ref)
    ppl16 = ref_served["ppl"]
    floor_ppl = abs(ref_served["ppl"] - ref_pred["ppl"])
    scale_check = []
    for r in runs[1:]:
        name = r["name"]
        s_run, p_run = served["runs"][name], pred[f"{name}@{backend}"]
        srv, prd = summarize(s_run, s_ref), summarize(p_run, p_ref)
        # paired per-window differences: log-PPL changes (ΔPPL ≈ PPL16 · Δ log PPL) and mean KL
        dl_s = [a - b for a, b in zip(_window_means(s_run["nll"]), _window_means(s_ref["nll"]), strict=True)]
        dl_p = [a - b for a, b in zip(_window_means(p_run["nll"]), _window_means(p_ref["nll"]), strict=True)]
        ag_ppl = agreement([ppl16 * x for x in dl_s], [ppl16 * x for x in dl_p], floor_ppl)
        ag_ppl["diff"] = srv["delta_ppl"] - prd["delta_ppl"]
        ag_ppl["ok"] = abs(ag_ppl["diff"]) <= ag_ppl["tol"]
        ag_kl = agreement(_window_means(s_run["kl"]), _window_means(p_run["kl"]))
        alt = summarize(pred[f"{name}@{other}"], p_ref) if other else None
        for ag, key, fl in ((ag_ppl, "delta_ppl", floor_ppl), (ag_kl, "kl_mean", 0.0)):
            if alt is not None:
                resolve_check(ag, abs(prd[key] - alt[key]), len(wins), fl)
            else:  # no rival write path for this model: nothing for the tolerance to separate
                ag.update(resolve=None, decided=True, windows_needed=None)
        jb = judge_bounded(srv, crit)  # the bar, on one-sided bounds over the served windows
        status, failed = jb["status"], jb["failed"]
        row = {"run": name, "kv_cache_dtype": dtype, "scales": "checkpoint" if "checkpoint" in name else "1.0",
               "skip_layers": list(skip),
               "served": srv, "predicted": prd, "backend": backend, "ppl_agreement": ag_ppl, "kl_agreement": ag_kl,
               "accept": status, "failed": failed, "accept_bounds": jb["bounds"],
               "accept_windows_needed": jb["windows_needed"], "agree": ag_ppl["ok"] and ag_kl["ok"],
               "agreement": ("FAIL" if not (ag_ppl["ok"] and ag_kl["ok"]) else
                             "PASS" if ag_ppl["decided"] and ag_kl["decided"] else "inconclusive"),
               "predicted_other_write": {"backend": other, **alt} if alt else None}
        if backend != "cuda":
            row["predicted_if_rounding"] = alt
        rows.append(row)
        held = s_run["layer_scales"]
        if "checkpoint" in name:
            bad = [i for i, x in enumerate(held) if i < L and not (
                math.isclose(x["k_scale"], ck.k_scales[i], rel_tol=2 ** -23) and
                math.isclose(x["v_scale"], ck.v_scales[i], rel_tol=2 ** -23))]
            scale_check.append({"what": "every layer's loaded k_scale/v_scale equals the checkpoint's",
                                "ok": not bad and len(held) == L, "layers_differing": bad})
        if skip:
            kept = [i for i, x in enumerate(held) if (i in skip) != (x["kv_cache_dtype"] == "auto")]
            scale_check.append({"what": f"{name}: layers {','.join(map(str, skip))} (and only they) hold a 16-bit cache",
                                "ok": not kept, "layers_differing": kept})
    if has_scales:
        a, b = rows[0]["served"], rows[1]["served"]
        differs = a["ppl"] != b["ppl"] or a["kl_mean"] != b["kl_mean"]
        scale_check.append({"what": "the served run with the checkpoint's scales differs from the same dtype at 1.0",
                            "ok": differs})
    gain = None
    if has_scales:  # the same engine run: the checkpoint's scales against the dtype at vLLM's default 1.0
        gain = served_gain(served["runs"][runs[1]["name"]], served["runs"][runs[2]["name"]], s_ref)
    passed = (all(r["accept"] == "PASS" and r["agreement"] == "PASS" for r in rows)
              and all(c["ok"] for c in scale_check) and (gain is None or gain["verdict"] != "FAIL"))
    inconclusive = (not passed and all(r["accept"] in ("PASS", "INCONCLUSIVE") and r["agree"] for r in rows)
                    and all(c["ok"] for c in scale_check) and (gain is None or gain["verdict"] != "FAIL"))
    return {
        "schema": "kvcal-verify/1", "kvcal_version": __version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "passed": passed, "verdict": "PASS" if passed else "inconclusive" if inconclusive else "FAIL",
        "checkpoint": str(ck.path), "engine": {
            "python": str(engine_python), "vllm_version": served.get("vllm_version"),
            "torch_version": served.get("torch_version"), "attention_impl": sorted(impls), "backend": backend,
            "align_max_abs": align, "seconds": {n: {"start": r["engine_start_s"], "serve": r["serve_s"]}
                                               for n, r in served["runs"].items()}},
        "corpus": {**corpus_info, "context": cfg.context, "windows": len(wins),
                   "bos_token_id": bos,
                   "window_source": "as kvcal evaluate: consecutive windows from the start, "
                                    + ("each starting with the BOS the tokenizer adds" if bos is not None else
                                       "no BOS (the tokenizer adds none)")},
        "reference": {"served_16bit_ppl": ref_served["ppl"], "predicted_16bit_ppl": ref_pred["ppl"]},
        "accept": crit_str, "confidence": CONFIDENCE, "rows": rows, "scales_applied": scale_check,
        "served_gain": gain,
    }


def render(doc: dict) -> str:
    """The one table ``kvcal verify`` prints (plus its verdict lines)."""
    e = doc["engine"]
    lines = [f"engine: vLLM {e['vllm_version']} ({', '.join(e['attention_impl'])}; kvcal backend {e['backend']}), "
             f"{doc['corpus']['windows']} x {doc['corpus']['context']} tokens of {doc['corpus']['path']}; "
             + (f"layers {','.join(map(str, doc['rows'][0]['skip_layers']))} in the model dtype; "
                if doc["rows"] and doc["rows"][0].get("skip_layers") else "")
             + f"16-bit PPL served {doc['reference']['served_16bit_ppl']:.4f}, kvcal {doc['reference']['predicted_16bit_ppl']:.4f}",
             "",
             "| --kv-cache-dtype | scales | served ΔPPL | predicted | diff (tol) | served KL | predicted | diff (tol) "
             f"| bar {doc['accept']} | served = predicted |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in doc["rows"]:
        s, p, a, k = r["served"], r["predicted"], r["ppl_agreement"], r["kl_agreement"]
        lines.append(f"| {r['kv_cache_dtype']} | {r['scales']} | {s['delta_ppl']:+.4f} | {p['delta_ppl']:+.4f} | "
                     f"{a['diff']:+.4f} (±{a['tol']:.4f}) | {s['kl_mean']:.3e} | {p['kl_mean']:.3e} | "
                     f"{k['diff']:+.2e} (±{k['tol']:.2e}) | {r['accept']}"
                     f"{' (' + '; '.join(r['failed']) + ')' if r['failed'] else _bound_note(r)} | "
                     f"{r.get('agreement', 'PASS' if r['agree'] else 'FAIL')} |")
    for r in doc["rows"]:
        if r.get("agreement") == "inconclusive":
            a, k = r["ppl_agreement"], r["kl_agreement"]
            need = max((x.get("windows_needed") or 0) for x in (a, k))
            lines.append(f"note: {r['run']}: served = predicted is inconclusive — its tolerance (KL ±{k['tol']:.2e}, "
                         f"ΔPPL ±{a['tol']:.4f}) is not below the difference between the two write paths it must tell "
                         f"apart (KL {k['resolve']:.2e}, ΔPPL {a['resolve']:.4f}); "
                         + (f"about {need} windows would decide it" if need else "more windows would not decide it"))
    for r in doc["rows"]:
        if "predicted_if_rounding" in r:
            q = r["predicted_if_rounding"]
            lines.append(f"note: {r['run']}: written by rounding to nearest (the GPU kernels' write, queries "
                         "unquantized), kvcal predicts "
                         f"ΔPPL {q['delta_ppl']:+.4f}, KL {q['kl_mean']:.3e}; truncation costs "
                         f"{r['predicted']['kl_mean'] / max(q['kl_mean'], 1e-30):.2f}x the KL of rounding here")
    for c in doc["scales_applied"]:
        lines.append(f"scales applied: {c['what']}: {'yes' if c['ok'] else 'NO'}")
    if doc.get("served_gain"):
        lines.append(gain_line(doc["served_gain"], e["backend"]))
    lines.append(f"tolerance: {int(doc['confidence'] * 100)}% paired t-interval over windows (+ the 16-bit "
                 "disagreement for ΔPPL); docs/serving.md#served-vs-predicted")
    lines.append(f"bar: each clause judged on the served figures' one-sided {LEVEL:.0%} Student-t bound over the "
                 "windows (the upper bound of a <= clause; kvcal.evaluate.bounds)"
                 + "".join(f"; {r['run']}: INCONCLUSIVE, " + (f"{r['accept_windows_needed']} windows would decide it"
                                                              if r.get("accept_windows_needed") else
                                                              "no window count would decide it at this spread")
                           for r in doc["rows"] if r["accept"] == "INCONCLUSIVE"))
    lines.append("verify: " + doc.get("verdict", "PASS" if doc["passed"] else "FAIL"))
    return "\n".join(lines)


def _bound_note(r: dict) -> str:
    """`` (KL bound 1.3e-02)``: the bound a passing row's clauses were judged on (its ``accept_bounds``)."""
    from kvcal.evaluate.bounds import bound_text

    bs = r.get("accept_bounds") or {}
    parts = [f"{m} {bound_text(bs, m)}" for m in bs if str(bs[m].get("method", "")).startswith("one-sided")]
    return f" ({'; '.join(parts)})" if parts else ""


__all__ = ["VerifyConfig", "verify", "render", "agreement", "read_checkpoint", "no_scale_view", "run_engine",
           "cpu_fp8_support", "check_engine_python", "VERIFY_METRICS",
           "ALIGN_TOL", "CONFIDENCE", "IMPL_BACKEND", "RUNNER", "Checkpoint", "check_accept", "from_recommend", "predict",
           "name_setting",
           "summarize", "t_quantile"]
