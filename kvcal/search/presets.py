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

``int8`` and ``int2`` have the memory layout of the prior-art baselines they are compared with
(dynamic int8 g64; KIVI-2 g32) — plus, for ``int2``, the keys' rounding triangle — so their gain is
the calibration and the transforms (clip ratios, centering, sinks; ``int2``: pre-RoPE keys with
query-aware rounding and Hadamard-rotated values, which took the 2 × 1024-window probe from KL 0.405
with the plain KIVI layout + clips to 0.192, KIVI-2 itself 0.623). ``int4`` spends 0.25 bit of
metadata on the keys (fp16 scale + zero point per 128 tokens of a key channel) and 0.125 on the
values (one log8 byte per value token and head: ``kvcal.formats.quant``, 4.4% scale steps, which cost
V-only KL 5.11e-3 → 5.21e-3 on the 2 × 1024 probe and brought the preset from 4.29 to 4.23 bits) plus
the per-layer clip ratios, tables and the 16-bit sinks, and uses the two transforms that measured best on the embedded model at that
budget (exploratory probes whose scripts were not kept; 2 × 1024 wikitext windows, K-only / V-only mean KL):
pre-RoPE 128-token key groups 9.4e-3 vs post-RoPE 14.1e-3 (and static per-channel pre-RoPE
ranges 16.7e-3, the previous preset's layout); Hadamard-rotated symmetric g64 values 6.7e-3 vs
10.0e-3 without the rotation. See :mod:`kvcal.formats.transforms`. Query-aware rounding of the
keys (OPTQ-style error feedback weighted by the calibration queries' second moments, see
:func:`kvcal.search.optimizer.query_rounding`) took the pre-RoPE g128 keys from 9.4e-3 to 5.8e-3
in the same probe; its stored form, the float8 ratios above a unit diagonal
(:func:`kvcal.formats.quant.unit_rounding`, ``H·D(D−1)/2`` bytes per layer), is counted as metadata
(+0.03 bit at 4096 tokens, batch 1; less at longer contexts or larger batches — the float16
triangle it replaced cost +0.06 and rounded 5% better on that probe, K-only KL 5.6e-3 vs 5.9e-3).
**Per-channel widths** (:func:`kvcal.search.optimizer.channel_bit_allocation`: each key channel gets
1–8 bits by reverse water-filling on its queries' second moment × its squared group range, each
head's row keeping its 4·D bits, so the payload size is unchanged; the ``uint8 [H, D]`` table is
+0.001 bit) then took the same probe's keys (min/max ranges, no clip search) from 9.4e-3 to
3.4e-3 without rounding and from 5.4e-3 to 2.5e-3 with it; through the full search
(clip ratios, guards) the ``int4`` keys measure K-only KL 2.45e-3 there. For ``int2`` keys (g32,
with rounding) the widths took the probe from 102e-3 to 59e-3. Allowed widths matter: restricting
them to {2, 3, 4, 8} (packing units the engines know) gave 3.1e-3 instead of 2.5e-3, so kvcal packs
any width (:func:`kvcal.formats.packing.pack_channels`). A 256- or 192-token key group (half or
two thirds of the scale / zero-point bits, which would bring ``int4`` under 4.25) measured 3.3e-3 /
3.2e-3 — the 128-token group stays. The same allocation for values (per-channel 128-token groups,
widths by ``o_proj`` column norms × range²) measured V-only 8.1e-3, worse than the Hadamard per-token
layout (6.8e-3): values keep it. The values'
clip ratio is not searched (``clip_search=False``: min/max): on the embedded model the clip ratios
that minimized the held-out attention-output error (0.89–0.96) raised the model's V-only KL from
6.8e-3 to 7.6e-3 on a 2 × 1024-window probe; on the 8 × 1024 benchmark windows (paired) they gave
KL 5.73e-3 vs 5.84e-3 but ΔPPL +0.152 vs +0.107 — no consistent gain, so the cheaper min/max stays.
(Until this release a keyword slip passed ``False`` as the rounding flag and the preset searched
value clips anyway; the README's earlier int4 rows were measured that way.)

**Non-uniform value levels** (:func:`kvcal.search.optimizer.fit_levels`, KVQuant's per-layer
non-uniform datatype applied to Hadamard-rotated per-token values): the 16 codes index a per-layer table
fitted by Lloyd's algorithm on the calibration values in units of each token's absmax, instead of the
uniform grid ``k/7`` (which also leaves one code unused). On Gaussian rows of 64 the fitted table cuts
the MSE from 0.0116σ² to 0.0080σ² (the same as an asymmetric grid, without its per-token zero point);
on the 2 × 1024 probe the int4 values went from V-only KL 6.83e-3 to 5.11e-3 (NF4's fixed table: 6.82e-3;
a table per head instead of per layer: 4.81e-3 vs 4.66e-3 in the same experiment, so one per layer).
The ``--bits`` menu offers 2-, 3-, 4-, 5- and 6-bit level entries with log8 scales too: int5 / int6 (kvcal's
runtime only; eight codes in five bytes / four in three) let the allocator spend a budget's last few hundredths
of a bit on the value layers the probe ranks first. On the 2 × 1024 probe (exploratory probe, script not kept), layer 1's
values alone at 6 bits took the ``int4`` plan's KL from 8.1e-3 to 6.5e-3 (that layer held 16% of the summed
single-side KL); ``--bits 4.25`` with int5/int6 in the menu moved four value layers to int5 and paid with
layer 0 (keys int2, values int3): KL 7.4e-3 vs the preset's 8.1e-3 (1 sink; exploratory probe, script not kept).
On the 8 × 1024 benchmark with 4 sinks it moved three value layers: ΔPPL +0.119 vs the preset's +0.136. At 2 bits the Gaussian
picture (a 2-bit table on groups of 32: 0.113σ² vs 0.155σ² for KIVI's asymmetric grid) did not carry over:
on the 2 × 1024 probe the ``int2`` values measured V-only KL 118e-3 with that table (16-channel groups:
101e-3) vs 85e-3 with the preset's asymmetric, clip-searched 32-channel groups, so ``int2`` keeps its
layout and the level entries only compete per layer in the allocator.

**Trellis-coded values** (:mod:`kvcal.formats.trellis`; QTIP's bitshift trellis, Tseng et al. 2024):
the same 4 bits per element, but element ``i`` of a row reads a per-layer table at the last ``ν + 4``
bits of the row's code stream, so 64 elements share their bits with their neighbours and a Viterbi
encoder picks the whole row's codes at once. With ``ν = 6`` (64 states, a 1024-entry int8 table per
layer: +0.004 bit at 4096 tokens, batch 1) the Hadamard-rotated value rows' MSE fell 0.9–1.2 dB below
the fitted levels in every layer, and on the 2 × 1024 probe (``benchmarks/probe_trellis.py``, tables
fitted on ``calibration_sets/chat.jsonl``) the V-only KL went 4.81e-3 → 3.78e-3, all sides 7.54e-3 →
6.19e-3. The search keeps it per layer only where its held-out attention-output error beats the levels
(:func:`kvcal.search.optimizer.search_side` ``trellis_nu``). ``ν = 8`` gained another 0.15–0.5 dB per
row in an exploratory probe (script not kept) but encodes 9× slower and its 4 KiB table would not fit
under 4.25 bits. Encoding costs a Viterbi pass per token (``64 · 2^10`` comparisons per row); decoding
is a table gather.

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
