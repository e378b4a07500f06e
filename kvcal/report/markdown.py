"""Markdown disclosure for a calibration artifact, rendered from its metadata alone."""

from __future__ import annotations


def _fmt(x: float) -> str:
    return f"{x:.3e}"


def _scale_str(v: list[float]) -> str:
    return ", ".join(f"{s:.4g}" for s in v)


def layer_table(meta: dict) -> str:
    """Fixed-width per-layer table: K/V scales, chosen candidate and held-out errors."""
    lines = [
        f"{'layer':>5}  {'k_scale':>22} {'k pick':>12} {'K KL chosen':>11} {'absmax':>9} {'unity':>9}  "
        f"{'v_scale':>22} {'v pick':>12} {'V err chosen':>12} {'absmax':>9} {'unity':>9}"
    ]
    for lm in meta["layers"]:
        k, v = lm["k"], lm["v"]
        lines.append(
            f"{lm['layer']:>5}  {_scale_str(k['scale']):>22} {','.join(sorted(set(k['candidate']))):>12} "
            f"{_fmt(k['heldout']['chosen']):>11} {_fmt(k['heldout']['absmax']):>9} {_fmt(k['heldout']['unity']):>9}  "
            f"{_scale_str(v['scale']):>22} {','.join(sorted(set(v['candidate']))):>12} "
            f"{_fmt(v['heldout']['chosen']):>12} {_fmt(v['heldout']['absmax']):>9} {_fmt(v['heldout']['unity']):>9}"
        )
    return "\n".join(lines)


def _sum(meta: dict, side: str, which: str) -> float:
    ls = meta["layers"]
    return sum(lm[side]["heldout"][which] for lm in ls) / max(len(ls), 1)


def corpus_section(meta: dict, concurrency: str) -> str:
    """The report's "Calibration corpus and context regime" section (FP8 and integer artifacts):
    corpus path / sha256 / format, sample and token counts, length percentiles (tokens),
    truncation, the calibration / held-out split, what the search saw, and the context regime;
    ``concurrency`` says what batch size does to this artifact's parameters."""
    from kvcal.report.data import error_data_label, has_heldout

    cal, corp = meta["calibration"], meta["corpus"]
    pct = corp["length_percentiles"]
    split = (f"{cal['calib_samples']} calibration / {cal['heldout_samples']} held-out samples (seed {cal['seed']}); the "
             f"search saw {cal['reservoir_sequences']['calib']} calibration and {cal['reservoir_sequences']['heldout']} "
             f"held-out sequences of at most {cal['search_tokens']} tokens" if has_heldout(meta) else
             f"none — {error_data_label(meta)}: the guard and every per-layer error below are measured on the "
             f"samples the parameters were fitted to (optimistic); the search saw {cal['reservoir_sequences']['calib']} "
             f"sequences of at most {cal['search_tokens']} tokens. Give 2 or more samples so that some are kept out of the fit")
    return f"""## Calibration corpus and context regime
- Corpus: `{corp["path"]}` (sha256 `{corp["sha256"][:16]}…`, format {corp["format"]}).
- {corp["samples"]} samples, {corp["tokens"]} tokens; length p50 / p90 / p99 / max = {round(pct["p50"], 1):g} / {round(pct["p90"], 1):g} / {round(pct["p99"], 1):g} / {round(pct["max"], 1):g} tokens; {corp["truncated"]} truncated at {cal["max_seq_len"]} tokens.
- Split: {split}.
- Context regime calibrated: {cal["context_regime"]}. {concurrency}
"""


def _query_line(meta: dict) -> str:
    """What the report says about the queries: the model's precision, or for an artifact calibrated for vLLM
    (``kvcal calibrate --engine vllm``: a ``vllm`` section) how that engine quantizes them."""
    from kvcal.artifact.sections import engine_section

    sec = engine_section(meta)
    if not sec:
        return "queries stay in the model's precision"
    qq = sec.query_quantization or "none"
    be = f", backend {sec.backend}" if sec.backend != "cuda" else ""
    return (f"queries as vLLM {sec.vllm_version} serves --kv-cache-dtype {sec.kv_cache_dtype}{be}: "
            f"{qq} (q_scale calibrated with the keys)" if not qq.startswith("none") else
            f"queries stay in the model's precision under vLLM --kv-cache-dtype {sec.kv_cache_dtype}{be}")


def _granularity(side: dict) -> str:
    """``kv.k``/``kv.v`` granularity, with its group size (elements) when it has one, e.g. ``token_group (16)``."""
    g = side.get("group_size")
    return f"{side['granularity']} ({g})" if g else side["granularity"]


def _scales_kind(meta: dict, side: str) -> str:
    """How ``side``'s scales are set: dynamic, static from calibration, or (``--kv-cache-dtype nvfp4``:
    ``vllm.{side}_outer_scale``) dynamic e4m3 block scales under the calibrated static outer scale."""
    from kvcal.artifact.sections import engine_section

    s = meta["kv"][side]
    sec = engine_section(meta)
    if sec and sec.outer_scale(side):
        return (f"dynamic {s.get('scale_dtype')} block scales under a static per-layer outer scale from calibration "
                f"(the {side}_scale column)")
    return "dynamic" if s["dynamic"] else "static scales from calibration"


def _skip_line(meta: dict) -> str:
    """The report's bullet on the layers vLLM keeps in the model dtype (``vllm.skip_layers``, written by
    ``kvcal calibrate --skip-layers`` and ``kvcal recommend``): the layers, how they were chosen and the KV
    bytes per token as vLLM allocates pages; ``""`` for an artifact that records none."""
    from kvcal.artifact.sections import engine_section

    sec = engine_section(meta)
    ch = (sec.skip_layers_choice if sec else None) or {}
    skip = sec.skip_layers if sec else ()
    if not skip and not ch:
        return ""
    how = {"auto": "chosen by `--skip-layers auto` (per-layer KL probe under "
                   + ", ".join(f"{o} {ch[k]}" for o, k in (("--max-skip", "max_skip"),
                                                          ("--max-bytes-per-token", "max_bytes_per_token"))
                               if ch.get(k) is not None) + ")",
           "given": "given with `--skip-layers`", "recommend": "chosen by `kvcal recommend`"}.get(ch.get("method"), "")
    nb = (f"; {ch['bytes_per_token']} KV bytes per token as vLLM allocates pages ({ch['bytes_per_token_16bit']} "
          "at 16 bits)" if "bytes_per_token" in ch and "bytes_per_token_16bit" in ch else "")
    layers = (f"{', '.join(map(str, skip))} (their scales are written but vLLM does not use them)" if skip
              else "none (every layer quantized)")
    return (f"- **Layers vLLM keeps in the model dtype (`--kv-cache-dtype-skip-layers`):** {layers}"
            f"{'; ' + how if how else ''}{nb}.\n")


def deployed_items(meta: dict) -> list[str]:
    """The bullet lines (markdown) of the "What is deployed" section of a static FP8 artifact: the cache write its
    scales were searched for (``calibration.cache_write``), which scale set each ``kvcal export`` target writes by
    default, and the held-out errors the search measured for each set (:func:`kvcal.artifact.sections.set_figures`),
    so the figures a user reads are those of the bytes they deploy. ``[]`` for an artifact that records no
    clip-free set (older kvcal, NVFP4 outer scales, integer formats). Shared by calibrate's ``report.md``
    (:func:`deployed_section`) and ``kvcal report`` (:func:`kvcal.report.disclosure.build_report`)."""
    from kvcal.artifact.sections import set_figures
    from kvcal.formats.fp8 import CACHE_WRITES

    a, b = set_figures(meta, "searched"), set_figures(meta, "clip_free")
    if a is None or b is None:
        return []
    from kvcal.report.data import heldout_word

    w = heldout_word(meta)  # "held-out", or the calibration data's name when there was no held-out split
    cw = (meta.get("calibration") or {}).get("cache_write")
    n = sum(1 for lm in meta.get("layers") or [] for s in ("k", "v")
            if (lm.get(s) or {}).get("clip_free", {}).get("scale") != (lm.get(s) or {}).get("scale"))
    per_tensor = meta["kv"]["k"]["granularity"] == "tensor"
    sglang = ("`--target sglang-json` (SGLang, which casts to FP8 without saturating) and `--clip-free` write the "
              "**clip-free** set" if per_tensor else "`--clip-free` writes the **clip-free** set")
    return [
        f"Scales searched for the cache write: **{cw or 'not recorded'}**"
        f"{f' ({CACHE_WRITES[cw]})' if cw in CACHE_WRITES else ''}.",
        f"`kvcal export --target vllm`, `modelopt`{', `trtllm-legacy`' if per_tensor else ''} write the **searched** "
        f"scales (the table below) unchanged ({w} mean: K attention KL {_fmt(a['k'])}, V output error "
        f"{_fmt(a['v'])}){' — trtllm-legacy as max(K, V) per layer, its cost measured in `layers[i].shared`' if per_tensor else ''}.",
        f"{sglang}: the search's best among candidates that clip nothing it observed ({n} of {2 * a['layers']} "
        f"scales differ; {w} mean: K attention KL {_fmt(b['k'])}, V output error {_fmt(b['v'])}).",
        "`--headroom` changes scales after the search; export prints its cost from the search's recorded candidates. "
        "`kvcal evaluate --artifact EXPORT_DIR` measures any export on the model.",
    ]


def deployed_section(meta: dict) -> str:
    """The report's "What is deployed" section (markdown, :func:`deployed_items` as bullets), or ``""`` when the
    artifact records no clip-free set."""
    items = deployed_items(meta)
    if not items:
        return ""
    return "## What is deployed\n" + "".join(f"- {x}\n" for x in items) + "\n"


def render_calibration_report(meta: dict) -> str:
    """``report.md`` text: what was quantized, how, on which data, and the held-out errors (labelled as
    calibration-data errors when there was no held-out split)."""
    from kvcal.artifact.sections import engine_section
    from kvcal.report.data import error_data_label, has_heldout

    m, kv, cal = meta["model"], meta["kv"], meta["calibration"]
    sec = engine_section(meta)
    title = "Held-out error per layer" if has_heldout(meta) else f"Error per layer on {error_data_label(meta)}"
    text = ("held-out calibration-domain text" if has_heldout(meta) else
            "the calibration samples themselves (no held-out split), so they are optimistic")
    k, v = kv["k"], kv["v"]
    rows = []
    for lm in meta["layers"]:
        rows.append(
            f"| {lm['layer']} | {_scale_str(lm['k']['scale'])} | {', '.join(sorted(set(lm['k']['candidate'])))} | "
            f"{_fmt(lm['k']['heldout']['chosen'])} | {_fmt(lm['k']['heldout']['absmax'])} | {_fmt(lm['k']['heldout']['unity'])} | "
            f"{_scale_str(lm['v']['scale'])} | {', '.join(sorted(set(lm['v']['candidate'])))} | "
            f"{_fmt(lm['v']['heldout']['chosen'])} | {_fmt(lm['v']['heldout']['absmax'])} | {_fmt(lm['v']['heldout']['unity'])} |"
        )
    return f"""# KV-cache calibration report

## What is quantized
- **Tensors:** {", ".join("keys" if t == "k" else "values" for t in kv["quantized_tensors"])} of every attention layer{" but the 16-bit layers below" if sec and sec.skip_layers else ""}
  ({m["num_layers"]} layers × {m["num_kv_heads"]} KV heads × head_dim {m["head_dim"]}); {_query_line(meta)}.
- **Keys:** {k["format"]}, {_granularity(k)} granularity, {"symmetric" if k["symmetric"] else "asymmetric"}, {_scales_kind(meta, "k")}; quantized **{kv["key_position"].replace("_", "-")}** (what the cache stores).
- **Values:** {v["format"]}, {_granularity(v)} granularity, {"symmetric" if v["symmetric"] else "asymmetric"}, {_scales_kind(meta, "v")}.
- **Residual window / sink tokens kept in 16 bits:** {kv["residual_window"]} / {kv["sink_tokens"]}.
{_skip_line(meta)}- `scale` is the dequantization multiplier: x ≈ q · scale (FP8 e4m3: scale = clip_amax / 448).

## Model (weights are NOT the KV precision)
- Model: `{m["id"]}` ({m["architecture"]}, model_type {m["model_type"]}), config sha256 `{m["config_sha256"][:16]}…`.
- **Weight precision:** {m["weight_precision"]}. This is independent of the KV-cache format above.

{corpus_section(meta, "Concurrency does not change static scales; evaluate separately (`kvcal evaluate`).")}
## Method
- Keys: {cal["objective_k"]}. Values: {cal["objective_v"]}.
- Candidates: {cal["candidates"]}. Selection: {cal["selection"]}.
- Capture {cal["capture_seconds"]} s, search {cal["search_seconds"]} s on {cal["device"]}.

{deployed_section(meta)}## {title}
Mean over layers — keys (attention KL, nats/query): chosen {_fmt(_sum(meta, "k", "chosen"))}, absmax {_fmt(_sum(meta, "k", "absmax"))}, unity {_fmt(_sum(meta, "k", "unity"))};
values (relative output error): chosen {_fmt(_sum(meta, "v", "chosen"))}, absmax {_fmt(_sum(meta, "v", "absmax"))}, unity {_fmt(_sum(meta, "v", "unity"))}.

These are attention-level errors on {text}, not model-level quality; run
`kvcal evaluate` for perplexity / logit KL on the serving path.

| layer | k_scale | K pick | K KL chosen | K KL absmax | K KL unity | v_scale | V pick | V err chosen | V err absmax | V err unity |
|---|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}
"""


# ---- integer artifacts ----

def _alloc_line(cal: dict) -> str:
    from kvcal.report.data import heldout_word

    a = cal.get("allocation")
    if not a:
        return ""
    p = a.get("probe")
    w = heldout_word({"calibration": cal})
    how = (f"summed {w} attention-level errors (no model-level probe)" if p is None else
           f"{w} attention-level errors weighted by each layer's K / V model-level KL, measured alone at "
           f"{a['reference']['k']} / {a['reference']['v']} on {p.get('samples')} {p.get('source')} samples "
           f"({p.get('tokens')} tokens)")
    return f"- Per-layer formats allocated under {a['budget_bits']} bits at {a['budget_context']} tokens from {how}.\n"


def _sink_note(cal: dict) -> str:
    from kvcal.report.data import heldout_word

    sk = cal.get("sinks") or {}
    if len(sk.get("tried", [])) < 2:
        return " (given)"
    if "heldout_model_kl" in sk:
        p = sk.get("probe", {})
        vals = ", ".join(f"{n}: {float(v):.3e}" for n, v in sk["heldout_model_kl"].items())
        return (f" (of {sk['tried']}, the lowest model KL on {p.get('samples', '?')} {p.get('source', 'held-out')} "
                f"samples ({p.get('tokens', '?')} tokens): {vals} nats/token)")
    return f" (of {sk['tried']}, the lowest summed {heldout_word({'calibration': cal})} attention-output error)"


def render_int_report(meta: dict) -> str:
    """``report.md`` for integer artifacts: specs, parameters chosen per layer, held-out errors."""
    kv, cal, m = meta["kv"], meta["calibration"], meta["model"]
    rows = []

    def spec_cell(side: dict) -> str:
        sp = side["spec"]
        out = f"{sp['format']} {sp['granularity']}{sp.get('group_size') or ''} {'sym' if sp.get('symmetric') else 'asym'}"
        if side.get("transform", "none") != "none":
            out += f", {side['transform'].replace('_', '-')}"
        out += ", query-aware rounding" if side.get("rounding") else ""
        out += ", non-uniform levels" if side.get("levels") else ""
        out += f", trellis-coded (nu={side['trellis']['nu']})" if side.get("trellis") else ""
        return out + (", per-channel bit widths" if side.get("channel_bits") else "")

    def pick_cell(side: dict) -> str:
        """What each head got: clip ratios of dynamic sides (``min/max`` where every ratio is 1 or the
        baseline won), per-head family and parameter of static ones."""
        labels, param = side["label"], side.get("param")
        if param is None or not side["spec"].get("dynamic", True):
            return ", ".join(sorted(set(labels)))
        center = " + centering" if any(lb.endswith("center") for lb in labels) else ""
        if all(abs(float(x) - 1.0) < 1e-9 for x in param):
            return "min/max ranges" + center + (" (baseline)" if set(labels) == {"minmax"} else "")
        return "clip " + "/".join(f"{float(x):.3g}" for x in param) + center

    for lm in meta["layers"]:
        k, v = lm["k"], lm["v"]
        rows.append(f"| {lm['layer']} | {spec_cell(k)} | {pick_cell(k)} | "
                    f"{k['heldout']:.3e} | {k['heldout_minmax']:.3e} | {spec_cell(v)} | "
                    f"{pick_cell(v)} | {v['heldout']:.3e} | {v['heldout_minmax']:.3e} |")
    from kvcal.report.data import error_data_label, has_heldout, heldout_word
    from kvcal.report.markdown import corpus_section

    w = heldout_word(meta)
    budget = (f"--bits {cal['bits_budget']:g} (per-layer allocation)" if cal.get("bits_budget") is not None
              else "none (fixed preset layout)")
    return f"""# KV-cache calibration report (integer)

- Model `{m["id"]}` ({m["num_layers"]} layers × {m["num_kv_heads"]} KV heads × head_dim {m["head_dim"]}); weights {m["weight_precision"]}.
- Tensors quantized: {", ".join("keys" if t == "k" else "values" for t in kv["quantized_tensors"])} of every attention layer (formats and granularity per layer in the K / V spec columns); {_query_line(meta)}.
- Preset: {cal.get("preset")}; bit budget: {budget}; average bits per cached element including all
  metadata at {cal["average_bits_context"]} tokens: **{cal["average_bits"]:.4f}**.
- Keys quantized {kv["key_position"].replace("_", "-")}; sink tokens in 16 bits: {kv["sink_tokens"]}{_sink_note(cal)}; residual window (runtime): {kv["residual_window"]}.
- Key objective: {cal["objective_k"]} (attention KL, nats/query, when `kl`); value objective: relative attention-output error.
- Every choice is compared with plain min/max (same transform; uniform grid, nearest rounding, uniform widths:
  the "min/max" columns) on {error_data_label(meta)} and kept only where it is lower. "pick" gives each KV head's clip ratio.
{_alloc_line(cal)}
{corpus_section(meta, "Integer parameters are per token / group at run time or per layer from calibration: batch "
                      "size changes neither; evaluate a serving regime with `kvcal evaluate`.")}
## {"Held-out error per layer" if has_heldout(meta) else f"Error per layer on {error_data_label(meta)}"}

| layer | K spec | K pick | K {w} | K min/max | V spec | V pick | V {w} | V min/max |
|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}
"""


def is_integer_artifact(meta: dict) -> bool:
    """True for an artifact of the integer search (presets ``int8``/``int4``/``int2``/``k4v2`` or
    ``--bits``): its ``calibration`` records ``average_bits``; the static FP8 searches' do not."""
    return "average_bits" in (meta.get("calibration") or {})


def render_report(meta: dict) -> str:
    """``report.md`` of any calibration artifact, from its metadata alone: the integer layout
    (:func:`render_int_report`: specs, picks and errors per layer, average bits) for an integer
    artifact (:func:`is_integer_artifact`), else the static-scale layout
    (:func:`render_calibration_report`: scales, candidates and errors per layer)."""
    return render_int_report(meta) if is_integer_artifact(meta) else render_calibration_report(meta)


def console_summary(meta: dict) -> str:
    """What ``kvcal calibrate`` prints after writing an artifact: the per-layer scale table
    (:func:`layer_table`) of a static-scale artifact, or one line for an integer artifact (preset or bit
    budget, average bits per element with metadata, mean K/V bits, sinks, mean K/V errors against
    plain min/max on held-out data — or on the calibration data when there was no held-out split)."""
    from kvcal.report.data import has_heldout

    if not is_integer_artifact(meta):
        return layer_table(meta)
    s, kv = meta["calibration"], meta["kv"]
    head = f"preset {s['preset']}" if s["bits_budget"] is None else f"per-layer allocation under {s['bits_budget']} bits"
    return (f"{head}: average {s['average_bits']:.4f} bits/element incl. "
            f"metadata at {s['average_bits_context']} tokens; K bits {s['key_bits_mean']:.2f}, V bits "
            f"{s['value_bits_mean']:.2f}; sinks {kv['sink_tokens']}; "
            f"{'held-out' if has_heldout(meta) else 'calibration-data (no held-out split)'} "
            f"K {s['heldout']['k']['chosen']:.3e} "
            f"(min/max {s['heldout']['k']['minmax']:.3e}), V {s['heldout']['v']['chosen']:.3e} "
            f"(min/max {s['heldout']['v']['minmax']:.3e})")
