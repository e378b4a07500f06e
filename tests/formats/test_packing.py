"""Bit packing: golden byte layouts and exact round trips."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcal.formats.packing import pack, packed_size, unpack


def test_golden_layouts():
    """Packed bytes equal hand-worked little-endian layouts (element 0 in the low bits) for 2, 3, 4, 5, 6 and
    8 bits, the int5 40-bit and int6 24-bit words re-stated with Python integer shifts."""
    assert pack(torch.tensor([1, 2]), 4).tolist() == [0x21]  # element 0 in the low nibble
    assert pack(torch.tensor([1, 2, 3, 0]), 2).tolist() == [1 | 2 << 2 | 3 << 4]
    codes = torch.tensor([1, 2, 3, 4, 5, 6, 7, 0])
    w = sum(int(c) << (3 * i) for i, c in enumerate(codes))
    assert pack(codes, 3).tolist() == [w & 255, (w >> 8) & 255, w >> 16]
    assert pack(torch.tensor([0, 255]), 8).tolist() == [0, 255]
    # int5: eight codes in a 40-bit little-endian word (five bytes); int6: four in 24 bits (three bytes)
    c5 = torch.tensor([31, 1, 17, 0, 30, 5, 9, 22])
    w5 = sum(int(c) << (5 * i) for i, c in enumerate(c5))
    assert w5 >= 2**32  # the word does not fit 32 bits: the packer must not wrap
    assert pack(c5, 5).tolist() == [(w5 >> (8 * j)) & 255 for j in range(5)]
    c6 = torch.tensor([63, 0, 42, 7])
    w6 = 63 | 0 << 6 | 42 << 12 | 7 << 18  # = 0x1EA03F
    assert pack(c6, 6).tolist() == [0x3F, 0xA0, 0x1E] == [(w6 >> (8 * j)) & 255 for j in range(3)]


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from([8, 6, 5, 4, 3, 2]), units=st.integers(0, 12), lead=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_round_trip_exact(bits, units, lead, seed):
    """unpack(pack(codes)) returns the random codes exactly for every width, and the packed length is n*bits/8
    bytes (hypothesis over widths, lengths and seeds)."""
    n = units * {8: 1, 6: 4, 5: 8, 4: 2, 3: 8, 2: 4}[bits]
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (lead, 2, n), generator=g, dtype=torch.uint8)
    p = pack(codes, bits)
    assert p.dtype == torch.uint8 and p.shape[-1] == packed_size(n, bits) == n * bits // 8
    assert torch.equal(unpack(p, bits), codes)


def test_errors():
    """Bad input raises ValueError naming the fault: a length not a multiple of the width's unit, a code
    outside [0, 2^bits - 1], bits=7, non-uint8 packed data, a packed length not a multiple of 3."""
    with pytest.raises(ValueError, match="multiple of 2"):
        pack(torch.tensor([1, 2, 3]), 4)
    with pytest.raises(ValueError, match=r"\[0, 3\]"):
        pack(torch.tensor([4, 0, 0, 0]), 2)
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        pack(torch.tensor([-1, 0]), 4)
    with pytest.raises(ValueError, match="bits=7"):
        pack(torch.zeros(8, dtype=torch.uint8), 7)
    with pytest.raises(ValueError, match=r"\[0, 31\]"):
        pack(torch.tensor([32, 0, 0, 0, 0, 0, 0, 0]), 5)
    with pytest.raises(ValueError, match="uint8"):
        unpack(torch.zeros(4, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="multiple of 3"):
        unpack(torch.zeros(4, dtype=torch.uint8), 3)
