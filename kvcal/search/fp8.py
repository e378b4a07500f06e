"""Static FP8 scale search over a capture: per layer, K and V scales chosen separately.

Keys by attention-score KL, values by attention-output error, each guarded on the held-out
reservoir against absmax and unity (:func:`kvcal.search.static_scales.choose_static_fp8`).
"""

from __future__ import annotations

from kvcal.capture.run import CaptureResult
from kvcal.search.objectives import sequence_caches
from kvcal.search.result import ERROR_DATA, SearchResult


def search_scales(cap: CaptureResult, fmt_name: str, per_head: bool, max_queries: int = 128,
                  progress: bool = True) -> list[dict]:
    """Per layer: choose K and V static scales. Returns ``[{"layer", "k": ScaleChoice, "v": ScaleChoice}]``."""
    from tqdm.auto import tqdm

    from kvcal.formats.fp8 import get_fp8_format
    from kvcal.search.static_scales import choose_static_fp8

    fmt = get_fp8_format(fmt_name)
    out = []
    n = len(cap.stats.k)
    for layer in tqdm(range(n), desc="search", disable=not progress):
        calib = sequence_caches(cap.calib, layer, cap.scaling[layer], max_queries,
                          cap.windows.get(layer, 0))
        held = sequence_caches(cap.heldout, layer, cap.scaling[layer], max_queries,
                          cap.windows.get(layer, 0)) if cap.heldout.items else []
        row = {"layer": layer}
        for side in ("k", "v"):
            st = getattr(cap.stats, side)[layer].finalize()
            row[side] = choose_static_fp8(calib, held, st["head_absmax"], side, fmt, per_head)
        if not per_head:
            row["shared"] = measure_shared(calib, held, row["k"], row["v"], fmt)
        out.append(row)
    return out


def measure_shared(calib: list, heldout: list, k, v, fmt) -> dict:
    """What one scale per layer shared by K and V costs (``sglang-json``, ``trtllm-legacy``: ``max(k, v)``),
    measured on the held-out split (the calibration split when there is none) with the objectives of the search:
    ``{"searched": {...}, "clip_free": {...}}``, each ``{"scale": float, "heldout": {"k": KL per query, "v":
    relative output error}}`` for ``max`` of the two sides' searched / clip-free per-tensor scales
    (:class:`~kvcal.search.static_scales.ScaleChoice`, ``[1]``). A side whose own scale is the shared one
    repeats its own figure (no extra evaluation)."""
    import torch

    from kvcal.search.static_scales import _side_errors

    held = heldout if heldout else calib
    out = {}
    for which in ("searched", "clip_free"):
        own = {"k": k, "v": v}
        sc = {sd: (c.scale if which == "searched" else c.clip_free["scale"]).reshape(-1)[:1] for sd, c in own.items()}
        shared = torch.maximum(sc["k"], sc["v"])
        figs = {}
        for sd, c in own.items():
            if bool(sc[sd] >= shared):
                figs[sd] = c.heldout["chosen"] if which == "searched" else c.clip_free["heldout"]
                continue
            cols = held[0].k.shape[0]  # [H_kv, T, D]: the per-tensor scale repeated per KV head
            num, den = _side_errors(held, sd, shared.float().expand(1, cols).contiguous(), fmt)
            figs[sd] = float(num.sum() / den.sum())
        out[which] = {"scale": float(shared), "heldout": figs}
    return out


def plan_from_choices(rows: list[dict], fmt: str, granularity: str, num_kv_heads: int):
    """Build the :class:`~kvcal.plan.KVPlan` and the per-layer metadata from :func:`search_scales` rows."""
    from kvcal.formats.spec import TensorQuantSpec
    from kvcal.plan import KVPlan, LayerPlan, SidePlan

    spec = TensorQuantSpec(fmt, granularity)
    layers, layers_meta = [], []
    for r in rows:
        lm, sides = {"layer": r["layer"]}, {}
        for side in ("k", "v"):
            ch = r[side]
            shape = (1, 1, 1, 1) if granularity == "tensor" else (1, num_kv_heads, 1, 1)
            sides[side] = SidePlan(spec, scale=ch.scale.reshape(shape).float())
            lm[side] = {"scale": ch.scale.tolist(), "amax": ch.amax.tolist(), "clip_ratio": ch.clip_ratio.tolist(),
                        "candidate": ch.label, "heldout": ch.heldout, "calib": ch.calib}
            if ch.clip_free is not None:
                cf = ch.clip_free
                lm[side]["clip_free"] = {"scale": cf["scale"].tolist(), "candidate": cf["label"],
                                         "heldout": cf["heldout"], "calib": cf["calib"]}
            if ch.candidates is not None:
                lm[side]["candidates"] = ch.candidates
        if r.get("shared"):
            lm["shared"] = r["shared"]
        layers.append(LayerPlan(sides["k"], sides["v"]))
        layers_meta.append(lm)
    return KVPlan(layers), layers_meta


def static_result(rows: list[dict], plan, layers_meta: list[dict], search_seconds: float) -> SearchResult:
    """The :class:`~kvcal.search.result.SearchResult` of a static-scale search (this module's
    :func:`search_scales`, :func:`kvcal.engines.vllm.search_fp8.search_vllm_fp8`,
    :func:`kvcal.engines.vllm.search_nvfp4.search_vllm_nvfp4`): ``rows`` as the search returned them, the plan
    and per-layer metadata built from them, and the search's wall time (seconds)."""
    from kvcal.search.static_scales import DEFAULT_CLIP_RATIOS, DEFAULT_HEADROOM

    return SearchResult(
        plan=plan, layers_meta=layers_meta, rows=rows,
        method="attention-aware static scale search",
        summary={
            "objective_k": "attention KL (nats per query, causal, real captured queries of every GQA head)",
            "objective_v": "relative attention-output error sum|P(V^-V)|^2 / sum|PV|^2",
            "candidates": "absmax, unity, otf (amax/200 K, amax/100 V), clip "
                          + ", ".join(f"{r:g}" for r in DEFAULT_CLIP_RATIOS) + ", headroom "
                          + ", ".join(f"{m:g}" for m in DEFAULT_HEADROOM),
        },
        selection=f"best on calibration split, then lowest {ERROR_DATA} among {{best, absmax, unity}}",
        timing={"search_seconds": round(search_seconds, 2)})
