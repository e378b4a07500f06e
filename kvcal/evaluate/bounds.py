"""Acceptance judged on confidence bounds over evaluation windows: a PASS that holds on text kvcal never saw.

A row's figures (``kl_mean``, ``delta_ppl``, ...) are means over ``N`` evaluation windows, and a bar judged on the
mean alone is a coin toss near the bar (a Gemma 3 row at KL 9.0e-3 under a 1e-2 bar measured 1.65e-2 on two
windows it had not seen). The windows are consecutive, disjoint stretches of the corpus, taken here as
independent samples of the text the deployment will see; each clause ``metric OP bar`` is judged on a one-sided
Student-t bound at :data:`LEVEL` over the per-window figures (``mean ± t_{level, N−1} · sd / √N``):

- ``metric <= bar``: PASS when the upper bound is at most the bar, FAIL when the lower bound is above it
  (the row is worse than the bar beyond its spread), else INCONCLUSIVE (and how many windows would decide
  it at the observed mean and spread, :func:`windows_to_decide`); ``>=`` mirrors it.
- ``kl_mean`` and ``top1_agree``: the per-window mean KL (nats per position) / top-1 agreement.
- ``delta_ppl``: the per-window paired NLL differences ``d_w = NLL_w − NLL16_w`` (same windows, same tokens)
  bound ``D = mean d``; ``ΔPPL = PPL16 · (exp(D) − 1)`` is increasing in ``D``, so the bounds of ``D`` map to
  bounds of ΔPPL with ``PPL16`` the reference perplexity of the same windows (the comparison is paired, the
  text's own difficulty cancels). ``ppl``: the per-window NLL, ``PPL = exp(mean NLL)``.
- ``greedy_agree`` / ``greedy_prefix``: the per-window (one sequence per window) agreements.
- ``kl_p999``: a percentile over positions has no per-window mean; judged on its estimate (said in the bound).

A clause with one window has no spread estimate: its bound is infinite and the clause INCONCLUSIVE unless its
estimate already fails it by the other side's logic (never a PASS). The clauses combine as: any FAIL → FAIL,
every clause PASS → PASS, else INCONCLUSIVE. Method: Student (1908); one-sided t bound, e.g. Wasserman,
*All of Statistics* §6.3 (the t interval for a mean of independent samples).
"""

from __future__ import annotations

import math

#: one-sided confidence level of every bound a PASS/FAIL is judged on
LEVEL = 0.95
INCONCLUSIVE = "INCONCLUSIVE"
#: metrics with a per-window sample (TokenMetrics.window_figures / decode's greedy lists)
_WINDOWED = ("kl_mean", "top1_agree", "greedy_agree", "greedy_prefix")


def t_one_sided(level: float, dof: int) -> float:
    """Student-t quantile ``t_{level, dof}`` (scipy.stats.t.ppf); ``inf`` for ``dof < 1``."""
    from scipy.stats import t

    return float(t.ppf(level, dof)) if dof >= 1 else math.inf


def mean_bounds(xs: list[float], level: float = LEVEL) -> tuple[float, float, float, float]:
    """``(mean, lower, upper, sd)`` of per-window samples ``xs``: each bound one-sided at ``level``
    (``mean ∓ t_{level, N−1} · sd / √N``); with one sample the bounds are ``-inf``/``inf`` and ``sd`` is ``inf``.
    Raises ``ValueError`` for an empty list."""
    import statistics

    if not xs:
        raise ValueError("no per-window samples to bound")
    n = len(xs)
    m = statistics.fmean(xs)
    if n < 2:
        return m, -math.inf, math.inf, math.inf
    sd = statistics.stdev(xs)
    h = t_one_sided(level, n - 1) * sd / math.sqrt(n)
    return m, m - h, m + h, sd


def windows_to_decide(gap: float, sd: float, n: int, level: float = LEVEL, cap: int = 10_000) -> int | None:
    """The least ``N > n`` with ``t_{level, N−1} · sd / √N < gap`` (the distance of the mean from the bar, in the
    bounded quantity's units): how many windows would decide a clause if its mean and spread stayed as observed;
    ``None`` when no ``N <= cap`` would (a mean on the bar, or an unknown spread)."""
    if gap <= 0 or not math.isfinite(sd):
        return None
    if sd == 0:
        return max(n + 1, 2)
    k = max(n + 1, 2)
    while k <= cap:
        if t_one_sided(level, k - 1) * sd / math.sqrt(k) < gap:
            return k
        k = k + 1 if k < 64 else int(k * 1.1) + 1
    return None


def _identity(x: float) -> float:
    return x


class _Exp:
    """``x -> p · exp(x)`` (PPL from a mean NLL) or ``p · (exp(x) − 1)`` (ΔPPL from a mean NLL difference, ``p`` =
    PPL16), increasing in ``x``, with the infinite bounds of one window mapped to the limits."""

    def __init__(self, p: float, minus_one: bool):
        self.p, self.minus_one = p, minus_one

    def __call__(self, x: float) -> float:
        if x > 700:
            return math.inf
        if x == -math.inf:
            return -self.p if self.minus_one else 0.0
        return self.p * (math.expm1(x) if self.minus_one else math.exp(x))


def metric_bounds(row: dict, metric: str, level: float = LEVEL) -> dict:
    """The bounds of one metric of an evaluated ``row`` (its figures and ``row["per_window"]``, as
    :class:`kvcal.evaluate.protocol_a.TokenMetrics` gives them): ``{"estimate", "lower", "upper", "windows",
    "method", "space": (mean, sd, to_metric)}`` where ``space`` is the bounded per-window quantity (for ΔPPL the
    paired NLL difference) and ``to_metric`` maps it to the metric (monotone increasing). A metric without
    per-window samples (``kl_p999``, or a row without ``per_window``) gets its estimate as both bounds and
    ``method`` saying so."""
    est = row.get(metric)
    pw = row.get("per_window") or {}
    if metric in _WINDOWED and pw.get(metric):
        xs = pw[metric]
        m, lo, hi, sd = mean_bounds(xs, level)
        return {"estimate": est, "lower": lo, "upper": hi, "windows": len(xs), "space": (m, sd, _identity),
                "method": f"one-sided {level:.0%} t over {len(xs)} windows"}
    if metric in ("delta_ppl", "ppl") and pw.get("nll") and (metric == "ppl" or pw.get("ref_nll")):
        if metric == "ppl":
            xs, to = pw["nll"], _Exp(1.0, minus_one=False)
        else:
            ref = pw["ref_nll"]
            xs = [a - b for a, b in zip(pw["nll"], ref, strict=True)]
            to = _Exp(math.exp(sum(ref) / len(ref)), minus_one=True)
        m, lo, hi, sd = mean_bounds(xs, level)
        return {"estimate": est, "lower": to(lo), "upper": to(hi), "windows": len(xs), "space": (m, sd, to),
                "method": f"one-sided {level:.0%} t over {len(xs)} windows"
                          + (" (paired NLL differences)" if metric == "delta_ppl" else "")}
    return {"estimate": est, "lower": est, "upper": est, "windows": None, "space": None,
            "method": "estimate (no per-window bound for this metric)"}


def _inverse(to, target: float, lo: float, hi: float) -> float:
    """``x`` with ``to(x) = target`` for a monotone increasing ``to`` on ``[lo, hi]`` (bisection, 200 steps)."""
    for _ in range(200):
        mid = (lo + hi) / 2
        if to(mid) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def judge_bounded(row: dict, criteria: list[tuple[str, str, float]], level: float = LEVEL,
                  fail_level: float | None = None) -> dict:
    """Judge an evaluated ``row`` against parsed ``criteria`` (:func:`kvcal.evaluate.accept.parse_accept`) on
    one-sided ``level`` bounds over its windows (module doc). Returns ``{"status": "PASS" | "FAIL" |
    INCONCLUSIVE, "failed": [clause texts that fail or cannot be decided], "bounds": {metric: {"estimate",
    "bound", "lower", "upper", "method"}}, "windows_needed": int | None}``: ``bound`` is the side a PASS is judged
    on (the upper bound of a ``<=`` clause, the lower of a ``>=``); ``windows_needed`` the most windows any
    undecided clause needs at its observed mean and spread (``None`` when decided, or when no count would).
    ``fail_level``: the level of the opposite bound a FAIL is judged on (default ``level``; a sequential search
    spends its error on false PASSes and may judge FAILs at a lower level)."""
    import math as _m

    bounds, failed, undecided, need = {}, [], [], []
    for name, op, bar in criteria:
        b = metric_bounds(row, name, level)
        bf = b if fail_level is None or fail_level == level else metric_bounds(row, name, fail_level)
        est = b["estimate"]
        upper_side = op in ("<=", "<")
        side = b["upper"] if upper_side else b["lower"]
        other = bf["lower"] if upper_side else bf["upper"]
        bounds[name] = {"estimate": est, "bound": side, "lower": b["lower"], "upper": b["upper"],
                        "method": b["method"]}
        if est is None or not isinstance(est, (int, float)) or _m.isnan(est) or side is None or _m.isnan(side):
            failed.append(f"{name}={est} not {op} {bar:g}")
            continue
        ok = (side <= bar if op == "<=" else side < bar if op == "<" else side >= bar if op == ">=" else side > bar)
        bad = (other > bar if op == "<=" else other >= bar if op == "<" else other < bar if op == ">=" else
               other <= bar)
        text = f"{name}={est:.4g} ({'upper' if upper_side else 'lower'} bound {side:.4g}) not {op} {bar:g}"
        if ok:
            continue
        if bad:
            failed.append(text)
            continue
        undecided.append(text)
        sp = b["space"]
        if sp is not None:
            m, sd, to = sp
            # the bar in the bounded quantity's units (to is increasing; a wide bracket around the mean)
            span = 10 * (abs(m) + (sd if _m.isfinite(sd) else 0) + 1)
            x_bar = _inverse(to, bar, m - span, m + span)
            need.append(windows_to_decide(abs(m - x_bar), sd, b["windows"], level))
        else:
            need.append(None)
    status = "FAIL" if failed else INCONCLUSIVE if undecided else "PASS"
    needed = None
    if status == INCONCLUSIVE and need and all(x is not None for x in need):
        needed = max(need)
    return {"status": status, "failed": failed + [f"{t} (undecided)" for t in undecided],
            "bounds": bounds, "windows_needed": needed}


def bound_text(bounds: dict, metric: str) -> str:
    """``"9.0e-03 (95% bound 1.3e-02)"``-style text of one judged metric (:func:`judge_bounded`'s ``bounds``)."""
    b = bounds[metric]
    est, bd = b["estimate"], b["bound"]
    if est is None:
        return "n/a"
    fmt = (lambda x: f"{x:+.4f}") if metric == "delta_ppl" else (lambda x: f"{x:.2e}") if metric.startswith("kl") \
        else (lambda x: f"{x:.4f}")
    if b["method"].startswith("estimate"):
        return fmt(est)
    return f"{fmt(est)} (bound {fmt(bd) if math.isfinite(bd) else ('+inf' if bd > 0 else '-inf')})"
