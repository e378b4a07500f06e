"""How a granularity lays a ``[B, H_kv, S, D]`` tensor out in groups (:class:`_Layout`), and each
group's parameters: calibrated, or computed from its (clipped) range when called (:func:`_params`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvcal.formats.granularity import PerChannelTokenGroup, PerTokenGroup
from kvcal.formats.scales import (
    E2M1_MAX,
    E4M3_MAX,
    _as_param,
    check_scale_base,
    log8_decode,
    nvfp4_global_scale,
    params_from_range,
)
from kvcal.formats.spec import LOG8, TensorQuantSpec

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


def _clip_view(clip_ratio, H: int, ndim: int, device) -> torch.Tensor | None:
    """clip_ratio -> float32 ``[1, H|1, 1, 1(, 1)]``; ``None`` stays ``None``."""
    if clip_ratio is None:
        return None
    c = _as_param(clip_ratio, "clip_ratio", positive=True).to(device=device, dtype=torch.float32)
    if c.numel() not in (1, H):
        raise ValueError(f"clip_ratio must be a scalar or hold one value per KV head ({H}), got shape {tuple(c.shape)}")
    return c.reshape(1, -1, *([1] * (ndim - 2)))


def _base_view(scale_base, spec, H: int, ndim: int, device) -> torch.Tensor | None:
    if spec.scale_dtype != LOG8:
        if scale_base is not None:
            raise ValueError("scale_base is for log8 scales (scale_dtype='log8')")
        return None
    if scale_base is None:
        raise ValueError("log8 scales need their calibrated per-head base (scale_base=, float32 [H])")
    return check_scale_base(scale_base, H).to(device).reshape(1, -1, *([1] * (ndim - 2)))


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


def _empty_stat(xg, lay):
    shape = list(xg.shape)
    for d in lay.red:
        shape[d] = 1
    return xg.new_zeros(shape)
