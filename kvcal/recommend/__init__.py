"""``kvcal recommend --engine vllm``: which vLLM 0.33 KV configuration to deploy, measured on the user's corpus.

For every ``--kv-cache-dtype`` of the menu (:data:`DEFAULT_MENU`) and every number of 16-bit layers up to
``max_skip`` (at most the model's layers − 1: a candidate keeps at least one layer in its dtype, see
:func:`kvcal.search.skip_layers.skip_count_range`), the layers to keep at 16 bits are chosen by a model-level probe
(:func:`layer_sensitivity` → :func:`kvcal.search.skip_layers.choose_skip_layers`); vLLM's fixed
first-2/last-2 rule is evaluated beside it at the same count (4), so both are reported at equal memory.
Each candidate runs under Protocol A (:func:`kvcal.evaluate.teacher_forced`, with vLLM's FP8 query
quantization where vLLM applies it) on evaluation windows disjoint from the probe windows, is judged by
the acceptance bar (``--accept`` or :data:`kvcal.evaluate.DEFAULT_ACCEPT` by precision), and the
cheapest deployable PASS within ``--max-bytes-per-token`` wins (ties: lower KL).

The dtypes whose static scales vLLM reads from the checkpoint and kvcal calibrate calibrates
(:data:`CALIBRATIONS`) are calibrated first, each into its own artifact, and probed and evaluated with
those scales: fp8 / fp8_e4m3 through ``kvcal calibrate --engine vllm --kv-cache-dtype fp8`` (k/v scales and
q_scale, artifact ``artifact/``), nvfp4 through ``kvcal calibrate --engine vllm --kv-cache-dtype nvfp4``
(NVFP4 outer scales and q_scale, :mod:`kvcal.search.vllm_nvfp4`, artifact ``artifact-nvfp4/``). Each such dtype
is also evaluated at vLLM's default scales (every static scale 1.0: a checkpoint without k/v/q scales) as
candidates of its own, on the calibrated rows' 16-bit layer sets (one probe per dtype, run with the calibrated
scales), so that a calibration that measures worse than not calibrating is never the one deployed; each row's
``scales`` field (:data:`SCALES_CALIBRATED`, :data:`SCALES_DEFAULT`, :data:`SCALES_WRITE_TIME`) says which it
uses. The other static dtypes (nvfp4_4over6, fp8_e5m2) run at vLLM's default scales (1.0) only; the rest compute
their scales at write time (:func:`scales_source` says which, per dtype, in the notes).

Data split (one token stream, :func:`kvcal.evaluate.corpus_stream`, cut into ``context``-token windows):
the first ``ceil(probe_tokens / context)`` windows are the probe; the next ``windows`` windows (or the first
ones of ``eval_corpus`` when given) are the evaluation. kvcal calibrate's sample subset (fp8, nvfp4) is drawn
from the whole corpus and may overlap the evaluation windows unless ``eval_corpus`` is a different file.

Output directory (written atomically): ``deploy.json`` (schema ``kvcal-recommend/1``), ``deploy.md``, and
the chosen row's calibrated artifact when it uses calibrated scales (none for a row at vLLM's default scales): ``artifact/`` (fp8, fp8_e4m3) or ``artifact-nvfp4/``
(nvfp4), which the deployment's ``kvcal export --target vllm`` line reads; the chosen 16-bit layers are recorded
in it (:func:`record_skip_layers`), so that export prints the same ``--kv-cache-dtype-skip-layers`` as deploy.md.

Modules: :mod:`~kvcal.recommend.config` (options, menus, labels), :mod:`~kvcal.recommend.checks` (checks before
the model loads), :mod:`~kvcal.recommend.candidates` (16-bit layer sets, scale sources),
:mod:`~kvcal.recommend.artifacts` (the calibrated artifacts) and :mod:`~kvcal.recommend.render` (``deploy.md``);
:func:`recommend` itself is here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

# the probe and its scale reader live in the evaluate layer (calibrate --skip-layers auto uses them too)
from kvcal.evaluate.vllm_probe import layer_sensitivity, vllm_fp8_scales
from kvcal.recommend.artifacts import _artifact_scales, record_skip_layers
from kvcal.recommend.candidates import WRITE_TIME, calibrations, candidate_sets, row_scales, scales_source
from kvcal.recommend.checks import (
    applicable_dtypes,
    budget_context,
    check_budget,
    check_head_dims,
    check_options,
    effective_max_skip,
)
from kvcal.recommend.config import (
    CALIBRATIONS,
    CPU_MENU,
    DEFAULT_MAX_SKIP,
    DEFAULT_MENU,
    NOT_APPLICABLE,
    RECOMMEND_METRICS,
    RULE_COUNT,
    SCALES_CALIBRATED,
    SCALES_DEFAULT,
    SCALES_WRITE_TIME,
    SCHEMA,
    RecommendConfig,
)
from kvcal.recommend.render import render_markdown, render_table


def recommend(cfg: RecommendConfig, log: Callable[[str], None] = print, progress: bool = True,
              model=None, tokenizer=None, corpus=None) -> dict:
    """Run ``kvcal recommend`` and write ``cfg.out`` atomically; returns the ``kvcal-recommend/1``
    document: ``{"schema", "chosen": candidate | None, "candidates": [{"dtype", "scales", "choice", "skip_layers",
    "deployable", "bytes_per_token", "vs_16bit", "kl_mean", "delta_ppl", "ppl", "top1_agree", "status",
    "criteria", "failed"}], "sensitivity": {dtype: [KL per layer]} (probed dtypes), "bytes_per_token_16bit",
    "commands": {"export": str | None, "serve": str} | None, "calibrated": {dtype: artifact directory name},
    "artifact": the directory kept in ``cfg.out`` (the chosen row's calibrated artifact) or None,
    "scales": {dtype: str}, "data": {...}, "notes": [str], "passed"}``. ``calibrated``: the menu dtypes
    probed and evaluated with scales kvcal calibrated, each with its artifact's directory
    (:data:`CALIBRATIONS`; only the chosen dtype's is kept in ``cfg.out``); ``scales``:
    :func:`scales_source` of every menu dtype. A candidate's ``scales`` (:func:`row_scales`): a calibrated dtype
    has one row per 16-bit layer set with :data:`SCALES_CALIBRATED` and one with :data:`SCALES_DEFAULT` (vLLM's
    1.0, no export); when the chosen row is the latter, ``commands["export"]`` is None and ``artifact`` is None.
    ``status`` is PASS/FAIL, or OVER-BUDGET / :data:`NOT_APPLICABLE` (not evaluated; ``failed`` says why: a
    dtype whose vLLM boundary layers cover the model has one such row). ``max_skip``: the value used
    (:func:`effective_max_skip`). ``model``/``tokenizer``: loaded objects for
    ``cfg.model`` (tests). ``corpus``: ``cfg.corpus`` already checked (:class:`kvcal.inputs.CorpusInput`,
    :mod:`kvcal.api`'s preflight); checked here when None. The model and corpora are resolved once
    (:func:`kvcal.inputs.preflight`) and handed down, the calibrations included. Raises
    :class:`~kvcal.errors.KvcalError` for bad input, before the model loads."""
    import dataclasses
    import json
    import shlex
    import shutil

    from kvcal.artifact import write_dir_atomically
    from kvcal.errors import KvcalError
    from kvcal.evaluate.accept import default_accept, judge, parse_accept
    from kvcal.evaluate.protocol_a import teacher_forced
    from kvcal.evaluate.windows import corpus_stream, cut_windows, served_bos
    from kvcal.formats.memory import model_shape, vllm_bytes_per_token, vllm_token_shares
    from kvcal.formats.vllm_dtypes import VllmDTypeError, vllm_backend, vllm_dtype
    from kvcal.inputs import preflight
    from kvcal.models import check_max_positions, load_model, load_tokenizer, resolve_model
    from kvcal.search.skip_layers import serve_skip_arg, skip_costs
    from kvcal.vllm_plan import VllmKVPlan

    try:
        cfg = dataclasses.replace(cfg, backend=vllm_backend(cfg.backend).name)
    except VllmDTypeError as e:
        raise KvcalError(f"--backend: {e}") from None
    if cfg.backend != "cuda" and tuple(cfg.dtypes) == DEFAULT_MENU:  # what that backend serves
        cfg = dataclasses.replace(cfg, dtypes=CPU_MENU)
    corpora = check_options(cfg, corpus)  # (corpus, eval corpus), each checked once
    pre = preflight(cfg.model, corpora[0], eval_corpus=corpora[1], loaded=model)  # the model's config, read once
    mconf = pre.model.config
    menu, menu_notes = check_head_dims(cfg, mconf)
    if menu != tuple(cfg.dtypes):  # the default menu without the dtypes this head_dim cannot hold (noted)
        cfg = dataclasses.replace(cfg, dtypes=menu)
        for n in menu_notes:
            log(f"note: {n}")
    check_budget(cfg, mconf)
    check_max_positions(cfg.context, pre.model.max_positions, "--context")
    shp = model_shape(mconf)
    L = shp.num_layers
    max_skip, skip_note = effective_max_skip(cfg.max_skip, L)  # refuses a given value outside [0, L - 1]
    cfg = dataclasses.replace(cfg, max_skip=max_skip)
    not_applicable = applicable_dtypes(cfg.dtypes, L)  # {dtype: reason}: vLLM's own 16-bit layers cover the model
    tok = tokenizer if tokenizer is not None else load_tokenizer(pre.model.source or cfg.model, vocab_size=pre.model.vocab_size)
    opts = pre.corpus.options
    ids, info = corpus_stream(cfg.corpus, tok, **opts, checked=True)
    T = cfg.context
    n_probe = max(1, math.ceil(cfg.probe_tokens / T))
    bos = served_bos(tok)  # as kvcal evaluate: a window starts with the BOS the tokenizer adds (Gemma), if any
    probe = cut_windows(ids, T, n_probe, bos=bos)
    if cfg.eval_corpus is None:
        ev = cut_windows(ids, T, cfg.windows, skip=n_probe, bos=bos)
        eval_info = {**info, "windows_after_probe": n_probe}
    else:
        eids, eval_info = corpus_stream(cfg.eval_corpus, tok, **opts, checked=True)
        ev = cut_windows(eids, T, cfg.windows, bos=bos)
    if cfg.eval_corpus is not None and len(ev) == 0 and len(probe) == n_probe:  # name the file that is short
        raise KvcalError(f"--eval-corpus {cfg.eval_corpus} has {eids.numel()} tokens; one evaluation window of "
                         f"{T} tokens needs {T} (lower --context, or give a longer --eval-corpus)")
    if len(probe) < n_probe or len(ev) == 0:
        need = (n_probe + 1) * T if cfg.eval_corpus is None else n_probe * T
        raise KvcalError(f"corpus {cfg.corpus} has {ids.numel()} tokens; {n_probe} probe window(s) of {T} tokens"
                         f"{' and at least one evaluation window' if cfg.eval_corpus is None else ''} need {need} "
                         f"(lower --context or --probe-tokens, or give a longer corpus"
                         f"{'' if cfg.eval_corpus is None else ' / --eval-corpus'})")
    crit_given = cfg.accept
    src = pre.model.source or resolve_model(cfg.model)  # an already-loaded model may carry none
    if calibrations(cfg.dtypes) and not src.gguf_file:  # its export line merges into the model's directory
        m, o = Path(src.path).resolve(), Path(cfg.out).resolve()
        if o == m or m in o.parents or o in m.parents:
            raise KvcalError(f"--out {cfg.out} overlaps the model directory {src.path}: the kvcal export line it would "
                             f"print (--model-dir {src.path} --out {Path(cfg.out) / 'checkpoint'}) is refused; "
                             "choose an --out outside the model directory")
    if model is None:
        model = load_model(src, device=cfg.device)
    # what vllm serve takes (the GGUF file, the user's directory or hub id) and what kvcal export merges into
    serve_model = str(Path(src.path) / src.gguf_file) if src.gguf_file else cfg.model
    model_dir = src.path
    bctx = budget_context(mconf)  # sliding-window layers: bytes per token averaged over the model's max context
    shares = vllm_token_shares(mconf, bctx) if bctx is not None else None
    b16 = vllm_bytes_per_token(mconf, "fp8", range(L), context=bctx)  # every layer skipped = the 16-bit cache
    doc: dict = {}

    def fill(staging: Path):
        notes = list(menu_notes) + ([skip_note] if skip_note else [])
        scales, artifact_of = {}, {}  # menu dtype -> vllm_scales of its calibrated artifact / its directory name
        calib = calibrations(cfg.dtypes)
        for cd, uses, name, _ in calib:  # fp8 first, as before nvfp4 was calibrated (its figures unchanged)
            from kvcal.calibrate import CalibrateConfig, calibrate

            fp8 = vllm_dtype(cd).family == "fp8"  # fp8 or fp8_e4m3, the menu's spelling (calibrations)
            log(f"{cd}: calibrating {'k/v scales' if fp8 else 'NVFP4 outer scales'} and q_scale "
                f"(kvcal calibrate --engine vllm --kv-cache-dtype {cd})")
            extra = cfg.fp8_kwargs if fp8 else cfg.nvfp4_kwargs
            calibrate(CalibrateConfig(corpus=cfg.corpus, out=str(staging / name), model=cfg.model,
                                      max_samples=cfg.fp8_samples, max_seq_len=cfg.fp8_seq_len, device=cfg.device,
                                      engine="vllm", kv_cache_dtype=cd,
                                      backend=None if cfg.backend == "cuda" else cfg.backend,
                                      **opts, **(extra or {})),
                      log=lambda s: None, progress=progress, model=model, tokenizer=tok, corpus=pre.corpus)
            sc = _artifact_scales(cd, staging / name, L)
            for d in uses:
                if d in cfg.dtypes:
                    scales[d], artifact_of[d] = sc, name
        sens, cands = {}, []
        for d in dict.fromkeys(cfg.dtypes):
            sc = scales.get(d, {})
            if d in not_applicable:  # not probed, not evaluated: one row saying why
                c = candidate_sets(d, None, [], L, cfg.max_skip)[0]
                cands.append({"dtype": d, "scales": row_scales(d, d in scales), "choice": c["choice"],
                              "skip_layers": c["skip"], "deployable": False, "bytes_per_token": b16, "vs_16bit": 1.0,
                              "criteria": crit_given or default_accept(VllmKVPlan(d, L, add_boundary=False)),
                              "status": NOT_APPLICABLE, "failed": [c["not_applicable"]]})
                notes.append(f"{d} not applicable on this model: {c['not_applicable']}")
                continue
            log(f"{d}: per-layer sensitivity probe on {len(probe)} x {T} tokens")
            sens[d] = layer_sensitivity(model, list(probe), d, L, progress=progress, **{"backend": cfg.backend, **sc})
            costs = skip_costs(d, L, shp.num_kv_heads, shp.head_dim, shares)
            sets = candidate_sets(d, sens[d], costs, L, cfg.max_skip)
            # a calibrated dtype is also run at vLLM's default scales (no checkpoint scales: 1.0), on the same
            # 16-bit layer sets (the probe above ran with the calibrated scales; no second probe)
            for label, vsc in ([(SCALES_CALIBRATED, sc), (SCALES_DEFAULT, {})] if d in scales
                               else [(row_scales(d, False), {})]):
                for c in sets:
                    plan = VllmKVPlan(d, L, skip_layers=tuple(c["skip"]), add_boundary=c["deployable"],
                                      **{"backend": cfg.backend, **vsc})
                    nb = vllm_bytes_per_token(mconf, d, plan.skipped, add_boundary=c["deployable"], context=bctx)
                    cands.append({"dtype": d, "scales": label, "choice": c["choice"], "skip_layers": list(plan.skipped),
                                  "deployable": c["deployable"], "bytes_per_token": nb, "vs_16bit": nb / b16,
                                  "criteria": crit_given or default_accept(plan), "_plan": plan})
        todo = {i: c["_plan"] for i, c in enumerate(cands) if "_plan" in c
                and (cfg.max_bytes_per_token is None or c["bytes_per_token"] <= cfg.max_bytes_per_token)}
        rounding = {}  # a backend that truncates: each dtype's cheapest evaluated row again, written by rounding
        if cfg.backend != "cuda":
            for i, p in list(todo.items()):
                key = (cands[i]["dtype"], cands[i]["scales"])
                if key not in rounding.values() and not p.skipped:
                    twin = VllmKVPlan(p.kv_cache_dtype, L, k_scales=p.k_scales, v_scales=p.v_scales, backend="cuda",
                                      quantize_query=False)
                    rounding[("rounding", i)] = key
                    todo[("rounding", i)] = twin
        log(f"evaluating {len(todo)} of {len(cands) + len(rounding)} candidates on {len(ev)} held-out windows x "
            f"{T} tokens")
        res = teacher_forced(model, ev, todo, progress=progress)
        truncation_cost = []
        for key, (d, label) in rounding.items():
            i = key[1]
            t, r = res[i], res[key]
            truncation_cost.append({"dtype": d, "scales": label, "kl_truncate": t["kl_mean"], "kl_round": r["kl_mean"],
                                    "delta_ppl_truncate": t["delta_ppl"], "delta_ppl_round": r["delta_ppl"]})
            notes.append(f"{d} ({label}), no 16-bit layer: backend {cfg.backend} writes FP8 by truncation: KL "
                         f"{t['kl_mean']:.3e}, ΔPPL {t['delta_ppl']:+.4f}; the same scales written by rounding to "
                         f"nearest (GPU kernels, queries kept 16-bit): KL {r['kl_mean']:.3e}, ΔPPL "
                         f"{r['delta_ppl']:+.4f} ({t['kl_mean'] / max(r['kl_mean'], 1e-30):.2f}x the KL)")
        for i, c in enumerate(cands):
            if c.pop("_plan", None) is None:  # not applicable: status and reason already set
                continue
            if i not in todo:
                c.update(status="OVER-BUDGET", failed=[f"bytes_per_token {c['bytes_per_token']} > "
                                                       f"{cfg.max_bytes_per_token}"])
                continue
            r = res[i]
            c.update({k: r[k] for k in ("kl_mean", "kl_p999", "delta_ppl", "ppl", "top1_agree")})
            c["status"], c["failed"] = judge(r, parse_accept(c["criteria"]))
        ok = [c for c in cands if c["status"] == "PASS" and c["deployable"]]
        # cheapest, then lower KL; at an exact tie the first listed (a calibrated row precedes its default twin)
        chosen = min(ok, key=lambda c: (c["bytes_per_token"], c["kl_mean"])) if ok else None
        commands = None
        if chosen is not None:
            skip_arg = serve_skip_arg(chosen["skip_layers"])
            if chosen["scales"] == SCALES_CALIBRATED:  # export its artifact's scales into the checkpoint
                ck = Path(cfg.out) / "checkpoint"
                if src.gguf_file:
                    notes.append(f"{src.model_id} is a GGUF model: kvcal export --model-dir needs its HF safetensors "
                                 "checkpoint; replace the --model-dir path with that one")
                q = shlex.quote  # shell lines, pasted as they are printed (a path may hold spaces)
                # the row was measured with the artifact's scales as calibrated; export --target vllm writes exactly
                # those by default (kvcal.export.export: the searched set for a saturating engine)
                commands = {"export": f"kvcal export --artifact {q(str(Path(cfg.out) / artifact_of[chosen['dtype']]))} "
                                      f"--target vllm --model-dir {q(str(model_dir))} --out {q(str(ck))}",
                            "serve": f"vllm serve {q(str(ck))} --kv-cache-dtype {chosen['dtype']}{skip_arg}"}
            else:
                commands = {"export": None, "serve": f"vllm serve {shlex.quote(str(serve_model))} --kv-cache-dtype "
                                                     f"{chosen['dtype']}{skip_arg}"}
                if chosen["dtype"] in artifact_of:  # calibrated dtype, chosen at vLLM's default scales
                    twin = next(c for c in cands if c["dtype"] == chosen["dtype"] and c["scales"] == SCALES_CALIBRATED
                                and c["skip_layers"] == chosen["skip_layers"] and c["deployable"])
                    kl = f"KL {twin['kl_mean']:.3e}, {twin['status']}" if "kl_mean" in twin else twin["status"]
                    notes.append(f"{chosen['dtype']} is chosen at vLLM's default scales (1.0), not with the scales "
                                 f"calibrated on the corpus (the calibrated row with the same 16-bit layers: {kl}; "
                                 f"this one: KL {chosen['kl_mean']:.3e}): no kvcal export, the vllm serve line is the "
                                 "whole deployment — a checkpoint without k_scale/v_scale/q_scale runs at 1.0 (the "
                                 "model's checkpoint must not carry such scales of its own)")
                elif vllm_dtype(chosen["dtype"]).static_scales:
                    notes.append(f"{chosen['dtype']} runs at vLLM's default scales (1.0; kvcal calibrate does not "
                                 "calibrate it): no checkpoint scales to export, the vllm serve line is the whole "
                                 "deployment")
                else:
                    notes.append(f"{chosen['dtype']} computes its scales at write time: no checkpoint scales to "
                                 "export, the vllm serve line is the whole deployment")
        keep = (artifact_of.get(chosen["dtype"]) if chosen is not None and chosen["scales"] == SCALES_CALIBRATED
                else None)  # a row at vLLM's default scales keeps no calibrated artifact
        if keep is not None:  # its export prints and records the chosen 16-bit layers, as deploy.md does
            record_skip_layers(staging / keep, chosen, cfg, sens[chosen["dtype"]],
                               {"source": "recommend probe windows", "samples": len(probe), "tokens": len(probe) * T},
                               b16)
        for _, _, name, _ in calib:  # only a chosen calibrated row's artifact stays in the output
            if name != keep and (staging / name).exists():
                shutil.rmtree(staging / name)
        if any(c["choice"] == "auto-free" for c in cands):
            notes.append("auto-free rows: the probe's choice for turboquant at vLLM's 4 layers without the forced "
                         "first-2/last-2 layers; vLLM 0.33 always adds those (engine/arg_utils.py), so these rows "
                         "show what the rule costs and are never chosen")
        if scales:
            notes.append(f"{', '.join(scales)} rows with scales '{SCALES_DEFAULT}': the same dtype with no checkpoint "
                         "k/v/q scales (vLLM then runs every static scale at 1.0), on the calibrated rows' 16-bit "
                         "layer sets (one probe, run with the calibrated scales); chosen over a calibrated row only "
                         "when cheaper or, at equal bytes, of lower KL")
        if cfg.eval_corpus is None and scales:
            notes.append(f"{' and '.join(c[0] for c in calib)} scales come from kvcal calibrate's sample subset of "
                         "the whole corpus, which may overlap the evaluation windows; pass --eval-corpus for a "
                         "disjoint evaluation file")
        source = {d: scales_source(d, d in scales) for d in dict.fromkeys(cfg.dtypes)}
        for d, name in artifact_of.items():  # the directory a note names is only there for the chosen dtype
            if name != keep and d in source:
                source[d] += f"; {name}/ not kept (only the artifact of a chosen calibrated row stays in the output)"
        notes += [f"{d} {'calibrated ' if d in scales else ''}rows: {s}" for d, s in source.items()
                  if s != WRITE_TIME]  # calibrated, or vLLM's defaults
        at_write = [d for d, s in source.items() if s == WRITE_TIME]
        if at_write:
            notes.append(f"{', '.join(at_write)} rows: {WRITE_TIME}")
        if bctx is not None:
            sl = model_shape(mconf).sliding_layers
            notes.append(f"bytes/token are averaged over {bctx} tokens (the model's maximum context): {len(sl)} of {L} "
                         f"layers are sliding-window layers whose vLLM pages stop at their window plus the in-flight "
                         f"tokens ({float(shares[sl[0]]):.3f} of a full layer's at {bctx}), so a 16-bit sliding layer "
                         "costs that share of a global one")
        doc.update({
            "schema": SCHEMA, "engine": "vllm", "vllm_version": "0.33.0", "model": serve_model,
            "backend": cfg.backend, "truncation_cost": truncation_cost,
            "passed": chosen is not None, "chosen": chosen, "commands": commands,
            "calibrated": artifact_of, "artifact": keep, "scales": source,
            "max_bytes_per_token": cfg.max_bytes_per_token, "max_skip": cfg.max_skip,
            "bytes_per_token_16bit": b16, "bytes_per_token_context": bctx, "accept": cfg.accept or "kvcal evaluate defaults by precision",
            "data": {"probe": {"corpus": info["path"], "windows": len(probe), "context": T},
                     "bos_token_id": bos,  # every probe and evaluation window starts with it (None: no BOS added)
                     "evaluation": {"corpus": eval_info["path"], "windows": len(ev), "context": T,
                                    "skipped_windows": 0 if cfg.eval_corpus else n_probe},
                     "reference_ppl": res["16-bit"]["ppl"]},
            "sensitivity": sens, "candidates": cands, "notes": notes})
        (staging / "deploy.json").write_text(json.dumps(doc, indent=2) + "\n")
        (staging / "deploy.md").write_text(render_markdown(doc))

    write_dir_atomically(Path(cfg.out), fill, overwrite=cfg.overwrite,
                         inputs={"--corpus": cfg.corpus, "--eval-corpus": cfg.eval_corpus}, kind="recommendation")
    return doc


__all__ = ["RecommendConfig", "DEFAULT_MENU", "DEFAULT_MAX_SKIP", "NOT_APPLICABLE", "CALIBRATIONS", "calibrations",
           "SCALES_CALIBRATED", "SCALES_DEFAULT", "SCALES_WRITE_TIME", "row_scales", "scales_source", "check_options", "check_head_dims", "check_budget", "effective_max_skip",
           "applicable_dtypes", "layer_sensitivity", "vllm_fp8_scales", "candidate_sets", "record_skip_layers", "recommend", "render_table", "render_markdown",
           "CPU_MENU", "RULE_COUNT", "SCHEMA", "RECOMMEND_METRICS", "WRITE_TIME", "budget_context"]
