"""Per model family: which checkpoint KV-scale names each loader maps, and into which parameter.

Three naming layouts are in use (SGLang #39942, vLLM #54623): ``{attn}.{k,v}_scale`` (llm-compressor /
compressed-tensors), ``{attn}.k_proj.k_scale`` / ``{attn}.v_proj.v_scale`` (NVIDIA ModelOpt) and
``{attn}.qkv_proj.{k,v}_scale`` (fused QKV), plus the deprecated ``{attn}.kv_scale`` (one value for K
and V). Whether a loader accepts one depends on the family, because the rules are written per model file.
:data:`FAMILIES` records, per ``config.json`` ``model_type``, the attention module path and its
projections; :func:`engine_param` replays each loader's renaming on one name. Sources (read from the
released code, not simulated from documentation):

* **vLLM 0.33.0** — ``model_executor/models/utils.py`` ``AutoWeightsLoader.load_weights`` applies the
  model's ``hf_to_vllm_mapper`` then ``QuantizationConfig.get_cache_scale_mapper()``
  (``layers/quantization/base_config.py``): every regex that matches rewrites the name, in this order:
  ``\\.kv_scale$ -> .attn.k_scale``; ``\\.self_attn\\.[kv]_proj\\.([kv])_scale$ -> .self_attn.attn.\\1_scale``;
  ``\\.self_attn\\.qk(qk)?v_proj\\.([kv])_scale$ -> .self_attn.attn.\\1_scale``;
  ``\\.mixer\\.[kv]_proj\\.([kv])_scale$ -> .mixer.attn.\\1_scale``;
  ``(?<!\\.attn)\\.([qkv])_scale$ -> .attn.\\1_scale``. A result that is not a parameter is dropped without
  error (``_ignore_unexpected_suffixes``). The parameter is ``{attn}.attn.{k,v}_scale`` of the vLLM
  module; families served by vLLM's Transformers backend (``models/registry.py``: GPTNeoXForCausalLM)
  first have their ``base_model_prefix`` rewritten to ``model.`` (``models/transformers/base.py``).
  A lone ``k_scale`` (from ``kv_scale``) is copied to ``v_scale`` after loading (``kv_cache.py``).
* **SGLang 0.5.23**, default loader (``SGLANG_ENABLE_WEIGHT_LOADER_V2`` off) — ``models/llama.py``
  (Llama and ``Phi3ForCausalLM``) calls ``model_loader/weight_utils.py: maybe_remap_kv_scale_name``:
  ``.kv_scale -> .attn.k_scale``; ``.self_attn.k_proj.k_scale -> .self_attn.attn.k_scale`` (same for v);
  otherwise ``.k_scale -> .attn.k_scale``; a result that is not a parameter is skipped with a warning.
  ``models/qwen2.py``, ``mixtral.py`` and ``qwen3_moe.py`` do **not** call it: only the parameter's own name
  ``{attn}.attn.{k,v}_scale`` loads; ``k_proj.k_scale`` becomes ``qkv_proj.k_scale`` (stacked-parameter
  mapping) and is skipped; ``self_attn.k_scale`` is "not found". GPT-NeoX has no SGLang model file (its
  Transformers fallback is not covered here).
* **Gemma 3** (``Gemma3ForCausalLM``, ``model_type`` ``gemma3_text``): vLLM 0.33.0 ``models/gemma3.py``
  ``Gemma3ForCausalLM.load_weights`` is ``AutoWeightsLoader`` with a mapper whose only entries are the stacked
  ``.{q,k,v}_proj -> .qkv_proj`` substrings, applied after the cache-scale regexes (``WeightsMapper._map_name_with_shard``
  runs regex before stacked), so the rules above hold unchanged; names that end up unknown but end in
  ``.{q,k,v}_scale`` are ignored (``_ignore_unexpected_suffixes``), any other unknown name is a ``ValueError``.
  SGLang 0.5.23 ``models/gemma3_causal.py`` ``Gemma3ForCausalLM.load_weights`` calls
  ``maybe_remap_kv_scale_name`` first (Llama's rules); a ``{k,v}_scale`` whose remapped name is not a parameter
  is skipped with a warning, but any other unknown name — ``{attn}.q_scale`` included, which
  ``maybe_remap_kv_scale_name`` leaves as is — reaches ``params_dict[name]`` and stops the load with a
  ``KeyError``. Neither SGLang's ``gemma3_causal.py`` nor ``gemma3_mm.py`` defines ``load_kv_cache_scales``, so
  ``--quantization-param-path`` is a startup ``RuntimeError`` (``model_runner_components/load_model_utils.py``
  ``load_kv_cache_scales``). Nothing Gemma-specific changes how a loaded scale is applied: both engines apply
  q/k-norm and then RoPE before the attention layer that quantizes the cache (post-norm, post-RoPE keys),
  sliding-window layers carry their own per-layer scale like global ones (SGLang's SWA pool passes
  ``k_scale``/``v_scale`` through, ``mem_cache/swa_memory_pool.py``), attention logit softcapping is off
  (vLLM passes ``attn_logits_soft_cap=None``, SGLang ``logit_cap=0.0``) and ``query_pre_attn_scalar**-0.5`` is
  the attention's softmax scale, not folded into the queries.
* **transformers + compressed-tensors** — ``from_pretrained`` loads a scale only under its exact
  parameter name ``{hf attention module}.{k,v}_scale`` (compressed-tensors attaches the parameters to
  the attention module; see :mod:`kvcal.export.hf_loader` for when it does at all). Anything else is an
  unexpected key.

``{attn}`` in vLLM/SGLang names is the layer's attention module in *their* model (``model.layers.{i}.self_attn``
for native families), and in checkpoint names the Hugging Face module path (:attr:`FamilyLayout.attention`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvcal.engines import engine as engine_facade

ENGINES = ("vLLM", "SGLang", "transformers")


@dataclass(frozen=True)
class FamilyLayout:
    """One model family's attention layout.

    ``model_type``: config.json ``model_type``; ``attention``: HF module path of layer ``{i}``'s
    attention; ``projections``: its K/V projection child names (``qkv_proj`` / ``query_key_value`` are
    fused); ``vllm_backend``: ``"native"`` (a vLLM model file) or ``"transformers"`` (vLLM's
    Transformers backend); ``base_model_prefix``: HF prefix vLLM's Transformers backend rewrites to
    ``model.``; ``sglang``: SGLang model file, or ``None`` when SGLang has none; ``sglang_remaps``:
    whether that file's default ``load_weights`` calls ``maybe_remap_kv_scale_name``; ``sglang_json``: whether
    its model class defines ``load_kv_cache_scales`` (without it ``--quantization-param-path`` stops SGLang at
    startup); ``sglang_unknown``: what its ``load_weights`` does with a name that is neither a parameter nor a
    remapped K/V scale (an exported ``q_scale``): ``"warns"`` (skipped with a log line), ``"raises"``
    (``KeyError``: the server does not start) or ``"unchecked"``.
    """

    model_type: str
    attention: str
    projections: tuple[str, ...]
    vllm_backend: str = "native"
    base_model_prefix: str = "model"
    sglang: str | None = None
    sglang_remaps: bool = False
    sglang_json: bool = False
    sglang_unknown: str = "unchecked"

    @property
    def compressed_tensors_attaches(self) -> bool:
        """Whether compressed-tensors can attach KV scales to this attention at all: it requires a
        ``k_proj``/``v_proj``/``qkv_proj``/``kv_b_proj`` child (``initialize.py: is_cached_attention_module``)."""
        return bool(set(self.projections) & {"k_proj", "v_proj", "qkv_proj", "kv_b_proj"})

    @property
    def fused(self) -> bool:
        """True when K and V come out of one fused QKV projection."""
        return len(self.projections) == 1

    def attn(self, layer: int) -> str:
        """HF attention module path of ``layer``, e.g. ``model.layers.3.self_attn``."""
        return self.attention.format(i=layer)

    def engine_attn(self, layer: int) -> str:
        """The attention module path in vLLM's / SGLang's model (base prefix normalised to ``model.``)."""
        a = self.attn(layer)
        if self.vllm_backend == "transformers" and self.base_model_prefix != "model":
            a = re.sub(rf"^{re.escape(self.base_model_prefix)}\.", "model.", a)
        return a


#: Families kvcal knows the loaders' layouts for (tiny configs of each are tested in tests/export/test_layouts.py).
FAMILIES: dict[str, FamilyLayout] = {f.model_type: f for f in (
    FamilyLayout("llama", "model.layers.{i}.self_attn", ("q_proj", "k_proj", "v_proj"),
                 sglang="llama.py", sglang_remaps=True, sglang_json=True, sglang_unknown="warns"),
    FamilyLayout("phi3", "model.layers.{i}.self_attn", ("qkv_proj",), sglang="llama.py", sglang_remaps=True,
                 sglang_json=True, sglang_unknown="warns"),
    FamilyLayout("gpt_neox", "gpt_neox.layers.{i}.attention", ("query_key_value",), vllm_backend="transformers",
                 base_model_prefix="gpt_neox"),
    FamilyLayout("qwen2", "model.layers.{i}.self_attn", ("q_proj", "k_proj", "v_proj"), sglang="qwen2.py",
                 sglang_json=True),
    # SGLang 0.5.23 mixtral.py / qwen3_moe.py define no load_kv_cache_scales: --quantization-param-path fails there
    FamilyLayout("mixtral", "model.layers.{i}.self_attn", ("q_proj", "k_proj", "v_proj"), sglang="mixtral.py"),
    FamilyLayout("qwen3_moe", "model.layers.{i}.self_attn", ("q_proj", "k_proj", "v_proj"), sglang="qwen3_moe.py"),
)}

#: Families whose tiny checkpoints are tested in their own files rather than in tests/export/test_layouts.py (its
#: per-family fixture builds a config for every entry of :data:`FAMILIES`): Gemma 3 in
#: tests/export/test_gemma3_export_names.py. :func:`family` looks in both.
OTHER_FAMILIES: dict[str, FamilyLayout] = {f.model_type: f for f in (
    # Gemma3ForCausalLM (vLLM 0.33.0 models/gemma3.py, SGLang 0.5.23 models/gemma3_causal.py; module docstring)
    FamilyLayout("gemma3_text", "model.layers.{i}.self_attn", ("q_proj", "k_proj", "v_proj"),
                 sglang="gemma3_causal.py", sglang_remaps=True, sglang_json=False, sglang_unknown="raises"),
)}

def family(model_type: str | None) -> FamilyLayout | None:
    """The :class:`FamilyLayout` of ``model_type``, or ``None`` for a family in neither :data:`FAMILIES` nor
    :data:`OTHER_FAMILIES`."""
    return FAMILIES.get(model_type or "") or OTHER_FAMILIES.get(model_type or "")


def checkpoint_names(fam: FamilyLayout, layer: int) -> dict[str, dict[str, str]]:
    """Every KV-scale naming layout for one layer of ``fam``: layout -> side -> checkpoint name.

    Layouts: ``compressed-tensors`` (``{attn}.{k,v}_scale``), ``modelopt`` (``{attn}.k_proj.k_scale``),
    ``fused`` (``{attn}.<fused projection>.{k,v}_scale``, fused families only) and ``legacy``
    (``{attn}.kv_scale``, side ``kv``)."""
    a = fam.attn(layer)
    out = {"compressed-tensors": {s: f"{a}.{s}_scale" for s in "kv"},
           "modelopt": {s: f"{a}.{s}_proj.{s}_scale" for s in "kv"},
           "legacy": {"kv": f"{a}.kv_scale"}}
    if fam.fused:
        out["fused"] = {s: f"{a}.{fam.projections[0]}.{s}_scale" for s in "kv"}
    return out


@dataclass(frozen=True)
class ParamLoad:
    """Where one engine puts one checkpoint tensor: ``param`` (its parameter name) and ``sides`` (``"k"``,
    ``"v"`` or ``"kv"`` for a legacy scale copied to both), or ``param=None`` and ``why`` when ignored."""

    engine: str
    name: str
    param: str | None
    sides: str = ""
    why: str = ""


_SIDE = re.compile(r"\.(k|v|kv)_scale$")
_LAYER = re.compile(r"\.(\d+)\.")

def _engine_params(fam: FamilyLayout, layer: int) -> dict[str, str]:
    a = fam.engine_attn(layer)
    return {f"{a}.attn.{s}_scale": s for s in "kv"}


def engine_param(engine: str, fam: FamilyLayout, name: str, hf_template: str | None = None) -> ParamLoad:
    """Replay ``engine``'s KV-scale renaming (module docstring) on checkpoint tensor ``name`` of a
    ``fam`` checkpoint. ``engine``: one of :data:`ENGINES`. ``hf_template``: for ``transformers``, the
    parameter template the installed compressed-tensors attaches (``...{i}...{side}_scale``, from
    :func:`kvcal.export.hf_loader.check_transformers_kv`); ``None`` uses ``{fam.attention}.{side}_scale``.
    Returns a :class:`ParamLoad`; raises ``ValueError`` for an unknown engine."""
    m = _SIDE.search(name)
    lm = _LAYER.search(name)
    if m is None or lm is None:
        return ParamLoad(engine, name, None, why="not a per-layer K/V scale name")
    side, layer = m.group(1), int(lm.group(1))
    sides = "kv" if side == "kv" else side
    if engine == "vLLM":
        key = name
        if fam.vllm_backend == "transformers" and fam.base_model_prefix != "model":
            key = re.sub(rf"^{re.escape(fam.base_model_prefix)}\.", "model.", key)
        for pat, rep in engine_facade("vllm").CACHE_SCALE_MAPPER:  # kvcal.engines.vllm.loader
            if pat.search(key):
                key = pat.sub(rep, key)
        params = _engine_params(fam, layer)
        if key in params:
            return ParamLoad(engine, name, key, sides)
        return ParamLoad(engine, name, None, why=f"renamed to {key}, which is not a parameter: dropped without error")
    if engine == "SGLang":
        if fam.sglang is None:
            return ParamLoad(engine, name, None, why=f"SGLang has no {fam.model_type} model file (unverified fallback)")
        params = _engine_params(fam, layer)
        key = name
        if fam.sglang_remaps:
            if key.endswith(".kv_scale"):
                key = key.replace(".kv_scale", ".attn.k_scale")
            elif f".self_attn.{side}_proj.{side}_scale" in key:
                key = key.replace(f".self_attn.{side}_proj.{side}_scale", f".self_attn.attn.{side}_scale")
            else:
                key = key.replace(f".{side}_scale", f".attn.{side}_scale")
        else:
            for proj in ("q_proj", "k_proj", "v_proj"):  # the stacked-parameter mapping runs on every name
                if f".{proj}" in key:
                    key = key.replace(f".{proj}", ".qkv_proj")
                    break
        if key in params:
            return ParamLoad(engine, name, key, sides)
        where = "" if fam.sglang_remaps else f" ({fam.sglang} load_weights does not remap KV-scale names)"
        return ParamLoad(engine, name, None, why=f"looked up as {key}, not a parameter{where}: not loaded")
    if engine == "transformers":
        if not fam.compressed_tensors_attaches:
            return ParamLoad(engine, name, None, why=f"compressed-tensors attaches no KV scales to an attention with "
                                                     f"{'/'.join(fam.projections)} (any version): unexpected key")
        tmpl = hf_template or f"{fam.attention}.{{side}}_scale"
        want = {tmpl.format(i=layer, side=s): s for s in "kv"}
        if name in want:
            return ParamLoad(engine, name, name, sides)
        return ParamLoad(engine, name, None, why="not a parameter name: an unexpected key, ignored")
    raise ValueError(f"unknown engine {engine!r}; one of {ENGINES}")


def to_canonical(fam: FamilyLayout, engine: str, tensors: dict, hf_template: str | None = None) -> dict:
    """``tensors`` (checkpoint name -> tensor) as ``engine`` loads them for ``fam``, renamed to the
    Llama-style names :mod:`kvcal.export.rules` simulates (``model.layers.{i}.self_attn.{k,v}_scale``, or
    ``...kv_scale`` for a legacy scale); tensors the engine ignores are left out."""
    out = {}
    for name, t in tensors.items():
        p = engine_param(engine, fam, name, hf_template)
        if p.param is None:
            continue
        layer = int(_LAYER.search(name).group(1))
        out[f"model.layers.{layer}.self_attn.{p.sides}_scale"] = t
    return out
