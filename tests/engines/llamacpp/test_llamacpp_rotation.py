"""llama.cpp's Hadamard rotation of quantized caches (``kvcal.engines.llamacpp.rotation``) against a float64
Sylvester matrix, and when llama.cpp turns it on."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.llamacpp import sylvester

from kvcal.engines.llamacpp import rotation as R
from kvcal.errors import KvcalError


def _grid(shape, seed=0) -> torch.Tensor:
    """Integers in [-512, 512) over 16: every partial sum of 64 of them, and their products by 1/8, are exact in
    float32 (< 2^24 units of 1/128), so an exact float64 result is the exact f32 one too."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-512, 512, shape, generator=g).float() / 16


@pytest.mark.parametrize("d,want", [(64, 64), (128, 128), (256, 256), (192, 64), (320, 64), (512, 512), (96, 0),
                                    (32, 0)])
def test_k_rotation_size(d, want):
    """``build_input_k_rot``: the largest power of two >= 64 dividing head_dim (do/while from 64), none unless
    head_dim % 64 == 0 (``attn_rot_k``); V is always 64 when head_dim % 64 == 0."""
    assert R.k_rot_size(d) == want
    assert R.v_rot_size(d) == (64 if d % 64 == 0 else 0)


def test_fwht_is_the_sylvester_matrix_exactly():
    """On the exact grid, ``ggml_fwht`` of each 64-chunk equals float64 ``H_64 @ chunk`` bit for bit (scale 1/8
    exact, sums exact), in Sylvester order: ``H[i][j] = (-1)^popcount(i & j) / 8``."""
    x = _grid((3, 2, 5, 128))
    h = sylvester(64)
    assert all(h[i, j] == (-1) ** bin(i & j).count("1") / 8 for i in range(64) for j in range(64))
    want = np.einsum("ij,...kj->...ki", h, x.double().numpy().reshape(3, 2, 5, 2, 64)).reshape(3, 2, 5, 128)
    assert np.array_equal(R.ggml_fwht(x, 64).double().numpy(), want)


def test_fwht_is_orthonormal_and_its_own_inverse():
    """Rows of ``fwht(I)`` are orthonormal in float64 (entries exactly ±1/8), and ``fwht(fwht(x)) == x`` exactly
    on the grid (H symmetric, H·H = I, all intermediate values exact)."""
    m = R.ggml_fwht(torch.eye(64), 64).double()
    assert set(m.abs().unique().tolist()) == {0.125}
    assert torch.equal(m @ m.T, torch.eye(64, dtype=torch.float64))
    x = _grid((4, 64), 1)
    assert torch.equal(R.ggml_fwht(R.ggml_fwht(x, 64), 64), x)


def test_fwht_128_within_f32_rounding_of_float64():
    """n = 128: the scale ``1.0f/sqrtf(128)`` is inexact, so compare with float64 ``H_128 @ x`` within the f32
    error of the algorithm: the scaled input carries <= 2 ulp-relative errors (sqrt, division, product:
    3·2^-24 relative) and each of the 7 butterfly stages one rounding of a partial sum bounded by
    ``Σ|x|/sqrt(128)``, so |err| <= (3 + 7)·2^-24·Σ|x|/sqrt(128)."""
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(2))
    want = x.double().numpy() @ sylvester(128).T
    bound = 10 * 2**-24 * x.double().abs().sum(-1, keepdim=True).numpy() / np.sqrt(128)
    assert (np.abs(R.ggml_fwht(x, 128).double().numpy() - want) <= bound).all()


@pytest.mark.parametrize("raw,on", [(None, True), ("1", False), ("0", True), ("2x", False), ("abc", True),
                                    ("", True), ("-1", False)])
def test_rotation_default_follows_the_env_switch(monkeypatch, raw, on):
    """``LLAMA_ATTN_ROT_DISABLE`` read with C ``atoi`` (leading integer, else 0): non-zero disables."""
    if raw is None:
        monkeypatch.delenv(R.DISABLE_ENV, raising=False)
    else:
        monkeypatch.setenv(R.DISABLE_ENV, raw)
    assert R.rotation_default() is on


@pytest.mark.parametrize("call", [lambda: R.ggml_fwht(torch.zeros(64), 48), lambda: R.ggml_fwht(torch.zeros(96), 64),
                                  lambda: R.k_rot_size(0)])
def test_bad_rotation_input(call):
    """A non-power-of-two size, a length not a multiple of it, or a bad head_dim: one KvcalError."""
    with pytest.raises(KvcalError):
        call()
