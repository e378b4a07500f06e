"""Capture hooks on tiny random models of six architectures, and streaming statistics."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from kvcal.capture.hooks import attention_hook, attention_layers, capture_kv
from kvcal.capture.reservoir import SequenceReservoir
from kvcal.capture.stats import HIST_EDGES, LayerStats, TensorStats

ARCHS = {
    "llama": {},
    "mistral": {},
    "qwen2": {},  # QKV bias
    "phi3": {},
    "gemma": {"head_dim": 16},
    "gpt_neox": {"rotary_pct": 0.25},  # partial rotary
}


def tiny(model_type: str, **kw):
    cfg = AutoConfig.for_model(
        model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, **kw,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_capture_fires_every_layer_with_config_shapes_and_identical_logits(arch):
    """On a tiny model of each architecture, capture fires once per layer with q [B, H_q, S, D] and k, v [B,
    H_kv, S, D] from the config, leaves the logits bit-identical during and after capture, and restores
    sdpa."""
    m = tiny(arch, **ARCHS[arch])
    cfg = m.config
    ids = torch.randint(3, 128, (2, 17), generator=torch.Generator().manual_seed(1))
    fired = {}
    with torch.no_grad():
        ref = m(ids).logits
        with capture_kv(m, lambda i, q, k, v, mod: fired.setdefault(i, []).append((q.shape, k.shape, v.shape))):
            got = m(ids).logits
        after = m(ids).logits
    assert torch.equal(ref, got), "capture must not change logits"
    assert torch.equal(ref, after), "the original attention implementation must be restored"
    L = cfg.num_hidden_layers
    assert sorted(fired) == list(range(L))
    assert all(len(v) == 1 for v in fired.values())
    Hq = cfg.num_attention_heads
    Hkv = getattr(cfg, "num_key_value_heads", None) or Hq
    if arch == "gpt_neox":
        Hkv = Hq  # no GQA in GPT-NeoX
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // Hq
    for q, k, v in (x[0] for x in fired.values()):
        assert tuple(q) == (2, Hq, 17, D)
        assert tuple(k) == (2, Hkv, 17, D) and tuple(v) == (2, Hkv, 17, D)
    assert len(attention_layers(m)) == L
    assert m.config._attn_implementation == "sdpa"


def test_capture_sees_post_rope_keys():
    """The hook sees keys after RoPE: recompute k_proj + rotary by hand for layer 0."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    m = tiny("llama")
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(2))
    got = {}
    with torch.no_grad(), capture_kv(m, lambda i, q, k, v, mod: got.setdefault(i, (q, k))):
        m(ids)
    with torch.no_grad():
        h = m.model.layers[0].input_layernorm(m.model.embed_tokens(ids))
        attn = m.model.layers[0].self_attn
        k = attn.k_proj(h).view(1, 9, 2, 16).transpose(1, 2)
        q = attn.q_proj(h).view(1, 9, 4, 16).transpose(1, 2)
        cos, sin = m.model.rotary_emb(h, torch.arange(9)[None])
        q_rot, k_rot = apply_rotary_pos_emb(q, k, cos, sin)
    # the same modules on the same [1, 9] shapes: the hook's tensors are these, exactly
    assert torch.equal(got[0][1], k_rot) and torch.equal(got[0][0], q_rot)
    assert not torch.allclose(k, k_rot)


def test_hook_replacement_changes_attention_and_is_removed_on_error():
    """An attention hook that zeroes K changes the logits, and a hook that raises propagates its error and is
    removed (logits bit-identical to the unhooked model afterwards)."""
    m = tiny("llama")
    ids = torch.randint(3, 128, (1, 8))
    with torch.no_grad():
        ref = m(ids).logits
        with attention_hook(m, lambda mod, q, k, v, mask, kw: (k * 0, v)):
            changed = m(ids).logits
        assert not torch.equal(ref, changed)
        with pytest.raises(ZeroDivisionError), attention_hook(m, lambda *a: 1 / 0):
            m(ids)
        assert torch.equal(m(ids).logits, ref)


def test_nan_activation_names_the_layer():
    """A NaN in layer 1's k_proj weight makes capture raise FloatingPointError naming layer 1."""
    m = tiny("llama")
    with torch.no_grad():
        m.model.layers[1].self_attn.k_proj.weight[0, 0] = float("nan")
        with pytest.raises(FloatingPointError, match="layer 1"), capture_kv(m, lambda *a: None):
            m(torch.randint(3, 128, (1, 5)))


def _ref_stats(x: torch.Tensor, mask: torch.Tensor):
    """float64 reference over masked tokens: x [B,H,S,D], mask [B,S]."""
    xs = x.double().permute(1, 0, 2, 3)[:, mask]  # [H, N, D]
    return xs


def test_stats_chunked_merge_equals_one_pass_and_matches_float64():
    """TensorStats merged from three chunks equals one pass exactly for absmax/min/max/count/histogram and
    within a float64 summation-order bound (Higham) for sums; all match a float64 re-statement (mean, std
    within derived bounds, histogram by bucketize on HIST_EDGES) and survive a state_dict round trip."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3, 20, 8, generator=g) * torch.logspace(-3, 2, 8)
    mask = torch.rand(6, 20, generator=g) > 0.2
    one = TensorStats(3, 8)
    one.update(x, mask)
    parts = [TensorStats(3, 8) for _ in range(3)]
    for i, p in enumerate(parts):
        p.update(x[2 * i : 2 * i + 2], mask[2 * i : 2 * i + 2])
    merged = parts[0].merge(parts[1]).merge(parts[2])
    for f in ("absmax", "min", "max", "count", "hist"):
        assert torch.equal(getattr(one, f), getattr(merged, f)), f
    xs = _ref_stats(x, mask)  # [H, N, D] float64
    # sums accumulate in float64 (float32 accumulation would miss these bounds by ~10⁶): two orders of the
    # same N terms differ by ≤ 2·N·eps64·Σ|x| (Higham Thm 3.1, each within γ_N of the exact sum)
    eps64, n = torch.finfo(torch.float64).eps, xs.shape[1]
    sum_bound = 2 * n * eps64 * xs.abs().sum(1)
    assert bool(((one.sum - merged.sum).abs() <= sum_bound).all())
    assert torch.equal(one.absmax, xs.abs().amax(1))
    assert torch.equal(one.min, xs.amin(1)) and torch.equal(one.max, xs.amax(1))
    assert int(one.count) == int(mask.sum())
    assert bool(((one.sum - xs.sum(1)).abs() <= sum_bound).all())
    fin = one.finalize()
    ref_mean, ref_std = xs.mean(1), xs.std(1, unbiased=False)
    assert bool(((fin["mean"] - ref_mean).abs() <= sum_bound / n + 2 * eps64 * ref_mean.abs()).all())
    # var = Σx²/N − mean²: each term within ~(N+2)·eps64 of its size, so |Δvar| ≤ 2(N+2)·eps64·(Σx²/N + mean²)
    # and |Δstd| ≤ |Δvar| / std (≥ |Δvar| / (std + std'))
    dvar = 2 * (n + 2) * eps64 * ((xs * xs).mean(1) + ref_mean**2)
    assert bool(((fin["std"] - ref_std).abs() <= dvar / ref_std + eps64 * ref_std).all())
    # histogram equals bucketizing |x| on the documented edges
    a = xs.abs().reshape(3, -1)
    ref_h = torch.stack([torch.bucketize(r, HIST_EDGES[1:-1], right=True).bincount(minlength=one.hist.shape[1]) for r in a])
    assert torch.equal(one.hist, ref_h)
    rt = TensorStats.from_state_dict(one.state_dict())
    assert torch.equal(rt.hist, one.hist) and torch.equal(rt.absmax, one.absmax)


def test_padding_is_excluded_from_statistics():
    """A masked (padded) position of value 1000 does not reach absmax (stays 1.0) or the token count (3)."""
    x = torch.ones(1, 2, 4, 3)
    x[0, :, 3] = 1000.0  # a padded position
    s = TensorStats(2, 3)
    s.update(x, torch.tensor([[True, True, True, False]]))
    assert float(s.absmax.max()) == 1.0 and int(s.count) == 3


def test_layer_stats_state_dict_round_trip():
    """LayerStats restored from its state_dict keeps which layers fired and layer 1's K absmax exactly."""
    ls = LayerStats(2, 2, 4, 8)
    ls.update(1, torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8))
    rt = LayerStats.from_state_dict(ls.state_dict())
    assert torch.equal(rt.fired, torch.tensor([0, 1]))
    assert torch.equal(rt.k[1].absmax, ls.k[1].absmax)


def test_reservoir_is_bounded_order_independent_and_mergeable():
    """The sequence reservoir keeps exactly the cap lowest-priority samples (brute-force sorted by priority)
    whatever the arrival order, two merged shards equal one pass, another seed picks another set, and the mean
    of 10,000 priorities is within 0.01 (3.5 sd) of 0.5."""
    from kvcal.capture.reservoir import priority

    def run(order, seed=0, cap=4):
        r = SequenceReservoir(cap, 16, seed)
        for i in order:
            if r.offer(i):
                r.put(i, [i])
        return r

    a = run(range(100))
    assert len(a.sequences()) == 4
    # exactly the 4 lowest priorities, whatever the order samples arrive in
    expect = sorted(sorted(range(100), key=lambda i: priority(0, i))[:4])
    assert a.indices() == expect
    assert run(reversed(range(100))).indices() == expect
    # two shards merged == one pass (data-parallel ranks, resumed runs)
    merged = run(range(0, 100, 2)).merge(run(range(1, 100, 2)))
    assert merged.indices() == expect
    assert run(range(100), seed=1).indices() != expect
    # priorities are uniform-ish: the mean of 10k U(0,1) has sd 1/√(12·10⁴) = 0.0029, so 0.01 is 3.5 sd
    # (a hash: the same numbers on any machine); a priority stuck in half the range misses by 0.25
    assert abs(sum(priority(3, i) for i in range(10000)) / 10000 - 0.5) < 0.01
