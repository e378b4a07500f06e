"""Quantization parameters as stored: scales rounded up to their storage dtype, zero-point limits,
one-byte log8 scales, and the NVFP4 global scale (the formulas are in :mod:`kvcal.formats.quant`)."""

from __future__ import annotations

import torch

from kvcal.formats.fp8 import FP8_FORMATS
from kvcal.formats.spec import LOG8, TensorQuantSpec

#: e2m1 magnitudes by 3-bit code (OCP MX spec, FP4 E2M1).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0


def _as_param(t, name: str, positive: bool) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        try:
            t = torch.as_tensor(t, dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"{name} must be a number or a float tensor, got {type(t).__name__}") from None
    if not torch.isfinite(t.float()).all() or (positive and bool((t <= 0).any())):
        raise ValueError(f"{name} must be finite{' and > 0' if positive else ''}; got {t.flatten()[:4].tolist()}")
    return t


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
