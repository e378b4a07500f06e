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
- {corp["samples"]} samples, {corp["tokens"]} tokens; length p50 / p90 / p99 / max = {pct["p50"]} / {pct["p90"]} / {pct["p99"]} / {pct["max"]} tokens; {corp["truncated"]} truncated at {cal["max_seq_len"]} tokens.
- Split: {split}.
- Context regime calibrated: {cal["context_regime"]}. {concurrency}
"""


def render_calibration_report(meta: dict) -> str:
    """``report.md`` text: what was quantized, how, on which data, and the held-out errors (labelled as
    calibration-data errors when there was no held-out split)."""
    from kvcal.report.data import error_data_label, has_heldout

    m, kv, cal = meta["model"], meta["kv"], meta["calibration"]
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
- **Tensors:** {", ".join("keys" if t == "k" else "values" for t in kv["quantized_tensors"])} of every attention layer
  ({m["num_layers"]} layers × {m["num_kv_heads"]} KV heads × head_dim {m["head_dim"]}); queries stay in the model's precision.
- **Keys:** {k["format"]}, {k["granularity"]} granularity, {"symmetric" if k["symmetric"] else "asymmetric"}, {"dynamic" if k["dynamic"] else "static scales from calibration"}; quantized **{kv["key_position"].replace("_", "-")}** (what the cache stores).
- **Values:** {v["format"]}, {v["granularity"]} granularity, {"symmetric" if v["symmetric"] else "asymmetric"}, {"dynamic" if v["dynamic"] else "static scales from calibration"}.
- **Residual window / sink tokens kept in 16 bits:** {kv["residual_window"]} / {kv["sink_tokens"]}.
- `scale` is the dequantization multiplier: x ≈ q · scale (FP8 e4m3: scale = clip_amax / 448).

## Model (weights are NOT the KV precision)
- Model: `{m["id"]}` ({m["architecture"]}, model_type {m["model_type"]}), config sha256 `{m["config_sha256"][:16]}…`.
- **Weight precision:** {m["weight_precision"]}. This is independent of the KV-cache format above.

{corpus_section(meta, "Concurrency does not change static scales; evaluate separately (`kvcal evaluate`).")}
## Method
- Keys: {cal["objective_k"]}. Values: {cal["objective_v"]}.
- Candidates: {cal["candidates"]}. Selection: {cal["selection"]}.
- Capture {cal["capture_seconds"]} s, search {cal["search_seconds"]} s on {cal["device"]}.

## {title}
Mean over layers — keys (attention KL, nats/query): chosen {_fmt(_sum(meta, "k", "chosen"))}, absmax {_fmt(_sum(meta, "k", "absmax"))}, unity {_fmt(_sum(meta, "k", "unity"))};
values (relative output error): chosen {_fmt(_sum(meta, "v", "chosen"))}, absmax {_fmt(_sum(meta, "v", "absmax"))}, unity {_fmt(_sum(meta, "v", "unity"))}.

These are attention-level errors on {text}, not model-level quality; run
`kvcal evaluate` for perplexity / logit KL on the serving path.

| layer | k_scale | K pick | K KL chosen | K KL absmax | K KL unity | v_scale | V pick | V err chosen | V err absmax | V err unity |
|---|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}
"""
