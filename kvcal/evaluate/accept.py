"""Acceptance criteria of ``kvcal evaluate`` rows: parse ``--accept``, the default bar per precision, judge.

A criterion is a comma-separated list of clauses ``METRIC OP VALUE`` (``"kl_mean<=2e-3,delta_ppl<=0.05"``);
metrics are the row keys of :data:`METRICS` (losses in nats, agreements as fractions), operators
``<= < >= >``. A row passes when every clause holds; a missing or NaN metric fails its clause.
Errors: :class:`~kvcal.errors.KvcalError` naming the bad clause.
"""

from __future__ import annotations

import math

METRICS = ("ppl", "delta_ppl", "kl_mean", "kl_p999", "top1_agree", "greedy_agree", "greedy_prefix")
_OPS = {"<=": lambda a, b: a <= b, "<": lambda a, b: a < b, ">=": lambda a, b: a >= b, ">": lambda a, b: a > b}

#: Default acceptance per precision (the mean payload bits of the plan's quantized sides, rounded
#: down to a key of this table: a ``--bits`` plan with one 2-bit layer among 4-bit ones is held to
#: the 4-bit bar, ``k4v2`` to the 3-bit one). The
#: 8-bit bar admits the FP8 floor of the embedded model (prior-art: unity +0.090 / 5.9e-3); the
#: 2-bit bar refuses KIVI-2 (+13 ppl there) — a configuration that went too far is a FAIL.
DEFAULT_ACCEPT = {
    16: "kl_mean<=1e-3,delta_ppl<=0.01",
    8: "kl_mean<=1e-2,delta_ppl<=0.15",
    4: "kl_mean<=3e-2,delta_ppl<=0.5",
    3: "kl_mean<=6e-2,delta_ppl<=1.0",
    2: "kl_mean<=1e-1,delta_ppl<=2.0",
}


def parse_accept(spec: str) -> list[tuple[str, str, float]]:
    """``"kl_mean<=2e-3,delta_ppl<=0.05"`` -> ``[("kl_mean", "<=", 0.002), ...]``.

    Metrics: see :data:`METRICS`; operators ``<= < >= >``. The clauses follow :func:`kvcal.options.parse_bar`'s rules
    (a bound that is not finite, a clause or pair that can never pass or always passes is refused), so the Python API
    refuses what the CLI refuses. Raises :class:`~kvcal.errors.KvcalError` naming the bad clause."""
    import re

    from kvcal.errors import KvcalError
    from kvcal.options import parse_bar

    parse_bar(spec, METRICS, "kvcal")
    out = []
    for clause in (c.strip() for c in spec.split(",")):
        if not clause:
            continue
        m = re.fullmatch(r"([a-z_0-9]+)\s*(<=|>=|<|>)\s*([-+0-9.eE]+)", clause)
        if not m:
            raise KvcalError(f"--accept clause {clause!r} is not METRIC<=VALUE (e.g. kl_mean<=2e-3)")
        name, op, val = m.groups()
        if name not in METRICS:
            raise KvcalError(f"--accept metric {name!r} is unknown; choose from {', '.join(METRICS)}")
        try:
            out.append((name, op, float(val)))
        except ValueError:
            raise KvcalError(f"--accept clause {clause!r}: {val!r} is not a number") from None
    if not out:
        raise KvcalError("--accept is empty; give at least one clause like kl_mean<=2e-3")
    return out


def _quantized_bits(plan) -> list[int]:
    """Payload bits of every quantized (layer, side) of ``plan``."""
    if hasattr(plan, "quantized_bits"):  # a VllmKVPlan
        return plan.quantized_bits()
    return [sp.spec.bits for lp in plan.layers for sp in (lp.k, lp.v) if sp.spec.is_quantized]


def plan_bits(plan) -> int:
    """Fewest payload bits among the plan's quantized sides (16 if nothing is quantized)."""
    bits = _quantized_bits(plan)
    return min(bits) if bits else 16


def default_accept(plan) -> str:
    """The :data:`DEFAULT_ACCEPT` bar for ``plan``: by the mean payload bits over its (layer, side)s
    that are quantized (16 when none is), rounded down to a bar (2 at least)."""
    bits = _quantized_bits(plan)
    b = sum(bits) / len(bits) if bits else 16
    return DEFAULT_ACCEPT[max(k for k in DEFAULT_ACCEPT if k <= b)] if b >= 2 else DEFAULT_ACCEPT[2]


def judge(row: dict, criteria: list[tuple[str, str, float]]) -> tuple[str, list[str]]:
    """``("PASS"|"FAIL", failed clauses)``; a metric that is missing or NaN fails its clause."""
    failed = []
    for name, op, val in criteria:
        x = row.get(name)
        if x is None or not isinstance(x, (int, float)) or math.isnan(x) or not _OPS[op](x, val):
            failed.append(f"{name}={x if x is None else f'{x:.4g}'} not {op} {val:g}")
    return ("FAIL" if failed else "PASS"), failed
