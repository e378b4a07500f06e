"""SGLang ``--quantization-param-path`` JSON target (also vLLM < 0.8).

Schema (runtime-formats.md; SGLang/vLLM ``KVCacheQuantSchema`` and ``QuantParamSchema``)::

    {"model_type": "llama",
     "kv_cache": {"dtype": "float8_e4m3fn",
                  "scaling_factor": {"0": {"0": 0.0152, "1": ...}, "1": {...}}}}

Outer key: TP rank (the file must list exactly the deployment's TP size); inner: layer index (all
``num_hidden_layers``); one float per layer shared by K and V, so kvcal writes ``max(k, v)``.
Per-tensor scales are the same on every rank. SGLang casts to FP8 *without saturating*, so this
target exports unclipped scales by default (every scale >= the calibration max / 448; ``--headroom``
adds margin, ``--clipped-scales`` keeps the searched clipping scales and warns). What sharing one
scale costs the side with the smaller scale is reported (:func:`kvcal.export.base.shared_scale_cost`).

With ``--model-dir`` the checkpoint is linked beside the JSON unchanged, except that KV-scale tensors
it already holds (an FP8 checkpoint's ``k_scale`` / ``v_scale``) are left out: SGLang would load them
with the weights as well as the JSON's scales, and which one wins would be up to its load order. The
shards holding them are written as filtered copies (:func:`kvcal.export.checkpoint.filtered_copy`,
other tensors byte-identical) and the index drops their names, as the ``vllm`` target does.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from kvcal.engines.sglang import JSON_FILE  # the facade's (kvcal.artifact.deployed reads it back)
from kvcal.export.base import ExportContext, Target, register, report_shared_scale, write_json
from kvcal.export.checkpoint import INDEX, Checkpoint, filtered_copy, link_or_copy, read_header, staged_path
from kvcal.export.rules import is_kv_scale_name


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
    shared_kv = True
    description = "legacy --quantization-param-path JSON, one entry per TP rank and layer (max of K and V)"

    def can_load(self, meta: dict) -> str | None:
        """Also refuses a model whose SGLang model class reads no ``--quantization-param-path``
        (:data:`kvcal.engines.sglang.loader.SGLANG_NO_PARAM_PATH`: Gemma 3, Mixtral, Qwen3-MoE in SGLang 0.5.23):
        ``load_model_utils.load_kv_cache_scales`` raises ``RuntimeError`` at startup for it."""
        from kvcal.engines.sglang.loader import SGLANG_NO_PARAM_PATH
        from kvcal.export.layouts import family

        mt = (meta.get("model") or {}).get("model_type")
        if mt in SGLANG_NO_PARAM_PATH:
            fam = family(mt)
            alt = ("--target vllm, whose compressed-tensors k_scale/v_scale names SGLang's "
                   f"{fam.sglang} loads from the checkpoint" if fam is not None and fam.sglang_remaps else
                   "--target vllm for vLLM")
            return (f"SGLang's {SGLANG_NO_PARAM_PATH[mt]} ({mt}) defines no load_kv_cache_scales, so SGLang refuses to "
                    f"start with --quantization-param-path (RuntimeError); use {alt}")
        return super().can_load(meta)

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
            model = "{out}"
            ctx.notes.extend(copy_without_kv_scales(ctx.model_dir, staging, ctx.ckpt, keep_out={JSON_FILE}))
        ctx.notes.append(f"{ctx.tp} TP rank(s) written")
        report_shared_scale(ctx)
        return (f"python -m sglang.launch_server --model-path {model} --kv-cache-dtype fp8_e4m3 "
                f"--quantization-param-path {{out}}/{JSON_FILE} --tp {ctx.tp}")


def copy_without_kv_scales(src: Path, staging: Path, ckpt: Checkpoint | None, keep_out: set[str]) -> list[str]:
    """Link or copy every file of the checkpoint ``src`` into ``staging`` (hidden files and the names
    in ``keep_out`` skipped), writing shards that hold KV-scale tensors
    (:func:`kvcal.export.rules.is_kv_scale_name`) as filtered copies without them and, when the
    checkpoint has an index, an index without their names (``total_size`` reduced by their bytes).
    Returns notes for the user. Raises :class:`~kvcal.export.base.ExportError` for unreadable shards
    or broken links."""
    stale: dict[str, dict[str, int]] = {}  # shard -> stale name -> bytes
    for shard in (ckpt.shards if ckpt else ()):
        header, _ = read_header(src / shard)
        names = {n: v["data_offsets"][1] - v["data_offsets"][0] for n, v in header.items()
                 if n != "__metadata__" and is_kv_scale_name(n)}
        if names:
            stale[shard] = names
    skip = set(keep_out) | set(stale) | ({INDEX} if stale and ckpt.index is not None else set())
    for root, dirs, files in os.walk(src, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for fname in sorted(files):
            rel = (Path(root) / fname).relative_to(src)
            if not fname.startswith(".") and str(rel) not in skip:
                link_or_copy(Path(root) / fname, staged_path(staging, rel))
    if not stale:
        return ["checkpoint linked unchanged; scales in " + JSON_FILE]
    for shard, names in stale.items():
        dst = staged_path(staging, shard)
        dst.parent.mkdir(parents=True, exist_ok=True)
        filtered_copy(src / shard, dst, set(names))
    if ckpt.index is not None:
        dropped = {n for names in stale.values() for n in names}
        index = dict(ckpt.index)
        index["weight_map"] = {k: v for k, v in (ckpt.index.get("weight_map") or {}).items() if k not in dropped}
        meta = dict(index.get("metadata") or {})
        if isinstance(meta.get("total_size"), int):
            meta["total_size"] -= sum(sum(names.values()) for names in stale.values())
        index["metadata"] = meta
        write_json(staging / INDEX, index)
    n = sum(len(v) for v in stale.values())
    first = sorted(n for names in stale.values() for n in names)[:2]
    return [f"checkpoint linked except {len(stale)} shard(s) holding {n} KV-scale tensors ({', '.join(first)}"
            f"{', ...' if n > 2 else ''}): written as filtered copies without them (other tensors byte-identical; the "
            f"source is untouched), so SGLang reads only {JSON_FILE}'s scales"]


TARGET = register(SglangJsonTarget())
