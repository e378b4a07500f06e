"""SGLang 0.5.23: what kvcal knows about this engine (it exports for it; it does not run it), and its facade.

``export``: the ``sglang-json`` target (``--quantization-param-path``, one shared K/V scale per layer and TP rank,
clip-free scales by default: SGLang casts to FP8 without saturating). ``loader``: what SGLang's checkpoint loader
and JSON loader do with kvcal's exports (``kvcal inspect``). SGLang also loads the ``vllm`` and ``modelopt``
targets' checkpoints (per tensor only); what it does with them per model family is in
:mod:`kvcal.export.layouts`.
"""

from __future__ import annotations

NAME = "sglang"
DISPLAY_NAME = "SGLang"
#: the file of the ``sglang-json`` target (``--quantization-param-path``)
JSON_FILE = "kv_cache_scales.json"
#: the modules registering this engine's export targets (:func:`kvcal.export.base.load_targets`)
EXPORT_MODULES = ("kvcal.engines.sglang.export",)
#: facade name -> (module of this package, name there); resolved on first use by :func:`__getattr__`
LAZY: dict[str, tuple[str, str]] = {
    "simulate": ("loader", "simulate_sglang"),
    "simulate_json": ("loader", "simulate_sglang_json"),
    "NO_PARAM_PATH": ("loader", "SGLANG_NO_PARAM_PATH"),
}


def __getattr__(name: str):
    """A facade name of :data:`LAZY`, from its module (PEP 562)."""
    if name not in LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from kvcal.engines.sglang import loader

    return getattr(loader, LAZY[name][1])
