"""The layer map of the kvcal package: which module may import which.

Rule: a module may import modules of its own layer or of a lower layer, never of a higher one,
and the import graph between units (a subpackage such as ``kvcal.search``, or a top-level module
such as ``kvcal.plan``) has no cycle. Both top-level and function-level imports count: a lazy
import inside a function is still a dependency. ``tests/test_layering.py`` checks this with
:mod:`ast` on every module under ``kvcal/``.

A module is placed by the longest prefix in :data:`LAYERS` that matches its dotted name; a new
module that no prefix covers fails the test until it is placed here.

Layers, lowest first::

    0 base      kvcal (package root: __version__), kvcal.errors, kvcal._layers, kvcal.options (option values,
                environment variables), kvcal.outputs (output-path safety, atomic writes): pure Python
    1 formats   kvcal.formats           numeric formats, quantize/dequantize (torch only)
    2 plan      kvcal.plan, kvcal.vllm_plan   per-layer plans built from formats;
                kvcal.engines.llamacpp (llama.cpp cache emulation and plan, torch only)
    3 stages    kvcal.capture, kvcal.search, kvcal.kernels, and the inputs they read:
                kvcal.corpus, kvcal.models, kvcal.weights, and kvcal.inputs (both resolved once: the preflight)
    4 products  kvcal.artifact, kvcal.runtime, kvcal.evaluate
    5 front     kvcal.export, kvcal.report, kvcal.api, kvcal.calibrate, kvcal.capacity,
                kvcal.inspect, kvcal.recommend, kvcal.vllm_skip,
                kvcal.verify, kvcal.engines (vllm_runner: runs in the engine's Python, imports no kvcal)
    6 cli       kvcal.cli, kvcal.__main__
"""

from __future__ import annotations

#: ``(layer name, module prefixes)``, lowest layer first; index = layer number.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("kvcal", "kvcal.errors", "kvcal._layers", "kvcal.options", "kvcal.outputs")),
    ("formats", ("kvcal.formats",)),
    ("plan", ("kvcal.plan", "kvcal.vllm_plan", "kvcal.engines.llamacpp")),
    ("stages", ("kvcal.capture", "kvcal.search", "kvcal.kernels", "kvcal.corpus", "kvcal.models",
                "kvcal.weights", "kvcal.inputs")),
    ("products", ("kvcal.artifact", "kvcal.runtime", "kvcal.evaluate")),
    ("front", ("kvcal.export", "kvcal.report", "kvcal.api", "kvcal.calibrate", "kvcal.capacity",
               "kvcal.inspect", "kvcal.recommend", "kvcal.vllm_skip", "kvcal.verify",
               "kvcal.engines")),
    ("cli", ("kvcal.cli", "kvcal.__main__")),
)


def layer_of(module: str) -> int | None:
    """Layer number of a dotted ``kvcal`` module name (longest matching prefix), ``None`` if unplaced.

    The bare prefix ``"kvcal"`` matches only the package root itself, so an unplaced submodule
    returns ``None`` instead of falling into the base layer."""
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            exact_only = p == "kvcal"
            if module == p or (not exact_only and module.startswith(p + ".")):
                if len(p) > best_len:
                    best, best_len = i, len(p)
    return best


def unit_of(module: str) -> str:
    """The unit a module belongs to for the cycle check: ``kvcal.<first component>``."""
    parts = module.split(".")
    return ".".join(parts[:2])
