"""The variants' internals: query-aware rounding matrices, per-channel widths, fitted level tables
and trellis codes — their checks, encoding to integer codes and decoding back to values
(:func:`kvcal.formats.quant.quantize` chooses among them by the tables it is given)."""

from __future__ import annotations

import torch

from kvcal.formats.fp8 import FP8_FORMATS, quantize_fp8
from kvcal.formats.granularity import PerChannelTokenGroup, PerToken, PerTokenGroup
from kvcal.formats.layout import _Layout
from kvcal.formats.scales import E2M1_VALUES
from kvcal.formats.spec import TensorQuantSpec
from kvcal.formats.variants import ChannelWidths, Codebook, QuantTables, Rounding


def rounding_matrix(sigma: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    """``U`` for query-aware rounding from second moments ``sigma [H, D, D]`` (float, symmetric PSD).

    ``U = cholesky((Σ + damp·mean(diag Σ)·I)⁻¹, upper=True)`` in float64, returned float32 — the
    damping of GPTQ (1% of the mean diagonal) keeps it defined for rank-deficient ``Σ``. Raises
    ``ValueError`` for a non-square / non-finite input."""
    if sigma.ndim != 3 or sigma.shape[-1] != sigma.shape[-2] or not torch.isfinite(sigma).all():
        raise ValueError(f"sigma must be a finite [H, D, D] tensor, got shape {tuple(sigma.shape)}")
    m = sigma.double()
    m = (m + m.transpose(-1, -2)) / 2
    D = m.shape[-1]
    lam = damp * m.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(1e-12)
    m = m + lam[:, None, None] * torch.eye(D, dtype=m.dtype, device=m.device)
    return torch.linalg.cholesky(torch.linalg.inv(m), upper=True).float()


def unit_rounding(U: torch.Tensor) -> torch.Tensor:
    """The stored form of a rounding matrix: ``Ũ = U / diag(U)`` row-wise, strict upper triangle
    rounded to float8 e4m3 (OCP FP8), unit diagonal, zeros below; float32 ``[H, D, D]``.

    Channel-ordered rounding only uses ``U[d, d+1:] / U[d, d]`` (the error feedback of
    :func:`quantize` with ``rounding=``), so ``Ũ`` rounds exactly like ``U`` up to the 8-bit
    rounding of those ratios, and the runtime keeps ``H · D(D−1)/2`` bytes per side instead of a
    float16 triangle. Idempotent: a ``Ũ`` maps to itself. Raises ``ValueError`` for a non-``[H, D, D]``
    input, a non-positive / non-finite diagonal, or a ratio beyond e4m3's ±448 (cannot happen for
    :func:`rounding_matrix` with its 1% damping, whose ratios stay below ``√(1 + 100·D)``)."""
    if U.ndim != 3 or U.shape[-1] != U.shape[-2]:
        raise ValueError(f"rounding matrix must be [H, D, D], got shape {tuple(U.shape)}")
    U = U.float()
    d = U.diagonal(dim1=-2, dim2=-1)
    if not torch.isfinite(U).all() or not bool((d > 0).all()):
        raise ValueError("rounding matrix must be finite with a positive diagonal (an upper Cholesky factor)")
    r = torch.triu(U / d[..., None], diagonal=1)
    if float(r.abs().max()) > 448.0:
        raise ValueError(f"rounding ratio {float(r.abs().max()):.4g} exceeds float8 e4m3's 448; "
                         "recompute it with more damping (rounding_matrix(damp=...))")
    eye = torch.eye(U.shape[-1], dtype=torch.float32, device=U.device)
    return r.to(torch.float8_e4m3fn).float() + eye


def _check_rounding(rounding: torch.Tensor, spec, lay: _Layout) -> torch.Tensor:
    if spec.format.kind != "int":
        raise ValueError(f"query-aware rounding is defined for int formats, not {spec.format.value}")
    if lay.D_g != lay.D:
        raise ValueError("query-aware rounding needs channel groups that divide head_dim")
    U = rounding.float()
    if U.ndim != 3 or U.shape[-2:] != (lay.D, lay.D) or U.shape[0] not in (1, lay.H):
        raise ValueError(f"rounding must be [H, D, D] = [{lay.H}, {lay.D}, {lay.D}], got {tuple(U.shape)}")
    d = U.diagonal(dim1=-2, dim2=-1)
    if not torch.isfinite(U).all() or not bool((d > 0).all()):
        raise ValueError("rounding must be finite with a positive diagonal (an upper Cholesky factor)")
    return U.expand(lay.H, lay.D, lay.D)


def _tensor_arg(value, message: str) -> torch.Tensor:
    """``torch.as_tensor(value)``, or ``ValueError(message)`` when it is not tensor-like."""
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(message) from None


def _over_scale(xg: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``xg / s`` where ``s > 0``, 0 where the group's scale is 0 (all-zero groups)."""
    return torch.where(s > 0, xg / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(xg))


def check_channel_bits(channel_bits, spec: TensorQuantSpec, H: int, D: int) -> torch.Tensor:
    """Validated per-channel widths ``[H, D]`` (int64) for ``spec`` (module docstring).

    Per-channel widths need an asymmetric int spec with per-channel token groups
    (:class:`~kvcal.formats.granularity.PerChannelTokenGroup`: each group's range is measured,
    so its scale can follow the channel's width), ``D`` a multiple of the spec's packing unit,
    integer widths in 1–8 and every head's widths summing to ``spec.bits · D``. Raises
    ``ValueError`` naming the first rule broken."""
    if spec.format.kind != "int" or spec.symmetric:
        raise ValueError("per-channel bit widths need an asymmetric int spec")
    if not isinstance(spec.granularity, PerChannelTokenGroup):
        raise ValueError(f"per-channel bit widths need per-channel token groups (ranges measured per group), "
                         f"not {spec.granularity.name}")
    if spec.padded_dims(1, D)[1] != D:
        raise ValueError(f"per-channel bit widths need head_dim a multiple of the {spec.bits}-bit packing unit")
    t = _tensor_arg(channel_bits, f"channel_bits must be an integer tensor [H, D], got {type(channel_bits).__name__}")
    if t.dtype == torch.bool or t.is_complex() or (t.is_floating_point() and not bool((t == t.round()).all())):
        raise ValueError("channel_bits must be integers (bit widths 1..8)")
    try:
        w = torch.broadcast_to(t, (H, D)).to(torch.int64)
    except RuntimeError:
        raise ValueError(f"channel_bits of shape {tuple(t.shape)} does not fit [H, D] = {(H, D)}") from None
    if w.numel() and (int(w.min()) < 1 or int(w.max()) > 8):
        raise ValueError("channel_bits must lie in 1..8")
    bad = (w.sum(-1) != spec.bits * D).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"channel_bits of heads {bad} do not sum to {spec.bits}·D = {spec.bits * D} bits "
                         "(the spec's row size)")
    return w


def check_levels(levels, spec: TensorQuantSpec, H: int) -> torch.Tensor:
    """Validated non-uniform levels ``float32 [H, 2^b]`` for ``spec`` (module docstring).

    Levels need a symmetric int2–int6 spec with a per-token or per-token-group granularity
    (each group's absmax is measured when it is written), and a finite, non-decreasing table of
    ``2^b`` values in ``[-1, 1]`` per KV head (shape ``[2^b]`` or ``[H, 2^b]``). Raises
    ``ValueError`` naming the first rule broken."""
    if spec.format.kind != "int" or not spec.symmetric or spec.bits > 6:
        raise ValueError(f"non-uniform levels need a symmetric int2–int6 spec, got {spec.format.value}"
                         f"{'' if spec.symmetric else ' asymmetric'}")
    if not isinstance(spec.granularity, (PerToken, PerTokenGroup)):
        raise ValueError(f"non-uniform levels need per-token or per-token-group scales, not {spec.granularity.name}")
    n = 2**spec.bits
    t = _tensor_arg(levels, f"levels must be a float tensor [H, {n}], got {type(levels).__name__}")
    if not t.is_floating_point():
        raise ValueError(f"levels must be a float tensor [H, {n}], got {t.dtype}")
    try:
        L = torch.broadcast_to(t.float(), (H, n)).contiguous()
    except RuntimeError:
        raise ValueError(f"levels of shape {tuple(t.shape)} do not fit [H, 2^b] = {(H, n)}") from None
    if not bool(torch.isfinite(L).all()) or bool((L.abs() > 1).any()):
        raise ValueError("levels must be finite and lie in [-1, 1] (units of the group's scale)")
    if bool((L[:, 1:] < L[:, :-1]).any()):
        raise ValueError("levels must be non-decreasing along the last dimension")
    return L


#: Trellis tables are int8 in units of 1/TRELLIS_UNIT of the row's scale; the largest state count.
TRELLIS_UNIT, TRELLIS_MAX_NU = 32, 10


def check_trellis(trellis, spec: TensorQuantSpec, D: int) -> torch.Tensor:
    """Validated trellis table ``float32 [2^(ν+b)]`` for ``spec`` and head_dim ``D`` (module docstring).

    Needs a symmetric int2–int4 spec with per-token scales, ``D`` a multiple of the spec's packing
    unit, and a 1-D table of ``2^(ν+b)`` entries (``b ≤ ν ≤ 10``), each a multiple of
    ``1/TRELLIS_UNIT`` in ``[-127, 127] / TRELLIS_UNIT``. Raises ``ValueError`` naming the first rule broken."""
    if spec.format.kind != "int" or not spec.symmetric or not 2 <= spec.bits <= 4:
        raise ValueError(f"a trellis table needs a symmetric int2–int4 spec, got {spec.format.value}"
                         f"{'' if spec.symmetric else ' asymmetric'}")
    if not isinstance(spec.granularity, PerToken):
        raise ValueError(f"a trellis table needs per-token scales (one row per token and head), not {spec.granularity.name}")
    if spec.padded_dims(1, D)[1] != D:
        raise ValueError(f"a trellis table needs head_dim a multiple of the {spec.bits}-bit packing unit")
    t = _tensor_arg(trellis, f"trellis must be a float tensor [2^(nu+bits)], got {type(trellis).__name__}")
    n = t.numel()
    if t.ndim != 1 or not t.is_floating_point() or n < 2 or n & (n - 1):
        raise ValueError(f"trellis must be a 1-D float tensor of 2^(nu+bits) entries, got {t.dtype} {tuple(t.shape)}")
    nu = n.bit_length() - 1 - spec.bits
    if not spec.bits <= nu <= TRELLIS_MAX_NU:
        raise ValueError(f"a {n}-entry trellis table with {spec.bits}-bit codes has nu={nu}; "
                         f"nu must lie in {spec.bits}..{TRELLIS_MAX_NU}")
    T = t.float().contiguous()
    k = T * TRELLIS_UNIT
    if not bool(torch.isfinite(T).all()) or bool((k != k.round()).any()) or bool((k.abs() > 127).any()):
        raise ValueError(f"trellis entries must be multiples of 1/{TRELLIS_UNIT} within ±127/{TRELLIS_UNIT} "
                         "(an int8 table; round with kvcal.search.tables.fit_trellis)")
    return T


def _trellis_codes(xg, s, T: torch.Tensor, bits: int) -> torch.Tensor:
    """Viterbi codes (fp32) of the rows ``xg / s`` ``[B,H,S,D]`` (rows with scale 0 encode zeros)."""
    from kvcal.formats import trellis as tr

    u = _over_scale(xg, s)
    return tr.encode(u.reshape(-1, u.shape[-1]), T.to(u.device), bits).reshape(u.shape).float()


def _trellis_values(q, s, T: torch.Tensor, bits: int) -> torch.Tensor:
    """``T[w_i] * s`` for codes ``q [B,H,S,D]``."""
    from kvcal.formats import trellis as tr

    return tr.decode(q.long().reshape(-1, q.shape[-1]), T.to(q.device), bits).reshape(q.shape) * s


def _level_codes(xg, s, L: torch.Tensor, lay: _Layout) -> torch.Tensor:
    """Index of the nearest level (ties to the lower one) of ``xg / s``, per KV head (dim 1); groups
    with scale 0 (all zero) get the level nearest 0 (they dequantize to 0 whatever it is)."""
    u = _over_scale(xg, s)
    mids = ((L[:, 1:] + L[:, :-1]) * 0.5).to(u.device)
    q = torch.empty_like(u)
    for h in range(lay.H):
        q[:, h] = torch.bucketize(u[:, h].contiguous(), mids[h].contiguous()).to(u.dtype)
    return q


def _level_values(q, s, L: torch.Tensor) -> torch.Tensor:
    """``L[h, q] * s`` for codes ``q`` (any int/float dtype) with heads on dim 1."""
    H, n = L.shape
    hidx = torch.arange(H, device=q.device).reshape(1, H, *([1] * (q.ndim - 2)))
    return L.to(q.device).flatten()[hidx * n + q.long()] * s


def _top_codes(w: torch.Tensor, lay: _Layout, device) -> torch.Tensor:
    """``2^W − 1`` as fp32 broadcastable to the grouped view."""
    return lay.from_stored(((2.0 ** w.to(device).float()) - 1)[None, :, None, :])


def _codes_ordered(xg, s, zp, spec, lay: _Layout, U: torch.Tensor, top=None) -> torch.Tensor:
    """Codes (fp32, grouped layout) by channel-ordered rounding with error feedback (module docstring)."""
    x = lay.ungroup(xg).clone()  # [B,H,S_g,D]
    sf = lay.ungroup(s.expand_as(xg)) if s.shape != xg.shape else lay.ungroup(s)
    zf = None if zp is None else (lay.ungroup(zp.expand_as(xg)) if zp.shape != xg.shape else lay.ungroup(zp))
    lo, hi = (spec.qmin, spec.qmax) if spec.symmetric else (0, spec.qmax)
    tf = None if top is None else lay.ungroup(top.expand_as(xg))
    q = torch.empty_like(x)
    Ub = U.to(x.device)[None, :, None]  # [1,H,1,D,D]
    D = x.shape[-1]
    for d in range(D):
        sd = sf[..., d]
        if zf is None:
            c = torch.round(x[..., d] / sd).clamp_(lo, hi)
            deq = c * sd
        else:
            c = torch.round(x[..., d] / sd + zf[..., d])
            c = c.clamp_(lo, hi) if tf is None else torch.minimum(c.clamp_(min=0), tf[..., d])
            deq = (c - zf[..., d]) * sd
        q[..., d] = c
        if d + 1 < D:
            err = (x[..., d] - deq) / Ub[..., d, d]
            x[..., d + 1 :] -= err[..., None] * Ub[..., d, d + 1 :]
    return lay.group(q)


def _codes_for(xg, s, zp, spec, lay: _Layout, tables: QuantTables, top=None) -> torch.Tensor:
    """Codes of the grouped input by the tables' variant (``tables``: checked against the spec, see
    :func:`kvcal.formats.quant.quantize`): a levels codebook's nearest level, nearest-rounding codes, or
    channel-ordered ones with query-aware rounding (``top``: per-channel top codes of allocated widths)."""
    if tables.codebook is Codebook.LEVELS:
        return _level_codes(xg, s, tables.levels, lay)
    if tables.rounding_mode is Rounding.QUERY_AWARE:
        return _codes_ordered(xg, s, zp, spec, lay, _check_rounding(tables.rounding, spec, lay), top)
    if tables.channel_widths is ChannelWidths.SPEC:
        return _codes(xg, s, zp, spec)
    return torch.minimum(torch.round(xg / s + zp).clamp_(min=0), top)  # asymmetric int (checked)


def _codes(xg, s, zp, spec):
    """fp32 grouped input -> codes (fp32 integers for int, e2m1 code for nvfp4, fp8 tensor)."""
    kind = spec.format.kind
    if kind == "fp8":
        return quantize_fp8(xg, s, FP8_FORMATS[spec.format.value])
    if kind == "nvfp4":
        y = _over_scale(xg, s)
        a = y.abs()
        idx = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5)
               + (a >= 3.5) + (a > 5.0))
        sign = ((y < 0) & (idx > 0)).to(torch.uint8) << 3
        return idx | sign
    if spec.symmetric:
        return torch.round(xg / s).clamp_(spec.qmin, spec.qmax)
    return torch.round(xg / s + zp).clamp_(0, spec.qmax)


_E2M1_TABLE = torch.tensor(list(E2M1_VALUES) + [-v for v in E2M1_VALUES], dtype=torch.float32)


def _dequant_codes(q, s, zp, spec, tables: QuantTables | None = None):
    """Values of codes ``q`` (grouped) with scales ``s`` / zero points ``zp``; a levels codebook reads its
    table (``tables.levels``, ``[H, 2^b]``)."""
    tables = QuantTables.coerce(tables)
    if tables.codebook is Codebook.LEVELS:
        return _level_values(q, s, tables.levels)
    kind = spec.format.kind
    if kind == "fp8":
        return q.float() * s
    if kind == "nvfp4":
        return _E2M1_TABLE.to(q.device)[q.long()] * s
    if spec.symmetric:
        return q.float() * s
    return (q.float() - zp) * s


def _levels_arg(levels, spec, lay: _Layout, scale) -> torch.Tensor:
    """Checked levels table (combinations with other tables: refused by :class:`QuantTables`)."""
    if scale is not None:
        raise ValueError("non-uniform levels take the group's absmax as scale; pass clip_ratio, not scale")
    return check_levels(levels, spec, lay.H)


def _trellis_arg(trellis, spec, lay: _Layout, scale, clip_ratio) -> torch.Tensor:
    """Checked trellis table (combinations with other tables: refused by :class:`QuantTables`)."""
    if scale is not None or clip_ratio is not None:
        raise ValueError("trellis rows take their RMS as scale; pass neither scale nor clip_ratio")
    return check_trellis(trellis, spec, lay.D)
