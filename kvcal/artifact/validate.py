"""Checks of an artifact's tensors: names, kinds and shapes against the metadata
(:func:`validate_tensors`), and scale ranges, including vLLM's NVFP4 outer-scale rules."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from kvcal.artifact.schema import SIDES
from kvcal.artifact.sections import engine_section
from kvcal.errors import ArtifactError
from kvcal.plan import tensor_name


def validate_scales(tensors: dict[str, torch.Tensor]) -> None:
    """Refuse zero, negative, NaN or Inf scales, naming the layer and side.

    Raises :class:`ArtifactError`. Engines silently produce garbage (or fall back to 1.0) on such
    scales, so kvcal never writes one.
    """
    for name, t in tensors.items():
        if not name.endswith("_scale"):
            continue
        bad = ~torch.isfinite(t) | (t <= 0)
        if bool(bad.any()):
            vals = t[bad].flatten()[:3].tolist()
            raise ArtifactError(
                f"refusing to write {name}: scales must be finite and > 0, got {vals} "
                f"({int(bad.sum())} bad of {t.numel()}); the calibration data for this layer is "
                "probably degenerate (all zeros or non-finite activations)"
            )


def is_finite_number(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)

#: Tensor kinds kvcal writes per layer and side (``model.layers.{i}.self_attn.{k,v}_{kind}``).
TENSOR_KINDS = ("scale", "zero_point", "clip_ratio", "mean", "rounding", "channel_bits", "levels", "trellis",
                "scale_base", "rope_inv_freq")
#: Tensors outside the per-layer K/V pattern: the query scale (per layer) and the RoPE table.
_OTHER_TENSOR = ("q_scale",)
#: vLLM NVFP4 outer scales (``model.layers.{i}.self_attn.{k,v}_outer_scale``, float32 ``[1]``; written by
#: ``calibrate --engine vllm --kv-cache-dtype nvfp4``, :mod:`kvcal.engines.vllm.search_nvfp4`): accepted only when
#: the metadata's ``vllm.kv_cache_dtype`` is an nvfp4 dtype, and then required for every layer.
_OUTER_KIND = "outer_scale"
#: e4m3 max x E2M1 max: the NVFP4 amax rule's divisor (outer = amax / 2688).
_NVFP4_AMAX_DIVISOR = 448.0 * 6.0
_ROPE_TENSOR = "rotary.inv_freq"

#: A static scale is refused when it lies outside ``[amax / fmt_max / SCALE_SANITY,
#: SCALE_SANITY * max(1, amax / 100)]`` for the calibration absmax ``amax`` the artifact records for
#: that layer and side. The search's candidates (runtime-formats.md, ``calibration.candidates``) span
#: clip 0.5 (scale = amax/fmt_max x 0.5), headroom 4, unity (1.0) and the on-the-fly rule
#: (amax/100 for V): every one of them lies a factor 32 or more inside these bounds, while a hand-typed
#: 1e30 or 1e-30 lies twenty orders of magnitude outside.
SCALE_SANITY = 64.0

_FMT_MAX = {"fp8_e4m3": 448.0, "fp8_e4m3fnuz": 240.0, "fp8_e5m2": 57344.0}  # kvcal.formats.fp8 (OCP, AMD)


def _parse_tensor_name(name: str) -> tuple[int, str, str] | None:
    """``model.layers.{i}.self_attn.{side}_{kind}`` -> ``(i, side, kind)``; ``q_scale`` -> ``(i, "q", "scale")``;
    anything else ``None``."""
    parts = name.split(".")
    if len(parts) != 5 or parts[:2] != ["model", "layers"] or not parts[2].isdigit() or parts[3] != "self_attn":
        return None
    if parts[4] in _OTHER_TENSOR:
        return int(parts[2]), "q", "scale"
    side, _, kind = parts[4].partition("_")
    if side not in SIDES or kind not in (*TENSOR_KINDS, _OUTER_KIND):
        return None
    return int(parts[2]), side, kind


def validate_tensors(f: Path, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Tensor checks against the (schema-checked) metadata: float32 dtype (kvcal writes nothing else;
    an int32 or float16 tensor was put there by hand), names kvcal writes, layer indices within
    ``model.num_layers``, scale and zero-point shapes consistent with the side's granularity
    (``tensor`` ``[1]``, ``head`` ``[H_kv,1,1]``, ``channel`` ``[H_kv,1,D]``), and scales finite, > 0
    and within :data:`SCALE_SANITY` of the calibration range the metadata records for that layer and
    side. Raises :class:`ArtifactError` naming the tensor."""
    m = meta["model"]
    n, H, D = m["num_layers"], m["num_kv_heads"], m["head_dim"]
    kv = meta["kv"]
    specs = kv.get("layer_specs")
    for name, t in sorted(tensors.items()):
        if t.dtype != torch.float32:
            raise ArtifactError(f"{f}: tensor {name} has dtype {str(t.dtype).replace('torch.', '')}; kvcal writes "
                                "float32 tensors only, so the file was edited — re-run calibration")
        if name == _ROPE_TENSOR:
            continue
        parsed = _parse_tensor_name(name)
        if parsed is None:
            raise ArtifactError(f"{f}: holds tensor {name}, which kvcal does not write (names are "
                                "model.layers.{i}.self_attn.{k,v}_{" + ",".join(TENSOR_KINDS) + "}); remove it or "
                                "re-run calibration")
        i, side, kind = parsed
        if i >= n:
            raise ArtifactError(f"{f}: tensor {name} is for layer {i} but the metadata says {n} layers")
        if kind == _OUTER_KIND:
            _check_outer_scale(f, meta, name, t, i, side)
            continue
        if side == "q":  # vLLM's static FP8 query scale (kvcal.engines.vllm.search_fp8): per tensor or per KV-head group
            if tuple(t.shape) not in ((1,), (H, 1, 1)):
                raise ArtifactError(f"{f}: {name} has shape {list(t.shape)}, expected [1] (per tensor) or {[H, 1, 1]} "
                                    f"(one per KV-head group, model.num_kv_heads {H}); the file was edited — re-run "
                                    "calibration")
            if not bool((torch.isfinite(t) & (t > 0)).all()):
                raise ArtifactError(f"{f}: tensor {name} holds zero, negative or non-finite scales "
                                    f"({t.flatten()[:3].tolist()}); re-run calibration")
            continue
        spec = (specs[i] if specs else kv)[side]
        if kind == "rope_inv_freq":  # a pre-RoPE key layer's own RoPE table (models with one per layer type)
            trs = kv.get("transforms") or []
            if side != "k" or i >= len(trs) or trs[i].get("k") != "pre_rope":
                raise ArtifactError(f"{f}: holds {name}, a RoPE table, but layer {i}'s keys are not stored pre-RoPE "
                                    "(kv.transforms); remove it or re-run calibration")
            if tuple(t.shape) != (D // 2,) or not bool((torch.isfinite(t) & (t > 0)).all()):
                raise ArtifactError(f"{f}: {name} must hold {D // 2} finite positive RoPE frequencies (head_dim {D} / 2), "
                                    f"got shape {list(t.shape)}; the file was edited — re-run calibration")
            continue
        if kind in ("scale", "zero_point"):
            allowed = {"tensor": (1,), "head": (H, 1, 1), "channel": (H, 1, D)}.get(spec["granularity"])
            if allowed and not spec.get("dynamic", False) and tuple(t.shape) != allowed:
                raise ArtifactError(f"{f}: {name} has shape {list(t.shape)}, expected {list(allowed)} for "
                                    f"{spec['granularity']} granularity (model.num_kv_heads {H}, head_dim {D}); "
                                    "the file was edited — re-run calibration")
        if kind == "scale":
            bad = ~torch.isfinite(t) | (t <= 0)
            if bool(bad.any()):
                raise ArtifactError(f"{f}: tensor {name} holds zero, negative or non-finite scales "
                                    f"({t[bad].flatten()[:3].tolist()}); re-run calibration")
    sec = engine_section(meta)
    nvfp4 = sec.nvfp4_dtype if sec else None
    if nvfp4:
        lost = [f"model.layers.{i}.self_attn.{s}_{_OUTER_KIND}" for i in range(n) for s in SIDES
                if f"model.layers.{i}.self_attn.{s}_{_OUTER_KIND}" not in tensors]
        if lost:
            raise ArtifactError(f"{f}: metadata says vllm.kv_cache_dtype {nvfp4} but {len(lost)} NVFP4 "
                                f"outer scale(s) are missing (first: {lost[0]}); the file is incomplete — re-run "
                                "calibration")
    _check_scale_ranges(f, meta, tensors)


def _check_outer_scale(f: Path, meta: dict, name: str, t: torch.Tensor, i: int, side: str) -> None:
    """An NVFP4 outer scale tensor: only in an nvfp4 artifact, shape ``[1]``, finite and > 0, and within
    :data:`SCALE_SANITY` of the amax rule for the calibration absmax ``layers[i].{side}.amax``
    (``[amax/2688/64, 64·max(1, amax/100)]``; the search's candidates — amax/2688 x 2^(-4/8..7/8) and
    1.0 — lie well inside). Raises :class:`ArtifactError` naming the tensor."""
    sec = engine_section(meta)
    if not (sec and sec.nvfp4_dtype):
        have = sec.kv_cache_dtype if sec else None
        raise ArtifactError(f"{f}: holds {name}, a vLLM NVFP4 outer scale, but the metadata says "
                            + (f"vllm.kv_cache_dtype {have!r}" if have else "no vllm nvfp4 calibration")
                            + "; kvcal writes outer scales only for --engine vllm --kv-cache-dtype nvfp4 — remove it "
                            "or re-run calibration")
    if tuple(t.shape) != (1,):
        raise ArtifactError(f"{f}: {name} has shape {list(t.shape)}, expected [1] (vLLM loads one outer scale per "
                            "layer and side); the file was edited — re-run calibration")
    v = float(t.reshape(-1)[0])
    if not math.isfinite(v) or v <= 0:
        raise ArtifactError(f"{f}: tensor {name} holds the non-positive or non-finite scale {v}; re-run calibration")
    rec = next((lm.get(side) for lm in meta.get("layers") or [] if lm.get("layer") == i), None) or {}
    amax = rec.get("amax")
    if amax:
        a = max(float(x) for x in amax)
        lo, hi = a / _NVFP4_AMAX_DIVISOR / SCALE_SANITY, SCALE_SANITY * max(1.0, a / 100.0)
        if a > 0 and not lo <= v <= hi:
            raise ArtifactError(f"{f}: tensor {name} holds the outer scale {v:.4g}, implausible for the calibration "
                                f"absmax {a:.4g} recorded for layer {i} {side.upper()} (a plausible NVFP4 outer scale "
                                f"lies in [{lo:.3g}, {hi:.3g}]); the file was edited — re-run calibration")


def _check_scale_ranges(f: Path, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Static FP8 scales against the calibration absmax recorded in ``layers[i].{k,v}.amax`` (see
    :data:`SCALE_SANITY`)."""
    kv = meta["kv"]
    specs = kv.get("layer_specs")
    for lm in meta.get("layers") or []:
        i = lm["layer"]
        for side in SIDES:
            rec = lm.get(side) or {}
            spec = (specs[i] if specs else kv)[side]
            fmax = _FMT_MAX.get(spec["format"])
            t = tensors.get(tensor_name(i, side))
            amax = rec.get("amax")
            if fmax is None or spec.get("dynamic", False) or t is None or not amax:
                continue
            a = torch.tensor(amax, dtype=torch.float64).flatten()
            s = t.double().flatten()
            # per-tensor (against the max over heads) / per-head: one recorded absmax per scale; per-channel
            # scales under a per-head absmax get only the upper bound (a channel may be far below its head)
            per_value = a.numel() == s.numel() or s.numel() == 1
            if a.numel() != s.numel():
                a = a.max().expand(s.shape)
            if not bool((a > 0).all()):
                continue
            lo = a / fmax / SCALE_SANITY if per_value else torch.zeros_like(a)
            hi = SCALE_SANITY * torch.clamp(a / 100.0, min=1.0)
            bad = (s < lo) | (s > hi)
            if bool(bad.any()):
                j = int(bad.nonzero()[0][0])
                raise ArtifactError(
                    f"{f}: tensor {tensor_name(i, side)} holds the scale {float(s[j]):.4g}, implausible for the "
                    f"calibration absmax {float(a[j]):.4g} recorded for layer {i} {side.upper()} (a plausible "
                    f"{spec['format']} scale lies in [{float(lo[j]):.3g}, {float(hi[j]):.3g}]); the file was "
                    "edited — re-run calibration")


def _same_values(recorded: torch.Tensor, stored: torch.Tensor, side: str) -> bool:
    """Whether the float32 values a calibration record holds are exactly the tensor's: the same values where the
    same float32 numbers are stored (K and V scales, NVFP4 outer scales: ``ScaleChoice.scale.tolist()`` beside the
    tensor built from it); for ``q_scale`` also the rules of :func:`kvcal.engines.vllm.search_fp8.q_scale_tensor` — a
    per-tensor tensor holds the first recorded value, a per-KV-head-group one the single recorded value broadcast."""
    if recorded.numel() == stored.numel():
        return torch.equal(recorded, stored)
    if side != "q":
        return False
    if stored.numel() == 1:
        return torch.equal(recorded[:1], stored)
    return recorded.numel() == 1 and torch.equal(recorded.expand(stored.numel()), stored)


def check_recorded_scales(f: Path, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Every scale the metadata records per layer (``layers[i].{k,v,q}.scale``: what the search chose, and what
    ``kvcal report`` and export's figures describe) must be the scale tensor the file holds for that layer and side
    (``model.layers.{i}.self_attn.{k,v}_scale``; the ``{k,v}_outer_scale`` of an NVFP4 artifact; ``q_scale``),
    compared exactly in float32 (:func:`_same_values`). A swapped or hand-edited tensor whose content hash was
    recomputed is caught here. Records without a ``scale`` (integer artifacts, older kvcal) are not compared.
    Raises :class:`ArtifactError` naming the file, the layer and field, and the fix."""
    sec = engine_section(meta)
    nvfp4 = sec is not None and sec.nvfp4_dtype is not None
    for lm in meta.get("layers") or []:
        i = lm["layer"]
        for side in (*SIDES, "q"):
            rec = lm.get(side)
            if not isinstance(rec, dict) or rec.get("scale") is None:
                continue
            name = (f"model.layers.{i}.self_attn.q_scale" if side == "q" else
                    f"model.layers.{i}.self_attn.{side}_{_OUTER_KIND}" if nvfp4 else tensor_name(i, side))
            t = tensors.get(name)
            if t is None:
                raise ArtifactError(f"{f}: metadata field layers[{i}].{side}.scale records a scale but the file holds "
                                    f"no {name}; the file was edited — re-run `kvcal calibrate`")
            r = torch.tensor(rec["scale"], dtype=torch.float32).flatten()
            v = t.detach().to(torch.float32).flatten()
            if not _same_values(r, v, side):
                raise ArtifactError(
                    f"{f}: tensor {name} holds {[float(x) for x in v[:3]]} but metadata field layers[{i}].{side}.scale "
                    f"records {[float(x) for x in r[:3]]} (the scale the calibration chose): the scales were swapped "
                    "or edited after kvcal wrote them — re-run `kvcal calibrate`")

