"""Static FP8 scale search over a capture: per layer, K and V scales chosen separately.

Keys by attention-score KL, values by attention-output error, each guarded on the held-out
reservoir against absmax and unity (:func:`kvcal.search.static_scales.choose_static_fp8`).
"""

from __future__ import annotations

from kvcal.capture.run import CaptureResult
from kvcal.search.objectives import sequence_caches


def search_scales(cap: CaptureResult, fmt_name: str, per_head: bool, max_queries: int = 128,
                  progress: bool = True) -> list[dict]:
    """Per layer: choose K and V static scales. Returns ``[{"layer", "k": SideChoice, "v": SideChoice}]``."""
    from tqdm.auto import tqdm

    from kvcal.formats.fp8 import get_fp8_format
    from kvcal.search.static_scales import choose_static_fp8

    fmt = get_fp8_format(fmt_name)
    out = []
    n = len(cap.stats.k)
    for layer in tqdm(range(n), desc="search", disable=not progress):
        calib = sequence_caches(cap.calib, layer, cap.scaling[layer], max_queries)
        held = sequence_caches(cap.heldout, layer, cap.scaling[layer], max_queries) if cap.heldout.items else []
        row = {"layer": layer}
        for side in ("k", "v"):
            st = getattr(cap.stats, side)[layer].finalize()
            row[side] = choose_static_fp8(calib, held, st["head_absmax"], side, fmt, per_head)
        out.append(row)
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
        layers.append(LayerPlan(sides["k"], sides["v"]))
        layers_meta.append(lm)
    return KVPlan(layers), layers_meta
