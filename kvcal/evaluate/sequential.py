"""Teacher-forced rows measured window by window (Protocol A), for a search that adds windows only where a
decision needs them (``kvcal recommend``).

:class:`WindowedRows` holds the evaluation windows ``[N, T]``; each row (a plan) is measured on a prefix of
them, ``measure(key, plan, n)`` extends it to the first ``n`` windows (a window is never measured twice for a
row), and :meth:`WindowedRows.result` gives the row's figures over the windows measured so far, with their
per-window samples for :mod:`kvcal.evaluate.bounds`. Every row shares one 16-bit reference per window: its
log-probabilities are computed once and kept (up to ``cache_bytes``; recomputed beyond it), so a row costs
one forward pass per window it is measured on. The figures equal :func:`kvcal.evaluate.teacher_forced`'s on
the same windows (same forward, same :class:`~kvcal.evaluate.protocol_a.TokenMetrics` arithmetic; the
reference of ΔPPL is the 16-bit run of the same windows the row was measured on).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kvcal.evaluate.protocol_a import TokenMetrics, protocol_a_logits


class WindowedRows:
    """Rows measured on growing prefixes of ``windows`` (int64 ``[N, T]``) with one shared 16-bit reference.

    ``cache_bytes``: most bytes of reference log-probabilities kept (float32 ``[T, V]`` per window).
    ``on_forward``: called after every forward pass (a progress bar's update). ``forwards``: forward passes
    run so far (reference ones included). ``reference_plan``: the plan the reference runs under (default
    ``None``: the model's own cache, unquantized)."""

    def __init__(self, model, windows: torch.Tensor, cache_bytes: int = 4 << 30,
                 on_forward: Callable[[], None] | None = None, reference_plan=None):
        self.model, self.windows = model, windows
        self.reference_plan = reference_plan
        self.cache_bytes = int(cache_bytes)
        self.on_forward = on_forward or (lambda: None)
        self.forwards = 0
        self._device = next(model.parameters()).device
        self._ref = TokenMetrics()
        self._ref_done = 0
        self._cached: dict[int, torch.Tensor] = {}
        self._cached_bytes = 0
        self._rows: dict = {}  # key -> [TokenMetrics, windows measured]

    def __len__(self) -> int:
        return len(self.windows)

    def _forward(self, w: int, plan) -> torch.Tensor:
        ids = self.windows[w : w + 1].to(self._device)
        with torch.no_grad():
            out = torch.log_softmax(protocol_a_logits(self.model, ids, plan).float().cpu(), -1)
        self.forwards += 1
        self.on_forward()
        return out

    def _reference(self, w: int) -> torch.Tensor:
        if w in self._cached:
            return self._cached[w]
        logp = self._forward(w, self.reference_plan)
        if w == self._ref_done:  # windows are first reached in order (every row measures a prefix)
            self._ref.add(logp, logp, self.windows[w : w + 1, 1:])
            self._ref_done += 1
        nb = logp.numel() * logp.element_size()
        if self._cached_bytes + nb <= self.cache_bytes:
            self._cached[w] = logp
            self._cached_bytes += nb
        return logp

    def measured(self, key) -> int:
        """Windows ``key`` has been measured on (0 for an unknown key)."""
        return self._rows[key][1] if key in self._rows else 0

    def measure(self, key, plan, n: int) -> int:
        """Extend row ``key`` (run with ``plan``, the same plan every call) to the first ``min(n, N)`` windows;
        returns the windows it now has."""
        acc, done = self._rows.setdefault(key, [TokenMetrics(), 0])
        n = min(int(n), len(self.windows))
        for w in range(done, n):
            ref = self._reference(w)
            logp = ref if plan is None else self._forward(w, plan)
            acc.add(ref, logp, self.windows[w : w + 1, 1:])
        self._rows[key][1] = max(done, n)
        return self._rows[key][1]

    def result(self, key) -> dict:
        """Row ``key``'s ``{"ppl", "delta_ppl", "kl_mean", "kl_p999", "top1_agree", "tokens", "windows",
        "per_window"}`` over its measured windows (``delta_ppl`` against the 16-bit run of the same windows;
        ``per_window["ref_nll"]`` that run's per-window NLL). Raises ``KeyError`` for a row never measured."""
        acc, n = self._rows[key]
        ref_nll = self._ref.window_figures()["nll"][:n]
        ref_ppl = math.exp(sum(ref_nll) / n)  # equal-length windows: the token mean of their NLL
        r = acc.result(ref_ppl)
        r["per_window"]["ref_nll"] = ref_nll
        r["windows"] = n
        return r

    def reference_ppl(self, n: int) -> float:
        """16-bit perplexity over the first ``n`` windows (all measured by some row)."""
        nll = self._ref.window_figures()["nll"][:n]
        return math.exp(sum(nll) / len(nll))
