"""What serving engines load: the KV-scale naming and loading rules several engines share.

These are the *independent references* the exporters are tested against and that ``kvcal inspect`` uses to say
whether an engine would load a scale or silently fall back to 1.0. They implement
``shared/docs/runtime-formats.md``; each rule names the engine source it mirrors. Each engine's own loader lives
in its package (``kvcal/engines/<name>/loader.py``: :func:`kvcal.engines.vllm.loader.simulate_vllm`,
:func:`kvcal.engines.sglang.loader.simulate_sglang` / ``simulate_sglang_json``,
:func:`kvcal.engines.trtllm.loader.simulate_trtllm`); what they share is here:

* the checkpoint names vLLM's ``vllm/model_executor/model_loader/weight_utils.py`` (``maybe_remap_kv_scale_name``)
  maps to ``model.layers.{i}.self_attn.attn.{k,v}_scale`` — SGLang's ``python/sglang/srt/model_loader/weight_utils.py``
  mirrors them (:data:`KV_SCALE_NAME_RULES`, :func:`remap_kv_scale_name`);
* the load of those names into the attention's ``k_scale``/``v_scale`` parameters (vLLM
  ``vllm/model_executor/layers/quantization/kv_cache.py`` ``BaseKVCacheMethod``, which SGLang follows): the
  parameters start at -1.0; after loading, both k and v > 0 -> used; neither -> 1.0 with a warning; only one
  (legacy ``kv_scale``) -> copied to both; non-scalar -> error, except where the engine takes the compressed-tensors
  ``attn_head`` path, ``[H_kv, 1, 1]`` (:func:`simulate_kv_scale_load`; SGLang loads a scalar per layer only);
* :func:`is_kv_scale_name`: whether any engine (these names, or a name pattern an engine's facade lists in
  ``KV_SCALE_PATTERNS``: TensorRT-LLM's legacy ``kv_cache_scaling_factor``) would load a tensor as a K/V scale.

Scales are per-layer lists of floats (one value for scalar / ``[1]``, ``H_kv`` values for
``[H_kv, 1, 1]``), in the engine's dequantization-multiplier convention (``x ≈ q * scale``).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

# ---- name rules --------------------------------------------------------------------------------

#: ``(pattern, kind)``: kind ``None`` (the name's own side), ``"kv_scale"`` or ``"output_scale"``. Source: vLLM
#: weight_utils.maybe_remap_kv_scale_name (SGLang's is the same) + runtime-formats.md "Checkpoint names accepted".
KV_SCALE_NAME_RULES: tuple[tuple[re.Pattern, str | None], ...] = (
    # already in vLLM's parameter naming
    (re.compile(r"^model\.layers\.(\d+)\.self_attn\.attn\.([kvq])_scale$"), None),
    # llm-compressor / compressed-tensors (the default rule)
    (re.compile(r"^model\.layers\.(\d+)\.self_attn\.([kvq])_scale$"), None),
    # NVIDIA ModelOpt HF export
    (re.compile(r"^model\.layers\.(\d+)\.self_attn\.k_proj\.(k)_scale$"), None),
    (re.compile(r"^model\.layers\.(\d+)\.self_attn\.v_proj\.(v)_scale$"), None),
    (re.compile(r"^model\.layers\.(\d+)\.self_attn\.q_proj\.(q)_scale$"), None),
    # fused qkv naming
    (re.compile(r"^model\.layers\.(\d+)\.self_attn\.qkv_proj\.([kv])_scale$"), None),
    # deprecated single scale (copied to both after loading)
    (re.compile(r"^model\.layers\.(\d+)\.self_attn\.kv_scale$"), "kv_scale"),
    # old compressed-tensors (2024): pre-RoPE output activation scales, first element used
    (re.compile(r"^model\.layers\.(\d+)\.self_attn\.([kv])_proj\.output_scale$"), "output_scale"),
)

#: quant_method values whose QuantizationConfig gives Attention a KV-cache method (so
#: ``k_scale``/``v_scale`` parameters exist to load into). Source: vLLM
#: ``layers/quantization/{compressed_tensors,fp8,modelopt,quark}.py`` ``get_quant_method`` (SGLang's loader is
#: simulated with the same set).
KV_QUANT_METHODS = frozenset({"compressed-tensors", "fp8", "modelopt", "modelopt_fp4", "quark"})
@dataclass(frozen=True)
class RemappedName:
    """A checkpoint tensor name as vLLM/SGLang see it: ``layer``, ``param`` (``k_scale``,
    ``v_scale`` or ``q_scale``), the vLLM parameter ``target`` name and the ``rule`` that matched."""

    layer: int
    param: str
    target: str
    rule: str


def remap_kv_scale_name(name: str) -> RemappedName | None:
    """Apply vLLM's (and SGLang's) KV-scale name remapping to one checkpoint tensor name.

    Returns ``None`` for a name vLLM would not recognise as a KV scale (its value is then never
    loaded). ``...self_attn.kv_scale`` maps to ``k_scale`` (vLLM copies it to ``v_scale`` after
    loading); ``{k,v}_proj.output_scale`` maps to the side's scale (rule ``output_scale``; vLLM 0.33 applies
    it only under the quant methods in :data:`kvcal.engines.vllm.loader.VLLM_OUTPUT_SCALE_METHODS`, which its load
    simulator checks).
    """
    for pat, kind in KV_SCALE_NAME_RULES:
        m = pat.match(name)
        if not m:
            continue
        layer = int(m.group(1))
        side = "k" if kind == "kv_scale" else m.group(2)
        param = f"{side}_scale"
        return RemappedName(layer, param, f"model.layers.{layer}.self_attn.attn.{param}", kind or "name")
    return None


def is_kv_scale_name(name: str) -> bool:
    """True for any tensor name an engine would load as a K/V scale: the names of :data:`KV_SCALE_NAME_RULES`
    (vLLM/SGLang), or a pattern of an engine's ``KV_SCALE_PATTERNS`` (TensorRT-LLM's legacy names)."""
    r = remap_kv_scale_name(name)
    if r is not None and r.param in ("k_scale", "v_scale"):
        return True
    return any(p.match(name) for p in _engine_patterns())


@functools.lru_cache(maxsize=1)
def _engine_patterns() -> tuple:
    """Every ``KV_SCALE_PATTERNS`` regex of the engines' facades (:mod:`kvcal.engines`), found once."""
    from kvcal.engines import engine, with_attr

    return tuple(p for n in with_attr("KV_SCALE_PATTERNS") for p in engine(n).KV_SCALE_PATTERNS)


# ---- load simulation ---------------------------------------------------------------------------


@dataclass
class LayerLoad:
    """What one engine ends up using for one layer.

    ``k`` / ``v``: the values used (list of floats; ``[1.0]`` on fallback); ``status``:
    ``"loaded"``, ``"copied"`` (only one scale found, copied to the other side), ``"fallback"``
    (no scale found: 1.0 — the silent-quality-loss case), ``"missing"`` (TensorRT-LLM: no scale
    for the layer; what the engine then does is not documented) or ``"error"`` (the engine refuses
    to start); ``message`` explains anything but ``"loaded"``.
    """

    layer: int
    k: list[float] | None
    v: list[float] | None
    status: str
    message: str = ""


@dataclass
class EngineLoad:
    """One engine's view of a checkpoint: ``layers`` (one :class:`LayerLoad` each), ``problems``
    (checkpoint-wide reasons nothing loads, e.g. no quantization config) and ``notes``."""

    engine: str
    layers: list[LayerLoad] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def count(self, status: str) -> int:
        return sum(1 for x in self.layers if x.status == status)

    @property
    def all_loaded(self) -> bool:
        return not self.problems and all(x.status == "loaded" for x in self.layers)


def scale_values(t) -> list[float]:
    """A scale tensor's values as a flat list of floats (what an engine uses, per layer and side)."""
    return [float(x) for x in t.detach().float().flatten().tolist()]


def simulate_kv_scale_load(
    engine: str,
    tensors: dict,
    num_layers: int,
    num_kv_heads: int | None,
    quantization_config: dict | None,
    allow_per_head: bool,
    output_scale_methods: frozenset | None = None,
) -> EngineLoad:
    """What an engine that loads the names of :data:`KV_SCALE_NAME_RULES` (vLLM, SGLang) uses per layer for a
    checkpoint holding ``tensors`` (name -> tensor; only KV-scale names matter) with ``config.json``
    ``quantization_config`` (module docstring). ``engine``: its name in the report (``"vLLM"``);
    ``allow_per_head``: it takes compressed-tensors ``attn_head`` scales ``[H_kv, 1, 1]``; ``output_scale_methods``:
    the quant methods under which it maps the old ``{k,v}_proj.output_scale`` names (``None``: it always does).
    Returns an :class:`EngineLoad` with one :class:`LayerLoad` per layer."""
    rep = EngineLoad(engine)
    qc = quantization_config or {}
    method = qc.get("quant_method")
    if not qc:
        rep.problems.append(
            "config.json has no quantization_config: no k_scale/v_scale parameters are created, so "
            "checkpoint scales are skipped and every layer uses 1.0"
        )
    elif method not in KV_QUANT_METHODS:
        rep.problems.append(
            f"quantization_config.quant_method={method!r} gives attention no KV-cache method "
            f"(only {sorted(KV_QUANT_METHODS)} do): scales are skipped, 1.0 is used"
        )
    strategy = (qc.get("kv_cache_scheme") or {}).get("strategy", "tensor") if method == "compressed-tensors" else "tensor"
    found: dict[tuple[int, str], list[tuple[str, list[float], str]]] = {}
    ignored_output_scale = []
    for name, t in tensors.items():
        r = remap_kv_scale_name(name)
        if r is None or r.param == "q_scale":
            continue
        if r.rule == "output_scale" and output_scale_methods is not None and method not in output_scale_methods:
            ignored_output_scale.append(name)
            continue
        vals = scale_values(t)
        shape = tuple(t.shape)
        if r.rule == "output_scale":
            vals = vals[:1]  # vLLM uses only the first element of the old pre-RoPE output_scale
            shape = (1,)
        found.setdefault((r.layer, r.param), []).append((name, vals, "x".join(map(str, shape)) or "scalar"))
    if ignored_output_scale:
        rep.notes.append(f"{len(ignored_output_scale)} {{k,v}}_proj.output_scale tensor(s) (e.g. {ignored_output_scale[0]}) "
                         f"are not KV-cache scales under quant_method={method!r}: vLLM 0.33 maps them to k/v_scale only "
                         f"for {'/'.join(sorted(output_scale_methods))} (Fp8Config / QuarkConfig "
                         "get_cache_scale_mapper); rename them to ...self_attn.{k,v}_scale")
    for i in range(num_layers):
        got = {}
        errs = []
        for param in ("k_scale", "v_scale"):
            hits = found.get((i, param), [])
            if len(hits) > 1:
                errs.append(f"{param} given {len(hits)} times ({', '.join(h[0] for h in hits)}): the last file read wins")
            if hits:
                name, vals, shape = hits[-1]
                if len(vals) > 1:
                    per_head_ok = allow_per_head and strategy == "attn_head" and len(vals) == num_kv_heads
                    if not per_head_ok:
                        why = (
                            f"{engine} loads one scalar per layer" if not allow_per_head
                            else "non-scalar scales need compressed-tensors strategy 'attn_head' "
                            f"and shape [{num_kv_heads},1,1]"
                        )
                        errs.append(f"{name} has shape [{shape}]: {why} (startup error)")
                got[param] = vals
        if rep.problems:
            rep.layers.append(LayerLoad(i, [1.0], [1.0], "fallback", "scales not loaded (see problems)"))
        elif errs:
            rep.layers.append(LayerLoad(i, got.get("k_scale"), got.get("v_scale"), "error", "; ".join(errs)))
        elif "k_scale" in got and "v_scale" in got:
            rep.layers.append(LayerLoad(i, got["k_scale"], got["v_scale"], "loaded"))
        elif not got:
            rep.layers.append(LayerLoad(i, [1.0], [1.0], "fallback", "no k/v scale under any accepted name: 1.0"))
        else:
            only = got.get("k_scale") or got.get("v_scale")
            side = "k" if "k_scale" in got else "v"
            rep.layers.append(LayerLoad(i, only, only, "copied", f"only {side}_scale found: copied to both"))
    return rep
