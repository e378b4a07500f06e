"""Storage of one side (K or V) of one layer of :class:`~kvcal.runtime.cache.QuantizedKVCache`
(:class:`SideStorage`): the sink, quantized and window regions, their write policy and allocation,
as described in :mod:`kvcal.runtime.cache`. Not thread-safe."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvcal.formats.codes import TRELLIS_UNIT, check_channel_bits, check_levels, check_trellis, unit_rounding
from kvcal.formats.fp8 import FP8_FORMATS
from kvcal.formats.quant import QuantizedTensor, dequantize, quantize
from kvcal.formats.scales import check_scale_base, nvfp4_global_scale, params_from_range
from kvcal.formats.spec import DEFAULTS, QFormat
from kvcal.formats.transforms import Transform, apply_transform
from kvcal.formats.variants import ChannelWidths, Codebook, QuantTables, Rounding, ScaleCoding, SideVariant
from kvcal.plan import SidePlan


def _payload_dtype(spec) -> torch.dtype:
    kind = spec.format.kind
    if kind == "fp8":
        return FP8_FORMATS[spec.format.value].dtype
    if spec.bits == 8 and spec.symmetric:
        return torch.int8
    return torch.uint8


def _scale_last(spec, D: int) -> int:
    """Size of the last dim of a dynamic scale tensor."""
    return spec.granularity.scale_shape(1, 1, 1, D)[3] if spec.format is not QFormat.NVFP4 else -(-D // 16)


class SideStorage:
    """Storage of one side (K or V) of one layer. Not thread-safe; shapes in the module docstring."""

    def __init__(self, sp: SidePlan, H: int, D: int, sink_tokens: int, residual_window: int,
                 dtype16: torch.dtype = DEFAULTS["dtype16"]):
        self.sp, self.spec, self.H, self.D = sp, sp.spec, H, D
        self.quantized = self.spec.is_quantized
        self.sinks = sink_tokens if self.quantized else 0
        self.R = residual_window if self.quantized else 0
        self.dtype16 = dtype16 if self.quantized else (
            torch.float16 if self.spec.format is QFormat.FP16 else torch.bfloat16)
        self.tg = self.spec.token_group  # tokens per group along S (KIVI keys) or None
        sp.check_transform()
        self.transform = sp.transform if self.quantized else Transform.NONE
        self.variant = sp.variant if self.quantized else SideVariant()  # which tables below are held
        self.rope = sp.rope
        self.B = 0
        self.dtype = None
        self.n_sink = self.n_win = self.n_q = 0  # tokens held in each region
        self.sinks_written = 0  # sink tokens written so far (a sliding layer drops them, n_sink falls)
        self.q_origin = self.sinks  # absolute position of quantized slot 0 (advances as a sliding layer drops)
        self.sink = self.win = self.data = self.scale = self.zp = None  # batch-major buffers
        self.open_rng = None  # raw min / max of the open token group, float32 [B,H,2,D] (groups with R < g)
        # per-layer metadata (independent of B and T)
        self.static_scale = self.static_zp = self.clip = self.global_scale = None
        self.mean = None
        self.rounding = None  # float8 e4m3 strict upper triangle [H, D(D-1)/2] of the unit-diagonal Ũ
        if self.variant.rounding is Rounding.QUERY_AWARE:
            iu = torch.triu_indices(D, D, offset=1)
            u = unit_rounding(torch.broadcast_to(sp.rounding.float(), (H, D, D)))
            self.rounding = u[:, iu[0], iu[1]].to(torch.float8_e4m3fn).clone()
        self.channel_bits = None  # uint8 [H, D] per-channel payload widths (rows keep the spec's size)
        if self.variant.channel_widths is ChannelWidths.ALLOCATED:
            self.channel_bits = check_channel_bits(sp.channel_bits, self.spec, H, D).to(torch.uint8)
        self.levels = None  # float32 [H, 2^b] non-uniform levels (codes index them)
        self.trellis = None  # int8 [2^(nu+b)] trellis table in units of 1/TRELLIS_UNIT of the row's scale
        match self.variant.codebook:
            case Codebook.LEVELS:
                self.levels = check_levels(sp.levels, self.spec, H).clone()
            case Codebook.TRELLIS:
                self.trellis = (check_trellis(sp.trellis, self.spec, D) * TRELLIS_UNIT).round().to(torch.int8)
        self.scale_base = None  # float32 [H] base of log8 per-token scales
        if self.quantized and ScaleCoding.of(self.spec) is ScaleCoding.LOG8:
            if sp.scale_base is None:
                raise ValueError("a side with log8 scales needs its calibrated scale_base (SidePlan.scale_base)")
            self.scale_base = check_scale_base(sp.scale_base, H).clone()
        if self.quantized:
            spec = self.spec
            if spec.dynamic:
                cr = sp.clip_ratio
                self.clip = (torch.ones(H) if cr is None else cr.reshape(-1).expand(H)).to(
                    DEFAULTS["clip_ratio_dtype"]).clone()
                self._clip_arg = None if cr is None else self.clip
            else:
                if sp.scale is None:
                    raise ValueError(f"static {spec.format.value} {spec.granularity.name} side has no scale; "
                                     "calibrate it or set SidePlan.scale")
                want = spec.granularity.scale_shape(1, H, 1, D)
                try:
                    self.static_scale = torch.broadcast_to(sp.scale, want).to(spec.scale_dtype).clone()
                    if spec.has_zero_point:
                        if sp.zero_point is None:
                            raise ValueError("asymmetric static side has no zero_point")
                        self.static_zp = torch.broadcast_to(sp.zero_point, want).to(spec.scale_dtype).clone()
                except RuntimeError:
                    raise ValueError(f"scale of shape {tuple(sp.scale.shape)} does not fit {spec.granularity.name} "
                                     f"for H={H}, D={D} (expected {want})") from None
            if spec.format is QFormat.NVFP4:
                self.global_scale = torch.zeros(1, dtype=DEFAULTS["global_scale_dtype"])  # set at first write
            if self.variant.centering:
                self.mean = sp.mean.float().reshape(1, H, 1, D).clone()

    # ---- sizes ---------------------------------------------------------------------------------
    def sizes(self, t: int) -> tuple[int, int, int, int]:
        """Contract sizes for capacity ``t``: (sink slots, window slots, payload rows, scale rows)."""
        if not self.quantized:
            return 0, t, 0, 0
        ns = min(self.sinks, t)
        nw = min(self.R, t - ns)
        nq = t - ns - nw
        s_pad, _ = self.spec.padded_dims(nq, self.D)
        rows = -(-nq // self.tg) if self.tg else nq
        return ns, nw, s_pad, rows

    def metadata_tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.static_scale, self.static_zp, self.clip, self.global_scale, self.rounding,
                            self.channel_bits, self.levels, self.trellis, self.scale_base) if t is not None]

    def batch_tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.sink, self.win, self.data, self.scale, self.zp, self.open_rng) if t is not None]

    def nbytes(self) -> int:
        ts = self.metadata_tensors() + self.batch_tensors()
        if self.mean is not None:
            ts.append(self.mean)
        return sum(t.numel() * t.element_size() for t in ts)

    # ---- allocation ---------------------------------------------------------------------------
    def _move(self, device):
        for name in ("static_scale", "static_zp", "clip", "global_scale", "mean", "rounding", "channel_bits", "levels", "trellis", "scale_base"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device))
        if self.quantized and self.spec.dynamic:
            self._clip_arg = None if self.sp.clip_ratio is None else self.clip

    def init(self, B: int, device, dtype: torch.dtype):
        self.B, self.dtype, self.device = B, dtype, device
        self.open_rng = None
        self._move(device)
        D, H = self.D, self.H
        self.sink = torch.empty(B, H, 0, D, dtype=self.dtype16, device=device) if self.quantized else None
        self.win = torch.empty(B, H, 0, D, dtype=self.dtype16, device=device)
        if self.quantized:
            spec = self.spec
            self.data = torch.empty(B, H, 0, spec.row_bytes(D), dtype=_payload_dtype(spec), device=device)
            if spec.dynamic:
                sdt = DEFAULTS["nvfp4_block_scale_dtype"] if spec.format is QFormat.NVFP4 else spec.scale_dtype
                self.scale = torch.empty(B, H, 0, _scale_last(spec, D), dtype=sdt, device=device)
                if spec.has_zero_point:
                    self.zp = torch.empty(B, H, 0, _scale_last(spec, D), dtype=spec.scale_dtype, device=device)

    def reserve(self, t: int):
        """Grow buffers (zero-filled) to the contract sizes for capacity ``t`` (never shrinks)."""
        ns, nw, s_pad, rows = self.sizes(t)

        def grow(buf, n):
            if buf is None or buf.shape[2] >= n:
                return buf
            pad = torch.zeros(*buf.shape[:2], n - buf.shape[2], buf.shape[3], dtype=buf.dtype, device=buf.device)
            return torch.cat([buf, pad], dim=2)

        self.sink = grow(self.sink, ns)
        self.win = grow(self.win, nw)
        self.data = grow(self.data, s_pad)
        self.scale = grow(self.scale, rows)
        self.zp = grow(self.zp, rows)
        if self.quantized and self.tg and self.R < self.tg and s_pad > 0 and self.open_rng is None:
            self.open_rng = torch.zeros(self.B, self.H, 2, self.D, dtype=torch.float32, device=self.device)

    def reserve_more(self, s: int):
        """Grow buffers (zero-filled) so that ``s`` more tokens fit after what is held (a sliding-window
        layer, whose held tokens are not a prefix of the sequence; :meth:`drop_before` trims them back)."""
        if not self.quantized:
            self.reserve_rows(0, self.n_win + s, 0, 0)
            return
        up = self.n_q + self.n_win + s  # quantized slots after this write, at most
        s_pad, _ = self.spec.padded_dims(up, self.D)
        rows = -(-up // self.tg) if self.tg else up
        self.reserve_rows(self.n_sink + min(self.sinks - self.sinks_written, s), min(self.R, self.n_win + s),
                          s_pad, rows)
        if self.tg and self.R < self.tg and s_pad > 0 and self.open_rng is None:
            self.open_rng = torch.zeros(self.B, self.H, 2, self.D, dtype=torch.float32, device=self.device)

    def reserve_rows(self, ns: int, nw: int, s_pad: int, rows: int):
        def grow(buf, n):
            if buf is None or buf.shape[2] >= n:
                return buf
            pad = torch.zeros(*buf.shape[:2], n - buf.shape[2], buf.shape[3], dtype=buf.dtype, device=buf.device)
            return torch.cat([buf, pad], dim=2)

        self.sink, self.win = grow(self.sink, ns), grow(self.win, nw)
        self.data, self.scale, self.zp = grow(self.data, s_pad), grow(self.scale, rows), grow(self.zp, rows)

    def drop_before(self, first: int) -> None:
        """A sliding-window layer's side: drop every held token before absolute position ``first`` that can
        go without changing a kept one (the rules of :func:`kvcal.formats.memory.sliding_held`: sinks first,
        quantized tokens by whole token groups, 16-bit window tokens only on sides without token groups once
        no quantized token precedes them), and shrink every buffer to exactly what is held."""
        if not self.quantized:
            dw = min(max(first - self.q_origin, 0), self.n_win)
            self.win = self.win[:, :, dw : self.n_win].clone()
            self.n_win -= dw
            self.q_origin += dw
            return
        s0 = self.sinks_written - self.n_sink  # absolute position of the first held sink
        ds = min(max(first - s0, 0), self.n_sink)
        dq = min(max(first - self.q_origin, 0), self.n_q)
        if self.tg:
            dq -= dq % self.tg
        dw = min(max(first - self.q_origin - self.n_q, 0), self.n_win) if (not self.tg and dq == self.n_q) else 0
        nq = self.n_q - dq
        s_pad, _ = self.spec.padded_dims(nq, self.D)
        self.sink = self.sink[:, :, ds : self.n_sink].clone()
        self.data = self.data[:, :, dq : dq + s_pad].clone()
        if self.scale is not None:
            r0 = dq // self.tg if self.tg else dq
            r1 = r0 + (-(-nq // self.tg) if self.tg else nq)
            self.scale = self.scale[:, :, r0:r1].clone()
            if self.zp is not None:
                self.zp = self.zp[:, :, r0:r1].clone()
        self.win = self.win[:, :, dw : self.n_win].clone()
        if self.open_rng is not None and self.q_origin - self.sinks + self.n_q == 0:
            self.open_rng = None  # no token group has been formed yet (allocated ahead by reserve_more)
        self.n_sink, self.n_q, self.n_win = self.n_sink - ds, nq, self.n_win - dw
        self.q_origin += dq + dw

    # ---- write ----------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        return self.n_sink + self.n_q + self.n_win

    def append(self, x: torch.Tensor) -> None:
        """Write new tokens ``x [B,H,s,D]`` (the model's dtype). Buffers must be reserved."""
        if not self.quantized:
            s = x.shape[2]
            self.win[:, :, self.n_win : self.n_win + s] = x.to(self.dtype16)
            self.n_win += s
            return
        k = min(self.sinks - self.sinks_written, x.shape[2])
        if k > 0:
            self.sink[:, :, self.n_sink : self.n_sink + k] = x[:, :, :k].to(self.dtype16)
            self.n_sink += k
            self.sinks_written += k
            x = x[:, :, k:]
        if x.shape[2] == 0:
            return
        tail = self.win[:, :, : self.n_win].to(x.dtype)
        comb = torch.cat([tail, x], dim=2) if self.n_win else x  # [B,H,m,D]
        m = comb.shape[2]
        if m <= self.R:
            e = 0
        elif self.tg and self.R >= self.tg:
            e = -(-(m - self.R) // self.tg) * self.tg
        else:
            e = m - self.R
        if e:
            self._quantize_into(comb[:, :, :e])
        keep = comb[:, :, e:]
        self.n_win = keep.shape[2]
        if self.n_win:
            self.win[:, :, : self.n_win] = keep.to(self.dtype16)

    def _rounding_matrix(self) -> torch.Tensor:
        iu = torch.triu_indices(self.D, self.D, offset=1, device=self.rounding.device)  # recomputed, not held
        U = torch.eye(self.D, dtype=torch.float32, device=self.rounding.device).repeat(self.H, 1, 1)
        U[:, iu[0], iu[1]] = self.rounding.float()
        return U

    def _params(self):
        if self.spec.dynamic:
            kw = {"clip_ratio": self._clip_arg}
            if self.spec.format is QFormat.NVFP4:
                kw["global_scale"] = self.global_scale.reshape(1, 1, 1, 1)
            return kw
        return {"scale": self.static_scale, "zero_point": self.static_zp}

    def _quantize_into(self, x: torch.Tensor) -> None:
        """Quantize ``x [B,H,e,D]`` (tokens leaving the window) into the payload after ``n_q``."""
        spec = self.spec
        if self.variant.centering:
            x = x - self.mean.to(x.dtype)
        q0 = self.n_q
        if self.transform is not Transform.NONE:  # into the quantized domain (positions = cache slots)
            x = apply_transform(self.transform, x, rope=self.rope, start=self.q_origin + q0)
        e = x.shape[2]
        if self.tg:
            x, q0, kw = self._token_group_params(x, q0)
        else:
            kw = self._params()
        if spec.format is QFormat.NVFP4 and float(self.global_scale) == 0.0:
            self.global_scale.copy_(nvfp4_global_scale(x.abs().amax()).reshape(1))
        qt = quantize(x, spec, tables=self._tables(), **kw)
        s_pad = qt.data.shape[2]
        self.data[:, :, q0 : q0 + s_pad] = qt.data
        if spec.dynamic:
            r0 = q0 // self.tg if self.tg else q0
            n = qt.scale.shape[2]
            self.scale[:, :, r0 : r0 + n] = qt.scale
            if self.zp is not None:
                self.zp[:, :, r0 : r0 + n] = qt.zero_point
        self.n_q = self.n_q + e

    def _tables(self, rounding: bool = True) -> QuantTables:
        """The side's variant tables as :func:`~kvcal.formats.quant.quantize` reads them, rebuilt from
        the compact forms held here (rounding triangle, uint8 widths, int8 trellis table; exact).
        ``rounding=False`` leaves out the rounding matrix (dequantizing does not need it)."""
        v = self.variant
        qa = rounding and v.rounding is Rounding.QUERY_AWARE
        return QuantTables(rounding=self._rounding_matrix() if qa else None,
                           channel_bits=self.channel_bits, levels=self.levels, scale_base=self.scale_base,
                           trellis=self._trellis_table() if v.codebook is Codebook.TRELLIS else None)

    def _trellis_table(self) -> torch.Tensor:
        """The int8 trellis table as the float32 values it encodes (exact)."""
        return self.trellis.float() / TRELLIS_UNIT

    def _token_group_params(self, x: torch.Tensor, q0: int):
        """Per-channel-token-group sides: ``(tokens to quantize, first slot, explicit scale / zero
        point)`` for new tokens ``x`` written at slot ``q0``.

        Every group's parameters come from the **raw** min / max of its tokens (then the clip ratio
        and per-channel widths), exactly as Protocol A computes them from the same tokens. While a
        group is still filling (``residual_window < g``, decode), its raw range ``(lo, hi)`` is kept
        in ``open_rng`` (float32 ``[B,H,2,D]``, in the memory
        accounting) so that its parameters stay Protocol A's for its tokens; members are re-quantized from their
        dequantized values when the range grows (one extra rounding each time) — never re-ranged
        from dequantized values, which would shrink a clipped range again at every token."""
        g = self.tg
        n_open = q0 % g
        raw = x.float()
        if n_open:
            g0 = q0 - n_open
            prev = dequantize(self._qt(g0, q0), x.dtype)  # centered / transformed values, like x
            x = torch.cat([prev, x], dim=2)
            lo, hi = self.open_rng[:, :, :1], self.open_rng[:, :, 1:]
            raw = torch.cat([lo.expand(-1, -1, n_open, -1), raw], dim=2)  # stand-ins for the members
            q0 = g0
        S = raw.shape[2]
        G = -(-S // g)
        rp = F.pad(raw, (0, 0, 0, G * g - S), mode="replicate") if G * g > S else raw
        rg = rp.reshape(raw.shape[0], raw.shape[1], G, g, raw.shape[3])
        mn, mx = rg.amin(3), rg.amax(3)  # [B,H,G,D]
        if n_open:
            mx[:, :, :1] = torch.maximum(mx[:, :, :1], hi)
        if (q0 + x.shape[2]) % g:  # the last group is still filling: keep its raw range
            self.open_rng[:, :, :1], self.open_rng[:, :, 1:] = mn[:, :, -1:], mx[:, :, -1:]
        return x, q0, dict(zip(("scale", "zero_point"), self._range_params(mn, mx), strict=True))

    def _range_params(self, mn: torch.Tensor, mx: torch.Tensor):
        """Stored ``(scale, zero_point)`` of token groups with raw ranges ``[mn, mx]`` ``[B,H,G,D]``."""
        c = None if self._clip_arg is None else self._clip_arg.float().reshape(1, -1, 1, 1)
        if self.spec.symmetric:
            return params_from_range(self.spec, amax=torch.maximum(mx.abs(), mn.abs()), clip_ratio=c)
        top = ((2.0 ** self.channel_bits.float() - 1)[None, :, None, :]
               if self.variant.channel_widths is ChannelWidths.ALLOCATED else None)
        return params_from_range(self.spec, amax=mx, amin=mn, clip_ratio=c, qmax=top)

    def _qt(self, a: int, b: int) -> QuantizedTensor:
        """The stored tokens ``[a, b)`` of the quantized region (``a`` on a group boundary)."""
        spec = self.spec
        s_pad, _ = spec.padded_dims(b - a, self.D)
        data = self.data[:, :, a : a + s_pad]
        if spec.dynamic:
            r0, r1 = (a // self.tg, -(-b // self.tg)) if self.tg else (a, b)
            scale = self.scale[:, :, r0:r1]
            zp = None if self.zp is None else self.zp[:, :, r0:r1]
        else:
            scale, zp = self.static_scale, self.static_zp
        gs = self.global_scale.reshape(1, 1, 1, 1) if self.global_scale is not None else None
        return QuantizedTensor(data, scale, zp, (self.B, self.H, b - a, self.D), spec, self.dtype, gs,
                               self._tables(rounding=False))

    # ---- read -----------------------------------------------------------------------------------
    def read(self) -> torch.Tensor:
        """All held tokens dequantized, ``[B,H,t,D]`` in the model's dtype."""
        if not self.quantized:
            return self.win[:, :, : self.n_win].to(self.dtype)
        parts = []
        if self.n_sink:
            parts.append(self.sink[:, :, : self.n_sink].to(self.dtype))
        if self.n_q:
            if self.transform is not Transform.NONE:
                y = dequantize(self._qt(0, self.n_q), torch.float32)
                y = apply_transform(self.transform, y, rope=self.rope, start=self.q_origin, inverse=True).to(self.dtype)
            else:
                y = dequantize(self._qt(0, self.n_q), self.dtype)
            parts.append(y + self.mean.to(self.dtype) if self.variant.centering else y)
        if self.n_win:
            parts.append(self.win[:, :, : self.n_win].to(self.dtype))
        if not parts:
            return torch.empty(self.B, self.H, 0, self.D, dtype=self.dtype, device=self.device)
        return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]

    # ---- batch ops ------------------------------------------------------------------------------
    def map_batch(self, fn) -> None:
        for name in ("sink", "win", "data", "scale", "zp", "open_rng"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, fn(t))
        if self.win is not None:
            self.B = self.win.shape[0]
