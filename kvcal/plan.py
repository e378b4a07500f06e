"""A quantization plan: for every layer and side, the spec and the calibrated parameters.

The one object the optimizer produces, the artifact stores, and the runtime cache / evaluation
consume. Torch + formats only (no transformers, no safetensors).

Per layer ``i`` and side ``s ∈ {k, v}`` (:class:`SidePlan`):

* ``spec``: :class:`~kvcal.formats.spec.TensorQuantSpec` (format, granularity, symmetric);
* static granularities: ``scale`` (and ``zero_point`` when asymmetric) shaped
  ``spec.granularity.scale_shape(1, H, 1, D)`` — ``[1,1,1,1]`` / ``[1,H,1,1]`` / ``[1,H,1,D]``;
* dynamic granularities: ``clip_ratio`` ``[H]`` (fraction of each group's range, 1 = min/max);
* ``mean`` (keys only, optional): per-channel centering ``[1,H,1,D]`` subtracted before
  quantizing and added back after dequantizing — exact under softmax because it shifts every
  score of a query by the same constant (SageAttention; ModelOpt FP8 "affine");
* ``transform``: a :class:`~kvcal.formats.transforms.Transform` — ``NONE`` (quantize what attention
  reads), ``PRE_ROPE`` (keys: quantize the pre-RoPE key, RoPE re-applied after dequantizing; needs
  ``rope``) or ``HADAMARD`` (rotate the head dimension before quantizing) — see
  :mod:`kvcal.formats.transforms`; artifacts hold its string (``"none"``, ``"pre_rope"``,
  ``"hadamard"``). Centering and a transform do not combine (``mean`` must be ``None`` unless the
  transform is ``NONE``);
* ``rounding`` (int sides, optional): ``U`` ``[H,D,D]`` float32 for query-aware rounding in the
  quantized (transformed) domain (:func:`kvcal.formats.codes.rounding_matrix`); it is used, and
  the runtime keeps it, in its 8-bit unit-diagonal form :func:`kvcal.formats.codes.unit_rounding`
  (``H·D(D−1)/2`` bytes per layer, counted as per-layer metadata);
* ``channel_bits`` (asymmetric int, per-channel token groups, optional): per-channel payload widths
  ``[H,D]`` (int64, 1–8 bits, each head summing to ``bits·D``: the row keeps its size;
  :func:`kvcal.search.tables.channel_bit_allocation`), ``H·D`` bytes of per-layer metadata;
* ``scale_base`` (log8 scales only): ``float32 [H]``, the per-head base of the 8-bit log-coded
  per-token scales (:func:`kvcal.formats.scales.log8_base`);
* ``levels`` (symmetric int2–int6, per-token / per-token-group, optional): non-uniform levels
  ``float32 [H, 2^b]`` in units of each group's absmax (:func:`kvcal.formats.codes.check_levels`;
  fitted by :func:`kvcal.search.tables.fit_levels`), ``4·H·2^b`` bytes of per-layer metadata;
* ``trellis`` (symmetric int2–int4 values, per-token, optional): a trellis table ``float32 [2^(ν+b)]``
  of int8 multiples of 1/32 (:func:`kvcal.formats.codes.check_trellis`; fitted by
  :func:`kvcal.search.tables.fit_trellis`), ``2^(ν+b)`` bytes of per-layer metadata; the side then
  has no ``clip_ratio`` (the row's RMS is its scale).

Which variant a side is comes from its types, not from which tensor is present: ``SidePlan.codebook``,
``rounding_mode``, ``channel_widths``, ``scale_coding``, ``centered`` and ``variant`` (a
:class:`~kvcal.formats.variants.SideVariant`, what :meth:`KVPlan.kv_config` puts in the cache config).

Artifact tensor names (see :mod:`kvcal.artifact`): ``model.layers.{i}.self_attn.{s}_scale`` stored
squeezed (``[1]``, ``[H,1,1]``, ``[H,1,D]``), ``{s}_zero_point`` (same shape), ``{s}_clip_ratio``
``[H]``, ``k_mean`` ``[H,1,D]``, ``{s}_rounding`` ``[H,D,D]``, ``{s}_channel_bits`` ``[H,D]``, ``{s}_levels`` ``[H,2^b]``, ``{s}_trellis`` ``[2^(ν+b)]``, ``{s}_scale_base`` ``[H]``; ``rotary.inv_freq`` ``[D/2]`` when some key side is pre-RoPE
(per-layer transforms go in the metadata's ``kv.transforms``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcal.formats.codes import check_channel_bits, check_levels, check_trellis, unit_rounding
from kvcal.formats.granularity import PerChannel, PerHead, PerTensor
from kvcal.formats.quant import fake_quant
from kvcal.formats.scales import check_scale_base
from kvcal.formats.spec import DTYPE_NAMES, KVCacheConfig, TensorQuantSpec
from kvcal.formats.transforms import RopeTable, Transform, apply_transform
from kvcal.formats.variants import (
    Codebook,
    HasTables,
    QuantTables,
    Rounding,
    ScaleCoding,
    SideVariant,
)

SIDES = ("k", "v")


def _checked(tensor_name: str, spec: TensorQuantSpec, check, *args):
    """``check(*args)``, its ``ValueError`` prefixed with the artifact tensor and the side's spec."""
    try:
        return check(*args)
    except ValueError as e:
        raise ValueError(f"{tensor_name} ({spec.format.value} {spec.granularity.name} "
                         f"{'sym' if spec.symmetric else 'asym'} side): {e}") from None


def _set_table(sp: SidePlan, name: str, value: torch.Tensor, tensor: str) -> None:
    """``setattr(sp, name, value)``, its ``ValueError`` (a refused combination) prefixed with the artifact tensor."""
    try:
        setattr(sp, name, value)
    except ValueError as e:
        raise ValueError(f"{tensor}: {e}") from None


def tensor_name(layer: int, side: str, kind: str = "scale") -> str:
    """Artifact tensor name, e.g. ``tensor_name(3, "k") == "model.layers.3.self_attn.k_scale"``.

    The one naming rule for every per-layer artifact tensor (``kind``: ``scale``, ``zero_point``,
    ``clip_ratio``, ``mean``, ``rounding``, ``channel_bits``, ``levels``, ``trellis``,
    ``scale_base``, ``rope_inv_freq``).
    Raises ``ValueError`` for a side other than ``"k"`` / ``"v"``."""
    if side not in SIDES:
        raise ValueError(f"side must be 'k' or 'v', got {side!r}")
    return f"model.layers.{layer}.self_attn.{side}_{kind}"



def _squeeze_static(t: torch.Tensor, spec: TensorQuantSpec) -> torch.Tensor:
    """``[1,1,1,1] -> [1]``, ``[1,H,1,1] -> [H,1,1]``, ``[1,H,1,D] -> [H,1,D]`` (engine layout)."""
    if isinstance(spec.granularity, PerTensor):
        return t.reshape(1)
    return t.reshape(t.shape[1:])


def _unsqueeze_static(t: torch.Tensor, spec: TensorQuantSpec, H: int, D: int) -> torch.Tensor:
    return t.reshape(spec.granularity.scale_shape(1, H, 1, D))


class _Table:
    """A :class:`SidePlan` attribute held in its ``tables`` (:class:`~kvcal.formats.variants.QuantTables`):
    reading gives the tensor (``None``: absent); assigning replaces it, checked like a new plan — a
    refused combination raises ``ValueError`` and leaves the plan unchanged."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, sp, owner=None):
        return self if sp is None else getattr(sp.tables, self.name)

    def __set__(self, sp, value):
        old = sp.tables
        sp.tables = old.replace(**{self.name: value})
        try:
            sp._check_variants()
        except ValueError:
            sp.tables = old
            raise


class SidePlan(HasTables):
    """One layer's K or V: spec plus calibrated parameters (see module docstring for shapes).

    Fields: ``spec``; the scale parameters ``scale`` / ``zero_point`` (static sides) or
    ``clip_ratio`` (dynamic sides); ``mean`` (key centering, :attr:`centered`); ``transform`` (a
    :class:`~kvcal.formats.transforms.Transform`; its string is accepted and converted) / ``rope``; and
    ``tables``, a :class:`~kvcal.formats.variants.QuantTables` holding the side's variant tables
    (codebook: uniform / ``levels`` / ``trellis``; ``rounding`` matrix; per-channel widths
    ``channel_bits``; log8 ``scale_base``), read as :attr:`codebook`, :attr:`rounding_mode`,
    :attr:`channel_widths`, :attr:`scale_coding` (all of them: :attr:`variant`). Each table is also an attribute
    (``sp.levels``, ``sp.rounding``, ...; assigning one replaces it in ``tables``, checked).

    Raises ``ValueError`` (one line) when built with a combination no quantizer defines:
    ``tables`` combinations refused by :class:`~kvcal.formats.variants.QuantTables`; a levels or
    trellis codebook with a calibrated ``scale`` (their scale is each group's absmax / RMS); a
    trellis side with a ``clip_ratio``; a variant table on a side whose spec is not an int format;
    a log8 ``scale_base`` on a spec without log8 scales; or, as :meth:`check_transform`, an unknown
    transform, ``pre_rope`` without ``rope``, a transform with ``mean``. (The fit of each table with
    the spec — shapes, bits, granularity — is checked where it is used.)"""

    rounding = _Table()  #: query-aware rounding matrix ``U [H, D, D]``
    channel_bits = _Table()  #: per-channel widths ``[H, D]``
    levels = _Table()  #: levels table ``[H, 2^b]``
    scale_base = _Table()  #: log8 base ``[H]``
    trellis = _Table()  #: trellis table ``[2^(ν+b)]``

    def __init__(self, spec: TensorQuantSpec, scale: torch.Tensor | None = None,
                 zero_point: torch.Tensor | None = None, clip_ratio: torch.Tensor | None = None,
                 mean: torch.Tensor | None = None, transform: Transform = Transform.NONE,
                 rope: RopeTable | None = None,
                 *, tables: QuantTables | None = None):
        self.spec = spec
        self.scale = scale
        self.zero_point = zero_point
        self.clip_ratio = clip_ratio
        self.mean = mean
        self.transform = transform
        self.rope = rope
        self.tables = QuantTables.coerce(tables)
        self._check_variants()
        self.check_transform()

    def _check_variants(self) -> None:
        t = self.tables
        if t.codebook is not Codebook.UNIFORM and self.scale is not None:
            raise ValueError(f"a {t.codebook.value} side takes its scale from each group (absmax / RMS); pass "
                             "clip_ratio, not a calibrated scale")
        if t.codebook is Codebook.TRELLIS and self.clip_ratio is not None:
            raise ValueError("a trellis side takes no clip_ratio (its scale is the row's RMS)")
        present = [n for n in t.as_kwargs() if n != "scale_base"]
        if present and self.spec.format.kind != "int":
            raise ValueError(f"{', '.join(present)} need an int spec, not {self.spec.format.value}")
        if t.scale_base is not None and ScaleCoding.of(self.spec) is not ScaleCoding.LOG8:
            raise ValueError("scale_base is for log8 scales (scale_dtype='log8'); this side's scales are "
                             f"{DTYPE_NAMES.get(self.spec.scale_dtype, self.spec.scale_dtype)}")

    def __repr__(self) -> str:
        parts = [f"spec={self.spec!r}"]
        for n in ("scale", "zero_point", "clip_ratio", "mean"):
            v = getattr(self, n)
            if v is not None:
                parts.append(f"{n}={tuple(v.shape)}")
        parts.append(f"transform={self.transform.value!r}")
        parts += [f"{n}={tuple(v.shape)}" for n, v in self.tables.as_kwargs().items()]
        return f"SidePlan({', '.join(parts)})"

    @property
    def transform(self) -> Transform:
        """The side's :class:`~kvcal.formats.transforms.Transform` (assigning its string converts it;
        an unknown one raises ``ValueError``)."""
        return self._transform

    @transform.setter
    def transform(self, value) -> None:
        self._transform = Transform.of(value)

    # ---- the variants, as typed values --------------------------------------------------------
    @property
    def centered(self) -> bool:
        """Whether keys are stored minus a calibrated per-channel mean (``mean``)."""
        return self.mean is not None

    @property
    def variant(self) -> SideVariant:
        """The side's :class:`~kvcal.formats.variants.SideVariant` (codebook, rounding, widths, centering,
        trellis entries)."""
        return self.tables.variant(centering=self.centered)

    def check_transform(self) -> None:
        """Raise ``ValueError`` for ``pre_rope`` without a RoPE table, or a transform combined with key
        centering (an unknown transform is refused when assigned)."""
        if self.transform is Transform.PRE_ROPE and self.rope is None:
            raise ValueError("a pre-RoPE side needs the model's RoPE table (SidePlan.rope)")
        if self.transform is not Transform.NONE and self.centered:
            raise ValueError(f"key centering does not combine with transform {self.transform.value!r}")

    def _unit_rounding(self) -> torch.Tensor:
        """:func:`unit_rounding` of ``self.rounding``, memoized per tensor object (no device sync per call)."""
        memo = self.__dict__.get("_ur")
        if memo is None or memo[0] is not self.rounding:
            memo = (self.rounding, unit_rounding(self.rounding))
            self.__dict__["_ur"] = memo
        return memo[1]

    def fake_quant(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Quantize-dequantize ``x [B, H, S, D]`` with this plan; same shape and dtype.

        ``start``: position of ``x``'s first token (used by the ``pre_rope`` transform only)."""
        if not self.spec.is_quantized:
            return fake_quant(x, self.spec)
        self.check_transform()
        if self.transform is not Transform.NONE:
            xq = apply_transform(self.transform, x, rope=self.rope, start=start)
        else:
            xq = x - self.mean.to(x.dtype) if self.centered else x
        params = ({"clip_ratio": self.clip_ratio} if self.spec.dynamic
                  else {"scale": self.scale, "zero_point": self.zero_point})
        tables = self.tables
        if tables.rounding_mode is Rounding.QUERY_AWARE:
            tables = tables.replace(rounding=self._unit_rounding())  # as the runtime keeps it
        y = fake_quant(xq, self.spec, tables=tables, **params)
        if self.transform is not Transform.NONE:
            return apply_transform(self.transform, y, rope=self.rope, start=start, inverse=True).to(x.dtype)
        return y + self.mean.to(x.dtype) if self.centered else y


def quantize_seq(plan: SidePlan, x: torch.Tensor, sinks: int = 0) -> torch.Tensor:
    """Fake-quantize one sequence ``x [H, T, D]`` (float) with a side plan, as :meth:`KVPlan.fake_quant` does.

    The first ``sinks`` tokens are rounded to bfloat16 (kept in 16 bits) and the rest goes through
    ``plan.fake_quant`` with token positions starting at ``sinks``. Returns ``[H, T, D]`` in ``x``'s
    dtype. Shared by the search (:mod:`kvcal.search.optimizer`) and the fused key-error kernel's
    torch reference (:mod:`kvcal.kernels.attn_error`)."""
    n = min(sinks, x.shape[1])
    y = plan.fake_quant(x[None, :, n:], start=n)[0]
    if n == 0:
        return y
    return torch.cat([x[:, :n].to(torch.bfloat16).to(x.dtype), y], dim=1)


@dataclass
class LayerPlan:
    k: SidePlan
    v: SidePlan

    def side(self, s: str) -> SidePlan:
        return self.k if s == "k" else self.v


@dataclass
class KVPlan:
    """Plan for every layer. ``sink_tokens`` first tokens and (runtime only) the ``residual_window``
    most recent tokens stay in 16 bits; ``key_position`` is ``"post_rope"`` (what engines cache)."""

    layers: list[LayerPlan]
    residual_window: int = 0
    sink_tokens: int = 0
    key_position: str = "post_rope"
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if any(lp.k.transform is Transform.PRE_ROPE for lp in self.layers):
            self.key_position = "pre_rope"

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def kv_config(self, layer: int = 0) -> KVCacheConfig:
        """The cache layout of ``layer``: its specs, windows and the sides' variants."""
        lp = self.layers[layer]
        return KVCacheConfig(lp.k.spec, lp.v.spec, residual_window=self.residual_window, sink_tokens=self.sink_tokens,
                             key_variant=lp.k.variant, value_variant=lp.v.variant)

    def fake_quant(self, layer: int, side: str, x: torch.Tensor) -> torch.Tensor:
        """Teacher-forced (Protocol A) fake quantization of what attention reads, ``x [B,H,S,D]``.

        Every token is quantized except the first ``sink_tokens`` (kept in 16 bits, as the runtime
        cache keeps them). The residual window is NOT applied here: under Protocol A every key/value
        that attention reads is quantized (a recent window would make any method look lossless).
        """
        sp = self.layers[layer].side(side)
        n = min(self.sink_tokens, x.shape[2])
        if n == 0 or not sp.spec.is_quantized:  # an unquantized side keeps its own 16-bit dtype, sinks too
            return sp.fake_quant(x)
        head = x[:, :, :n].to(torch.bfloat16).to(x.dtype)
        return torch.cat([head, sp.fake_quant(x[:, :, n:], start=n)], dim=2)

    # ---- artifact tensors ------------------------------------------------------------------
    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Artifact tensors (float32) named as in the module docstring. Raises ``ValueError`` for a
        log8 side without its ``scale_base`` (the artifact could not be loaded back)."""
        out = {}
        for i, lp in enumerate(self.layers):
            for s in SIDES:
                sp = lp.side(s)
                if sp.scale_coding is ScaleCoding.LOG8 and sp.scale_base is None:
                    raise ValueError(f"layer {i} {s}: log8 scales need SidePlan.scale_base (calibrate the side)")
                if sp.scale is not None:
                    out[tensor_name(i, s, "scale")] = _squeeze_static(sp.scale.float(), sp.spec)
                if sp.zero_point is not None:
                    out[tensor_name(i, s, "zero_point")] = _squeeze_static(sp.zero_point.float(), sp.spec)
                if sp.clip_ratio is not None:
                    out[tensor_name(i, s, "clip_ratio")] = sp.clip_ratio.float().reshape(-1)
                if sp.centered:
                    out[tensor_name(i, s, "mean")] = sp.mean.float().reshape(sp.mean.shape[1:])
                for n, t in sp.tables.as_kwargs().items():  # rounding, channel_bits, levels, trellis, scale_base
                    t = t.float().reshape(-1) if n in ("trellis", "scale_base") else t.float()
                    out[tensor_name(i, s, n)] = t.contiguous()
        rope = self.rope_table()
        if rope is not None:
            out["rotary.inv_freq"] = rope.inv_freq.float().contiguous()
            for i, lp in enumerate(self.layers):  # a layer whose table differs (Gemma 3: one RoPE per layer type)
                for sp in (lp.k, lp.v):
                    if sp.transform is not Transform.PRE_ROPE or sp.rope is rope:
                        continue
                    if sp.rope.attention_scaling != rope.attention_scaling:
                        raise ValueError(f"layer {i}: RoPE attention_scaling {sp.rope.attention_scaling} differs from "
                                         f"{rope.attention_scaling}; an artifact records one")
                    if not torch.equal(sp.rope.inv_freq, rope.inv_freq):
                        out[tensor_name(i, "k", "rope_inv_freq")] = sp.rope.inv_freq.float().contiguous()
        # own storage per name: a plan built through the API may share one tensor between sides or
        # layers, which safetensors refuses to write
        return {n: t.detach().clone(memory_format=torch.contiguous_format) for n, t in out.items()}

    def transforms(self) -> list[dict[str, str]]:
        """Per-layer ``{"k": transform, "v": transform}``, the transforms' strings (the metadata's ``kv.transforms``)."""
        return [{"k": lp.k.transform.value, "v": lp.v.transform.value} for lp in self.layers]

    def rope_table(self) -> RopeTable | None:
        """The RoPE table of the first pre-RoPE side (``None`` when no side is pre-RoPE)."""
        for lp in self.layers:
            for sp in (lp.k, lp.v):
                if sp.transform is Transform.PRE_ROPE:
                    return sp.rope
        return None

    def kv_metadata(self) -> dict:
        """The artifact's ``"kv"`` section (specs of layer 0; per-layer specs under ``layer_specs``
        when layers differ, e.g. after bit allocation)."""
        k0, v0 = self.layers[0].k.spec, self.layers[0].v.spec
        meta = {
            "quantized_tensors": [s for s, sp in (("k", k0), ("v", v0)) if sp.is_quantized],
            "key_position": self.key_position,
            "k": k0.to_dict(),
            "v": v0.to_dict(),
            "residual_window": self.residual_window,
            "sink_tokens": self.sink_tokens,
            "key_centering": any(lp.k.centered for lp in self.layers),
        }
        tr = self.transforms()
        if any(t["k"] != "none" or t["v"] != "none" for t in tr):
            meta["transforms"] = tr
            rope = self.rope_table()
            if rope is not None:
                meta["key_position"] = "pre_rope"
                meta["rope_attention_scaling"] = rope.attention_scaling
        if any(lp.k.spec != k0 or lp.v.spec != v0 for lp in self.layers):
            meta["layer_specs"] = [{"k": lp.k.spec.to_dict(), "v": lp.v.spec.to_dict()} for lp in self.layers]
        return meta

    @classmethod
    def from_artifact(cls, tensors: dict[str, torch.Tensor], metadata: dict) -> KVPlan:
        """Rebuild the plan from an artifact's tensors and metadata (see :func:`kvcal.artifact.load_artifact`).

        Raises ``ValueError`` naming the missing tensor when a static side lacks its scale."""
        m, kv = metadata["model"], metadata["kv"]
        L, H, D = int(m["num_layers"]), int(m["num_kv_heads"]), int(m["head_dim"])
        specs = kv.get("layer_specs") or [{"k": kv["k"], "v": kv["v"]}] * L
        trs = kv.get("transforms") or [{"k": "none", "v": "none"}] * L
        if len(trs) != L:
            raise ValueError(f"kv.transforms has {len(trs)} entries, the model {L} layers")
        rope = None
        if any(t.get(s) == "pre_rope" for t in trs for s in SIDES):
            if "rotary.inv_freq" not in tensors:
                raise ValueError("artifact has pre-RoPE keys but lacks the tensor rotary.inv_freq")
            rope = RopeTable(tensors["rotary.inv_freq"].float().reshape(-1),
                             float(kv.get("rope_attention_scaling", 1.0)))

        def layer_rope(i):  # the layer's own table where its RoPE differs from the first (Gemma 3's layer types)
            t = tensors.get(tensor_name(i, "k", "rope_inv_freq"))
            return rope if t is None else RopeTable(t.float().reshape(-1), rope.attention_scaling)
        layers = []
        for i in range(L):
            sides = {}
            for s in SIDES:
                d = dict(specs[i][s])
                spec = TensorQuantSpec.from_dict(d)
                sp = SidePlan(spec)
                if spec.is_quantized and not spec.dynamic:
                    name = tensor_name(i, s, "scale")
                    if name not in tensors:
                        raise ValueError(f"artifact lacks {name} required by its {spec.format.value} "
                                         f"{spec.granularity.name} spec")
                    sp.scale = _unsqueeze_static(tensors[name].float(), spec, H, D)
                    zp = tensors.get(tensor_name(i, s, "zero_point"))
                    sp.zero_point = None if zp is None else _unsqueeze_static(zp.float(), spec, H, D)
                cr = tensors.get(tensor_name(i, s, "clip_ratio"))
                if cr is not None:
                    if not spec.dynamic:
                        raise ValueError(f"{tensor_name(i, s, 'clip_ratio')} is only for dynamic sides; this side's "
                                         f"{spec.format.value} {spec.granularity.name} ranges are static")
                    if cr.numel() not in (1, H) or not bool(torch.isfinite(cr).all()) or bool((cr <= 0).any()):
                        raise ValueError(f"{tensor_name(i, s, 'clip_ratio')} must hold 1 or {H} finite values > 0, got "
                                         f"shape {tuple(cr.shape)} {cr.flatten()[:4].tolist()}")
                    sp.clip_ratio = cr.float().reshape(-1)
                mean = tensors.get(tensor_name(i, s, "mean"))
                if mean is not None:
                    if mean.numel() != H * D or not bool(torch.isfinite(mean).all()):
                        raise ValueError(f"{tensor_name(i, s, 'mean')} must hold {H}×{D} finite values (one per KV head and "
                                         f"channel), got shape {tuple(mean.shape)}")
                    sp.mean = mean.float().reshape(1, H, 1, D)
                rd = tensors.get(tensor_name(i, s, "rounding"))
                if rd is not None:
                    if tuple(rd.shape) != (H, D, D):
                        raise ValueError(f"{tensor_name(i, s, 'rounding')} has shape {tuple(rd.shape)}, expected {(H, D, D)}")
                    _set_table(sp, "rounding", unit_rounding(rd.float()), tensor_name(i, s, "rounding"))  # identity for kvcal artifacts
                cb = tensors.get(tensor_name(i, s, "channel_bits"))
                if cb is not None:
                    if tuple(cb.shape) != (H, D):
                        raise ValueError(f"{tensor_name(i, s, 'channel_bits')} has shape {tuple(cb.shape)}, expected {(H, D)}")
                    _set_table(sp, "channel_bits", _checked(tensor_name(i, s, "channel_bits"), spec, check_channel_bits, cb.float(),
                                                            spec, H, D), tensor_name(i, s, "channel_bits"))
                lv = tensors.get(tensor_name(i, s, "levels"))
                if lv is not None:
                    n = 2**spec.bits if spec.format.kind == "int" else 0
                    if lv.ndim not in (1, 2) or lv.shape[-1] != n or lv.numel() not in (n, H * n):
                        raise ValueError(f"{tensor_name(i, s, 'levels')} has shape {tuple(lv.shape)}, expected [H, 2^bits] = "
                                         f"{(H, n)} for its {spec.format.value} side")
                    _set_table(sp, "levels", _checked(tensor_name(i, s, "levels"), spec, check_levels, lv.float(), spec, H),
                               tensor_name(i, s, "levels"))
                tt = tensors.get(tensor_name(i, s, "trellis"))
                if tt is not None:
                    if s != "v":
                        raise ValueError(f"{tensor_name(i, s, 'trellis')}: trellis tables are for values only")
                    if sp.clip_ratio is not None or sp.codebook is Codebook.LEVELS:
                        raise ValueError(f"{tensor_name(i, s, 'trellis')}: a trellis side takes no clip_ratio or levels "
                                         "tensor (its scale is the row's RMS)")
                    _set_table(sp, "trellis", _checked(tensor_name(i, s, "trellis"), spec, check_trellis, tt.float(), spec, D),
                               tensor_name(i, s, "trellis"))
                sb = tensors.get(tensor_name(i, s, "scale_base"))
                if ScaleCoding.of(spec) is ScaleCoding.LOG8:
                    if sb is None:
                        raise ValueError(f"artifact lacks {tensor_name(i, s, 'scale_base')} required by its log8 scales")
                    if sb.numel() != H:
                        raise ValueError(f"{tensor_name(i, s, 'scale_base')} must hold {H} values (one per KV head), "
                                         f"got shape {tuple(sb.shape)}")
                    try:
                        sp.scale_base = check_scale_base(sb.float(), H)
                    except ValueError as e:
                        raise ValueError(f"{tensor_name(i, s, 'scale_base')}: {e}") from None
                elif sb is not None:
                    what = (f"{DTYPE_NAMES[spec.scale_dtype]}" if spec.is_quantized else "absent (the side is not "
                            "quantized)")
                    raise ValueError(f"{tensor_name(i, s, 'scale_base')} is only for log8 scales; the side's scales are {what}")
                sp.transform = Transform.of(str(trs[i].get(s, "none")))
                sp.rope = layer_rope(i) if sp.transform is Transform.PRE_ROPE else None
                sp.check_transform()
                sides[s] = sp
            layers.append(LayerPlan(sides["k"], sides["v"]))
        return cls(layers, int(kv.get("residual_window", 0)), int(kv.get("sink_tokens", 0)),
                   kv.get("key_position", "post_rope"))

    @classmethod
    def uniform(cls, num_layers: int, config: KVCacheConfig, key_position: str = "post_rope") -> KVPlan:
        """Same spec on every layer with no calibrated parameters: dynamic sides use min/max
        (clip_ratio 1); static sides must have scales set before use."""
        return cls([LayerPlan(SidePlan(config.key), SidePlan(config.value)) for _ in range(num_layers)],
                   config.residual_window, config.sink_tokens, key_position)


def static_granularities() -> tuple[type, ...]:
    return (PerTensor, PerHead, PerChannel)
