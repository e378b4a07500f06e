"""Capacity on sliding-window layers with token-group keys: the cache's bytes rise and fall with the group
phase, so `kvcal plan` plans with the peak on the way (`peak_cache_bytes`), checked against a brute-force
running maximum of `cache_bytes` over every position."""

from __future__ import annotations

import itertools

import pytest

from kvcal.capacity import max_batch, max_context
from kvcal.formats.memory import ModelShape, cache_bytes, peak_cache_bytes
from kvcal.formats.spec import preset

#: a small Gemma-3-like shape: 6 layers, every 3rd global, the rest a 40-token window; 1 KV head x 32
SMALL = ModelShape(6, 1, 32, 4096, tuple(0 if (i + 1) % 3 == 0 else 40 for i in range(6)))
#: Gemma 3 270M: 18 layers, every 6th global, the others sliding window 512; 1 KV head x 256
GEMMA = ModelShape(18, 1, 256, 32768, tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(18)))


def running_max(shape, kv, n, batch=1):
    return list(itertools.accumulate((cache_bytes(shape, kv, t, batch) for t in range(n)), max))


@pytest.mark.parametrize("name", ["kivi4", "kivi2", "int8", "fp8", "bf16"])
def test_peak_equals_brute_force_running_maximum(name):
    """For every position up to 400 (ten 32-token group periods past the 40-token window) the peak equals
    max(cache_bytes(t') for t' <= t), bytes compared exactly (integers)."""
    kv = preset(name)
    ref = running_max(SMALL, kv, 401)
    for t in range(401):
        assert peak_cache_bytes(SMALL, kv, t)[0] == ref[t], (name, t)
        b, at = peak_cache_bytes(SMALL, kv, t)
        assert cache_bytes(SMALL, kv, at) == b and at <= t


def test_kivi_on_sliding_layers_is_not_monotone_and_the_plan_uses_the_peak():
    """KIVI keys hold whole token groups past the window, so the bytes fall when a group leaves: the plain
    bytes-at-T curve has drops, a binary search on it can answer a context whose prefix does not fit; the
    planned max context is the brute-force largest T with running maximum <= budget."""
    kv = preset("kivi4")
    curve = [cache_bytes(SMALL, kv, t) for t in range(400)]
    assert any(b < a for a, b in itertools.pairwise(curve))
    ref = running_max(SMALL, kv, 400)
    for budget in sorted(set(curve[100:400:7])):
        want = max(t for t in range(400) if ref[t] <= budget)
        if want < 399:
            assert max_context(SMALL, kv, 1, budget) == want, budget
    # a budget between the bytes at T and the peak before T: T's own bytes fit, the sequence does not
    t = next(t for t in range(60, 400) if curve[t] < ref[t])
    assert max_context(SMALL, kv, 1, curve[t]) < t


def test_max_batch_uses_the_peak():
    """B sequences growing to the context: bytes are linear in B at every position, so the peak of B
    sequences is B x per-sequence peak + static; checked against the running maximum at batch B."""
    kv = preset("kivi4")
    ctx = next(t for t in range(60, 400) if cache_bytes(SMALL, kv, t) < running_max(SMALL, kv, t + 1)[t])
    for budget in (10**5, 3 * 10**5, 10**6):
        want = max((b for b in range(1, 200) if running_max(SMALL, kv, ctx + 1, b)[ctx] <= budget), default=0)
        assert max_batch(SMALL, kv, ctx, budget) == want


def test_gemma_kivi4_peak_at_32k_by_hand_bound():
    """Gemma 3 270M, kivi4 at 32,768 tokens: the peak exceeds the bytes at 32,768 and by less than what 15
    sliding layers' keys hold in g - 1 = 31 extra tokens (payload + per-group scales), bounded by 16-bit
    storage of those tokens: 15 x 31 x 256 x 2 bytes."""
    kv = preset("kivi4")
    b, at = peak_cache_bytes(GEMMA, kv, 32768)
    end = cache_bytes(GEMMA, kv, 32768)
    assert end < b <= end + 15 * 31 * 256 * 2 and at < 32768
    assert peak_cache_bytes(GEMMA, preset("fp8"), 32768) == (cache_bytes(GEMMA, preset("fp8"), 32768), 32768)


def test_memory_command_prints_the_peak(tmp_path):
    """`kvcal memory --json` on a config.json of SMALL's shape reports the peak bytes and position equal to the
    brute-force running maximum; the bytes at the context stay the plain `cache_bytes`."""
    import json

    from click.testing import CliRunner

    from kvcal.cli import main

    cfg = {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 6,
           "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "hidden_size": 64,
           "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 4096, "sliding_window": 40,
           "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    kv = preset("kivi4")
    ctx = next(t for t in range(60, 400) if cache_bytes(SMALL, kv, t) < running_max(SMALL, kv, t + 1)[t])
    r = CliRunner().invoke(main, ["memory", "--model", str(tmp_path / "config.json"), "--format", "kivi4",
                                  "--context", str(ctx), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    ref = running_max(SMALL, kv, ctx + 1)
    assert doc["peak"]["bytes"] == ref[ctx] and doc["bytes"]["total"] == cache_bytes(SMALL, kv, ctx)
    assert cache_bytes(SMALL, kv, doc["peak"]["context"]) == ref[ctx]
    r = CliRunner().invoke(main, ["memory", "--model", str(tmp_path / "config.json"), "--format", "fp8",
                                  "--context", str(ctx), "--json"])
    assert r.exit_code == 0 and "peak" not in json.loads(r.output)
