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
:func:`kvcal.search.optimizer.channel_bit_allocation`).

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
layer; :data:`TRELLIS_UNIT`). Fitted per layer by :func:`kvcal.search.optimizer.fit_trellis`.

Errors: ``ValueError`` for a non-4D or non-float input, NaN/Inf inputs (counted in the message;
quantizing them would silently poison a whole group), non-positive / non-finite scales or clip
ratios, a scale that overflows its storage dtype, or parameters of the wrong shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcal.formats.fp8 import FP8_FORMATS, quantize_fp8
from kvcal.formats.granularity import PerChannelTokenGroup, PerToken, PerTokenGroup
from kvcal.formats.packing import pack, pack_channels, unpack, unpack_channels
from kvcal.formats.spec import DEFAULTS, LOG8, QFormat, TensorQuantSpec
from kvcal.formats.variants import QuantTables

#: e2m1 magnitudes by 3-bit code (OCP MX spec, FP4 E2M1).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0


@dataclass(frozen=True)
class QuantizedTensor:
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
    * ``channel_bits``: per-channel widths ``[H, D]`` (int64) when quantized with ``channel_bits=``
      (payload then packed by :func:`kvcal.formats.packing.pack_channels`), else ``None``.
    * ``levels``: non-uniform levels ``float32 [H, 2^b]`` when quantized with ``levels=`` (codes
      stored unsigned, ``scale`` = the group's clipped absmax), else ``None``.
    * ``scale_base``: ``float32 [H]`` base of log8 scales (``scale`` then holds ``uint8`` codes), else ``None``.
    * ``trellis``: the trellis table ``float32 [2^(ν+b)]`` when quantized with ``trellis=`` (codes
      stored unsigned, ``scale`` = the row's RMS), else ``None``.
    * ``shape``: logical ``(B, H, S, D)``; ``dtype``: the input's dtype (what dequantize returns).
    """

    data: torch.Tensor
    scale: torch.Tensor | None
    zero_point: torch.Tensor | None
    shape: tuple[int, int, int, int]
    spec: TensorQuantSpec
    dtype: torch.dtype
    global_scale: torch.Tensor | None = None
    channel_bits: torch.Tensor | None = None
    levels: torch.Tensor | None = None
    scale_base: torch.Tensor | None = None
    trellis: torch.Tensor | None = None

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


# ---- validation -----------------------------------------------------------------------------------

def _check_input(x: torch.Tensor, check_finite: bool = True) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"expected a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.ndim != 4:
        raise ValueError(f"expected a K/V tensor [B, H_kv, S, D], got shape {tuple(x.shape)}")
    if check_finite and x.numel():
        mn, mx = torch.aminmax(x)  # NaN and +-Inf propagate; ~5x cheaper than isfinite().all()
        if not (torch.isfinite(mn) and torch.isfinite(mx)):
            bad = ~torch.isfinite(x)
            n_nan = int(torch.isnan(x).sum())
            raise ValueError(
                f"input holds {n_nan} NaN and {int(bad.sum()) - n_nan} Inf values of {x.numel()}; "
                "KV quantization needs finite activations (check the model / capture dtype)"
            )


def _as_param(t, name: str, positive: bool) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        try:
            t = torch.as_tensor(t, dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"{name} must be a number or a float tensor, got {type(t).__name__}") from None
    if not torch.isfinite(t.float()).all() or (positive and bool((t <= 0).any())):
        raise ValueError(f"{name} must be finite{' and > 0' if positive else ''}; got {t.flatten()[:4].tolist()}")
    return t


def _clip_view(clip_ratio, H: int, ndim: int, device) -> torch.Tensor | None:
    """clip_ratio -> float32 ``[1, H|1, 1, 1(, 1)]``; ``None`` stays ``None``."""
    if clip_ratio is None:
        return None
    c = _as_param(clip_ratio, "clip_ratio", positive=True).to(device=device, dtype=torch.float32)
    if c.numel() not in (1, H):
        raise ValueError(f"clip_ratio must be a scalar or hold one value per KV head ({H}), got shape {tuple(c.shape)}")
    return c.reshape(1, -1, *([1] * (ndim - 2)))


# ---- parameter rounding ------------------------------------------------------------------------

def round_scale_up(s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round positive fp32 scales up to the next value representable in ``dtype`` (returned in
    ``dtype``). Raises ``ValueError`` if a scale overflows ``dtype``."""
    if dtype == torch.float32:
        return s.float()
    r = s.to(dtype)
    low = r.float() < s
    if bool(low.any()):
        bumped = (r.view(torch.int16) + 1).view(dtype)  # next representable value for positive r
        r = torch.where(low, bumped, r)
    if not torch.isfinite(r).all():
        raise ValueError(
            f"a scale ({float(s.max()):.4g}) overflows {dtype}; use scale_dtype=torch.float32 "
            "or check the input's range"
        )
    return r


def zero_point_limit(dtype: torch.dtype) -> float:
    """Largest |zero point| stored in ``dtype`` with a spacing <= 1 (2^(mantissa bits + 1))."""
    return float(2 ** (_MANTISSA_BITS[dtype] + 1))


_MANTISSA_BITS = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23}

#: log8 scales: codes per octave and top code (module docstring).
LOG8_STEPS, LOG8_TOP = 16, 255


def log8_decode(code: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """fp32 scales of log8 codes: ``base · 2^(code / 16)`` for codes 1–255, 0 for code 0 (the scale of
    an all-zero group); ``base`` broadcastable to ``code``."""
    c = code.float()
    return torch.where(c > 0, base.float() * torch.exp2(c / LOG8_STEPS), torch.zeros_like(c))


def log8_encode(s: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """``uint8`` codes of fp32 scales ``s >= 0``: 0 for ``s == 0``; else the smallest code in 1–255
    whose :func:`log8_decode` is ``>= s`` (scales above the top code are clipped to it)."""
    b = base.float()
    sf = s.float()
    e = torch.ceil(torch.log2(sf.double().clamp_min(1e-45) / b.double()) * LOG8_STEPS).clamp_(1, LOG8_TOP)
    e = torch.where((e > 1) & (log8_decode(e - 1, b) >= sf), e - 1, e)  # float32 decode decides, not float64
    e = torch.where((log8_decode(e, b) < sf) & (e < LOG8_TOP), e + 1, e)
    return torch.where(sf > 0, e, torch.zeros_like(e)).to(torch.uint8)


def log8_base(max_scale: torch.Tensor, headroom: float = 16.0) -> torch.Tensor:
    """Per-head fp32 base putting log8's top code ``headroom`` times above ``max_scale`` ``[H]``
    (the largest scale seen in calibration)."""
    m = torch.as_tensor(max_scale, dtype=torch.float64).clamp_min(1e-30)
    return (m * headroom / 2.0 ** (LOG8_TOP / LOG8_STEPS)).float()


def check_scale_base(scale_base, H: int) -> torch.Tensor:
    """Validated log8 base ``float32 [H]`` (a scalar broadcasts): finite, positive, and small enough
    that the top code's scale is finite in float32. Raises ``ValueError``."""
    b = _as_param(scale_base, "scale_base", positive=True).float().reshape(-1)
    if b.numel() not in (1, H):
        raise ValueError(f"scale_base must hold one value per KV head ({H}), got {b.numel()} values")
    if not bool(torch.isfinite(log8_decode(torch.tensor(float(LOG8_TOP)), b)).all()):
        raise ValueError(f"scale_base {float(b.max()):.4g} overflows float32 at the top log8 code "
                         f"(base · 2^({LOG8_TOP}/{LOG8_STEPS}))")
    return b.expand(H).contiguous()


def _base_view(scale_base, spec, H: int, ndim: int, device) -> torch.Tensor | None:
    if spec.scale_dtype != LOG8:
        if scale_base is not None:
            raise ValueError("scale_base is for log8 scales (scale_dtype='log8')")
        return None
    if scale_base is None:
        raise ValueError("log8 scales need their calibrated per-head base (scale_base=, float32 [H])")
    return check_scale_base(scale_base, H).to(device).reshape(1, -1, *([1] * (ndim - 2)))


def params_from_range(
    spec: TensorQuantSpec,
    amax: torch.Tensor | None = None,
    amin: torch.Tensor | None = None,
    clip_ratio: torch.Tensor | float | None = None,
    qmax: torch.Tensor | None = None,
    scale_base: torch.Tensor | None = None,
    levels: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stored ``(scale, zero_point)`` from observed ranges (same shapes as the inputs).

    Symmetric specs (FP8, symmetric ints) take ``amax`` = absmax; asymmetric ints take the
    signed ``amin`` and ``amax``. ``clip_ratio`` broadcasts against them. This is the exact
    arithmetic :func:`quantize` uses, so calibration code computing static parameters from
    streaming statistics gets identical results. Returns tensors in ``spec.scale_dtype``
    (``zero_point`` is ``None`` when symmetric). Not for NVFP4 (see :func:`nvfp4_global_scale`).
    ``qmax``: per-element top code ``2^W − 1`` (broadcastable; asymmetric ints with per-channel
    widths) instead of the spec's. ``levels=True`` (symmetric ints with non-uniform levels): the
    scale is the clipped absmax (the grid's top is 1), and an all-zero group gets scale 0 so that it
    reads back as zeros whatever the table. ``scale_base``: log8 specs' per-head base, broadcastable
    to ``amax`` (the returned scale is then the ``uint8`` codes).
    """
    kind = spec.format.kind
    if kind not in ("int", "fp8"):
        raise ValueError(f"params_from_range is for int/fp8 formats, not {spec.format.value}")
    c = None if clip_ratio is None else torch.as_tensor(clip_ratio, dtype=torch.float32)
    if spec.symmetric:
        if amax is None:
            raise ValueError("symmetric specs need amax (the absolute maximum)")
        a = amax.float().abs()
        if c is not None:
            a = a * c.to(a.device)
        if levels:
            s = a  # all-zero groups keep scale 0
        else:
            s = a / (FP8_FORMATS[spec.format.value].max if kind == "fp8" else float(spec.qmax))
            s = torch.where(s > 0, s, torch.ones_like(s))
        if spec.scale_dtype == LOG8:
            if scale_base is None:
                raise ValueError("log8 scales need their calibrated per-head base (scale_base=)")
            return log8_encode(s, scale_base.to(s.device)), None
        return round_scale_up(s, spec.scale_dtype), None
    if amax is None or amin is None:
        raise ValueError("asymmetric specs need both amin and amax")
    mn, mx = amin.float(), amax.float()
    if c is not None:
        t = (1.0 - c.to(mn.device)) * 0.5 * (mx - mn)
        lo, hi = mn + t, mx - t
    else:
        lo, hi = mn, mx
    s = (hi - lo) / (float(spec.qmax) if qmax is None else qmax.to(hi.device).float())
    s = torch.maximum(s, lo.abs() / zero_point_limit(spec.scale_dtype))
    s = torch.where(s > 0, s, torch.ones_like(s))
    s_r = round_scale_up(s, spec.scale_dtype)
    zp = (-lo / s_r.float()).to(spec.scale_dtype)
    return s_r, zp


def nvfp4_global_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """NVFP4 fp32 global (outer) scale ``amax / (448 * 6)`` as ``[1,1,1,1]`` (1.0 for amax 0)."""
    a = torch.as_tensor(amax, dtype=torch.float32).reshape(1, 1, 1, 1)
    g = a / (E4M3_MAX * E2M1_MAX)
    return torch.where(g > 0, g, torch.ones_like(g))


# ---- grouping ------------------------------------------------------------------------------------

class _Layout:
    """Maps ``[B,H,S,D]`` to a grouped view whose reduction over ``red`` gives one group per
    parameter, and stored parameters back to shapes that broadcast against that view."""

    def __init__(self, spec: TensorQuantSpec, shape):
        self.B, self.H, self.S, self.D = shape
        self.spec = spec
        self.gran = spec.granularity
        tg, cg = spec.token_group or 1, spec.effective_channel_group(self.D)
        self.cg = cg
        self.S_g = -(-self.S // tg) * tg
        self.D_g = -(-self.D // cg) * cg
        self.S_pad, self.D_pad = spec.padded_dims(self.S, self.D)
        assert self.S_pad == self.S_g
        if isinstance(self.gran, PerTokenGroup):
            self.red = (4,)
        elif isinstance(self.gran, PerChannelTokenGroup):
            self.red = (3,)
        else:
            self.red = self.gran.reduce_dims()

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """Replicate-pad ``[B,H,S,D]`` to ``[B,H,S_g,D_g]`` (padding never widens a group's range)."""
        ds, dd = self.S_g - self.S, self.D_g - self.D
        if (ds or dd) and x.numel():
            x = F.pad(x, (0, dd, 0, ds), mode="replicate")
        elif ds or dd:
            x = x.new_zeros(self.B, self.H, self.S_g, self.D_g)
        return x

    def group(self, x: torch.Tensor) -> torch.Tensor:
        B, H = self.B, self.H
        if isinstance(self.gran, PerTokenGroup):
            g = self.cg
            return x.reshape(B, H, self.S_g, self.D_g // g, g)
        if isinstance(self.gran, PerChannelTokenGroup):
            g = self.gran.group_size
            return x.reshape(B, H, self.S_g // g, g, self.D_g)
        return x

    def ungroup(self, xg: torch.Tensor) -> torch.Tensor:
        return xg.reshape(self.B, self.H, self.S_g, self.D_g)

    def to_stored(self, pg: torch.Tensor) -> torch.Tensor:
        return pg.squeeze(self.red[0]) if len(self.red) == 1 and xg_is_5d(self.gran) else pg

    def from_stored(self, p: torch.Tensor) -> torch.Tensor:
        if xg_is_5d(self.gran):
            return p.unsqueeze(self.red[0])
        return p

    def stored_shape(self) -> tuple[int, ...]:
        return self.gran.scale_shape(self.B, self.H, self.S, self.D)

    def check_param(self, p: torch.Tensor, name: str) -> torch.Tensor:
        want = self.stored_shape()
        try:
            return torch.broadcast_to(p, want)
        except RuntimeError:
            raise ValueError(
                f"{name} of shape {tuple(p.shape)} does not fit granularity {self.gran.name} "
                f"(expected {want} for input {(self.B, self.H, self.S, self.D)})"
            ) from None


def xg_is_5d(gran) -> bool:
    return isinstance(gran, (PerTokenGroup, PerChannelTokenGroup))


# ---- the core: grouped fp32 view -> codes and back ------------------------------------------------

def _params(xg, lay: _Layout, spec, scale, zero_point, clip_ratio, global_scale, x_for_static, top=None,
            scale_base=None, levels: bool = False, rms: bool = False):
    """Returns fp32 params broadcastable to xg: (s, zp|None, block_scale_fp8|None, global|None),
    plus the stored tensors (scale, zero_point)."""
    kind = spec.format.kind
    if kind == "nvfp4":
        if scale is not None or zero_point is not None:
            raise ValueError("nvfp4 block scales are computed per block; pass global_scale (and clip_ratio) only")
        if global_scale is None:
            if xg.numel() == 0:
                raise ValueError("cannot derive an nvfp4 global scale from an empty tensor; pass global_scale")
            gs = nvfp4_global_scale(xg.abs().amax())
        else:
            gs = _as_param(global_scale, "global_scale", positive=True).float().reshape(1, 1, 1, 1)
        gs = gs.to(xg.device)
        c = _clip_view(clip_ratio, lay.H, xg.ndim, xg.device)
        bamax = xg.abs().amax(dim=4, keepdim=True) if xg.numel() else xg.new_zeros(*xg.shape[:4], 1)
        if c is not None:
            bamax = bamax * c
        enc = (bamax / E2M1_MAX / gs.unsqueeze(-1)).clamp(max=E4M3_MAX)
        bs8 = enc.to(torch.float8_e4m3fn)
        s = bs8.float() * gs.unsqueeze(-1)
        return s, None, (lay.to_stored(bs8), None, gs)

    base = _base_view(scale_base, spec, lay.H, xg.ndim, xg.device)
    if scale is not None and base is not None:
        raise ValueError("log8 scales are computed per group; pass clip_ratio and scale_base, not scale")
    if scale is not None:
        if clip_ratio is not None:
            raise ValueError("pass either a calibrated scale or a clip_ratio, not both")
        s_st = lay.check_param(_as_param(scale, "scale", positive=True), "scale").to(spec.scale_dtype)
        zp_st = None
        if spec.symmetric:
            if zero_point is not None:
                raise ValueError("symmetric specs take no zero_point; set symmetric=False for asymmetric")
        else:
            if zero_point is None:
                raise ValueError("asymmetric static quantization needs a zero_point as well as a scale")
            zp_st = lay.check_param(_as_param(zero_point, "zero_point", positive=False), "zero_point")
            zp_st = zp_st.to(spec.scale_dtype)
        s_st, zp_st = s_st.to(xg.device), None if zp_st is None else zp_st.to(xg.device)
    else:
        if zero_point is not None:
            raise ValueError("a zero_point needs its scale; pass both or neither")
        if lay.gran.static and x_for_static.numel() == 0:
            raise ValueError("cannot compute a static scale from an empty tensor; pass scale=")
        c = _clip_view(clip_ratio, lay.H, xg.ndim, xg.device)
        red = lay.red
        if spec.symmetric:
            if not xg.numel():
                amax = _empty_stat(xg, lay)
            elif rms:  # trellis rows: the scale is the row's RMS
                amax = xg.pow(2).mean(dim=red, keepdim=True).sqrt()
            else:
                amax = xg.abs().amax(dim=red, keepdim=True)
            s_g, zp_g = params_from_range(spec, amax=amax, clip_ratio=c, scale_base=base, levels=levels)
        else:
            if xg.numel():
                mn, mx = torch.aminmax(xg, dim=red[0], keepdim=True) if len(red) == 1 else (
                    xg.amin(dim=red, keepdim=True), xg.amax(dim=red, keepdim=True))
            else:
                mn = mx = _empty_stat(xg, lay)
            s_g, zp_g = params_from_range(spec, amax=mx, amin=mn, clip_ratio=c, qmax=top)
        s_st = lay.to_stored(s_g)
        zp_st = None if zp_g is None else lay.to_stored(zp_g)
    s = lay.from_stored(s_st.float() if base is None else log8_decode(s_st, lay.to_stored(base)))
    zp = None if zp_st is None else lay.from_stored(zp_st.float())
    return s, zp, (s_st, zp_st, None)


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
                         "(an int8 table; round with kvcal.search.optimizer.fit_trellis)")
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


def _codes_for(xg, s, zp, spec, lay: _Layout, rounding: torch.Tensor | None, top=None, levels=None) -> torch.Tensor:
    """Nearest-rounding codes, or channel-ordered ones when a rounding matrix is given
    (``top``: per-channel top codes for per-channel bit widths; ``levels``: checked non-uniform levels)."""
    if levels is not None:
        return _level_codes(xg, s, levels, lay)
    if rounding is None:
        if top is None:
            return _codes(xg, s, zp, spec)
        return torch.minimum(torch.round(xg / s + zp).clamp_(min=0), top)  # asymmetric int (checked)
    return _codes_ordered(xg, s, zp, spec, lay, _check_rounding(rounding, spec, lay), top)


def _empty_stat(xg, lay):
    shape = list(xg.shape)
    for d in lay.red:
        shape[d] = 1
    return xg.new_zeros(shape)


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


def _dequant_codes(q, s, zp, spec, levels=None):
    if levels is not None:
        return _level_values(q, s, levels)
    kind = spec.format.kind
    if kind == "fp8":
        return q.float() * s
    if kind == "nvfp4":
        return _E2M1_TABLE.to(q.device)[q.long()] * s
    if spec.symmetric:
        return q.float() * s
    return (q.float() - zp) * s


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
    rounding: torch.Tensor | None = None,
    channel_bits: torch.Tensor | None = None,
    levels: torch.Tensor | None = None,
    scale_base: torch.Tensor | None = None,
    trellis: torch.Tensor | None = None,
) -> QuantizedTensor:
    """Quantize ``x [B, H_kv, S, D]`` (any float dtype) to packed storage.

    ``scale`` / ``zero_point``: calibrated parameters, broadcastable to
    ``spec.granularity.scale_shape(B,H,S,D)`` (stored at ``spec.scale_dtype``). ``clip_ratio``:
    scalar or ``[H]``-sized, shrinks ranges computed from ``x`` (see module docstring); not with
    ``scale``. ``global_scale``: NVFP4 fp32 outer scale (default ``amax(x) / 2688``).
    ``check_finite=False`` skips the NaN/Inf check (results for non-finite inputs are then
    undefined). ``tables``: the side's calibrated tables as one
    :class:`~kvcal.formats.variants.QuantTables` (codebook, rounding, channel widths, log8 base; it
    refuses undefined combinations when built). The five keywords below are the deprecated form of
    ``tables`` (kept as a thin adapter; not together with ``tables``):
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
    t = QuantTables.from_keywords(tables, rounding=rounding, channel_bits=channel_bits, levels=levels,
                                  scale_base=scale_base, trellis=trellis)
    rounding, scale_base = t.rounding, t.scale_base
    lay = _Layout(spec, shape)
    w = None if t.channel_bits is None else check_channel_bits(t.channel_bits, spec, lay.H, lay.D)
    top = None if w is None else _top_codes(w, lay, x.device)
    L = _levels_arg(t.levels, spec, lay, scale)
    T = _trellis_arg(t.trellis, spec, lay, scale, clip_ratio)
    x32 = x.float()
    xg = lay.group(lay.pad(x32))
    s, zp, (s_st, zp_st, gs) = _params(xg, lay, spec, scale, zero_point, clip_ratio, global_scale, x32, top,
                                       scale_base, L is not None or T is not None, T is not None)
    if T is not None:
        q = _trellis_codes(xg, s, T, spec.bits)
    else:
        q = lay.ungroup(_codes_for(xg, s, zp, spec, lay, rounding, top, L))  # [B,H,S_g,D_g]
    kind = spec.format.kind
    if kind == "fp8":
        data = F.pad(q.float(), (0, lay.D_pad - lay.D_g)).to(q.dtype) if lay.D_pad > lay.D_g else q
    elif kind == "nvfp4":
        data = pack(F.pad(q, (0, lay.D_pad - lay.D_g)), 4)
    else:
        if spec.symmetric and L is None and T is None:
            q = q + 2 ** (spec.bits - 1) if spec.bits < 8 else q
        q = F.pad(q, (0, lay.D_pad - lay.D_g)) if lay.D_pad > lay.D_g else q
        if w is not None:
            data = pack_channels(q.to(torch.uint8), w.to(q.device))
        elif spec.bits == 8:
            data = q.to(torch.int8 if spec.symmetric else torch.uint8)
        else:
            data = pack(q.to(torch.uint8), spec.bits)
    return QuantizedTensor(data.contiguous(), s_st.contiguous(), None if zp_st is None else zp_st.contiguous(),
                           shape, spec, x.dtype, gs, w, L,
                           None if scale_base is None else check_scale_base(scale_base, lay.H).to(x.device), T)


def _levels_arg(levels, spec, lay: _Layout, scale) -> torch.Tensor | None:
    """Checked levels table (combinations with other tables: refused by :class:`QuantTables`)."""
    if levels is None:
        return None
    if scale is not None:
        raise ValueError("non-uniform levels take the group's absmax as scale; pass clip_ratio, not scale")
    return check_levels(levels, spec, lay.H)


def _trellis_arg(trellis, spec, lay: _Layout, scale, clip_ratio) -> torch.Tensor | None:
    """Checked trellis table (combinations with other tables: refused by :class:`QuantTables`)."""
    if trellis is None:
        return None
    if scale is not None or clip_ratio is not None:
        raise ValueError("trellis rows take their RMS as scale; pass neither scale nor clip_ratio")
    return check_trellis(trellis, spec, lay.D)


def _stored_scale(qt: QuantizedTensor) -> torch.Tensor:
    """fp32 scales of ``qt`` as stored (log8 codes decoded with ``qt.scale_base``)."""
    if qt.spec.scale_dtype != LOG8:
        return qt.scale.float()
    if qt.scale_base is None:
        raise ValueError("a log8-scaled tensor needs its scale_base to dequantize")
    return log8_decode(qt.scale, qt.scale_base.float().reshape(1, -1, *([1] * (qt.scale.ndim - 2))))


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
    elif qt.channel_bits is not None:
        q = unpack_channels(d, qt.channel_bits).to(torch.int16)
    elif qt.levels is not None or qt.trellis is not None:
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
    L = None if qt.levels is None else torch.broadcast_to(qt.levels.float(), (lay.H, 2**spec.bits))  # checked by quantize
    if qt.trellis is not None:
        out = _trellis_values(qg, s, qt.trellis.float(), spec.bits)
    else:
        out = lay.ungroup(_dequant_codes(qg, s, zp, spec, L))
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
    rounding: torch.Tensor | None = None,
    channel_bits: torch.Tensor | None = None,
    levels: torch.Tensor | None = None,
    scale_base: torch.Tensor | None = None,
    trellis: torch.Tensor | None = None,
) -> torch.Tensor:
    """``dequantize(quantize(x, ...))`` computed without packing (the fast path for search).

    Same arguments and errors as :func:`quantize`; returns ``x``'s shape and dtype; bit-identical
    to the packed round trip."""
    _check_input(x, check_finite)
    if not spec.is_quantized:
        dt = torch.float16 if spec.format is QFormat.FP16 else torch.bfloat16
        return x.to(dt).to(x.dtype)
    t = QuantTables.from_keywords(tables, rounding=rounding, channel_bits=channel_bits, levels=levels,
                                  scale_base=scale_base, trellis=trellis)
    rounding, scale_base = t.rounding, t.scale_base
    lay = _Layout(spec, tuple(x.shape))
    cb = t.channel_bits
    top = None if cb is None else _top_codes(check_channel_bits(cb, spec, lay.H, lay.D), lay, x.device)
    L = _levels_arg(t.levels, spec, lay, scale)
    T = _trellis_arg(t.trellis, spec, lay, scale, clip_ratio)
    x32 = x.float()
    xg = lay.group(lay.pad(x32))
    s, zp, _ = _params(xg, lay, spec, scale, zero_point, clip_ratio, global_scale, x32, top, scale_base,
                       L is not None or T is not None, T is not None)
    if T is not None:
        y = _trellis_values(_trellis_codes(xg, s, T, spec.bits), s, T, spec.bits)
        return y[:, :, : lay.S, : lay.D].to(x.dtype)
    y = lay.ungroup(_dequant_codes(_codes_for(xg, s, zp, spec, lay, rounding, top, L), s, zp, spec, L))
    return y[:, :, : lay.S, : lay.D].to(x.dtype)


def quant_step(qt: QuantizedTensor) -> torch.Tensor:
    """Per-element quantization step (fp32 ``[B,H,S,D]``) for int formats: the scale broadcast
    to every element (error bounds in tests are half of this)."""
    spec = qt.spec
    if spec.format.kind != "int" or qt.levels is not None or qt.trellis is not None:
        raise ValueError("quant_step is defined for int formats with uniform grids (not nvfp4/fp8/non-uniform "
                         "levels/trellis tables)")
    lay = _Layout(spec, qt.shape)
    s = lay.from_stored(_stored_scale(qt))
    xg_shape = lay.group(torch.empty(lay.B, lay.H, lay.S_g, lay.D_g, device="meta")).shape
    s = lay.ungroup(s.expand(xg_shape) if xg_is_5d(lay.gran) else s.expand(lay.B, lay.H, lay.S_g, lay.D_g))
    return s[:, :, : lay.S, : lay.D]


__all__ = [
    "QuantizedTensor", "quantize", "dequantize", "fake_quant", "params_from_range",
    "nvfp4_global_scale", "round_scale_up", "zero_point_limit", "quant_step", "rounding_matrix", "unit_rounding", "E2M1_VALUES",
    "check_channel_bits", "check_levels", "check_trellis", "TRELLIS_UNIT", "TRELLIS_MAX_NU", "log8_encode", "log8_decode", "log8_base", "check_scale_base", "LOG8_STEPS", "LOG8_TOP",
    "DEFAULTS",
]
