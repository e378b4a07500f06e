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
