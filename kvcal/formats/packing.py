"""Bit packing of unsigned integer codes along the last dimension (torch reference).

Layouts (little-endian, element 0 in the lowest bits; these are the byte layouts the runtime
cache stores and the Triton kernels reproduce):

* 8 bits: one code per byte (no-op).
* 4 bits: two codes per byte, ``byte = c[2i] | c[2i+1] << 4`` (NVFP4's nibble order).
* 2 bits: four codes per byte, ``byte = c[4i] | c[4i+1] << 2 | c[4i+2] << 4 | c[4i+3] << 6``.
* 3, 5, 6 bits: dense, ``n`` codes per ``m`` bytes (3 bits: 8 per 3, 5 bits: 8 per 5, 6 bits: 4 per
  3): ``w = sum_j c[n·i+j] << b·j`` (an ``8m``-bit word) stored little-endian as
  ``w & 255, w >> 8 & 255, …``.

Per-channel widths (:func:`pack_channels`): a row of ``D`` codes whose channel ``c`` has its own
width ``w_c`` (1–8 bits) is one little-endian bit stream, channel ``c`` at bit offset
``Σ_{c'<c} w_c'``; the row takes ``ceil(Σ w_c / 8)`` bytes. With equal widths this is the same byte
layout as above (e.g. 4 bits: ``c[0] | c[1] << 4``).

``codes``: any shape ``[..., N]``, integer dtype, values in ``[0, 2^bits)``; ``N`` must be a
multiple of the values per unit (2, 4 or 8) — callers pad first (see
:meth:`kvcal.formats.spec.TensorQuantSpec.padded_dims`). Output: ``uint8 [..., N*bits/8]``.
"""

from __future__ import annotations

import torch

from kvcal.formats.spec import PACK_UNITS

_WIDTHS = tuple(sorted((b for b in PACK_UNITS if b <= 8), reverse=True))  # 8, 6, 5, 4, 3, 2
_WIDTHS_TEXT = ", ".join(map(str, _WIDTHS[:-1])) + f" or {_WIDTHS[-1]}"


def _word_dtype(bpu: int) -> torch.dtype:
    """Integer dtype holding one packing unit's word: int32 up to 3 bytes (int2/3/4/6), int64 for int5's 5."""
    return torch.int32 if bpu <= 3 else torch.int64


def _check(codes: torch.Tensor, bits: int) -> tuple[int, int]:
    if bits not in _WIDTHS:
        raise ValueError(f"can pack {_WIDTHS_TEXT}-bit codes, got bits={bits}")
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
    if bits == 8:
        return codes.to(torch.uint8)
    wt = _word_dtype(bpu)
    c = codes.to(wt)
    lead = c.shape[:-1]
    units = c.shape[-1] // vpu
    c = c.reshape(*lead, units, vpu)  # [..., N/vpu, vpu]
    shifts = torch.arange(vpu, dtype=wt, device=c.device) * bits
    w = (c << shifts).sum(-1, keepdim=True)  # [..., N/vpu, 1]  bits are disjoint, so sum == or
    if bpu > 1:
        w = torch.cat([(w >> (8 * j)) & 255 for j in range(bpu)], dim=-1)  # [..., N/vpu, bpu]
    return w.reshape(*lead, units * bpu).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int, n: int | None = None) -> torch.Tensor:
    """Inverse of :func:`pack`: ``uint8 [..., M]`` -> ``uint8`` codes ``[..., M*8/bits]``
    (or the first ``n`` of them). Raises ``ValueError`` on a wrong dtype or misaligned ``M``."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed data must be uint8, got {packed.dtype}")
    if bits not in _WIDTHS:
        raise ValueError(f"can unpack {_WIDTHS_TEXT}-bit codes, got bits={bits}")
    vpu, bpu = PACK_UNITS[bits]
    if packed.shape[-1] % bpu:
        raise ValueError(f"last dimension {packed.shape[-1]} is not a multiple of {bpu} bytes")
    if bits == 8:
        out = packed
    else:
        lead = packed.shape[:-1]
        units = packed.shape[-1] // bpu
        wt = _word_dtype(bpu)
        p = packed.to(wt).reshape(*lead, units, bpu)  # [..., units, bpu]
        w = p[..., 0]  # [..., units]
        for j in range(1, bpu):
            w = w | (p[..., j] << (8 * j))
        shifts = torch.arange(vpu, dtype=wt, device=p.device) * bits
        out = ((w.unsqueeze(-1) >> shifts) & (2**bits - 1)).reshape(*lead, units * vpu).to(torch.uint8)
    return out if n is None else out[..., :n]


def packed_size(n: int, bits: int) -> int:
    """Bytes that :func:`pack` produces for ``n`` codes (``n`` rounded up to a whole unit)."""
    vpu, bpu = PACK_UNITS[bits]
    return -(-n // vpu) * bpu


def _channel_offsets(widths: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Bit offsets ``[H, D]`` (int64) of each channel in its head's row, and the row's bytes."""
    if widths.ndim != 2:
        raise ValueError(f"channel widths must be [H, D], got shape {tuple(widths.shape)}")
    if widths.dtype == torch.bool or (widths.is_floating_point() and not bool((widths == widths.round()).all())):
        raise ValueError("channel widths must be integers (1..8 bits)")
    w = widths.to(torch.int64)
    if w.numel() and (int(w.min()) < 1 or int(w.max()) > 8):
        raise ValueError("channel widths must lie in 1..8 bits")
    total = w.sum(-1)
    if w.numel() and int(total.min()) != int(total.max()):
        raise ValueError(f"every head's row must hold the same number of bits, got {total.tolist()}")
    off = torch.cumsum(w, -1) - w
    return off, (-(-int(total[0]) // 8) if w.numel() else 0)


def pack_channels(codes: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """Pack codes ``[B, H, S, D]`` whose channel ``(h, c)`` is ``widths[h, c]`` bits wide (1–8,
    the same total per head) into ``uint8 [B, H, S, ceil(Σ_c widths[h, c] / 8)]`` (module docstring).

    Raises ``ValueError`` for a widths table that is not ``[H, D]``, widths outside 1–8, unequal
    per-head totals, or a code that does not fit its channel's width."""
    if codes.ndim != 4 or tuple(widths.shape) != tuple(codes.shape[1:2]) + tuple(codes.shape[3:]):
        raise ValueError(f"codes [B,H,S,D] {tuple(codes.shape)} do not match widths [H,D] {tuple(widths.shape)}")
    off, nbytes = _channel_offsets(widths)
    w = widths.to(torch.int64).to(codes.device)
    if codes.dtype == torch.bool or (codes.is_floating_point() and not bool((codes == codes.round()).all())):
        raise ValueError("codes must be integers")
    c = codes.to(torch.int64)
    if c.numel() and (bool((c < 0).any()) or bool((c >= (1 << w)[None, :, None, :]).any())):
        raise ValueError("a code does not fit its channel's width")
    off = off.to(codes.device)
    B, H, S, D = codes.shape
    shifted = c << (off % 8)[None, :, None, :]  # at most 15 bits: spans two bytes
    byte = (off // 8)[None, :, None, :].expand(B, H, S, D)
    out = torch.zeros(B, H, S, nbytes + 1, dtype=torch.int64, device=codes.device)
    out.scatter_add_(-1, byte, shifted & 255)  # bits are disjoint, so add == or
    out.scatter_add_(-1, byte + 1, shifted >> 8)
    return out[..., :nbytes].to(torch.uint8)


def unpack_channels(packed: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_channels`: ``uint8 [B, H, S, M]`` -> ``uint8`` codes ``[B, H, S, D]``.
    Raises ``ValueError`` on a wrong dtype or a row size that does not match ``widths``."""
    if packed.dtype != torch.uint8 or packed.ndim != 4:
        raise ValueError(f"packed data must be uint8 [B,H,S,M], got {packed.dtype} {tuple(packed.shape)}")
    off, nbytes = _channel_offsets(widths)
    if packed.shape[-1] != nbytes or packed.shape[1] != widths.shape[0]:
        raise ValueError(f"packed rows of {packed.shape[-1]} bytes do not match widths (need {nbytes} bytes per row)")
    off = off.to(packed.device)
    w = widths.to(torch.int64).to(packed.device)
    p = torch.cat([packed.to(torch.int64), packed.new_zeros(*packed.shape[:-1], 1).to(torch.int64)], -1)
    B, H, S, _ = packed.shape
    byte = (off // 8)[None, :, None, :].expand(B, H, S, -1)
    word = p.gather(-1, byte) | (p.gather(-1, byte + 1) << 8)
    return ((word >> (off % 8)[None, :, None, :]) & ((1 << w) - 1)[None, :, None, :]).to(torch.uint8)
