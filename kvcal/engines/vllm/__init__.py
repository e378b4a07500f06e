"""vLLM 0.33: everything kvcal knows about this engine, and its facade (the interface of :mod:`kvcal.engines`).

The floors reach vLLM only through ``kvcal.engines.engine("vllm")``, i.e. this module; the names below are what
they use. Each is defined in a module of this package and imported from there on first use (the facade itself
imports nothing, so finding the engine costs nothing). Modules, lowest floor first:

==========================  =========================================================================================
``dtypes/``                 each ``--kv-cache-dtype`` as vLLM 0.33 writes and reads it, per attention backend (the
                            emulations, read from the engine's source and cited there), the dtype and backend
                            registry, the page bytes per layer (formats floor)
``memory``                  the pages vLLM's allocator reserves: bytes per token, for a context × batch, the share a
                            sliding-window layer holds (formats floor)
``plan``                    :class:`~kvcal.engines.vllm.plan.VllmKVPlan`, the fake-quant plan Protocol A runs for a
                            dtype (plan floor)
``search_fp8``,             the scales vLLM reads from a checkpoint, searched by kvcal's attention objectives: FP8
``search_nvfp4``            k/v/q scales, NVFP4 outer scales (stages floor; ``search_nvfp4`` builds on
                            ``search_fp8``'s query search)
``skip_layers``             ``--kv-cache-dtype-skip-layers``: vLLM's boundary rule, the knapsack's costs, the checks
                            against a model, the probe's plans, the serve argument (stages floor)
``section``                 the artifact's ``vllm`` metadata section: typed view and schema (products floor)
``probe``                   the per-layer sensitivity probe for the 16-bit layers and the scales it reads from an
                            artifact (products floor)
``skip``                    ``kvcal calibrate --skip-layers``: its checks and the 16-bit layers recorded in the artifact
                            (front floor)
``calibrate``               ``kvcal calibrate --engine vllm``: option checks, the search, the artifact section (front)
``export``                  the ``vllm`` export target (compressed-tensors names and ``kv_cache_scheme``) (front)
``loader``                  what vLLM's checkpoint loader does with each KV-scale name (``kvcal inspect``) (front)
``runner``                  the script ``kvcal verify`` runs in vLLM's own Python; imports no kvcal
==========================  =========================================================================================
"""

from __future__ import annotations

from pathlib import Path

NAME = "vllm"
DISPLAY_NAME = "vLLM"
#: the modules registering this engine's export targets (:func:`kvcal.export.base.load_targets`)
EXPORT_MODULES = ("kvcal.engines.vllm.export",)
#: the script ``kvcal verify`` runs with the engine's interpreter (:func:`kvcal.verify.engine.run_engine`)
RUNNER = Path(__file__).resolve().parent / "runner.py"

#: facade name -> (module of this package, name there); resolved on first use by :func:`__getattr__`
LAZY: dict[str, tuple[str, str]] = {
    # the --kv-cache-dtype menu and the attention backends (dtypes/registry.py, dtypes/pages.py, dtypes/dispatch.py)
    "VERSION": ("dtypes", "VLLM_VERSION"),
    "DTYPES": ("dtypes", "VLLM_DTYPES"),
    "DTypeError": ("dtypes", "VllmDTypeError"),
    "dtype": ("dtypes", "vllm_dtype"),
    "same_dtype": ("dtypes", "same_vllm_dtype"),
    "backend": ("dtypes", "vllm_backend"),
    "check_backend_serves": ("dtypes", "check_backend_serves"),
    "check_dtypes_served": ("dtypes", "check_dtypes_served"),
    "check_head_dim": ("dtypes", "check_head_dim"),
    "boundary_skip_layers": ("dtypes", "boundary_skip_layers"),
    "layer_bytes_per_token": ("dtypes", "layer_bytes_per_token"),
    # what the allocator reserves (memory.py)
    "bytes_per_token": ("memory", "vllm_bytes_per_token"),
    "cache_bytes": ("memory", "vllm_cache_bytes"),
    "token_shares": ("memory", "vllm_token_shares"),
    "MAX_NUM_BATCHED_TOKENS": ("memory", "VLLM_MAX_NUM_BATCHED_TOKENS"),
    # the plan Protocol A runs (plan.py)
    "Plan": ("plan", "VllmKVPlan"),
    # the artifact section (section.py)
    "read_section": ("section", "vllm_section"),
    "check_section": ("section", "check_section"),
    # the 16-bit layers (skip.py) and the probe (probe.py)
    "layer_sensitivity": ("probe", "layer_sensitivity"),
    "calibrated_scales": ("probe", "vllm_scales"),
    "fp8_scales": ("probe", "vllm_fp8_scales"),
    "rule_skip_layers": ("skip_layers", "rule_skip_layers"),
    "skip_costs": ("skip_layers", "skip_costs"),
    "skip_count_range": ("skip_layers", "skip_count_range"),
    "not_applicable": ("skip_layers", "not_applicable"),
    "budget_skip_layers": ("skip_layers", "budget_skip_layers"),
    "check_skip_layers": ("skip_layers", "check_skip_layers"),
    "serve_skip_arg": ("skip_layers", "serve_skip_arg"),
    # kvcal calibrate --engine vllm (calibrate.py)
    "calibrate_check": ("calibrate", "check_options"),
    "calibrate_preflight": ("calibrate", "check_model"),
    "calibrate_search": ("calibrate", "search"),
    "calibrate_finish": ("calibrate", "add_to_artifact"),
    "cache_write": ("calibrate", "cache_write"),
    # the checkpoint loader (loader.py) and the export target (export.py)
    "remap": ("loader", "vllm_remap"),
    "simulate": ("loader", "simulate_vllm"),
    "CACHE_SCALE_MAPPER": ("loader", "CACHE_SCALE_MAPPER"),
    "kv_only_quantization_config": ("export", "kv_only_quantization_config"),
}


def serve_line(model: str, kv_cache_dtype: str, skip_layers=(), per_head: bool = False) -> str:
    """The shell line that serves ``model`` (a path or hub id, already quoted for the shell) with
    ``--kv-cache-dtype kv_cache_dtype`` and the 16-bit layers ``skip_layers``
    (:func:`kvcal.engines.vllm.skip_layers.serve_skip_arg`): ``vllm serve MODEL --kv-cache-dtype D
    [--kv-cache-dtype-skip-layers ...]``; ``per_head``: per-KV-head scales, which vLLM loads on its FlashAttention-3
    backend only, selected by ``VLLM_ATTENTION_BACKEND=FLASH_ATTN`` in front."""
    from kvcal.engines.vllm.skip_layers import serve_skip_arg

    return (("VLLM_ATTENTION_BACKEND=FLASH_ATTN " if per_head else "")
            + f"vllm serve {model} --kv-cache-dtype {kv_cache_dtype}{serve_skip_arg(skip_layers)}")


def _module(name: str):
    """The module ``name`` of this package (imported here, so the import graph shows every edge)."""
    if name == "dtypes":
        from kvcal.engines.vllm import dtypes as m
    elif name == "memory":
        from kvcal.engines.vllm import memory as m
    elif name == "plan":
        from kvcal.engines.vllm import plan as m
    elif name == "section":
        from kvcal.engines.vllm import section as m
    elif name == "probe":
        from kvcal.engines.vllm import probe as m
    elif name == "skip_layers":
        from kvcal.engines.vllm import skip_layers as m
    elif name == "calibrate":
        from kvcal.engines.vllm import calibrate as m
    elif name == "loader":
        from kvcal.engines.vllm import loader as m
    elif name == "export":
        from kvcal.engines.vllm import export as m
    else:
        raise AttributeError(f"kvcal.engines.vllm has no module {name!r}")
    return m


def __getattr__(name: str):
    """A facade name of :data:`LAZY`, from its module (PEP 562: only names not defined above come here)."""
    if name not in LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = LAZY[name]
    return getattr(_module(module), attr)
