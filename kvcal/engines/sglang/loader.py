"""What SGLang 0.5.23's loaders do with kvcal's exports: the checkpoint loader (:func:`simulate_sglang`: vLLM's
names and rules, a scalar per layer only) and the ``--quantization-param-path`` JSON (:func:`simulate_sglang_json`),
and the model files that read no such JSON (:data:`SGLANG_NO_PARAM_PATH`). ``kvcal inspect`` runs them; the
exporters are tested against them. Moved from :mod:`kvcal.export.rules` and :mod:`kvcal.export.layouts` (issue 41).
"""

from __future__ import annotations

import math

from kvcal.export.layouts import FAMILIES, OTHER_FAMILIES
from kvcal.export.rules import EngineLoad, LayerLoad, simulate_kv_scale_load

#: ``model_type`` -> SGLang 0.5.23 model file whose model class defines no ``load_kv_cache_scales``, so
#: ``--quantization-param-path`` stops the server at startup (``load_model_utils.load_kv_cache_scales`` raises
#: ``RuntimeError``). ``gemma3`` is Gemma3ForConditionalGeneration (``gemma3_mm.py``).
SGLANG_NO_PARAM_PATH: dict[str, str] = {
    **{f.model_type: f.sglang for f in (*FAMILIES.values(), *OTHER_FAMILIES.values())
       if f.sglang is not None and not f.sglang_json},
    "gemma3": "gemma3_mm.py",
}



def simulate_sglang(tensors: dict, num_layers: int, num_kv_heads: int | None = None,
                    quantization_config: dict | None = None) -> EngineLoad:
    """SGLang: vLLM's names and rules (:func:`kvcal.export.rules.simulate_kv_scale_load`), scalar per layer only
    (per-head is refused); the old ``output_scale`` names are mapped under any quant method."""
    return simulate_kv_scale_load("SGLang", tensors, num_layers, num_kv_heads, quantization_config, allow_per_head=False)


def simulate_sglang_json(doc: dict, num_layers: int, tp_size: int, model_type: str | None) -> EngineLoad:
    """SGLang ``--quantization-param-path`` JSON for a deployment of ``tp_size`` ranks.

    Mirrors ``KVCacheQuantSchema`` / ``QuantParamSchema`` validators: dtype ``float8_e4m3fn``;
    exactly ``tp_size`` ranks; ``num_layers`` entries per rank; ``model_type`` equal to the
    model's. A failed check is an engine startup error. One value per layer, shared by K and V.
    A model whose SGLang class defines no ``load_kv_cache_scales`` (:data:`SGLANG_NO_PARAM_PATH`, e.g. Gemma 3)
    fails at startup whatever the file holds.
    """
    rep = EngineLoad("SGLang")
    if model_type in SGLANG_NO_PARAM_PATH:
        rep.problems.append(f"SGLang's {SGLANG_NO_PARAM_PATH[model_type]} ({model_type}) defines no "
                            "load_kv_cache_scales: --quantization-param-path is a RuntimeError at startup")
    kv = doc.get("kv_cache") or {}
    sf = kv.get("scaling_factor") or {}
    if kv.get("dtype") != "float8_e4m3fn":
        rep.problems.append(f"kv_cache.dtype is {kv.get('dtype')!r}, not 'float8_e4m3fn' (startup error)")
    if model_type is not None and doc.get("model_type") != model_type:
        rep.problems.append(f"model_type {doc.get('model_type')!r} != model's {model_type!r} (startup error)")
    if len(sf) != tp_size or any(str(r) not in sf for r in range(tp_size)):
        rep.problems.append(f"{len(sf)} TP ranks in the file, engine runs TP={tp_size} (startup error)")
    for r, layers in sf.items():
        if len(layers) != num_layers:
            rep.problems.append(f"rank {r} lists {len(layers)} layers, model has {num_layers} (startup error)")
    rank0 = sf.get("0") or {}
    bad = [f"{r}/{i}={v!r}" for r, layers in sf.items() for i, v in (layers or {}).items()
           if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0]
    if bad:
        rep.problems.append(f"scales must be finite and > 0; got rank/layer {', '.join(bad[:4])}"
                            + (" ..." if len(bad) > 4 else "") + " (a zero/negative/NaN scale corrupts the cache)")
    for i in range(num_layers):
        if rep.problems:
            rep.layers.append(LayerLoad(i, None, None, "error", "file rejected (see problems)"))
        elif str(i) in rank0:
            s = [float(rank0[str(i)])]
            rep.layers.append(LayerLoad(i, s, s, "loaded"))
        else:
            rep.layers.append(LayerLoad(i, [1.0], [1.0], "fallback", "layer missing"))
    return rep


__all__ = ["SGLANG_NO_PARAM_PATH", "simulate_sglang", "simulate_sglang_json"]
