"""Which layers to keep in the model dtype under vLLM's ``--kv-cache-dtype-skip-layers`` (torch only).

vLLM 0.33 keeps the cache of the layers named in ``--kv-cache-dtype-skip-layers`` at 16 bits and, for the
turboquant presets on dense models, always adds the first 2 and last 2 attention layers on its own
(``engine/arg_utils.py``: ``kv_cache_dtype_skip_layers |= TurboQuantConfig.get_boundary_skip_layers``;
the union cannot be switched off from the command line). That rule is fixed; this module chooses the
layers from a measurement on the user's model and prompts instead.

The measurement (run by :func:`kvcal.evaluate.vllm_probe.layer_sensitivity`, which calls
:func:`kvcal.evaluate.plans_kl` on the plans :func:`probe_plans` builds): ``s_l`` = model-level mean
``KL(P_16bit ‖ P_l)`` in nats over held-out tokens when only layer ``l``'s K and V (and query, where vLLM
quantizes it) go through dtype ``D`` — Protocol A, one plan per layer. Keeping layer ``l`` at 16 bits is
scored as removing ``s_l`` from the all-layers KL (the additive model HAWQ/KVTuner use; on the embedded
model single-side KLs add up to the all-sides KL within ~10%, see :func:`kvcal.evaluate.side_sensitivity`).

The choice (:func:`choose_skip_layers`) is then an exact 0/1 knapsack: maximise ``Σ s_l`` over the skipped
set subject to a count bound (``--max-skip N``) and/or an extra-bytes bound (from
``--max-bytes-per-token B``), with layers vLLM adds on its own forced in. Ties go to fewer layers, then
lower indices, so the result is deterministic.

At least one layer always stays in the dtype (:func:`skip_count_range`): a configuration that keeps every
layer at 16 bits stores nothing in ``D`` — it is the 16-bit cache under ``D``'s name, with the 16-bit cache's
bytes — so no caller offers, chooses or records one. Where vLLM's own boundary layers already cover the whole
model (turboquant on 2 or 4 layers: ``min(2, L // 2)`` first and last), the dtype has no deployment on that
model (:func:`not_applicable`).
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


def skip_costs(kv_cache_dtype: str, num_layers: int, num_kv_heads: int, head_dim: int, shares=None) -> list[int]:
    """Extra KV bytes per token of keeping each layer at 16 bits instead of ``kv_cache_dtype``: the
    16-bit page slot minus the dtype's slot (payload, inline scales, norms), per layer, as
    :func:`kvcal.formats.vllm_dtypes.layer_bytes_per_token` counts them. ``shares`` (a model with
    sliding-window layers: :func:`kvcal.formats.memory.vllm_token_shares`): each layer's extra bytes times the
    share of the context it holds, rounded up — a sliding layer at 16 bits costs little at long context.
    ``list[int]`` of length ``num_layers``."""
    import math

    from kvcal.formats.vllm_dtypes import layer_bytes_per_token

    q = layer_bytes_per_token(kv_cache_dtype, num_layers, num_kv_heads, head_dim, add_boundary=False)
    full = layer_bytes_per_token(kv_cache_dtype, num_layers, num_kv_heads, head_dim, range(num_layers),
                                 add_boundary=False)
    if shares is None:
        return [int(f - b) for f, b in zip(full, q, strict=True)]
    return [math.ceil((f - b) * w) for f, b, w in zip(full, q, shares, strict=True)]


def _quantized_bytes(kv_cache_dtype, num_layers, num_kv_heads, head_dim, shares=None) -> int:
    """Bytes per token of the dtype with no layer at 16 bits beyond vLLM's own (``shares``: weighted, rounded up)."""
    import math

    from kvcal.formats.vllm_dtypes import layer_bytes_per_token

    per = layer_bytes_per_token(kv_cache_dtype, num_layers, num_kv_heads, head_dim, add_boundary=False)
    return sum(per) if shares is None else math.ceil(sum(b * w for b, w in zip(per, shares, strict=True)))


def skip_count_range(kv_cache_dtype: str, num_layers: int) -> tuple[int, int]:
    """The numbers of 16-bit layers a vLLM deployment of ``kv_cache_dtype`` can have on a ``num_layers``-layer
    model: ``(lo, hi)`` with ``lo`` = the layers vLLM 0.33 keeps at 16 bits on its own
    (:func:`kvcal.formats.vllm_dtypes.boundary_skip_layers`: 4 for turboquant on 5+ layers, else 0) and
    ``hi = num_layers - 1`` — at least one layer stays in the dtype, else nothing is stored in it (the 16-bit
    cache under the dtype's name, with its bytes). ``lo > hi`` when the boundary alone covers every layer
    (:func:`not_applicable`)."""
    from kvcal.formats.vllm_dtypes import boundary_skip_layers

    return len(boundary_skip_layers(kv_cache_dtype, num_layers)), num_layers - 1


def not_applicable(kv_cache_dtype: str, num_layers: int) -> str | None:
    """Why ``kv_cache_dtype`` has no meaningful vLLM deployment on a ``num_layers``-layer model, or ``None``:
    vLLM 0.33 adds the first and last ``min(2, L // 2)`` layers of a turboquant dtype to
    ``--kv-cache-dtype-skip-layers`` on its own (``TurboQuantConfig.get_boundary_skip_layers``, unioned in
    ``engine/arg_utils.py``), which covers every layer of a 2- or 4-layer model: nothing would be stored in
    the dtype. One line (no trailing period)."""
    from kvcal.formats.vllm_dtypes import boundary_skip_layers

    forced = boundary_skip_layers(kv_cache_dtype, num_layers)
    if num_layers < 1 or len(forced) < num_layers:
        return None
    return (f"vLLM 0.33 keeps every layer ({', '.join(map(str, forced))}) of this {num_layers}-layer model at 16 bits "
            f"for {kv_cache_dtype} on its own (first and last min(2, L//2) layers, "
            "TurboQuantConfig.get_boundary_skip_layers): nothing would be stored in it")


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


def parse_skip_layers(text) -> str | tuple[int, ...] | None:
    """``--skip-layers`` as given: ``None`` (not given), ``"auto"`` (choose by the probe), or a tuple of
    layer indices from a comma-separated list (``"0,1,29"``; spaces allowed; returned sorted) or from a
    list/tuple of integers (the Python API). The range is checked later against the model
    (:func:`check_skip_layers`). Raises :class:`~kvcal.errors.KvcalError` with a one-line fix for an empty
    list, an empty item, a non-integer or negative item, or a repeated layer."""
    from kvcal.errors import KvcalError

    if text is None:
        return None
    if isinstance(text, (list, tuple)):
        if any(isinstance(x, bool) or not isinstance(x, int) for x in text):
            raise KvcalError(f"skip_layers {list(text)!r}: give 'auto' or a list of layer indices (integers >= 0)")
        text = ",".join(map(str, text))
    t = str(text).strip()
    if t.lower() == "auto":
        return "auto"
    from kvcal.options import split_list

    items = split_list(t, "--skip-layers", "layer index ('auto' or comma-separated indices)", "0,1,29", item="layer")
    out = []
    for x in items:
        if not x.isdigit():
            raise KvcalError(f"--skip-layers {text!r}: {x!r} is not a layer index (an integer >= 0); give 'auto' or "
                             "comma-separated layer indices (e.g. 0,1,29)")
        if int(x) in out:
            raise KvcalError(f"--skip-layers {text!r}: layer {int(x)} is named twice; name each layer once")
        out.append(int(x))
    return tuple(sorted(out))


def check_skip_options(skip_layers, max_skip: int | None, max_bytes_per_token: int | None) -> None:
    """The model-free checks of ``--skip-layers`` / ``--max-skip`` / ``--max-bytes-per-token`` (values
    as :func:`parse_skip_layers` returns them): ``auto`` needs a budget (without one the knapsack keeps all but
    one layer at 16 bits), a budget applies to ``auto`` only (an explicit list is taken as given), and
    bounds are >= 0 / >= 1. Raises :class:`~kvcal.errors.KvcalError`."""
    from kvcal.errors import KvcalError

    if max_skip is not None and max_skip < 0:
        raise KvcalError(f"--max-skip must be >= 0, got {max_skip}")
    if max_bytes_per_token is not None and max_bytes_per_token < 1:
        raise KvcalError(f"--max-bytes-per-token must be >= 1, got {max_bytes_per_token}")
    budget = [o for o, v in (("--max-skip", max_skip), ("--max-bytes-per-token", max_bytes_per_token)) if v is not None]
    if skip_layers == "auto" and not budget:
        raise KvcalError("--skip-layers auto needs a budget: add --max-skip N (most 16-bit layers) or "
                         "--max-bytes-per-token B (KV bytes per token, all layers)")
    if budget and skip_layers != "auto":
        raise KvcalError(f"{' and '.join(budget)} bound{'s' if len(budget) == 1 else ''} the choice of "
                         "--skip-layers auto; add --skip-layers auto or drop "
                         f"{'it' if len(budget) == 1 else 'them'}")


def check_skip_layers(skip_layers, kv_cache_dtype: str, num_layers: int, num_kv_heads: int, head_dim: int,
                      max_skip: int | None = None, max_bytes_per_token: int | None = None, shares=None) -> None:
    """The checks that need the model's shape (before it loads): the dtype has a deployment on the model
    (:func:`not_applicable`); an explicit list inside ``[0, num_layers)`` that leaves at least one layer
    (after vLLM's own boundary layers) in the dtype; for ``auto``, a ``--max-skip`` inside
    :func:`skip_count_range` (not below the layers vLLM skips on its own, at most ``num_layers - 1``) and a
    ``--max-bytes-per-token`` that the dtype can meet with only the layers vLLM skips on its own. Raises
    :class:`~kvcal.errors.KvcalError`."""
    import math

    from kvcal.errors import KvcalError
    from kvcal.formats.vllm_dtypes import boundary_skip_layers, layer_bytes_per_token

    if skip_layers is None:
        return
    na = not_applicable(kv_cache_dtype, num_layers)
    if na:
        raise KvcalError(f"--kv-cache-dtype {kv_cache_dtype}: {na}; choose another dtype")
    forced = boundary_skip_layers(kv_cache_dtype, num_layers)
    if skip_layers != "auto":
        bad = [i for i in skip_layers if i >= num_layers]
        if bad:
            raise KvcalError(f"--skip-layers: layer{'s' if len(bad) > 1 else ''} {','.join(map(str, bad))} out of "
                             f"range: the model has {num_layers} layers (0..{num_layers - 1})")
        if len(set(skip_layers) | set(forced)) >= num_layers:
            raise KvcalError(f"--skip-layers {','.join(map(str, skip_layers))}: keeps all {num_layers} layers of the "
                             f"model at 16 bits, so nothing would be stored in --kv-cache-dtype {kv_cache_dtype} (the "
                             "16-bit cache under its name); leave at least one layer out")
        return
    lo, hi = skip_count_range(kv_cache_dtype, num_layers)
    if max_skip is not None and max_skip < lo:
        raise KvcalError(f"--max-skip {max_skip}: vLLM always keeps {len(forced)} layers {forced} of "
                         f"--kv-cache-dtype {kv_cache_dtype} at 16 bits; give --max-skip >= {len(forced)}")
    if max_skip is not None and max_skip > hi:
        raise KvcalError(f"--max-skip {max_skip}: the model has {num_layers} layers and at least one must stay in "
                         f"--kv-cache-dtype {kv_cache_dtype}; give --max-skip between {lo} and {hi}")
    if max_bytes_per_token is not None:
        per = layer_bytes_per_token(kv_cache_dtype, num_layers, num_kv_heads, head_dim)
        least = sum(per) if shares is None else math.ceil(sum(b * w for b, w in zip(per, shares, strict=True)))
        if least > max_bytes_per_token:
            raise KvcalError(f"--max-bytes-per-token {max_bytes_per_token}: --kv-cache-dtype {kv_cache_dtype} needs "
                             f"{least} bytes per token on this model with no layer at 16 bits; raise the bound")


def budget_skip_layers(sensitivity: list[float], kv_cache_dtype: str, num_layers: int, num_kv_heads: int,
                       head_dim: int, *, max_skip: int | None = None,
                       max_bytes_per_token: int | None = None, shares=None) -> list[int]:
    """The 16-bit layers ``--skip-layers auto`` deploys under a budget: :func:`choose_skip_layers` with
    :func:`skip_costs`, vLLM's own boundary layers forced in, ``max_skip`` as the count bound and
    ``max_bytes_per_token`` (KV bytes per token, all layers, as
    :func:`kvcal.formats.memory.vllm_bytes_per_token` counts them) turned into the extra-bytes bound
    ``B - Σ quantized slots``. The count is also bounded by ``num_layers - 1`` (:func:`skip_count_range`): a
    byte bound at or above the 16-bit cache's size, or an unbounded ``max_skip``, still leaves the least
    sensitive layer in the dtype (every layer at 16 bits would store nothing in it). ``sensitivity``: per-layer
    KL (nats) of :func:`kvcal.evaluate.vllm_probe.layer_sensitivity`. Sorted layer indices. Raises
    ``ValueError`` when the forced layers alone exceed a bound or cover every layer (:func:`check_skip_layers`
    refuses both before the model loads). ``shares`` (sliding-window models,
    :func:`kvcal.formats.memory.vllm_token_shares`): costs and the bound are bytes per token averaged over the
    context the shares were taken at."""
    from kvcal.formats.vllm_dtypes import boundary_skip_layers

    na = not_applicable(kv_cache_dtype, num_layers)
    if na:
        raise ValueError(na)
    hi = skip_count_range(kv_cache_dtype, num_layers)[1]
    max_skip = hi if max_skip is None else min(max_skip, hi)
    costs = skip_costs(kv_cache_dtype, num_layers, num_kv_heads, head_dim, shares)
    extra = None
    if max_bytes_per_token is not None:
        base = _quantized_bytes(kv_cache_dtype, num_layers, num_kv_heads, head_dim, shares)
        extra = max_bytes_per_token - base
        if extra < 0:
            raise ValueError(f"{max_bytes_per_token} bytes per token is below {base}, the dtype with no 16-bit layer")
    return choose_skip_layers(sensitivity, costs, max_skip=max_skip, max_extra_bytes=extra,
                              forced=boundary_skip_layers(kv_cache_dtype, num_layers))


def serve_skip_arg(skip_layers) -> str:
    """The ``vllm serve`` argument for ``skip_layers`` (``" --kv-cache-dtype-skip-layers 0 1 29"``, or ``""``
    for none): vLLM 0.33 parses the option as a ``list[str]`` with ``nargs="+"`` (``engine/arg_utils.py``)
    and compares each item with ``str(layer_index)`` (``attention.py``), so the indices are separated by
    spaces — a comma-separated ``0,1`` would be one item that matches no layer."""
    skip = " ".join(str(int(i)) for i in skip_layers)
    return f" --kv-cache-dtype-skip-layers {skip}" if skip else ""


__all__ = ["rule_skip_layers", "skip_count_range", "not_applicable", "skip_costs", "probe_plans",
           "choose_skip_layers", "parse_skip_layers", "check_skip_options", "check_skip_layers", "budget_skip_layers",
           "serve_skip_arg"]
