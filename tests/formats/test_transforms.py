"""Transforms before quantizing: Hadamard and pre-RoPE keys, through plan, artifact, runtime cache, export."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.transforms import (
    K_SPEC,
    V_SPEC,
    D,
    H,
    L,
    decode_and_protocol_a,
    prefill_matches_protocol_a,
    tiny_model,
    transform_plan,
)

from kvcal.capture.hooks import attention_hook
from kvcal.evaluate.protocol_a import plan_hook
from kvcal.formats.granularity import PerToken
from kvcal.formats.quant import fake_quant
from kvcal.formats.spec import TensorQuantSpec
from kvcal.formats.transforms import RopeTable, apply_transform, fwht, hadamard_matrix
from kvcal.formats.variants import QuantTables
from kvcal.models import rope_table
from kvcal.plan import KVPlan, LayerPlan, SidePlan
from kvcal.runtime import QuantizedKVCache


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_hadamard_matches_scipy_and_is_orthogonal():
    """hadamard_matrix(d) equals scipy.linalg.hadamard(d)/√d exactly and H·H = I within d·eps64; d=96
    (not a power of two) is refused."""
    from scipy.linalg import hadamard

    for d in (1, 2, 16, 64, 128):
        h = hadamard_matrix(d, torch.float64)
        assert torch.equal(h, torch.tensor(hadamard(d), dtype=torch.float64) / d**0.5)
        # float64 dot of d terms of magnitude 1/d: |error| <= d·eps64·Σ|terms| = d·eps64 <= 2.9e-14
        torch.testing.assert_close(h @ h, torch.eye(d, dtype=torch.float64), rtol=0, atol=d * torch.finfo(torch.float64).eps)
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard_matrix(96)


def test_fwht_is_the_hadamard_product_and_row_independent():
    """fwht(x) = x @ H_D/√D: in float64 within the butterfly's log2(D) roundings plus the matmul's
    D-term dot-product error (Higham Thm 3.1: γ_D ≈ D·eps64), each of the magnitudes Σ|x|/√D, so
    |err| ≤ (log2 D + D)·eps64·Σ|x|/√D whatever the BLAS blocking; a wrong butterfly sign moves an
    output by ~|x|/√D, 10¹³x more; in float32 each
    row's result does not depend on the other rows (one token alone == the same token inside a
    sequence, exactly), which is what keeps decode-step codes equal to Protocol A's on any CPU."""
    g = torch.Generator().manual_seed(0)
    for d in (1, 2, 16, 64, 128):
        x = torch.randn(3, 2, 7, d, generator=g, dtype=torch.float64)
        want = x @ hadamard_matrix(d, torch.float64)
        bound = (math.log2(d) + d) * torch.finfo(torch.float64).eps * x.abs().sum(-1, keepdim=True) / d**0.5
        assert ((fwht(x) - want).abs() <= bound).all()
        x32 = x.float()
        full = fwht(x32)
        assert all(torch.equal(full[:, :, t : t + 1], fwht(x32[:, :, t : t + 1])) for t in range(7))
    with pytest.raises(ValueError, match="power-of-two"):
        fwht(torch.zeros(1, 1, 1, 96))


def test_rope_table_matches_transformers(model):
    """rope_table's post-RoPE rotation equals transformers' apply_rotary_pos_emb exactly; the inverse
    restores x within 8·eps32·max|x| only at the right positions; attention scaling is divided out."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rope = rope_table(model)
    assert rope.head_dim == D and rope.attention_scaling == 1.0
    x = torch.randn(2, H, 20, D)
    pos = torch.arange(20)[None] + 5
    cos, sin = model.model.rotary_emb(x, pos)
    _, k_post = apply_rotary_pos_emb(x, x, cos, sin)
    # same float32 angles (one product), same cos/sin, same x·cos + rotate_half(x)·sin: equal exactly
    assert torch.equal(rope.to_post_rope(x, 5), k_post)
    # the inverse: ~6 fp32 roundings of magnitude ≤ |x| plus cos²+sin² = 1 ± 2 ulp -> ≤ 8·eps32·max|x|;
    # a wrong sign or position moves elements by O(|x|)
    inv_bound = 8 * torch.finfo(torch.float32).eps * float(x.abs().max())
    torch.testing.assert_close(rope.to_pre_rope(k_post, 5), x, rtol=0, atol=inv_bound)
    # the inverse undoes the rotation at the given positions only
    assert (rope.to_pre_rope(k_post, 6) - x).abs().max() > 1e-2
    # a YaRN-style attention scaling multiplies cos and sin: the inverse divides it out
    r2 = RopeTable(rope.inv_freq, 1.3)
    # two more roundings (·1.3, /1.3) of magnitude ≤ 1.3·2|x|: 8 -> 16 eps32·max|x| covers them
    torch.testing.assert_close(r2.to_pre_rope(r2.to_post_rope(x, 3), 3), x, rtol=0, atol=2 * inv_bound)
    assert torch.equal(r2.to_post_rope(x, 3), 1.3 * rope.to_post_rope(x, 3))  # (…)·1.3 and 1.3·((…)·1.0): same products


def test_rope_table_refuses_partial_rotary():
    """A GPT-NeoX model with rotary_pct=0.25 is refused with 'partial rotary'."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                        intermediate_size=64, rotary_pct=0.25, max_position_embeddings=64)
    with pytest.raises(ValueError, match="partial rotary"):
        rope_table(GPTNeoXForCausalLM(cfg))


def test_side_plan_pre_rope_is_quantization_of_the_unrotated_key(model):
    """The pre-RoPE key plan equals the hand re-statement (bf16 sinks, un-rotate, group int4, re-rotate)
    exactly; the Hadamard value plan equals fwht∘fake_quant∘fwht exactly; neither is post-RoPE quantization."""
    plan = transform_plan(model, sinks=2)
    rope = rope_table(model)
    k = torch.randn(1, H, 30, D) * 2
    y = plan.fake_quant(0, "k", k)
    # by hand: sinks in bf16; the rest un-rotated at positions 2.., quantized in 8-token groups, re-rotated
    pre = rope.to_pre_rope(k[:, :, 2:], 2)
    q = fake_quant(pre, K_SPEC, clip_ratio=torch.full((H,), 0.9))
    want = torch.cat([k[:, :, :2].to(torch.bfloat16).float(), rope.to_post_rope(q, 2)], dim=2)
    assert torch.equal(y, want)  # the same elementwise ops in the same order: exact
    # values: Hadamard rotate (the butterfly, as the plan does), per-token symmetric int4, rotate back;
    # exact, since the arithmetic is shared. A matmul by H_D here (as this test once had) differs from
    # the butterfly by ulps that can move an int4 code a whole step; fwht == x @ H_D is its own test
    v = torch.randn(1, H, 30, D)
    want_v = torch.cat([v[:, :, :2].to(torch.bfloat16).float(), fwht(fake_quant(fwht(v[:, :, 2:]), V_SPEC))], dim=2)
    assert torch.equal(plan.fake_quant(0, "v", v), want_v)
    # and it is not the post-RoPE quantization
    post = SidePlan(K_SPEC, clip_ratio=torch.full((H,), 0.9)).fake_quant(k[:, :, 2:])
    assert (post - y[:, :, 2:]).abs().max() > 1e-3


def test_pre_rope_helps_keys_with_an_offset_channel(model):
    """A key channel pair with a large constant pre-RoPE value rotates through ± post-RoPE: the
    per-channel group range post-RoPE is wide, pre-RoPE narrow — the reason for the transform."""
    rope = rope_table(model)
    pre = torch.randn(1, H, 64, D) * 0.1
    pre[:, :, :, 0] += 5.0  # channel 0 pairs with channel D/2; inv_freq[0] = 1 rad / token
    post = rope.to_post_rope(pre, 0)
    sp_post = SidePlan(K_SPEC, clip_ratio=torch.ones(H))
    sp_pre = SidePlan(K_SPEC, clip_ratio=torch.ones(H), transform="pre_rope", rope=rope)
    e_post = (sp_post.fake_quant(post) - post).pow(2).mean()
    e_pre = (sp_pre.fake_quant(post) - post).pow(2).mean()
    # channels 0 and D/2 span ~±5 over a post-RoPE 8-token group (int4 step ~10/15) but only the 0.1-noise
    # range pre-RoPE, and they dominate e_post: e_pre/e_post ≈ 0.006 (seeds 0-2); 0.2 is a 30x margin
    # that a transform applied at the wrong positions (no gain, ratio ~1) does not meet
    assert e_pre < 0.2 * e_post


def test_transform_errors():
    """Refusals: pre_rope without a RoPE table, an unknown transform name, centering with hadamard, and
    a non-power-of-two Hadamard size."""
    with pytest.raises(ValueError, match="RoPE table"):
        SidePlan(K_SPEC, transform="pre_rope").fake_quant(torch.randn(1, H, 4, D))
    with pytest.raises(ValueError, match="unknown transform"):
        SidePlan(K_SPEC, transform="rotate").fake_quant(torch.randn(1, H, 4, D))
    with pytest.raises(ValueError, match="centering"):
        SidePlan(K_SPEC, transform="hadamard", mean=torch.zeros(1, H, 1, D)).fake_quant(torch.randn(1, H, 4, D))
    with pytest.raises(ValueError, match="power-of-two"):
        apply_transform("hadamard", torch.randn(1, 1, 2, 12))


def test_runtime_prefill_and_decode_equal_protocol_a(model):
    """Runtime cache with pre-RoPE/Hadamard plans: prefill logits equal Protocol A exactly, per-token
    decode within 5e-5 (fp32 reassociation); the transforms change the logits by more than 1e-3."""
    ids = torch.randint(0, 128, (2, 37), generator=torch.Generator().manual_seed(1))
    prefill_matches_protocol_a(model, transform_plan(model, sinks=1), ids)
    with torch.no_grad():
        # decode token by token: with per-token keys (pre-RoPE) every token is quantized alone, so each
        # step reads exactly what Protocol A reads (token groups re-quantize an open group: documented)
        plan = transform_plan(model, sinks=1, k_spec=TensorQuantSpec("int4", PerToken(), symmetric=False))
        got, ref = decode_and_protocol_a(model, plan, ids, 6, 30)
        torch.testing.assert_close(got, ref, rtol=0, atol=5e-5)  # fp32 reassociation (decode_and_protocol_a)
        with attention_hook(model, plan_hook(transform_plan(model, sinks=1, k_tr="none", v_tr="none",
                                                            k_spec=plan.layers[0].k.spec))):
            other = model(ids[:, :30], use_cache=False).logits[:, 5:]
        assert (other - got).abs().max() > 1e-3  # the transforms are not a no-op


def test_runtime_refuses_left_padding_for_pre_rope(model):
    """Left-padded generate with a pre-RoPE plan is refused ('position'); a Hadamard-only plan
    generates under left padding."""
    plan = transform_plan(model)
    ids = torch.randint(1, 128, (2, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0
    with pytest.raises(ValueError, match="position"):
        model.generate(ids, attention_mask=mask, cache=QuantizedKVCache(plan, model.config), max_new_tokens=2,
                       do_sample=False)
    # Hadamard-only plans do not depend on positions: left padding works
    plan_v = transform_plan(model, k_tr="none")
    out = model.generate(ids, attention_mask=mask, cache=QuantizedKVCache(plan_v, model.config), max_new_tokens=3,
                         do_sample=False)
    assert out.shape == (2, 13)


def test_artifact_roundtrip_and_export_refusal(tmp_path, model):
    """A transform plan survives write_artifact/load_artifact with identical fake_quant; missing
    rotary.inv_freq is refused; vllm export of a Hadamard-rotated FP8 artifact raises ExportError."""
    from kvcal.artifact import load_artifact, write_artifact
    from kvcal.export import export
    from kvcal.export.base import ExportError

    plan = transform_plan(model)
    meta = {"model": {"num_layers": L, "num_kv_heads": H, "head_dim": D}, "kv": plan.kv_metadata()}
    assert meta["kv"]["key_position"] == "pre_rope"
    assert meta["kv"]["transforms"] == [{"k": "pre_rope", "v": "hadamard"}] * L
    tensors = plan.to_tensors()
    write_artifact(tmp_path / "a", tensors, meta)
    art = load_artifact(tmp_path / "a")
    back = KVPlan.from_artifact(art.tensors, art.metadata)
    x = torch.randn(1, H, 20, D)
    for i in range(L):
        for s in ("k", "v"):
            assert torch.equal(back.fake_quant(i, s, x), plan.fake_quant(i, s, x))
    no_rope = {k: v for k, v in tensors.items() if k != "rotary.inv_freq"}
    with pytest.raises(ValueError, match="rotary.inv_freq"):
        KVPlan.from_artifact(no_rope, meta)
    # an otherwise engine-loadable FP8 artifact is refused once a side is Hadamard-rotated
    fp8 = TensorQuantSpec("fp8_e4m3")
    plan8 = KVPlan([LayerPlan(SidePlan(fp8, scale=torch.ones(1, 1, 1, 1)),
                              SidePlan(fp8, scale=torch.ones(1, 1, 1, 1), transform="hadamard")) for _ in range(L)])
    write_artifact(tmp_path / "b", plan8.to_tensors(), {"model": meta["model"], "kv": plan8.kv_metadata()})
    with pytest.raises(ExportError, match="transform"):
        export(tmp_path / "b", "vllm", tmp_path / "out")


# ---- query-aware rounding -------------------------------------------------------------------------

def test_rounding_identity_is_nearest_and_feedback_lowers_score_error():
    """Identity rounding matrix gives nearest rounding; rounding_matrix is the damped Cholesky factor
    (float32 bound); feedback cuts float64 score error below 0.7× nearest; fp8 and a wrong shape are refused."""
    from kvcal.formats.codes import rounding_matrix
    from kvcal.formats.quant import dequantize, quantize

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, H, 24, D, generator=g) * 3
    eye = torch.eye(D).expand(H, D, D)
    assert torch.equal(fake_quant(x, K_SPEC, tables=QuantTables(rounding=eye)), fake_quant(x, K_SPEC))
    # anisotropic queries: a few strong directions
    basis = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))[0]
    w = torch.tensor([30.0, 10.0, 5.0] + [0.3] * (D - 3), dtype=torch.float64)
    q = (torch.randn(4000, D, generator=g, dtype=torch.float64) * w) @ basis.T
    sigma = (q.T @ q).expand(H, D, D)
    U = rounding_matrix(sigma)
    # U is float64's Cholesky factor rounded to float32 (|ΔU| ≤ eps32/2·|U|), so elementwise
    # |UᵀU·M − I| ≤ eps32·|U|ᵀ|U||M| to first order; 2x that covers float64's inv/cholesky (κ·eps64 ≈ 3e-13).
    # A wrong damping (e.g. 2% instead of 1%) moves the small-eigenvalue block by ~0.5: caught
    u, m = U[0].double(), sigma[0] + 0.01 * sigma[0].diagonal().mean() * torch.eye(D, dtype=torch.float64)
    err = (u.T @ u @ m - torch.eye(D, dtype=torch.float64)).abs()
    assert bool((err <= 2 * torch.finfo(torch.float32).eps * (u.abs().T @ u.abs() @ m.abs())).all())
    for spec in (K_SPEC, TensorQuantSpec("int4", PerToken(), symmetric=True)):
        near, fb = fake_quant(x, spec), fake_quant(x, spec, tables=QuantTables(rounding=U))
        # float64 score error E[(q·Δk)^2] over the query sample, independently of the library
        e_near = ((near - x).double() @ q.T).pow(2).mean()
        e_fb = ((fb - x).double() @ q.T).pow(2).mean()
        # seeded data; GPTQ-style feedback moves error out of the 3 strong query directions (weights
        # 30/10/5 vs 0.3): 0.12 / 0.07 of nearest here, so 0.7 holds with a 6x margin on any CPU's
        # ulp-level differences, and fails for feedback that is a no-op (ratio 1) or mis-ordered
        assert e_fb < 0.7 * e_near
        # same grid: every code is a representable value (the packed round trip agrees exactly)
        qt = quantize(x, spec, tables=QuantTables(rounding=U))
        assert torch.equal(dequantize(qt), fb)
    with pytest.raises(ValueError, match="int formats"):
        fake_quant(x, TensorQuantSpec("fp8_e4m3"), scale=torch.ones(1), tables=QuantTables(rounding=U))
    with pytest.raises(ValueError, match="rounding must be"):
        fake_quant(x, K_SPEC, tables=QuantTables(rounding=torch.eye(D)[None].expand(5, D, D)))


def test_unit_rounding_keeps_the_ratios_rounding_uses():
    """Ũ = U / diag(U), ratios in float8 e4m3: codes identical to U's when U's ratios are
    e4m3-exact (hand-built U = diag(d)·R), idempotent, and the storage limit is enforced."""
    from kvcal.formats.codes import unit_rounding

    g = torch.Generator().manual_seed(3)
    # R: unit upper triangle with entries k/8 in [-2, 2] (exact in e4m3), d: arbitrary positive scales
    R = torch.triu(torch.randint(-16, 17, (H, D, D), generator=g).float() / 8, diagonal=1) + torch.eye(D)
    d = torch.rand(H, D, generator=g) * 5 + 0.1
    U = d[..., None] * R
    Ut = unit_rounding(U)
    torch.testing.assert_close(Ut, R, rtol=0, atol=0)
    assert torch.equal(unit_rounding(Ut), Ut)
    x = torch.randn(2, H, 24, D, generator=g) * 3
    assert torch.equal(fake_quant(x, K_SPEC, tables=QuantTables(rounding=U)), fake_quant(x, K_SPEC, tables=QuantTables(rounding=Ut)))
    # a ratio that is not e4m3-exact is rounded to the nearest e4m3 value (0.3 -> 0.3125: 1.25 * 2^-2)
    U2 = torch.eye(D).repeat(H, 1, 1)
    U2[:, 0, 1] = 0.3
    assert float(unit_rounding(U2)[0, 0, 1]) == 0.3125
    U2[:, 0, 1] = 500.0
    with pytest.raises(ValueError, match="448"):
        unit_rounding(U2)
    U2[:, 0, 0] = 0.0
    with pytest.raises(ValueError, match="positive diagonal"):
        unit_rounding(U2)


def test_runtime_with_rounding_equals_protocol_a_and_accounting(model):
    """Runtime cache with key rounding matrices: prefill logits equal Protocol A exactly; the cache holds
    exactly L·H·D(D−1)/2 more bytes (float8 strict triangle); and every one of 28 decode steps stores
    exactly quantize() of the keys/values it handed the cache (helpers.plans.decode_stores_quantize_of_inputs:
    the new token's codes and its token group's scale / zero point). Decode logits are not compared with
    Protocol A here: the keys are per-channel token groups, whose open group is re-quantized as it fills."""
    from helpers.plans import decode_stores_quantize_of_inputs

    from kvcal.formats.codes import rounding_matrix

    plan = transform_plan(model, sinks=1)
    g = torch.Generator().manual_seed(4)
    a = torch.randn(H, D, D, generator=g)
    U = rounding_matrix(a @ a.transpose(1, 2))  # float32, not yet in its stored 8-bit form
    for lp in plan.layers:
        lp.k.rounding = U
    ids = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(6))
    cache = prefill_matches_protocol_a(model, plan, ids)
    no_round = transform_plan(model, sinks=1)
    c2 = QuantizedKVCache(no_round, model.config)
    with torch.no_grad():
        model(ids, cache=c2, use_cache=True)
    assert cache.allocated_bytes() - c2.allocated_bytes() == L * H * (D * (D - 1) // 2)  # float8 strict triangle
    assert decode_stores_quantize_of_inputs(model, plan, ids, 5, 33) == 28 * L * 2  # steps x layers x sides


def test_calibrate_refuses_pre_rope_preset_on_partial_rotary(tmp_path, smollm_tokenizer):
    """calibrate --preset int4 on a partial-rotary GPT-NeoX raises KvcalError 'pre-RoPE' and writes no
    artifact directory."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from kvcal.calibrate import CalibrateConfig, calibrate
    from kvcal.errors import KvcalError

    cfg = GPTNeoXConfig(vocab_size=smollm_tokenizer.vocab_size, hidden_size=64, num_hidden_layers=1,
                        num_attention_heads=4, intermediate_size=64, rotary_pct=0.25, max_position_embeddings=64)
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(f"Paragraph {i} about foxes and dogs." for i in range(6)), encoding="utf-8")
    c = CalibrateConfig(corpus=str(corpus), out=str(tmp_path / "art"), preset="int4", max_seq_len=32)
    with pytest.raises(KvcalError, match="pre-RoPE"):
        calibrate(c, log=lambda s: None, progress=False, model=GPTNeoXForCausalLM(cfg).eval(),
                  tokenizer=smollm_tokenizer)
    assert not (tmp_path / "art").exists()


def test_walsh_hadamard_is_the_sylvester_product_exactly():
    """The one butterfly (`walsh_hadamard`, shared by the hadamard transform and vLLM's rotations) equals
    ``x @ H_D`` with scipy's ±1 Sylvester matrix exactly: integer inputs below 2^10 keep every partial sum below
    2^18, exact in float32; and `fwht` is it times 1/√D."""
    from scipy.linalg import hadamard

    from kvcal.formats.transforms import fwht, walsh_hadamard

    g = torch.Generator().manual_seed(0)
    for d in (1, 2, 16, 64, 256):
        x = torch.randint(-1000, 1000, (5, 3, d), generator=g).float()
        ref = (x.double() @ torch.tensor(hadamard(d), dtype=torch.float64)).float()
        assert torch.equal(walsh_hadamard(x), ref)
        assert torch.equal(fwht(x), walsh_hadamard(x) * (1.0 / d**0.5))
    with pytest.raises(ValueError, match="power-of-two"):
        walsh_hadamard(torch.zeros(3, 48))
