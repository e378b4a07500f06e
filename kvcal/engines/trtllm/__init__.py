"""TensorRT-LLM: what kvcal knows about this engine (it exports for it; it does not run it), and its facade.

``export``: the ``trtllm-legacy`` target (``kv_cache_scaling_factor``, one shared K/V scale per layer, for
``convert_checkpoint.py`` / ``trtllm-build``). ``export_modelopt``: the ``modelopt`` target (NVIDIA ModelOpt HF
names + ``hf_quant_config.json``: TensorRT-LLM's PyTorch flow; vLLM and SGLang load it too for ModelOpt-quantized
weights). ``loader``: what TensorRT-LLM loads of them (``kvcal inspect``).
"""

from __future__ import annotations

NAME = "trtllm"
DISPLAY_NAME = "TensorRT-LLM"
#: the legacy checkpoint's one K/V scale per layer ``i`` (``trtllm-legacy``; :mod:`kvcal.artifact.deployed` reads
#: it back)
LEGACY_SCALE_TEMPLATE = "transformer.layers.{i}.attention.kv_cache_scaling_factor"
#: the modules registering this engine's export targets (:func:`kvcal.export.base.load_targets`)
EXPORT_MODULES = ("kvcal.engines.trtllm.export_modelopt", "kvcal.engines.trtllm.export")
#: facade name -> (module of this package, name there); resolved on first use by :func:`__getattr__`
LAZY: dict[str, tuple[str, str]] = {
    "simulate": ("loader", "simulate_trtllm"),
    "KV_SCALE_PATTERNS": ("loader", "KV_SCALE_PATTERNS"),
    "LEGACY_SCALE_NAME": ("loader", "TRTLLM_LEGACY"),
}


def __getattr__(name: str):
    """A facade name of :data:`LAZY`, from its module (PEP 562)."""
    if name not in LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from kvcal.engines.trtllm import loader

    return getattr(loader, LAZY[name][1])
