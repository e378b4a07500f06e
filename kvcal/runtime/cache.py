"""``QuantizedKVCache``: a transformers ``Cache`` that stores K/V as a :class:`~kvcal.plan.KVPlan` says.

Use::

    cache = QuantizedKVCache.from_artifact("artifacts/smollm2-135m-fp8", model)
    out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=64)

What one layer's side (K or V, spec ``s``, ``H`` KV heads, head_dim ``D``, batch ``B``) holds
------------------------------------------------------------------------------------------------
Token order of a sequence is ``[sinks | quantized | window]``:

* **sinks**: the first ``n_sink = plan.sink_tokens`` tokens, ``dtype16 [B,H,n_sink,D]`` (bf16);
* **quantized**: a :class:`~kvcal.formats.quant.QuantizedTensor` laid out in preallocated buffers —
  payload ``[B,H,S_pad,row_bytes]`` (real ``float8_e4m3fn`` / ``int8`` / packed ``uint8`` codes),
  dynamic scales (and zero points) ``granularity.scale_shape(B,H,n_q,D)`` at ``s.scale_dtype``;
  static scales / zero points ``[1,H,1,D]``-style and dynamic ``clip_ratio float32 [H]`` once per
  layer; NVFP4 adds a ``float32 [1]`` global scale;
* **window**: the most recent tokens, ``dtype16 [B,H,residual_window,D]``.

Write policy (each entry is quantized when it is written; the *window* delays that):

* tokens after the sinks enter the window; when it would hold more than ``residual_window``
  tokens the oldest leave it and are quantized (from their 16-bit values). Per-token and static
  granularities evict token by token.
* per-channel-token-group sides (KIVI keys, group ``g``) with ``residual_window >= g`` evict whole
  groups: when the window overflows, the oldest ``g·k`` tokens are quantized together (KIVI
  style), so the window holds between ``residual_window - g + 1`` and ``residual_window`` tokens
  and a group is never quantized before it is full;
* with ``residual_window < g`` such a side has nowhere to hold an incomplete group in 16 bits, so
  the open group is quantized in place. It keeps its **raw** min / max (``float32 [B,H,2,D]`` per
  sequence, in the allocation contract), so its parameters are always those Protocol A computes
  from the same tokens (clip ratio applied once); when a new token widens that range, the members
  are re-quantized from their dequantized values under the new parameters — one extra rounding
  per widening, no compounding (before this, the range was re-derived from dequantized, already
  clipped members and shrank again at every token). Prefill of a whole sequence is exact.

Reads dequantize everything (``update`` returns ``[B,H,t,D]`` in the model's dtype), so the
attention of the step that writes tokens already sees them quantized — a prefill through this
cache with ``residual_window = 0`` is Protocol A (``KVPlan.fake_quant``) bit for bit.

Unquantized sides (``fp16``/``bf16`` spec) hold one ``[B,H,t,D]`` 16-bit buffer (no window or
sinks), as the contract says.

Transforms (:mod:`kvcal.formats.transforms`): a ``hadamard`` side rotates tokens by ``H/√D`` as
they are quantized and rotates back when it dequantizes; a ``pre_rope`` key side un-rotates each
token at its position before quantizing and re-applies RoPE after dequantizing. Sinks and the
residual window stay as attention reads them. Both cost no bytes (the Hadamard matrix and the
RoPE angles are recomputed). A side with query-aware rounding keeps the strict upper triangle of its
unit-diagonal rounding matrix in float8 e4m3 ``[H, D(D-1)/2]`` (per-layer metadata, in the accounting); one with
per-channel bit widths keeps them as ``uint8 [H, D]`` and packs each row with
:func:`kvcal.formats.packing.pack_channels`. ``pre_rope`` needs every token's position to equal its cache slot
(transformers passes ``position_ids`` to ``update``; a left-padded batch is refused with a
``ValueError`` rather than rotated at the wrong angle).

Allocation (the contract of :mod:`kvcal.formats.memory`, byte for byte)
-------------------------------------------------------------------------
``max_cache_len=T`` preallocates every buffer for ``T`` tokens at the first ``update`` (server
style), so ``allocated_bytes() == cache_bytes(model, plan configs, T, B)``. Without it the
buffers grow to exactly the contract's sizes for the current length ``t``, so
``allocated_bytes() == cache_bytes(..., context=t, batch=B)`` after every update. Before the first
update only per-layer metadata is held (``cache_bytes(context=0)``), including the key-centering
mean ``k_mean float32 [1,H,1,D]`` of layers whose plan has one (``KVCacheConfig.key_centering``).

Left padding: pad positions are cached like any token and masked by attention. Sinks are the
first cache slots of each row, so with left padding the pads, not the prompt's first tokens, are
the sinks (use ``sink_tokens = 0`` or equal-length prompts when that matters).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvcal.errors import ArtifactError
from kvcal.formats.codes import TRELLIS_UNIT, check_channel_bits, check_levels, check_trellis, unit_rounding
from kvcal.formats.fp8 import FP8_FORMATS
from kvcal.formats.quant import QuantizedTensor, dequantize, quantize
from kvcal.formats.scales import check_scale_base, nvfp4_global_scale, params_from_range
from kvcal.formats.spec import DEFAULTS, LOG8, QFormat
from kvcal.formats.transforms import apply_transform
from kvcal.formats.variants import QuantTables
from kvcal.plan import KVPlan, SidePlan

try:  # transformers is a runtime dependency of this layer (style: runtime adds transformers)
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError as e:  # pragma: no cover
    raise ImportError("kvcal.runtime needs transformers") from e


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


class _Side:
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
        self.transform = sp.transform if self.quantized else "none"
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
        if self.quantized and sp.rounding is not None:
            iu = torch.triu_indices(D, D, offset=1)
            u = unit_rounding(torch.broadcast_to(sp.rounding.float(), (H, D, D)))
            self.rounding = u[:, iu[0], iu[1]].to(torch.float8_e4m3fn).clone()
        self.channel_bits = None  # uint8 [H, D] per-channel payload widths (rows keep the spec's size)
        if self.quantized and sp.channel_bits is not None:
            self.channel_bits = check_channel_bits(sp.channel_bits, self.spec, H, D).to(torch.uint8)
        self.levels = None  # float32 [H, 2^b] non-uniform levels (codes index them)
        if self.quantized and sp.levels is not None:
            self.levels = check_levels(sp.levels, self.spec, H).clone()
        self.trellis = None  # int8 [2^(nu+b)] trellis table in units of 1/TRELLIS_UNIT of the row's scale
        if self.quantized and sp.trellis is not None:
            self.trellis = (check_trellis(sp.trellis, self.spec, D) * TRELLIS_UNIT).round().to(torch.int8)
        self.scale_base = None  # float32 [H] base of log8 per-token scales
        if self.quantized and self.spec.scale_dtype == LOG8:
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
            if sp.mean is not None:
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
        if self.mean is not None:
            x = x - self.mean.to(x.dtype)
        q0 = self.n_q
        if self.transform != "none":  # into the quantized domain (positions = cache slots)
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

    def _tables(self) -> QuantTables:
        """The side's variant tables as :func:`~kvcal.formats.quant.quantize` reads them, rebuilt from
        the compact forms held here (rounding triangle, uint8 widths, int8 trellis table; exact)."""
        return QuantTables(rounding=None if self.rounding is None else self._rounding_matrix(),
                           channel_bits=self.channel_bits, levels=self.levels, scale_base=self.scale_base,
                           trellis=None if self.trellis is None else self._trellis_table())

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
        top = None if self.channel_bits is None else (2.0 ** self.channel_bits.float() - 1)[None, :, None, :]
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
                               self.channel_bits, self.levels, self.scale_base,
                               None if self.trellis is None else self._trellis_table())

    # ---- read -----------------------------------------------------------------------------------
    def read(self) -> torch.Tensor:
        """All held tokens dequantized, ``[B,H,t,D]`` in the model's dtype."""
        if not self.quantized:
            return self.win[:, :, : self.n_win].to(self.dtype)
        parts = []
        if self.n_sink:
            parts.append(self.sink[:, :, : self.n_sink].to(self.dtype))
        if self.n_q:
            if self.transform != "none":
                y = dequantize(self._qt(0, self.n_q), torch.float32)
                y = apply_transform(self.transform, y, rope=self.rope, start=self.q_origin, inverse=True).to(self.dtype)
            else:
                y = dequantize(self._qt(0, self.n_q), self.dtype)
            parts.append(y + self.mean.to(self.dtype) if self.mean is not None else y)
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


class QuantizedKVLayer(CacheLayerMixin):
    """One decoder layer's quantized K/V storage (a transformers ``CacheLayerMixin``).

    ``sliding_window`` ``W > 0``: a sliding-window layer (transformers' ``DynamicSlidingWindowLayer``
    contract): each update returns the ``min(seen, W - 1)`` previous tokens plus the new ones (the model's
    sliding mask, sized by :meth:`get_mask_sizes`, hides the rest), then drops what no later query reads
    (:meth:`_Side.drop_before`), so it holds at most ``W - 1`` tokens (plus whole token groups / a 16-bit
    window of token-group sides, :func:`kvcal.formats.memory.sliding_held`). Kept tokens are never
    re-quantized: it reads the values a full-attention cache of the same plan would hold there. It is
    sized by what it holds, never preallocated to ``max_cache_len``."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, plan: KVPlan, layer_idx: int, num_kv_heads: int, head_dim: int,
                 max_cache_len: int | None = None, sliding_window: int = 0):
        super().__init__()
        lp = plan.layers[layer_idx]
        self.layer_idx = layer_idx
        self.sliding_window = int(sliding_window)
        self.is_sliding = self.sliding_window > 0
        self.max_cache_len = None if self.is_sliding else max_cache_len
        self.capacity = max_cache_len
        self.k = _Side(lp.k, num_kv_heads, head_dim, plan.sink_tokens, plan.residual_window)
        self.v = _Side(lp.v, num_kv_heads, head_dim, plan.sink_tokens, plan.residual_window)
        self.cumulative_length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        if H != self.k.H or D != self.k.D:
            raise ValueError(f"layer {self.layer_idx}: key states have {H} heads x head_dim {D}, the plan "
                             f"was built for {self.k.H} x {self.k.D}")
        self.device = key_states.device
        for side, x in ((self.k, key_states), (self.v, value_states)):
            side.init(B, x.device, x.dtype)
            if self.max_cache_len is not None:
                side.reserve(self.max_cache_len)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write ``[B,H,s,D]`` new keys/values; return all cached keys/values dequantized ``[B,H,t,D]``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if "pre_rope" in (self.k.transform, self.v.transform):
            self._check_positions(key_states, kwargs)
        s = key_states.shape[-2]
        t = self.cumulative_length + s
        if self.capacity is not None and t > self.capacity:
            raise ValueError(f"QuantizedKVCache is full: {t} tokens > max_cache_len {self.capacity}")
        if self.is_sliding:
            W = self.sliding_window
            n = min(self.cumulative_length, W - 1) + s  # what this step's queries may read (get_mask_sizes)
            for side, x in ((self.k, key_states), (self.v, value_states)):
                side.reserve_more(s)
                side.append(x)
            k, v = self.k.read()[:, :, -n:], self.v.read()[:, :, -n:]
            for side in (self.k, self.v):
                side.drop_before(max(0, t - (W - 1)))
            self.cumulative_length = t
            return k, v
        for side, x in ((self.k, key_states), (self.v, value_states)):
            side.reserve(t)
            side.append(x)
        self.cumulative_length = t
        return self.k.read(), self.v.read()

    def _check_positions(self, x: torch.Tensor, kwargs: dict) -> None:
        """Pre-RoPE sides rotate by the cache slot: refuse position ids that differ from it."""
        inner = kwargs.get("kwargs")
        pos = inner.get("position_ids") if isinstance(inner, dict) else None
        if pos is None:
            pos = kwargs.get("position_ids")
        s = x.shape[-2]
        if pos is None:
            raise ValueError(f"layer {self.layer_idx}: a pre-RoPE key cache needs the position_ids of new tokens "
                             "(transformers passes them to Cache.update); none were given")
        want = torch.arange(self.cumulative_length, self.cumulative_length + s, device=pos.device)
        if pos.shape[-1] != s or not bool((pos.reshape(-1, s) == want).all()):
            raise ValueError(f"layer {self.layer_idx}: pre-RoPE keys need positions equal to cache slots "
                             f"{self.cumulative_length}..{self.cumulative_length + s - 1}; got other position ids "
                             "(left padding?). Batch prompts of equal length or use a post-RoPE plan.")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.is_sliding:  # as transformers' DynamicSlidingWindowLayer: W - 1 past tokens at most
            W = self.sliding_window
            return min(self.cumulative_length, W - 1) + query_length, max(self.cumulative_length - W + 1, 0)
        return self.cumulative_length + query_length, 0

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        if self.is_sliding:
            return self.sliding_window
        return -1 if self.max_cache_len is None else self.max_cache_len

    def reset(self) -> None:
        for side in (self.k, self.v):
            if side.B:
                side.init(side.B, side.device, side.dtype)
                if self.max_cache_len is not None:
                    side.reserve(self.max_cache_len)
            side.n_sink = side.n_win = side.n_q = side.sinks_written = 0
            side.q_origin = side.sinks
            if side.global_scale is not None:
                side.global_scale.zero_()
        self.cumulative_length = 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("QuantizedKVCache cannot be cropped (quantized groups are not reversible)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for side in (self.k, self.v):
            side.map_batch(lambda t: t.index_select(0, indices.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        for side in (self.k, self.v):
            side.map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def offload(self):  # buffers stay where they are
        return None

    def prefetch(self):
        return None

    def nbytes(self) -> int:
        return self.k.nbytes() + self.v.nbytes()


class QuantizedKVCache(Cache):
    """A transformers ``Cache`` storing every layer's K/V as ``plan`` says (module docstring).

    ``plan``: :class:`~kvcal.plan.KVPlan` (post-RoPE keys, or pre-RoPE / Hadamard sides with
    their transform, see the module docstring). ``model_config``: the model's
    transformers config (or its text config). ``max_cache_len``: preallocate this many tokens per
    sequence at the first update (``None``: grow exactly); sliding-window layers (the config's
    ``layer_types`` / ``sliding_window``, e.g. Gemma 3) are :class:`QuantizedKVLayer` with their window, hold
    at most about ``W - 1`` tokens and are never preallocated. Raises ``ValueError`` if the plan's layer count /
    scale shapes do not fit the config or the config has layer types other than full / sliding attention.
    """

    def __init__(self, plan: KVPlan, model_config, max_cache_len: int | None = None):
        from kvcal.formats.memory import model_shape

        cfg = model_config.get_text_config(decoder=True) if hasattr(model_config, "get_text_config") else model_config
        shp = model_shape(cfg)
        if plan.num_layers != shp.num_layers:
            raise ValueError(f"plan has {plan.num_layers} layers, the model {shp.num_layers}")
        if plan.key_position not in ("post_rope", "pre_rope"):
            raise ValueError(f"unknown key_position {plan.key_position!r}")
        if plan.key_position == "pre_rope" and plan.rope_table() is None:
            raise ValueError("plan says keys are pre-RoPE but no key side has a RoPE table")
        if max_cache_len is not None and (not isinstance(max_cache_len, int) or max_cache_len < 1):
            raise ValueError(f"max_cache_len must be a positive integer or None, got {max_cache_len!r}")
        self.plan, self.shape, self.max_cache_len = plan, shp, max_cache_len
        layers = [QuantizedKVLayer(plan, i, shp.num_kv_heads, shp.head_dim, max_cache_len, shp.window(i))
                  for i in range(shp.num_layers)]
        super().__init__(layers=layers)

    @classmethod
    def from_artifact(cls, path_or_artifact, model, max_cache_len: int | None = None) -> QuantizedKVCache:
        """Build the cache for ``model`` from a kvcal artifact directory / file or a loaded
        :class:`~kvcal.artifact.Artifact`. Loading is strict: raises :class:`ArtifactError` naming
        the field (num_layers, num_kv_heads, head_dim, config_sha256) when the artifact was made
        for another model, or naming the missing/ill-shaped tensor."""
        from kvcal.artifact import Artifact, check_model_match, load_artifact
        from kvcal.models import model_metadata

        art = path_or_artifact if isinstance(path_or_artifact, Artifact) else load_artifact(path_or_artifact)
        mm = model_metadata(model.config, getattr(model, "kvcal_source", None), architecture=type(model).__name__)
        check_model_match(art.metadata, mm)
        try:
            plan = KVPlan.from_artifact(art.tensors, art.metadata)
            return cls(plan, model.config, max_cache_len)
        except (ValueError, KeyError, RuntimeError) as e:
            raise ArtifactError(f"{art.path}: cannot build the runtime cache: {e}") from None

    def kv_configs(self) -> list:
        """One :class:`~kvcal.formats.spec.KVCacheConfig` per layer (for the memory accounting)."""
        return [self.plan.kv_config(i) for i in range(self.plan.num_layers)]

    @property
    def batch_size(self) -> int:
        b = self.layers[0].k.B
        return b if b else -1

    def allocated_bytes(self) -> int:
        """Bytes of every tensor the cache holds (``nbytes`` sum over layers and sides)."""
        return sum(layer.nbytes() for layer in self.layers)

    def expected_bytes(self) -> int:
        """:func:`kvcal.formats.memory.cache_bytes` for this cache's capacity and batch (the
        current length when growing; ``max_cache_len`` when preallocated)."""
        from kvcal.formats.memory import cache_bytes, memory_report

        t = self.get_seq_length()
        ctx = self.max_cache_len if (self.max_cache_len is not None and self.layers[0].is_initialized) else t
        if self.shape.layer_windows:  # sliding layers are sized by what they hold after t tokens
            return memory_report(self.shape, self.kv_configs(), ctx, max(self.layers[0].k.B, 1),
                                 sliding_context=t).total
        return cache_bytes(self.shape, self.kv_configs(), ctx, max(self.layers[0].k.B, 1))


__all__ = ["QuantizedKVCache", "QuantizedKVLayer"]
