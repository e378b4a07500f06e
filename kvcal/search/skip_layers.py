"""Which layers to keep in the model dtype under vLLM's ``--kv-cache-dtype-skip-layers`` (torch only).

vLLM 0.33 keeps the cache of the layers named in ``--kv-cache-dtype-skip-layers`` at 16 bits and, for the
turboquant presets on dense models, always adds the first 2 and last 2 attention layers on its own
(``engine/arg_utils.py``: ``kv_cache_dtype_skip_layers |= TurboQuantConfig.get_boundary_skip_layers``;
the union cannot be switched off from the command line). That rule is fixed; this module chooses the
layers from a measurement on the user's model and prompts instead.

The measurement (run by :func:`kvcal.recommend.layer_sensitivity`, which calls
:func:`kvcal.evaluate.plans_kl` on the plans :func:`probe_plans` builds): ``s_l`` = model-level mean
``KL(P_16bit ‖ P_l)`` in nats over held-out tokens when only layer ``l``'s K and V (and query, where vLLM
quantizes it) go through dtype ``D`` — Protocol A, one plan per layer. Keeping layer ``l`` at 16 bits is
scored as removing ``s_l`` from the all-layers KL (the additive model HAWQ/KVTuner use; on the embedded
model single-side KLs add up to the all-sides KL within ~10%, see :func:`kvcal.evaluate.side_sensitivity`).

The choice (:func:`choose_skip_layers`) is then an exact 0/1 knapsack: maximise ``Σ s_l`` over the skipped
set subject to a count bound (``--max-skip N``) and/or an extra-bytes bound (from
``--max-bytes-per-token B``), with layers vLLM adds on its own forced in. Ties go to fewer layers, then
lower indices, so the result is deterministic.
"""

from __future__ import annotations

from math import gcd


def rule_skip_layers(num_layers: int, n: int) -> list[int]:
    """vLLM's boundary rule generalised to ``n`` skipped layers: the first ``ceil(n/2)`` and the last
    ``floor(n/2)`` layers (``n = 4``: ``TurboQuantConfig.get_boundary_skip_layers``'s first 2 and last 2).
    Raises ``ValueError`` for ``n`` outside ``[0, num_layers]``."""
    if not 0 <= n <= num_layers:
        raise ValueError(f"cannot skip {n} of {num_layers} layers")
    first = (n + 1) // 2
    return sorted(set(range(first)) | set(range(num_layers - (n - first), num_layers)))


def skip_costs(kv_cache_dtype: str, num_layers: int, num_kv_heads: int, head_dim: int) -> list[int]:
    """Extra KV bytes per token of keeping each layer at 16 bits instead of ``kv_cache_dtype``: the
    16-bit page slot minus the dtype's slot (payload, inline scales, norms), per layer, as
    :func:`kvcal.formats.vllm_dtypes.layer_bytes_per_token` counts them. ``list[int]`` of length
    ``num_layers``."""
    from kvcal.formats.vllm_dtypes import layer_bytes_per_token

    q = layer_bytes_per_token(kv_cache_dtype, num_layers, num_kv_heads, head_dim, add_boundary=False)
    full = layer_bytes_per_token(kv_cache_dtype, num_layers, num_kv_heads, head_dim, range(num_layers),
                                 add_boundary=False)
    return [int(f - b) for f, b in zip(full, q, strict=True)]


def probe_plans(kv_cache_dtype: str, num_layers: int, **scales) -> dict:
    """``{l: plan}`` with one :class:`~kvcal.vllm_plan.VllmKVPlan` per layer ``l`` that quantizes only
    layer ``l`` (every other layer skipped, no boundary rule) — the plans whose model-level KL is the
    sensitivity ``s_l``. ``scales``: ``k_scales``/``v_scales``/``q_scales`` as VllmKVPlan takes them."""
    from kvcal.vllm_plan import VllmKVPlan

    return {layer: VllmKVPlan(kv_cache_dtype, num_layers, skip_layers=tuple(i for i in range(num_layers) if i != layer),
                              add_boundary=False, **scales)
            for layer in range(num_layers)}


def choose_skip_layers(sensitivity: list[float], costs: list[int], *, max_skip: int | None = None,
                       max_extra_bytes: int | None = None, forced=()) -> list[int]:
    """The set of layers to keep at 16 bits that removes the most KL under the bounds: exact 0/1
    knapsack maximising ``Σ sensitivity[l]`` over the chosen layers subject to ``len ≤ max_skip`` and
    ``Σ costs[l] ≤ max_extra_bytes`` (``None``: unbounded), ``forced`` layers always included (and
    counted). ``sensitivity``: non-negative KL per layer (nats); ``costs``: extra bytes per token of
    skipping each layer (:func:`skip_costs`; integers ≥ 0). Among sets of equal value the one with
    fewer layers, then the lexicographically smallest sorted index list, wins.

    Dynamic programme over (layers kept, bytes in units of the costs' gcd) with the best set per
    state: ``O(L · states)``; states are at most ``(L+1)²`` for a uniform model (one cost for every
    layer). Raises ``ValueError`` when a bound is negative, the lists differ in length, or the forced
    layers alone exceed a bound."""
    L = len(sensitivity)
    if len(costs) != L:
        raise ValueError(f"{L} sensitivities but {len(costs)} costs")
    if (max_skip is not None and max_skip < 0) or (max_extra_bytes is not None and max_extra_bytes < 0):
        raise ValueError("skip bounds must be >= 0")
    forced = sorted(set(int(i) for i in forced))
    if any(not 0 <= i < L for i in forced):
        raise ValueError(f"forced layer(s) out of range for {L} layers")
    n0, c0 = len(forced), sum(costs[i] for i in forced)
    if (max_skip is not None and n0 > max_skip) or (max_extra_bytes is not None and c0 > max_extra_bytes):
        raise ValueError(f"the {n0} layer(s) vLLM always skips {forced} already exceed the bound")
    g = 0
    for c in costs:
        g = gcd(g, int(c))
    g = g or 1
    cap_n = L if max_skip is None else max_skip
    cap_c = None if max_extra_bytes is None else max_extra_bytes // g

    def better(a, b):  # (value, layers) a beats b?
        if a[0] != b[0]:
            return a[0] > b[0]
        if len(a[1]) != len(b[1]):
            return len(a[1]) < len(b[1])
        return a[1] < b[1]

    best = {(n0, c0 // g): (sum(float(sensitivity[i]) for i in forced), tuple(forced))}
    for layer in range(L):
        if layer in forced:
            continue
        for (n, c), (v, s) in list(best.items()):
            key = (n + 1, c + costs[layer] // g)
            if key[0] > cap_n or (cap_c is not None and key[1] > cap_c):
                continue
            cand = (v + float(sensitivity[layer]), tuple(sorted((*s, layer))))
            if key not in best or better(cand, best[key]):
                best[key] = cand
    top = None
    for cand in best.values():
        if top is None or better(cand, top):
            top = cand
    return list(top[1])


__all__ = ["rule_skip_layers", "skip_costs", "probe_plans", "choose_skip_layers"]
