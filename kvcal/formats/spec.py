"""Quantization configs: one side's :class:`TensorQuantSpec` and the cache's :class:`KVCacheConfig`.

Frozen dataclasses with string enums and validation in ``__post_init__``; every default lives in
:data:`DEFAULTS` or in the field defaults below, and the named presets in :data:`PRESETS`.

Storage formats (:class:`QFormat`, value = the string used in configs, artifacts and the CLI):

======================  ====  ======================================================================
format                  bits  payload element
======================  ====  ======================================================================
``fp16`` / ``bf16``       16  unquantized (a side kept in 16 bits)
``fp8_e4m3``               8  OCP e4m3fn, max 448 (torch ``float8_e4m3fn``)
``fp8_e4m3fnuz``           8  AMD e4m3fnuz, max 240 (torch ``float8_e4m3fnuz``)
``fp8_e5m2``               8  OCP e5m2, max 57344 (torch ``float8_e5m2``)
``int8 … int2``           b    integer codes (int8, int6, int5, int4, int3, int2); symmetric
                              ``[-(2^(b-1)-1), 2^(b-1)-1]`` (int8: ±127) or asymmetric ``[0, 2^b-1]``
                              with a floating-point zero point (int6/int5: kvcal's runtime cache only)
``nvfp4``                  4  e2m1 values in blocks of 16 channels, FP8 e4m3 block scales, fp32
                              global scale (NVIDIA's recipe: global = amax / (448*6))
======================  ====  ======================================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum

import torch

from kvcal.formats.granularity import (
    Granularity,
    PerChannel,
    PerChannelTokenGroup,
    PerHead,
    PerTensor,
    PerToken,
    PerTokenGroup,
    granularity_from_name,
)
from kvcal.formats.variants import LOG8, ChannelWidths, Codebook, Rounding, SideVariant


class QFormat(str, Enum):
    """Storage format of one side of the cache (value = config/CLI string)."""

    FP16 = "fp16"
    BF16 = "bf16"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E4M3FNUZ = "fp8_e4m3fnuz"
    FP8_E5M2 = "fp8_e5m2"
    INT8 = "int8"
    INT6 = "int6"
    INT5 = "int5"
    INT4 = "int4"
    INT3 = "int3"
    INT2 = "int2"
    NVFP4 = "nvfp4"

    @property
    def bits(self) -> int:
        """Payload bits per element (16 for unquantized sides)."""
        return _BITS[self]

    @property
    def kind(self) -> str:
        """``"float16"``, ``"fp8"``, ``"int"`` or ``"nvfp4"``."""
        if self in (QFormat.FP16, QFormat.BF16):
            return "float16"
        if self.value.startswith("fp8"):
            return "fp8"
        if self is QFormat.NVFP4:
            return "nvfp4"
        return "int"

    @property
    def is_quantized(self) -> bool:
        return self.kind != "float16"


_BITS = {
    QFormat.FP16: 16, QFormat.BF16: 16, QFormat.FP8_E4M3: 8, QFormat.FP8_E4M3FNUZ: 8,
    QFormat.FP8_E5M2: 8, QFormat.INT8: 8, QFormat.INT6: 6, QFormat.INT5: 5, QFormat.INT4: 4, QFormat.INT3: 3, QFormat.INT2: 2,
    QFormat.NVFP4: 4,
}

#: Packing unit per payload bit width: ``bits -> (values per unit, bytes per unit)``. A row of D
#: channels (padded to whole groups) occupies ``ceil(D_pad / values) * bytes`` bytes. int4/nvfp4
#: put two values in a byte (element 0 in the low nibble), int2 four (element i at bits 2i),
#: int3 eight values in three bytes (element i at bits 3i of a little-endian 24-bit word), int5 eight
#: in five bytes (40-bit word), int6 four in three bytes (24-bit word).
PACK_UNITS = {16: (1, 2), 8: (1, 1), 6: (4, 3), 5: (8, 5), 4: (2, 1), 3: (8, 3), 2: (4, 1)}

#: Defaults in one place.
DEFAULTS = {
    # scale (and zero-point) dtype when TensorQuantSpec.scale_dtype is None
    "scale_dtype_static": torch.float32,  # per-tensor/head/channel: per-layer metadata, fp32 as engines load it
    "scale_dtype_dynamic": torch.float16,  # per-token/group: stored beside every token (KIVI, LMDeploy use fp16)
    "nvfp4_block": 16,  # NVFP4 block size along D (NVIDIA)
    "nvfp4_block_scale_dtype": torch.float8_e4m3fn,
    "global_scale_dtype": torch.float32,  # NVFP4 outer scale
    "clip_ratio_dtype": torch.float32,  # calibrated per-head clip ratio of dynamic sides, [H_kv] per layer
    "dtype16": torch.bfloat16,  # residual window / sinks / unquantized sides
    "group_size": 32,
}

SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# LOG8, the ``scale_dtype`` of 8-bit log-coded dynamic scales, is imported above from kvcal.formats.variants (defined
# there so that ScaleCoding reads it without importing this module) and stays importable from here.
DTYPE_NAMES = {
    torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
    torch.float8_e4m3fn: "float8_e4m3fn", LOG8: "log8",
}


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    """``"float16"`` / ``"fp16"`` / ``torch.float16`` -> ``torch.float16`` (also bf16, fp32, e4m3fn)."""
    if isinstance(name, torch.dtype):
        return name
    aliases = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "float": "float32"}
    n = aliases.get(name, name)
    for dt, dn in DTYPE_NAMES.items():
        if dn == n:
            return dt
    raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPE_NAMES.values())}")


@dataclass(frozen=True)
class TensorQuantSpec:
    """How one side (K or V) of one layer is stored.

    ``format``: a :class:`QFormat` or its string. ``granularity``: which elements share a scale
    (a :class:`~kvcal.formats.granularity.Granularity` or its name; static ones take calibrated
    parameters, dynamic ones compute them when a token is written). ``symmetric``: integer formats
    only may be asymmetric (FP8/NVFP4 are symmetric). ``scale_dtype``: dtype of stored scales and
    zero points; ``None`` picks :data:`DEFAULTS` (fp32 static, fp16 dynamic; NVFP4 block scales are
    always ``float8_e4m3fn``); ``"log8"`` (:data:`LOG8`): 8-bit log-coded per-token scales of
    symmetric int sides, one byte instead of two per token and head. Raises ``ValueError`` (message says what to change) on an invalid
    combination. 16-bit formats ignore the other fields.
    """

    format: QFormat | str
    granularity: Granularity | str = field(default_factory=PerTensor)
    symmetric: bool = True
    scale_dtype: torch.dtype | None = None

    def __post_init__(self):
        try:
            fmt = QFormat(self.format)
        except ValueError:
            raise ValueError(
                f"unknown KV format {self.format!r}; choose one of {[f.value for f in QFormat]}"
            ) from None
        object.__setattr__(self, "format", fmt)
        gran = self.granularity
        if isinstance(gran, str):
            gran = granularity_from_name(gran)
        if not isinstance(gran, Granularity):
            raise ValueError(f"granularity must be a Granularity or its name, got {type(gran).__name__}")
        if fmt is QFormat.NVFP4:
            if isinstance(gran, PerTensor):  # the default: NVFP4 always uses 16-channel blocks
                gran = PerTokenGroup(DEFAULTS["nvfp4_block"])
            if gran != PerTokenGroup(DEFAULTS["nvfp4_block"]):
                raise ValueError(
                    f"nvfp4 uses blocks of {DEFAULTS['nvfp4_block']} channels per token "
                    f"(granularity token_group, group_size {DEFAULTS['nvfp4_block']}); got {gran}"
                )
        object.__setattr__(self, "granularity", gran)
        if fmt.kind in ("fp8", "nvfp4") and not self.symmetric:
            raise ValueError(f"{fmt.value} is symmetric only; set symmetric=True (asymmetric needs an int format)")
        sd = self.scale_dtype
        if fmt is QFormat.NVFP4:
            if sd not in (None, DEFAULTS["nvfp4_block_scale_dtype"]):
                raise ValueError("nvfp4 block scales are float8_e4m3fn; leave scale_dtype unset")
            sd = DEFAULTS["nvfp4_block_scale_dtype"]
        elif sd is None:
            sd = DEFAULTS["scale_dtype_static" if gran.static else "scale_dtype_dynamic"]
        else:
            sd = dtype_from_name(sd)
            if sd == LOG8:
                if not (fmt.kind == "int" and self.symmetric and isinstance(gran, (PerToken, PerTokenGroup))):
                    raise ValueError("log8 scales (8-bit log-coded, see kvcal.formats.quant) are for symmetric int "
                                     "sides with per-token or per-token-group scales")
            elif sd not in SCALE_DTYPES:
                raise ValueError(f"scale_dtype must be float16, bfloat16, float32 or log8, got {sd}")
        object.__setattr__(self, "scale_dtype", sd)

    # ---- derived properties -------------------------------------------------------------------
    @property
    def bits(self) -> int:
        return self.format.bits

    @property
    def is_quantized(self) -> bool:
        return self.format.is_quantized

    @property
    def dynamic(self) -> bool:
        """True when scales are computed at write time (stored per token / group)."""
        return self.is_quantized and not self.granularity.static

    @property
    def has_zero_point(self) -> bool:
        return self.is_quantized and not self.symmetric

    @property
    def qmin(self) -> int:
        """Smallest integer code (int formats): ``-(2^(b-1)-1)`` symmetric, 0 asymmetric."""
        self._need_int()
        return -(2 ** (self.bits - 1) - 1) if self.symmetric else 0

    @property
    def qmax(self) -> int:
        """Largest integer code (int formats): ``2^(b-1)-1`` symmetric (127 for int8), ``2^b-1`` asymmetric."""
        self._need_int()
        return 2 ** (self.bits - 1) - 1 if self.symmetric else 2**self.bits - 1

    def _need_int(self):
        if self.format.kind != "int":
            raise ValueError(f"qmin/qmax are defined for int formats, not {self.format.value}")

    @property
    def channel_group(self) -> int | None:
        """Group size along D (``token_group``), else ``None``."""
        g = self.granularity
        return g.group_size if isinstance(g, PerTokenGroup) else None

    def effective_channel_group(self, D: int) -> int:
        """Channel group size actually used for head_dim ``D``: ``min(group_size, D)``, 1 if ungrouped."""
        g = self.channel_group
        return 1 if g is None else (min(g, D) if D > 0 else g)

    @property
    def token_group(self) -> int | None:
        """Group size along S (``channel_token_group``), else ``None``."""
        g = self.granularity
        return g.group_size if isinstance(g, PerChannelTokenGroup) else None

    def padded_dims(self, S: int, D: int) -> tuple[int, int]:
        """``(S_pad, D_pad)``: tokens rounded up to whole token groups and channels rounded up to
        whole channel groups and then to whole packing units (see :data:`PACK_UNITS`).

        A channel group never spans heads: a group size larger than ``D`` acts as ``D`` (one group
        per token and head, no padding)."""
        tg, cg = self.token_group or 1, self.effective_channel_group(D)
        s_pad = -(-S // tg) * tg
        d_pad = -(-D // cg) * cg
        vpu = PACK_UNITS[self.bits][0] if self.is_quantized else 1
        d_pad = -(-d_pad // vpu) * vpu
        return s_pad, d_pad

    def row_bytes(self, D: int) -> int:
        """Payload bytes of one token of one head (``D`` channels, padded and packed)."""
        if not self.is_quantized:
            return 2 * D
        _, d_pad = self.padded_dims(1, D)
        vpu, bpu = PACK_UNITS[self.bits]
        return d_pad // vpu * bpu

    def with_group_size(self, group_size: int) -> TensorQuantSpec:
        """The same spec with its grouped granularity's group size replaced (no-op if ungrouped
        or NVFP4, whose block size is fixed)."""
        g = self.granularity
        if self.format is QFormat.NVFP4 or not isinstance(g, (PerTokenGroup, PerChannelTokenGroup)):
            return self
        return replace(self, granularity=type(g)(group_size))

    def to_dict(self) -> dict:
        """JSON-able description (the artifact's ``kv.k`` / ``kv.v`` section)."""
        g = self.granularity
        return {
            "format": self.format.value,
            "granularity": g.name,
            "group_size": getattr(g, "group_size", None),
            "symmetric": self.symmetric,
            "scale_dtype": DTYPE_NAMES[self.scale_dtype],
            "dynamic": self.dynamic,
            "bits": self.bits,
        }

    @classmethod
    def from_dict(cls, d: dict) -> TensorQuantSpec:
        """Inverse of :meth:`to_dict` (extra keys such as ``dynamic``/``bits`` are derived)."""
        gran = granularity_from_name(d.get("granularity", "tensor"), d.get("group_size"))
        sd = d.get("scale_dtype")
        fmt = QFormat(d["format"])
        return cls(
            fmt, gran, bool(d.get("symmetric", True)),
            None if sd is None or fmt is QFormat.NVFP4 else dtype_from_name(sd),
        )


@dataclass(frozen=True)
class KVCacheConfig:
    """Quantization of a whole KV cache (same spec for every layer).

    ``key`` / ``value``: :class:`TensorQuantSpec` (or a format string, meaning that format per
    tensor). ``residual_window``: the most recent tokens kept in ``dtype16`` (KIVI's R).
    ``sink_tokens``: the first tokens kept in ``dtype16`` (attention sinks). ``dtype16``:
    ``torch.bfloat16`` or ``torch.float16``. ``key_variant`` / ``value_variant``: each side's
    :class:`~kvcal.formats.variants.SideVariant` (default: uniform codes, nearest rounding, the spec's
    widths, no centering), whose per-layer metadata is counted by :mod:`kvcal.formats.memory`: key
    centering, a mean ``float32 [1,H,1,D]``; query-aware rounding, the float8 strict upper triangle
    ``[H, D(D-1)/2]`` the runtime keeps (:func:`kvcal.formats.codes.unit_rounding`); allocated channel
    widths, ``uint8 [H, D]`` (the rows keep the spec's size); a levels codebook, ``float32 [H, 2^b]``
    (:func:`kvcal.formats.codes.check_levels`); a trellis codebook, its ``trellis_entries`` int8 entries
    (:func:`kvcal.formats.codes.check_trellis`). Centering is for keys and trellis tables for values only.

    :meth:`to_dict` / :meth:`from_dict` write and read the variants as the flat flags of the wire format
    (``kvcal memory --json``, artifact metadata): ``key_centering``, ``key_rounding`` /
    ``value_rounding``, ``key_channel_bits`` / ``value_channel_bits``, ``key_levels`` / ``value_levels``
    (bools) and ``value_trellis`` (entries, 0 = none). Raises ``ValueError`` on negative windows,
    another 16-bit dtype, a variant that is not a :class:`~kvcal.formats.variants.SideVariant`, value
    centering or a key trellis table (``from_dict``: also levels together with a trellis table).
    """

    key: TensorQuantSpec
    value: TensorQuantSpec
    residual_window: int = 0
    sink_tokens: int = 0
    dtype16: torch.dtype = DEFAULTS["dtype16"]
    key_variant: SideVariant = SideVariant()
    value_variant: SideVariant = SideVariant()

    def __post_init__(self):
        for side in ("key", "value"):
            s = getattr(self, side)
            if isinstance(s, str):
                object.__setattr__(self, side, TensorQuantSpec(s))
            elif not isinstance(s, TensorQuantSpec):
                raise ValueError(f"{side} must be a TensorQuantSpec, got {type(s).__name__}")
        for name in ("residual_window", "sink_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        dt = dtype_from_name(self.dtype16)
        if dt not in (torch.float16, torch.bfloat16):
            raise ValueError(f"dtype16 must be torch.float16 or torch.bfloat16, got {dt}")
        object.__setattr__(self, "dtype16", dt)
        for name in ("key_variant", "value_variant"):
            if not isinstance(getattr(self, name), SideVariant):
                raise ValueError(f"{name} must be a SideVariant, got {type(getattr(self, name)).__name__}")
        if self.value_variant.centering:
            raise ValueError("centering is for keys only (value_variant.centering must be False)")
        if self.key_variant.codebook is Codebook.TRELLIS:
            raise ValueError("trellis tables are for values only (key_variant.codebook must not be trellis)")

    def side(self, name: str) -> TensorQuantSpec:
        """``"k"``/``"key"`` -> key spec, ``"v"``/``"value"`` -> value spec."""
        if name in ("k", "key"):
            return self.key
        if name in ("v", "value"):
            return self.value
        raise ValueError(f"side must be 'k' or 'v', got {name!r}")

    def with_group_size(self, group_size: int) -> KVCacheConfig:
        """Both sides with their group size replaced (ungrouped sides unchanged)."""
        return replace(self, key=self.key.with_group_size(group_size), value=self.value.with_group_size(group_size))

    def to_dict(self) -> dict:
        """The wire format (class docstring): specs, windows, dtype and the variants as flat flags."""
        kv, vv = self.key_variant, self.value_variant
        return {
            "k": self.key.to_dict(),
            "v": self.value.to_dict(),
            "residual_window": self.residual_window,
            "sink_tokens": self.sink_tokens,
            "dtype16": DTYPE_NAMES[self.dtype16],
            "key_centering": kv.centering,
            "key_rounding": kv.rounding is Rounding.QUERY_AWARE,
            "value_rounding": vv.rounding is Rounding.QUERY_AWARE,
            "key_channel_bits": kv.channel_widths is ChannelWidths.ALLOCATED,
            "value_channel_bits": vv.channel_widths is ChannelWidths.ALLOCATED,
            "key_levels": kv.codebook is Codebook.LEVELS,
            "value_levels": vv.codebook is Codebook.LEVELS,
            "value_trellis": vv.trellis_entries,
        }

    @classmethod
    def from_dict(cls, d: dict) -> KVCacheConfig:
        """Inverse of :meth:`to_dict` (missing flags: off)."""
        return cls(
            TensorQuantSpec.from_dict(d["k"]), TensorQuantSpec.from_dict(d["v"]),
            int(d.get("residual_window", 0)), int(d.get("sink_tokens", 0)),
            dtype_from_name(d.get("dtype16", DTYPE_NAMES[DEFAULTS["dtype16"]])),
            _variant_from_flags(d, "key"), _variant_from_flags(d, "value"),
        )


def _variant_from_flags(d: dict, side: str) -> SideVariant:
    """The :class:`SideVariant` of ``side`` (``"key"`` / ``"value"``) from the wire format's flat flags."""
    entries = int(d.get("value_trellis", 0)) if side == "value" else 0
    levels = bool(d.get(f"{side}_levels", False))
    if levels and entries:
        raise ValueError("value_levels and value_trellis do not combine (a side has one codebook)")
    codebook = Codebook.TRELLIS if entries else Codebook.LEVELS if levels else Codebook.UNIFORM
    return SideVariant(codebook,
                       Rounding.QUERY_AWARE if d.get(f"{side}_rounding", False) else Rounding.NEAREST,
                       ChannelWidths.ALLOCATED if d.get(f"{side}_channel_bits", False) else ChannelWidths.SPEC,
                       bool(d.get("key_centering", False)) if side == "key" else False, entries)


def _kivi(bits: int, g: int = 32) -> KVCacheConfig:
    fmt = f"int{bits}"
    return KVCacheConfig(
        TensorQuantSpec(fmt, PerChannelTokenGroup(g), symmetric=False),
        TensorQuantSpec(fmt, PerTokenGroup(g), symmetric=False),
    )


#: Named presets (``kvcal memory --format NAME``, ``preset(NAME)``). Windows/sinks are 0 here; set
#: them per deployment (KIVI's paper keeps R=128 recent tokens in 16 bits).
PRESETS: dict[str, KVCacheConfig] = {
    "fp16": KVCacheConfig(TensorQuantSpec("fp16"), TensorQuantSpec("fp16"), dtype16=torch.float16),
    "bf16": KVCacheConfig(TensorQuantSpec("bf16"), TensorQuantSpec("bf16")),
    # static per-tensor FP8, what vLLM/SGLang/TensorRT-LLM load (k_scale/v_scale fp32 scalars)
    "fp8": KVCacheConfig(TensorQuantSpec("fp8_e4m3", PerTensor()), TensorQuantSpec("fp8_e4m3", PerTensor())),
    "fp8_head": KVCacheConfig(TensorQuantSpec("fp8_e4m3", PerHead()), TensorQuantSpec("fp8_e4m3", PerHead())),
    "fp8_e5m2": KVCacheConfig(TensorQuantSpec("fp8_e5m2", PerTensor()), TensorQuantSpec("fp8_e5m2", PerTensor())),
    # dynamic per-token groups of 64 channels, asymmetric (the prior-art INT8 row)
    "int8": KVCacheConfig(
        TensorQuantSpec("int8", PerTokenGroup(64), symmetric=False),
        TensorQuantSpec("int8", PerTokenGroup(64), symmetric=False),
    ),
    # keys: static per-channel (calibrated, asymmetric); values: dynamic per-token g32, asymmetric.
    # (``kvcal memory`` / ``kvcal plan`` read "int4" as what ``kvcal calibrate --preset int4`` writes:
    # :func:`kvcal.search.presets.named_cache_config`)
    "int4_static": KVCacheConfig(
        TensorQuantSpec("int4", PerChannel(), symmetric=False),
        TensorQuantSpec("int4", PerTokenGroup(32), symmetric=False),
    ),
    "kivi4": _kivi(4),
    "kivi3": _kivi(3),
    "kivi2": _kivi(2),
    "int2": _kivi(2),
    "nvfp4": KVCacheConfig(TensorQuantSpec("nvfp4"), TensorQuantSpec("nvfp4")),
}


def preset(name: str, **overrides) -> KVCacheConfig:
    """A named preset, optionally with fields replaced (``preset("kivi4", residual_window=128)``).

    Raises ``ValueError`` listing the preset names."""
    try:
        cfg = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None
    return replace(cfg, **overrides) if overrides else cfg


__all__ = [
    "QFormat", "TensorQuantSpec", "KVCacheConfig", "PRESETS", "DEFAULTS", "PACK_UNITS", "preset",
    "dtype_from_name", "PerTensor", "PerHead", "PerChannel", "PerToken", "PerTokenGroup",
    "PerChannelTokenGroup",
]
