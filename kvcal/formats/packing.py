"""Bit packing of unsigned integer codes along the last dimension (torch reference).

Layouts (little-endian, element 0 in the lowest bits; these are the byte layouts the runtime
cache stores and the Triton kernels reproduce):

* 8 bits: one code per byte (no-op).
* 4 bits: two codes per byte, ``byte = c[2i] | c[2i+1] << 4`` (NVFP4's nibble order).
* 2 bits: four codes per byte, ``byte = c[4i] | c[4i+1] << 2 | c[4i+2] << 4 | c[4i+3] << 6``.
* 3 bits: dense, eight codes per three bytes: ``w = sum_j c[8i+j] << 3j`` (24 bits) stored as
  ``w & 255, w >> 8 & 255, w >> 16``.

``codes``: any shape ``[..., N]``, integer dtype, values in ``[0, 2^bits)``; ``N`` must be a
multiple of the values per unit (2, 4 or 8) — callers pad first (see
:meth:`kvcal.formats.spec.TensorQuantSpec.padded_dims`). Output: ``uint8 [..., N*bits/8]``.
"""

from __future__ import annotations

import torch

from kvcal.formats.spec import PACK_UNITS


def _check(codes: torch.Tensor, bits: int) -> tuple[int, int]:
    if bits not in (8, 4, 3, 2):
        raise ValueError(f"can pack 8, 4, 3 or 2-bit codes, got bits={bits}")
    vpu, bpu = PACK_UNITS[bits]
    if codes.shape[-1] % vpu:
        raise ValueError(
            f"last dimension {codes.shape[-1]} is not a multiple of {vpu} (the {bits}-bit packing unit); "
            "pad it first"
        )
    return vpu, bpu


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned ``bits``-bit codes ``[..., N]`` into ``uint8 [..., N*bits/8]``.

    Raises ``ValueError`` for unsupported widths, a misaligned last dimension, or codes out of
    ``[0, 2^bits)`` (checked: a silent wrap would corrupt neighbours)."""
    vpu, bpu = _check(codes, bits)
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= 2**bits):
        raise ValueError(f"codes must lie in [0, {2**bits - 1}] for {bits}-bit packing")
    c = codes.to(torch.int32)
    if bits == 8:
        return c.to(torch.uint8)
    lead = c.shape[:-1]
    units = c.shape[-1] // vpu
    c = c.reshape(*lead, units, vpu)  # [..., N/vpu, vpu]
    shifts = torch.arange(vpu, dtype=torch.int32, device=c.device) * bits
    w = (c << shifts).sum(-1)  # [..., N/vpu]  bits are disjoint, so sum == or
    if bits == 3:
        w = torch.stack([w & 255, (w >> 8) & 255, (w >> 16) & 255], dim=-1)  # [..., N/8, 3]
    return w.reshape(*lead, units * bpu).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int, n: int | None = None) -> torch.Tensor:
    """Inverse of :func:`pack`: ``uint8 [..., M]`` -> ``uint8`` codes ``[..., M*8/bits]``
    (or the first ``n`` of them). Raises ``ValueError`` on a wrong dtype or misaligned ``M``."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed data must be uint8, got {packed.dtype}")
    if bits not in (8, 4, 3, 2):
        raise ValueError(f"can unpack 8, 4, 3 or 2-bit codes, got bits={bits}")
    vpu, bpu = PACK_UNITS[bits]
    if packed.shape[-1] % bpu:
        raise ValueError(f"last dimension {packed.shape[-1]} is not a multiple of {bpu} bytes")
    if bits == 8:
        out = packed
    else:
        lead = packed.shape[:-1]
        units = packed.shape[-1] // bpu
        p = packed.to(torch.int32).reshape(*lead, units, bpu)  # [..., units, bpu]
        if bits == 3:
            w = p[..., 0] | (p[..., 1] << 8) | (p[..., 2] << 16)  # [..., units]
        else:
            w = p[..., 0]
        shifts = torch.arange(vpu, dtype=torch.int32, device=p.device) * bits
        out = ((w.unsqueeze(-1) >> shifts) & (2**bits - 1)).reshape(*lead, units * vpu).to(torch.uint8)
    return out if n is None else out[..., :n]


def packed_size(n: int, bits: int) -> int:
    """Bytes that :func:`pack` produces for ``n`` codes (``n`` rounded up to a whole unit)."""
    vpu, bpu = PACK_UNITS[bits]
    return -(-n // vpu) * bpu
