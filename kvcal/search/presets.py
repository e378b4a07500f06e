"""Integer presets of ``kvcal calibrate`` and the menu of the bit allocator (specs only; torch only).

Average bits per cached element (payload + per-token/group fp16 parameters; per-layer metadata
and 16-bit sinks are added by the exact accounting in :mod:`kvcal.search.allocate`):

=========  ==========================================  ==========================================  =====
preset     keys                                        values                                      avg
=========  ==========================================  ==========================================  =====
``int8``   int8 per token (g64), asym, clip, centering  int8 per token (g64), asym, clip            8.5
``int4``   int4 static per channel, asym (calibrated)   int4 per token, sym, clip                   4.125
``int2``   int2 per channel in 32-token groups, asym    int2 per token in 32-channel groups, asym   3.0
``k4v2``   int4 static per channel, asym                int2 per token in 32-channel groups, asym   3.5
=========  ==========================================  ==========================================  =====

``int8`` and ``int2`` have the memory layout of the prior-art baselines they are compared with
(dynamic int8 g64; KIVI-2 g32), so their gain is the calibration alone (clip ratios, centering,
sinks). ``int4`` follows the issue's layout (static per-channel keys, per-token values).
"""

from __future__ import annotations

from kvcal.formats.granularity import PerChannel, PerChannelTokenGroup, PerToken, PerTokenGroup
from kvcal.formats.spec import TensorQuantSpec


def _s(fmt, gran, sym):
    return TensorQuantSpec(fmt, gran, symmetric=sym)


INT_PRESETS: dict[str, tuple[TensorQuantSpec, TensorQuantSpec]] = {
    "int8": (_s("int8", PerTokenGroup(64), False), _s("int8", PerTokenGroup(64), False)),
    "int4": (_s("int4", PerChannel(), False), _s("int4", PerToken(), True)),
    "int2": (_s("int2", PerChannelTokenGroup(32), False), _s("int2", PerTokenGroup(32), False)),
    "k4v2": (_s("int4", PerChannel(), False), _s("int2", PerTokenGroup(32), False)),
}

#: Candidate specs per side for ``--bits`` allocation (cheapest first).
ALLOC_MENU: dict[str, tuple[TensorQuantSpec, ...]] = {
    "k": (
        _s("int2", PerChannel(), False),
        _s("int2", PerChannelTokenGroup(128), False),
        _s("int2", PerChannelTokenGroup(32), False),
        _s("int4", PerChannel(), False),
        _s("int4", PerChannelTokenGroup(128), False),
        _s("int4", PerChannelTokenGroup(32), False),
        _s("int8", PerToken(), False),
    ),
    "v": (
        _s("int2", PerToken(), False),
        _s("int2", PerTokenGroup(32), False),
        _s("int4", PerToken(), True),
        _s("int4", PerTokenGroup(32), False),
        _s("int8", PerToken(), True),
    ),
}


def spec_label(spec: TensorQuantSpec) -> str:
    """Short name, e.g. ``int4/channel/asym``, ``int2/channel_token_group32/asym``."""
    g = spec.granularity
    gs = getattr(g, "group_size", "")
    return f"{spec.format.value}/{g.name}{gs}/{'sym' if spec.symmetric else 'asym'}"


__all__ = ["INT_PRESETS", "ALLOC_MENU", "spec_label"]
