"""Serving engines: one package per engine, ``kvcal/engines/<name>/``, found by name.

Everything kvcal knows about one engine lives in its package: the ``--kv-cache-dtype`` menu and the emulation
of each backend's cache write (read from the engine's source, cited there), the pages its allocator reserves,
the search of the scales it reads, the export target(s) that write them in the names it loads, the simulation
of its checkpoint loader (``kvcal inspect``), the serve line and the runner ``kvcal verify`` starts in the
engine's own Python. The engine-agnostic floors (formats, capture, search objectives, evaluate, recommend,
verify, export, report, inspect, the CLI) import no engine package: they ask this registry for an engine by
its name (a user's ``--engine vllm``, an artifact's metadata section ``"vllm"``, an export ``--target``) and use
what the engine's package ``__init__`` (its *facade*) offers. ``tests/test_layering.py`` checks both halves: no
module outside ``kvcal/engines/<name>/`` names an engine, and no floor imports one.

The interface (what a facade may define; the floors use only what an engine has, :func:`has`):

=============================  =====================================================================================
``NAME``, ``DISPLAY_NAME``     the package name (``"vllm"``) and how messages spell the engine (``"vLLM"``) — every
                               engine
``EXPORT_MODULES``             modules that register :class:`kvcal.export.base.Target` subclasses (``kvcal export
                               --target``); loaded by :func:`kvcal.export.base.load_targets`
``simulate``, ...              the loader simulation ``kvcal inspect`` runs (per engine: its arguments)
``VERSION``, ``dtype``,        the ``--kv-cache-dtype`` menu: entries with a ``family``, ``static_scales``, ...;
``dtypes``, ``DTypeError``,    ``DTypeError`` a ``ValueError``; the attention backends whose writes are emulated
``backend``, ``Plan``          and the fake-quant plan Protocol A runs for a dtype (``fake_quant``,
                               ``fake_quant_query``)
``bytes_per_token``,           what the engine's allocator reserves per token and for a context × batch
``cache_bytes``
``read_section``               the typed read view of the artifact metadata section named ``NAME`` (``None`` when
                               absent), and ``check_section`` its schema
``calibrate_*``                ``kvcal calibrate --engine NAME``'s checks, search and artifact section
``serve_line``, ``RUNNER``     the command that serves an export; the script ``kvcal verify`` runs in the engine
=============================  =====================================================================================

vLLM's facade (:mod:`kvcal.engines.vllm`) is the full case; SGLang's and TensorRT-LLM's hold export targets and
loader simulations only (kvcal runs neither). ``docs/design.md`` ("Adding an engine") lists the steps.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from types import ModuleType

from kvcal.errors import KvcalError


@functools.lru_cache(maxsize=1)
def names() -> tuple[str, ...]:
    """Every engine package under ``kvcal/engines/`` (sorted; found on disk once, nothing imported)."""
    return tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if m.ispkg))


def engine(name: str) -> ModuleType:
    """The facade of engine ``name`` (the package ``kvcal.engines.<name>``, imported on first use: its ``__init__``
    imports nothing heavy). Raises :class:`~kvcal.errors.KvcalError` naming the engines for an unknown name."""
    if name not in names():
        raise KvcalError(f"unknown engine {name!r}; kvcal knows {', '.join(names())}")
    return importlib.import_module(f"{__name__}.{name}")


def has(name: str, attr: str) -> bool:
    """Whether engine ``name``'s facade defines ``attr`` (a part of the interface an engine may leave out): in its
    namespace, or among the names it resolves on first use (its ``LAZY`` table) — asked without importing them."""
    m = engine(name)
    return attr in vars(m) or attr in getattr(m, "LAZY", {})


def with_attr(attr: str) -> tuple[str, ...]:
    """The engines whose facade defines ``attr``, in :func:`names` order (e.g. ``"calibrate_search"``: the engines
    ``kvcal calibrate --engine`` takes)."""
    return tuple(n for n in names() if has(n, attr))


__all__ = ["engine", "names", "has", "with_attr"]
