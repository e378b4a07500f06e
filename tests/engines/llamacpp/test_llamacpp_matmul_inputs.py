"""llama.cpp's weight-matmul input rounding as kvcal emulates it (``kvcal.engines.llamacpp.plan.MatmulInputs``,
``gguf_matmul_inputs``, ``quants.fake_quant_q8_K``).

Claims: ``q8_K`` (the input type of K-quant weights: Gemma 3's Q4_K/Q6_K) rounds a block of 256 as
``quantize_row_q8_K_ref`` does — checked on a hand-worked block (``iscale = -127/max`` exactly -1 or 1, so every
code is ``x`` rounded half to even) and against a numpy float32 re-statement of the C on random rows; the hooks
round exactly the modules the GGUF names with the type its weights take, and are gone after the block; the GGUF
header of each shipped model maps to the ``vec_dot_type`` ggml's ``type_traits_cpu`` gives its weight types.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from kvcal.engines.llamacpp import quants as Q
from kvcal.engines.llamacpp.plan import MatmulInputs, gguf_matmul_inputs
from kvcal.errors import KvcalError, ModelLoadError
from kvcal.models.gguf import gguf_tensor_types


def _q8_K_np(x: np.ndarray) -> np.ndarray:
    """``quantize_row_q8_K_ref`` then ``d * code``, statement by statement in float32 (``ggml-quants.c``)."""
    x = np.asarray(x, dtype=np.float32).reshape(-1, 256)
    out = np.zeros_like(x)
    for i, blk in enumerate(x):
        amax, mx = np.float32(0), np.float32(0)
        for v in blk:  # if (ax > amax) { amax = ax; max = x[j]; }: the first element of largest magnitude
            if abs(v) > amax:
                amax, mx = np.float32(abs(v)), v
        if amax == 0:
            continue
        iscale = np.float32(-127.0) / mx
        # nearest_int: fval + 12582912.f in f32 (round half to even), valid for |fval| <= 2^22
        codes = ((blk * iscale) + np.float32(12582912.0)).astype(np.float32) - np.float32(12582912.0)
        codes = np.minimum(np.float32(127), codes)
        d = np.float32(1.0) / iscale
        out[i] = d * codes
    return out


def test_q8_K_hand_worked_block():
    # max = 127: iscale = -127/127 = -1, d = -1, so each value is -(-x rounded half to even) = x rounded to even
    x = torch.zeros(256)
    x[:6] = torch.tensor([127.0, 2.5, 3.5, -0.5, -1.5, 100.25])
    want = torch.zeros(256)
    want[:6] = torch.tensor([127.0, 2.0, 4.0, 0.0, -2.0, 100.0])
    assert torch.equal(Q.fake_quant_q8_K(x), want)
    assert torch.equal(Q.fake_quant(x, "q8_K"), want)
    # max = -127 (negative): iscale = +1, the same values
    assert torch.equal(Q.fake_quant_q8_K(-x), -want)
    # a block of zeros stays zero; each block of 256 has its own scale
    two = torch.cat([torch.zeros(256), x])
    assert torch.equal(Q.fake_quant_q8_K(two), torch.cat([torch.zeros(256), want]))


def test_q8_K_matches_float32_restatement_and_half_step_bound():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 512, generator=g) * torch.tensor([0.01, 1.0, 300.0]).view(3, 1, 1)
    x[1, 0, 256 + 7] = -40.0  # a block whose max is negative
    got = Q.fake_quant_q8_K(x)
    want = torch.from_numpy(_q8_K_np(x.numpy())).reshape(x.shape)
    assert torch.equal(got, want)
    # |x - d*code| <= d/2 per block, d = amax/127 (up to the f32 rounding of iscale·x and d·code: 4 ulps of amax)
    amax = x.reshape(3, 2, 2, 256).abs().amax(-1, keepdim=True)
    err = (got - x).reshape(3, 2, 2, 256).abs()
    assert bool((err <= amax / 127 / 2 + 4 * torch.finfo(torch.float32).eps * amax).all())


def test_q8_K_refusals():
    with pytest.raises(KvcalError, match="blocks of 256"):
        Q.fake_quant_q8_K(torch.zeros(2, 96))
    with pytest.raises(KvcalError, match="NaN or Inf"):
        Q.fake_quant_q8_K(torch.full((256,), float("inf")))


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.up = torch.nn.Linear(256, 64, bias=False)
        self.down = torch.nn.Linear(64, 256, bias=False)
        self.odd = torch.nn.Linear(48, 8, bias=False)
        for m in (self.up, self.down, self.odd):
            m.weight.data = torch.randn(m.weight.shape, generator=g)

    def forward(self, x):
        return self.down(self.up(x))


def test_matmul_inputs_hooks_round_the_named_inputs_then_leave():
    m = _Tiny()
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(2))
    plain = m(x)
    with MatmulInputs(m, {"up": "q8_K", "down": "q8_0", "odd": "q8_K", "missing": "q8_0", "none": None}) as mm:
        got = m(x)
    # the same F.linear calls on the rounded inputs: equal bit for bit
    h = torch.nn.functional.linear(Q.fake_quant_q8_K(x), m.up.weight)
    want = torch.nn.functional.linear(Q.fake_quant(h, "q8_0"), m.down.weight)
    assert torch.equal(got, want) and not torch.equal(got, plain)
    assert mm.emulated == {"up": "q8_K", "down": "q8_0"}
    assert sorted(mm.left) == ["missing", "none", "odd"]  # odd: 48 input features are not a q8_K block
    assert torch.equal(m(x), plain)  # hooks removed


def _gguf_types(path):
    """The gguf library's own reading of each tensor's type (decodes the whole header, vocabulary included)."""
    return {t.name: t.tensor_type.name for t in GGUFReader(str(path)).tensors}


def test_gguf_matmul_inputs_smollm2():
    from kvcal.models import resolve_model

    src = resolve_model("smollm2-135m")
    path = f"{src.path}/{src.gguf_file}"
    types = _gguf_types(path)
    # kvcal's header read gives every tensor the type the gguf library's reader gives it
    assert gguf_tensor_types(path) == {n: t.lower() for n, t in types.items()}
    got = gguf_matmul_inputs(gguf_tensor_types(path))
    # ggml-cpu.c type_traits_cpu: Q4_1 -> vec_dot_type Q8_1, Q8_0 -> Q8_0 (tied embeddings: lm_head is token_embd)
    assert types["blk.0.attn_q.weight"] == "Q4_1" and types["token_embd.weight"] == "Q8_0"
    assert got["model.layers.0.self_attn.q_proj"] == "q8_1" and got["model.layers.29.mlp.down_proj"] == "q8_1"
    assert got["lm_head"] == "q8_0" and len(got) == 30 * 7 + 1


def test_gguf_matmul_inputs_gemma3_k_quants():
    from kvcal.models import gemma_gguf

    try:
        path = gemma_gguf()
    except ModelLoadError as e:
        pytest.skip(f"Gemma 3 GGUF not installed (`make gemma`): {e}")
    types = _gguf_types(path)
    assert gguf_tensor_types(path) == {n: t.lower() for n, t in types.items()}
    got = gguf_matmul_inputs(gguf_tensor_types(path))
    # Q4_K_M: attn_output Q4_K and ffn_down Q4_K/Q6_K take q8_K inputs; Q5_0/Q8_0 weights take q8_0
    assert types["blk.0.attn_output.weight"] == "Q4_K" and got["model.layers.0.self_attn.o_proj"] == "q8_K"
    for i in range(18):
        want = {"Q4_K": "q8_K", "Q6_K": "q8_K", "Q8_0": "q8_0", "Q5_0": "q8_0"}[types[f"blk.{i}.ffn_down.weight"]]
        assert got[f"model.layers.{i}.mlp.down_proj"] == want
    assert got["model.layers.0.self_attn.q_proj"] == "q8_0" and got["lm_head"] == "q8_0"
    assert None not in got.values()


def test_gelu_f16_table_against_float64():
    from kvcal.engines.llamacpp.plan import gelu_f16, gelu_f16_table

    t = gelu_f16_table()
    x16 = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
    x = x16.double()
    ok = torch.isfinite(x) & (x.abs() < 10)
    g64 = 0.5 * x * (1 + torch.tanh(np.sqrt(2 / np.pi) * x * (1 + 0.044715 * x * x)))
    # ggml computes each entry in f32, then rounds it to fp16. The f32 error: 1 + tanh(.) is formed with an absolute
    # error of a few f32 ulps of 1 (at x near -4, tanh ~ -1 and the sum cancels, so only an absolute bound holds),
    # times 0.5|x|; here 4 ulps (2^-23 each). The fp16 rounding adds half an fp16 ulp of the value.
    u16 = torch.exp2(torch.floor(torch.log2(g64.abs().clamp(min=2.0 ** -14))) - 10)
    bound = u16 / 2 + 0.5 * x.abs() * 4 * 2.0 ** -23
    assert bool(((t.double() - g64).abs() <= bound)[ok].all())
    # hand-worked: gelu(1) = 0.841192 -> fp16 0.84131 (1723 x 2^-11); the ends pass x through or give 0
    xs = torch.tensor([1.0, -10.0, -10.5, 10.0, 12.25])
    assert torch.equal(gelu_f16(xs), torch.tensor([1723 * 2.0 ** -11, 0.0, 0.0, 10.0, 12.25]))


def test_matmul_inputs_hooks_gelu_tanh_modules():
    from transformers.activations import GELUTanh

    from kvcal.engines.llamacpp.plan import gelu_f16

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.act_fn = GELUTanh()

        def forward(self, x):
            return self.act_fn(x)

    m, x = M(), torch.linspace(-12, 12, 1001)
    with MatmulInputs(m, {}) as mm:
        got = m(x)
    assert mm.activations == ["act_fn"] and torch.equal(got, gelu_f16(x))
    assert torch.equal(m(x), torch.nn.functional.gelu(x, approximate="tanh"))


def test_q8_K_block_too_small_for_its_scale_is_zeros():
    # amax < 127 / FLT_MAX: -127/max overflows to inf; ggml's nearest_int of inf/NaN keeps no low bits (codes 0)
    # and d = 1/inf = 0, so the block holds zeros (a NaN here would poison the whole window)
    x = torch.zeros(512)
    x[0], x[1], x[300] = 1e-38, -3e-39, 2.0
    got = Q.fake_quant_q8_K(x)
    assert torch.equal(got[:256], torch.zeros(256)) and got[300] == 2.0


def test_matmul_inputs_reports_what_it_does_not_round(tmp_path):
    """A Linear the map does not name, and a quantized GGUF weight that maps to no module (MoE experts), are both
    reported as not emulated (so verify judges the float32 prediction with a floor instead of claiming the whole
    model is emulated)."""
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFWriter
    from gguf.quants import quantize

    w = GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    rng = np.random.default_rng(0)
    for name, ty in (("blk.0.attn_q.weight", T.Q8_0), ("blk.0.ffn_gate_exps.weight", T.Q8_0),
                     ("blk.0.attn_norm.weight", T.F32)):
        a = rng.standard_normal((64, 64) if ty != T.F32 else (64,)).astype(np.float32)
        if ty == T.F32:
            w.add_tensor(name, a)
        else:
            w.add_tensor(name, quantize(a, ty), raw_dtype=ty)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert gguf_tensor_types(tmp_path / "m.gguf") == {"blk.0.attn_q.weight": "q8_0",
                                                     "blk.0.ffn_gate_exps.weight": "q8_0",
                                                     "blk.0.attn_norm.weight": "f32"}
    got = gguf_matmul_inputs(gguf_tensor_types(tmp_path / "m.gguf"))
    assert got == {"model.layers.0.self_attn.q_proj": "q8_0", "gguf:blk.0.ffn_gate_exps.weight": None}
    m = _Tiny()
    with MatmulInputs(m, {"up": "q8_K"}) as mm:
        pass
    assert mm.emulated == {"up": "q8_K"} and sorted(mm.left) == ["down", "odd"]  # named by no GGUF tensor
