"""Which layers to keep in the model dtype: the exact 0/1 knapsack over per-layer sensitivities, and the
``--skip-layers`` option (torch only; engine-agnostic).

An engine that keeps chosen layers of a quantized cache at 16 bits (vLLM's ``--kv-cache-dtype-skip-layers``) is
asked which: ``s_l`` = model-level mean ``KL(P_16bit ‖ P_l)`` in nats over held-out tokens when only layer ``l``
goes through the dtype (the engine's probe, e.g. :func:`kvcal.engines.vllm.probe.layer_sensitivity`). Keeping layer
``l`` at 16 bits is scored as removing ``s_l`` from the all-layers KL (the additive model HAWQ/KVTuner use; on the
embedded model single-side KLs add up to the all-sides KL within ~10%, see :func:`kvcal.evaluate.side_sensitivity`).

The choice (:func:`choose_skip_layers`) is then an exact 0/1 knapsack: maximise ``Σ s_l`` over the skipped set
subject to a count bound (``--max-skip N``) and/or an extra-bytes bound (from ``--max-bytes-per-token B``), with the
layers the engine adds on its own forced in. Ties go to fewer layers, then lower indices, so the result is
deterministic. The costs, the forced layers and the checks against a model are the engine's
(:mod:`kvcal.engines.vllm.skip_layers`); :func:`parse_skip_layers` and :func:`check_skip_options` read the options.
"""

from __future__ import annotations

from math import gcd


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


__all__ = ["choose_skip_layers", "parse_skip_layers", "check_skip_options"]
