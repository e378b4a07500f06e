"""The layer map of the kvcal package: which module may import which.

Rule: a module may import modules of its own layer or of a lower layer, never of a higher one,
and neither the import graph between modules nor the one between units (a subpackage such as
``kvcal.search``, a top-level module such as ``kvcal.plan``, or one engine's package such as
``kvcal.engines.vllm``) has a cycle. Both top-level and function-level imports count: a lazy
import inside a function is still a dependency. ``tests/test_layering.py`` checks this with
:mod:`ast` on every module under ``kvcal/``.

A module is placed by the longest prefix in :data:`LAYERS` that matches its dotted name; a new
module that no prefix covers fails the test until it is placed here. The modules of an engine's
package (``kvcal.engines.<name>.<module>``) are placed by their module's name instead
(:data:`ENGINE_MODULES`), the same for every engine, so that adding an engine touches no floor
and not this file: its emulation sits on the formats floor, its plan on the plan floor, its
search on the stages floor, and so on up to its export target and facade on the front floor.

Layers, lowest first::

    0 base      kvcal (package root: __version__), kvcal.errors, kvcal._layers, kvcal.options (option values,
                environment variables), kvcal.outputs (output-path safety, atomic writes), kvcal.engines (the
                registry of engines: found by name, imported with importlib): pure Python
    1 formats   kvcal.formats           numeric formats, quantize/dequantize (torch only)
                engines' dtypes/, quants, rotation, attention, memory   each engine's cache writes, the kernel
                                        arithmetic it reads them with, and the pages it allocates
    2 plan      kvcal.plan              per-layer plans built from formats
                engines' plan           the fake-quant plan of an engine's dtype
    3 stages    kvcal.capture, kvcal.search, kvcal.kernels, and the inputs they read:
                kvcal.corpus, kvcal.models, kvcal.weights, and kvcal.inputs (both resolved once: the preflight)
                engines' search_*, skip_layers   the scales an engine reads, its 16-bit layer rules
    4 products  kvcal.artifact, kvcal.runtime, kvcal.evaluate
                engines' section, probe  the artifact section an engine's calibration writes, its probe
    5 front     kvcal.export, kvcal.report, kvcal.api, kvcal.calibrate, kvcal.capacity,
                kvcal.inspect, kvcal.recommend, kvcal.verify
                engines' facade (__init__), calibrate, skip, export*, loader, runner and *_runner (run in the
                engine's Python, import no kvcal)
    6 cli       kvcal.cli, kvcal.__main__
"""

from __future__ import annotations

from fnmatch import fnmatchcase

#: ``(layer name, module prefixes)``, lowest layer first; index = layer number.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("kvcal", "kvcal.errors", "kvcal._layers", "kvcal.options", "kvcal.outputs", "kvcal.engines")),
    ("formats", ("kvcal.formats",)),
    ("plan", ("kvcal.plan",)),
    ("stages", ("kvcal.capture", "kvcal.search", "kvcal.kernels", "kvcal.corpus", "kvcal.models",
                "kvcal.weights", "kvcal.inputs")),
    ("products", ("kvcal.artifact", "kvcal.runtime", "kvcal.evaluate")),
    ("front", ("kvcal.export", "kvcal.report", "kvcal.api", "kvcal.calibrate", "kvcal.capacity",
               "kvcal.inspect", "kvcal.recommend", "kvcal.verify")),
    ("cli", ("kvcal.cli", "kvcal.__main__")),
)

#: The package of the engines: ``kvcal.engines.<name>`` is one engine, its modules placed by :data:`ENGINE_MODULES`.
ENGINES_PACKAGE = "kvcal.engines"
#: ``(module name pattern, layer name)`` for the modules of an engine's package, matched (:func:`fnmatch.fnmatchcase`)
#: against the first component after ``kvcal.engines.<name>.``, first match wins; the package's ``__init__`` (its
#: facade, which reaches every module of the package) is on the front floor.
ENGINE_MODULES: tuple[tuple[str, str], ...] = (
    ("dtypes", "formats"), ("memory", "formats"), ("quants", "formats"), ("rotation", "formats"),
    ("attention", "formats"),
    ("plan", "plan"),
    ("search_*", "stages"), ("skip_layers", "stages"),
    ("section", "products"), ("probe", "products"),
    ("calibrate", "front"), ("skip", "front"), ("export", "front"), ("export_*", "front"), ("loader", "front"),
    ("runner", "front"), ("*_runner", "front"),
)


def engine_of(module: str) -> str | None:
    """The engine a dotted ``kvcal`` module belongs to (``"vllm"`` for ``kvcal.engines.vllm.plan``), ``None`` for
    a module outside ``kvcal/engines/<name>/`` (the registry ``kvcal.engines`` itself included)."""
    parts = module.split(".")
    return parts[2] if len(parts) >= 3 and ".".join(parts[:2]) == ENGINES_PACKAGE else None


def layer_of(module: str) -> int | None:
    """Layer number of a dotted ``kvcal`` module name, ``None`` if unplaced: an engine's module by
    :data:`ENGINE_MODULES`, any other by its longest matching prefix in :data:`LAYERS`.

    The bare prefix ``"kvcal"`` matches only the package root itself, and ``"kvcal.engines"`` only the
    registry, so an unplaced submodule returns ``None`` instead of falling into the base layer."""
    names = [n for n, _ in LAYERS]
    if engine_of(module) is not None:
        parts = module.split(".")
        if len(parts) == 3:  # the engine's facade
            return names.index("front")
        return next((names.index(layer) for pattern, layer in ENGINE_MODULES if fnmatchcase(parts[3], pattern)), None)
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            exact_only = p in ("kvcal", ENGINES_PACKAGE)
            if module == p or (not exact_only and module.startswith(p + ".")):
                if len(p) > best_len:
                    best, best_len = i, len(p)
    return best


def unit_of(module: str) -> str:
    """The unit a module belongs to for the cycle check: ``kvcal.<first component>``, or
    ``kvcal.engines.<name>`` for a module of an engine's package."""
    parts = module.split(".")
    return ".".join(parts[:3]) if engine_of(module) is not None else ".".join(parts[:2])
