"""What the report shows, pulled out of artifact metadata and an evaluation JSON (no drawing).

Everything here reads plain dicts and tolerates missing optional keys: a section whose inputs are
absent returns ``None`` / an empty list and the report says so. The only arithmetic is reshaping,
the clip threshold ``clip_ratio x amax``, the outlier rule (:data:`OUTLIER_FACTOR`) and the exact
memory accounting, which comes from :mod:`kvcal.formats.memory`.

Inputs
------
* artifact metadata (``kvcal.artifact``): ``model``, ``kv``, ``calibration``, ``corpus``,
  ``layers[i].{k,v}.{scale, amax, clip_ratio, candidate, heldout{chosen, absmax, unity}}``; optional
  per-channel ranges ``layers[i].{k,v}.channel_absmax`` ``[H][D]`` or artifact tensors
  ``model.layers.{i}.self_attn.{k,v}_channel_absmax`` ``[H, D]`` (float32).
* evaluation JSON (``kvcal evaluate --json``, schema ``kvcal-eval/1``): ``artifact``, ``corpus``,
  ``model``, ``regimes``, ``results[]``, ``per_layer``, ``memory``, ``notes``.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

#: A channel (or head) is an outlier when its absmax exceeds this multiple of the median of its
#: peers (the channels of the same layer and head; or, without per-channel data, the same side's
#: per-head/per-layer absmax over all layers).
OUTLIER_FACTOR = 4.0
METRICS = ("ppl", "delta_ppl", "kl_mean", "kl_p999", "top1_agree", "greedy_agree", "tokens")
SIDE_NAMES = {"k": "keys", "v": "values"}


def error_data_text(calib_samples: int, heldout_samples: int) -> str:
    """What calibration's guard and per-layer errors were measured on: ``"held-out data (3 of 12
    samples)"``, or — with no held-out split (one sample, or ``heldout_fraction`` 0), where they are
    measured on the calibration samples themselves and are optimistic — ``"calibration data (no
    held-out split: 1 sample)"``. Stored as the artifact's ``calibration.error_data``."""
    if heldout_samples:
        return f"held-out data ({heldout_samples} of {calib_samples + heldout_samples} samples)"
    return f"calibration data (no held-out split: {calib_samples} sample{'' if calib_samples == 1 else 's'})"


def has_heldout(meta: dict) -> bool:
    """True unless the artifact's calibration had no held-out split (``calibration.heldout_samples``
    0); artifacts that do not record it count as having one (as they were reported)."""
    h = (meta.get("calibration") or {}).get("heldout_samples")
    return not (isinstance(h, int) and h == 0)


def heldout_word(meta: dict) -> str:
    """``"held-out"``, or ``"calibration-data"`` when there was no held-out split (:func:`has_heldout`):
    the adjective every report puts before the calibration errors."""
    return "held-out" if has_heldout(meta) else "calibration-data"


def error_data_label(meta: dict) -> str:
    """:func:`error_data_text` of an artifact (its recorded ``calibration.error_data``, else derived
    from the split counts; ``"held-out data"`` when those are not recorded)."""
    cal = meta.get("calibration") or {}
    if isinstance(cal.get("error_data"), str):
        return cal["error_data"]
    c, h = cal.get("calib_samples"), cal.get("heldout_samples")
    if isinstance(c, int) and isinstance(h, int):
        return error_data_text(c, h)
    return "held-out data"


def load_eval(path: str | os.PathLike | None) -> dict | None:
    """Read an evaluation JSON (``None`` passes through). Raises :class:`KvcalError` if unreadable, not
    JSON, not schema ``kvcal-eval/1``, or a result row lacks ``method`` / ``mode`` / ``context``."""
    from kvcal.errors import KvcalError

    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            ev = json.load(f)
    except OSError as e:
        raise KvcalError(f"cannot read evaluation JSON {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise KvcalError(f"{path} is not valid JSON ({e}); pass the file written by `kvcal evaluate --json`") from None
    if not isinstance(ev, dict) or not isinstance(ev.get("results"), list):
        raise KvcalError(f"{path} is not a kvcal evaluation (expected an object with a 'results' list); pass the "
                         "file written by `kvcal evaluate --json`")
    schema = ev.get("schema")
    if schema != "kvcal-eval/1":
        raise KvcalError(f"{path}: schema {schema!r} is not a kvcal evaluation (expected 'kvcal-eval/1'); pass the "
                         "file written by `kvcal evaluate --json`")
    for i, r in enumerate(ev["results"]):
        missing = [k for k in ("method", "mode", "context") if not isinstance(r, dict) or k not in r]
        if missing:
            raise KvcalError(f"{path}: results[{i}] lacks {', '.join(missing)}; the file is not a complete "
                             "`kvcal evaluate --json` output")
    return ev


# ---- what is quantized -----------------------------------------------------------------------
def side_rows(meta: dict) -> list[dict]:
    """One row per side: ``side, quantized, format, bits, granularity, group_size, symmetric,
    dynamic, scale_dtype`` (``quantized`` False for a 16-bit side)."""
    kv = meta.get("kv", {})
    q = set(kv.get("quantized_tensors", [s for s in ("k", "v") if s in kv]))
    rows = []
    for side in ("k", "v"):
        s = kv.get(side) or {}
        fmt = s.get("format", "?")
        quant = side in q and fmt not in ("fp16", "bf16")
        rows.append({"side": side, "quantized": quant, "format": fmt, "bits": s.get("bits"),
                     "granularity": s.get("granularity") if quant else "-",
                     "group_size": s.get("group_size"), "symmetric": s.get("symmetric"),
                     "dynamic": s.get("dynamic"), "scale_dtype": s.get("scale_dtype") if quant else "-"})
    return rows


def quantized_label(meta: dict) -> str:
    """``"K and V"``, ``"K only"``, ``"V only"`` or ``"neither"``."""
    q = [r["side"] for r in side_rows(meta) if r["quantized"]]
    return {("k", "v"): "K and V", ("k",): "K only (V in 16 bits)", ("v",): "V only (K in 16 bits)"}.get(
        tuple(q), "neither (16-bit cache)")


# ---- per-layer ranges ------------------------------------------------------------------------
def _as_rows(x) -> list[float]:
    if x is None:
        return []
    if isinstance(x, (int, float)):
        return [float(x)]
    return [float(v) for v in x]


def _channel_absmax(meta: dict, tensors: dict | None, layer: int, side: str):
    lm = meta["layers"][layer][side]
    if lm.get("channel_absmax") is not None:
        return [[float(v) for v in row] for row in lm["channel_absmax"]]
    if tensors:
        t = tensors.get(f"model.layers.{layer}.self_attn.{side}_channel_absmax")
        if t is not None:
            return t.reshape(t.shape[0], -1).tolist()
    return None


def _clip(ratio: list[float], amax: list[float]) -> list[float]:
    """Clip threshold ``clip_ratio x amax`` with a length-1 side broadcast."""
    if len(ratio) == len(amax):
        return [r * a for r, a in zip(ratio, amax, strict=True)]
    if len(ratio) == 1:
        return [ratio[0] * a for a in amax]
    if len(amax) == 1:
        return [r * amax[0] for r in ratio]
    return []


def _tensor_rows(tensors: dict | None, layer: int, side: str, kind: str) -> list[float]:
    t = (tensors or {}).get(f"model.layers.{layer}.self_attn.{side}_{kind}")
    return [] if t is None else [float(x) for x in t.flatten().tolist()]


def layer_ranges(meta: dict, tensors: dict | None = None) -> dict | None:
    """Per side (sides without any range data are left out):

    * ``amax`` ``[L][H or 1]``: calibration absmax (FP8 artifacts), or ``None``;
    * ``clip_ratio`` ``[L][H or 1]``: chosen clip as a fraction of the absmax (FP8) or of the
      per-group range (dynamic integer sides, from the ``{k,v}_clip_ratio`` tensors), or ``None``;
    * ``clip`` ``[L][...]``: clip threshold ``clip_ratio x amax`` (the value mapped to the format
      maximum), or ``None`` without ``amax``;
    * ``candidate`` ``[L]`` (chosen candidate labels), ``channel_absmax`` ``[L][H][D]`` or ``None``;
    * ``outliers``: ``(layer, head, channel)`` (channel-level data) or ``(layer, head, None)``, with
      ``outlier_level`` ``"channel"`` / ``"head"`` / ``"layer"`` (``None`` without range data).

    Returns ``None`` when no side has any of these."""
    layers = meta.get("layers") or []
    if not layers:
        return None
    out = {}
    for side in ("k", "v"):
        if not all(isinstance(lm.get(side), dict) for lm in layers):
            continue
        n = len(layers)
        amax = [_as_rows(lm[side].get("amax")) for lm in layers]
        ratio = [_as_rows(lm[side].get("clip_ratio")) or _tensor_rows(tensors, i, side, "clip_ratio")
                 for i, lm in enumerate(layers)]
        have_amax, have_ratio = all(amax), all(ratio)
        cand = [",".join(sorted(set(lm[side].get("candidate") or lm[side].get("label") or []))) for lm in layers]
        chans = [_channel_absmax(meta, tensors, i, side) for i in range(n)]
        have_ch = all(c is not None for c in chans)
        if not (have_amax or have_ratio or have_ch):
            continue
        outliers, level = [], None
        if have_ch:
            level = "channel"
            for i, heads in enumerate(chans):
                for h, row in enumerate(heads):
                    med = statistics.median(row) if row else 0.0
                    outliers += [(i, h, d) for d, x in enumerate(row) if med > 0 and x > OUTLIER_FACTOR * med]
        elif have_amax:
            flat = [x for row in amax for x in row]
            med = statistics.median(flat) if flat else 0.0
            level = "head" if any(len(r) > 1 for r in amax) else "layer"
            for i, row in enumerate(amax):
                outliers += [(i, h, None) for h, x in enumerate(row) if med > 0 and x > OUTLIER_FACTOR * med]
        out[side] = {"amax": amax if have_amax else None, "clip_ratio": ratio if have_ratio else None,
                     "clip": [_clip(r, a) for r, a in zip(ratio, amax, strict=True)] if have_amax and have_ratio else None,
                     "candidate": cand, "channel_absmax": chans if have_ch else None, "outliers": outliers,
                     "outlier_level": level}
    return out or None


def heldout_errors(meta: dict) -> dict | None:
    """Per side: held-out errors per layer from calibration (keys: attention KL in nats/query;
    values: relative attention-output error), ``{name: [L]}``: FP8 artifacts ``chosen`` /
    ``absmax`` / ``unity``; integer artifacts ``chosen`` / ``min/max`` (plain min/max ranges)."""
    layers = meta.get("layers") or []
    out = {}
    for side in ("k", "v"):
        recs = [lm.get(side) if isinstance(lm.get(side), dict) else {} for lm in layers]
        hs = [r.get("heldout") for r in recs]
        if not hs or any(h is None for h in hs):
            continue
        if all(isinstance(h, dict) for h in hs):
            d = {w: [h.get(w) for h in hs] for w in ("chosen", "absmax", "unity") if all(w in h for h in hs)}
        elif all(isinstance(h, (int, float)) for h in hs):
            d = {"chosen": [float(h) for h in hs]}
            if all(isinstance(r.get("heldout_minmax"), (int, float)) for r in recs):
                d["min/max"] = [float(r["heldout_minmax"]) for r in recs]
        else:
            continue
        if d:
            out[side] = d
    return out or None


def layer_rows(meta: dict) -> list[list[str]]:
    """Per-layer table rows for any artifact: ``layer, K spec, K pick, K held-out, V spec, V pick,
    V held-out`` (held-out shown as ``chosen (reference)``: absmax for FP8, min/max for integer)."""
    kv = meta.get("kv") or {}
    specs = kv.get("layer_specs")
    he = heldout_errors(meta) or {}
    rows = []
    for i, lm in enumerate(meta.get("layers") or []):
        row = [str(lm.get("layer", i))]
        for side in ("k", "v"):
            rec = lm.get(side) if isinstance(lm.get(side), dict) else {}
            sp = rec.get("spec") or (specs[i][side] if specs and i < len(specs) else kv.get(side)) or {}
            gs = f"(g={sp['group_size']})" if sp.get("group_size") else ""
            pick = ",".join(sorted(set(rec.get("candidate") or rec.get("label") or []))) or "–"
            h = he.get(side) or {}
            ref = h.get("absmax") or h.get("min/max")
            err = "–"
            if h.get("chosen"):
                err = f"{h['chosen'][i]:.3e}" + (f" ({ref[i]:.3e})" if ref else "")
            row += [f"{sp.get('format', '?')} {sp.get('granularity', '')}{gs}".strip(), pick, err]
        rows.append(row)
    return rows


def mean_or_none(xs) -> float | None:
    xs = [x for x in xs if isinstance(x, (int, float))]
    return sum(xs) / len(xs) if xs else None


# ---- evaluation results ----------------------------------------------------------------------
def tested_method(ev: dict | None) -> str | None:
    """Name of the method that is the artifact under test: the ``methods`` entry with role
    ``"artifact"``, else ``artifact.method`` / ``name``, else a result row named ``"artifact"``."""
    if not ev:
        return None
    if isinstance(ev.get("judged_method"), str):  # kvcal evaluate names the row that sets its verdict
        return ev["judged_method"]
    for name, m in (ev.get("methods") or {}).items():
        if isinstance(m, dict) and m.get("role") == "artifact":
            return name
    a = ev.get("artifact") or {}
    for key in ("method", "name"):
        if isinstance(a.get(key), str):
            return a[key]
    if any(isinstance(r, dict) and r.get("method") == "artifact" for r in ev.get("results") or []):
        return "artifact"
    return None


def methods_rows(ev: dict | None) -> list[dict]:
    """``[{"name", "role", "label", "bits", "criteria"}]`` from the evaluation's ``methods``."""
    out = []
    for name, m in ((ev or {}).get("methods") or {}).items():
        if isinstance(m, dict):
            out.append({"name": name, "role": m.get("role"), "label": m.get("label"), "bits": m.get("bits"),
                        "residual_window": m.get("residual_window"), "criteria": m.get("criteria")})
    return out


def results(ev: dict | None) -> list[dict]:
    """Evaluation results sorted by (mode, context, batch, method); missing metrics are ``None``."""
    if not ev:
        return []
    rows = []
    for r in ev.get("results") or []:
        if not isinstance(r, dict):
            continue
        row = {k: r.get(k) for k in ("method", "mode", "context", "batch", "status", "criteria", "failed", "bounds",
                                      *METRICS)}
        rows.append(row)
    order = {"teacher_forced": 0, "decode": 1}
    return sorted(rows, key=lambda r: (order.get(r["mode"], 2), r["context"] or 0, r["batch"] or 0, str(r["method"])))


def verdict(ev: dict | None) -> dict | None:
    """``{"method", "status": "PASS"|"FAIL"|"INCONCLUSIVE"|"NOT JUDGED", "failed": [rows not PASS]}`` for the
    method under test (``judged_method``, or every judged method when the JSON does not name one): FAIL when a
    row fails, INCONCLUSIVE when none fails but one is undecided (its bound straddles the bar)."""
    rs = results(ev)
    if not rs:
        return None
    m = tested_method(ev)
    decided = ("PASS", "FAIL", "INCONCLUSIVE")
    mine = [r for r in rs if r["method"] == m] if m else [r for r in rs if r["status"] in decided]
    judged = [r for r in mine if r["status"] in decided]
    failed = [r for r in judged if r["status"] != "PASS"]
    status = ("FAIL" if any(r["status"] == "FAIL" for r in judged) else "INCONCLUSIVE" if failed else
              "PASS" if judged else "NOT JUDGED")
    return {"method": m, "status": status, "failed": failed, "judged": len(judged)}


def regimes(ev: dict | None) -> dict:
    """``{"contexts": [...], "batches": [...], "modes": [...], "pairs": [(context, batch)]}``."""
    pairs = set()
    for r in (ev or {}).get("regimes") or []:
        if isinstance(r, dict) and r.get("context") is not None:
            pairs.add((int(r["context"]), int(r.get("batch") or 1)))
    rs = results(ev)
    for r in rs:
        if r["context"] is not None:
            pairs.add((int(r["context"]), int(r["batch"] or 1)))
    return {"contexts": sorted({c for c, _ in pairs}), "batches": sorted({b for _, b in pairs}),
            "modes": sorted({r["mode"] for r in rs if r["mode"]}), "pairs": sorted(pairs)}


def quality_series(ev: dict | None, metric: str) -> dict[str, tuple[list[int], list[float]]]:
    """``label -> (contexts, values)`` of ``metric`` per (method, mode[, batch]), for plotting."""
    rs = [r for r in results(ev) if r.get(metric) is not None and r["context"] is not None]
    multi_batch = len({r["batch"] for r in rs}) > 1
    series: dict[str, tuple[list[int], list[float]]] = {}
    for r in rs:
        suffix = f", batch {r['batch']}" if multi_batch else ""
        label = f"{r['method']} ({r['mode'] or '?'}{suffix})"
        xs, ys = series.setdefault(label, ([], []))
        xs.append(int(r["context"]))
        ys.append(float(r[metric]))
    return series


def per_layer_eval(ev: dict | None) -> dict | None:
    """``method -> {"k_attention_kl": [L], "v_output_error": [L]}`` from the evaluation, if present."""
    pl = (ev or {}).get("per_layer")
    return pl if isinstance(pl, dict) and pl else None


def criteria_text(c) -> str:
    if c is None:
        return ""
    if isinstance(c, dict):
        return ", ".join(f"{k}{v}" if isinstance(v, str) and v[:1] in "<>=" else f"{k}<={v}" for k, v in c.items())
    if isinstance(c, (list, tuple)):
        return ", ".join(map(str, c))
    return ", ".join(p.strip() for p in str(c).split(",") if p.strip())


# ---- corpora ---------------------------------------------------------------------------------
def _window_percentiles(windows: dict) -> dict:
    """Nearest-rank length percentiles of evaluation windows ``{"<length>": count}``."""
    lengths = sorted((int(k), int(v)) for k, v in windows.items() if int(v) > 0)
    n = sum(v for _, v in lengths)
    out = {}
    for name, q in (("p50", 50), ("p90", 90), ("p99", 99), ("max", 100)):
        rank, acc = max(1, -(-q * n // 100)), 0
        for length, count in lengths:
            acc += count
            if acc >= rank:
                out[name] = length
                break
    return out


def corpus_summary(c: dict | None) -> dict:
    """Normalise a corpus section: the artifact's (``length_percentiles`` nested), or the
    evaluation's (flat percentiles, or ``windows`` ``{"<context>": count}`` from which the window
    length percentiles are read; ``kind`` is its format)."""
    c = c or {}
    pct = dict(c.get("length_percentiles") or {})
    windows = c.get("windows") if isinstance(c.get("windows"), dict) else None
    from_windows = bool(windows) and not any(k in c or k in pct for k in ("p50", "max"))
    if from_windows:
        pct = _window_percentiles(windows)
    get = lambda k: c.get(k, pct.get(k))  # noqa: E731
    path = c.get("path")
    samples = c.get("samples")
    if samples is None and windows:
        samples = sum(int(v) for v in windows.values())
    return {"path": path, "domain": c.get("domain") or (Path(path).stem if path else None),
            "sha256": c.get("sha256"), "format": c.get("format") or c.get("kind"), "samples": samples,
            "tokens": c.get("tokens"), "p50": get("p50"), "p90": get("p90"), "p99": get("p99"),
            "max": get("max"), "truncated": c.get("truncated"),
            "windows": ", ".join(f"{n} × {k} tok" for k, n in sorted(windows.items(), key=lambda kv: int(kv[0])))
            if windows else None, "lengths_from_windows": from_windows, "source": c.get("window_source")}


def corpus_relation(cal: dict, ev: dict | None, cal_max_len: int | None, eval_contexts: list[int],
                    heldout: bool = True) -> list[str]:
    """Plain sentences relating the calibration corpus to the evaluation corpus (``heldout``: whether
    calibration split off held-out samples, :func:`has_heldout`)."""
    if not ev:
        return ["No evaluation corpus given: run `kvcal evaluate --json` and pass it with `--eval`."]
    out = []
    if not cal.get("path") and not cal.get("sha256"):
        return ["The artifact does not record its calibration corpus: the relation to the evaluation corpus "
                "cannot be stated."]
    same_hash = cal.get("sha256") and cal.get("sha256") == ev.get("sha256")
    same_path = cal.get("path") and ev.get("path") and Path(cal["path"]).name == Path(ev["path"]).name
    if same_hash:
        out.append("The evaluation corpus is **the same file** as the calibration corpus (same sha256): quality "
                   "figures are in-domain and may be optimistic"
                   + ("; held-out samples were split off at calibration." if heldout
                      else ", and calibration had no held-out split: the evaluation reads the calibration samples."))
    elif same_path:
        out.append("The evaluation corpus has the same file name as the calibration corpus but a different "
                   "content hash: check that they are the intended pair.")
    else:
        out.append(f"Different corpora: calibration `{cal.get('domain') or '?'}` vs evaluation "
                   f"`{ev.get('domain') or '?'}` (out-of-sample; domain shift is part of what is measured).")
    if cal.get("p50") and ev.get("p50"):
        out.append(f"Median sample length: calibration {cal['p50']} vs evaluation {ev['p50']} tokens "
                   f"({ev['p50'] / cal['p50']:.2f}x).")
    if cal_max_len and eval_contexts and max(eval_contexts) > cal_max_len:
        out.append(f"Evaluation contexts reach {max(eval_contexts)} tokens while calibration samples were capped at "
                   f"{cal_max_len}: scales were not observed at the longest evaluated positions.")
    return out


# ---- memory ----------------------------------------------------------------------------------
def memory_summary(meta: dict, contexts: list[int] | None = None, batches: list[int] | None = None,
                   tensors: dict | None = None) -> dict | None:
    """Exact accounting (:mod:`kvcal.formats.memory`) for the artifact's cache vs 16-bit (per-layer
    metadata counted exactly when the artifact's ``tensors`` are given; :func:`kvcal.capacity.artifact_kv_config`).

    Returns ``{"bytes_per_token", "bytes_per_token_16", "ratio", "contexts", "batches",
    "cache_bytes": {batch: [bytes per context]}, "cache_bytes_16": {...}}`` or ``None`` when the
    metadata lacks the model shape or kv config."""
    from kvcal.capacity import artifact_kv_config
    from kvcal.formats.memory import ModelShape, bytes_per_token_exact, cache_bytes
    from kvcal.formats.spec import PRESETS

    m = meta.get("model") or {}
    try:
        shape = ModelShape(int(m["num_layers"]), int(m["num_kv_heads"]), int(m["head_dim"]),
                           int(m.get("max_position_embeddings") or 0) or None,
                           tuple(m["layer_windows"]) if m.get("layer_windows") else None)
        cfg = artifact_kv_config(meta, tensors)
    except Exception:
        return None
    mmax = shape.max_position_embeddings or 8192
    if not contexts:
        contexts, c = [], 256
        while c < mmax:
            contexts.append(c)
            c *= 2
        contexts.append(mmax)
    batches = batches or [1, 8, 32]
    b16, bq = bytes_per_token_exact(shape, PRESETS["bf16"]), bytes_per_token_exact(shape, cfg)
    return {
        "bytes_per_token": float(bq), "bytes_per_token_16": float(b16), "ratio": float(b16 / bq),
        "capacity_gain_pct": float((b16 / bq - 1) * 100), "contexts": list(contexts), "batches": list(batches),
        "cache_bytes": {b: [cache_bytes(shape, cfg, c, b) for c in contexts] for b in batches},
        "cache_bytes_16": {b: [cache_bytes(shape, PRESETS["bf16"], c, b) for c in contexts] for b in batches},
    }
