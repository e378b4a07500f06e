"""Which layers to keep in the model dtype under vLLM's ``--kv-cache-dtype-skip-layers`` (torch only): vLLM's own
rule, the costs and checks of the knapsack :func:`kvcal.search.skip_layers.choose_skip_layers` runs, the probe's plans
and the serve argument. Moved from :mod:`kvcal.search.skip_layers` (issue 41), which keeps the engine-agnostic
knapsack and option parsing.

vLLM 0.33 keeps the cache of the layers named in ``--kv-cache-dtype-skip-layers`` at 16 bits and, for the
turboquant presets on dense models, always adds the first 2 and last 2 attention layers on its own
(``engine/arg_utils.py``: ``kv_cache_dtype_skip_layers |= TurboQuantConfig.get_boundary_skip_layers``;
the union cannot be switched off from the command line). That rule is fixed; this module chooses the
layers from a measurement on the user's model and prompts instead.

The measurement (run by :func:`kvcal.engines.vllm.probe.layer_sensitivity`, which calls
:func:`kvcal.evaluate.plans_kl` on the plans :func:`probe_plans` builds): ``s_l`` = model-level mean
``KL(P_16bit ‖ P_l)`` in nats over held-out tokens when only layer ``l``'s K and V (and query, where vLLM
quantizes it) go through dtype ``D`` — Protocol A, one plan per layer. Keeping layer ``l`` at 16 bits is
scored as removing ``s_l`` from the all-layers KL (the additive model HAWQ/KVTuner use; on the embedded
model single-side KLs add up to the all-sides KL within ~10%, see :func:`kvcal.evaluate.side_sensitivity`).

The choice (:func:`kvcal.search.skip_layers.choose_skip_layers`) is then an exact 0/1 knapsack: maximise ``Σ s_l`` over the skipped
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

from kvcal.search.skip_layers import choose_skip_layers


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
    :func:`kvcal.engines.vllm.dtypes.layer_bytes_per_token` counts them. ``shares`` (a model with
    sliding-window layers: :func:`kvcal.engines.vllm.memory.vllm_token_shares`): each layer's extra bytes times the
    share of the context it holds, rounded up — a sliding layer at 16 bits costs little at long context.
    ``list[int]`` of length ``num_layers``."""
    import math

    from kvcal.engines.vllm.dtypes import layer_bytes_per_token

    q = layer_bytes_per_token(kv_cache_dtype, num_layers, num_kv_heads, head_dim, add_boundary=False)
    full = layer_bytes_per_token(kv_cache_dtype, num_layers, num_kv_heads, head_dim, range(num_layers),
                                 add_boundary=False)
    if shares is None:
        return [int(f - b) for f, b in zip(full, q, strict=True)]
    return [math.ceil((f - b) * w) for f, b, w in zip(full, q, shares, strict=True)]


def _quantized_bytes(kv_cache_dtype, num_layers, num_kv_heads, head_dim, shares=None) -> int:
    """Bytes per token of the dtype with no layer at 16 bits beyond vLLM's own (``shares``: weighted, rounded up)."""
    import math

    from kvcal.engines.vllm.dtypes import layer_bytes_per_token

    per = layer_bytes_per_token(kv_cache_dtype, num_layers, num_kv_heads, head_dim, add_boundary=False)
    return sum(per) if shares is None else math.ceil(sum(b * w for b, w in zip(per, shares, strict=True)))


def skip_count_range(kv_cache_dtype: str, num_layers: int) -> tuple[int, int]:
    """The numbers of 16-bit layers a vLLM deployment of ``kv_cache_dtype`` can have on a ``num_layers``-layer
    model: ``(lo, hi)`` with ``lo`` = the layers vLLM 0.33 keeps at 16 bits on its own
    (:func:`kvcal.engines.vllm.dtypes.boundary_skip_layers`: 4 for turboquant on 5+ layers, else 0) and
    ``hi = num_layers - 1`` — at least one layer stays in the dtype, else nothing is stored in it (the 16-bit
    cache under the dtype's name, with its bytes). ``lo > hi`` when the boundary alone covers every layer
    (:func:`not_applicable`)."""
    from kvcal.engines.vllm.dtypes import boundary_skip_layers

    return len(boundary_skip_layers(kv_cache_dtype, num_layers)), num_layers - 1


def not_applicable(kv_cache_dtype: str, num_layers: int) -> str | None:
    """Why ``kv_cache_dtype`` has no meaningful vLLM deployment on a ``num_layers``-layer model, or ``None``:
    vLLM 0.33 adds the first and last ``min(2, L // 2)`` layers of a turboquant dtype to
    ``--kv-cache-dtype-skip-layers`` on its own (``TurboQuantConfig.get_boundary_skip_layers``, unioned in
    ``engine/arg_utils.py``), which covers every layer of a 2- or 4-layer model: nothing would be stored in
    the dtype. One line (no trailing period)."""
    from kvcal.engines.vllm.dtypes import boundary_skip_layers

    forced = boundary_skip_layers(kv_cache_dtype, num_layers)
    if num_layers < 1 or len(forced) < num_layers:
        return None
    return (f"vLLM 0.33 keeps every layer ({', '.join(map(str, forced))}) of this {num_layers}-layer model at 16 bits "
            f"for {kv_cache_dtype} on its own (first and last min(2, L//2) layers, "
            "TurboQuantConfig.get_boundary_skip_layers): nothing would be stored in it")


def probe_plans(kv_cache_dtype: str, num_layers: int, **scales) -> dict:
    """``{l: plan}`` with one :class:`~kvcal.engines.vllm.plan.VllmKVPlan` per layer ``l`` that quantizes only
    layer ``l`` (every other layer skipped, no boundary rule) — the plans whose model-level KL is the
    sensitivity ``s_l``. ``scales``: ``k_scales``/``v_scales``/``q_scales`` as VllmKVPlan takes them."""
    from kvcal.engines.vllm.plan import VllmKVPlan

    return {layer: VllmKVPlan(kv_cache_dtype, num_layers, skip_layers=tuple(i for i in range(num_layers) if i != layer),
                              add_boundary=False, **scales)
            for layer in range(num_layers)}


def check_skip_layers(skip_layers, kv_cache_dtype: str, num_layers: int, num_kv_heads: int, head_dim: int,
                      max_skip: int | None = None, max_bytes_per_token: int | None = None, shares=None) -> None:
    """The checks that need the model's shape (before it loads): the dtype has a deployment on the model
    (:func:`not_applicable`); an explicit list inside ``[0, num_layers)`` that leaves at least one layer
    (after vLLM's own boundary layers) in the dtype; for ``auto``, a ``--max-skip`` inside
    :func:`skip_count_range` (not below the layers vLLM skips on its own, at most ``num_layers - 1``) and a
    ``--max-bytes-per-token`` that the dtype can meet with only the layers vLLM skips on its own. Raises
    :class:`~kvcal.errors.KvcalError`."""
    import math

    from kvcal.engines.vllm.dtypes import boundary_skip_layers, layer_bytes_per_token
    from kvcal.errors import KvcalError

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
    :func:`kvcal.engines.vllm.memory.vllm_bytes_per_token` counts them) turned into the extra-bytes bound
    ``B - Σ quantized slots``. The count is also bounded by ``num_layers - 1`` (:func:`skip_count_range`): a
    byte bound at or above the 16-bit cache's size, or an unbounded ``max_skip``, still leaves the least
    sensitive layer in the dtype (every layer at 16 bits would store nothing in it). ``sensitivity``: per-layer
    KL (nats) of :func:`kvcal.engines.vllm.probe.layer_sensitivity`. Sorted layer indices. Raises
    ``ValueError`` when the forced layers alone exceed a bound or cover every layer (:func:`check_skip_layers`
    refuses both before the model loads). ``shares`` (sliding-window models,
    :func:`kvcal.engines.vllm.memory.vllm_token_shares`): costs and the bound are bytes per token averaged over the
    context the shares were taken at."""
    from kvcal.engines.vllm.dtypes import boundary_skip_layers

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


__all__ = ["rule_skip_layers", "skip_count_range", "not_applicable", "skip_costs", "probe_plans", "check_skip_layers",
           "budget_skip_layers", "serve_skip_arg"]
