"""Helpers shared by the plan-variant tests (log8 scales, trellis tables, ...); ``tests/formats`` is on
pytest's ``pythonpath`` (pyproject), so test modules import this by name."""

from __future__ import annotations

import torch

from kvcal.plan import KVPlan


def artifact_round_trip(plan: KVPlan, num_kv_heads: int, head_dim: int) -> tuple[dict[str, torch.Tensor], dict]:
    """``plan`` -> artifact tensors + metadata -> :meth:`KVPlan.from_artifact`, checked: the reloaded plan
    fake-quantizes a random ``[1, num_kv_heads, 12, head_dim]`` float32 input exactly as ``plan`` does, for
    every layer and side (same tensors, same arithmetic: exact equality). Returns ``(tensors, metadata)``
    for the caller's refusal checks on altered copies."""
    meta = {"model": {"num_layers": plan.num_layers, "num_kv_heads": num_kv_heads, "head_dim": head_dim},
            "kv": plan.kv_metadata()}
    tensors = plan.to_tensors()
    back = KVPlan.from_artifact(tensors, meta)
    x = torch.randn(1, num_kv_heads, 12, head_dim, generator=torch.Generator().manual_seed(0))
    for i in range(plan.num_layers):
        for side in ("k", "v"):
            assert torch.equal(back.fake_quant(i, side, x), plan.fake_quant(i, side, x)), (i, side)
    return tensors, meta


def assert_refused(tensors: dict[str, torch.Tensor], metadata: dict, match: str, name: str,
                   value: torch.Tensor | None) -> None:
    """A copy of artifact ``tensors`` with tensor ``name`` set to ``value`` (``None``: removed) is refused by
    :meth:`KVPlan.from_artifact` with a ``ValueError`` whose message matches the regex ``match``."""
    import pytest

    bad = dict(tensors)
    if value is None:
        del bad[name]
    else:
        bad[name] = value
    with pytest.raises(ValueError, match=match):
        KVPlan.from_artifact(bad, metadata)


def _reference_quantize(sp, raw: torch.Tensor, start: int):
    """:func:`kvcal.formats.quant.quantize` of raw keys/values ``raw [B, H, n, D]`` at positions ``start..``
    as the side plan ``sp`` defines them (its transform or key-centering mean, then its spec, clip ratio /
    static parameters and tables; a rounding matrix in its stored unit form) — built from the plan, not
    from the runtime cache."""
    from kvcal.formats.codes import unit_rounding
    from kvcal.formats.quant import quantize
    from kvcal.formats.transforms import apply_transform

    x = raw
    if sp.transform != "none":
        x = apply_transform(sp.transform, x, rope=sp.rope, start=start)
    elif sp.mean is not None:
        x = x - sp.mean.to(x.dtype)
    tables = sp.tables
    if tables.rounding is not None:
        tables = tables.replace(rounding=unit_rounding(torch.broadcast_to(sp.rounding.float(), (raw.shape[1],)
                                                                          + tuple(sp.rounding.shape[-2:]))))
    kw = {"clip_ratio": sp.clip_ratio} if sp.spec.dynamic else {"scale": sp.scale, "zero_point": sp.zero_point}
    return quantize(x, sp.spec, tables=tables, **kw)


def decode_stores_quantize_of_inputs(model, plan: KVPlan, ids: torch.Tensor, prefill: int, end: int) -> int:
    """Decode through the runtime cache and check what it stores at every step, exactly.

    Prefills ``ids[:, :prefill]`` into a :class:`~kvcal.runtime.QuantizedKVCache` (the plan's
    ``residual_window`` must be 0 and ``prefill`` > its sinks), then decodes ``ids[:, prefill:end]`` one
    token at a time. At each decode step, for every layer and side, the payload row the cache stored for
    the new token and the scale / zero point of its row or token group equal those of
    :func:`_reference_quantize` of the keys/values the model actually handed the cache (recorded from
    ``Cache.update``; for a per-channel token group, the group's tokens so far, prefill ones included):
    the same quantizer on the same inputs, so ``torch.equal``. Earlier members of an open token group are
    not compared: the cache re-quantizes them from their dequantized values when the group's range
    grows (one extra rounding, documented in :mod:`kvcal.runtime.cache`). Returns the number of
    (step, layer, side) comparisons made."""
    from kvcal.runtime import QuantizedKVCache

    assert plan.residual_window == 0 and prefill > plan.sink_tokens
    sinks, checked = plan.sink_tokens, 0
    raw: dict[tuple[int, str], list[torch.Tensor]] = {}
    cache = QuantizedKVCache(plan, model.config)
    decoding = False

    def check(i: int, s: str, side) -> None:
        sp = plan.layers[i].side(s)
        q = side.n_q - 1  # quantized slot of the token just written (no window: written at once)
        g = side.tg or 1
        g0 = q - q % g  # first slot of its token group (itself for per-token rows)
        tokens = torch.cat(raw[i, s], dim=2)[:, :, sinks + g0 : sinks + q + 1]  # [B,H,q-g0+1,D]
        ref = _reference_quantize(sp, tokens, start=sinks + g0)
        n = tokens.shape[2]  # the payload has one row per token (token groups pad S to whole groups)
        assert torch.equal(side.data[:, :, q], ref.data[:, :, n - 1]), (i, s, q)
        if sp.spec.dynamic:
            r = q // g
            assert torch.equal(side.scale[:, :, r], ref.scale[:, :, -1]), (i, s, q)
            if side.zp is not None:
                assert torch.equal(side.zp[:, :, r], ref.zero_point[:, :, -1]), (i, s, q)

    for i, layer in enumerate(cache.layers):
        def update(k, v, *args, _orig=layer.update, _i=i, _layer=layer, **kwargs):
            nonlocal checked
            raw.setdefault((_i, "k"), []).append(k.clone())
            raw.setdefault((_i, "v"), []).append(v.clone())
            out = _orig(k, v, *args, **kwargs)
            if decoding:
                for s in ("k", "v"):
                    if plan.layers[_i].side(s).spec.is_quantized:
                        check(_i, s, getattr(_layer, s))
                        checked += 1
            return out

        layer.update = update
    with torch.no_grad():
        model(ids[:, :prefill], cache=cache, use_cache=True)
        decoding = True
        for t in range(prefill, end):
            model(ids[:, t : t + 1], cache=cache, use_cache=True)
    assert checked == (end - prefill) * sum(sp.spec.is_quantized for lp in plan.layers for sp in (lp.k, lp.v))
    return checked
