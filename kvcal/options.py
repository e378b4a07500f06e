"""Option values every command reads the same way: comma-separated lists, acceptance bars, environment variables.

Pure Python (no torch), in the base layer, so the CLI checks these before any heavy import and every
layer may use them. Each function raises :class:`~kvcal.errors.KvcalError` with a one-line message that
names the option (or environment variable) and says how to fix it.

* :func:`split_list` — the one parser of every comma-separated option (``--context 1024,4096``,
  ``--vllm-dtype fp8,nvfp4``, ``--dtypes``, ``--mode``, ``--kv-config``, ``--skip-layers``, the clauses of
  ``--accept``): items are stripped; an empty value (``""``, ``" "``, ``","``), an empty item (``"a,,b"``,
  ``"a,"``) and an item named twice are refused.
* :func:`parse_bar` — ``--accept`` clauses ``METRIC OP VALUE`` checked against the metrics the command
  measures (:data:`METRIC_RANGES` gives each metric's possible values): a metric the command does not
  measure, a bound that is not finite, and a clause (or a pair of clauses) that can never pass or always
  passes are refused before any model loads.
* :func:`check_environment` — kvcal's own environment variables (``KVCAL_KERNELS``, ``KVCAL_CACHE``,
  ``XDG_CACHE_HOME``), checked by every command before it works; :func:`check_distributed_environment` —
  torchrun's (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``),
  checked where ``calibrate`` joins the process group; both built on :func:`env_int` / :func:`env_choice`.
"""

from __future__ import annotations

import math
import os
import re

from kvcal.errors import KvcalError


def split_list(value, option: str, what: str = "value", example: str = "", item: str = "") -> tuple[str, ...]:
    """``"a, b"`` -> ``("a", "b")``: option ``option``'s comma-separated items, stripped.

    Raises :class:`KvcalError` for an empty value (``""``, blanks, only commas: ``"{option} is empty; name at
    least one {what} (e.g. {example})"``), an empty item between commas or at an end (``"a,,b"``, ``"a,"``),
    or an item named twice (``item``: what one item is, for that message: ``"layer 2 is named twice"``)."""
    eg = f" (e.g. {example})" if example else ""
    text = "" if value is None else str(value)
    items = [x.strip() for x in text.split(",")]
    if not any(items):
        raise KvcalError(f"{option} is empty; name at least one {what}{eg}")
    if not all(items):
        raise KvcalError(f"{option} {text!r} has an empty item; separate the items with single commas{eg}")
    seen: set[str] = set()
    for x in items:
        if x in seen:
            raise KvcalError(f"{option} {text!r}: {f'{item} {x}' if item else repr(x)} is named twice; name each "
                             f"{item or 'item'} once")
        seen.add(x)
    return tuple(items)


#: Every metric an ``--accept`` clause may name, with the values it can take: ``(low, high)``, both
#: attainable where finite. ppl = exp(mean NLL) >= 1; KL >= 0; agreements are fractions.
METRIC_RANGES: dict[str, tuple[float, float]] = {
    "ppl": (1.0, math.inf),
    "delta_ppl": (-math.inf, math.inf),
    "kl_mean": (0.0, math.inf),
    "kl_p999": (0.0, math.inf),
    "top1_agree": (0.0, 1.0),
    "greedy_agree": (0.0, 1.0),
    "greedy_prefix": (0.0, 1.0),
}
#: A bound that reads well for each metric, for messages.
METRIC_EXAMPLES = {"ppl": "ppl<=20", "delta_ppl": "delta_ppl<=0.15", "kl_mean": "kl_mean<=1e-2",
                   "kl_p999": "kl_p999<=0.5", "top1_agree": "top1_agree>=0.95", "greedy_agree": "greedy_agree>=0.5",
                   "greedy_prefix": "greedy_prefix>=0.8"}
_CLAUSE = re.compile(r"([a-z_0-9]+)\s*(<=|>=|<|>)\s*([-+0-9.eE]+)")


def _span(lo: float, hi: float) -> str:
    return f"[{lo:g}, {'inf)' if math.isinf(hi) else f'{hi:g}]'}"


def parse_bar(spec, measured, command: str, option: str = "--accept",
              why_not: dict[str, str] | None = None) -> list[tuple[str, str, float]]:
    """``"kl_mean<=2e-3,top1_agree>=0.9"`` -> ``[("kl_mean", "<=", 0.002), ("top1_agree", ">=", 0.9)]``.

    ``measured``: the metrics ``command`` measures (keys of :data:`METRIC_RANGES`); ``why_not``: metric ->
    why this command (with these options) does not measure it, for the message. Clauses are split by
    :func:`split_list`. Raises :class:`KvcalError` naming the clause when it is not ``METRIC OP VALUE``
    (operators ``<= < >= >``), names an unknown metric or one ``command`` does not measure (the message lists
    those it does), has a bound that is not a finite number (``1e999`` overflows to inf), can never pass
    (``kl_mean<=-1``, ``top1_agree>=2``; also two clauses that exclude each other, ``kl_mean<=1e-3,
    kl_mean>=1e-2``) or always passes (``top1_agree<=1``, ``kl_mean>=0``) — such a bar would be judged only
    after the whole run."""
    measured = tuple(measured)
    listed = ", ".join(measured)
    out: list[tuple[str, str, float]] = []
    box: dict[str, list] = {}  # metric -> [lo, lo_closed, hi, hi_closed, clauses]
    for clause in split_list(spec, option, "clause", "kl_mean<=1e-2"):
        m = _CLAUSE.fullmatch(clause)
        if not m:
            raise KvcalError(f"{option} clause {clause!r} is not METRIC<=VALUE (e.g. kl_mean<=1e-2); {command} "
                             f"measures {listed}")
        name, op, text = m.groups()
        if name not in METRIC_RANGES:
            raise KvcalError(f"{option} metric {name!r} is unknown; {command} measures {listed}")
        if name not in measured:
            why = f" ({why_not[name]})" if why_not and name in why_not else ""
            raise KvcalError(f"{option} metric {name!r} is not measured by {command}{why}, so no row could pass "
                             f"it; {command} measures {listed}")
        try:
            v = float(text)
        except ValueError:
            raise KvcalError(f"{option} clause {clause!r}: {text!r} is not a number") from None
        eg = METRIC_EXAMPLES[name]
        if not math.isfinite(v):
            raise KvcalError(f"{option} clause {clause!r}: {text} is not a finite number (it overflows to inf); "
                             f"give a finite bound, e.g. {eg}")
        lo, hi = METRIC_RANGES[name]
        never = {"<=": v < lo, "<": v <= lo, ">=": v > hi, ">": v >= hi}[op]
        always = {"<=": v >= hi, "<": v > hi, ">=": v <= lo, ">": v < lo}[op]
        if never:
            raise KvcalError(f"{option} clause {clause!r} can never pass: {name} lies in {_span(lo, hi)}; "
                             f"give a bound inside it, e.g. {eg}")
        if always:
            raise KvcalError(f"{option} clause {clause!r} always passes: {name} lies in {_span(lo, hi)}; "
                             f"drop it or give a bound inside the range, e.g. {eg}")
        b = box.setdefault(name, [lo, True, hi, True, []])
        if op in ("<=", "<") and (v < b[2] or (v == b[2] and op == "<")):
            b[2], b[3] = v, op == "<="
        if op in (">=", ">") and (v > b[0] or (v == b[0] and op == ">")):
            b[0], b[1] = v, op == ">="
        b[4].append(clause)
        if b[0] > b[2] or (b[0] == b[2] and not (b[1] and b[3])):
            raise KvcalError(f"{option} clauses {' and '.join(repr(c) for c in b[4])} can never pass together "
                             f"(no {name} satisfies both); keep one bound per side, e.g. {eg}")
        out.append((name, op, v))
    return out


def env_int(name: str, lo: int, hi: int | None = None, default: int | None = None,
            environ=None) -> int | None:
    """Environment variable ``name`` as an integer in ``[lo, hi]`` (``default`` when unset or empty).
    Raises :class:`KvcalError` naming the variable and its value when it is not such an integer."""
    env = os.environ if environ is None else environ
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    rng = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
    try:
        v = int(raw.strip(), 10)
    except ValueError:
        raise KvcalError(f"environment variable {name}={raw!r} is not {rng}; fix or unset it") from None
    if v < lo or (hi is not None and v > hi):
        raise KvcalError(f"environment variable {name}={raw!r} is not {rng}; fix or unset it")
    return v


#: ``KVCAL_KERNELS``: the kernel backend (:data:`kvcal.kernels.BACKENDS`).
KERNEL_BACKENDS = ("auto", "torch", "triton")


def check_environment(environ=None) -> None:
    """kvcal's own environment variables, before a command does any work: ``KVCAL_KERNELS`` one of
    :data:`KERNEL_BACKENDS`; ``KVCAL_CACHE`` (or, without it, ``XDG_CACHE_HOME``) not an existing file. Raises
    :class:`KvcalError` naming the variable."""
    env = os.environ if environ is None else environ
    if env_choice("KVCAL_KERNELS", KERNEL_BACKENDS, "auto", env) == "triton":
        import importlib.util

        if importlib.util.find_spec("triton") is None:
            raise KvcalError("environment variable KVCAL_KERNELS='triton' asks for the Triton kernels, but triton is "
                             "not installed; pip install kvcal[triton], or set KVCAL_KERNELS=auto or unset it")
    for name in ("KVCAL_CACHE", "XDG_CACHE_HOME"):
        raw = env.get(name)
        if raw:
            if "\x00" in raw:
                raise KvcalError(f"environment variable {name}={raw!r} holds a NUL byte; fix or unset it")
            if os.path.exists(raw) and not os.path.isdir(raw):
                raise KvcalError(f"environment variable {name}={raw!r} is a file, not a directory (kvcal keeps its "
                                 "model-conversion cache there); point it at a directory or unset it")
            break  # KVCAL_CACHE set: XDG_CACHE_HOME is not read


def check_distributed_environment(environ=None) -> int:
    """torchrun's environment variables, validated before ``torch.distributed`` reads them (a bad one was a
    ``ValueError`` traceback): ``WORLD_SIZE`` an integer >= 1 (default 1); with ``WORLD_SIZE`` > 1 also ``RANK``
    in ``[0, WORLD_SIZE - 1]``, ``LOCAL_RANK`` >= 0 and ``LOCAL_WORLD_SIZE`` >= 1 where set, a non-empty
    ``MASTER_ADDR`` and ``MASTER_PORT`` in ``[1, 65535]`` (what the ``env://`` rendezvous needs). Returns
    ``WORLD_SIZE``. Raises :class:`KvcalError` naming the variable."""
    env = os.environ if environ is None else environ
    world = env_int("WORLD_SIZE", 1, None, 1, env)
    if world == 1:
        return 1
    launch = "launch with torchrun --nproc-per-node N (it sets them) or unset WORLD_SIZE"
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        if not (env.get(name) or "").strip():
            raise KvcalError(f"environment variable WORLD_SIZE={env['WORLD_SIZE']!r} asks for {world} processes, but "
                             f"{name} is not set; {launch}")
    env_int("RANK", 0, world - 1, None, env)
    env_int("LOCAL_RANK", 0, world - 1, None, env)
    env_int("LOCAL_WORLD_SIZE", 1, world, None, env)
    env_int("MASTER_PORT", 1, 65535, None, env)
    return world


def env_choice(name: str, choices: tuple[str, ...], default: str, environ=None) -> str:
    """Environment variable ``name`` as one of ``choices`` (``default`` when unset or empty); raises
    :class:`KvcalError` naming the variable otherwise."""
    env = os.environ if environ is None else environ
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    if raw.strip() not in choices:
        raise KvcalError(f"environment variable {name}={raw!r} is not one of {', '.join(choices)}; fix or unset it")
    return raw.strip()
