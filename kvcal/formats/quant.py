"""Generic quantize / dequantize / fake-quant of K/V tensors ``[B, H_kv, S, D]`` (the torch spec).

One meaning of ``scale`` everywhere: the dequantization multiplier,

* int symmetric:   ``q = clamp(round(x / scale), -qmax, qmax)``, ``x̂ = q * scale``
  (``qmax = 2^(b-1) - 1``: 127, 31, 15, 7, 3, 1 for int8/6/5/4/3/2);
* int asymmetric:  ``q = clamp(round(x / scale + zero_point), 0, 2^b - 1)``,
  ``x̂ = (q - zero_point) * scale`` with a floating-point ``zero_point`` (= ``-lo / scale``);
* FP8:             ``q = fp8(clamp(x / scale, -max, max))``, ``x̂ = float(q) * scale``;
* NVFP4:           per 16-channel block ``s_b = float(e4m3(amax_b / 6 / g)) * g`` with the fp32
  global scale ``g = amax / (448 * 6)`` (NVIDIA's recipe), ``q = e2m1(clamp(x / s_b, -6, 6))``,
  ``x̂ = e2m1 * s_b``.

``round`` is round-half-to-even (``torch.round``); ``e2m1()`` rounds to the nearest of
``0, .5, 1, 1.5, 2, 3, 4, 6`` with ties to the even code.

Where parameters come from:

* **Static** granularities (per-tensor ``[1,1,1,1]``, per-head ``[1,H,1,1]``, per-channel
  ``[1,H,1,D]``) take the calibrated ``scale`` (and ``zero_point``); without one, the range of
  ``x`` itself is used (an oracle, useful for search and tests).
* **Dynamic** granularities (per-token ``[B,H,S,1]``, per-token-group ``[B,H,S,ceil(D/g)]``,
  per-channel-token-group ``[B,H,ceil(S/g),D]``) compute each group's range when called and
  shrink it by ``clip_ratio`` (``[1,H,1,1]``-broadcastable, default 1): symmetric ranges use
  ``clip_ratio * absmax``; asymmetric ranges ``[lo, hi]`` keep their centre and are shrunk to
  ``clip_ratio * (max - min)`` (``lo = min + (1 - c)/2 * (max - min)``). Values outside the clipped
  range saturate.

Parameters are rounded to their storage dtype *before* quantizing, so the stored scale / zero
point are exactly the ones used: scales round **up** (never saturating the group's own extreme),
zero points to nearest. Asymmetric scales are at least ``|lo| / 2^(m+1)`` (``m`` = mantissa bits
of the zero-point dtype: 2048 for fp16, 256 for bf16) so that the stored zero point is exact to
within half a unit; for groups whose range is tiny next to their offset this widens the step — the
price of a 16-bit zero point. With that, every value inside the (clipped) range dequantizes to within
half a quantization step. A group whose range is zero gets ``scale = 1``.

Query-aware rounding (``rounding=U``, int formats): instead of rounding every element to its
nearest code, channels are rounded in order ``d = 0..D-1`` and each one's rounding error is fed
forward into the channels not yet rounded, OPTQ/GPTQ-style (Frantar et al., ICLR 2023, Alg. 1),
with ``U`` the upper Cholesky factor of ``Σ⁻¹`` (``[H, D, D]``, see :func:`rounding_matrix`). With
``Σ = E[q qᵀ]`` over the queries that read a key, this minimizes the expected *score* error
``E[(qᵀ(k − k̂))²]`` greedily instead of ``‖k − k̂‖²``. The group parameters (scale, zero point) are
those of the plain path, computed from ``x`` before any feedback; fed-back values outside the range
saturate. The stored format is unchanged (dequantization does not need ``U``); kvcal stores
``U`` in its 8-bit unit-diagonal form (:func:`unit_rounding`).

Per-channel bit widths (``channel_bits=W``, asymmetric int, per-channel token groups): channel
``(h, c)`` uses ``W[h, c]`` bits (1–8), i.e. ``2^W − 1`` in place of ``2^b − 1`` in the asymmetric
formulas above, while every head's row keeps the spec's size (``Σ_c W[h, c] = b·D``; packing:
:func:`kvcal.formats.packing.pack_channels`; widths chosen by
:func:`kvcal.search.tables.channel_bit_allocation`).

Non-uniform levels (``levels=L``, symmetric int, per-token or per-token-group): the ``2^b`` codes
index a calibrated, non-decreasing table ``L [H, 2^b]`` in ``[-1, 1]`` instead of the uniform grid:
``scale = clip_ratio * absmax`` of the group (the grid's ``qmax`` is 1), ``q`` = index of the
nearest level to ``x / scale`` (ties to the lower level, values beyond ``±1`` to the end levels),
``x̂ = L[h, q] * scale``; codes are stored unsigned (no offset). An all-zero group gets scale 0
and reads back as zeros (a fitted table need not contain 0). The table is per-layer metadata
(``float32 [H, 2^b]``), the per-token scale is unchanged — a non-uniform grid costs no per-token
bits. Source: KVQuant's non-uniform datatype (Hooper et al., "KVQuant", NeurIPS 2024, §3.4: a
per-layer codebook fitted offline by weighted k-means), here applied to per-token values.

8-bit log-coded scales (``scale_dtype="log8"``, symmetric int, per-token / per-token-group): each
group's scale is stored as one byte ``e`` with ``scale = base_h · 2^(e / 16)`` (``base_h``: a
calibrated fp32 per KV head, ``scale_base=``; 256 codes span ``2^16``, steps of 4.4%). ``e`` is the
smallest code in 1–255 whose scale is at least the group's exact one (never saturating its own
extreme); scales below ``base_h · 2^(1/16)`` use code 1, scales above the top code are clipped to it
(calibration puts the top code 16× above the largest calibration scale), and code 0 is scale 0 (an
all-zero group with non-uniform levels).

Trellis-coded rows (``trellis=T``, symmetric int2–int4, per-token): each token's row of ``D``
elements is divided by its scale — the row's RMS (``sqrt(mean(x²))``, rounded up to the stored scale
dtype or log8 code; an all-zero row gets scale 0) — and Viterbi-encoded against the table ``T``
(:mod:`kvcal.formats.trellis`: element ``i`` reads back as ``T[w_i] · scale`` with ``w_i`` the last
``ν + b`` bits of the row's code stream up to code ``i``; QTIP's bitshift trellis). The payload is
the same ``b`` bits per element as plain codes (stored unsigned, packed as usual). ``T`` has
``2^(ν+b)`` entries, ``b ≤ ν ≤ 10``, each a multiple of 1/32 in ``[-127/32, 127/32]`` — an int8 table
in units of 1/32 of the scale, which is what the memory accounting counts (``2^(ν+b)`` bytes per
layer; :data:`TRELLIS_UNIT`). Fitted per layer by :func:`kvcal.search.tables.fit_trellis`.

Errors: ``ValueError`` for a non-4D or non-float input, NaN/Inf inputs (counted in the message;
quantizing them would silently poison a whole group), non-positive / non-finite scales or clip
ratios, a scale that overflows its storage dtype, or parameters of the wrong shape.

This module holds the public entry points; the parameters as stored are in :mod:`kvcal.formats.scales`,
the group layout in :mod:`kvcal.formats.layout`, and each variant's codes (rounding, per-channel widths,
levels, trellis) in :mod:`kvcal.formats.codes`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvcal.formats.codes import (
    _codes_for,
    _dequant_codes,
    _levels_arg,
    _top_codes,
    _trellis_arg,
    _trellis_codes,
    _trellis_values,
    check_channel_bits,
)
from kvcal.formats.layout import _check_input, _Layout, _params, xg_is_5d
from kvcal.formats.packing import pack, pack_channels, unpack, unpack_channels
from kvcal.formats.scales import (
    check_scale_base,
    log8_decode,
)
from kvcal.formats.spec import QFormat, TensorQuantSpec
from kvcal.formats.variants import ChannelWidths, Codebook, HasTables, QuantTables, ScaleCoding


@dataclass(frozen=True)
class QuantizedTensor(HasTables):
    """A quantized K or V tensor as the cache stores it.

    * ``data``: payload, tokens padded to whole token groups and channels to whole channel groups
      and packing units (``S_pad, D_pad = spec.padded_dims(S, D)``): FP8 dtype ``[B,H,S_pad,D_pad]``;
      int8 ``int8`` (symmetric) / ``uint8`` (asymmetric) ``[B,H,S_pad,D_pad]``; int6/int5/int4/int3/int2/nvfp4
      ``uint8 [B,H,S_pad,spec.row_bytes(D)]`` packed (:mod:`kvcal.formats.packing`; symmetric codes
      stored offset by ``2^(b-1)``; nvfp4 codes are sign<<3 | e2m1 index).
    * ``scale``: ``spec.scale_dtype``; static: the calibrated parameter (``[1,1,1,1]``,
      ``[1,H,1,1]`` or ``[1,H,1,D]``); dynamic: ``granularity.scale_shape(B,H,S,D)``.
      NVFP4: the block scales, ``float8_e4m3fn [B,H,S,D_pad/16]`` (multiply by ``global_scale``).
    * ``zero_point``: same shape/dtype as ``scale`` for asymmetric ints, else ``None``.
    * ``global_scale``: NVFP4 fp32 outer scale (``[1,1,1,1]``), else ``None``.
    * ``shape``: logical ``(B, H, S, D)``; ``dtype``: the input's dtype (what dequantize returns).
    * ``tables``: the :class:`~kvcal.formats.variants.QuantTables` dequantizing needs (no rounding
      matrix: codes read back the same whichever rounding chose them), checked against the spec —
      ``channel_bits`` ``[H, D]`` (int64) with allocated widths (payload then packed by
      :func:`kvcal.formats.packing.pack_channels`); ``levels`` ``float32 [H, 2^b]`` with a levels
      codebook (codes stored unsigned, ``scale`` = the group's clipped absmax); ``trellis``
      ``float32 [2^(ν+b)]`` with a trellis codebook (codes stored unsigned, ``scale`` = the row's RMS);
      ``scale_base`` ``float32 [H]`` with log8 scales (``scale`` then holds ``uint8`` codes).
      :attr:`codebook` / :attr:`channel_widths` / :attr:`scale_coding` say which variant it is.
    """

    data: torch.Tensor
    scale: torch.Tensor | None
    zero_point: torch.Tensor | None
    shape: tuple[int, int, int, int]
    spec: TensorQuantSpec
    dtype: torch.dtype
    global_scale: torch.Tensor | None = None
    tables: QuantTables = field(default_factory=QuantTables)

    @property
    def payload_nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @property
    def param_nbytes(self) -> int:
        """Bytes of scales, zero points and global scale held by this tensor."""
        return sum(t.numel() * t.element_size() for t in (self.scale, self.zero_point, self.global_scale) if t is not None)

    @property
    def nbytes(self) -> int:
        return self.payload_nbytes + self.param_nbytes


# ---- public API ---------------------------------------------------------------------------------

def quantize(
    x: torch.Tensor,
    spec: TensorQuantSpec,
    *,
    scale: torch.Tensor | None = None,
    zero_point: torch.Tensor | None = None,
    clip_ratio: torch.Tensor | float | None = None,
    global_scale: torch.Tensor | float | None = None,
    check_finite: bool = True,
    tables: QuantTables | None = None,
) -> QuantizedTensor:
    """Quantize ``x [B, H_kv, S, D]`` (any float dtype) to packed storage.

    ``scale`` / ``zero_point``: calibrated parameters, broadcastable to
    ``spec.granularity.scale_shape(B,H,S,D)`` (stored at ``spec.scale_dtype``). ``clip_ratio``:
    scalar or ``[H]``-sized, shrinks ranges computed from ``x`` (see module docstring); not with
    ``scale``. ``global_scale``: NVFP4 fp32 outer scale (default ``amax(x) / 2688``).
    ``check_finite=False`` skips the NaN/Inf check (results for non-finite inputs are then
    undefined). ``tables``: the side's calibrated tables as one
    :class:`~kvcal.formats.variants.QuantTables` (codebook, rounding, channel widths, log8 base; it
    refuses undefined combinations when built), each table being:
    ``rounding``: ``U [H, D, D]`` for query-aware rounding (int formats; module
    docstring). ``channel_bits``: per-channel widths ``[H, D]`` (asymmetric int, per-channel token
    groups, each head summing to ``spec.bits · D``; :func:`check_channel_bits`); explicit ``scale`` /
    ``zero_point`` given with them must come from :func:`params_from_range` with
    ``qmax = 2^W − 1`` (what the runtime cache does). ``levels``: non-uniform levels ``[H, 2^b]``
    (symmetric int2–int6, per-token / per-token-group; :func:`check_levels`; not with ``rounding``,
    ``channel_bits`` or an explicit ``scale``). ``scale_base``: per-head base ``[H]`` of log8 scales
    (required for, and only for, ``scale_dtype="log8"``; see :func:`log8_base`). ``trellis``: a
    trellis table ``[2^(ν+b)]`` (symmetric int2–int4, per-token; :func:`check_trellis`; not with
    ``levels``, ``rounding``, ``channel_bits``, ``scale`` or ``clip_ratio``). 16-bit specs return
    ``data = x`` cast to fp16/bf16 with no parameters. Raises ``ValueError`` (see module docstring).
    """
    _check_input(x, check_finite)
    shape = tuple(x.shape)
    if not spec.is_quantized:
        dt = torch.float16 if spec.format is QFormat.FP16 else torch.bfloat16
        return QuantizedTensor(x.to(dt), None, None, shape, spec, x.dtype)
    lay = _Layout(spec, shape)
    t, top = _checked_tables(QuantTables.coerce(tables), spec, lay, scale, clip_ratio, x.device)
    x32 = x.float()
    xg = lay.group(lay.pad(x32))
    s, zp, (s_st, zp_st, gs) = _params(xg, lay, spec, scale, zero_point, clip_ratio, global_scale, x32, top,
                                       t.scale_base, t.codebook is not Codebook.UNIFORM,
                                       t.codebook is Codebook.TRELLIS)
    if t.codebook is Codebook.TRELLIS:
        q = _trellis_codes(xg, s, t.trellis, spec.bits)
    else:
        q = lay.ungroup(_codes_for(xg, s, zp, spec, lay, t, top))  # [B,H,S_g,D_g]
    kind = spec.format.kind
    if kind == "fp8":
        data = F.pad(q.float(), (0, lay.D_pad - lay.D_g)).to(q.dtype) if lay.D_pad > lay.D_g else q
    elif kind == "nvfp4":
        data = pack(F.pad(q, (0, lay.D_pad - lay.D_g)), 4)
    else:
        if spec.symmetric and t.codebook is Codebook.UNIFORM:
            q = q + 2 ** (spec.bits - 1) if spec.bits < 8 else q
        q = F.pad(q, (0, lay.D_pad - lay.D_g)) if lay.D_pad > lay.D_g else q
        if t.channel_widths is ChannelWidths.ALLOCATED:
            data = pack_channels(q.to(torch.uint8), t.channel_bits.to(q.device))
        elif spec.bits == 8:
            data = q.to(torch.int8 if spec.symmetric else torch.uint8)
        else:
            data = pack(q.to(torch.uint8), spec.bits)
    base = check_scale_base(t.scale_base, lay.H).to(x.device) if ScaleCoding.of(spec) is ScaleCoding.LOG8 else None
    return QuantizedTensor(data.contiguous(), s_st.contiguous(), None if zp_st is None else zp_st.contiguous(),
                           shape, spec, x.dtype, gs, t.replace(rounding=None, scale_base=base))


def _checked_tables(t: QuantTables, spec: TensorQuantSpec, lay: _Layout, scale, clip_ratio, device):
    """``(tables, top)``: ``t`` with its widths / levels / trellis table checked against the spec and
    layout (:func:`check_channel_bits`, :func:`~kvcal.formats.codes.check_levels`,
    :func:`~kvcal.formats.codes.check_trellis`), and the per-channel top codes ``2^W − 1`` of allocated
    widths (``None`` otherwise). Raises ``ValueError`` as :func:`quantize` documents."""
    checked, top = {}, None
    if t.channel_widths is ChannelWidths.ALLOCATED:
        checked["channel_bits"] = w = check_channel_bits(t.channel_bits, spec, lay.H, lay.D)
        top = _top_codes(w, lay, device)
    match t.codebook:
        case Codebook.LEVELS:
            checked["levels"] = _levels_arg(t.levels, spec, lay, scale)
        case Codebook.TRELLIS:
            checked["trellis"] = _trellis_arg(t.trellis, spec, lay, scale, clip_ratio)
    return (t.replace(**checked) if checked else t), top


def _stored_scale(qt: QuantizedTensor) -> torch.Tensor:
    """fp32 scales of ``qt`` as stored (log8 codes decoded with ``qt.scale_base``)."""
    if qt.scale_coding is ScaleCoding.FLOAT:
        return qt.scale.float()
    base = qt.tables.scale_base
    if base is None:
        raise ValueError("a log8-scaled tensor needs its scale_base to dequantize")
    return log8_decode(qt.scale, base.float().reshape(1, -1, *([1] * (qt.scale.ndim - 2))))


def dequantize(qt: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Dequantize to ``[B, H_kv, S, D]`` in ``dtype`` (default: the quantized input's dtype).
    Computation is fp32 (see module docstring for the formulas)."""
    spec = qt.spec
    dtype = dtype or qt.dtype
    if not spec.is_quantized:
        return qt.data.to(dtype)
    lay = _Layout(spec, qt.shape)
    kind = spec.format.kind
    d = qt.data
    if kind == "fp8":
        q = d[..., : lay.D_g]
    elif kind == "nvfp4":
        q = unpack(d, 4, lay.D_g)
    elif qt.channel_widths is ChannelWidths.ALLOCATED:
        q = unpack_channels(d, qt.tables.channel_bits).to(torch.int16)
    elif qt.codebook is not Codebook.UNIFORM:
        q = unpack(d, spec.bits, lay.D_g)
    elif spec.bits == 8:
        q = d[..., : lay.D_g]
    else:
        q = unpack(d, spec.bits, lay.D_g).to(torch.int16)
        if spec.symmetric:
            q = q - 2 ** (spec.bits - 1)
    qg = lay.group(q)
    if kind == "nvfp4":
        s = lay.from_stored(qt.scale.float()) * qt.global_scale.float().reshape(1, 1, 1, 1, 1)
        zp = None
    else:
        s = lay.from_stored(_stored_scale(qt))
        zp = None if qt.zero_point is None else lay.from_stored(qt.zero_point.float())
    t = qt.tables
    match qt.codebook:
        case Codebook.TRELLIS:
            out = _trellis_values(qg, s, t.trellis.float(), spec.bits)
        case Codebook.LEVELS:  # levels checked by quantize
            L = torch.broadcast_to(t.levels.float(), (lay.H, 2**spec.bits))
            out = lay.ungroup(_dequant_codes(qg, s, zp, spec, t.replace(levels=L)))
        case Codebook.UNIFORM:
            out = lay.ungroup(_dequant_codes(qg, s, zp, spec))
    return out[:, :, : lay.S, : lay.D].to(dtype)


def fake_quant(
    x: torch.Tensor,
    spec: TensorQuantSpec,
    *,
    scale: torch.Tensor | None = None,
    zero_point: torch.Tensor | None = None,
    clip_ratio: torch.Tensor | float | None = None,
    global_scale: torch.Tensor | float | None = None,
    check_finite: bool = True,
    tables: QuantTables | None = None,
) -> torch.Tensor:
    """``dequantize(quantize(x, ...))`` computed without packing (the fast path for search).

    Same arguments and errors as :func:`quantize`; returns ``x``'s shape and dtype; bit-identical
    to the packed round trip."""
    _check_input(x, check_finite)
    if not spec.is_quantized:
        dt = torch.float16 if spec.format is QFormat.FP16 else torch.bfloat16
        return x.to(dt).to(x.dtype)
    lay = _Layout(spec, tuple(x.shape))
    t, top = _checked_tables(QuantTables.coerce(tables), spec, lay, scale, clip_ratio, x.device)
    x32 = x.float()
    xg = lay.group(lay.pad(x32))
    s, zp, _ = _params(xg, lay, spec, scale, zero_point, clip_ratio, global_scale, x32, top, t.scale_base,
                       t.codebook is not Codebook.UNIFORM, t.codebook is Codebook.TRELLIS)
    if t.codebook is Codebook.TRELLIS:
        y = _trellis_values(_trellis_codes(xg, s, t.trellis, spec.bits), s, t.trellis, spec.bits)
        return y[:, :, : lay.S, : lay.D].to(x.dtype)
    y = lay.ungroup(_dequant_codes(_codes_for(xg, s, zp, spec, lay, t, top), s, zp, spec, t))
    return y[:, :, : lay.S, : lay.D].to(x.dtype)


def quant_step(qt: QuantizedTensor) -> torch.Tensor:
    """Per-element quantization step (fp32 ``[B,H,S,D]``) for int formats: the scale broadcast
    to every element (error bounds in tests are half of this)."""
    spec = qt.spec
    if spec.format.kind != "int" or qt.codebook is not Codebook.UNIFORM:
        raise ValueError("quant_step is defined for int formats with uniform grids (not nvfp4/fp8/non-uniform "
                         "levels/trellis tables)")
    lay = _Layout(spec, qt.shape)
    s = lay.from_stored(_stored_scale(qt))
    xg_shape = lay.group(torch.empty(lay.B, lay.H, lay.S_g, lay.D_g, device="meta")).shape
    s = lay.ungroup(s.expand(xg_shape) if xg_is_5d(lay.gran) else s.expand(lay.B, lay.H, lay.S_g, lay.D_g))
    return s[:, :, : lay.S, : lay.D]


__all__ = ["QuantizedTensor", "quantize", "dequantize", "fake_quant", "quant_step"]
