"""``deploy.md``: the candidate table (:func:`render_table`) and the whole document
(:func:`render_markdown`)."""

from __future__ import annotations

from kvcal.recommend.config import SCALES_DEFAULT


def render_table(doc: dict) -> str:
    """The candidate table (one row per candidate, markdown); the scales column is the row's ``scales``
    (:func:`row_scales`); KL and ΔPPL with, in brackets, the one-sided bound the status was judged on
    (:mod:`kvcal.evaluate.bounds`); ``windows`` the evaluation windows the row was measured on. A pairs document
    (``"menu": "pairs"``, :mod:`kvcal.recommend.pairs`) has its own table."""
    if doc.get("menu") == "pairs":
        return render_pairs_table(doc)
    lines = ["| dtype | scales | 16-bit layers | choice | bytes/token | vs 16-bit | windows | KL mean [bound] | "
             "ΔPPL [bound] | status |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---|"]
    for c in doc["candidates"]:
        b = c.get("bounds") or {}
        kl = f"{c['kl_mean']:.3e}" + _bound(b, "kl_mean", "{:.3e}") if "kl_mean" in c else "-"
        dp = f"{c['delta_ppl']:+.4f}" + _bound(b, "delta_ppl", "{:+.4f}") if "delta_ppl" in c else "-"
        mark = " ← chosen" if c is doc["chosen"] or c == doc["chosen"] else ""
        why = ""
        if c["status"] == "NOT-MEASURED" and c.get("failed"):
            why = " (" + ("a cheaper row passed" if "cheaper row passed" in c["failed"][-1] else
                          "its group's row with the most 16-bit layers fails" if "most 16-bit layers" in c["failed"][-1]
                          else c["failed"][-1].removeprefix("not measured: ")[:60]) + ")"
        elif c["status"] == "INCONCLUSIVE" and c.get("windows_needed"):
            why = f" (~{c['windows_needed']} windows would decide)"
        scales = c.get("scales", "-")
        lines.append(f"| {c['dtype']} | {scales} | {','.join(map(str, c['skip_layers'])) or '-'} | "
                     f"{c['choice']}"
                     f"{'' if c['deployable'] else ' (not deployable)'} | {c['bytes_per_token']} | "
                     f"{c['vs_16bit']:.3f} | {c.get('windows', '-')} | {kl} | {dp} | {c['status']}{why}{mark} |")
    return "\n".join(lines)


def _bound(bounds: dict, metric: str, fmt: str) -> str:
    b = bounds.get(metric)
    if not b or not str(b.get("method", "")).startswith("one-sided") or b.get("bound") is None:
        return ""
    x = b["bound"]
    return f" [{fmt.format(x) if x == x and abs(x) != float('inf') else ('+inf' if x > 0 else '-inf')}]"


def render_markdown(doc: dict) -> str:
    """``deploy.md``: the chosen configuration, its commands, the candidate table and the notes."""
    out = ["# kvcal recommend: vLLM KV-cache deployment", ""]
    if doc.get("backend", "cuda") != "cuda":
        from kvcal.engines import engine

        b = engine(doc["engine"]).backend(doc["backend"])  # the document's engine (kvcal-recommend/1 "engine")
        out += [f"Backend: {b.name} ({b.engine_name}); every row emulates its write path (FP8 "
                f"{'truncated toward zero' if b.fp8_rounding == 'truncate' else 'rounded to nearest even'}"
                f"{', queries not quantized' if not b.quantizes_query else ''}).", ""]
    c = doc["chosen"]
    if c is None:
        out += ["**No configuration passes** the acceptance bar on its confidence bound within the budget; nothing "
                "to deploy. What would: see the first note below the table.", ""]
    else:
        at = (" at vLLM's default scales (1.0: a checkpoint without k/v/q scales; nothing to export)"
              if c.get("scales") == SCALES_DEFAULT else "")
        out += [f"Chosen: `--kv-cache-dtype {c['dtype']}`{at}, 16-bit layers {c['skip_layers'] or 'none'}, "
                f"{c['bytes_per_token']} bytes/token ({c['vs_16bit']:.3f} of 16-bit), KL {c['kl_mean']:.3e}"
                f"{_bound(c.get('bounds') or {}, 'kl_mean', '{:.3e}')}, ΔPPL {c['delta_ppl']:+.4f}"
                f"{_bound(c.get('bounds') or {}, 'delta_ppl', '{:+.4f}')} on {c.get('windows')} windows "
                f"({c['criteria']}; brackets: the one-sided bound it passed on)"
                + (", per-KV-head scales" if c.get("granularity") == "head" else "") + ".", "", "```sh"]
        if doc["commands"]["export"]:
            out.append(doc["commands"]["export"])
        out += [doc["commands"]["serve"], "```", ""]
    cal = doc.get("calibrated") or {}
    out += [f"Scales calibrated on the corpus (kvcal calibrate --engine vllm) for: "
            f"{', '.join(cal) if cal else 'none of the menu'}; the notes say what each dtype's scales are.", ""]
    d = doc["data"]
    ref = f" (16-bit PPL {d['reference_ppl']:.4f} on them)" if d.get("reference_ppl") else ""
    out += [f"Evaluated on up to {d['evaluation']['windows']} windows x {d['evaluation']['context']} tokens of "
            f"{d['evaluation']['corpus']}{ref}, each row on as many as its decision needed; 16-bit layers chosen by a "
            f"per-layer probe on {d['probe']['windows']} other windows. Acceptance: {doc['accept']}.", "",
            render_table(doc), ""]
    out += [f"- {n}" for n in doc["notes"]]
    return "\n".join(out) + "\n"


def render_pairs_table(doc: dict) -> str:
    """The candidate table of a pairs document (markdown): K type, V type, bytes, windows, KL and ΔPPL with the
    one-sided bound each status was judged on, status."""
    lines = ["| -ctk | -ctv | bytes/token | vs 16-bit | windows | KL mean [bound] | ΔPPL [bound] | status |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for c in sorted(doc["candidates"], key=lambda c: (c["bytes_per_token"], c["dtype"])):
        b = c.get("bounds") or {}
        kl = f"{c['kl_mean']:.3e}" + _bound(b, "kl_mean", "{:.3e}") if "kl_mean" in c else "-"
        dp = f"{c['delta_ppl']:+.4f}" + _bound(b, "delta_ppl", "{:+.4f}") if "delta_ppl" in c else "-"
        mark = " ← chosen" if doc["chosen"] is not None and c["dtype"] == doc["chosen"]["dtype"] else ""
        common = " (common)" if c["dtype"] in doc.get("common", ()) else ""
        lines.append(f"| {c['type_k']} | {c['type_v']} | {c['bytes_per_token']} | {c['vs_16bit']:.3f} | "
                     f"{c.get('windows', '-')} | {kl} | {dp} | {c['status']}{common}{mark} |")
    return "\n".join(lines)


def render_pairs_markdown(doc: dict) -> str:
    """``deploy.md`` of a pairs document: the chosen pair, its serve line, the table and the notes."""
    from kvcal.engines import engine

    name = engine(doc["engine"]).DISPLAY_NAME
    out = [f"# kvcal recommend: {name} KV-cache deployment", ""]
    c = doc["chosen"]
    if c is None:
        out += ["**No K/V cache-type pair passes the bar.**", ""]
    else:
        out += [f"**Deploy:** -ctk {c['type_k']} -ctv {c['type_v']} — {c['bytes_per_token']} bytes/token "
                f"({c['vs_16bit']:.3f} of 16-bit), KL {c['kl_mean']:.3e}, ΔPPL {c['delta_ppl']:+.4f} on "
                f"{c['windows']} windows of {doc['data']['evaluation']['context']} tokens.", "",
                "```", doc["commands"]["serve"], "```", ""]
    out += [f"Bar: `{doc['accept']}`. Model: `{doc['model']}` ({doc['engine_version']}).", "",
            render_pairs_table(doc), "", "## Notes", ""]
    out += [f"- {n}" for n in doc["notes"]]
    return "\n".join(out) + "\n"
