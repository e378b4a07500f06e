"""What vLLM 0.33's checkpoint loader does with each KV-scale tensor: the simulation ``kvcal inspect`` runs and the
exporters are tested against (:func:`simulate_vllm`), and vLLM's cache-scale name mapper per model family
(:data:`CACHE_SCALE_MAPPER`, replayed by :func:`kvcal.export.layouts.engine_param`).

The names and the load rules vLLM shares with SGLang are in :mod:`kvcal.export.rules` (``maybe_remap_kv_scale_name``,
``BaseKVCacheMethod``); what is vLLM's own is here: the per-head compressed-tensors ``attn_head`` path and the quant
methods under which it maps the old ``{k,v}_proj.output_scale`` names. Moved from :mod:`kvcal.export.rules` and
:mod:`kvcal.export.layouts` (issue 41).
"""

from __future__ import annotations

import re

from kvcal.export.rules import EngineLoad, remap_kv_scale_name, simulate_kv_scale_load

#: quant_method values under which vLLM 0.33 maps the old ``{k,v}_proj.output_scale`` names to the attention
#: layer's ``k_scale``/``v_scale``: ``Fp8Config.get_cache_scale_mapper`` (``layers/quantization/fp8.py``) and
#: ``QuarkConfig.get_cache_scale_mapper`` (``quark/quark.py``); the base mapper (compressed-tensors, ModelOpt)
#: and ``weight_utils.maybe_remap_kv_scale_name`` do not.
VLLM_OUTPUT_SCALE_METHODS = frozenset({"fp8", "quark"})


#: vLLM 0.33 ``QuantizationConfig.get_cache_scale_mapper`` (``layers/quantization/base_config.py``), in its order:
#: every regex that matches rewrites the name (:mod:`kvcal.export.layouts` replays it per model family).
CACHE_SCALE_MAPPER = (
    (re.compile(r"\.kv_scale$"), r".attn.k_scale"),
    (re.compile(r"\.self_attn\.[kv]_proj\.([kv])_scale$"), r".self_attn.attn.\1_scale"),
    (re.compile(r"\.self_attn\.qk(?:qk)?v_proj\.([kv])_scale$"), r".self_attn.attn.\1_scale"),
    (re.compile(r"\.mixer\.[kv]_proj\.([kv])_scale$"), r".mixer.attn.\1_scale"),
    (re.compile(r"(?<!\.attn)\.([qkv])_scale$"), r".attn.\1_scale"),
)

#: vLLM's KV-scale name remapping of one checkpoint tensor name (the rules it shares with SGLang):
#: :func:`kvcal.export.rules.remap_kv_scale_name`.
vllm_remap = remap_kv_scale_name


def simulate_vllm(tensors: dict, num_layers: int, num_kv_heads: int | None = None,
                  quantization_config: dict | None = None) -> EngineLoad:
    """What vLLM uses per layer for a checkpoint holding ``tensors`` (name -> tensor; only KV-scale
    names matter) with ``config.json`` ``quantization_config``: :func:`kvcal.export.rules.simulate_kv_scale_load`
    with per-head scales allowed (compressed-tensors ``attn_head``) and the old ``output_scale`` names mapped only
    under :data:`VLLM_OUTPUT_SCALE_METHODS`."""
    return simulate_kv_scale_load("vLLM", tensors, num_layers, num_kv_heads, quantization_config, allow_per_head=True,
                                  output_scale_methods=VLLM_OUTPUT_SCALE_METHODS)


__all__ = ["VLLM_OUTPUT_SCALE_METHODS", "CACHE_SCALE_MAPPER", "vllm_remap", "simulate_vllm"]
