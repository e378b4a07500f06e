"""Trellis-coded quantization of rows with a bitshift trellis (torch reference).

The ``int4`` preset's values use it (:func:`kvcal.formats.quant.quantize` ``trellis=``; the table is
fitted per layer by :func:`kvcal.search.tables.fit_trellis`).

A row ``u [N]`` (e.g. one token's Hadamard-rotated value head divided by its scale) is stored as
``N`` codes of ``b`` bits — the same payload as plain ``b``-bit codes — but a code does not index a
fixed level: element ``i`` reads back as

    ``û_i = table[w_i]``,  ``w_i = (c_{i−m} ‖ … ‖ c_{i−1} ‖ c_i) mod 2^(ν+b)``

i.e. the last ``ν + b`` bits of the code stream up to and including ``c_i`` (codes most
significant first, ``c_j = 0`` for ``j < 0``; ``m = ceil(ν / b)``). The previous ``ν`` bits are
the trellis *state*, so consecutive elements share bits and a row's ``2^(b·N)`` code sequences
select from ``2^(ν+b)`` table entries in a way a scalar quantizer cannot. This is the "bitshift
trellis" of QTIP (Tseng et al., "QTIP: Quantization with Trellises and Incoherence Processing",
NeurIPS 2024, §3), a form of trellis-coded quantization (Marcellin & Fischer, IEEE Trans. Commun.
38(1), 1990); the encoder is the Viterbi algorithm (exact minimum squared error over all code
sequences of the row), decoding is a table gather — random access, no sequential state.

The table is fitted to data by the generalized Lloyd algorithm (:func:`fit_table`: Viterbi-encode
the training rows, then set every used entry to the mean of the elements that chose it; the
training distortion never increases).

Measured on the embedded model (``diagnostics/probe_trellis.py``, tables fitted on
``calibration_sets/chat.jsonl``): Hadamard-rotated value rows at 4 bits, ``ν = 6``, have 0.9–1.2 dB
lower MSE than with the fitted 16-level table (all 30 layers), and the model's V-only mean KL on
2 × 1024 wikitext windows fell from 4.81e-3 to 3.78e-3 (all sides: 7.54e-3 → 6.19e-3).

Shapes: ``u`` float ``[R, N]`` (rows × elements), codes int64 ``[R, N]`` in ``[0, 2^b)``, table
float ``[2^(ν+b)]``. ``ν`` is inferred from the table's length and must satisfy ``b ≤ ν ≤ 16``.
Errors: ``ValueError`` for bad shapes, widths, non-finite inputs or tables.
"""

from __future__ import annotations

import torch

MAX_NU = 16
#: rows encoded per Viterbi chunk (bounds the [rows, 2^(ν+b)] working set)
CHUNK_ROWS = 8192


def _nu(table: torch.Tensor, bits: int) -> int:
    if not 1 <= bits <= 8:
        raise ValueError(f"trellis codes need 1..8 bits, got bits={bits}")
    if table.ndim != 1 or table.numel() < 2 or table.numel() & (table.numel() - 1):
        raise ValueError(f"the trellis table must be 1-D with a power-of-two length 2^(nu+bits), got shape "
                         f"{tuple(table.shape)}")
    nu = table.numel().bit_length() - 1 - bits
    if not bits <= nu <= MAX_NU:
        raise ValueError(f"a {table.numel()}-entry table with {bits}-bit codes gives nu={nu}; "
                         f"the trellis needs bits <= nu <= {MAX_NU} (table length 2^(nu+bits))")
    if not table.is_floating_point() or not bool(torch.isfinite(table).all()):
        raise ValueError("the trellis table must be finite floats")
    return nu


def windows(codes: torch.Tensor, bits: int, nu: int) -> torch.Tensor:
    """Table index ``w_i`` (int64 ``[R, N]``) of every element: the last ``ν + b`` bits of the code
    stream ending with ``c_i`` (module docstring). ``codes`` int ``[R, N]`` in ``[0, 2^b)``."""
    c = codes.long()
    w = c.clone()
    for j in range(1, -(-nu // bits) + 1):
        if j >= c.shape[-1]:
            break
        w[..., j:] |= c[..., :-j] << (bits * j)
    return w & ((1 << (nu + bits)) - 1)


def decode(codes: torch.Tensor, table: torch.Tensor, bits: int) -> torch.Tensor:
    """Reconstruction ``table[w_i]`` ``[R, N]`` (the table's dtype) of codes ``[R, N]``.
    Raises ``ValueError`` for a bad table or codes outside ``[0, 2^bits)``."""
    nu = _nu(table, bits)
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= 1 << bits):
        raise ValueError(f"trellis codes must lie in [0, {1 << bits})")
    return table[windows(codes, bits, nu)]


def encode(u: torch.Tensor, table: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes int64 ``[R, N]`` minimizing ``Σ_i (u_i − table[w_i])²`` for every row of ``u [R, N]``
    (Viterbi; the stream starts in state 0, the end state is free). Exact: the result's
    distortion equals the minimum over all ``2^(b·N)`` code sequences (ties to the lower
    predecessor). Cost ``O(R · N · 2^(ν+b))`` time, ``O(R · N · 2^ν)`` bytes of back-pointers per
    chunk of :data:`CHUNK_ROWS` rows. Raises ``ValueError`` for a non-2-D, non-finite ``u`` or a bad table."""
    nu = _nu(table, bits)
    if u.ndim != 2:
        raise ValueError(f"encode takes rows [R, N], got shape {tuple(u.shape)}")
    if not bool(torch.isfinite(u).all()):
        raise ValueError("encode got NaN/Inf elements")
    if u.numel() == 0:
        return torch.zeros(u.shape, dtype=torch.long, device=u.device)
    return torch.cat([_viterbi(c, table.to(u.device, torch.float32), bits, nu)
                      for c in u.float().split(CHUNK_ROWS)])


def _viterbi(u: torch.Tensor, table: torch.Tensor, bits: int, nu: int) -> torch.Tensor:
    R, N = u.shape
    S, C = 1 << nu, 1 << bits
    M = S // C
    # table entry h·2^ν + s' (predecessor's top b bits h, new state s' = m·2^b + c), laid out [s', h] so the
    # minimum over the C predecessors h·2^(ν−b) + m runs over the innermost, contiguous axis
    Tt = table.view(C, S).t().reshape(1, S * C)
    cost = torch.full((R, S), float("inf"), device=u.device)
    cost[:, 0] = 0.0
    back = torch.empty((N, R, S), dtype=torch.uint8 if bits <= 8 else torch.int16, device=u.device)
    for i in range(N):
        prev = cost.view(R, C, M).transpose(1, 2).unsqueeze(2)  # [R, m, 1, h]: state h·2^(ν−b) + m
        tot = (u[:, i, None] - Tt).square_().view(R, M, C, C).add_(prev)  # [R, m, c, h]
        best, h = tot.min(-1)
        cost = best.reshape(R, S)
        back[i] = h.reshape(R, S)
    s = cost.argmin(1)
    codes = torch.empty((R, N), dtype=torch.long, device=u.device)
    for i in range(N - 1, -1, -1):
        codes[:, i] = s & (C - 1)
        h = back[i].gather(1, s[:, None])[:, 0].long()
        s = h * M + (s >> bits)
    return codes


def fit_table(u: torch.Tensor, bits: int, nu: int, iters: int = 16, seed: int = 0) -> torch.Tensor:
    """Table ``float32 [2^(ν+b)]`` fitted to the rows ``u [R, N]`` by the generalized Lloyd
    algorithm: start from i.i.d. N(0, 1) entries (``seed``; the rows should be normalized to unit
    RMS), then ``iters`` rounds of :func:`encode` and centroid updates (entries no element chose keep
    their value). The training distortion is non-increasing from round to round. Raises
    ``ValueError`` for bad ``bits`` / ``nu`` or rows :func:`encode` refuses."""
    if not 1 <= bits <= 8 or not bits <= nu <= MAX_NU:
        raise ValueError(f"fit_table needs 1 <= bits <= 8 and bits <= nu <= {MAX_NU}, got bits={bits}, nu={nu}")
    if iters < 0:
        raise ValueError(f"iters must be >= 0, got {iters}")
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(1 << (nu + bits), generator=g)
    uf = u.float().cpu()
    for _ in range(iters):
        w = windows(encode(uf, table, bits), bits, nu).flatten()
        cnt = torch.zeros_like(table).index_add_(0, w, torch.ones(w.numel()))
        tot = torch.zeros(table.numel(), dtype=torch.float64).index_add_(0, w, uf.flatten().double())
        table = torch.where(cnt > 0, (tot / cnt.clamp_min(1).double()).float(), table)
    return table


def distortion(u: torch.Tensor, table: torch.Tensor, bits: int) -> float:
    """Mean squared error per element (float, units of ``u²``) of :func:`encode` then :func:`decode`."""
    return float((decode(encode(u, table, bits), table, bits).float() - u.float()).pow(2).mean())


__all__ = ["encode", "decode", "windows", "fit_table", "distortion", "MAX_NU"]
