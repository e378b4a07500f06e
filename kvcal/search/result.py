"""The one result type of every scale search: what ``kvcal calibrate`` writes into an artifact.

The static FP8 searches (:mod:`kvcal.search.fp8`, :mod:`kvcal.engines.vllm.search_fp8`,
:mod:`kvcal.engines.vllm.search_nvfp4`) and the integer search (:mod:`kvcal.search.integer`) all return a
:class:`SearchResult`; ``calibrate`` turns it into the artifact's ``calibration`` metadata with
:meth:`SearchResult.calibration_meta` and renders ``report.md`` with
:func:`kvcal.report.markdown.render_report`, one path for both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Placeholder in :attr:`SearchResult.selection` for what the guard measured on (:data:`HELDOUT_ERROR`
#: or :data:`CALIBRATION_ERROR`).
ERROR_DATA = "{error_data}"
HELDOUT_ERROR = "held-out error"
CALIBRATION_ERROR = "error on the calibration data (no held-out split)"


@dataclass(frozen=True)
class SearchResult:
    """What a search chose.

    ``plan``: the :class:`~kvcal.plan.KVPlan` (its tensors are the artifact's); ``layers_meta``: one
    dict per layer (``{"layer", "k": {...}, "v": {...}}``, the artifact's ``layers``); ``method``: one
    line naming the search; ``summary``: the search's own ``calibration`` fields (objectives, candidates;
    for the integer search also preset, bit budget, average bits, sinks, allocation, ``search_seconds``);
    ``selection``: how the guard picks, with :data:`ERROR_DATA` where the data it measured on is named;
    ``timing``: fields written after the shared ones (the static searches' ``search_seconds``);
    ``rows``: the static searches' per-layer ``{"layer", "k": ScaleChoice, "v": ScaleChoice[, "q"]}``
    records, which the vLLM exporters of the artifact read (``None`` for the integer search)."""

    plan: object
    layers_meta: list[dict]
    summary: dict
    method: str = ""
    selection: str = ""
    timing: dict = field(default_factory=dict)
    rows: list[dict] | None = None

    def calibration_meta(self, common: dict, heldout: bool) -> dict:
        """The artifact's ``calibration`` section: ``method``, the search's ``summary`` fields,
        ``selection`` (naming held-out data when ``heldout``, else the calibration data), the
        fields every search shares (``common``: seed, split, capture time…), then ``timing``."""
        sel = self.selection.replace(ERROR_DATA, HELDOUT_ERROR if heldout else CALIBRATION_ERROR)
        return {"method": self.method, **self.summary, "selection": sel, **common, **self.timing}


__all__ = ["SearchResult", "ERROR_DATA", "HELDOUT_ERROR", "CALIBRATION_ERROR"]
