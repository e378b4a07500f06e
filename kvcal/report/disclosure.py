"""The disclosure report: ``report.md`` + ``report.html`` (PNG figures embedded as base64).

:func:`build_report` turns artifact metadata (+ an optional evaluation JSON) into a list of blocks
(:class:`Heading`, :class:`Para`, :class:`Bullets`, :class:`Table`, :class:`Figure`, :class:`Pre`);
:func:`~kvcal.report.document.to_markdown` / :func:`~kvcal.report.document.to_html` render them; :func:`write_report` writes both files (the
markdown links ``figures/*.png`` written beside it; the HTML is self-contained).

What it states (the issue's acceptance list): which tensors are quantized and each one's format
and granularity; the weight precision, separately; calibration vs evaluation corpus (domain,
length percentiles side by side); context/concurrency regimes tested; cache bytes per token and
capacity gained vs 16-bit; quality figures with baselines and PASS/FAIL; and the plots of
:mod:`kvcal.report.plots`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvcal.report import data as D
from kvcal.report.document import Bullets, Figure, Heading, Para, Pre, Report, Table, to_html, to_markdown


# ---- formatting helpers ----------------------------------------------------------------------
def _num(x, spec: str = ".4g") -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        return format(x, spec)
    return str(x)


def _sci(x) -> str:
    return "–" if x is None else f"{x:.3e}"


def _bytes(n) -> str:
    if n is None:
        return "–"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:g} B"


def _gran(row: dict) -> str:
    if not row["quantized"]:
        return "–"
    g = row["granularity"] or "?"
    if row.get("group_size"):
        g += f" (group {row['group_size']})"
    return g


# ---- sections --------------------------------------------------------------------------------
def _what_is_quantized(rep: Report, meta: dict) -> None:
    kv = meta.get("kv") or {}
    m = meta.get("model") or {}
    from kvcal.artifact.sections import engine_section

    sec = engine_section(meta)
    rep.add(Heading("What is quantized (KV cache)"))
    skip = sec.skip_layers if sec else None
    rep.add(Para(f"**Quantized tensors: {D.quantized_label(meta)}** of every attention layer "
                 + (f"but layers {', '.join(map(str, skip))}, which vLLM keeps in the model dtype (section below) "
                    if skip else "")
                 + f"({_num(m.get('num_layers'))} layers × {_num(m.get('num_kv_heads'))} KV heads × head_dim "
                 f"{_num(m.get('head_dim'))}). "
                 + ("Queries are FP8 too on the serving engine (section below); all other activations stay in the model's "
                    "compute precision." if sec and sec.q_scale else
                    "Queries and all other activations stay in the model's compute precision.")))
    rows = []
    for r in D.side_rows(meta):
        rows.append([
            "K (keys)" if r["side"] == "k" else "V (values)",
            "yes" if r["quantized"] else "no (16-bit)",
            r["format"], _num(r["bits"]), _gran(r),
            "–" if not r["quantized"] else ("symmetric" if r["symmetric"] else "asymmetric"),
            "–" if not r["quantized"] else ("dynamic (per write)" if r["dynamic"] else "static (calibrated)"),
            r["scale_dtype"] or "–",
        ])
    rep.add(Table(["tensor", "quantized", "KV format", "bits", "granularity", "symmetry", "scales", "scale dtype"], rows))
    items = []
    if kv.get("key_position"):
        items.append(f"Keys are quantized **{kv['key_position'].replace('_', '-')}** (what the cache stores).")
    items.append(f"Kept in 16 bits: residual window {_num(kv.get('residual_window', 0))} most recent tokens, "
                 f"{_num(kv.get('sink_tokens', 0))} sink tokens.")
    if kv.get("key_centering"):
        items.append("Keys are centred per channel (k_mean subtracted before quantization).")
    trs = kv.get("transforms") or []
    for side, name in (("k", "Keys"), ("v", "Values")):
        kinds = sorted({t.get(side, "none") for t in trs} - {"none"})
        if kinds:
            items.append(f"{name} are quantized after a transform: {', '.join(k.replace('_', '-') for k in kinds)} "
                         "(inverted after dequantization; engines do not apply it — kvcal runtime only).")
    rounded = [lm["layer"] for lm in meta.get("layers") or [] if (lm.get("k") or {}).get("rounding")]
    if rounded:
        items.append(f"Keys use query-aware rounding (OPTQ-style error feedback weighted by calibration queries) in "
                     f"{len(rounded)} of {_num(m.get('num_layers'))} layers; its matrix is counted as per-layer metadata.")
    widths = [lm["layer"] for lm in meta.get("layers") or [] if (lm.get("k") or {}).get("channel_bits")]
    if widths:
        items.append(f"Keys use per-channel bit widths (1–8 bits, each head's row keeping the format's size; chosen "
                     f"from calibration queries × key ranges) in {len(widths)} of {_num(m.get('num_layers'))} layers; "
                     "the width table is counted as per-layer metadata (kvcal runtime only).")
    lv = [lm["layer"] for lm in meta.get("layers") or [] if (lm.get("v") or {}).get("levels")]
    if lv:
        items.append(f"Values use non-uniform levels (a per-layer table of 2^bits levels fitted on the calibration "
                     f"values; codes index it) in {len(lv)} of {_num(m.get('num_layers'))} layers; the table is counted "
                     "as per-layer metadata (kvcal runtime only).")
    tl = [lm["layer"] for lm in meta.get("layers") or [] if (lm.get("v") or {}).get("trellis")]
    if tl:
        items.append(f"Values are trellis-coded in {len(tl)} of {_num(m.get('num_layers'))} layers (QTIP's bitshift "
                     "trellis: each element reads a per-layer table at the last ν+b bits of its row's code stream; "
                     "Viterbi-encoded, same payload; the row's RMS is its scale); the int8 table is counted as "
                     "per-layer metadata (kvcal runtime only). The other layers keep their levels, which measured "
                     f"lower {D.heldout_word(meta)} error there.")
    specs_all = [kv.get("k") or {}, kv.get("v") or {}] + [s.get(x) or {} for s in kv.get("layer_specs") or [] for x in "kv"]
    if any(sp.get("scale_dtype") == "log8" for sp in specs_all):
        items.append("Some per-token scales are stored as log8: one byte per token and head, scale = base · "
                     "2^(code/16) with a calibrated per-head base (≤ 4.4% coarser than the exact scale; kvcal runtime only).")
    if kv.get("layer_specs"):
        kinds = sorted({f"K {s['k'].get('format')} / V {s['v'].get('format')}" for s in kv["layer_specs"]})
        items.append(f"Per-layer formats differ (mixed precision): {'; '.join(kinds)}.")
    cal = meta.get("calibration") or {}
    if isinstance(cal.get("average_bits"), (int, float)):
        items.append(f"Average bits per cached element including all metadata at {_num(cal.get('average_bits_context'))} "
                     f"tokens: **{cal['average_bits']:.4f}**" + (f" (budget {cal['bits_budget']})" if cal.get("bits_budget") else "")
                     + (f", preset `{cal['preset']}`" if cal.get("preset") else "") + ".")
    alloc = cal.get("allocation") if isinstance(cal.get("allocation"), dict) else None
    if alloc:
        p = alloc.get("probe")
        items.append(f"Per-layer formats were allocated under {_num(alloc.get('budget_bits'))} bits from "
                     f"{D.heldout_word(meta)} "
                     "attention-level errors" + (" summed over layers (no model-level probe)." if not isinstance(p, dict)
                     else f" weighted by each layer's K / V model-level KL measured alone on {_num(p.get('samples'))} "
                          f"{p.get('source')} samples ({_num(p.get('tokens'))} tokens)."))
    items.append("`scale` is the dequantization multiplier: x ≈ q · scale.")
    rep.add(Bullets(items))


def _serving_engine(rep: Report, meta: dict) -> None:
    """Engine, ``--kv-cache-dtype``, skipped layers, query quantization and ``q_scale`` of an artifact
    calibrated with ``kvcal calibrate --engine vllm`` (its ``vllm`` metadata section); nothing otherwise."""
    from kvcal.artifact.sections import engine_section

    sec = engine_section(meta)
    if sec is None:
        return
    rep.add(Heading("Serving engine"))
    qs = [x for row in sec.q_scale for x in row]
    skip = sec.skip_layers
    cpu = sec.backend == "cpu"
    qq = "none" if sec.query_quantization is None else sec.query_quantization
    items = [f"Engine: **{sec.engine}** {sec.vllm_version} with `--kv-cache-dtype "
             f"{sec.kv_cache_dtype}`, backend **{sec.backend}** (FP8 written by "
             f"{sec.fp8_write}); the scales were searched for what it serves.",
             f"Layers kept in the model dtype (`--kv-cache-dtype-skip-layers`): "
             f"{', '.join(map(str, skip)) if skip else 'none (every layer quantized)'}.",
             *_skip_choice(sec),
             (f"Query quantization: **{qq}** — vLLM's CPU backend attends with the "
              "model-dtype queries; the key search scored exact queries against the truncated FP8 keys." if cpu else
              f"Query quantization: **{qq}** — vLLM quantizes the post-RoPE queries "
              "to FP8 with the checkpoint's `q_scale` (1.0 when a checkpoint has none) and folds q_scale · k_scale "
              "into the softmax scale; the key search scored vLLM's scores with those FP8 queries.")]
    if qs:
        items.append(f"q_scale: {len(sec.q_scale)} layers, min {_num(min(qs))}, median "
                     f"{_num(sorted(qs)[len(qs) // 2])}, max {_num(max(qs))} (exported as `...self_attn.q_scale`).")
    for side in ("k", "v"):  # --kv-cache-dtype nvfp4: the static outer scales (kvcal.engines.vllm.search_nvfp4)
        xs = sec.outer_scale(side)
        if xs:
            items.append(f"NVFP4 outer {side}_scale: {len(xs)} layers, min {_num(min(xs))}, median "
                         f"{_num(sorted(xs)[len(xs) // 2])}, max {_num(max(xs))} (exported as `...self_attn.{side}_scale`; "
                         "the e4m3 block scales are computed at write time).")
    for xs, lab in ((sec.heldout_kl_query_only, "query quantization alone"), (sec.heldout_kl_kv_only, "K/V alone"),
                    (sec.heldout_kl_joint, "both")):
        if xs:
            items.append(f"Mean {D.heldout_word(meta)} attention KL per query over layers, {lab}: {_sci(sum(xs) / len(xs))} nats.")
    rep.add(Bullets(items))


def _deployed(rep: Report, meta: dict) -> None:
    """calibrate's "What is deployed" section (:func:`kvcal.report.markdown.deployed_items`): the cache write
    searched for, the scale set each export target writes and each set's measured held-out means; nothing for an
    artifact that records no clip-free set."""
    from kvcal.report.markdown import deployed_items

    items = deployed_items(meta)
    if items:
        rep.add(Heading("What is deployed"), Bullets(items))


def _skip_choice(sec) -> list[str]:
    """How the 16-bit layers were chosen (``vllm.skip_layers_choice``, ``kvcal calibrate --skip-layers``) in
    the artifact's :class:`~kvcal.engines.vllm.section.VllmSection` ``sec``: a bullet with the method, the budget,
    the bytes per token and the serve argument; none without it."""
    ch = sec.skip_layers_choice
    if ch is None:
        return []
    skip = sec.skip_layers
    arg = f"`--kv-cache-dtype-skip-layers {' '.join(map(str, skip))}`" if skip else "no `--kv-cache-dtype-skip-layers`"
    if ch.get("method") == "auto":
        budget = ", ".join(f"{k} {ch[v]}" for k, v in (("--max-skip", "max_skip"),
                                                      ("--max-bytes-per-token", "max_bytes_per_token"))
                           if ch.get(v) is not None)
        pr = ch.get("probe") or {}
        how = (f"chosen by `--skip-layers auto` under {budget}: exact 0/1 knapsack of each layer's model-level KL "
               f"when only it goes through `{sec.kv_cache_dtype}` (probe on {_num(pr.get('samples'))} "
               f"{pr.get('source', '?')} samples, {_num(pr.get('tokens'))} tokens)")
    elif ch.get("method") == "recommend":  # kvcal recommend's chosen configuration (kvcal.recommend.record_skip_layers)
        how = (f"chosen by `kvcal recommend` (its {ch.get('choice', '?')} set: the cheapest configuration that "
               f"passed its acceptance bar, --max-skip {ch.get('max_skip')})")
    else:
        how = "given with `--skip-layers`"
    return [f"16-bit layers {how}; {_num(ch.get('bytes_per_token'))} KV bytes per token as vLLM allocates pages "
            f"({_num(ch.get('bytes_per_token_16bit'))} at 16 bits); serve with {arg}."]


def _weights(rep: Report, meta: dict, ev: dict | None) -> None:
    m = meta.get("model") or {}
    rep.add(Heading("Model weights (separate from the KV cache)"))
    kv_fmts = " / ".join(f"{'K' if r['side'] == 'k' else 'V'} {r['format']}" for r in D.side_rows(meta))
    rep.add(Bullets([
        f"Model: `{m.get('id', '?')}` ({m.get('architecture', '?')}, model_type {m.get('model_type', '?')}), "
        f"config sha256 `{(m.get('config_sha256') or '?')[:16]}…`, max context {_num(m.get('max_position_embeddings'))}.",
        f"**Weight precision: {m.get('weight_precision', 'not recorded')}.**",
        f"The KV-cache precision ({kv_fmts}) is a separate choice: the figures below change only the cache.",
    ]))
    ew = ((ev or {}).get("description") or {}).get("weight_precision") or ((ev or {}).get("model") or {}).get(
        "weight_precision")
    if ew and ew != m.get("weight_precision"):
        rep.add(Para(f"**Note:** the evaluation ran the model with weights `{ew}`, calibration with "
                     f"`{m.get('weight_precision', 'not recorded')}`."))


def _corpora(rep: Report, meta: dict, ev: dict | None, reg: dict) -> None:
    cal = D.corpus_summary(meta.get("corpus") or ((ev or {}).get("artifact") or {}).get("corpus"))
    evc = D.corpus_summary(ev.get("corpus")) if ev and ev.get("corpus") else None
    rep.add(Heading("Calibration and evaluation corpora"))
    fields = [("path", "path"), ("domain", "domain"), ("format", "format"), ("sha256", "sha256"),
              ("samples", "samples / windows"), ("tokens", "tokens"), ("p50", "length p50"), ("p90", "length p90"),
              ("p99", "length p99"), ("max", "length max"), ("truncated", "truncated"), ("windows", "evaluation windows")]

    def cell(c, k):
        if c is None:
            return "not evaluated"
        v = c.get(k)
        if k == "sha256" and v:
            return f"`{v[:12]}…`"
        if k == "path" and v:
            return f"`{v}`"
        return _num(v)

    rep.add(Table(["", "calibration", "evaluation"], [[lab, cell(cal, k), cell(evc, k)] for k, lab in fields]))
    cal_meta = meta.get("calibration") or {}
    items = D.corpus_relation(cal, evc, cal_meta.get("max_seq_len"), reg["contexts"], heldout=D.has_heldout(meta))
    if evc and evc["lengths_from_windows"]:
        items.append("Evaluation lengths are its window lengths (the corpus is cut into fixed-size windows"
                     + (f": {evc['source']}" if evc.get("source") else "") + ").")
    if cal_meta and not D.has_heldout(meta):
        items.append(f"Calibration split: none — {D.error_data_label(meta)}; the guard and the per-layer errors "
                     f"below are measured on the samples the scales were fitted to (optimistic); samples capped at "
                     f"{_num(cal_meta.get('max_seq_len'))} tokens.")
    elif cal_meta:
        items.append(f"Calibration split: {_num(cal_meta.get('calib_samples'))} calibration / "
                     f"{_num(cal_meta.get('heldout_samples'))} held-out samples (seed {_num(cal_meta.get('seed'))}); "
                     f"samples capped at {_num(cal_meta.get('max_seq_len'))} tokens.")
    rep.add(Bullets(items))


def _regimes(rep: Report, meta: dict, ev: dict | None, reg: dict) -> None:
    rep.add(Heading("Context and concurrency regimes"))
    cal = meta.get("calibration") or {}
    items = [f"Calibrated on: {cal.get('context_regime', 'not recorded')}."]
    if ev:
        items.append(f"Evaluated contexts: {', '.join(map(str, reg['contexts'])) or 'none recorded'} tokens; "
                     f"batches (concurrent sequences): {', '.join(map(str, reg['batches'])) or 'none recorded'}; "
                     f"modes: {', '.join(reg['modes']) or 'none recorded'}.")
        if reg["pairs"]:
            items.append("Context × batch pairs run: " + ", ".join(f"{c}×{b}" for c, b in reg["pairs"]) + ".")
        desc = ev.get("description") or {}
        if desc.get("decode_tokens") is not None:
            items.append(f"Decode mode: {desc['decode_tokens']} positions per window fed one token at a time through "
                         f"the quantized cache; greedy agreement over {desc.get('greedy_tokens', '?')} generated tokens.")
        if desc.get("device") or desc.get("throughput"):
            items.append(f"Device: {desc.get('device', '?')}; throughput: {desc.get('throughput', 'not recorded')}.")
    else:
        items.append("No evaluation given: quality at serving contexts/concurrency is **not** established by this "
                     "report (run `kvcal evaluate --json` and re-render with `--eval`).")
    rep.add(Bullets(items))


def _skip_memory(meta: dict) -> list[str]:
    """A memory bullet for an artifact whose ``vllm.skip_layers`` keeps layers in the model dtype: vLLM's
    bytes per token with them (``vllm.skip_layers_choice``) beside the every-layer figures of this section."""
    from kvcal.artifact.sections import engine_section

    sec = engine_section(meta)
    skip = sec.skip_layers if sec else None
    if not skip:
        return []
    ch = sec.skip_layers_choice or {}
    nb = (f": {_num(ch.get('bytes_per_token'))} bytes per token as vLLM allocates pages "
          f"({_num(ch.get('bytes_per_token_16bit'))} at 16 bits)" if ch.get("bytes_per_token") else "")
    return [f"**Served by vLLM with layers {', '.join(map(str, skip))} in the model dtype** "
            f"(`--kv-cache-dtype-skip-layers`){nb}; the figures in this section count every layer quantized."]


def _sliding_memory(meta: dict, mem: dict) -> list[str]:
    """A memory bullet for a model with sliding-window layers (``model.layer_windows``): what each layer type
    holds, the global layers' share of the bytes at the longest context shown, and what vLLM 0.33 reserves
    for a sliding layer (:func:`kvcal.engines.vllm.memory.vllm_layer_tokens`, from ``SlidingWindowSpec``)."""
    lw = (meta.get("model") or {}).get("layer_windows")
    if not lw:
        return []
    sl = [i for i, w in enumerate(lw) if w]
    W = max(lw)
    c = mem["contexts"][-1]
    held = [min(c, w - 1) if w else c for w in lw]
    share = sum(h for h, w in zip(held, lw, strict=True) if not w) / sum(held)
    return [f"{len(sl)} of {len(lw)} layers are sliding-window layers (W = {W}): each holds at most {W - 1} tokens, "
            f"so the figures below count them at min(context, {W - 1}) tokens and the {len(lw) - len(sl)} global "
            f"layers hold {share:.0%} of the cached tokens at {c:,} tokens. vLLM 0.33 reserves a sliding layer its "
            "window plus the in-flight tokens (max_num_batched_tokens, 2,048 by default) and one block "
            "(`SlidingWindowSpec.max_admission_blocks_per_request`; `kvcal memory --format vllm:<dtype>`)."]


def _memory(rep: Report, meta: dict, ev: dict | None, reg: dict, tensors: dict | None = None) -> dict | None:
    rep.add(Heading("Memory: cache bytes per token and capacity"))
    mem = D.memory_summary(meta, batches=reg["batches"] or None, tensors=tensors)
    if mem is None:
        rep.add(Para("The artifact metadata lacks the model shape or kv config; memory cannot be computed."))
        return None
    rep.add(Bullets([
        f"**{mem['bytes_per_token']:g} bytes per token** (all layers, K+V) vs {mem['bytes_per_token_16']:g} at 16 bits: "
        f"**{mem['ratio']:.2f}× smaller**, i.e. {mem['capacity_gain_pct']:.0f}% more tokens in the same memory.",
        "Exact accounting (`kvcal.formats.memory.cache_bytes`): payload, scales/zero points, 16-bit window and "
        "sinks, per-layer metadata. Weights and activations are not included (see `kvcal plan`).",
        *_skip_memory(meta),
        *_sliding_memory(meta, mem),
    ]))
    rows = []
    show_ctx = reg["contexts"] or [c for c in mem["contexts"] if c >= 1024]
    sub = D.memory_summary(meta, contexts=show_ctx, batches=reg["batches"] or [1, 8], tensors=tensors)
    for b in sub["batches"]:
        for c, q, f in zip(sub["contexts"], sub["cache_bytes"][b], sub["cache_bytes_16"][b], strict=True):
            rows.append([_num(c), _num(b), f"{q:,}", _bytes(q), _bytes(f), f"{f / q:.2f}×" if q else "–"])
    rep.add(Table(["context", "batch", "cache bytes", "cache", "16-bit", "saving"], rows))
    em = (ev or {}).get("memory")
    if isinstance(em, dict) and isinstance(em.get("bytes_per_token"), dict) and em["bytes_per_token"]:
        b16 = em.get("bytes_per_token_16bit")
        rep.add(Para("Bytes per token of every method in the evaluation run"
                     + (f" (16-bit: {_num(b16, 'g')})" if b16 else "") + ":"))
        rep.add(Table(["method", "bytes/token", "vs 16-bit"],
                      [[str(k), _num(v, "g"), f"{b16 / v:.2f}× smaller" if b16 and v else "–"]
                       for k, v in em["bytes_per_token"].items()]))
    meas = [x for x in (em or {}).get("measured") or [] if isinstance(x, dict)] if isinstance(em, dict) else []
    if meas:
        rep.add(Para("Runtime cache allocation measured during decode vs the accounting:"))
        rep.add(Table(["method", "context", "batch", "cache tokens", "allocated bytes", "accounting", "equal"],
                      [[str(x.get("method")), _num(x.get("context")), _num(x.get("batch")), _num(x.get("cache_tokens")),
                        _num(x.get("allocated_bytes")), _num(x.get("expected_bytes")),
                        "yes" if x.get("allocated_bytes") == x.get("expected_bytes") else "**no**"] for x in meas]))
    return mem


def _bounded(r: dict, metric: str, fmt) -> str:
    """A result's ``metric`` formatted by ``fmt``, with the bound its status was judged on in brackets
    (:func:`kvcal.evaluate.bounds.judge_bounded`) when the row carries one."""
    b = (r.get("bounds") or {}).get(metric)
    if not isinstance(b, dict) or not str(b.get("method", "")).startswith("one-sided") or b.get("bound") is None:
        return fmt(r[metric])
    return f"{fmt(r[metric])} [{fmt(b['bound'])}]"


def _quality(rep: Report, ev: dict | None, meta: dict | None = None) -> None:
    rep.add(Heading("Quality with baselines"))
    if not ev:
        rep.add(Para(f"No evaluation JSON given. The calibration {D.heldout_word(meta or {})} errors below are "
                     "attention-level only; they do not establish model-level quality."))
        return
    v = D.verdict(ev)
    mine = D.tested_method(ev)
    if v:
        who = f"`{v['method']}`" if v["method"] else "judged methods"
        extra = ""
        if v["failed"]:
            extra = " — failed at " + ", ".join(
                f"{r['mode']} ctx {r['context']} batch {r['batch']}"
                + (f" ({', '.join(map(str, r['failed']))})" if r.get("failed") else "") for r in v["failed"])
        rep.add(Para(f"**Verdict for {who}: {v['status']}**{extra}."))
    mrows = D.methods_rows(ev)
    if mrows:
        rep.add(Table(["method", "role", "cache format", "bits", "acceptance criteria"],
                      [[f"**{m['name']}**" if m["name"] == mine else m["name"], str(m["role"] or "–"),
                        str(m["label"] or "–"), _num(m["bits"]), D.criteria_text(m["criteria"]) or "–"]
                       for m in mrows]))
    rows = []
    for r in D.results(ev):
        name = f"**{r['method']}**" if mine and r["method"] == mine else str(r["method"])
        st = r["status"] or "–"
        rows.append([name, str(r["mode"] or "–"), _num(r["context"]), _num(r["batch"]), _num(r["ppl"], ".4f"),
                     _bounded(r, "delta_ppl", lambda x: _num(x, "+.4f")), _bounded(r, "kl_mean", _sci),
                     _sci(r["kl_p999"]),
                     _num(r["top1_agree"], ".4f"), _num(r["greedy_agree"], ".3f"), _num(r["tokens"]),
                     f"**{st}**" if st in ("PASS", "FAIL", "INCONCLUSIVE") else st, D.criteria_text(r["criteria"]) or "–"])
    if rows:
        rep.add(Table(["method", "mode", "context", "batch", "ppl", "Δppl", "KL mean", "KL p99.9", "top-1 agree",
                       "greedy agree", "tokens", "status", "criteria"], rows))
    else:
        rep.add(Para("The evaluation JSON holds no results."))
    if any(r.get("bounds") for r in D.results(ev)):
        rep.add(Para("A bracketed figure is the one-sided 95% Student-t bound over the evaluation windows that the "
                     "status is judged on (the upper bound of a <= clause): PASS needs the bound inside the bar, "
                     "FAIL the opposite bound outside it; INCONCLUSIVE otherwise."))
    rep.add(Para("Units: perplexity exp(mean NLL); Δppl vs the 16-bit cache on the same windows; KL(P16 ‖ Pquant) of "
                 "the next-token distribution in nats; agreement as fractions. Teacher-forced = every key/value "
                 "attention reads is quantized in one pass; decode = token by token through the quantized cache."))
    notes = [str(n) for n in (ev.get("notes") or [])]
    if notes:
        rep.add(Bullets(notes))


def _calibration_detail(rep: Report, meta: dict) -> None:
    from kvcal.report.markdown import layer_table

    cal = meta.get("calibration") or {}
    rep.add(Heading("Calibration method and per-layer scales"))
    items = []
    for key, lab in (("objective_k", "Keys objective"), ("objective_v", "Values objective"),
                     ("candidates", "Candidates"), ("selection", "Selection")):
        if cal.get(key):
            items.append(f"{lab}: {cal[key]}.")
    he = D.heldout_errors(meta)
    if he:
        for side, unit in (("k", "keys objective"), ("v", "relative output error")):
            if side in he:
                parts = ", ".join(f"{w} {_sci(D.mean_or_none(ys))}" for w, ys in he[side].items())
                items.append(f"Mean {D.heldout_word(meta)} {D.SIDE_NAMES[side]} error ({unit}): {parts}.")
    if items:
        rep.add(Bullets(items))
    if meta.get("layers"):
        try:
            rep.add(Pre(layer_table(meta)))  # FP8 artifacts: scales, picks and the three held-out errors
        except (KeyError, TypeError, IndexError, ValueError):
            w = D.heldout_word(meta)
            rep.add(Table(["layer", "K spec", "K pick", f"K {w} (reference)", "V spec", "V pick",
                           f"V {w} (reference)"], D.layer_rows(meta)))
    else:
        rep.add(Para("The artifact metadata holds no per-layer calibration records."))


def _figures(rep: Report, meta: dict, ev: dict | None, tensors: dict | None, mem: dict | None) -> None:
    from kvcal.report import plots as P

    rep.add(Heading("Figures"))
    ranges = D.layer_ranges(meta, tensors)
    specs = [
        ("kv_ranges", "Per-layer / per-head key and value ranges (calibration absmax), outliers marked "
         f"(> {D.OUTLIER_FACTOR:g}× the median of their peers).", lambda: P.plot_kv_ranges(ranges)),
        ("clip_vs_absmax", "Chosen clip threshold (value mapped to the format maximum) vs observed absmax per layer.",
         lambda: P.plot_clip_vs_absmax(ranges)),
        ("layer_errors", "; ".join(x for x in (
            f"Per-layer error before/after calibration: {D.heldout_word(meta)} error with the chosen scale vs absmax and "
            "unity scales"
            if D.heldout_errors(meta) else "",
            "per-layer K attention KL / V output error on the evaluation corpus per method"
            if D.per_layer_eval(ev) else "") if x) + ".",
         lambda: P.plot_layer_errors(D.heldout_errors(meta), D.per_layer_eval(ev), D.heldout_word(meta))),
        ("quality_vs_context", "Quality vs context length per method (solid: teacher-forced, dashed: decode).",
         lambda: P.plot_quality_vs_context({m: D.quality_series(ev, m) for m in ("delta_ppl", "kl_mean")})),
        ("memory", "KV-cache memory vs context × batch (exact accounting).", lambda: P.plot_memory(mem)),
    ]
    missing = []
    for name, caption, make in specs:
        fig = make()
        if fig is None:
            missing.append(name)
            continue
        rep.add(Figure(name, caption, P.fig_to_png(fig)))
    if missing:
        rep.add(Para(f"Not drawn (inputs absent): {', '.join(missing)}."))


def build_report(meta: dict, ev: dict | None = None, tensors: dict | None = None,
                 artifact_path: str | None = None, figures: bool = True) -> Report:
    """The full disclosure report for an artifact's metadata and an optional evaluation dict.

    ``tensors``: the artifact's tensors (for optional per-channel ranges). ``figures=False`` skips
    drawing (text and tables only). Missing optional keys are reported as absent, never raise."""
    m = meta.get("model") or {}
    rep = Report(f"KV-cache disclosure report: {m.get('id', 'model')}")
    reg = D.regimes(ev)
    head = [f"Artifact: `{artifact_path}`" if artifact_path else None,
            f"created {meta.get('created', '?')} by kvcal {meta.get('kvcal_version', '?')}"]
    rep.add(Para(" — ".join(h for h in head if h)))
    v = D.verdict(ev)
    summary = [f"KV cache: {D.quantized_label(meta)}; "
               + "; ".join(f"{'K' if r['side'] == 'k' else 'V'} {r['format']} {_gran(r)}" for r in D.side_rows(meta))
               + f". Weights: {m.get('weight_precision', 'not recorded')} (separate)."]
    if v:
        summary.append(f"Acceptance: **{v['status']}**" + (f" for `{v['method']}`" if v["method"] else "") + ".")
    rep.add(Bullets(summary))
    _what_is_quantized(rep, meta)
    _serving_engine(rep, meta)
    _deployed(rep, meta)
    _weights(rep, meta, ev)
    _corpora(rep, meta, ev, reg)
    _regimes(rep, meta, ev, reg)
    mem = _memory(rep, meta, ev, reg, tensors)
    _quality(rep, ev, meta)
    if figures:
        _figures(rep, meta, ev, tensors, mem)
    _calibration_detail(rep, meta)
    return rep


def check_eval_matches(art, ev: dict, source) -> None:
    """Refuse an evaluation of another artifact: its recorded ``artifact.sha256`` (evaluations
    written since it was recorded) must equal the artifact file's, else (older files) its recorded
    ``kv`` section must equal the artifact's. Raises :class:`KvcalError` naming both paths."""
    from kvcal.artifact import artifact_sha256
    from kvcal.errors import KvcalError

    rec = ev.get("artifact") if isinstance(ev.get("artifact"), dict) else {}
    where = f"{source} was run on artifact {rec.get('path', '?')}"
    if rec.get("sha256") is not None:
        if rec["sha256"] != artifact_sha256(art.path):
            raise KvcalError(f"{where}, whose kv_scales.safetensors differs from --artifact {art.path} (sha256); "
                             "evaluate this artifact (`kvcal evaluate --artifact ... --json`) or pass its own --eval")
    elif rec.get("kv") and json.loads(json.dumps(rec["kv"])) != json.loads(json.dumps(art.metadata["kv"])):
        raise KvcalError(f"{where}, whose cache format (kv section) differs from --artifact {art.path}; evaluate this "
                         "artifact or pass its own --eval")


def check_out_holds_no_other_artifact(art_dir: Path, od: Path) -> None:
    """Refuse report ``--out`` directory ``od`` when it holds a ``kv_scales.safetensors`` other than the one in
    ``art_dir`` (compared by :func:`kvcal.artifact.artifact_sha256`, as ``--eval`` is): its report.md,
    report.html and figures describe that artifact, and a report of another one would replace them.
    Raises :class:`KvcalError`; an identical copy of the artifact is accepted."""
    from kvcal.artifact import artifact_sha256
    from kvcal.errors import KvcalError
    from kvcal.outputs import SCALES_FILE

    other = od / SCALES_FILE
    if not other.exists() or od.resolve() == Path(art_dir).resolve():
        return
    if artifact_sha256(other) != artifact_sha256(art_dir):
        raise KvcalError(f"--out {od} holds another artifact (its {SCALES_FILE} differs from --artifact {art_dir}, "
                         "sha256), whose report files a report of this one would replace — omit --out (the report "
                         "goes into the --artifact directory) or choose a directory without an artifact")


def _meta_with_stored_scales(art) -> dict:
    """A copy of ``art.metadata`` whose per-layer ``layers[i].{k,v}.scale`` are the scale tensors the artifact file
    holds (``model.layers.{i}.self_attn.{k,v}_scale``, flattened): the report shows what is deployed, read from the
    tensors (:func:`kvcal.artifact.load_artifact` has refused a file whose tensors and records disagree)."""
    import copy

    meta = copy.deepcopy(art.metadata)
    for lm in meta.get("layers") or []:
        for side in ("k", "v"):
            t = art.scale(lm.get("layer"), side)
            if t is not None and isinstance(lm.get(side), dict) and "scale" in lm[side]:
                lm[side]["scale"] = t.reshape(-1).tolist()
    return meta


def write_report(artifact: str | os.PathLike, eval_json: str | os.PathLike | dict | None = None,
                 out: str | os.PathLike | None = None) -> dict:
    """Render ``report.md`` (+ ``figures/*.png``) and ``report.html`` for an artifact directory.

    ``eval_json``: path to (or dict of) ``kvcal evaluate --json`` output. ``out``: output directory
    (default: the artifact directory; ``report.md`` there is replaced by this fuller report).
    Returns ``{"markdown", "html", "figures": [paths]}``. Raises :class:`KvcalError` for a bad
    artifact or evaluation file, an unwritable location, or when a file it would write is an input or
    exists and is not a report / figure kvcal wrote (:func:`kvcal.outputs.check_output_file`: every
    target is checked before the first is written); each file is written atomically and carries kvcal's
    mark (``report.md`` ends with :data:`kvcal.outputs.REPORT_MD_MARK`)."""
    from kvcal import __version__
    from kvcal.artifact import load_artifact
    from kvcal.errors import KvcalError
    from kvcal.outputs import REPORT_MD_MARK, check_output_file, write_files_atomically

    art = load_artifact(artifact)
    ev = eval_json if isinstance(eval_json, dict) or eval_json is None else D.load_eval(eval_json)
    if ev is not None:
        check_eval_matches(art, ev, eval_json if not isinstance(eval_json, dict) else "the evaluation")
    od = Path(out) if out is not None else art.path
    if od.exists() and not od.is_dir():
        raise KvcalError(f"--out {od} is not a directory; give the directory the report goes into")
    check_out_holds_no_other_artifact(art.path, od)
    md, ht = od / "report.md", od / "report.html"
    inputs = {"--artifact": artifact, "--eval": None if isinstance(eval_json, dict) else eval_json}
    for p in (md, ht):  # before the figures are drawn (seconds); the figures' own files are checked below
        check_output_file(p, "report", inputs, KvcalError, "--out")
    rep = build_report(_meta_with_stored_scales(art), ev, art.tensors, artifact_path=str(artifact))
    mark = f"\n{REPORT_MD_MARK} {__version__}; kvcal report replaces this file when it runs again -->\n"
    files = [(od / "figures" / f"{name}.png", f.png, "figure") for name, f in rep.figures.items()]
    files += [(ht, to_html(rep), "report"), (md, to_markdown(rep) + mark, "report")]
    # every refusal before the first file is written; all staged, then renamed: a failure (a full disk) leaves
    # neither a partial report nor an empty figures/ directory
    write_files_atomically(files, inputs, KvcalError, "--out")
    return {"markdown": str(md), "html": str(ht), "figures": [str(p) for p, _, k in files if k == "figure"]}
