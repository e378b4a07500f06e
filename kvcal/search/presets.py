"""Integer presets of ``kvcal calibrate`` and the menu of the bit allocator (specs only; torch only).

Average bits per cached element (payload + per-token/group parameters; per-layer metadata —
rounding ratios, channel-width and levels tables —, the open key group's float32 raw range and 16-bit sinks
are added by the exact accounting in :mod:`kvcal.search.allocate`; the ``+`` column is that at
4096 tokens, batch 1, on the embedded model, with the 4 sink tokens the search keeps there):

=========  =============================================  ============================================  =====
preset     keys                                           values                                        avg
=========  =============================================  ============================================  =====
``int8``   int8 per token (g64), asym, clip, centering    int8 per token (g64), asym, clip               8.5
``int4``   int4 per channel in 128-token groups, asym,    int4 per token (g64), sym, after a 64×64       4.1875
           clip, **pre-RoPE**, query-aware rounding,      Hadamard rotation, **trellis-coded** (RMS      +0.058
           **per-channel widths** (4 bits on average)     scale) or **non-uniform levels** (absmax
                                                          scale), **log8** scale (1 byte / token)
``int2``   int2 per channel in 32-token groups, asym,     int2 per token in 32-channel groups, asym,     3.0
           clip, pre-RoPE, query-aware rounding,          clip, after a Hadamard rotation               +0.054
           per-channel widths (2 bits on average)
``k4v2``   as ``int4``                                    as ``int2``                                   3.625
=========  =============================================  ============================================  =====

Why each preset is built this way, with the probe figures behind each choice (pre-RoPE key groups,
Hadamard values, query-aware rounding, per-channel widths, levels, trellis, value clips, int5/int6
menu entries): ``docs/design.md``, section "Integer presets".

The ``--bits`` menu below is searched per layer and side; ``ALLOC_REFERENCE`` is the choice at which
the model-level sensitivity probe measures each (layer, side).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import NamedTuple

from kvcal.formats.codes import TRELLIS_MAX_NU
from kvcal.formats.granularity import PerChannel, PerChannelTokenGroup, PerToken, PerTokenGroup
from kvcal.formats.spec import PRESETS, KVCacheConfig, TensorQuantSpec
from kvcal.formats.transforms import Transform
from kvcal.formats.variants import ChannelWidths, Codebook, Rounding, ScaleCoding, SideVariant


def _enum(cls, value, name: str):
    """``value`` as a member of the str enum ``cls``; ``ValueError`` naming the members otherwise (a bool
    is refused: the flags these enums replace were bools, and ``False`` must not pass for a member)."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            return cls(value)
        except ValueError:
            pass
    raise ValueError(f"{name} must be one of {[m.value for m in cls]} ({cls.__name__}), got {value!r}")


@dataclass(frozen=True)
class SideChoice:
    """One side's storage as the integer search takes it (:func:`kvcal.search.optimizer.search_side`).

    ``spec``: an integer :class:`~kvcal.formats.spec.TensorQuantSpec` (its ``scale_dtype`` gives the
    :class:`~kvcal.formats.variants.ScaleCoding`, :attr:`scale_coding`). Keyword-only variants:

    * ``transform``: a :class:`~kvcal.formats.transforms.Transform` applied before quantizing (its
      string is accepted and converted; :mod:`kvcal.formats.transforms`);
    * ``rounding``: :class:`~kvcal.formats.variants.Rounding` — ``query_aware`` (keys, dynamic specs:
      :func:`kvcal.search.tables.query_rounding`) or ``nearest``;
    * ``clip_search``: ``False`` keeps dynamic ranges at min/max (clip ratio 1) instead of searching them;
    * ``channel_widths``: :class:`~kvcal.formats.variants.ChannelWidths` — ``allocated`` (keys, dynamic
      asymmetric per-channel-token-group specs: :func:`kvcal.search.tables.channel_bit_allocation`)
      or ``spec``;
    * ``codebook``: :class:`~kvcal.formats.variants.Codebook` — ``uniform``; ``levels`` (values: a fitted
      non-uniform grid, :func:`kvcal.search.tables.fit_levels`); or ``trellis`` (values: the levels
      search, then a trellis table with ``2^trellis_nu`` states replaces the levels in the layers where it
      measures lower held-out error, :func:`kvcal.search.tables.fit_trellis`);
    * ``trellis_nu``: trellis state bits, ``spec.bits ≤ ν ≤ 10`` with the ``trellis`` codebook, else 0.

    Raises ``ValueError`` (one line) at construction for a combination the search does not define:
    a non-integer spec, an unknown transform or enum value (a bool where an enum is expected
    included), a levels / trellis codebook with query-aware rounding or allocated widths, levels on
    a spec other than a dynamic symmetric per-token / per-token-group int2–int6, a trellis codebook on
    a spec other than a symmetric per-token int2–int4 or without a valid ``trellis_nu`` (or a
    ``trellis_nu`` without it), query-aware rounding or allocated widths on a static spec, allocated
    widths on a spec other than an asymmetric per-channel-token-group int. Which side a choice is
    for is checked by :meth:`check_side`."""

    spec: TensorQuantSpec
    _: KW_ONLY
    transform: Transform = Transform.NONE
    rounding: Rounding = Rounding.NEAREST
    clip_search: bool = True
    channel_widths: ChannelWidths = ChannelWidths.SPEC
    codebook: Codebook = Codebook.UNIFORM
    trellis_nu: int = 0

    def __post_init__(self):
        spec = self.spec
        if not isinstance(spec, TensorQuantSpec):
            raise ValueError(f"SideChoice.spec must be a TensorQuantSpec, got {type(spec).__name__}")
        if spec.format.kind != "int":
            raise ValueError(f"SideChoice is for integer specs (search_side); {spec.format.value} is searched "
                             "elsewhere")
        object.__setattr__(self, "transform", Transform.of(self.transform))
        rounding = _enum(Rounding, self.rounding, "rounding")
        widths = _enum(ChannelWidths, self.channel_widths, "channel_widths")
        codebook = _enum(Codebook, self.codebook, "codebook")
        object.__setattr__(self, "rounding", rounding)
        object.__setattr__(self, "channel_widths", widths)
        object.__setattr__(self, "codebook", codebook)
        if not isinstance(self.clip_search, bool):
            raise ValueError(f"clip_search must be True or False, got {self.clip_search!r}")
        nu = self.trellis_nu
        if not isinstance(nu, int) or isinstance(nu, bool) or nu < 0:
            raise ValueError(f"trellis_nu must be an integer >= 0, got {nu!r}")
        gran = spec.granularity
        if codebook is not Codebook.UNIFORM and (rounding is not Rounding.NEAREST
                                                 or widths is not ChannelWidths.SPEC):
            raise ValueError(f"a {codebook.value} codebook does not combine with query-aware rounding or "
                             "per-channel widths")
        if codebook is Codebook.TRELLIS:
            if not isinstance(gran, PerToken) or not spec.symmetric or not 2 <= spec.bits <= 4:
                raise ValueError(f"trellis-coded values need a symmetric per-token int2–int4 spec, not "
                                 f"{spec.format.value} {gran.name} {'sym' if spec.symmetric else 'asym'}")
            if not spec.bits <= nu <= TRELLIS_MAX_NU:
                raise ValueError(f"a trellis codebook needs trellis_nu in {spec.bits}..{TRELLIS_MAX_NU} "
                                 f"(state bits), got {nu}")
        elif nu:
            raise ValueError(f"trellis_nu={nu} needs codebook=Codebook.TRELLIS, not {codebook.value}")
        if codebook is not Codebook.UNIFORM:
            if not spec.dynamic or not spec.symmetric or not isinstance(gran, (PerToken, PerTokenGroup)):
                raise ValueError(f"non-uniform levels need a symmetric per-token or per-token-group int spec, "
                                 f"not {gran.name} {'sym' if spec.symmetric else 'asym'}")
            if spec.bits > 6:
                raise ValueError(f"non-uniform levels need a symmetric int2–int6 spec, got {spec.format.value}")
        for on, what in ((rounding is Rounding.QUERY_AWARE, "query-aware rounding is"),
                         (widths is ChannelWidths.ALLOCATED, "per-channel bit widths are")):
            if on and not spec.dynamic:
                raise ValueError(f"{what} searched for dynamic key specs only")
        if widths is ChannelWidths.ALLOCATED and (spec.symmetric or not isinstance(gran, PerChannelTokenGroup)):
            raise ValueError("per-channel bit widths need an asymmetric int spec with per-channel token groups")

    def check_side(self, side: str) -> None:
        """Raise ``ValueError`` when this choice is not defined for ``side`` (``"k"`` / ``"v"``): query-aware
        rounding and allocated widths weigh errors by the queries (keys), levels / trellis codebooks are
        fitted for values."""
        if side not in ("k", "v"):
            raise ValueError(f"side must be 'k' or 'v', got {side!r}")
        for on, what in ((self.rounding is Rounding.QUERY_AWARE, "query-aware rounding is"),
                         (self.channel_widths is ChannelWidths.ALLOCATED, "per-channel bit widths are")):
            if on and side != "k":
                raise ValueError(f"{what} defined for keys (errors weighted by the queries)")
        if self.codebook is not Codebook.UNIFORM and side != "v":
            raise ValueError("non-uniform levels are fitted for values")

    @property
    def scale_coding(self) -> ScaleCoding:
        """``float`` or ``log8`` (from ``spec.scale_dtype``)."""
        return ScaleCoding.of(self.spec)

    @property
    def variant(self) -> SideVariant:
        """The :class:`~kvcal.formats.variants.SideVariant` the search writes for this choice (no centering:
        the search turns it on per run; a trellis codebook with its ``2^(ν+b)``-entry table)."""
        entries = 2 ** (self.trellis_nu + self.spec.bits) if self.codebook is Codebook.TRELLIS else 0
        return SideVariant(self.codebook, self.rounding, self.channel_widths, False, entries)


#: Trellis state bits of the int4 values (a 1024-entry int8 table per layer; ``diagnostics/probe_trellis.py``)
TRELLIS_NU = 6

QUERY_AWARE, ALLOCATED, LEVELS, TRELLIS = Rounding.QUERY_AWARE, ChannelWidths.ALLOCATED, Codebook.LEVELS, Codebook.TRELLIS


def _c(fmt: str, gran, *, symmetric: bool, scale_dtype: str | None = None, **variants) -> SideChoice:
    """``SideChoice(TensorQuantSpec(fmt, gran, symmetric, scale_dtype), **variants)`` (keywords only)."""
    return SideChoice(TensorQuantSpec(fmt, gran, symmetric=symmetric, scale_dtype=scale_dtype), **variants)


def _key_qround(fmt: str, group: int) -> SideChoice:
    """Asymmetric per-channel keys in ``group``-token groups, pre-RoPE, query-aware rounding, allocated widths."""
    return _c(fmt, PerChannelTokenGroup(group), symmetric=False, transform="pre_rope", rounding=QUERY_AWARE,
              channel_widths=ALLOCATED)


def _value_levels(fmt: str, gran=None, **variants) -> SideChoice:
    """Symmetric Hadamard-rotated values with a levels codebook (or ``codebook=TRELLIS``), log8 scales, min/max
    ranges (no clip search)."""
    variants.setdefault("codebook", LEVELS)
    return _c(fmt, gran or PerToken(), symmetric=True, scale_dtype="log8", transform="hadamard", clip_search=False,
              **variants)


class KVChoice(NamedTuple):
    """A preset's key and value :class:`SideChoice` (a named pair; ``k, v = INT_PRESETS[name]`` still works)."""

    k: SideChoice
    v: SideChoice


INT_PRESETS: dict[str, KVChoice] = {
    "int8": KVChoice(k=_c("int8", PerTokenGroup(64), symmetric=False), v=_c("int8", PerTokenGroup(64), symmetric=False)),
    "int4": KVChoice(k=_key_qround("int4", 128), v=_value_levels("int4", codebook=TRELLIS, trellis_nu=TRELLIS_NU)),
    "int2": KVChoice(k=_key_qround("int2", 32), v=_c("int2", PerTokenGroup(32), symmetric=False, transform="hadamard")),
    "k4v2": KVChoice(k=_key_qround("int4", 128), v=_c("int2", PerTokenGroup(32), symmetric=False, transform="hadamard")),
}

#: Candidate side choices for ``--bits`` allocation (cheapest first within a payload width).
ALLOC_MENU: dict[str, tuple[SideChoice, ...]] = {
    "k": (
        _c("int2", PerChannel(), symmetric=False),
        _c("int2", PerChannelTokenGroup(128), symmetric=False),
        _key_qround("int2", 128),
        _c("int2", PerChannelTokenGroup(32), symmetric=False),
        _c("int2", PerChannelTokenGroup(32), symmetric=False, transform="pre_rope"),
        _key_qround("int2", 32),
        _c("int4", PerChannel(), symmetric=False),
        _c("int4", PerChannelTokenGroup(128), symmetric=False),
        _c("int4", PerChannelTokenGroup(128), symmetric=False, transform="pre_rope"),
        _key_qround("int4", 128),
        _c("int4", PerChannelTokenGroup(32), symmetric=False),
        _c("int4", PerChannelTokenGroup(32), symmetric=False, transform="pre_rope"),
        _c("int8", PerToken(), symmetric=False),
    ),
    "v": (
        _c("int2", PerToken(), symmetric=False),
        _c("int2", PerToken(), symmetric=False, transform="hadamard"),
        _c("int2", PerTokenGroup(32), symmetric=False),
        _c("int2", PerTokenGroup(32), symmetric=False, transform="hadamard"),
        _value_levels("int2"),
        _value_levels("int2", PerTokenGroup(32)),
        _value_levels("int3"),
        _c("int4", PerToken(), symmetric=True),
        _value_levels("int4", codebook=TRELLIS, trellis_nu=TRELLIS_NU),
        _c("int4", PerTokenGroup(32), symmetric=False),
        _value_levels("int5"),
        _value_levels("int6"),
        _c("int8", PerToken(), symmetric=True),
    ),
}

#: The side choices at which ``--bits`` measures each (layer, side)'s model-level sensitivity.
ALLOC_REFERENCE: dict[str, SideChoice] = {"k": INT_PRESETS["int4"].k, "v": INT_PRESETS["int4"].v}

#: Transforms that need the model's RoPE table.
NEEDS_ROPE = (Transform.PRE_ROPE,)


def spec_label(spec: TensorQuantSpec | SideChoice) -> str:
    """Short name, e.g. ``int4/channel/asym``, ``int4/channel_token_group128/asym/pre_rope/qround/chbits``,
    ``int4/token/sym/hadamard/levels/trellis6/log8`` (a trellis choice also fits levels: both are named)."""
    c = spec if isinstance(spec, SideChoice) else None
    spec = spec.spec if c is not None else spec
    g = spec.granularity
    gs = getattr(g, "group_size", "")
    out = f"{spec.format.value}/{g.name}{gs}/{'sym' if spec.symmetric else 'asym'}"
    if c is not None:
        out += "" if c.transform is Transform.NONE else f"/{c.transform.value}"
        out += "/qround" if c.rounding is Rounding.QUERY_AWARE else ""
        out += "/chbits" if c.channel_widths is ChannelWidths.ALLOCATED else ""
        out += "/levels" if c.codebook is not Codebook.UNIFORM else ""
        out += f"/trellis{c.trellis_nu}" if c.codebook is Codebook.TRELLIS else ""
    return out + "/log8" if ScaleCoding.of(spec) is ScaleCoding.LOG8 else out


def preset_cache_config(name: str, sink_tokens: int = 0, residual_window: int = 0) -> KVCacheConfig:
    """The cache layout ``kvcal calibrate --preset name`` writes (``name`` in :data:`INT_PRESETS`),
    as a :class:`~kvcal.formats.spec.KVCacheConfig` whose side variants (:attr:`SideChoice.variant`: rounding
    triangle, channel widths, levels or trellis tables) make :func:`kvcal.formats.memory.memory_report` count
    exactly the bytes the runtime cache allocates for such an artifact. Key centering, which the
    search turns on per run (``int8``), is not counted (``H·D·4`` bytes per layer when it is); value
    sides that may use a trellis table are counted with it in every layer (the upper bound: a layer
    whose guard keeps the levels stores ``4·H·2^b`` bytes instead of ``2^(ν+b)``).
    Raises ``KeyError`` for another name."""
    k, v = INT_PRESETS[name]
    return KVCacheConfig(k.spec, v.spec, residual_window=residual_window, sink_tokens=sink_tokens,
                         key_variant=k.variant, value_variant=v.variant)


#: Names ``kvcal memory --format`` and ``kvcal plan --kv-config`` accept: the calibrate presets
#: (int8, int4, int2, k4v2: their layouts, metadata included) and the storage layouts of
#: :data:`kvcal.formats.spec.PRESETS` (fp8, kivi4, int4_static, ...; ``fp8`` is the calibrate one).
CACHE_CONFIG_NAMES = tuple(dict.fromkeys([*PRESETS, *INT_PRESETS]))


def named_cache_config(name: str) -> KVCacheConfig | None:
    """``name`` -> cache layout: a calibrate preset's (:func:`preset_cache_config`), which wins over
    a storage layout of the same name (``int8``, ``int2``: same bytes per token, plus the preset's
    per-layer metadata), else :data:`kvcal.formats.spec.PRESETS`; ``None`` for an unknown name."""
    if name in INT_PRESETS:
        return preset_cache_config(name)
    return PRESETS.get(name)


__all__ = ["INT_PRESETS", "ALLOC_MENU", "ALLOC_REFERENCE", "SideChoice", "KVChoice", "NEEDS_ROPE", "spec_label",
           "preset_cache_config", "named_cache_config", "CACHE_CONFIG_NAMES"]
