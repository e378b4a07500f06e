"""TensorRT-LLM legacy checkpoint target (``convert_checkpoint.py`` / ``trtllm-build`` flow).

Names (runtime-formats.md "Legacy TensorRT-LLM checkpoint"):
``transformer.layers.{i}.attention.kv_cache_scaling_factor`` float32 ``[1]`` = ``max(k, v)``
scale (dequant multiplier, clip / 448 for FP8, clip / 127 for INT8) and
``...kv_cache_rcp_scaling_factor`` = its reciprocal. The legacy checkpoint's ``rank{r}.safetensors``
files are produced by TensorRT-LLM's converter, so kvcal never merges into them: it writes
``kv_cache_scales.safetensors`` (the same tensors go into every rank's file) and
``quantization.json`` with the ``kv_cache_quant_algo`` for the checkpoint's ``config.json``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvcal.artifact.io import save_safetensors
from kvcal.export.base import ExportContext, Target, register, report_shared_scale, write_json

SCALES_FILE = "kv_cache_scales.safetensors"


def scale_names(layer: int) -> dict[str, str]:
    """Golden names for one layer: ``scale`` and ``rcp`` (reciprocal)."""
    base = f"transformer.layers.{layer}.attention"
    return {"scale": f"{base}.kv_cache_scaling_factor", "rcp": f"{base}.kv_cache_rcp_scaling_factor"}


class TrtllmLegacyTarget(Target):
    name = "trtllm-legacy"
    order = 2
    engines = ("TensorRT-LLM",)
    shared_kv = True
    formats = ("fp8_e4m3", "fp8_e4m3fnuz", "int8")
    accepts_model_dir = False
    description = "legacy TensorRT-LLM kv_cache_scaling_factor (max of K and V) + reciprocal"

    def write(self, ctx: ExportContext, staging: Path) -> str:

        p = ctx.scales
        for i in range(p.num_layers):
            n = scale_names(i)
            s = p.combined(i).to(torch.float32)
            ctx.tensors[n["scale"]] = s
            ctx.tensors[n["rcp"]] = (1.0 / s).to(torch.float32)
        save_safetensors(ctx.tensors, staging / SCALES_FILE, {"format": "pt", "producer": "kvcal"})
        algo = "INT8" if p.format == "int8" else "FP8"
        write_json(staging / "quantization.json", {"quantization": {"kv_cache_quant_algo": algo}})
        ctx.notes.append(
            f"K and V share one scale per layer (max of the two). Add these tensors to every rank{{r}}.safetensors "
            f"of the TensorRT-LLM checkpoint and set quantization.kv_cache_quant_algo={algo} in its config.json"
        )
        report_shared_scale(ctx)
        return "trtllm-build --checkpoint_dir <checkpoint with these tensors> --output_dir <engine>"


TARGET = register(TrtllmLegacyTarget())
