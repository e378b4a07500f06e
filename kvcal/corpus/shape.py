"""The loaded corpus (:class:`Corpus`) and its deployment shape as printed before calibrating
(:func:`format_shape`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch  # imported where samples are built: check_corpus runs before torch is imported



@dataclass(frozen=True)
class Corpus:
    """Token sequences of one corpus file and how they were obtained.

    ``samples``: 1-D ``int64`` CPU tensors of token ids, ``min_tokens <= len <= max_seq_len``,
    in file order. ``sha256``: hex digest of the raw file bytes (compressed bytes for ``.gz``).
    ``format``: ``text | prompt | prompt_completion | messages | turns | txt | mixed``.
    ``truncated``: returned samples cut to ``max_seq_len`` tokens (``.txt`` windows are not
    truncations). ``skipped_empty``: empty/whitespace-only lines (``.txt``: blank lines are
    separators and are not counted). ``dropped_short``: samples or windows under ``min_tokens``.
    ``lines``: physical lines (rows, for a dataset) read. ``available``: eligible samples before
    ``max_samples``. ``source``: ``jsonl | txt | parquet | arrow | csv | json | save_to_disk |
    data_dir | hub``; ``split``: the dataset split read (``None`` for files without splits).
    ``dropped_parts``: non-text chat content parts dropped, per part type, over all rows read;
    ``tool_call_turns``: assistant turns with ``tool_calls``; ``tool_calls_rendered``: whether
    the chat template mentions ``tool_calls`` at all.
    """

    path: str
    sha256: str
    format: str
    samples: list[torch.Tensor]
    truncated: int
    skipped_empty: int
    dropped_short: int
    lines: int
    max_seq_len: int = 0
    min_tokens: int = 2
    available: int = 0
    seed: int = 0
    formats: dict[str, int] = field(default_factory=dict)
    source: str = "jsonl"
    split: str | None = None
    dropped_parts: dict[str, int] = field(default_factory=dict)
    tool_call_turns: int = 0
    tool_calls_rendered: bool = True

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def lengths(self) -> list[int]:
        """Sample lengths in tokens, in sample order."""
        return [int(s.numel()) for s in self.samples]

    def shape(self) -> dict:
        """Deployment shape of the returned samples (all lengths in tokens).

        Keys: ``samples``, ``tokens`` (total), ``p50``/``p90``/``p99`` (``numpy.percentile``,
        linear interpolation, floats), ``max``, ``min``, ``mean``, ``truncated``, ``max_seq_len``,
        ``min_tokens``, ``format``, ``formats`` (samples per line format), ``available``,
        ``skipped_empty``, ``dropped_short``, ``lines``, ``path``, ``sha256``, ``seed``,
        ``source``, ``split``, ``dropped_parts``, ``tool_call_turns``, ``tool_calls_rendered``.
        Percentiles are 0 for a corpus without samples.
        """
        n = np.asarray(self.lengths, dtype=np.int64)
        has = n.size > 0
        pct = np.percentile(n, [50, 90, 99]) if has else np.zeros(3)
        return {
            "path": self.path,
            "sha256": self.sha256,
            "format": self.format,
            "formats": dict(self.formats),
            "samples": int(n.size),
            "available": int(self.available),
            "tokens": int(n.sum()),
            "p50": float(pct[0]),
            "p90": float(pct[1]),
            "p99": float(pct[2]),
            "max": int(n.max()) if has else 0,
            "min": int(n.min()) if has else 0,
            "mean": float(n.mean()) if has else 0.0,
            "truncated": int(self.truncated),
            "max_seq_len": int(self.max_seq_len),
            "min_tokens": int(self.min_tokens),
            "skipped_empty": int(self.skipped_empty),
            "dropped_short": int(self.dropped_short),
            "lines": int(self.lines),
            "seed": int(self.seed),
            "source": self.source,
            "split": self.split,
            "dropped_parts": dict(self.dropped_parts),
            "tool_call_turns": int(self.tool_call_turns),
            "tool_calls_rendered": bool(self.tool_calls_rendered),
        }


def format_shape(shape: dict) -> str:
    """Multi-line human-readable summary of :meth:`Corpus.shape` (lengths in tokens).

    Missing keys (e.g. a shape read back from older artifact metadata) print as 0 / "?".
    """
    g = shape.get
    n = int(g("samples", 0))
    sel = ""
    if g("available", n) > n:
        sel = f" (seeded subset of {g('available'):,}, seed {g('seed', 0)})"
    fmt = str(g("format", "?"))
    if fmt == "mixed" and g("formats"):
        fmt += " (" + ", ".join(f"{k} {v}" for k, v in g("formats").items()) + ")"
    src = g("source")  # absent in shapes recorded before datasets sources: say nothing about it
    table = src not in (None, "jsonl", "txt")
    where = (f"; {src}" if src else "") + (f", split {g('split')}" if g("split") else "")
    lines = [
        f"corpus     {g('path', '?')}  [{fmt}{where}]  sha256 {str(g('sha256', '?'))[:12]}",
        f"samples    {n:,}{sel}  from {g('lines', 0):,} {'rows' if table else 'lines'}; {g('skipped_empty', 0):,} "
        f"empty lines skipped, {g('dropped_short', 0):,} samples under {g('min_tokens', 2)} tokens dropped",
        f"tokens     {g('tokens', 0):,} total, mean {g('mean', 0.0):.1f} per sample",
        f"length     p50 {g('p50', 0):.0f}  p90 {g('p90', 0):.0f}  p99 {g('p99', 0):.0f}  "
        f"max {g('max', 0):,}  min {g('min', 0):,} tokens",
        f"truncated  {g('truncated', 0):,} of {n:,} samples cut to max_seq_len {g('max_seq_len', 0):,} tokens",
    ]
    if g("dropped_parts"):
        parts = ", ".join(f"{v:,} {k}" for k, v in g("dropped_parts").items())
        lines.append(f"dropped    {parts} chat content part(s): not text, not in the samples (text parts kept)")
    if g("tool_call_turns"):
        note = ("rendered by the chat template" if g("tool_calls_rendered", True) else
                "the chat template does not render tool_calls: their arguments are not in the samples")
        lines.append(f"tool calls {g('tool_call_turns'):,} assistant turns with tool_calls ({note})")
    return "\n".join(lines)
