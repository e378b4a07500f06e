"""What TensorRT-LLM loads from kvcal's exports: the legacy checkpoint's ``kv_cache_scaling_factor`` (one scale per
layer shared by K and V) and, in its PyTorch flow, ModelOpt HF names with ``hf_quant_config.json``
(:func:`simulate_trtllm`, *unverified* for the latter). ``kvcal inspect`` runs it; the exporters are tested against
it. Moved from :mod:`kvcal.export.rules` (issue 41).
"""

from __future__ import annotations

import re

from kvcal.export.rules import EngineLoad, LayerLoad, scale_values

#: the legacy checkpoint's one K/V scale of layer ``i`` and its reciprocal (runtime-formats.md "Legacy TensorRT-LLM
#: checkpoint"); the ModelOpt HF names its PyTorch flow reads (``k_proj.k_scale`` / ``v_proj.v_scale``)
TRTLLM_LEGACY = re.compile(r"^transformer\.layers\.(\d+)\.attention\.kv_cache_scaling_factor$")
TRTLLM_LEGACY_RCP = re.compile(r"^transformer\.layers\.(\d+)\.attention\.kv_cache_rcp_scaling_factor$")
MODELOPT_K = re.compile(r"^model\.layers\.(\d+)\.self_attn\.k_proj\.k_scale$")
MODELOPT_V = re.compile(r"^model\.layers\.(\d+)\.self_attn\.v_proj\.v_scale$")
#: the names :func:`kvcal.export.rules.is_kv_scale_name` counts as KV scales for TensorRT-LLM (the facade's
#: ``KV_SCALE_PATTERNS``)
KV_SCALE_PATTERNS = (TRTLLM_LEGACY, TRTLLM_LEGACY_RCP)


def simulate_trtllm(tensors: dict, num_layers: int, hf_quant_config: dict | None = None) -> EngineLoad:
    """TensorRT-LLM: legacy ``transformer.layers.{i}.attention.kv_cache_scaling_factor`` (one
    scale per layer shared by K and V), else ModelOpt HF names with ``hf_quant_config.json``
    ``kv_cache_quant_algo`` set (PyTorch flow; *unverified*, uses max(k, v) per layer)."""
    rep = EngineLoad("TensorRT-LLM")
    legacy = {int(m.group(1)): scale_values(t) for n, t in tensors.items() if (m := TRTLLM_LEGACY.match(n))}
    mk = {int(m.group(1)): scale_values(t) for n, t in tensors.items() if (m := MODELOPT_K.match(n))}
    mv = {int(m.group(1)): scale_values(t) for n, t in tensors.items() if (m := MODELOPT_V.match(n))}
    algo = ((hf_quant_config or {}).get("quantization") or {}).get("kv_cache_quant_algo")
    use_modelopt = not legacy and (mk or mv)
    if use_modelopt:
        if not algo:
            rep.problems.append("ModelOpt-named scales but no hf_quant_config.json kv_cache_quant_algo: not used")
        rep.notes.append("ModelOpt HF checkpoint path (TensorRT-LLM PyTorch flow; unverified)")
    for i in range(num_layers):
        if rep.problems:
            rep.layers.append(LayerLoad(i, None, None, "missing", "scales not loaded (see problems)"))
        elif i in legacy:
            s = legacy[i]
            status = "loaded" if len(s) == 1 else "error"
            rep.layers.append(LayerLoad(i, s, s, status, "" if len(s) == 1 else "kv_cache_scaling_factor must be [1]"))
        elif use_modelopt and i in mk and i in mv and len(mk[i]) == 1 and len(mv[i]) == 1:
            s = [max(mk[i][0], mv[i][0])]
            rep.layers.append(LayerLoad(i, s, s, "loaded"))
        else:
            rep.layers.append(LayerLoad(i, None, None, "missing", "no kv_cache_scaling_factor for this layer"))
    return rep


__all__ = ["KV_SCALE_PATTERNS", "simulate_trtllm"]
