"""``kvcal recommend --engine vllm``: which vLLM 0.33 KV configuration to deploy, measured on the user's corpus.

For every ``--kv-cache-dtype`` of the menu (:data:`DEFAULT_MENU`) and every number of 16-bit layers up to
``max_skip`` (at most the model's layers − 1: a candidate keeps at least one layer in its dtype, see
:func:`kvcal.engines.vllm.skip_layers.skip_count_range`), the layers to keep at 16 bits are chosen by a model-level probe
(the engine's ``layer_sensitivity``, :func:`kvcal.engines.vllm.probe.layer_sensitivity` →
:func:`kvcal.search.skip_layers.choose_skip_layers`); vLLM's fixed
first-2/last-2 rule is evaluated beside it at the same count (4), so both are reported at equal memory.
Each candidate runs under Protocol A (:func:`kvcal.evaluate.teacher_forced`, with vLLM's FP8 query
quantization where vLLM applies it) on evaluation windows disjoint from the probe windows, is judged by
the acceptance bar (``--accept`` or :data:`kvcal.evaluate.DEFAULT_ACCEPT` by precision), and the
cheapest deployable PASS within ``--max-bytes-per-token`` wins (ties: lower KL).

The dtypes whose static scales vLLM reads from the checkpoint and kvcal calibrate calibrates
(:data:`CALIBRATIONS`) are calibrated first, each into its own artifact, and probed and evaluated with
those scales: fp8 / fp8_e4m3 through ``kvcal calibrate --engine vllm --kv-cache-dtype fp8`` (k/v scales and
q_scale, artifact ``artifact/``), nvfp4 through ``kvcal calibrate --engine vllm --kv-cache-dtype nvfp4``
(NVFP4 outer scales and q_scale, :mod:`kvcal.engines.vllm.search_nvfp4`, artifact ``artifact-nvfp4/``). Each such dtype
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

from kvcal.evaluate.attention_probe import attention_sensitivity
from kvcal.evaluate.bounds import INCONCLUSIVE, LEVEL, judge_bounded
from kvcal.evaluate.sequential import WindowedRows
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
    HEAD_ARTIFACT,
    NOT_APPLICABLE,
    NOT_MEASURED,
    RECOMMEND_METRICS,
    RULE_COUNT,
    SCALES_CALIBRATED,
    SCALES_CALIBRATED_HEAD,
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
    from kvcal.engines import engine, names
    from kvcal.errors import KvcalError
    from kvcal.evaluate.accept import default_accept, parse_accept
    from kvcal.evaluate.windows import corpus_stream, cut_windows, served_bos
    from kvcal.formats.memory import model_shape
    from kvcal.inputs import preflight
    from kvcal.models import check_max_positions, load_model, load_tokenizer, resolve_model
    from kvcal.recommend.pairs import is_pair_engine, recommend_pairs

    if cfg.engine in names() and is_pair_engine(cfg.engine):  # chosen as a K and a V cache type (llama.cpp)
        return recommend_pairs(cfg, log=log, progress=progress, model=model, tokenizer=tokenizer, corpus=corpus)
    eng = engine(cfg.engine)  # the engine's facade (kvcal.engines): dtypes, plans, pages, probe, serve line
    try:
        cfg = dataclasses.replace(cfg, backend=eng.backend(cfg.backend).name)
    except eng.DTypeError as e:
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
    not_applicable = applicable_dtypes(cfg.dtypes, L, cfg.engine)  # {dtype: reason}: vLLM's own 16-bit layers cover the model
    tok = tokenizer if tokenizer is not None else load_tokenizer(pre.model.source or cfg.model, vocab_size=pre.model.vocab_size)
    opts = pre.corpus.options
    ids, info = corpus_stream(cfg.corpus, tok, **opts, checked=True)
    T = cfg.context
    n_probe = max(1, math.ceil(cfg.probe_tokens / T))
    bos = served_bos(tok)  # as kvcal evaluate: a window starts with the BOS the tokenizer adds (Gemma), if any
    probe = cut_windows(ids, T, n_probe, bos=bos)
    if cfg.eval_corpus is None:
        ev = cut_windows(ids, T, max(cfg.windows, cfg.max_windows), skip=n_probe, bos=bos)
        eval_info = {**info, "windows_after_probe": n_probe}
    else:
        eids, eval_info = corpus_stream(cfg.eval_corpus, tok, **opts, checked=True)
        ev = cut_windows(eids, T, max(cfg.windows, cfg.max_windows), bos=bos)
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
    shares = eng.token_shares(mconf, bctx) if bctx is not None else None
    b16 = eng.bytes_per_token(mconf, "fp8", range(L), context=bctx)  # every layer skipped = the 16-bit cache
    doc: dict = {}

    def fill(staging: Path):
        notes = list(menu_notes) + ([skip_note] if skip_note else [])
        scales, artifact_of = {}, {}  # menu dtype -> the calibrated scales of its artifact / its directory name
        calib = calibrations(cfg.dtypes)
        progress_bar = _RunBar(progress)

        # one capture for every calibration (fp8 per tensor, nvfp4, the per-KV-head rescue; kvcal.calibrate), its K/V/Q
        # reservoirs held only while a later calibration may still read them
        captures: dict = {}

        def calibrate_one(cd: str, name: str, granularity: str | None = None) -> dict:
            from kvcal.calibrate import CalibrateConfig, calibrate

            fp8 = eng.dtype(cd).family == "fp8"  # fp8 or fp8_e4m3, the menu's spelling (calibrations)
            log(f"{cd}: calibrating {'per-KV-head ' if granularity == 'head' else ''}"
                f"{'k/v scales' if fp8 else 'NVFP4 outer scales'} and q_scale (kvcal calibrate --engine vllm "
                f"--kv-cache-dtype {cd}{' --granularity head' if granularity == 'head' else ''})")
            extra = dict((cfg.fp8_kwargs if fp8 else cfg.nvfp4_kwargs) or {})
            if granularity is not None:
                extra["granularity"] = granularity
            calibrate(CalibrateConfig(corpus=cfg.corpus, out=str(staging / name), model=cfg.model,
                                      max_samples=cfg.fp8_samples, max_seq_len=cfg.fp8_seq_len, device=cfg.device,
                                      engine=cfg.engine, kv_cache_dtype=cd,
                                      backend=None if cfg.backend == "cuda" else cfg.backend,
                                      **opts, **extra),
                      log=lambda s: None, progress=False, model=model, tokenizer=tok, corpus=pre.corpus,
                      captures=captures)
            return _artifact_scales(cd, staging / name, L)

        # fp8 is calibrated up front (vLLM's default 1.0 saturates keys beyond ±448); nvfp4 and the per-KV-head
        # rescue only when screening says their rows could matter (lazy, below)
        lazy = []
        for cd, uses, name, _ in calib:
            if eng.dtype(cd).family == "fp8":
                sc = calibrate_one(cd, name)
                for d in uses:
                    if d in cfg.dtypes:
                        scales[d], artifact_of[d] = sc, name
            else:
                lazy.append((cd, uses, name))
        rescue = cfg.backend == "cuda" and cfg.per_head and any(d in ("fp8", "fp8_e4m3") for d in scales)
        if not (lazy or rescue):
            captures.clear()  # no later calibration can read it
        ev_rows = WindowedRows(model, ev, on_forward=progress_bar.tick)
        n0 = min(cfg.windows, len(ev))
        cap = max(n0, min(cfg.max_windows, len(ev)))
        looks = 1 + max(0, math.ceil(math.log2(cap / n0)))
        pass_level = 1 - (1 - LEVEL) / looks  # Bonferroni over a row's looks: a false PASS has probability <= 5%
        sens, cands, groups = {}, [], {}

        def add_group(d: str, label: str, vsc: dict, sets: list, head: bool = False):
            key = (d, label)
            for c in sets:
                plan = eng.Plan(d, L, skip_layers=tuple(c["skip"]), add_boundary=c["deployable"],
                                  **{"backend": cfg.backend, **vsc})
                nb = eng.bytes_per_token(mconf, d, plan.skipped, add_boundary=c["deployable"], context=bctx)
                row = {"dtype": d, "scales": label, "granularity": "head" if head else "tensor",
                       "choice": c["choice"], "skip_layers": list(plan.skipped), "deployable": c["deployable"],
                       "bytes_per_token": nb, "vs_16bit": nb / b16,
                       "criteria": crit_given or default_accept(plan), "_plan": plan}
                groups.setdefault(key, []).append(len(cands))
                cands.append(row)
            return key

        def sets_of(name: str, d: str) -> list:
            costs = eng.skip_costs(d, L, shp.num_kv_heads, shp.head_dim, shares)
            return candidate_sets(d, sens[name], costs, L, cfg.max_skip, cfg.engine)

        def probe_groups(plans: dict):
            log(f"per-layer probe: {', '.join(plans)} on {len(probe)} x {T} tokens (one 16-bit forward per window, "
                "each dtype's attention-output error per layer)")
            sens.update(attention_sensitivity(model, list(probe), plans, progress=False))

        def judge_row(i: int, n: int):
            c = cands[i]
            ev_rows.measure(i, c["_plan"], n)
            r = ev_rows.result(i)
            j = judge_bounded(r, parse_accept(c["criteria"]), level=pass_level, fail_level=LEVEL)
            c.update({k: r[k] for k in ("kl_mean", "kl_p999", "delta_ppl", "ppl", "top1_agree")})
            c.update(windows=r["windows"], status=j["status"], failed=j["failed"], bounds=j["bounds"],
                     windows_needed=j["windows_needed"],
                     per_window={k: r["per_window"][k] for k in ("kl_mean", "nll", "ref_nll")})

        def in_budget(i: int) -> bool:
            return cfg.max_bytes_per_token is None or cands[i]["bytes_per_token"] <= cfg.max_bytes_per_token

        def screen(key, probe_name: str):
            """A group (dtype and scales) on the first windows: its cheapest deployable row; when that does not
            pass, the group's rows with more 16-bit layers are either pruned by the probe (its cheapest row FAILs a
            KL clause by more than keeping the max_skip most sensitive layers could remove, with a factor 2 of
            margin for the probe's approximation) or judged by the row with the most 16-bit layers, whose FAIL
            prunes the rows with fewer (the probe's sets are nested)."""
            dep = [i for i in groups[key] if cands[i]["deployable"] and in_budget(i)]
            if not dep or cfg.measure_all:
                return
            lo = min(dep, key=lambda i: (cands[i]["bytes_per_token"], i))
            hi = max(dep, key=lambda i: (len(cands[i]["skip_layers"]), cands[i]["bytes_per_token"], -i))
            progress_bar.plan(n0)
            judge_row(lo, n0)
            if cands[lo]["status"] == "PASS" or hi == lo:
                return
            why = None
            if cands[lo]["status"] == "FAIL":
                kept = _probe_share(sens[probe_name], cands[lo]["skip_layers"], cands[hi]["skip_layers"])
                for name, op, bar in parse_accept(cands[lo]["criteria"]):
                    lb = (cands[lo]["bounds"].get(name) or {}).get("lower")
                    if name == "kl_mean" and op in ("<=", "<") and lb is not None and lb * (1 - kept) > 2 * bar:
                        why = (f"not measured: without 16-bit layers beyond {_layers(cands[lo])} this group FAILs "
                               f"(KL lower bound {lb:.3e}); its {len(cands[hi]['skip_layers'])} most sensitive layers "
                               f"hold {kept:.0%} of the probe's error, so at best about {lb * (1 - kept):.3e} "
                               f"remains — over twice the bar {bar:g}")
            if why is None:
                progress_bar.plan(n0)
                judge_row(hi, n0)
                if cands[hi]["status"] == "FAIL":
                    why = (f"not measured: this group's row with the most 16-bit layers ({_layers(cands[hi])}) fails "
                           f"its bar on its bound ({cands[hi]['failed'][0]}); rows with fewer 16-bit layers (the "
                           "probe's sets are nested) are not expected to pass")
            if why is not None:
                for i in groups[key]:
                    if "status" not in cands[i] and in_budget(i):
                        cands[i].update(status=NOT_MEASURED, failed=[why])

        for d in dict.fromkeys(cfg.dtypes):
            if d in not_applicable:  # not probed, not evaluated: one row saying why
                c = candidate_sets(d, None, [], L, cfg.max_skip, cfg.engine)[0]
                cands.append({"dtype": d, "scales": row_scales(d, d in scales, cfg.engine), "granularity": "tensor",
                              "choice": c["choice"], "skip_layers": c["skip"], "deployable": False,
                              "bytes_per_token": b16, "vs_16bit": 1.0,
                              "criteria": crit_given or default_accept(eng.Plan(d, L, add_boundary=False)),
                              "status": NOT_APPLICABLE, "failed": [c["not_applicable"]]})
                notes.append(f"{d} not applicable on this model: {c['not_applicable']}")
        menu = [d for d in dict.fromkeys(cfg.dtypes) if d not in not_applicable]
        probe_groups({d: eng.Plan(d, L, add_boundary=False, **{"backend": cfg.backend, **scales.get(d, {})})
                      for d in menu})
        for d in menu:
            sets = sets_of(d, d)
            # a calibrated dtype is also run at vLLM's default scales (no checkpoint scales: 1.0), on the same
            # 16-bit layer sets (the probe ran with the calibrated scales)
            for label, vsc in ([(SCALES_CALIBRATED, scales[d]), (SCALES_DEFAULT, {})] if d in scales
                               else [(row_scales(d, False, cfg.engine), {})]):
                screen(add_group(d, label, vsc, sets), d)
        # lazy calibrations: nvfp4's outer scales when its rows at vLLM's default scales are not out of reach
        # (their row with the most 16-bit layers does not FAIL); the calibrated rows reuse those layer sets
        amax = _fp8_amax(staging, artifact_of)
        for cd, uses, name in lazy:
            for d in (x for x in uses if x in menu):
                key = (d, row_scales(d, False, cfg.engine))
                rows = [cands[i] for i in groups.get(key, []) if "kl_mean" in cands[i]]
                near = [c for c in rows if any(n == "kl_mean" and c["kl_mean"] <= NVFP4_NEAR * bar
                                               for n, _, bar in parse_accept(c["criteria"]))]
                if _default_outer_ok(amax) and not near and not cfg.measure_all:
                    lo_a = min(a for pair in amax for a in pair)
                    hi_a = max(a for pair in amax for a in pair)
                    best_kl = min((c["kl_mean"] for c in rows), default=None)
                    notes.append(f"{d}: not calibrated — every layer's K/V amax ({lo_a:.3g} to {hi_a:.3g}, from the "
                                 "fp8 calibration) keeps vLLM's default outer scale 1.0 well conditioned (no block "
                                 "scale saturates, the largest stay inside e4m3's normal range), so "
                                 "calibrating moves only the blocks' alignment on the e4m3 grid — a few percent of "
                                 "KL on the models measured (docs/results.md) — and no measured row at 1.0 is within "
                                 f"{NVFP4_NEAR:g}x of its KL bar"
                                 + (f" (best {best_kl:.3e})" if best_kl is not None else "")
                                 + "; --measure-all calibrates it anyway")
                    continue
                scales[d], artifact_of[d] = calibrate_one(cd, name), name
                screen(add_group(d, SCALES_CALIBRATED, scales[d], sets_of(d, d)), d)
        if not rescue:
            captures.clear()
        # the per-KV-head FP8 rescue (vLLM: compressed-tensors strategy attn_head, FlashAttention-3): calibrated
        # and measured when per-tensor FP8 without 16-bit layers does not pass on its bound
        fp8d = next((d for d in menu if d in ("fp8", "fp8_e4m3") and d in scales), None)
        if fp8d is not None and cfg.backend == "cuda" and cfg.per_head:
            base_i = [i for key in ((fp8d, SCALES_CALIBRATED), (fp8d, SCALES_DEFAULT))
                      for i in groups.get(key, []) if not cands[i]["skip_layers"] and cands[i]["deployable"]]
            for i in base_i:  # measured by the screening, or here (--measure-all screens nothing)
                if "kl_mean" not in cands[i]:
                    progress_bar.plan(n0)
                    judge_row(i, n0)
            base = [cands[i] for i in base_i]
            if base and (cfg.measure_all or all(c.get("status") != "PASS" for c in base)):
                hs = calibrate_one(fp8d, HEAD_ARTIFACT, granularity="head")
                head_key = f"{fp8d} per-KV-head"
                probe_groups({head_key: eng.Plan(fp8d, L, add_boundary=False, **{"backend": cfg.backend, **hs})})
                artifact_of[head_key] = HEAD_ARTIFACT
                scales[head_key] = hs
                screen(add_group(fp8d, SCALES_CALIBRATED_HEAD, hs, sets_of(head_key, fp8d), head=True), head_key)
                notes.append(f"{fp8d} per-KV-head rows: per-tensor {fp8d} without 16-bit layers does not pass "
                             f"({base[0]['status']}: {'; '.join(base[0]['failed']) or 'undecided'}), so per-KV-head "
                             "k/v/q scales were calibrated (kvcal calibrate --granularity head) as a rescue; vLLM "
                             "loads them through compressed-tensors strategy attn_head on the FlashAttention-3 "
                             "backend (Hopper GPUs) only")
            elif base:
                notes.append(f"per-KV-head {fp8d} not calibrated: per-tensor {fp8d} without 16-bit layers passes")
        captures.clear()  # every calibration has run
        # cheapest first, adding windows where a bound straddles the bar (doubling, up to the cap); once a row
        # passes, every dearer row is left unmeasured
        best = None
        order = sorted((i for i, c in enumerate(cands) if "_plan" in c), key=lambda i: (cands[i]["bytes_per_token"], i))
        for i in order:
            c = cands[i]
            if not in_budget(i):
                c.update(status="OVER-BUDGET", failed=[f"bytes_per_token {c['bytes_per_token']} > "
                                                       f"{cfg.max_bytes_per_token}"])
                continue
            if c.get("status") in ("FAIL", NOT_MEASURED):
                continue
            if not c["deployable"] and not cfg.measure_all:
                if "status" not in c:
                    c.update(status=NOT_MEASURED, failed=["not measured: not deployable on stock vLLM 0.33 (its forced "
                                                          "first-2/last-2 16-bit layers)"])
                continue
            if best is not None and c["bytes_per_token"] > cands[best]["bytes_per_token"] and not cfg.measure_all:
                if c.get("status") != "PASS":
                    c.update(status=NOT_MEASURED if "kl_mean" not in c else c["status"],
                             failed=(c.get("failed") or []) + [f"not measured further: a cheaper row passed "
                                                              f"({_row_name(cands[best])})"])
                continue
            while True:
                n = max(ev_rows.measured(i), n0) if c.get("status") != INCONCLUSIVE else min(2 * c["windows"], cap)
                if "kl_mean" in c and n <= c.get("windows", 0):
                    break
                progress_bar.plan(n - ev_rows.measured(i))
                judge_row(i, n)
                if c["status"] != INCONCLUSIVE or c["windows"] >= cap:
                    break
            if c["status"] == "PASS" and c["deployable"] and (best is None or c["bytes_per_token"] < cands[best]["bytes_per_token"]):
                best = i
        for c in cands:
            if "status" not in c:  # a row never reached (a dearer row behind a decided one)
                c.update(status=NOT_MEASURED, failed=["not measured"])
        # a backend that truncates: each dtype's cheapest measured row without 16-bit layers again, written by
        # rounding (the GPU kernels' write), on the same windows — what truncation costs
        rounding, truncation_cost = {}, []
        if cfg.backend != "cuda":
            for i in order:
                c = cands[i]
                key = (c["dtype"], c["scales"])
                if key in rounding.values() or c["skip_layers"] or "kl_mean" not in c:
                    continue
                p = c["_plan"]
                twin = eng.Plan(p.kv_cache_dtype, L, k_scales=p.k_scales, v_scales=p.v_scales, backend="cuda",
                                  quantize_query=False)
                rounding[("rounding", i)] = key
                ev_rows.measure(("rounding", i), twin, c["windows"])
                t, r = ev_rows.result(i), ev_rows.result(("rounding", i))
                truncation_cost.append({"dtype": c["dtype"], "scales": c["scales"], "kl_truncate": t["kl_mean"],
                                        "kl_round": r["kl_mean"], "delta_ppl_truncate": t["delta_ppl"],
                                        "delta_ppl_round": r["delta_ppl"]})
                notes.append(f"{c['dtype']} ({c['scales']}), no 16-bit layer: backend {cfg.backend} writes FP8 by "
                             f"truncation: KL {t['kl_mean']:.3e}, ΔPPL {t['delta_ppl']:+.4f}; the same scales written "
                             f"by rounding to nearest (GPU kernels, queries kept 16-bit): KL {r['kl_mean']:.3e}, ΔPPL "
                             f"{r['delta_ppl']:+.4f} ({t['kl_mean'] / max(r['kl_mean'], 1e-30):.2f}x the KL)")
        progress_bar.close()
        for c in cands:
            c.pop("_plan", None)
        used = max((c.get("windows", 0) for c in cands), default=0)
        ok = [c for c in cands if c["status"] == "PASS" and c["deployable"]]
        # cheapest; at equal bytes a row that needs no particular attention backend (per-tensor scales), then lower
        # KL; at an exact tie the first listed (a calibrated row precedes its default twin)
        chosen = (min(ok, key=lambda c: (c["bytes_per_token"], c["granularity"] == "head", c["kl_mean"]))
                  if ok else None)
        if chosen is None:
            notes.append(_what_would_pass(cands, cfg, cap, len(ev)))
        elif chosen["skip_layers"] or chosen["granularity"] == "head":  # a rescue: say why the plain row was not it
            plain = [c for c in cands if c["dtype"] == chosen["dtype"] and c["deployable"] and c["granularity"] ==
                     "tensor" and not c["skip_layers"] and "kl_mean" in c and c["status"] != "PASS"]
            for c in plain:
                notes.append(f"why not per-tensor {c['dtype']} ({c['scales']}) without 16-bit layers: {c['status']} — "
                             f"{'; '.join(c['failed']) or 'undecided'} (KL {c['kl_mean']:.3e} on {c['windows']} "
                             f"windows); the chosen rescue keeps {_layers(chosen)} at 16 bits"
                             + (" with per-KV-head scales" if chosen["granularity"] == "head" else "")
                             + f" (the probe's most sensitive layers: "
                             f"{', '.join(map(str, _top_layers(sens, chosen)))})")
        notes.append(f"every status is judged on one-sided bounds over the evaluation windows (kvcal.evaluate.bounds): "
                     f"a PASS needs each clause's {pass_level:.2%} Student-t bound inside the bar ({LEVEL:.0%} split "
                     f"over up to {looks} looks per row: {n0} windows, doubled while undecided, at most {cap}), a "
                     f"FAIL the {LEVEL:.0%} opposite bound outside it; INCONCLUSIVE otherwise. Rows are measured "
                     "cheapest first and a row dearer than a PASS is not measured; each group (dtype and scales) is "
                     "screened first by its cheapest row and its row with the most 16-bit layers")
        notes.append(f"per-layer probe: each dtype's attention-output error per layer when only that layer is "
                     f"quantized (kvcal.evaluate.attention_probe.attention_sensitivity; one 16-bit forward per probe "
                     f"window for the whole menu); it ranks the layers kept at 16 bits, the rows are judged on their "
                     f"measured model-level figures. {ev_rows.forwards} evaluation forward passes of {T} tokens")
        commands = None
        if chosen is not None:
            if chosen["scales"] in (SCALES_CALIBRATED, SCALES_CALIBRATED_HEAD):  # export its artifact's scales
                ck = Path(cfg.out) / "checkpoint"
                head = chosen["granularity"] == "head"
                if src.gguf_file:
                    notes.append(f"{src.model_id} is a GGUF model: kvcal export --model-dir needs its HF safetensors "
                                 "checkpoint; replace the --model-dir path with that one")
                q = shlex.quote  # shell lines, pasted as they are printed (a path may hold spaces)
                # the row was measured with the artifact's scales as calibrated; export --target vllm writes exactly
                # those by default (kvcal.export.export: the searched set for a saturating engine)
                art_dir = HEAD_ARTIFACT if head else artifact_of[chosen["dtype"]]
                commands = {"export": f"kvcal export --artifact {q(str(Path(cfg.out) / art_dir))} "
                                      f"--target vllm --model-dir {q(str(model_dir))} --out {q(str(ck))}",
                            "serve": eng.serve_line(q(str(ck)), chosen["dtype"], chosen["skip_layers"], per_head=head)}
                if head:
                    notes.append("the chosen row uses per-KV-head k/v/q scales: vLLM loads them (compressed-tensors "
                                 "strategy attn_head) on the FlashAttention-3 backend only, i.e. Hopper GPUs; the serve "
                                 "line selects it (VLLM_ATTENTION_BACKEND=FLASH_ATTN)")
            else:
                commands = {"export": None, "serve": eng.serve_line(shlex.quote(str(serve_model)), chosen["dtype"],
                                                                    chosen["skip_layers"])}
                if chosen["dtype"] in artifact_of:  # calibrated dtype, chosen at vLLM's default scales
                    twin = next(c for c in cands if c["dtype"] == chosen["dtype"] and c["scales"] == SCALES_CALIBRATED
                                and c["skip_layers"] == chosen["skip_layers"] and c["deployable"])
                    kl = f"KL {twin['kl_mean']:.3e}, {twin['status']}" if "kl_mean" in twin else twin["status"]
                    notes.append(f"{chosen['dtype']} is chosen at vLLM's default scales (1.0), not with the scales "
                                 f"calibrated on the corpus (the calibrated row with the same 16-bit layers: {kl}; "
                                 f"this one: KL {chosen['kl_mean']:.3e}): no kvcal export, the vllm serve line is the "
                                 "whole deployment — a checkpoint without k_scale/v_scale/q_scale runs at 1.0 (the "
                                 "model's checkpoint must not carry such scales of its own)")
                elif eng.dtype(chosen["dtype"]).static_scales:
                    notes.append(f"{chosen['dtype']} runs at vLLM's default scales (1.0; kvcal calibrate does not "
                                 "calibrate it): no checkpoint scales to export, the vllm serve line is the whole "
                                 "deployment")
                else:
                    notes.append(f"{chosen['dtype']} computes its scales at write time: no checkpoint scales to "
                                 "export, the vllm serve line is the whole deployment")
        keep = None  # a row at vLLM's default scales keeps no calibrated artifact
        if chosen is not None and chosen["scales"] == SCALES_CALIBRATED_HEAD:
            keep = HEAD_ARTIFACT
        elif chosen is not None and chosen["scales"] == SCALES_CALIBRATED:
            keep = artifact_of.get(chosen["dtype"])
        if keep is not None:  # its export prints and records the chosen 16-bit layers, as deploy.md does
            probe_key = f"{chosen['dtype']} per-KV-head" if keep == HEAD_ARTIFACT else chosen["dtype"]
            record_skip_layers(staging / keep, chosen, cfg, sens[probe_key],
                               {"source": "recommend probe windows", "samples": len(probe), "tokens": len(probe) * T,
                                "metric": "attention-output error per layer (relative)"},
                               b16)
        for name in [*(c[2] for c in calib), HEAD_ARTIFACT]:  # only a chosen calibrated row's artifact stays
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
        source = {d: scales_source(d, d in scales, cfg.engine) for d in dict.fromkeys(cfg.dtypes)}
        if any(c["granularity"] == "head" for c in cands):
            source[f"{fp8d} per-KV-head"] = (f"per-KV-head k_scale, v_scale and q_scale calibrated on the corpus "
                                             f"(kvcal calibrate --engine vllm --kv-cache-dtype {fp8d} --granularity "
                                             f"head, {HEAD_ARTIFACT}/)")
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
            "schema": SCHEMA, "engine": cfg.engine, "vllm_version": eng.VERSION, "model": serve_model,
            "backend": cfg.backend, "truncation_cost": truncation_cost,
            "passed": chosen is not None, "chosen": chosen, "commands": commands,
            "calibrated": artifact_of, "artifact": keep, "scales": source,
            "max_bytes_per_token": cfg.max_bytes_per_token, "max_skip": cfg.max_skip,
            "bytes_per_token_16bit": b16, "bytes_per_token_context": bctx, "accept": cfg.accept or "kvcal evaluate defaults by precision",
            "data": {"probe": {"corpus": info["path"], "windows": len(probe), "context": T},
                     "bos_token_id": bos,  # every probe and evaluation window starts with it (None: no BOS added)
                     "evaluation": {"corpus": eval_info["path"], "windows": used, "windows_available": len(ev),
                                    "windows_first": n0, "windows_cap": cap, "forward_passes": ev_rows.forwards,
                                    "pass_level": pass_level, "fail_level": LEVEL,
                                    "context": T,
                                    "skipped_windows": 0 if cfg.eval_corpus else n_probe},
                     "reference_ppl": ev_rows.reference_ppl(used) if used else None},
            "sensitivity": sens, "candidates": cands, "notes": notes})
        (staging / "deploy.json").write_text(json.dumps(doc, indent=2) + "\n")
        (staging / "deploy.md").write_text(render_markdown(doc))

    write_dir_atomically(Path(cfg.out), fill, overwrite=cfg.overwrite,
                         inputs={"--corpus": cfg.corpus, "--eval-corpus": cfg.eval_corpus}, kind="recommendation")
    return doc


#: The range of every layer's K/V amax in which vLLM's default NVFP4 outer scale 1.0 is well conditioned, so that
#: recommend may skip calibrating nvfp4 when no default-scale row is near its bar: at 1.0 a block's e4m3 scale is its
#: amax/6, so the largest block neither saturates (amax <= 448 x 6 = 2688) nor leaves e4m3's normal range (amax/6 at
#: least one octave above its smallest normal 2^-6); calibration then moves the blocks' alignment on the e4m3 grid.
NVFP4_DEFAULT_AMAX_RANGE = (6 * 2.0 ** -5, 448.0 * 6)


#: A row at vLLM's default NVFP4 outer scale within this factor of its KL bar gets nvfp4 calibrated (the few percent
#: calibration moves could decide it).
NVFP4_NEAR = 1.25


def _fp8_amax(staging: Path, artifact_of: dict) -> list[tuple[float, float]] | None:
    """Per-layer ``(k_amax, v_amax)`` recorded by the fp8 calibration of this run (None without one)."""
    from kvcal.artifact import load_artifact
    from kvcal.evaluate.baselines import artifact_amax

    name = artifact_of.get("fp8") or artifact_of.get("fp8_e4m3")
    if name is None or not (staging / name).exists():
        return None
    return artifact_amax(load_artifact(staging / name).metadata)


def _default_outer_ok(amax: list[tuple[float, float]] | None) -> bool:
    """Whether every layer's K and V amax lies in :data:`NVFP4_DEFAULT_AMAX_RANGE` (False when none is known)."""
    lo, hi = NVFP4_DEFAULT_AMAX_RANGE
    return bool(amax) and all(lo <= a <= hi for pair in amax for a in pair)


class _RunBar:
    """One progress bar for the whole run, in forward passes of evaluation windows: its total grows as rows are
    planned (a row's first windows, and more while its bound is undecided), so tqdm's ETA is for the work known."""

    def __init__(self, enabled: bool):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=0, desc="recommend (windows)", unit="fwd", disable=not enabled)

    def plan(self, n: int):
        self.bar.total += max(0, int(n))
        self.bar.refresh()

    def tick(self):
        if self.bar.n >= self.bar.total:  # a reference window (not planned per row)
            self.bar.total += 1
        self.bar.update()

    def close(self):
        self.bar.close()


def _probe_share(sensitivity: list[float], base: list[int], more: list[int]) -> float:
    """The share of the probe's per-layer error outside ``base`` (layers already at 16 bits) that the layers of
    ``more`` not in ``base`` hold: what keeping them at 16 bits removes under an additive model."""
    rest = [i for i in range(len(sensitivity)) if i not in set(base)]
    total = sum(sensitivity[i] for i in rest)
    if total <= 0:
        return 1.0
    return sum(sensitivity[i] for i in set(more) - set(base)) / total


def _top_layers(sens: dict, c: dict, n: int = 3) -> list[int]:
    """The ``n`` layers the probe found most sensitive for row ``c``'s dtype (and granularity)."""
    key = f"{c['dtype']} per-KV-head" if c.get("granularity") == "head" else c["dtype"]
    s = sens.get(key) or []
    return sorted(range(len(s)), key=lambda i: -s[i])[:n]


def _layers(c: dict) -> str:
    return ",".join(map(str, c["skip_layers"])) or "none"


def _row_name(c: dict) -> str:
    """``fp8 (calibrated), 16-bit layers 0,1, 11904 B/token``."""
    return f"{c['dtype']} ({c['scales']}), 16-bit layers {_layers(c)}, {c['bytes_per_token']} B/token"


def _what_would_pass(cands: list[dict], cfg: RecommendConfig, cap: int, available: int) -> str:
    """The note when no row passes: the measured deployable row nearest its bar (the smallest ratio of a clause's
    bound to its bar, worst clause), its memory, its 16-bit layers and granularity, and what would decide or
    rescue it."""
    from kvcal.evaluate.accept import parse_accept

    best, worst_ratio = None, None
    for c in cands:
        if not c.get("deployable") or not c.get("bounds"):
            continue
        ratios = []
        for name, op, bar in parse_accept(c["criteria"]):
            b = c["bounds"].get(name) or {}
            bd = b.get("bound")
            if bd is None or bar == 0:
                continue
            ratios.append(bd / bar if op in ("<=", "<") else bar / bd if bd > 0 else math.inf)
        r = max(ratios) if ratios else math.inf
        if worst_ratio is None or (r, c["bytes_per_token"]) < (worst_ratio, best["bytes_per_token"]):
            best, worst_ratio = c, r
    if best is None:
        return "no configuration passes, and no deployable row was measured: widen --max-bytes-per-token or --dtypes"
    what = (f"no configuration passes its bar on its bound; nearest: {_row_name(best)} "
            f"({best['vs_16bit']:.3f}x 16-bit, {best['granularity']} scales): {best['status']}, "
            f"{'; '.join(best['failed']) or 'undecided'}")
    if best["status"] == INCONCLUSIVE:
        need = best.get("windows_needed")
        what += (f"; about {need} evaluation windows would decide it (--max-windows {need}"
                 + (f", the corpus holds {available}" if need and need > available else "") + ")"
                 if need else "; more windows would not decide it at this spread")
    elif len(best["skip_layers"]) >= cfg.max_skip:
        what += f"; it already keeps --max-skip {cfg.max_skip} layers at 16 bits: raise --max-skip, or loosen --accept"
    return what


__all__ = ["RecommendConfig", "DEFAULT_MENU", "DEFAULT_MAX_SKIP", "NOT_APPLICABLE", "CALIBRATIONS", "calibrations",
           "SCALES_CALIBRATED", "SCALES_DEFAULT", "SCALES_WRITE_TIME", "row_scales", "scales_source", "check_options", "check_head_dims", "check_budget", "effective_max_skip",
           "applicable_dtypes", "candidate_sets", "record_skip_layers", "recommend", "render_table", "render_markdown",
           "CPU_MENU", "RULE_COUNT", "SCHEMA", "RECOMMEND_METRICS", "WRITE_TIME", "budget_context"]
