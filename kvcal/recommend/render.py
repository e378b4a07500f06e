"""``deploy.md``: the candidate table (:func:`render_table`) and the whole document
(:func:`render_markdown`)."""

from __future__ import annotations

from kvcal.recommend.config import SCALES_DEFAULT


def render_table(doc: dict) -> str:
    """The candidate table (one row per candidate, markdown); the scales column is the row's ``scales``
    (:func:`row_scales`)."""
    lines = ["| dtype | scales | 16-bit layers | choice | bytes/token | vs 16-bit | KL mean | ΔPPL | status |",
             "|---|---|---|---|---:|---:|---:|---:|---|"]
    for c in doc["candidates"]:
        kl = f"{c['kl_mean']:.3e}" if "kl_mean" in c else "-"
        dp = f"{c['delta_ppl']:+.4f}" if "delta_ppl" in c else "-"
        mark = " ← chosen" if c is doc["chosen"] or c == doc["chosen"] else ""
        lines.append(f"| {c['dtype']} | {c.get('scales', '-')} | {','.join(map(str, c['skip_layers'])) or '-'} | "
                     f"{c['choice']}"
                     f"{'' if c['deployable'] else ' (not deployable)'} | {c['bytes_per_token']} | "
                     f"{c['vs_16bit']:.3f} | {kl} | {dp} | {c['status']}{mark} |")
    return "\n".join(lines)


def render_markdown(doc: dict) -> str:
    """``deploy.md``: the chosen configuration, its commands, the candidate table and the notes."""
    out = ["# kvcal recommend: vLLM KV-cache deployment", ""]
    if doc.get("backend", "cuda") != "cuda":
        from kvcal.formats.vllm_dtypes import vllm_backend

        b = vllm_backend(doc["backend"])
        out += [f"Backend: {b.name} ({b.engine_name}); every row emulates its write path (FP8 "
                f"{'truncated toward zero' if b.fp8_rounding == 'truncate' else 'rounded to nearest even'}"
                f"{', queries not quantized' if not b.quantizes_query else ''}).", ""]
    c = doc["chosen"]
    if c is None:
        out += ["**No configuration passes** the acceptance bar within the budget; nothing to deploy.", ""]
    else:
        at = (" at vLLM's default scales (1.0: a checkpoint without k/v/q scales; nothing to export)"
              if c.get("scales") == SCALES_DEFAULT else "")
        out += [f"Chosen: `--kv-cache-dtype {c['dtype']}`{at}, 16-bit layers {c['skip_layers'] or 'none'}, "
                f"{c['bytes_per_token']} bytes/token ({c['vs_16bit']:.3f} of 16-bit), KL {c['kl_mean']:.3e}, "
                f"ΔPPL {c['delta_ppl']:+.4f} ({c['criteria']}).", "", "```sh"]
        if doc["commands"]["export"]:
            out.append(doc["commands"]["export"])
        out += [doc["commands"]["serve"], "```", ""]
    cal = doc.get("calibrated") or {}
    out += [f"Scales calibrated on the corpus (kvcal calibrate --engine vllm) for: "
            f"{', '.join(cal) if cal else 'none of the menu'}; the notes say what each dtype's scales are.", ""]
    d = doc["data"]
    out += [f"Evaluated on {d['evaluation']['windows']} windows x {d['evaluation']['context']} tokens of "
            f"{d['evaluation']['corpus']} (16-bit PPL {d['reference_ppl']:.4f}); 16-bit layers chosen by a per-layer "
            f"KL probe on {d['probe']['windows']} other windows. Acceptance: {doc['accept']}.", "",
            render_table(doc), ""]
    out += [f"- {n}" for n in doc["notes"]]
    return "\n".join(out) + "\n"
