"""NVIDIA ModelOpt HF-checkpoint target (TensorRT-LLM PyTorch flow; vLLM/SGLang for ModelOpt models).

Names (runtime-formats.md "ModelOpt / TensorRT-LLM"; vLLM ``weight_utils.maybe_remap_kv_scale_name``
ModelOpt rule): ``model.layers.{i}.self_attn.k_proj.k_scale`` and ``...v_proj.v_scale``, float32
``[1]`` = clip / 448, plus ``hf_quant_config.json``
``{"producer": {"name": "modelopt"}, "quantization": {"kv_cache_quant_algo": "FP8"}}``.

vLLM accepts a ModelOpt config only with weight quantization (``quant_algo`` required: vLLM
``layers/quantization/modelopt.py`` ``ModelOptQuantConfigBase.from_config``), so an existing
ModelOpt ``quantization_config`` in ``config.json`` is updated, but none is invented for a BF16
checkpoint: serve those with ``--target vllm``.
"""

from __future__ import annotations

import copy
from pathlib import Path

from kvcal import __version__
from kvcal.artifact.io import save_safetensors
from kvcal.export.base import ExportContext, ExportError, Target, register, write_json
from kvcal.export.checkpoint import SCALES_SHARD, merge_into_copy
from kvcal.export.rules import is_kv_scale_name

HF_QUANT_CONFIG = "hf_quant_config.json"


def scale_names(layer: int) -> dict[str, str]:
    """Golden names for one layer: side -> checkpoint tensor name."""
    return {"k": f"model.layers.{layer}.self_attn.k_proj.k_scale",
            "v": f"model.layers.{layer}.self_attn.v_proj.v_scale"}


def hf_quant_config(existing: dict | None) -> dict:
    """``hf_quant_config.json`` with ``kv_cache_quant_algo: "FP8"`` merged into ``existing``."""
    doc = copy.deepcopy(existing) if existing else {
        "producer": {"name": "modelopt", "version": f"kvcal-{__version__}"},
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": None, "exclude_modules": []},
    }
    doc.setdefault("quantization", {})["kv_cache_quant_algo"] = "FP8"
    return doc


class ModelOptTarget(Target):
    name = "modelopt"
    order = 1
    engines = ("TensorRT-LLM", "vLLM", "SGLang")
    non_saturating = ("SGLang",)
    description = "ModelOpt HF export names + hf_quant_config.json kv_cache_quant_algo"

    def write(self, ctx: ExportContext, staging: Path) -> str:

        p = ctx.scales
        for i in range(p.num_layers):
            n = scale_names(i)
            ctx.tensors[n["k"]] = p.k[i]
            ctx.tensors[n["v"]] = p.v[i]
        if ctx.model_dir is None:
            save_safetensors(ctx.tensors, staging / SCALES_SHARD, {"format": "pt", "producer": "kvcal"})
            write_json(staging / HF_QUANT_CONFIG, hf_quant_config(None))
            ctx.notes.append(f"standalone export: {SCALES_SHARD} + {HF_QUANT_CONFIG}; pass --model-dir to merge")
            return "trtllm-serve {out}"
        existing = None
        if (ctx.model_dir / HF_QUANT_CONFIG).is_file():
            from kvcal.export.checkpoint_json import read_hf_quant_config

            existing = read_hf_quant_config(ctx.model_dir / HF_QUANT_CONFIG, ExportError)  # "quantization" an object
        replace = {HF_QUANT_CONFIG: hf_quant_config(existing)}
        cfg = copy.deepcopy(ctx.config)
        qc = cfg.get("quantization_config")
        if qc and str(qc.get("quant_method", "")).startswith("modelopt"):
            if isinstance(qc.get("quantization"), dict):
                qc["quantization"]["kv_cache_quant_algo"] = "FP8"
            else:  # flat ("compressed-tensors style") ModelOpt config: vLLM reads kv_cache_scheme
                qc["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "symmetric": True,
                                         "strategy": "tensor", "dynamic": False}
            replace["config.json"] = cfg
        elif qc is None:
            ctx.warnings.append(
                "config.json has no quantization_config: TensorRT-LLM reads hf_quant_config.json, but vLLM/SGLang "
                "load ModelOpt KV scales only for ModelOpt-quantized weights; for a BF16 model served by "
                "vLLM/SGLang export with --target vllm"
            )
        else:
            ctx.notes.append(f"config.json kept (quant_method={qc.get('quant_method')}); vLLM remaps the "
                             "ModelOpt names for it")
        ctx.notes += merge_into_copy(ctx.ckpt, staging, ctx.tensors, is_stale=is_kv_scale_name,
                                     replace_files=replace)
        return "trtllm-serve {out}   # or, for ModelOpt-quantized weights: vllm serve {out} --kv-cache-dtype fp8"


TARGET = register(ModelOptTarget())
