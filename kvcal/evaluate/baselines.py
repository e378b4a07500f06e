"""Side-by-side baselines of ``kvcal evaluate``, their JSON description, and per-layer attention errors.

Baselines (:func:`baseline_plans`, :class:`~kvcal.plan.KVPlan` each): ``bf16-cache`` (16-bit
storage through the runtime cache), ``fp8-unity`` (FP8 e4m3, scale 1), ``fp8-absmax`` (per-tensor
FP8 e4m3, scale = calibration absmax / 448, ``FP8_E4M3.max``; the absmax comes from the artifact's
metadata, :func:`artifact_amax`, or from a capture pass on windows kept apart from the evaluation
windows, :func:`capture_amax`), ``kivi4`` / ``kivi2`` (KIVI: dynamic g32 asymmetric, keys per
channel over 32 tokens, values per token over 32 channels, the most recent tokens in 16 bits at run
time). Both capture passes here go through :func:`kvcal.capture.capture_kv` (post-RoPE ``q``, ``k``,
``v`` of every attention call; NaN/Inf refused with ``FloatingPointError``).
"""

from __future__ import annotations

import torch

from kvcal.evaluate.accept import plan_bits


def fp8_plan(num_layers: int, scales: list[tuple[float, float]]):
    """Per-tensor FP8 e4m3 :class:`~kvcal.plan.KVPlan` of ``num_layers`` layers with the given
    ``(k_scale, v_scale)`` per layer (dequantization multipliers, ``x ≈ q·scale``; stored as float32
    ``[1, 1, 1, 1]``). ``ValueError`` when ``len(scales) != num_layers``."""
    from kvcal.formats.spec import preset
    from kvcal.plan import KVPlan

    plan = KVPlan.uniform(num_layers, preset("fp8"))
    for lp, (ks, vs) in zip(plan.layers, scales, strict=True):
        lp.k.scale = torch.tensor(float(ks)).reshape(1, 1, 1, 1)
        lp.v.scale = torch.tensor(float(vs)).reshape(1, 1, 1, 1)
    return plan


def artifact_amax(metadata: dict) -> list[tuple[float, float]] | None:
    """Per-layer ``(k_amax, v_amax)`` (float, activation units) from a calibration artifact's
    ``layers[i][side]["amax"]`` metadata (max over heads/channels), or ``None`` when the artifact
    does not record it for every one of ``metadata["model"]["num_layers"]`` layers."""
    layers = metadata.get("layers") or []
    n = int(metadata["model"]["num_layers"])
    if len(layers) != n:
        return None
    out = []
    for lm in layers:
        try:
            ka, va = (max(torch.as_tensor(lm[s]["amax"], dtype=torch.float64).flatten().tolist()) for s in ("k", "v"))
        except (KeyError, TypeError, ValueError):
            return None
        out.append((ka, va))
    return out


def capture_amax(model, windows: torch.Tensor, num_layers: int) -> list[tuple[float, float]]:
    """Per-layer ``(k_amax, v_amax)`` (float, activation units): the max of ``|k|`` / ``|v|``
    (post-RoPE keys) over every head, position and window of a capture pass over ``windows`` int64
    ``[N, T]``, one window per forward pass (use windows kept apart from the evaluation windows).
    Layers that never fire keep ``0.0``."""
    from kvcal.capture.hooks import capture_kv

    amax = [[0.0, 0.0] for _ in range(num_layers)]

    def on_layer(i, q, k, v, module):
        amax[i][0] = max(amax[i][0], float(k.abs().max()))
        amax[i][1] = max(amax[i][1], float(v.abs().max()))

    with torch.no_grad(), capture_kv(model, on_layer):
        for w in windows:
            model(w[None].to(next(model.parameters()).device), use_cache=False)
    return [tuple(a) for a in amax]


def baseline_plans(num_layers: int, amax: list[tuple[float, float]] | None, kivi_window: int = 32) -> dict:
    """The side-by-side baselines: ``bf16-cache`` (16-bit storage through the runtime),
    ``fp8-unity``, ``fp8-absmax`` (calibration absmax / 448; omitted when ``amax`` is None),
    ``kivi4`` / ``kivi2`` (dynamic g32 asymmetric, K per-channel over 32 tokens, V per-token over
    32 channels, ``kivi_window`` recent tokens in 16 bits at run time)."""
    from kvcal.formats.fp8 import FP8_E4M3
    from kvcal.formats.spec import preset
    from kvcal.plan import KVPlan

    out = {"bf16-cache": KVPlan.uniform(num_layers, preset("bf16")),
           "fp8-unity": fp8_plan(num_layers, [(1.0, 1.0)] * num_layers)}
    if amax is not None:
        out["fp8-absmax"] = fp8_plan(num_layers, [(max(k, 1e-12) / FP8_E4M3.max, max(v, 1e-12) / FP8_E4M3.max)
                                                  for k, v in amax])
    for b in (4, 2):
        out[f"kivi{b}"] = KVPlan.uniform(num_layers, preset(f"kivi{b}", residual_window=kivi_window))
    return out


def describe_plan(plan) -> dict:
    """JSON description of a plan (layer 0 specs, per-layer ones when they differ)."""
    meta = plan.kv_metadata()
    lp = plan.layers[0]
    fmt = []
    for s, sp in (("K", lp.k), ("V", lp.v)):
        g = sp.spec.granularity
        gs = f"(g={g.group_size})" if hasattr(g, "group_size") else ""
        kind = "" if not sp.spec.is_quantized else (" dynamic" if sp.spec.dynamic else " static") + (
            "" if sp.spec.symmetric else " asym")
        fmt.append(f"{s} {sp.spec.format.value}" + ("" if not sp.spec.is_quantized else f" {g.name}{gs}{kind}"))
    return {"k": meta["k"], "v": meta["v"], "residual_window": plan.residual_window,
            "sink_tokens": plan.sink_tokens, "quantized_tensors": meta["quantized_tensors"],
            "bits": plan_bits(plan), "label": ", ".join(fmt),
            **({"layer_specs": meta["layer_specs"]} if "layer_specs" in meta else {})}


def per_layer_errors(model, ids: torch.Tensor, plans: dict[str, object], max_queries: int = 128) -> dict:
    """Per-layer attention KL for keys and attention-output error for values on one window.

    ``ids`` int64 ``[1, T]``. Captures post-RoPE q/k/v, then per layer and plan quantizes K (resp.
    V) alone as Protocol A does and scores it with :class:`~kvcal.search.objectives.SequenceCache`
    (``max_queries`` evenly spaced queries). Returns name -> ``{"k_attention_kl": [L] (mean KL per
    (query head, query), nats), "v_output_error": [L] (relative), "tokens", "queries"}``."""
    from kvcal.capture.hooks import attention_scaling, attention_window, capture_kv
    from kvcal.search.objectives import SequenceCache

    captured: dict[int, tuple] = {}

    def on_layer(i, q, k, v, module):
        captured[i] = (q[0].float().cpu(), k[0].float().cpu(), v[0].float().cpu(),
                       attention_scaling(module, k.shape[-1]), attention_window(module))

    with torch.no_grad(), capture_kv(model, on_layer):
        model(ids.to(next(model.parameters()).device), use_cache=False)
    out = {name: {"k_attention_kl": [], "v_output_error": [], "tokens": int(ids.shape[1]), "queries": 0}
           for name in plans}
    for i in sorted(captured):
        q, k, v, scaling, window = captured[i]
        sc = SequenceCache(q, k, v, scaling, max_queries, window)
        nq = sc.num_queries * k.shape[0]  # (query head, query) pairs
        for name, plan in plans.items():
            k_hat = plan.fake_quant(i, "k", k[None])[0]
            v_hat = plan.fake_quant(i, "v", v[None])[0]
            out[name]["k_attention_kl"].append(float(sc.key_kl(k_hat).sum()) / nq)
            err, norm = sc.value_error(v_hat)
            out[name]["v_output_error"].append(float(err.sum() / norm.sum().clamp_min(1e-30)))
            out[name]["queries"] = nq
    return out
