"""ggml's KV-cache block formats (``kvcal.engines.llamacpp.quants``) against independent references.

* ``q4_0``, ``q4_1``, ``q5_0``, ``q5_1`` and the reference ``q8_0``: gguf-py's numpy quantizers (``gguf.quants``)
  implement the same algorithm as ``quantize_row_*_ref`` in float32 (same first-occurrence absmax, ``1/d``
  multiplier, f32 add and truncation, ``roundf`` for q8_0 via ``np_roundf``), so the stored **bytes** must be
  identical, and so must the dequantized values.
* The x86 AVX ``q8_0`` (what the CPU cache write calls for q8_0 on this build) and ``iq4_nl`` (gguf has no
  iq4_nl quantizer): statement-by-statement numpy re-statements of the C (``tests/helpers/llamacpp.py``), plus
  hand-worked blocks whose codes follow from the C arithmetic by hand.
* Sizes: gguf's published ``GGML_QUANT_SIZES``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import IQ4_NL
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from helpers.llamacpp import KVALUES, iq4_nl_block, pack, q8_0_avx_block

from kvcal.engines.llamacpp import quants as Q
from kvcal.errors import KvcalError

GGUF = {"q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_1": T.Q4_1, "q5_0": T.Q5_0, "q5_1": T.Q5_1, "iq4_nl": T.IQ4_NL}


def _rows(seed: int = 0, n: int = 600) -> np.ndarray:
    """Seeded rows of 64 (two blocks) with magnitudes over ~6 decades, plus edge rows: all zeros, a constant
    block, a block whose largest magnitudes tie with opposite signs (first one wins), fp16-subnormal scales."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, 64)) * np.exp(rng.uniform(-7, 7, (n, 1)))).astype(np.float32)
    x[0] = 0
    x[1, :32] = 2.5
    x[2, :32] = 0
    x[2, 3], x[2, 9] = -4.0, 4.0
    x[3, 32:] = 0
    x[3, 40], x[3, 50] = 3.0, -3.0
    x[4] *= np.float32(1e-6)
    return x


@pytest.mark.parametrize("name", ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"])
def test_reference_quantizers_match_gguf_bytes(name):
    """Bit-exact bytes (and dequantized values) with gguf-py's numpy port of ``quantize_row_<t>_ref`` /
    ``dequantize_row_<t>`` (same f32 algorithm, argued in the module docstring); q8_0 with ``impl='ref'``."""
    x = _rows()
    want = gguf_quantize(x, GGUF[name]).reshape(-1, GGML_QUANT_SIZES[GGUF[name]][1])
    b = Q.quantize(torch.from_numpy(x), name, impl="ref")
    assert np.array_equal(pack(b), want)
    assert np.array_equal(Q.dequantize(b).numpy(), gguf_dequantize(want.reshape(x.shape[0], -1), GGUF[name]))


def test_q8_0_avx_matches_the_c_restatement():
    """The default q8_0 path equals the AVX branch of ``arch/x86/quants.c`` quantize_row_q8_0, restated in numpy
    (``127/amax`` multiplier, ties to even), block by block: fp16 scale and codes."""
    x = _rows(1, 300)
    b = Q.quantize(torch.from_numpy(x), "q8_0")
    d, c = b.d.reshape(-1).numpy(), b.codes.reshape(-1, 32).numpy()
    for i, blk in enumerate(x.reshape(-1, 32)):
        wd, wq = q8_0_avx_block(blk)
        assert d[i] == wd and np.array_equal(c[i], wq), i


def test_q8_0_avx_and_ref_differ_on_a_hand_worked_tie():
    """Block [127, 2.5, -2.5, 0.5, 0 ...]: amax = 127 so d = 1 and both multipliers are exactly 1; 2.5 and 0.5
    are ties. ``roundf`` (ref) gives 3, -3, 1; ``_MM_ROUND_NEAREST`` (AVX) gives 2, -2, 0."""
    x = torch.zeros(32)
    x[:4] = torch.tensor([127.0, 2.5, -2.5, 0.5])
    assert Q.quantize(x, "q8_0", impl="ref").codes[0, :4].tolist() == [127, 3, -3, 1]
    assert Q.quantize(x, "q8_0").codes[0, :4].tolist() == [127, 2, -2, 0]
    assert float(Q.quantize(x, "q8_0").d[0]) == 1.0


def test_q8_1_sum_uses_the_unrounded_scale():
    """q8_1 (the query format of q4_1/q5_1 keys) stores ``s = fp16(d_f32 · Σq)``. Hand-worked: a block of 32
    values 1.0 → amax 1, d = 1/127 (f32), every code 127 (1 · 127/1 = 127), Σq = 4064, s = fp16(4064/127 in f32)
    = fp16(32.0) = 32, whereas fp16(d)·Σq = 4064 · fp16(1/127) = 32.0078..."""
    b = Q.quantize(torch.ones(32), "q8_1")
    assert b.codes.tolist() == [[127] * 32]
    d32 = np.float32(np.float32(1) / np.float32(127))
    assert float(b.s[0]) == float(np.float16(np.float32(d32 * np.float32(4064))))
    assert float(b.s[0]) != float(b.d[0]) * 4064


def test_iq4_nl_table_is_the_published_one():
    """``kvalues_iq4nl`` as printed in ggml-common.h and as gguf-py publishes it."""
    assert Q.IQ4_NL_VALUES == KVALUES == tuple(IQ4_NL.kvalues)


def test_iq4_nl_matches_the_c_restatement_and_gguf_dequant():
    """iq4_nl codes and fp16 scales equal the statement-by-statement numpy re-statement of
    ``quantize_row_iq4_nl_impl`` (ntry = -1), and the packed bytes dequantize through gguf-py to our values."""
    x = _rows(2, 200)
    b = Q.quantize(torch.from_numpy(x), "iq4_nl")
    d, c = b.d.reshape(-1).numpy(), b.codes.reshape(-1, 32).numpy()
    for i, blk in enumerate(x.reshape(-1, 32)):
        wd, wl = iq4_nl_block(blk)
        assert d[i] == wd, i
        if wd != 0:
            assert np.array_equal(c[i], wl), i
    want = gguf_dequantize(pack(b).reshape(x.shape[0], -1), T.IQ4_NL)
    assert np.array_equal(Q.dequantize(b).numpy(), want)


def test_iq4_nl_hand_worked_block():
    """x_j = 0.01 · kvalues[j % 16]: the first largest magnitude is x_0 = -1.27, so d0 = -1.27/-127 = 0.01 and
    x_j / d0 lands on (within f32 rounding of) kvalues[j % 16] → code j % 16; the least-squares scale of an exact
    fit is 0.01 (to f32 rounding), stored as fp16(0.01)."""
    x = torch.tensor([0.01 * KVALUES[j % 16] for j in range(32)], dtype=torch.float32)
    b = Q.quantize(x, "iq4_nl")
    assert b.codes[0].tolist() == [j % 16 for j in range(32)]
    assert float(b.d[0]) == float(np.float16(0.01))


@pytest.mark.parametrize("name,top", [("q4_0", 15), ("q5_0", 31), ("q8_0", None), ("q4_1", 15), ("q5_1", 31)])
def test_dequant_error_within_half_a_step(name, top):
    """Every element is reconstructed within half a step of its block plus the fp16 storage of the step:
    codes are chosen with the f32 ``d`` (nearest level), the stored ``d16 = fp16(d)`` is within
    ``e = 2^-10·|d16| + 2^-25`` of it (2^-11 relative for normal fp16, half the 2^-24 spacing for subnormal
    scales, which the 1e-6 row produces), so ``|x − x̂| <= (|d16| + e)/2 + |c − centre|·e (+ |min − m16|)``, plus
    one f32 rounding of the product; the top code of ``q4_0``/``q5_0`` (the side opposite the signed max has
    one level fewer) is allowed a whole step."""
    x = torch.from_numpy(_rows(3, 300))
    b = Q.quantize(x, name, impl="ref")
    xb = x.reshape(-1, 32).double()
    y = Q.dequantize(b).reshape(-1, 32).double()
    d16 = b.d.reshape(-1, 1).double().abs()
    e = d16 * 2**-10 + 2**-25
    c = b.codes.reshape(-1, 32).double()
    centre = {"q4_0": 8, "q5_0": 16}.get(name, 0)
    slack = (c - centre).abs() * e + xb.abs() * 2**-23
    bound = 0.5 * (d16 + e) + slack
    if b.m is not None:
        bound = bound + b.m.reshape(-1, 1).double().abs() * 2**-11 + 2**-25
    if top is not None and centre:
        bound = torch.where(c == top, d16 + e + slack, bound)
    assert bool(((xb - y).abs() <= bound).all())


@pytest.mark.parametrize("name", Q.KV_CACHE_TYPES)
def test_sizes_match_the_published_table(name):
    """``blck_size``/``type_size`` of every cache type equal gguf-py's ``GGML_QUANT_SIZES`` (ggml.c type_traits).
    (q8_1 is not a cache type; this gguf release still lists its pre-fp16 size 40, the vendored source 36.)"""
    t = Q.ggml_type(name)
    assert (t.blck_size, t.type_size) == GGML_QUANT_SIZES[T[name.upper()]]
    assert Q.GGML_TYPES["q8_1"].type_size == 2 + 2 + 32


def test_f16_bf16_rounding():
    """f16/bf16 cache rows are round-to-nearest-even: 1 + 2^-11 (a tie) → 1 in fp16; 1 + 3·2^-11 → 1 + 2^-9."""
    x = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11])
    assert Q.fake_quant(x, "f16").tolist() == [1.0, 1 + 2**-9]
    assert Q.fake_quant(torch.tensor([1 + 2**-8]), "bf16").tolist() == [1.0]
    assert Q.fake_quant(x, "f32").tolist() == x.tolist()


@pytest.mark.parametrize("call,msg", [
    (lambda: Q.quantize(torch.zeros(48), "q8_0"), "multiple of 32"),
    (lambda: Q.quantize(torch.full((32,), float("nan")), "q4_0"), "NaN"),
    (lambda: Q.quantize(torch.zeros(32), "q3_k"), "unknown"),
    (lambda: Q.quantize(torch.zeros(32), "q8_0", impl="neon"), "implementation"),
    (lambda: Q.quantize(torch.zeros(32, dtype=torch.int32), "q8_0"), "floating-point"),
    (lambda: Q.quantize(torch.zeros(32), "f16"), "not a block-quantized"),
])
def test_bad_input_is_one_kvcal_error(call, msg):
    """Bad input raises one KvcalError whose single-line message says what is wrong."""
    with pytest.raises(KvcalError, match=msg) as e:
        call()
    assert "\n" not in str(e.value)
