"""What one capture pass produced: :class:`CaptureResult` (statistics, reservoirs, per-layer softmax scale and window).

:func:`kvcal.capture.run.run_capture` fills it and :func:`kvcal.capture.distributed.all_reduce_capture` combines the
ranks' results; it lives below both (and :mod:`kvcal.capture.run` re-exports it), so that neither imports the other
for it — the circle issue 41 cut.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcal.capture.reservoir import SequenceReservoir
from kvcal.capture.stats import LayerStats


@dataclass
class CaptureResult:
    """What one capture pass produced (all on CPU)."""

    stats: LayerStats
    calib: SequenceReservoir
    heldout: SequenceReservoir
    scaling: dict[int, float] = field(default_factory=dict)
    #: per layer, the sliding window ``W`` its attention reads (the module's ``sliding_window``: Gemma 3's
    #: sliding layers), 0 for full attention; the searches mask each layer's objective with it
    windows: dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0
    tokens: int = 0
    sink_stats: LayerStats | None = None  # statistics without the first tokens (see run_capture)
    rope: object = None  # per-layer RopeTables (kvcal.models.rope_tables) for pre-RoPE key choices, or None


__all__ = ["CaptureResult"]
