"""Exporters: kvcal artifacts in the exact form each serving engine loads.

Targets (one module each in its engine's package, ``kvcal/engines/<name>/``, registered by name when first asked for:
:func:`kvcal.export.base.load_targets`; see ``shared/docs/runtime-formats.md``):

=====================  ==========================================================================
``vllm``               ``model.layers.{i}.self_attn.{k,v}_scale`` + compressed-tensors
(``compressed-tensors``) ``quantization_config.kv_cache_scheme`` (per-tensor ``[1]`` or per-head
                       ``[H_kv,1,1]`` with ``strategy: "attn_head"``)
``modelopt``           ``...self_attn.k_proj.k_scale`` / ``...v_proj.v_scale`` + ``hf_quant_config.json``
``trtllm-legacy``      ``transformer.layers.{i}.attention.kv_cache_scaling_factor`` (max of K, V) + reciprocal
``sglang-json``        ``--quantization-param-path`` JSON, one entry per TP rank and layer (max of K, V)
=====================  ==========================================================================

Python API: :func:`export`, :func:`get_target`, :func:`target_names`, :func:`targets_that_can_load`;
engine name rules for checks in :mod:`kvcal.export.rules`.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

from kvcal import __version__
from kvcal.artifact import Artifact, artifact_sha256, load_artifact
from kvcal.artifact.sections import set_figures
from kvcal.export.base import (
    MANIFEST,
    ExportContext,
    ExportError,
    ExportResult,
    Target,
    check_loadable,
    clipped_names,
    clipping_warning,
    get_target,
    headroom_cost,
    prepare_scales,
    set_cost_line,
    shared_figures,
    stage_output,
    target_names,
    targets_that_can_load,
)

__all__ = [
    "ExportError", "ExportResult", "Target", "export", "get_target", "target_names", "targets_that_can_load",
]


def export(
    artifact: str | os.PathLike | Artifact,
    target: str,
    out: str | os.PathLike,
    model_dir: str | os.PathLike | None = None,
    tp: int = 1,
    headroom: float | None = None,
    overwrite: bool = False,
    clipped_scales: bool = False,
    clip_free: bool = False,
) -> ExportResult:
    """Export an artifact for ``target`` into the new directory ``out`` (written atomically).

    ``artifact``: an artifact directory/file or a loaded :class:`Artifact`. ``model_dir``: a HF
    safetensors checkpoint to merge into (a linked copy is written to ``out``; the source is never
    modified). ``tp``: tensor-parallel size (ranks in the ``sglang-json`` file; checkpoints are
    TP-agnostic). ``headroom``: margin ``>= 1`` so every scale ``>= observed max / 448 x margin`` (a change after
    the search: its cost is reported from the search's recorded candidates, :func:`kvcal.export.base.headroom_cost`).

    Which scales (one set chosen by the search, never changed silently after it): by default the **searched**
    scales — exactly the artifact's tensors, what ``kvcal calibrate`` measured for the cache write in
    ``calibration.cache_write`` — for every target whose engines saturate (``vllm``, ``modelopt``,
    ``trtllm-legacy``); for ``sglang-json``, read only by SGLang, which casts to FP8 without saturating, the
    **clip-free** scales the same search chose among candidates that clip nothing it observed (recorded with their
    held-out error; the export reports their cost against the searched ones). ``clip_free``: the clip-free set for
    any target (a ``vllm`` / ``modelopt`` checkpoint to be served by SGLang); ``clipped_scales``: the searched set
    for ``sglang-json`` too (warned: NaN in SGLang where it clips). A checkpoint whose scales clip and that SGLang
    can load says so (``nan_risk`` in ``kvcal-export.json``, a warning, ``kvcal inspect``).

    Raises :class:`ExportError` (a :class:`kvcal.errors.KvcalError`) when the target cannot load the
    artifact (the message lists the targets that can), ``clipped_scales`` with ``clip_free`` or ``headroom``,
    ``out`` exists without ``overwrite``,
    ``out`` is the source checkpoint, or the checkpoint does not match the artifact.
    """
    from kvcal.export.checkpoint import check_matches, check_weights, open_checkpoint

    art = artifact if isinstance(artifact, Artifact) else load_artifact(artifact)
    t = get_target(target)
    check_loadable(t, art.metadata)
    if not isinstance(tp, int) or tp < 1:
        raise ExportError(f"--tp must be a positive integer, got {tp!r}")
    out = Path(out)
    from kvcal.outputs import check_output_dir

    inputs = {"--artifact": art.path, "--model-dir": model_dir}
    check_output_dir(out, overwrite, inputs, ExportError, kind="export")
    notes: list[str] = []
    ckpt, ckpt_warnings = None, []
    if model_dir is not None:
        if not t.accepts_model_dir:
            raise ExportError(f"{t.name} writes standalone tensors (TensorRT-LLM's converter owns its rank files); "
                              "drop --model-dir, or use --target modelopt for a Hugging Face checkpoint")
        ckpt = open_checkpoint(model_dir)
        src, dst = ckpt.path.resolve(), out.resolve()
        if dst == src or src in dst.parents or dst in src.parents:
            raise ExportError(f"--out {out} overlaps --model-dir {model_dir}; write the merged copy elsewhere")
        ckpt_warnings = check_matches(art.metadata, ckpt.config, ckpt.path) + check_weights(art.metadata, ckpt)
    if clipped_scales and clip_free:
        raise ExportError("--clipped-scales and --clip-free name two different scale sets; give one")
    has_amax = any((e.get(side) or {}).get("amax") is not None for e in art.metadata.get("layers", [])
                   if isinstance(e, dict) for side in ("k", "v"))
    if clipped_scales and headroom is not None and has_amax:  # it would undo what the flag asks for: refused
        raise ExportError(f"--clipped-scales with --headroom {headroom:g}: --headroom raises every scale to at least "
                          f"{headroom:g}x the one that just holds the observed max, so no scale would clip and the "
                          "searched scales --clipped-scales asks for would not be written; give one of the two")
    from kvcal.artifact import engine_section

    sec = engine_section(art.metadata)
    if clipped_scales and sec is not None and sec.nvfp4_dtype is not None:
        raise ExportError(f"--clipped-scales: {art.path} holds vLLM NVFP4 outer scales, which have one set only (no "
                          "clip-free set to opt out of: vLLM's NVFP4 cache saturates its block scales); drop "
                          "--clipped-scales")
    cw = (art.metadata.get("calibration") or {}).get("cache_write")
    from kvcal.formats.fp8 import CACHE_WRITES

    if cw is not None and cw not in CACHE_WRITES:
        raise ExportError(f"{art.path}: metadata field calibration.cache_write is {cw!r}, not one of "
                          f"{', '.join(CACHE_WRITES)}; re-run calibration")
    per_tensor = art.metadata["kv"]["k"]["granularity"] == "tensor"
    # SGLang loads per-tensor scales only; a target read by SGLang alone defaults to the clip-free set
    sglang_only = bool(t.non_saturating) and set(t.engines) <= set(t.non_saturating)
    use_clip_free = clip_free or (sglang_only and not clipped_scales)
    prep = prepare_scales(art, headroom, clip_free=use_clip_free)
    if prep.format != "nvfp4":
        figs = shared_figures(art, prep) if t.shared_kv else set_figures(art.metadata, prep.source)
        sep = set_figures(art.metadata, prep.source) if t.shared_kv and figs is None else None
        fig = (f" (held-out mean over {figs['layers']} layers, as the search measured"
               + (" at the shared max(K, V) scale the files hold" if t.shared_kv else "")
               + f": K attention KL {figs['k']:.3e}, V output error {figs['v']:.3e})" if figs else
               f" (held-out mean over {sep['layers']} layers of the separate K and V scales: K attention KL "
               f"{sep['k']:.3e}, V output error {sep['v']:.3e}; the files hold the shared max(K, V) scale, which the "
               "artifact records no measurement of at these scales: see the shared-scale line)" if sep else "")
        write = f" for a {cw} FP8 write ({CACHE_WRITES[cw]})" if cw else ""
        cf = ("k/v scales: the clip-free ones the search chose (nothing the calibration observed saturates)"
              if not prep.amax_rule else
              f"k/v scales: clip-free (nothing the calibration observed saturates), {prep.amax_rule} of "
              f"{2 * prep.num_layers} sides by the amax rule (not measured), the others as the search chose")
        notes.append((f"k/v scales: the searched ones, as calibrated{write}" if prep.source == "searched" else cf)
                     + (", served as one shared max(K, V) scale per layer" if t.shared_kv else "")
                     + fig + ("; then raised by --headroom" if prep.raised else ""))
        if prep.source == "clip_free" or sglang_only:
            line = set_cost_line(art)
            if line:
                notes.append(line)
    cost = headroom_cost(art, prep)
    if cost:
        notes.append(cost)
    nkv = art.metadata["model"].get("num_kv_heads")
    if tp > 1 and t.name != "sglang-json":
        notes.append(f"--tp {tp}: checkpoints are TP-agnostic (the engine slices per-head scales per rank)")
    if nkv and prep.granularity == "head" and tp > 1 and nkv % tp and tp % nkv:
        raise ExportError(f"--tp {tp} does not divide the {nkv} KV heads (nor they it); per-head scales cannot be sliced")
    ctx = ExportContext(art, prep, ckpt.path if ckpt else None, ckpt.config if ckpt else None, tp, ckpt=ckpt)
    ctx.notes += prep.notes + notes
    from kvcal.artifact import CONTENT_HASH_KEY

    if not art.metadata.get(CONTENT_HASH_KEY):
        ctx.notes.append(f"the artifact has no {CONTENT_HASH_KEY} (written before kvcal recorded one): its scales "
                         "passed every range and schema check, but a plausible hand edit cannot be detected")
    ctx.warnings += ckpt_warnings
    engines = t.non_saturating if per_tensor and prep.format != "nvfp4" else ()
    warn = clipping_warning(prep, engines, clip_free_flag=not sglang_only)
    if warn:  # a warning where SGLang is the target's engine; a note where it is another engine that can load it
        (ctx.warnings if sglang_only else ctx.notes).append(warn)
    nan_risk = ({"engines": list(engines), "scales": clipped_names(prep),
                 "worst_ratio": round(max(r for d in prep.clipped.values() for r in d.values()), 4)}
                if warn else None)
    if engines and all(prep.amax[i][s] is None for i in range(prep.num_layers) for s in ("k", "v")):
        ctx.warnings.append(f"the artifact records no observed amax, so kvcal can neither check nor undo clipping; "
                            f"{'/'.join(engines)} writes FP8 without saturating (a clipped value becomes NaN): "
                            "re-calibrate with this kvcal, which records it")
    mm = art.metadata["model"]
    hq, hkv = mm.get("num_attention_heads"), mm.get("num_kv_heads")
    if tp > 1 and isinstance(hq, int) and isinstance(hkv, int) and (
            hq % tp != 0 or (hkv % tp != 0 and tp % hkv != 0)):
        valid = [d for d in range(1, hq + 1) if hq % d == 0 and (hkv % d == 0 or d % hkv == 0)]
        raise ExportError(
            f"--tp {tp}: the model has {hq} attention heads and {hkv} KV heads, which engines cannot split "
            f"over {tp} ranks (tensor parallelism needs the heads divisible by the TP size, and the server refuses "
            f"such a launch); choose --tp from {', '.join(map(str, valid))}"
        )
    kv = art.metadata["kv"]
    if kv.get("residual_window") or kv.get("sink_tokens"):
        ctx.warnings.append(
            f"artifact was calibrated with residual_window={kv.get('residual_window', 0)}, "
            f"sink_tokens={kv.get('sink_tokens', 0)} kept in full precision; engines quantize every token, so "
            "kvcal's quality estimates for this artifact do not carry over"
        )
    result: dict = {}

    def fill(staging: Path) -> None:
        serve = t.write(ctx, staging)
        if (staging / "config.json").is_file():  # merged checkpoint: would the installed transformers apply it?
            from kvcal.export.hf_loader import check_transformers_kv

            chk = check_transformers_kv(json.loads((staging / "config.json").read_text(encoding="utf-8")))
            if chk is not None and chk.warning():
                ctx.warnings.append(chk.warning())
        manifest = {
            "kvcal_version": __version__,
            "target": t.name,
            "artifact": str(art.path),
            # what kvcal evaluate --artifact OUT reads the model and format from (kvcal.artifact.deployed)
            "artifact_path": str(Path(art.path).resolve()),
            "artifact_sha256": artifact_sha256(art.path),
            "model_dir": str(ckpt.path) if ckpt else None,
            "tp": tp,
            "headroom": headroom,
            "scales": prep.source + (f" ({prep.amax_rule} sides by the amax rule, not measured)" if prep.amax_rule
                                     else "") + (" + headroom" if prep.raised else "")
                      + (", as one shared max(K, V) scale per layer" if t.shared_kv else ""),
            "cache_write": cw,
            "nan_risk": nan_risk,
            "source_format": prep.format,
            "granularity": prep.granularity,
            "notes": ctx.notes,
            "warnings": ctx.warnings,
            **ctx.manifest,
            # every file of the export (this manifest included): `--overwrite` refuses a directory holding others
            "files": sorted([*(str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file()), MANIFEST]),
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        result["serve"] = serve
        result["files"] = sorted(str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file())

    stage_output(out, overwrite, fill, inputs)
    return ExportResult(out, t.name, result["files"], ctx.tensors, ctx.notes, ctx.warnings,
                        result["serve"].replace("{out}", shlex.quote(str(out))))  # a shell line, pasted as is
