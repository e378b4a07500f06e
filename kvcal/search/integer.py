"""Integer KV plans from a capture: fixed presets, or per-layer formats allocated under ``--bits``.

Per layer and side the parameters come from :func:`kvcal.search.optimizer.search_side`; with a bit
budget the formats come from :func:`kvcal.search.allocate.allocate` over the measured (optionally
model-KL-weighted) held-out errors; the sink count is chosen on held-out data. Why each design
choice: ``docs/design.md``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from kvcal.capture.run import CaptureResult
from kvcal.errors import KvcalError
from kvcal.formats.variants import Codebook, SideVariant
from kvcal.search.objectives import sequence_caches
from kvcal.search.result import ERROR_DATA, SearchResult

#: Sink-token counts ``search_int`` chooses from when ``sinks`` is not given: none, the first token
#: (the BOS / attention-sink position), or StreamingLLM's four initial tokens (Xiao et al., "Efficient
#: Streaming Language Models with Attention Sinks", ICLR 2024). Each costs ``2·L·H·D`` 16-bit values
#: (counted in the average bits); at 4096 tokens four sinks add about 0.009 bit to an int4 cache.
SINK_CANDIDATES = (0, 1, 4)


def _reference_index(menu: tuple, side: str) -> tuple[int, bool]:
    """``(index, fallback)`` in ``menu`` of the sensitivity probe's reference choice: the ``int4``
    preset's side when the menu has it; else (``fallback=True``, e.g. no RoPE table, so no pre-RoPE
    entries) the entry with the same spec without its transform / rounding, else the first 4-bit
    entry, else the first entry."""
    from kvcal.search.presets import ALLOC_REFERENCE

    ref = ALLOC_REFERENCE[side]
    if ref in menu:
        return menu.index(ref), False
    same = [i for i, c in enumerate(menu) if c.spec == ref.spec]
    if same:
        return same[-1], True
    return next((i for i, c in enumerate(menu) if c.spec.bits == 4), 0), True


def _probe_weights(kl: dict, items: list, ref_idx: dict, log) -> tuple[dict, dict]:
    """Per (layer, side) weight ``KL / error(reference)`` from the probe's KLs (nats).

    KLs at or below a floor of 1e-3 × the mean positive KL (below what the probe resolves, e.g. a
    side whose quantized tokens no probed position reads) are raised to it and listed. Raises
    :class:`KvcalError` for missing / non-finite values or a probe that measured nothing."""
    keys = [(it.layer, it.side) for it in items]
    bad = [k for k in keys if k not in kl or not math.isfinite(float(kl[k]))]
    if bad:
        raise KvcalError(f"the sensitivity probe returned no finite KL for {len(bad)} (layer, side) pairs (first: "
                         f"layer {bad[0][0]} {bad[0][1].upper()}) — the model's logits overflow or are -inf on the probe "
                         "samples; use other held-out samples or --probe-tokens 0 (no probe)")
    pos = [float(kl[k]) for k in keys if float(kl[k]) > 0]
    if not pos:
        raise KvcalError("the sensitivity probe measured no effect of any layer (every KL <= 0): the probe samples are "
                         "too short to read a quantized token; raise --probe-tokens / --max-seq-len or use --probe-tokens 0")
    floor = 1e-3 * sum(pos) / len(pos)
    floored = [k for k in keys if float(kl[k]) < floor]
    if floored:
        log(f"sensitivity probe: {len(floored)} (layer, side) pairs below its resolution, weighted at the floor "
            f"{floor:.3g} nats")
    weights = {}
    for it in items:
        k = (it.layer, it.side)
        v = max(float(kl[k]), floor)
        weights[k] = (v / max(it.errors[ref_idx[it.side]], 1e-12), float(kl[k]))
    return weights, {"floor_nats": floor, "floored": [f"{layer}{side.upper()}" for layer, side in floored]}


def search_int(cap: CaptureResult, *, preset: str | None = None, bits: float | None = None, sinks: int | None = None,
               residual_window: int = 0, key_centering: str = "auto", objective_k: str = "kl",
               max_queries: int = 128, budget_context: int = 4096, progress: bool = True,
               cache: dict | None = None, log: Callable[[str], None] = lambda s: None,
               rope=None, probe: Callable | None = None, sink_probe: Callable | None = None) -> SearchResult:
    """Integer KV plan from a capture: fixed ``preset`` specs, or per-layer specs under ``bits``.

    Per layer and side the parameters come from :func:`kvcal.search.optimizer.search_side`
    (clip ratios / static ranges / centering, guarded on held-out). With ``bits``, every menu spec
    (:data:`kvcal.search.presets.ALLOC_MENU`) is first searched on a coarse grid to measure its
    held-out attention-output error, :func:`kvcal.search.allocate.allocate` picks per-layer specs
    under the exact byte budget at ``budget_context`` tokens, and the chosen specs are refined.
    ``sinks``: ``None`` searches with 1 sink token and then keeps the count in
    :data:`SINK_CANDIDATES` (0, 1 or 4 first tokens in 16 bits) with the lowest held-out
    model-level KL when ``sink_probe`` is given — a callable taking ``{count: KVPlan}`` and
    returning ``{count: KL in nats}`` (:func:`kvcal.evaluate.plans_kl` on held-out samples) —, else
    with the lowest summed held-out attention-output error (ties: fewer sinks; ``--bits`` budgets
    count the largest, so any choice fits). The attention-level sum is recorded either way (why the
    model is asked when one is at hand: ``docs/design.md``, "Sink count"). ``cache``: dict reused across calls on the same capture (benchmarks).
    ``rope``: the model's :class:`~kvcal.formats.transforms.RopeTable` (every layer) or a list of one per
    layer (:func:`kvcal.models.rope_tables`; default ``cap.rope``), needed by pre-RoPE key choices (``int4``, ``int2``, ``k4v2`` presets; with
    ``bits`` the pre-RoPE menu entries are skipped when it is ``None``).
    ``probe`` (with ``bits``): a callable taking a :class:`~kvcal.plan.KVPlan` and returning the
    model-level KL (nats) of quantizing each ``(layer, side)`` alone with it
    (:func:`kvcal.evaluate.side_sensitivity` on held-out samples). It is called once with the
    reference plan (every side at its ``int4``-preset choice, :data:`~kvcal.search.presets.ALLOC_REFERENCE`),
    and each (layer, side)'s attention-level errors are multiplied by ``KL / error(reference)``, so
    the allocation minimizes an estimate of the model-level KL instead of the sum of layer errors
    (``docs/design.md``, "Bit allocation"). Raises
    :class:`KvcalError` for an infeasible budget or a pre-RoPE preset without ``rope``.
    """
    from tqdm.auto import tqdm

    from kvcal.formats.memory import cache_bytes, side_extra_bytes
    from kvcal.plan import KVPlan, LayerPlan
    from kvcal.search import allocate as al
    from kvcal.search.optimizer import search_side, side_error
    from kvcal.search.presets import ALLOC_MENU, INT_PRESETS, NEEDS_ROPE, SideChoice, spec_label

    cache = {} if cache is None else cache
    L = len(cap.stats.k)
    windows = [int(cap.windows.get(i, 0)) for i in range(L)]  # sliding windows (0: full attention)
    rope = rope if rope is not None else cap.rope
    if rope is not None and not isinstance(rope, (list, tuple)):  # one table for every layer
        rope = [rope] * L
    H, D = cap.stats.k[0].num_heads, cap.stats.k[0].head_dim
    s_try = 1 if sinks is None else sinks
    s_cost = max(SINK_CANDIDATES) if sinks is None else sinks  # sink tokens the --bits costs count
    obj = {"k": objective_k, "v": "out"}

    def caches(layer):
        key = ("caches", layer, max_queries)
        if key not in cache:
            cache[key] = (sequence_caches(cap.calib, layer, cap.scaling[layer], max_queries,
                          cap.windows.get(layer, 0)),
                          sequence_caches(cap.heldout, layer, cap.scaling[layer], max_queries,
                          cap.windows.get(layer, 0)) if cap.heldout.items else [])
        return cache[key]

    def run(layer, side, choice: SideChoice, refine):
        key = ("search", layer, side, choice, refine, s_try, key_centering, obj[side], max_queries)
        if key not in cache:
            cal, held = caches(layer)
            st = getattr(cap.sink_stats if cap.sink_stats is not None else cap.stats, side)[layer].finalize()
            cache[key] = search_side(cal, held, side, choice, stats=st, sinks=s_try, objective=obj[side],
                                     centering=key_centering if side == "k" else "off", refine=refine,
                                     rope=rope[layer] if choice.transform in NEEDS_ROPE else None)
        return cache[key]

    menu = {s: tuple(c for c in ALLOC_MENU[s] if rope is not None or c.transform not in NEEDS_ROPE)
            for s in ("k", "v")}
    if bits is None and rope is None and any(c.transform in NEEDS_ROPE for c in INT_PRESETS[preset]):
        raise KvcalError(f"preset {preset} quantizes keys pre-RoPE and needs the model's RoPE table (rope=)")

    t0 = time.perf_counter()
    alloc_meta = None
    if bits is not None:
        items = []
        for layer in tqdm(range(L), desc="sensitivity", disable=not progress):
            for side in ("k", "v"):
                rs = [run(layer, side, c, False) for c in menu[side]]
                costs = tuple(al.side_cost(c.spec, H, D, budget_context, s_cost, residual_window,
                                           side_extra_bytes(c.spec, H, D, r.plan.variant),
                                           sliding_window=windows[layer])
                              for c, r in zip(menu[side], rs, strict=True))
                items.append(al.Item(layer, side, tuple(c.spec for c in menu[side]), costs,
                                     tuple(r.heldout_out for r in rs)))
        weights = probe_meta = None
        if probe is not None:
            refs = {s: _reference_index(menu[s], s) for s in ("k", "v")}
            ref_idx = {s: refs[s][0] for s in ("k", "v")}
            ref_plan = KVPlan([LayerPlan(run(layer, "k", menu["k"][ref_idx["k"]], False).plan,
                                         run(layer, "v", menu["v"][ref_idx["v"]], False).plan) for layer in range(L)],
                              sink_tokens=s_try)
            log("sensitivity probe: model-level KL of each layer's K and V alone at "
                + ", ".join(spec_label(menu[s][ref_idx[s]]) + (" (fallback: the int4 preset's choice is not in the "
                                                               "menu)" if refs[s][1] else "") for s in ("k", "v")))
            weights, probe_meta = _probe_weights(probe(ref_plan), items, ref_idx, log)
            probe_meta.update(getattr(probe, "meta", {}))
            items = [al.Item(it.layer, it.side, it.specs, it.costs,
                             tuple(weights[(it.layer, it.side)][0] * e for e in it.errors)) for it in items]
        budget = al.budget_bytes(bits, L, H, D, budget_context, windows)
        _check_bits_feasible(bits, sum(min(it.costs) for it in items), L, H, D, budget_context, s_cost, windows)
        try:
            choice = al.allocate(items, budget)
        except ValueError as e:
            raise KvcalError(f"--bits {bits}: {e}") from None
        chosen: list[dict[str, SideChoice]] = [{} for _ in range(L)]  # per layer: side -> choice
        for it, j in zip(items, choice, strict=True):
            chosen[it.layer][it.side] = menu[it.side][j]
        alloc_meta = {"budget_bits": bits, "budget_context": budget_context, "budget_bytes": float(budget),
                      "sensitivity": ("held-out relative attention-output error per (layer, side, spec)"
                                      + ("" if weights is None else " × model-level KL of that (layer, side) alone "
                                         "at the reference spec / its error at the reference spec (nats)")),
                      "menu": {s: [spec_label(c) for c in menu[s]] for s in ("k", "v")},
                      "table": [{"layer": it.layer, "side": it.side, "errors": [float(e) for e in it.errors],
                                 "bytes": list(it.costs), "chosen": spec_label(menu[it.side][j]),
                                 **({} if weights is None else {"probe_kl": weights[(it.layer, it.side)][1],
                                                                "weight": weights[(it.layer, it.side)][0]})}
                                for it, j in zip(items, choice, strict=True)]}
        if weights is not None:
            alloc_meta["reference"] = {s: spec_label(menu[s][ref_idx[s]]) for s in ("k", "v")}
            alloc_meta["probe"] = probe_meta
    else:
        pair = INT_PRESETS[preset]
        chosen = [{"k": pair.k, "v": pair.v} for _ in range(L)]
    results = []
    for layer in tqdm(range(L), desc="search", disable=not progress):
        results.append({side: run(layer, side, chosen[layer][side], True) for side in ("k", "v")})
        for side in ("k", "v"):
            results[-1][side].extra["transform"] = chosen[layer][side].transform.value
    # sinks: the count with the lowest summed held-out output error (ties: fewer)
    word = "held-out" if cap.heldout.items else "calibration-data"  # no held-out split: say what was measured
    sink_meta = {"tried": list(SINK_CANDIDATES) if sinks is None else [s_try]}
    final_sinks = s_try
    if sinks is None:
        tot = dict.fromkeys(SINK_CANDIDATES, 0.0)
        for layer, r in enumerate(results):
            cal, held = caches(layer)
            for side in ("k", "v"):
                for n in SINK_CANDIDATES:
                    a, b = side_error(held or cal, side, r[side].plan, "out", n)
                    tot[n] += float(a.sum() / b.sum())
        sink_meta["heldout_out_sum"] = {str(n): tot[n] for n in SINK_CANDIDATES}
        if sink_probe is None:
            final_sinks = min(SINK_CANDIDATES, key=lambda n: (tot[n], n))
            sink_meta["chosen_by"] = f"{word} attention-output error (summed over layers and sides)"
        else:
            kl = sink_probe({n: KVPlan([LayerPlan(r["k"].plan, r["v"].plan) for r in results],
                                       residual_window=residual_window, sink_tokens=n) for n in SINK_CANDIDATES})
            bad = [n for n in SINK_CANDIDATES if n not in kl or not math.isfinite(float(kl[n])) or float(kl[n]) < -1e-9]
            if bad:
                raise KvcalError(f"the sink probe returned no finite, non-negative KL for {bad[0]} sink tokens (the "
                                 "model's logits overflow on the probe samples); use other held-out samples, "
                                 "--sinks N, or --probe-tokens 0")
            final_sinks = min(SINK_CANDIDATES, key=lambda n: (float(kl[n]), n))
            sink_meta["heldout_model_kl"] = {str(n): float(kl[n]) for n in SINK_CANDIDATES}
            sink_meta["chosen_by"] = f"{word} model-level KL (nats/token)"
            sink_meta.update(getattr(sink_probe, "meta", {}))
            log(f"sink tokens by {word} model KL: " + ", ".join(f"{n}: {float(kl[n]):.4e}" for n in SINK_CANDIDATES)
                + f" nats -> {final_sinks}")
    sink_meta["kept"] = final_sinks
    plan = KVPlan([LayerPlan(r["k"].plan, r["v"].plan) for r in results], residual_window=residual_window,
                  sink_tokens=final_sinks)
    shape = {"num_hidden_layers": L, "num_key_value_heads": H, "head_dim": D, "num_attention_heads": H}
    if any(windows):  # sliding-window layers (Gemma 3) hold at most W - 1 tokens: count what the cache holds
        shape.update(layer_types=["sliding_attention" if w else "full_attention" for w in windows],
                     sliding_window=max(windows))
        if len({w for w in windows if w}) > 1:
            raise KvcalError(f"layers with different sliding windows {sorted({w for w in windows if w})}: kvcal's "
                             "memory accounting supports one window size")
    total = cache_bytes(shape, [plan.kv_config(i) for i in range(L)], budget_context)
    avg = al.average_bits(total, L, H, D, budget_context, windows)
    if bits is not None:
        assert avg <= bits + 1e-12, (avg, bits)
    layers_meta = [{"layer": i, "k": r["k"].to_meta(), "v": r["v"].to_meta()} for i, r in enumerate(results)]
    summary = {
        "preset": preset if bits is None else None, "bits_budget": bits, "sinks": sink_meta,
        "average_bits": avg, "average_bits_context": budget_context, "cache_bytes_at_context": total,
        "key_bits_mean": sum(r["k"].spec.bits for r in results) / L,
        "value_bits_mean": sum(r["v"].spec.bits for r in results) / L,
        "centered_layers": [i for i, r in enumerate(results) if r["k"].plan.centered],
        "objective_k": obj["k"], "objective_v": "out", "search_seconds": round(time.perf_counter() - t0, 2),
        "heldout": {s: {"chosen": sum(r[s].heldout for r in results) / L,
                        "minmax": sum(r[s].heldout_minmax for r in results) / L} for s in ("k", "v")},
    }
    if alloc_meta is not None:
        summary["allocation"] = alloc_meta
    method = ("attention-aware integer search (clip ratios, static per-channel ranges, key centering, sinks, "
              "pre-RoPE / Hadamard transforms" + (", bit allocation" if bits is not None else "") + ")")
    selection = ("coarse grid + scipy bounded refinement per KV head on the calibration split (errors summed over "
                 f"all sequences), then the lower {ERROR_DATA} of {{chosen, plain min/max}}")
    return SearchResult(plan, layers_meta, summary, method=method, selection=selection)


def _check_bits_feasible(bits: float, cheapest: int, L: int, H: int, D: int, context: int, sinks: int,
                         windows=None) -> None:
    """Raise :class:`KvcalError` naming the smallest feasible ``--bits`` when ``cheapest`` (bytes of
    the cheapest menu choice of every layer's K and V at ``context`` tokens, batch 1, ``sinks``
    16-bit sink tokens counted) exceeds the ``bits`` budget."""
    from kvcal.search import allocate as al

    if cheapest > al.budget_bytes(bits, L, H, D, context, windows):
        avg = al.average_bits(cheapest, L, H, D, context, windows)
        if avg > 16.0:  # no allowed --bits can fit: the 16-bit tokens alone exceed the context's budget
            raise KvcalError(f"--bits {bits}: the cheapest plan needs {avg:.4f} bits per element at --budget-context "
                             f"{context} tokens, above any allowed --bits (2-16): the 16-bit sink tokens ({sinks}) and "
                             "residual window take most of that context; lower --residual-window / --sinks or raise "
                             "--budget-context")
        raise KvcalError(f"--bits {bits}: even the cheapest choice for every layer needs {avg:.4f} bits per "
                         f"element at {context} tokens (payload, scales, tables and {sinks} 16-bit sink tokens); "
                         f"raise --bits to at least {math.ceil(avg * 100) / 100:.2f}")


def bits_precheck(bits: float, config, context: int, sinks: int | None, residual_window: int) -> None:
    """Refuse an infeasible ``--bits`` from the model's config alone, before any weight loads or
    capture runs (the allocation itself comes after a capture, a search and a sensitivity probe).

    Lower bound of the cheapest plan: every layer's K and V at the cheapest
    :data:`~kvcal.search.presets.ALLOC_MENU` entry, without key centering (which only adds bytes),
    with the sink tokens the allocation counts (``--sinks``, else ``max(SINK_CANDIDATES)``), at
    ``context`` tokens, batch 1. ``config``: a transformers config. Raises :class:`KvcalError`
    (as the allocation would) when even that exceeds the budget."""
    from kvcal.formats.memory import model_shape, side_extra_bytes
    from kvcal.search import allocate as al
    from kvcal.search.presets import ALLOC_MENU

    try:
        shape = model_shape(config.get_text_config() if hasattr(config, "get_text_config") else config)
    except ValueError as e:
        raise KvcalError(str(e)) from None
    L, H, D = shape.num_layers, shape.num_kv_heads, shape.head_dim
    s_cost = max(SINK_CANDIDATES) if sinks is None else sinks
    cheapest = L * sum(
        min(al.side_cost(c.spec, H, D, context, s_cost, residual_window,
                         side_extra_bytes(c.spec, H, D, _levels_variant(c)))
            for c in ALLOC_MENU[side])
        for side in ("k", "v"))
    _check_bits_feasible(bits, cheapest, L, H, D, context, s_cost)


def _levels_variant(c) -> SideVariant:
    """A menu choice's variant with a trellis codebook counted as its levels table (a trellis choice fits
    levels first and keeps them where the trellis table measures worse; the precheck's lower bound)."""
    v = c.variant
    if v.codebook is Codebook.TRELLIS:
        return SideVariant(Codebook.LEVELS, v.rounding, v.channel_widths)
    return v
