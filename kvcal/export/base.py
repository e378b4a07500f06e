"""Exporter machinery shared by every target: registry, load checks, scale conversion, atomic output.

A target (a module of its engine's package, ``kvcal/engines/<name>/export*.py``, named in the facade's
``EXPORT_MODULES`` and loaded by :func:`load_targets`) subclasses :class:`Target`, states which artifacts it can load
(:meth:`Target.can_load`) and writes its files into a staging directory (:meth:`Target.write`).
:func:`kvcal.export.export` does the rest: refuse unloadable artifacts naming the targets that can
load them, convert scales into the engine convention (:func:`prepare_scales`), stage everything
in a temporary sibling of ``--out`` and rename it into place only when complete.

Scale convention on output: the *OCP e4m3fn* dequantization multiplier every engine expects in a
checkpoint (``x ≈ q * scale``, ``scale = clip_amax / 448``; INT8: ``clip_amax / 127``), float32.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvcal.artifact import Artifact, engine_section
from kvcal.artifact.sections import set_figures
from kvcal.errors import KvcalError
from kvcal.outputs import EXPORT_MANIFEST
from kvcal.plan import tensor_name

FP8_E4M3_MAX = 448.0  # OCP float8_e4m3fn, the convention of every engine's checkpoint scales
FP8_E4M3FNUZ_MAX = 240.0  # AMD float8_e4m3fnuz
INT8_MAX = 127.0  # kvcal symmetric INT8 (compressed-tensors would use 127.5)
FORMAT_MAX = {"fp8_e4m3": FP8_E4M3_MAX, "fp8_e4m3fnuz": FP8_E4M3FNUZ_MAX, "fp8_e5m2": 57344.0, "int8": INT8_MAX}
MANIFEST = EXPORT_MANIFEST  # the manifest kvcal.artifact recognizes an export by
#: relative tolerance when deciding whether calibration clipped (scale*max vs observed amax)
CLIP_RTOL = 1e-5


class ExportError(KvcalError):
    """An artifact that a target cannot load, or an unusable ``--out`` / ``--model-dir``."""


@dataclass
class PreparedScales:
    """Per-layer scales in the engine convention, ready for a target to name and write.

    ``k`` / ``v``: layer -> float32 tensor, shape ``[1]`` (per-tensor) or ``[H_kv, 1, 1]``
    (per-head); ``q``: optional layer -> query scale passed through from the artifact;
    ``amax``: layer -> side -> observed absmax tensor shaped like the scale (None when the artifact
    has no statistics); ``fmt_max``: the output format's max (448 for FP8, 127 for INT8);
    ``clipped``: layer -> side -> ratio observed amax / (scale * fmt_max) for each exported scale
    that clips (> 1), after headroom; ``notes``: conversions applied, for the user.
    """

    num_layers: int
    granularity: str
    format: str
    k: dict[int, torch.Tensor]
    v: dict[int, torch.Tensor]
    q: dict[int, torch.Tensor]
    amax: dict[int, dict[str, torch.Tensor | None]]
    fmt_max: float
    clipped: dict[int, dict[str, float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    source: str = "searched"  # which recorded set: "searched" or "clip_free" (before any --headroom)
    raised: dict[int, list[str]] = field(default_factory=dict)  # layer -> sides --headroom raised
    amax_rule: int = 0  # clip-free sides the artifact records no choice for, set to observed max / fmt_max (not measured)

    def combined(self, layer: int) -> torch.Tensor:
        """One scale per layer shared by K and V (legacy JSON / TRT-LLM): ``max(k, v)``, shape
        ``[1]`` float32. The max never clips a value either side's scale represented."""
        return torch.maximum(self.k[layer].amax().reshape(1), self.v[layer].amax().reshape(1))


@dataclass
class ExportContext:
    """Inputs a target's :meth:`Target.write` may use: the artifact, prepared scales, the
    optional checkpoint ``model_dir`` (``Path``) and its parsed ``config`` dict, ``tp`` size."""

    artifact: Artifact
    scales: PreparedScales
    model_dir: Path | None
    config: dict | None
    tp: int
    ckpt: object = None  # kvcal.export.checkpoint.Checkpoint when model_dir is given
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # exported name -> tensor
    manifest: dict = field(default_factory=dict)  # extra entries for kvcal-export.json (e.g. shared_scale)


@dataclass
class ExportResult:
    """What :func:`kvcal.export.export` wrote: ``out`` dir, ``target`` name, ``files`` (relative
    paths), ``tensors`` (exported name -> float32 tensor, or the JSON values), ``notes`` and
    ``warnings`` (human-readable lines), and ``serve`` (a command line that uses the output)."""

    out: Path
    target: str
    files: list[str]
    tensors: dict[str, torch.Tensor]
    notes: list[str]
    warnings: list[str]
    serve: str


class Target:
    """Base class of an export target. Subclasses set ``name``, ``aliases``, ``engines`` (who
    loads it), ``formats`` / ``granularities`` (what it can load), ``non_saturating`` (engines
    among those that cast to FP8 without saturating: SGLang), ``shared_kv`` (its files hold one scale per
    layer for K and V, ``max(k, v)``) and implement :meth:`write`."""

    name = "base"
    order = 99  # position in listings
    aliases: tuple[str, ...] = ()
    engines: tuple[str, ...] = ()
    formats: tuple[str, ...] = ("fp8_e4m3", "fp8_e4m3fnuz")
    granularities: tuple[str, ...] = ("tensor",)
    non_saturating: tuple[str, ...] = ()
    shared_kv = False  # one scale per layer for K and V (max of the two): sglang-json, trtllm-legacy
    accepts_model_dir = True
    description = ""

    def can_load(self, meta: dict) -> str | None:
        """``None`` if this target's engines can load the artifact described by ``meta`` (the
        artifact metadata dict), else a one-line reason."""
        sec = engine_section(meta)
        d = sec.nvfp4_dtype if sec else None
        if d is not None:
            return (f"the artifact holds vLLM NVFP4 outer scales (calibrate --engine vllm --kv-cache-dtype {d}), "
                    "which only vLLM's NVFP4 cache reads; use --target vllm")
        reason = engine_common_reason(meta)
        if reason:
            return reason
        # engine_common_reason has checked that every layer shares layer 0's (kv.k) format and granularity
        kv = meta["kv"]
        fmt, gran = kv["k"]["format"], kv["k"]["granularity"]
        if fmt not in self.formats:
            return f"{self.name} loads {'/'.join(self.formats)} scales, not {fmt}"
        if gran not in self.granularities:
            return f"{self.name} loads per-{' or per-'.join(self.granularities)} scales, not per-{gran}"
        return None

    def write(self, ctx: ExportContext, staging: Path) -> str:
        """Write this target's files into the empty directory ``staging``; return the serve
        command line. Exported tensors go into ``ctx.tensors``; lines for the user into
        ``ctx.notes`` / ``ctx.warnings``."""
        raise NotImplementedError


_REGISTRY: dict[str, Target] = {}


def register(target: Target) -> Target:
    """Register ``target`` under its name and aliases (used by the engines' export modules)."""
    for n in (target.name, *target.aliases):
        assert n not in _REGISTRY, f"duplicate export target {n}"
        _REGISTRY[n] = target
    return target


def load_targets() -> None:
    """Import every engine's export modules (``EXPORT_MODULES`` of each facade, :mod:`kvcal.engines`), which
    :func:`register` their targets; once (later calls find them imported). Every lookup below calls it first."""
    import importlib

    from kvcal.engines import engine, with_attr

    for name in with_attr("EXPORT_MODULES"):
        for module in engine(name).EXPORT_MODULES:
            importlib.import_module(module)


def target_names() -> list[str]:
    """All registered names, canonical names first then aliases, e.g. ``['vllm', 'modelopt', ...]``."""
    load_targets()
    canon = [t.name for t in sorted(dict.fromkeys(_REGISTRY.values()), key=lambda t: (t.order, t.name))]
    # aliases by their target's module (the engine's package), whatever the order the modules were imported in
    return canon + sorted((n for n in _REGISTRY if n not in canon), key=lambda n: (type(_REGISTRY[n]).__module__, n))


def get_target(name: str) -> Target:
    """Look a target up by name or alias; raises :class:`ExportError` listing the valid names."""
    load_targets()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ExportError(f"unknown export target {name!r}; choose one of {', '.join(target_names())}") from None


def targets_that_can_load(meta: dict) -> list[str]:
    """Names (canonical + aliases) of the registered targets that can load this artifact."""
    load_targets()
    return [n for n in target_names() if _REGISTRY[n].can_load(meta) is None]


def describe_kv(meta: dict) -> str:
    """Human summary of an artifact's KV format, e.g. ``static per-channel int4 K / ... V``."""
    kv = meta.get("kv", {})
    parts = []
    for side in ("k", "v"):
        s = kv.get(side)
        if not s:
            continue
        kind = "dynamic" if s.get("dynamic") else "static"
        sym = "" if s.get("symmetric", True) else " asymmetric"
        g = s.get("granularity")
        gs = f"(g={s['group_size']})" if s.get("group_size") else ""
        parts.append(f"{kind}{sym} per-{g}{gs} {s.get('format')} {side.upper()}")
    return " / ".join(parts) or "no quantized K/V"


def layer_kv_specs(meta: dict) -> list[tuple[str, dict]]:
    """``[(where, {"k": spec dict, "v": spec dict})]`` for every layer of an artifact's metadata:
    ``kv.layer_specs`` when the layers differ (``--bits``), else layer 0's ``kv.k`` / ``kv.v`` once.
    ``where`` is ``""`` or ``" (layer i)"`` for messages."""
    kv = meta.get("kv", {})
    per_layer = kv.get("layer_specs")
    if isinstance(per_layer, list) and per_layer:
        return [(f" (layer {i})", {"k": ls.get("k"), "v": ls.get("v")}) for i, ls in enumerate(per_layer)
                if isinstance(ls, dict)]
    return [("", {"k": kv.get("k"), "v": kv.get("v")})]


def _prepare_nvfp4(artifact: Artifact, headroom: float | None) -> PreparedScales:
    """:class:`PreparedScales` of an NVFP4 artifact: ``k``/``v`` the per-layer outer scales (float32 ``[1]``,
    vLLM's ``k_scale``/``v_scale`` for an NVFP4 cache: the dequantization multiplier, ``global_scale =
    1/outer``), ``q`` the FP8 query scales, ``fmt_max`` 2688 (e4m3 max x E2M1 max: at ``amax/2688`` the
    largest block's e4m3 scale is 448). ``headroom`` raises each outer scale to at least
    ``observed amax / 2688 x headroom`` (block scales of larger values then do not saturate)."""
    meta = artifact.metadata
    n = artifact.num_layers
    fmax = FP8_E4M3_MAX * 6.0
    stats = {int(e["layer"]): e for e in meta.get("layers", []) if isinstance(e, dict) and "layer" in e}
    p = PreparedScales(n, "tensor", "nvfp4", {}, {}, {}, {}, fmax)
    p.notes.append(f"vLLM --kv-cache-dtype {engine_section(meta).nvfp4_dtype}: k_scale/v_scale are the NVFP4 outer "
                   "(global) scales, one per layer and side (vLLM's BaseKVCacheMethod takes per-tensor scales only)")
    raised = 0
    for i in range(n):
        p.amax[i] = {}
        for side in ("k", "v"):
            s = artifact.tensors[f"model.layers.{i}.self_attn.{side}_outer_scale"].detach().float().reshape(1).clone()
            amax = _amax_like((stats.get(i, {}).get(side) or {}).get("amax"), s)
            p.amax[i][side] = amax
            if headroom is not None and amax is not None:
                floor = amax / fmax * headroom
                raised += int(bool((floor > s).any()))
                s = torch.maximum(s, floor)
            getattr(p, side)[i] = s.contiguous()
        q = artifact.tensors.get(f"model.layers.{i}.self_attn.q_scale")
        if q is not None:
            p.q[i] = q.detach().float().clone()
    if headroom is not None:
        p.notes.append(f"--headroom {headroom}: raised {raised} of {2 * n} outer scales to observed max / 2688 x "
                       f"{headroom}")
    return p


def engine_common_reason(meta: dict) -> str | None:
    """Checks every engine target shares (runtime-formats.md): static symmetric scales for both K
    and V in one format, in every layer, measured post-RoPE (engines quantize the cache, i.e.
    post-RoPE keys)."""
    kv = meta.get("kv", {})
    first = None
    for where, specs in layer_kv_specs(meta):
        k, v = specs["k"], specs["v"]
        if not k or not v:
            return "engines quantize both K and V; this artifact quantizes only " + ("K" if k else "V") + where
        for side, s in (("K", k), ("V", v)):
            if s.get("dynamic"):
                return (f"{side}{where} uses a dynamic per-{s.get('granularity')} format whose scales are computed "
                        "at runtime; engines load static scales only (their dynamic modes ignore checkpoint scales)")
            if not s.get("symmetric", True):
                return f"{side}{where} is asymmetric (zero points); engines load symmetric scales only"
        if (k.get("format"), k.get("granularity")) != (v.get("format"), v.get("granularity")):
            return f"K and V{where} use different formats/granularities; engines use one KV-cache dtype for both"
        first = first or (k.get("format"), k.get("granularity"))
        if (k.get("format"), k.get("granularity")) != first:
            return (f"layers use different formats ({first[0]} per-{first[1]} in layer 0, {k.get('format')} "
                    f"per-{k.get('granularity')}{where}); engines use one KV-cache dtype for every layer")
    if kv.get("key_position", "post_rope") != "post_rope":
        return ("K scales were measured pre-RoPE; engines quantize post-RoPE keys "
                "(recalibrate with post-RoPE key capture)")
    if any(t.get(s, "none") != "none" for t in kv.get("transforms") or [] for s in ("k", "v")):
        return ("the artifact quantizes K/V after a transform (pre-RoPE or Hadamard) that engines do not apply; "
                "calibrate without --preset int4/transforms for an engine target")
    return None


def check_loadable(target: Target, meta: dict) -> None:
    """Raise :class:`ExportError` if ``target`` cannot load the artifact, listing the targets
    that can (or saying none can, and what to recalibrate with)."""
    reason = target.can_load(meta)
    if reason is None:
        return
    ok = targets_that_can_load(meta)
    alt = (f"targets that can load it: {', '.join(ok)}" if ok else
           "no export target can load it (use the kvcal runtime, or recalibrate with "
           "--format fp8_e4m3 --granularity tensor|head)")
    raise ExportError(f"cannot export {describe_kv(meta)} to {target.name}: {reason}; {alt}")


def _amax_like(values, scale: torch.Tensor) -> torch.Tensor | None:
    """Observed absmax list (per head or ``[1]``) shaped like ``scale`` (``[1]`` or ``[H,1,1]``)."""
    if values is None:
        return None
    a = torch.as_tensor(values, dtype=torch.float32).flatten()
    if a.numel() == 0 or not torch.isfinite(a).all():
        return None
    if scale.numel() == 1:
        return a.max().reshape(scale.shape)
    if a.numel() == scale.numel():
        return a.reshape(scale.shape)
    return a.max().expand(scale.shape).clone()


#: Largest ``--headroom`` accepted: 16 leaves the observed max at 28 of e4m3's 448 (4 of its ~17
#: binades unused); beyond that the margin destroys more resolution than any saturation it avoids.
MAX_HEADROOM = 16.0


def prepare_scales(artifact: Artifact, headroom: float | None = None, clip_free: bool = False) -> PreparedScales:
    """Convert an artifact's static K/V scales into the engine convention.

    Which scales: the searched ones (``layers[i].{k,v}.scale``, the artifact's tensors: what the search chose for
    the cache write recorded in ``calibration.cache_write`` and what ``kvcal evaluate`` measured), or with
    ``clip_free`` the clip-free ones the same search chose among candidates that clip nothing the calibration
    observed (``layers[i].{k,v}.clip_free``, :func:`kvcal.search.static_scales.clip_free_of`), with their held-out
    error recorded beside the searched one's — for an engine that casts to FP8 without saturating (SGLang). An
    artifact written before kvcal recorded a clip-free choice gets the amax rule (``observed amax / fmt_max``) on
    the sides whose searched scale clips: that is the search's ``absmax`` candidate, whose held-out error it
    recorded (``heldout.absmax``), and a note says so.

    * ``fp8_e4m3fnuz`` artifacts (clip = ``scale * 240``) are re-expressed in the OCP e4m3fn
      convention engines store in checkpoints: ``scale * 240 / 448`` (= clip / 448). vLLM and
      SGLang double loaded scales on FNUZ (ROCm) hardware (vLLM ``kv_cache.py`` /
      ``llama.py load_kv_cache_scales``: ``scaling_factor *= 2``), so there the effective clip
      is ``1.07 x`` the calibrated one (no clipping); on OCP hardware it is exactly the calibrated
      clip. Exporting ``scale / 2`` instead would clip 7% of the range on NVIDIA GPUs and give
      NaN in SGLang there.
    * ``headroom`` (``1 <= headroom <=`` :data:`MAX_HEADROOM`): raise each scale to at least
      ``observed_amax / fmt_max * headroom`` — a change after the search, which export reports with its cost
      (:func:`headroom_cost`).
    * An artifact of ``calibrate --engine vllm --kv-cache-dtype nvfp4`` gives its NVFP4 outer scales
      (:func:`_prepare_nvfp4`; ``headroom`` against ``amax / 2688``; ``clip_free`` refused, since no engine
      writes NVFP4 without saturating its block scales).

    Returns :class:`PreparedScales` (float32 ``[1]`` or ``[H_kv,1,1]`` per layer and side; ``source`` names the
    set written). Raises :class:`ExportError` for a bad ``headroom`` or ``clip_free`` on an NVFP4 artifact.
    """
    meta = artifact.metadata
    kv = meta["kv"]
    fmt, gran = kv["k"]["format"], kv["k"]["granularity"]
    sec = engine_section(meta)
    nvfp4 = sec is not None and sec.nvfp4_dtype is not None
    finite = isinstance(headroom, (int, float)) and math.isfinite(headroom)
    if headroom is not None and not (finite and headroom >= 1.0):
        raise ExportError(f"--headroom must be a number >= 1.0, a margin over the observed max (e.g. 1.25), got "
                          f"{headroom}: " + ("a margin below 1 clips values the calibration observed" if finite else
                                             "not a finite number"))
    if headroom is not None and headroom > MAX_HEADROOM:
        raise ExportError(
            f"--headroom must be at most {MAX_HEADROOM:g} (e.g. 1.25), got {headroom}: a margin of "
            f"{MAX_HEADROOM:g} already puts the observed max at 1/{MAX_HEADROOM:g} of the format's range and pushes "
            "small values into its subnormals; a larger one flushes the cache toward zero")
    if nvfp4:
        if clip_free:
            raise ExportError("--clip-free: NVFP4 outer scales are read by vLLM's NVFP4 cache only, which saturates "
                              "its block scales; drop --clip-free")
        return _prepare_nvfp4(artifact, headroom)
    conv = 1.0
    notes = []
    out_fmt_max = FORMAT_MAX.get(fmt, FP8_E4M3_MAX)
    if fmt == "fp8_e4m3fnuz":
        conv = FP8_E4M3FNUZ_MAX / FP8_E4M3_MAX
        out_fmt_max = FP8_E4M3_MAX
        notes.append(
            "artifact calibrated for ROCm fp8_e4m3fnuz (max 240): scales exported in the OCP e4m3fn "
            "convention engines expect (scale x 240/448 = clip/448); vLLM/SGLang double them on FNUZ "
            "hardware at load time, giving 1.07x the calibrated clip range there (nothing clips)"
        )
    stats = {int(e["layer"]): e for e in meta.get("layers", []) if isinstance(e, dict) and "layer" in e}
    n = artifact.num_layers
    p = PreparedScales(n, gran, fmt, {}, {}, {}, {}, out_fmt_max, notes=notes,
                       source="clip_free" if clip_free else "searched")
    raised, amax_rule, changed, recorded, unknown = 0, 0, 0, 0, 0
    for i in range(n):
        p.amax[i] = {}
        for side in ("k", "v"):
            s = artifact.scale(i, side)
            assert s is not None  # load_artifact guarantees static scales exist for every layer
            shape = (-1, 1, 1) if gran == "head" else (1,)
            s = s.detach().to(torch.float32).clone().reshape(shape)
            rec = stats.get(i, {}).get(side) or {}
            amax = _amax_like(rec.get("amax"), s)
            if clip_free:
                cf = (rec.get("clip_free") or {}).get("scale")
                if cf is not None:
                    t = torch.as_tensor(cf, dtype=torch.float32)
                    if t.numel() == s.numel():
                        recorded += 1
                        changed += int(not torch.equal(t.reshape(shape), s))
                        s = t.reshape(shape).clone()
                elif amax is None:
                    unknown += 1
                elif bool((amax / out_fmt_max > s / conv).any()):
                    s = torch.maximum(s, amax / out_fmt_max * conv)
                    amax_rule += 1
            s = s * conv
            p.amax[i][side] = amax
            if headroom is not None and amax is not None:
                floor = amax / out_fmt_max * headroom
                if bool((floor > s).any()):
                    raised += 1
                    p.raised.setdefault(i, []).append(side)
                s = torch.maximum(s, floor)
            if amax is not None:
                ratio = float((amax / (s * out_fmt_max)).max())
                if ratio > 1.0 + CLIP_RTOL:
                    p.clipped.setdefault(i, {})[side] = ratio
            getattr(p, side)[i] = s.contiguous()
        q = artifact.tensors.get(tensor_name(i, "k").replace("k_scale", "q_scale"))
        if q is not None:
            p.q[i] = q.detach().to(torch.float32).clone() * conv
    no_amax = all(p.amax[i][s] is None for i in range(n) for s in ("k", "v"))
    if clip_free:
        p.amax_rule = amax_rule
        missing = 2 * n - recorded
        line = (f"{changed} of {recorded} recorded clip-free scales differ from the searched ones (the searched scale "
                "clips there)" if recorded else "the artifact records no clip-free choice (written by an older kvcal)")
        if missing:
            kept = missing - amax_rule - unknown
            line += (f"; {amax_rule} of the {missing} sides without one get the amax rule (observed max / "
                     f"{out_fmt_max:g}, not measured: `kvcal evaluate --artifact OUT` measures the export)"
                     + (f", {kept} keep the searched scale (it clips nothing observed)" if kept else "")
                     + (f", {unknown} keep the searched scale unchecked (no observed amax recorded)" if unknown else ""))
        notes.append(line)
    if headroom is not None:
        if no_amax:
            notes.append("--headroom ignored: the artifact records no observed amax per layer")
        else:
            notes.append(f"--headroom {headroom}: raised {raised} of {2 * n} K/V scales to observed max / "
                         f"{out_fmt_max:g} x {headroom} after the search")
    return p


def clipping_warning(p: PreparedScales, engines: tuple[str, ...], clip_free_flag: bool = True) -> str | None:
    """A warning line when exported scales clip observed values and an engine in ``engines`` (those of the
    target's loaders that cast without saturating: SGLang) would load them — there ``x / scale`` above 448 becomes
    NaN/Inf — else ``None``. ``clip_free_flag``: whether ``--clip-free`` is an option of this target (it is not
    where the clip-free set is already the default)."""
    if not p.clipped or not engines:
        return None
    worst = max(r for d in p.clipped.values() for r in d.values())
    items = clipped_names(p)
    more = f" (+{len(items) - 8} more)" if len(items) > 8 else ""
    return (
        f"{len(items)} K/V scales clip values the calibration observed ({', '.join(items[:8])}{more}; observed max up "
        f"to {worst:.2f}x the representable range): engines that saturate (vLLM, TensorRT-LLM) serve them as "
        f"measured, but {'/'.join(engines)} casts to FP8 without saturating, so those values become NaN/Inf there; "
        + ("for SGLang export with --clip-free (the clip-free scales the search measured)" if clip_free_flag else
           "export without --clipped-scales for SGLang")
    )


def clipped_names(p: PreparedScales) -> list[str]:
    """``["K3", "V5", ...]``: the layer sides whose exported scale clips the recorded calibration absmax."""
    return [f"{s.upper()}{i}" for i, d in sorted(p.clipped.items()) for s in sorted(d)]


def set_cost_line(art: Artifact) -> str | None:
    """One line comparing the clip-free set with the searched one, from the recorded held-out figures
    (:func:`set_figures`), or ``None`` when either is not recorded."""
    a, b = set_figures(art.metadata, "searched"), set_figures(art.metadata, "clip_free")
    if a is None or b is None:
        return None

    def rel(x, y):
        return f"{(y / x - 1):+.1%}" if x > 0 else "n/a"
    return (f"clip-free vs searched scales, held-out mean over {a['layers']} layers (measured by the search): K "
            f"attention KL {b['k']:.3e} vs {a['k']:.3e} ({rel(a['k'], b['k'])}), V output error {b['v']:.3e} vs "
            f"{a['v']:.3e} ({rel(a['v'], b['v'])})")


def shared_figures(art: Artifact, p: PreparedScales) -> dict | None:
    """Held-out means of the shared scale a shared-K/V target writes (``max(k, v)`` per layer, the scales ``p``), as
    the search measured them at exactly that scale (``layers[i].shared[p.source].heldout``,
    :func:`kvcal.search.fp8.measure_shared`): ``{"k": mean attention KL, "v": mean relative output error,
    "layers": n}``, or ``None`` when some layer records no such measurement, records it for another scale (an
    artifact without clip-free records given the amax rule) or ``--headroom`` changed the scales."""
    if p.raised or p.format == "nvfp4":
        return None
    conv = (FP8_E4M3FNUZ_MAX / FP8_E4M3_MAX) if p.format == "fp8_e4m3fnuz" else 1.0
    stats = {e.get("layer"): e for e in art.metadata.get("layers") or [] if isinstance(e, dict)}
    out = {"k": 0.0, "v": 0.0}
    for i in range(p.num_layers):
        sh = (stats.get(i, {}).get("shared") or {}).get(p.source)
        served = float(p.combined(i))
        if not isinstance(sh, dict) or not isinstance(sh.get("scale"), (int, float)) or \
                abs(sh["scale"] * conv / served - 1) >= 1e-5:
            return None
        for sd in ("k", "v"):
            x = (sh.get("heldout") or {}).get(sd)
            if not isinstance(x, (int, float)):
                return None
            out[sd] += float(x) / p.num_layers
    return {**out, "layers": p.num_layers}


def headroom_cost(art: Artifact, p: PreparedScales) -> str | None:
    """What ``--headroom`` costs, from the calibration-split error the search recorded for every candidate
    (``layers[i].{k,v}.candidates``, per-tensor searches): for each side it raised, the error at the raised scale
    — read at the candidate of that scale (``headroom{m}`` for ``m`` in the search's grid, ``absmax`` for 1), else
    interpolated linearly in log(scale) between the candidates around it — against the error at the scale it
    replaced. Returns one line (mean and worst relative increase per side, and whether every figure was a
    measured candidate), or ``None`` when nothing was raised or the artifact records no candidates (per-head
    searches, older artifacts: the line then says to measure with ``kvcal evaluate``)."""
    if not p.raised:
        return None
    conv = (FP8_E4M3FNUZ_MAX / FP8_E4M3_MAX) if p.format == "fp8_e4m3fnuz" else 1.0
    stats = {e["layer"]: e for e in art.metadata.get("layers") or [] if isinstance(e, dict) and "layer" in e}
    incs: dict[str, list[float]] = {"k": [], "v": []}
    exact = True
    for i, sides in sorted(p.raised.items()):
        for sd in sides:
            rec = stats.get(i, {}).get(sd) or {}
            cand = rec.get("candidates")
            if not isinstance(cand, dict) or p.granularity != "tensor":
                return ("--headroom changed scales after the search and this artifact records no per-candidate "
                        "errors to price it: measure the export with `kvcal evaluate --artifact OUT`")
            pts = list(zip(cand["scale"], cand["calib"], strict=False))
            served = float(getattr(p, sd)[i].max()) / conv
            before = (float(torch.as_tensor(rec["clip_free"]["scale"]).max()) if p.source == "clip_free"
                      and rec.get("clip_free") else float(art.scale(i, sd).max()))
            hit = [e for sc, e in pts if abs(sc / served - 1) < 1e-5]
            exact &= bool(hit)
            e_srv = hit[0] if hit else _interp_log(pts, served)
            e_own = next((e for sc, e in pts if abs(sc / before - 1) < 1e-5), _interp_log(pts, before))
            if e_srv is not None and e_own:
                incs[sd].append(e_srv / e_own - 1.0)
    parts = [f"{sd.upper()} {'KL' if sd == 'k' else 'output error'} mean {sum(v) / len(v):+.1%}, worst "
             f"{max(v):+.1%} ({len(v)} raised)" for sd, v in incs.items() if v]
    if not parts:
        return None
    how = ("measured at the search's candidates of exactly these scales" if exact else
           "interpolated between the search's candidates")
    return (f"--headroom cost on the calibration split ({how}): {'; '.join(parts)} — these scales differ from the "
            "measured artifact; `kvcal evaluate --artifact OUT` measures the export")


def _interp_log(points: list[tuple[float, float]], x: float) -> float | None:
    """Piecewise-linear interpolation of ``(scale, error)`` points in log(scale); ``None`` outside them."""
    pts = sorted({(a, b) for a, b in points if a > 0 and b is not None and math.isfinite(b)})
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * math.log(x / x0) / math.log(x1 / x0)
    return pts[0][1] if pts and abs(x / pts[0][0] - 1) < 1e-6 else None


def shared_scale_cost(art: Artifact, p: PreparedScales) -> tuple[str | None, list[dict]]:
    """What serving K and V with one scale per layer (``max(k, v)``: sglang-json, trtllm-legacy)
    costs against the per-side scales ``p`` a separate-scale target would export.

    Per layer: ``ratio[side]`` = served / own scale (``>= 1``; the side with the smaller scale is
    quantized ``ratio`` times coarser: ``log2(ratio)`` of FP8 e4m3's ~17.8 binades are lost and its
    small values fall into subnormals or to zero), and ``est_error_increase[side]``, the relative
    increase of that side's held-out attention error (K: attention KL; V: attention-output error)
    estimated by interpolating, linearly in log(scale), the held-out errors the search recorded at
    the chosen, absmax and unity scales (``layers[i].{k,v}.heldout``); ``None`` when they are not
    recorded or the served scale lies beyond them. An estimate from recorded statistics, not a
    measurement (``kvcal evaluate`` measures the served configuration on the model).

    Returns ``(summary line or None when no layer pays a cost, per-layer rows)``; the line names the three layer
    sides with the largest held-out error increase (measured, else estimated), then those without one by ratio.
    """
    meta = art.metadata
    fmt_max = FORMAT_MAX.get(p.format, FP8_E4M3_MAX)
    conv = (FP8_E4M3FNUZ_MAX / FP8_E4M3_MAX) if p.format == "fp8_e4m3fnuz" else 1.0
    stats = {e["layer"]: e for e in meta.get("layers") or []}
    rows, costly = [], []
    for i in range(p.num_layers):
        own = {sd: float(getattr(p, sd)[i].max()) for sd in ("k", "v")}
        served = max(own.values())
        row = {"layer": i, "k": own["k"], "v": own["v"], "served": served, "ratio": {}, "est_error_increase": {}}
        for sd in ("k", "v"):
            ratio = served / own[sd]
            row["ratio"][sd] = ratio
            rec = stats.get(i, {}).get(sd) or {}
            ho = rec.get("heldout") if isinstance(rec.get("heldout"), dict) else {}
            chosen = art.scale(i, sd)
            pts = []
            if chosen is not None and chosen.numel() == 1:
                pts.append((float(chosen), ho.get("chosen")))
            if rec.get("amax"):
                pts.append((max(rec["amax"]) / fmt_max, ho.get("absmax")))
            pts.append((1.0, ho.get("unity")))
            pts = [(a, b) for a, b in pts if isinstance(b, (int, float))]
            e_own, e_srv = _interp_log(pts, own[sd] / conv), _interp_log(pts, served / conv)
            inc = (e_srv / e_own - 1.0) if e_own and e_srv is not None else None
            sh = (stats.get(i, {}).get("shared") or {}).get(p.source) if not p.raised else None
            if isinstance(sh, dict) and abs(sh.get("scale", 0) * conv / served - 1) < 1e-5:
                own_h = ho.get("chosen") if p.source == "searched" else (rec.get("clip_free") or {}).get("heldout")
                if isinstance(own_h, (int, float)) and own_h > 0:
                    inc = sh["heldout"][sd] / own_h - 1.0
                    row.setdefault("measured", {})[sd] = True
            row["est_error_increase"][sd] = inc
            if ratio > 1 + CLIP_RTOL:
                costly.append((ratio, i, sd, inc))
        rows.append(row)
    if not costly:
        return None, rows
    # the layers whose held-out error the shared scale raises most first (measured where layers[i].shared records it,
    # else estimated), then those without a figure by how much coarser their side is served
    costly.sort(key=lambda c: (c[3] is not None, c[3] if c[3] is not None else 0.0, c[0]), reverse=True)
    how = {(r["layer"], sd): "" if r.get("measured", {}).get(sd) else "est. " for r in rows for sd in ("k", "v")}
    worst = ", ".join(f"layer {i} {sd.upper()} {r:.1f}x" + (f" ({how[(i, sd)]}held-out attention error {inc:+.0%})"
                                                           if inc is not None else "")
                      for r, i, sd, inc in costly[:3])
    incs = [c[3] for c in costly if c[3] is not None]
    measured = all(r.get("measured", {}).get(sd) for r in rows for sd in ("k", "v")
                   if r["ratio"][sd] > 1 + CLIP_RTOL)
    est = ((f"; held-out attention error up to {max(incs):+.0%} on a side (measured by the search at the shared "
            "scale)" if measured else
            f"; estimated held-out attention error up to {max(incs):+.0%} on a side (interpolated from the search's "
            "recorded candidates, not measured)") if incs else "")
    line = (f"K and V share one scale per layer (max of the two): {len(costly)} of {p.num_layers} layers serve one side "
            f"with a coarser scale than calibrated for it — worst: {worst}{est}; per-layer figures under shared_scale "
            "in kvcal-export.json; --target vllm keeps separate K and V scales")
    return line, rows


def report_shared_scale(ctx: ExportContext) -> None:
    """Add :func:`shared_scale_cost`'s summary to ``ctx`` (a warning when some side is served more than
    :data:`MAX_HEADROOM` times coarser — the margin ``--headroom`` itself refuses as destroying
    resolution — else a note) and its per-layer rows to the manifest."""
    line, rows = shared_scale_cost(ctx.artifact, ctx.scales)
    ctx.manifest["shared_scale"] = rows
    if line is None:
        return
    worst = max(r["ratio"][sd] for r in rows for sd in ("k", "v"))
    (ctx.warnings if worst >= MAX_HEADROOM else ctx.notes).append(line)


# ---- files -------------------------------------------------------------------------------------


def write_json(path: Path, obj: dict) -> None:
    """Write ``obj`` as indented JSON (``allow_nan=False``) with a trailing newline."""
    path.write_text(json.dumps(obj, indent=2, allow_nan=False) + "\n", encoding="utf-8")


def stage_output(out: Path, overwrite: bool, fill, inputs: dict | None = None) -> None:
    """Create ``out`` atomically: ``fill(staging_dir)`` populates a temporary sibling directory
    which replaces ``out`` only if ``fill`` returns normally; on any error nothing is left.

    Raises :class:`ExportError` for the refusals of :func:`kvcal.outputs.check_output_dir`
    (``out`` exists without ``overwrite``, is not a kvcal export, is or contains one of
    ``inputs``, lies inside a kvcal output) or on OS errors.
    """
    from kvcal.outputs import write_dir_atomically

    write_dir_atomically(out, fill, overwrite, ExportError, inputs, kind="export")
