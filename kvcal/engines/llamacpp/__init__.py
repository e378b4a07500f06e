"""llama.cpp (the build vendored by llama-cpp-python 0.3.36): everything kvcal knows about this engine, and its
facade (the interface of :mod:`kvcal.engines`).

llama.cpp takes no calibrated scale (no export target: it loads no KV-cache scale from a model file) for its KV cache: ``--cache-type-k`` / ``--cache-type-v`` (``-ctk``/``-ctv``)
pick a ggml block format whose per-block fp16 scale is computed when a row is written. What kvcal calibrates for
this engine is therefore the *choice*: which K type and which V type, per model and corpus. The floors reach it
only through ``kvcal.engines.engine("llamacpp")``; the names below are imported from this package's modules on
first use (the facade itself imports nothing). Modules, lowest floor first:

==========================  =========================================================================================
``quants``                  ggml's block formats as the CPU backend writes them (q8_0 as x86 AVX and reference,
                            q4_0, q4_1, q5_0, q5_1, iq4_nl; q8_1 for queries) (formats floor)
``rotation``                the Hadamard rotation llama.cpp applies to quantized caches, ``LLAMA_ATTN_ROT_DISABLE``
                            (formats floor)
``plan``                    :class:`~kvcal.engines.llamacpp.plan.LlamaCppKVPlan` (the plan Protocol A runs for a
                            ``-ctk``/``-ctv`` pair) and :func:`~kvcal.engines.llamacpp.plan.kv_bytes` (what
                            ``llama_kv_cache`` allocates, its log line) (plan floor)
``runner``                  the script ``kvcal verify --engine llamacpp`` runs in llama-cpp-python's own Python;
                            imports no kvcal
``layer_runner``            captures one attention layer as llama.cpp runs it (query, key, value, cache bytes,
                            flash-attention output) in the engine's own Python; imports no kvcal
==========================  =========================================================================================
"""

from __future__ import annotations

from pathlib import Path

NAME = "llamacpp"
DISPLAY_NAME = "llama.cpp"
#: the build whose source every emulation here cites
VERSION = "llama-cpp-python 0.3.36"
#: the script ``kvcal verify`` runs with the engine's interpreter (:func:`kvcal.verify.engine.run_engine`)
RUNNER = Path(__file__).resolve().parent / "runner.py"
#: the script that captures one attention layer as llama.cpp runs it (its query, key, value, cache bytes and
#: flash-attention output), run by the engine's own Python (``diagnostics/llamacpp_layer_check.py``, the engine tier)
LAYER_RUNNER = Path(__file__).resolve().parent / "layer_runner.py"
#: the ``-ctk``/``-ctv`` types ``kvcal recommend --engine llamacpp`` pairs by default, cheapest first
#: (``bf16``/``f32`` are left out: never cheaper than ``f16``; ``--cache-types`` takes them)
PAIR_TYPES = ("q4_0", "iq4_nl", "q4_1", "q5_0", "q5_1", "q8_0", "f16")
#: the module the engine's interpreter must import (checked before a run)
PYTHON_MODULE = "llama_cpp"
#: how to build the interpreter ``kvcal verify --engine llamacpp --engine-python`` takes (its own venv)
BUILD_HINT = ("build llama-cpp-python's venv beside kvcal with `make llamacpp-venv` (then --engine-python "
              ".venv-llamacpp/bin/python)")
#: the pairs users run by folklore, compared with the calibrated choice in ``kvcal recommend``'s notes
COMMON_PAIRS = (("q8_0", "q8_0"), ("q4_0", "q4_0"))

#: facade name -> (module of this package, name there); resolved on first use by :func:`__getattr__`
LAZY: dict[str, tuple[str, str]] = {
    "CACHE_TYPES": ("quants", "KV_CACHE_TYPES"),
    "GGML_TYPES": ("quants", "GGML_TYPES"),
    "IQ4_NL_VALUES": ("quants", "IQ4_NL_VALUES"),
    "KV_CACHE_TYPES": ("quants", "KV_CACHE_TYPES"),
    "ggml_type": ("quants", "ggml_type"),
    "quantize": ("quants", "quantize"),
    "dequantize": ("quants", "dequantize"),
    "fake_quant": ("quants", "fake_quant"),
    "ggml_fwht": ("rotation", "ggml_fwht"),
    "k_rot_size": ("rotation", "k_rot_size"),
    "v_rot_size": ("rotation", "v_rot_size"),
    "rotation_default": ("rotation", "rotation_default"),
    "Plan": ("plan", "LlamaCppKVPlan"),
    "LlamaCppKVPlan": ("plan", "LlamaCppKVPlan"),
    "LlamaCppKVBytes": ("plan", "LlamaCppKVBytes"),
    "kv_bytes": ("plan", "kv_bytes"),
    "bits_per_value": ("plan", "bits_per_value"),
    "parse_pair": ("plan", "parse_pair"),
    "pair_bytes_per_token": ("plan", "pair_bytes_per_token"),
    "kv_memory": ("plan", "kv_memory"),
    "pair_plan": ("plan", "pair_plan"),
    "MatmulInputs": ("plan", "MatmulInputs"),
    "gguf_matmul_inputs": ("plan", "gguf_matmul_inputs"),
}


def serve_line(model: str, type_k: str, type_v: str) -> str:
    """The shell line that serves ``model`` (a .gguf path, already quoted for the shell) with this K/V cache:
    ``llama-server -m MODEL -fa on -ctk TYPE_K -ctv TYPE_V`` (flash attention on: llama.cpp refuses a quantized V
    cache without it, ``src/llama-context.cpp``)."""
    return f"llama-server -m {model} -fa on -ctk {type_k} -ctv {type_v}"


def _module(name: str):
    """The module ``name`` of this package (imported here, so the import graph shows every edge)."""
    if name == "quants":
        from kvcal.engines.llamacpp import quants as m
    elif name == "rotation":
        from kvcal.engines.llamacpp import rotation as m
    elif name == "plan":
        from kvcal.engines.llamacpp import plan as m
    else:
        raise AttributeError(f"kvcal.engines.llamacpp has no module {name!r}")
    return m


def __getattr__(name: str):
    """A facade name of :data:`LAZY`, from its module (PEP 562: only names not defined above come here)."""
    if name not in LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = LAZY[name]
    return getattr(_module(module), attr)


__all__ = ["BUILD_HINT", "COMMON_PAIRS", "DISPLAY_NAME", "LAYER_RUNNER", "NAME", "PAIR_TYPES", "PYTHON_MODULE", "RUNNER",
           "VERSION",
           "serve_line", *LAZY]
