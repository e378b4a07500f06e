"""What each serving engine loads: tiny simulators of their KV-scale naming and loading rules.

These are the *independent references* the exporters are tested against and that
``kvcal inspect`` uses to say whether an engine would load a scale or silently fall back to 1.0.
They implement ``shared/docs/runtime-formats.md``; each rule names the engine source it mirrors:

* vLLM ``vllm/model_executor/model_loader/weight_utils.py`` (``maybe_remap_kv_scale_name``):
  checkpoint names remapped to ``model.layers.{i}.self_attn.attn.{k,v}_scale``.
* vLLM ``vllm/model_executor/layers/quantization/kv_cache.py`` (``BaseKVCacheMethod``): the
  parameters start at -1.0; after loading, both k and v > 0 -> used; neither -> 1.0 with a
  warning; only one (legacy ``kv_scale``) -> copied to both; non-scalar -> error (except the
  compressed-tensors ``attn_head`` path, ``[H_kv, 1, 1]``).
* SGLang mirrors vLLM's names (``python/sglang/srt/model_loader/weight_utils.py``) but loads a
  scalar per layer only; it also reads the legacy ``--quantization-param-path`` JSON
  (``KVCacheQuantSchema``: dtype ``float8_e4m3fn``, one entry per TP rank and per layer).
* TensorRT-LLM legacy checkpoints: ``transformer.layers.{i}.attention.kv_cache_scaling_factor``
  (one scale per layer shared by K and V); its PyTorch flow reads ModelOpt HF exports
  (``k_proj.k_scale`` / ``v_proj.v_scale`` + ``hf_quant_config.json``) — that last rule is
  marked *unverified* in the reference and kept easy to adjust.

Scales are per-layer lists of floats (one value for scalar / ``[1]``, ``H_kv`` values for
``[H_kv, 1, 1]``), in the engine's dequantization-multiplier convention (``x ≈ q * scale``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# ---- name rules --------------------------------------------------------------------------------

# (pattern, param) : param is "k_scale" / "v_scale" / "q_scale" / "kv_scale" / "{k,v}_output_scale".
# Source: vLLM weight_utils.maybe_remap_kv_scale_name + runtime-formats.md "Checkpoint names accepted".
_VLLM_RULES: tuple[tuple[re.Pattern, str | None], ...] = (
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

_TRTLLM_LEGACY = re.compile(r"^transformer\.layers\.(\d+)\.attention\.kv_cache_scaling_factor$")
_TRTLLM_LEGACY_RCP = re.compile(r"^transformer\.layers\.(\d+)\.attention\.kv_cache_rcp_scaling_factor$")
_MODELOPT_K = re.compile(r"^model\.layers\.(\d+)\.self_attn\.k_proj\.k_scale$")
_MODELOPT_V = re.compile(r"^model\.layers\.(\d+)\.self_attn\.v_proj\.v_scale$")

#: quant_method values whose vLLM QuantizationConfig gives Attention a KV-cache method (so
#: ``k_scale``/``v_scale`` parameters exist to load into). Source: vLLM
#: ``layers/quantization/{compressed_tensors,fp8,modelopt,quark}.py`` ``get_quant_method``.
VLLM_KV_QUANT_METHODS = frozenset({"compressed-tensors", "fp8", "modelopt", "modelopt_fp4", "quark"})
#: quant_method values under which vLLM 0.33 maps the old ``{k,v}_proj.output_scale`` names to the attention
#: layer's ``k_scale``/``v_scale``: ``Fp8Config.get_cache_scale_mapper`` (``layers/quantization/fp8.py``) and
#: ``QuarkConfig.get_cache_scale_mapper`` (``quark/quark.py``); the base mapper (compressed-tensors, ModelOpt)
#: and ``weight_utils.maybe_remap_kv_scale_name`` do not.
VLLM_OUTPUT_SCALE_METHODS = frozenset({"fp8", "quark"})


@dataclass(frozen=True)
class RemappedName:
    """A checkpoint tensor name as vLLM/SGLang see it: ``layer``, ``param`` (``k_scale``,
    ``v_scale`` or ``q_scale``), the vLLM parameter ``target`` name and the ``rule`` that matched."""

    layer: int
    param: str
    target: str
    rule: str


def vllm_remap(name: str) -> RemappedName | None:
    """Apply vLLM's KV-scale name remapping to one checkpoint tensor name.

    Returns ``None`` for a name vLLM would not recognise as a KV scale (its value is then never
    loaded). ``...self_attn.kv_scale`` maps to ``k_scale`` (vLLM copies it to ``v_scale`` after
    loading); ``{k,v}_proj.output_scale`` maps to the side's scale (rule ``output_scale``; vLLM 0.33 applies
    it only under the quant methods in :data:`VLLM_OUTPUT_SCALE_METHODS`, which the load simulators check).
    """
    for pat, kind in _VLLM_RULES:
        m = pat.match(name)
        if not m:
            continue
        layer = int(m.group(1))
        side = "k" if kind == "kv_scale" else m.group(2)
        param = f"{side}_scale"
        return RemappedName(layer, param, f"model.layers.{layer}.self_attn.attn.{param}", kind or "name")
    return None


def is_kv_scale_name(name: str) -> bool:
    """True for any tensor name an engine would load as a K/V scale (vLLM/SGLang or TRT-LLM)."""
    r = vllm_remap(name)
    if r is not None and r.param in ("k_scale", "v_scale"):
        return True
    return bool(_TRTLLM_LEGACY.match(name) or _TRTLLM_LEGACY_RCP.match(name))


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


def _values(t) -> list[float]:
    return [float(x) for x in t.detach().float().flatten().tolist()]


def _vllm_like(
    engine: str,
    tensors: dict,
    num_layers: int,
    num_kv_heads: int | None,
    quantization_config: dict | None,
    allow_per_head: bool,
) -> EngineLoad:
    rep = EngineLoad(engine)
    qc = quantization_config or {}
    method = qc.get("quant_method")
    if not qc:
        rep.problems.append(
            "config.json has no quantization_config: no k_scale/v_scale parameters are created, so "
            "checkpoint scales are skipped and every layer uses 1.0"
        )
    elif method not in VLLM_KV_QUANT_METHODS:
        rep.problems.append(
            f"quantization_config.quant_method={method!r} gives attention no KV-cache method "
            f"(only {sorted(VLLM_KV_QUANT_METHODS)} do): scales are skipped, 1.0 is used"
        )
    strategy = (qc.get("kv_cache_scheme") or {}).get("strategy", "tensor") if method == "compressed-tensors" else "tensor"
    found: dict[tuple[int, str], list[tuple[str, list[float], str]]] = {}
    ignored_output_scale = []
    for name, t in tensors.items():
        r = vllm_remap(name)
        if r is None or r.param == "q_scale":
            continue
        if r.rule == "output_scale" and engine == "vLLM" and method not in VLLM_OUTPUT_SCALE_METHODS:
            ignored_output_scale.append(name)
            continue
        vals = _values(t)
        shape = tuple(t.shape)
        if r.rule == "output_scale":
            vals = vals[:1]  # vLLM uses only the first element of the old pre-RoPE output_scale
            shape = (1,)
        found.setdefault((r.layer, r.param), []).append((name, vals, "x".join(map(str, shape)) or "scalar"))
    if ignored_output_scale:
        rep.notes.append(f"{len(ignored_output_scale)} {{k,v}}_proj.output_scale tensor(s) (e.g. {ignored_output_scale[0]}) "
                         f"are not KV-cache scales under quant_method={method!r}: vLLM 0.33 maps them to k/v_scale only "
                         f"for {'/'.join(sorted(VLLM_OUTPUT_SCALE_METHODS))} (Fp8Config / QuarkConfig "
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


def simulate_vllm(tensors: dict, num_layers: int, num_kv_heads: int | None = None,
                  quantization_config: dict | None = None) -> EngineLoad:
    """What vLLM uses per layer for a checkpoint holding ``tensors`` (name -> tensor; only KV-scale
    names matter) with ``config.json`` ``quantization_config``. Rules in the module docstring."""
    return _vllm_like("vLLM", tensors, num_layers, num_kv_heads, quantization_config, allow_per_head=True)


def simulate_sglang(tensors: dict, num_layers: int, num_kv_heads: int | None = None,
                    quantization_config: dict | None = None) -> EngineLoad:
    """SGLang: vLLM's names and rules, scalar per layer only (per-head is refused)."""
    return _vllm_like("SGLang", tensors, num_layers, num_kv_heads, quantization_config, allow_per_head=False)


def simulate_trtllm(tensors: dict, num_layers: int, hf_quant_config: dict | None = None) -> EngineLoad:
    """TensorRT-LLM: legacy ``transformer.layers.{i}.attention.kv_cache_scaling_factor`` (one
    scale per layer shared by K and V), else ModelOpt HF names with ``hf_quant_config.json``
    ``kv_cache_quant_algo`` set (PyTorch flow; *unverified*, uses max(k, v) per layer)."""
    rep = EngineLoad("TensorRT-LLM")
    legacy = {int(m.group(1)): _values(t) for n, t in tensors.items() if (m := _TRTLLM_LEGACY.match(n))}
    mk = {int(m.group(1)): _values(t) for n, t in tensors.items() if (m := _MODELOPT_K.match(n))}
    mv = {int(m.group(1)): _values(t) for n, t in tensors.items() if (m := _MODELOPT_V.match(n))}
    algo = ((hf_quant_config or {}).get("quantization") or {}).get("kv_cache_quant_algo")
    use_modelopt = not legacy and (mk or mv)
    if use_modelopt:
        if not algo:
            rep.problems.append("ModelOpt-named scales but no hf_quant_config.json kv_cache_quant_algo: not used")
        rep.notes.append("ModelOpt HF checkpoint path (TensorRT-LLM PyTorch flow; unverified)")
    for i in range(num_layers):
        if rep.problems:
            rep.layers.append(LayerLoad(i, None, None, "missing", "scales not loaded (see problems)"))
        elif i in legacy:
            s = legacy[i]
            status = "loaded" if len(s) == 1 else "error"
            rep.layers.append(LayerLoad(i, s, s, status, "" if len(s) == 1 else "kv_cache_scaling_factor must be [1]"))
        elif use_modelopt and i in mk and i in mv and len(mk[i]) == 1 and len(mv[i]) == 1:
            s = [max(mk[i][0], mv[i][0])]
            rep.layers.append(LayerLoad(i, s, s, "loaded"))
        else:
            rep.layers.append(LayerLoad(i, None, None, "missing", "no kv_cache_scaling_factor for this layer"))
    return rep


def simulate_sglang_json(doc: dict, num_layers: int, tp_size: int, model_type: str | None) -> EngineLoad:
    """SGLang ``--quantization-param-path`` JSON for a deployment of ``tp_size`` ranks.

    Mirrors ``KVCacheQuantSchema`` / ``QuantParamSchema`` validators: dtype ``float8_e4m3fn``;
    exactly ``tp_size`` ranks; ``num_layers`` entries per rank; ``model_type`` equal to the
    model's. A failed check is an engine startup error. One value per layer, shared by K and V.
    A model whose SGLang class defines no ``load_kv_cache_scales``
    (:data:`kvcal.export.layouts.SGLANG_NO_PARAM_PATH`, e.g. Gemma 3) fails at startup whatever the file holds.
    """
    from kvcal.export.layouts import SGLANG_NO_PARAM_PATH

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
    import math

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
