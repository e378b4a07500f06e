"""SGLang ``--quantization-param-path`` JSON target (also vLLM < 0.8).

Schema (runtime-formats.md; SGLang/vLLM ``KVCacheQuantSchema`` and ``QuantParamSchema``)::

    {"model_type": "llama",
     "kv_cache": {"dtype": "float8_e4m3fn",
                  "scaling_factor": {"0": {"0": 0.0152, "1": ...}, "1": {...}}}}

Outer key: TP rank (the file must list exactly the deployment's TP size); inner: layer index (all
``num_hidden_layers``); one float per layer shared by K and V, so kvcal writes ``max(k, v)``.
Per-tensor scales are the same on every rank. SGLang casts to FP8 *without saturating*, so this
target warns when calibration clipped (see ``--headroom``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from kvcal.export.base import ExportContext, Target, register, write_json
from kvcal.export.checkpoint import link_or_copy, read_header
from kvcal.export.rules import is_kv_scale_name

JSON_FILE = "kv_cache_scales.json"


def scales_json(model_type: str, per_layer: list[float], tp: int) -> dict:
    """The JSON document: ``per_layer[i]`` (float, dequant multiplier) replicated on ``tp`` ranks."""
    layers = {str(i): float(s) for i, s in enumerate(per_layer)}
    return {"model_type": model_type,
            "kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {str(r): dict(layers) for r in range(tp)}}}


class SglangJsonTarget(Target):
    name = "sglang-json"
    order = 3
    aliases = ("quantization-param-path",)
    engines = ("SGLang",)
    non_saturating = ("SGLang",)
    description = "legacy --quantization-param-path JSON, one entry per TP rank and layer (max of K and V)"

    def write(self, ctx: ExportContext, staging: Path) -> str:
        p = ctx.scales
        per_layer = []
        for i in range(p.num_layers):
            s = p.combined(i).to(torch.float32)
            per_layer.append(float(s))
            ctx.tensors[f"{i}"] = s
        mt = ctx.artifact.metadata["model"].get("model_type") or (ctx.config or {}).get("model_type")
        write_json(staging / JSON_FILE, scales_json(mt, per_layer, ctx.tp))
        model = "<model>"
        if ctx.model_dir is not None:
            for root, dirs, files in os.walk(ctx.model_dir, followlinks=True):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for fname in sorted(files):
                    rel = (Path(root) / fname).relative_to(ctx.model_dir)
                    if not fname.startswith(".") and str(rel) != JSON_FILE:
                        link_or_copy(Path(root) / fname, staging / rel)
            model = "{out}"
            ctx.notes.append(f"checkpoint linked unchanged; scales in {JSON_FILE}")
            stale = sorted(n for shard in (ctx.ckpt.shards if ctx.ckpt else ())
                           for n in read_header(ctx.model_dir / shard)[0] if is_kv_scale_name(n))
            if stale:
                ctx.warnings.append(
                    f"--model-dir already holds {len(stale)} KV-scale tensors ({', '.join(stale[:2])}"
                    f"{', ...' if len(stale) > 2 else ''}), copied unchanged: SGLang may load them besides "
                    f"{JSON_FILE}, so which scale wins is up to its load order. Use --target vllm (it replaces them) "
                    "or a checkpoint without KV scales")
        ctx.notes.append(f"K and V share one scale per layer (max of the two); {ctx.tp} TP rank(s) written")
        return (f"python -m sglang.launch_server --model-path {model} --kv-cache-dtype fp8_e4m3 "
                f"--quantization-param-path {{out}}/{JSON_FILE} --tp {ctx.tp}")


TARGET = register(SglangJsonTarget())
