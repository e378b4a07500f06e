"""The variants of an integer K/V side, as small typed values (torch only).

A side's storage is its :class:`~kvcal.formats.spec.TensorQuantSpec` plus a choice along four
independent axes; each axis is a value here instead of a loose boolean or an optional tensor:

* **codebook** (:class:`Codebook`): what the codes index — the ``uniform`` grid of the spec, a
  non-uniform ``levels`` table ``float32 [H, 2^b]``, or a ``trellis`` table ``float32 [2^(ν+b)]``
  (:mod:`kvcal.formats.quant` module docstring, sections "Non-uniform levels" / "Trellis-coded rows");
* **scale coding** (:class:`ScaleCoding`): per-group scales stored as floats (``float``: the spec's
  ``scale_dtype``) or as 8-bit log codes (``log8``: ``scale_dtype="log8"``, with a per-head
  ``scale_base float32 [H]``);
* **rounding** (:class:`Rounding`): ``nearest`` code, or ``query_aware`` channel-ordered rounding with
  error feedback through a matrix ``U float32 [H, D, D]``;
* **channel widths** (:class:`ChannelWidths`): every channel at the spec's width (``spec``), or
  per-channel widths ``int64 [H, D]`` (``allocated``; each head summing to ``bits · D``).

:class:`QuantTables` carries the calibrated tensors of one side along these axes into
:func:`kvcal.formats.quant.quantize` / :func:`~kvcal.formats.quant.fake_quant`, the plan
(:class:`kvcal.plan.SidePlan`) and the runtime cache; it refuses at construction the combinations
no quantizer defines (a levels or trellis codebook with query-aware rounding or per-channel widths,
levels with trellis). Which spec each table needs (symmetric / asymmetric, granularity, bits) is checked
against the spec where the tables are used (:func:`kvcal.formats.codes.check_levels`,
:func:`~kvcal.formats.codes.check_trellis`, :func:`~kvcal.formats.codes.check_channel_bits`,
:func:`~kvcal.formats.scales.check_scale_base`). Errors: ``ValueError`` with a one-line message.

:class:`SideVariant` is the side's choice along these axes without the tensors (plus key centering and
the trellis table's size): what a :class:`~kvcal.formats.spec.KVCacheConfig` carries per side and what
the memory accounting counts (:func:`kvcal.formats.memory.side_extra_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

import torch

#: ``scale_dtype`` of 8-bit log-coded dynamic scales: ``scale = base_h · 2^(code / 16)`` with a calibrated fp32 base
#: per KV head (see :mod:`kvcal.formats.quant`); held as ``uint8`` codes. :mod:`kvcal.formats.spec` re-exports it
#: (``spec.LOG8``); it lives here, below the spec, so that :meth:`ScaleCoding.of` needs no import of the spec
#: (which imports this module: the circle issue 41 cut).
LOG8 = torch.uint8


class Codebook(str, Enum):
    """What a side's integer codes index (see the module docstring)."""

    UNIFORM = "uniform"
    LEVELS = "levels"
    TRELLIS = "trellis"


class ScaleCoding(str, Enum):
    """How per-group scales are stored: ``float`` (the spec's scale dtype) or ``log8`` (one byte,
    ``base_h · 2^(code/16)``; :func:`kvcal.formats.scales.log8_decode`)."""

    FLOAT = "float"
    LOG8 = "log8"

    @classmethod
    def of(cls, spec) -> ScaleCoding:
        """The scale coding of a :class:`~kvcal.formats.spec.TensorQuantSpec` (``log8`` iff its
        ``scale_dtype`` is :data:`LOG8`)."""
        return cls.LOG8 if spec.is_quantized and spec.scale_dtype == LOG8 else cls.FLOAT


class Rounding(str, Enum):
    """``nearest`` code (round half to even), or ``query_aware`` channel-ordered rounding with error
    feedback (OPTQ/GPTQ-style, :func:`kvcal.formats.codes.rounding_matrix`)."""

    NEAREST = "nearest"
    QUERY_AWARE = "query_aware"


class ChannelWidths(str, Enum):
    """Every channel at the spec's width (``spec``), or ``allocated`` per-channel widths
    (:func:`kvcal.formats.codes.check_channel_bits`)."""

    SPEC = "spec"
    ALLOCATED = "allocated"


@dataclass(frozen=True)
class SideVariant:
    """One side's variant as plain values (no tensors): ``codebook`` (:class:`Codebook`), ``rounding``
    (:class:`Rounding`), ``channel_widths`` (:class:`ChannelWidths`), ``centering`` (keys stored minus a
    calibrated per-channel mean ``float32 [1,H,1,D]``) and ``trellis_entries`` (int8 entries ``2^(ν+b)`` of
    the trellis table; > 0 exactly with the ``trellis`` codebook). Enum fields also take their values'
    strings. Raises ``ValueError`` (one line) for a combination no quantizer defines (as
    :class:`QuantTables`) or a ``trellis_entries`` that does not match the codebook."""

    codebook: Codebook = Codebook.UNIFORM
    rounding: Rounding = Rounding.NEAREST
    channel_widths: ChannelWidths = ChannelWidths.SPEC
    centering: bool = False
    trellis_entries: int = 0

    def __post_init__(self):
        for name, cls in (("codebook", Codebook), ("rounding", Rounding), ("channel_widths", ChannelWidths)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, str):
                raise ValueError(f"{name} must be one of {[m.value for m in cls]} ({cls.__name__}), got {v!r}")
            try:
                object.__setattr__(self, name, cls(v))
            except ValueError:
                raise ValueError(f"{name} must be one of {[m.value for m in cls]} ({cls.__name__}), got {v!r}") from None
        if not isinstance(self.centering, bool):
            raise ValueError(f"centering must be True or False, got {self.centering!r}")
        n = self.trellis_entries
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"trellis_entries must be an integer >= 0, got {n!r}")
        if (n > 0) != (self.codebook is Codebook.TRELLIS):
            raise ValueError(f"trellis_entries={n} does not fit a {self.codebook.value} codebook (a trellis "
                             "codebook has a table of > 0 entries, the others none)")
        if self.codebook is not Codebook.UNIFORM and (self.rounding is not Rounding.NEAREST
                                                      or self.channel_widths is not ChannelWidths.SPEC):
            raise ValueError(f"a {self.codebook.value} codebook does not combine with query-aware rounding or "
                             "per-channel widths")


_TABLE_NAMES = ("rounding", "channel_bits", "levels", "trellis", "scale_base")


@dataclass(frozen=True, eq=False)
class QuantTables:
    """The calibrated per-layer tables of one side, beyond its scales (all optional).

    * ``rounding``: ``U [H, D, D]`` (float) — query-aware rounding (:class:`Rounding`);
    * ``channel_bits``: ``[H, D]`` integer widths 1–8 — per-channel widths (:class:`ChannelWidths`);
    * ``levels``: ``[H, 2^b]`` or ``[2^b]`` float in ``[-1, 1]`` — a levels codebook;
    * ``trellis``: ``[2^(ν+b)]`` float, int8 multiples of 1/32 — a trellis codebook;
    * ``scale_base``: ``[H]`` float > 0 — the base of log8 scales (:class:`ScaleCoding`).

    Raises ``ValueError`` (one line) when built with a combination no quantizer defines: levels
    with query-aware rounding or per-channel widths; a trellis table with levels, query-aware
    rounding or per-channel widths. Tensor contents and the fit with a spec are checked where the
    tables are used (module docstring). Immutable: :meth:`replace` returns a checked copy."""

    rounding: torch.Tensor | None = None
    channel_bits: torch.Tensor | None = None
    levels: torch.Tensor | None = None
    trellis: torch.Tensor | None = None
    scale_base: torch.Tensor | None = None

    def __post_init__(self):
        if self.trellis is not None and (self.levels is not None or self.rounding is not None
                                         or self.channel_bits is not None):
            raise ValueError("a trellis table does not combine with non-uniform levels, query-aware rounding or "
                             "per-channel widths")
        if self.levels is not None and (self.rounding is not None or self.channel_bits is not None):
            raise ValueError("non-uniform levels do not combine with query-aware rounding or per-channel widths")

    @property
    def codebook(self) -> Codebook:
        """``trellis`` with a trellis table, ``levels`` with a levels table, else ``uniform``."""
        if self.trellis is not None:
            return Codebook.TRELLIS
        return Codebook.LEVELS if self.levels is not None else Codebook.UNIFORM

    @property
    def rounding_mode(self) -> Rounding:
        """``query_aware`` with a rounding matrix, else ``nearest``."""
        return Rounding.NEAREST if self.rounding is None else Rounding.QUERY_AWARE

    @property
    def channel_widths(self) -> ChannelWidths:
        """``allocated`` with per-channel widths, else ``spec``."""
        return ChannelWidths.SPEC if self.channel_bits is None else ChannelWidths.ALLOCATED

    def variant(self, *, centering: bool = False) -> SideVariant:
        """The :class:`SideVariant` these tables give (``centering``: whether the side has a key mean,
        which is held outside the tables)."""
        codebook = self.codebook
        return SideVariant(codebook, self.rounding_mode, self.channel_widths, centering,
                           int(self.trellis.numel()) if codebook is Codebook.TRELLIS else 0)

    def replace(self, **changes) -> QuantTables:
        """A copy with some tables replaced (checked like a new one)."""
        return replace(self, **changes)

    def as_kwargs(self) -> dict:
        """``{name: tensor}`` of the tables present (for messages and per-head views)."""
        return {n: getattr(self, n) for n in _TABLE_NAMES if getattr(self, n) is not None}

    @classmethod
    def coerce(cls, tables: QuantTables | None) -> QuantTables:
        """``tables``, or the empty tables for ``None``; ``ValueError`` for anything else."""
        if tables is None:
            return _NONE
        if not isinstance(tables, QuantTables):
            raise ValueError(f"tables must be a QuantTables, got {type(tables).__name__}")
        return tables


_NONE = QuantTables()


class HasTables:
    """The variant views of an object holding ``tables`` (:class:`QuantTables`) and ``spec``
    (:class:`~kvcal.formats.spec.TensorQuantSpec`): :class:`~kvcal.plan.SidePlan` and
    :class:`~kvcal.formats.quant.QuantizedTensor` answer which variant applies from these, never from
    which table tensor is ``None``."""

    @property
    def codebook(self) -> Codebook:
        """``uniform``, ``levels`` or ``trellis`` (:attr:`QuantTables.codebook`)."""
        return self.tables.codebook

    @property
    def rounding_mode(self) -> Rounding:
        """``nearest`` or ``query_aware`` (:attr:`QuantTables.rounding_mode`)."""
        return self.tables.rounding_mode

    @property
    def channel_widths(self) -> ChannelWidths:
        """``spec`` or ``allocated`` (:attr:`QuantTables.channel_widths`)."""
        return self.tables.channel_widths

    @property
    def scale_coding(self) -> ScaleCoding:
        """``float`` or ``log8``, from the spec (:meth:`ScaleCoding.of`)."""
        return ScaleCoding.of(self.spec)

__all__ = ["Codebook", "ScaleCoding", "Rounding", "ChannelWidths", "SideVariant", "QuantTables", "HasTables"]
