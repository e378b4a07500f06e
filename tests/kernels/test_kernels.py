"""Triton kernels vs the torch reference: bit-identical storage, parameters and dequantization.

These run for real on CPU under ``TRITON_INTERPRET=1`` (set here before the kernels are imported;
the Makefile exports it too). Skipped only when triton is not installed.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kvcal import kernels as K  # noqa: E402
from kvcal.formats import quant as R  # noqa: E402
from kvcal.formats.granularity import PerChannel, PerChannelTokenGroup, PerToken, PerTokenGroup  # noqa: E402
from kvcal.formats.spec import TensorQuantSpec  # noqa: E402

pytestmark = pytest.mark.skipif(not K.triton_available(), reason="triton not installed")


def _x(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.linspace(0.2, 3.0, shape[-1])
    x[:, 0] = x[:, 0].abs() + 2.0  # head 0 one-signed (negative zero points)
    x[:, 1, 0] = 0.0  # an all-zero token (scale 1)
    return x


def _assert_same(a: R.QuantizedTensor, b: R.QuantizedTensor):
    assert a.data.dtype == b.data.dtype and torch.equal(a.data, b.data)
    assert a.scale.dtype == b.scale.dtype and torch.equal(a.scale, b.scale)
    assert (a.zero_point is None) == (b.zero_point is None)
    if a.zero_point is not None:
        assert torch.equal(a.zero_point, b.zero_point)


GRANS = [PerToken(), PerTokenGroup(16), PerChannelTokenGroup(8)]


@pytest.mark.parametrize("bits", [8, 4, 3, 2])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("gran", GRANS, ids=lambda g: g.name)
def test_parity_bits_symmetry_granularity(bits, sym, gran):
    """The Triton kernel (interpreted on CPU) quantizes bit-identically to the torch reference (codes, scales,
    zero points) for int8/4/3/2, symmetric and asymmetric, three granularities with a partial token group, and
    dequantizes identically."""
    x = _x((1, 3, 11, 32))  # S=11: a partial token group of 8
    spec = TensorQuantSpec(f"int{bits}", gran, symmetric=sym)
    clip = torch.tensor([1.0, 0.9, 0.6])
    a = K.quantize(x, spec, clip_ratio=clip, backend="triton")
    b = R.quantize(x, spec, clip_ratio=clip)
    _assert_same(a, b)
    assert torch.equal(K.dequantize(b, backend="triton"), R.dequantize(b))


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("out", [torch.float32, torch.bfloat16, torch.float16])
def test_parity_dtypes(scale_dtype, out):
    """Triton quantize/dequantize equal the torch reference exactly for fp16/bf16/fp32 scale dtypes and
    fp32/bf16/fp16 inputs, and the dequantized output keeps the input dtype."""
    x = _x((2, 3, 5, 32), seed=1).to(out)
    for gran in (PerTokenGroup(32), PerChannelTokenGroup(4)):
        spec = TensorQuantSpec("int4", gran, symmetric=False, scale_dtype=scale_dtype)
        a = K.quantize(x, spec, backend="triton")
        b = R.quantize(x, spec)
        _assert_same(a, b)
        ya = K.dequantize(a, backend="triton")
        assert ya.dtype == out and torch.equal(ya, R.dequantize(b))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_dispatch_fallbacks_and_errors():
    """Specs the kernel does not support (D=24 channel-token groups, static int8, fp8, nvfp4) fall back to the
    torch reference with equal results; a NaN input, backend="cuda" and a value that overflows int8 scales are
    refused with ValueError; auto on CPU resolves to torch."""
    x = _x((1, 3, 4, 24))
    # D=24 is not a power of two for channel_token_group; static and fp8 specs: torch reference
    for spec in (TensorQuantSpec("int4", PerChannelTokenGroup(8)), TensorQuantSpec("int8", PerChannel()),
                 TensorQuantSpec("fp8_e4m3"), TensorQuantSpec("nvfp4", PerTokenGroup(16))):
        assert K.triton_supports(spec, tuple(x.shape)) is not None
        assert torch.equal(K.dequantize(K.quantize(x, spec, backend="triton")), R.fake_quant(x, spec))
    assert K.triton_supports(TensorQuantSpec("int4", PerTokenGroup(8)), (1, 3, 4, 24)) is None
    bad = x.clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        K.quantize(bad, TensorQuantSpec("int4", PerToken()), backend="triton")
    with pytest.raises(ValueError, match="backend"):
        K.quantize(x, TensorQuantSpec("int4", PerToken()), backend="cuda")
    with pytest.raises(ValueError, match="overflows"):
        K.quantize(torch.full((1, 1, 1, 8), 1e30), TensorQuantSpec("int8", PerToken()), backend="triton")
    # auto on CPU stays on the reference
    spec = TensorQuantSpec("int4", PerToken())
    assert K._resolve("auto", torch.device("cpu"), spec, (1, 1, 1, 8)) == "torch"
