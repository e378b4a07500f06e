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

from typing import NamedTuple

from kvcal.formats.granularity import PerChannel, PerChannelTokenGroup, PerToken, PerTokenGroup
from kvcal.formats.spec import LOG8, PRESETS, KVCacheConfig, TensorQuantSpec


class SideChoice(NamedTuple):
    """One side's storage: the spec, the transform applied before quantizing (``"none"``,
    ``"pre_rope"``, ``"hadamard"``; :mod:`kvcal.formats.transforms`) and whether keys use
    query-aware rounding (:func:`kvcal.search.optimizer.query_rounding`); ``clip_search=False``
    keeps dynamic ranges at min/max (clip ratio 1) instead of searching them; ``channel_bits``: keys
    get per-channel payload widths (:func:`kvcal.search.optimizer.channel_bit_allocation`); ``levels``:
    values use a fitted non-uniform grid (:func:`kvcal.search.optimizer.fit_levels`); ``trellis_nu``
    (with ``levels``): a trellis table with ``2^trellis_nu`` states replaces the levels in the layers
    where it measures lower held-out error (:func:`kvcal.search.optimizer.fit_trellis`; 0 = never)."""

    spec: TensorQuantSpec
    transform: str = "none"
    rounding: bool = False
    clip_search: bool = True
    channel_bits: bool = False
    levels: bool = False
    trellis_nu: int = 0


#: Trellis state bits of the int4 values (a 1024-entry int8 table per layer; ``benchmarks/probe_trellis.py``)
TRELLIS_NU = 6


def _s(fmt, gran, sym, transform="none", rounding=False, clip_search=True, channel_bits=False, levels=False,
       scale_dtype=None, trellis_nu=0):
    return SideChoice(TensorQuantSpec(fmt, gran, symmetric=sym, scale_dtype=scale_dtype), transform, rounding,
                      clip_search, channel_bits, levels, trellis_nu)


INT_PRESETS: dict[str, tuple[SideChoice, SideChoice]] = {
    "int8": (_s("int8", PerTokenGroup(64), False), _s("int8", PerTokenGroup(64), False)),
    "int4": (_s("int4", PerChannelTokenGroup(128), False, "pre_rope", True, channel_bits=True),
             _s("int4", PerToken(), True, "hadamard", clip_search=False, levels=True, scale_dtype="log8",
                trellis_nu=TRELLIS_NU)),
    "int2": (_s("int2", PerChannelTokenGroup(32), False, "pre_rope", True, channel_bits=True),
             _s("int2", PerTokenGroup(32), False, "hadamard")),
    "k4v2": (_s("int4", PerChannelTokenGroup(128), False, "pre_rope", True, channel_bits=True),
             _s("int2", PerTokenGroup(32), False, "hadamard")),
}

#: Candidate side choices for ``--bits`` allocation (cheapest first within a payload width).
ALLOC_MENU: dict[str, tuple[SideChoice, ...]] = {
    "k": (
        _s("int2", PerChannel(), False),
        _s("int2", PerChannelTokenGroup(128), False),
        _s("int2", PerChannelTokenGroup(128), False, "pre_rope", True, channel_bits=True),
        _s("int2", PerChannelTokenGroup(32), False),
        _s("int2", PerChannelTokenGroup(32), False, "pre_rope"),
        _s("int2", PerChannelTokenGroup(32), False, "pre_rope", True, channel_bits=True),
        _s("int4", PerChannel(), False),
        _s("int4", PerChannelTokenGroup(128), False),
        _s("int4", PerChannelTokenGroup(128), False, "pre_rope"),
        _s("int4", PerChannelTokenGroup(128), False, "pre_rope", True, channel_bits=True),
        _s("int4", PerChannelTokenGroup(32), False),
        _s("int4", PerChannelTokenGroup(32), False, "pre_rope"),
        _s("int8", PerToken(), False),
    ),
    "v": (
        _s("int2", PerToken(), False),
        _s("int2", PerToken(), False, "hadamard"),
        _s("int2", PerTokenGroup(32), False),
        _s("int2", PerTokenGroup(32), False, "hadamard"),
        _s("int2", PerToken(), True, "hadamard", False, False, levels=True, scale_dtype="log8"),
        _s("int2", PerTokenGroup(32), True, "hadamard", False, False, levels=True, scale_dtype="log8"),
        _s("int3", PerToken(), True, "hadamard", False, False, levels=True, scale_dtype="log8"),
        _s("int4", PerToken(), True),
        _s("int4", PerToken(), True, "hadamard", False, False, levels=True, scale_dtype="log8", trellis_nu=TRELLIS_NU),
        _s("int4", PerTokenGroup(32), False),
        _s("int5", PerToken(), True, "hadamard", False, False, levels=True, scale_dtype="log8"),
        _s("int6", PerToken(), True, "hadamard", False, False, levels=True, scale_dtype="log8"),
        _s("int8", PerToken(), True),
    ),
}

#: The side choices at which ``--bits`` measures each (layer, side)'s model-level sensitivity.
ALLOC_REFERENCE: dict[str, SideChoice] = {"k": INT_PRESETS["int4"][0], "v": INT_PRESETS["int4"][1]}

#: Transforms that need the model's RoPE table.
NEEDS_ROPE = ("pre_rope",)


def spec_label(spec: TensorQuantSpec | SideChoice) -> str:
    """Short name, e.g. ``int4/channel/asym``, ``int4/channel_token_group128/asym/pre_rope/qround``."""
    tr, rounding, spec_in = "none", False, spec
    if isinstance(spec, SideChoice):
        spec, tr, rounding = spec.spec, spec.transform, spec.rounding
    g = spec.granularity
    gs = getattr(g, "group_size", "")
    out = f"{spec.format.value}/{g.name}{gs}/{'sym' if spec.symmetric else 'asym'}"
    if tr != "none":
        out += f"/{tr}"
    out = out + "/qround" if rounding else out
    out = out + "/chbits" if isinstance(spec_in, SideChoice) and spec_in.channel_bits else out
    out = out + "/levels" if isinstance(spec_in, SideChoice) and spec_in.levels else out
    out = out + f"/trellis{spec_in.trellis_nu}" if isinstance(spec_in, SideChoice) and spec_in.trellis_nu else out
    return out + "/log8" if spec.scale_dtype == LOG8 else out


def preset_cache_config(name: str, sink_tokens: int = 0, residual_window: int = 0) -> KVCacheConfig:
    """The cache layout ``kvcal calibrate --preset name`` writes (``name`` in :data:`INT_PRESETS`),
    as a :class:`~kvcal.formats.spec.KVCacheConfig` whose per-layer metadata flags (rounding
    triangle, channel widths, levels or trellis tables) make :func:`kvcal.formats.memory.memory_report` count
    exactly the bytes the runtime cache allocates for such an artifact. Key centering, which the
    search turns on per run (``int8``), is not counted (``H·D·4`` bytes per layer when it is); value
    sides that may use a trellis table are counted with it in every layer (the upper bound: a layer
    whose guard keeps the levels stores ``4·H·2^b`` bytes instead of ``2^(ν+b)``).
    Raises ``KeyError`` for another name."""
    k, v = INT_PRESETS[name]
    vt = 2 ** (v.trellis_nu + v.spec.bits) if v.trellis_nu else 0
    return KVCacheConfig(k.spec, v.spec, residual_window=residual_window, sink_tokens=sink_tokens,
                         key_rounding=k.rounding, value_rounding=v.rounding, key_channel_bits=k.channel_bits,
                         value_channel_bits=v.channel_bits, key_levels=k.levels, value_levels=v.levels and not vt,
                         value_trellis=vt)


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


__all__ = ["INT_PRESETS", "ALLOC_MENU", "ALLOC_REFERENCE", "SideChoice", "NEEDS_ROPE", "spec_label",
           "preset_cache_config", "named_cache_config", "CACHE_CONFIG_NAMES"]
