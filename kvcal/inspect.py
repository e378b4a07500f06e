"""``kvcal inspect``: what an artifact, an exported directory or a checkpoint holds, and what each
engine would load from it under its naming rules (:mod:`kvcal.export.rules`).

Recognised inputs (:func:`inspect_path`):

* a kvcal artifact directory (``kv_scales.safetensors``) or that file;
* a Hugging Face checkpoint directory (``config.json`` + safetensors, e.g. ``kvcal export --model-dir``);
* a standalone export directory (``kvcal-kv-scales.safetensors`` / ``kv_cache_scales.safetensors``);
* an SGLang ``--quantization-param-path`` JSON file, or a directory holding ``kv_cache_scales.json``.

Per-layer scales are the stored dequantization multipliers (float lists: one value per-tensor,
``H_kv`` per-head) as the engine reads them, before any engine-side FNUZ doubling.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvcal.engines import engine
from kvcal.errors import KvcalError
from kvcal.export.hf_loader import check_transformers_kv
from kvcal.export.layouts import FAMILIES, family, to_canonical
from kvcal.export.rules import EngineLoad, LayerLoad, is_kv_scale_name, remap_kv_scale_name

JSON_NAME = "kv_cache_scales.json"


class InspectError(KvcalError):
    """A path ``kvcal inspect`` cannot read."""


@dataclass
class Inspection:
    """Result of :func:`inspect_path`.

    ``kind``: ``artifact`` | ``checkpoint`` | ``standalone`` | ``sglang-json``; ``layers``: one dict
    per layer ``{"layer": i, "k": [float] | None, "v": [float] | None, "q": [float] | None}`` (``q``: vLLM's
    FP8 query scale where one is stored; ``k`` and ``v`` are the
    same list where one value is shared, e.g. the JSON); ``engines``: engine name ->
    :class:`~kvcal.export.rules.EngineLoad`; ``exportable`` (artifacts): target -> ``None`` if it
    can load the artifact, else the reason; ``corpus``: the artifact's corpus summary. Checkpoints also
    get ``warnings`` (silent drops: the installed transformers + compressed-tensors ignoring the KV scheme,
    a declared scheme with a scale missing), ``family`` (:class:`~kvcal.export.layouts.FamilyLayout` of a
    known ``model_type``) and ``params`` (per layer ``{"layer": i, "tensors": [{"name": checkpoint name,
    "vLLM" | "SGLang" | "transformers": ParamLoad}]}``: the parameter each loader fills with each tensor).
    """

    path: Path
    kind: str
    num_layers: int
    format: str | None = None
    granularity: str | None = None
    layers: list[dict] = field(default_factory=list)
    engines: dict[str, EngineLoad] = field(default_factory=dict)
    exportable: dict[str, str | None] = field(default_factory=dict)
    corpus: dict | None = None
    model: dict | None = None
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # silent drops: printed as "warning:" lines
    family: object = None  # kvcal.export.layouts.FamilyLayout of a checkpoint of a known family
    params: list[dict] = field(default_factory=list)  # per layer: tensor -> parameter each engine loads it into


def _read_json(p: Path) -> dict:
    """The JSON object in ``p``; :class:`InspectError` when unreadable or not an object (every JSON
    file kvcal inspect reads — scales JSON, config, index, manifest — is an object)."""
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InspectError(f"{p} is not readable JSON ({e})") from None
    if not isinstance(doc, dict):
        kind = {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(doc), "null")
        raise InspectError(f"{p} holds a JSON {kind}, not an object; kvcal inspect reads JSON objects (a "
                           "--quantization-param-path file is {\"kv_cache\": {\"scaling_factor\": ...}})")
    return doc


def _kv_tensors(files: list[Path], where: dict | None = None) -> dict:
    """Load only the KV-scale-like tensors (and q scales) from safetensors ``files``; ``where``, when given, is
    filled with tensor name -> the file holding it."""
    from safetensors import safe_open

    from kvcal.export.checkpoint import read_header

    out = {}
    for f in files:
        header, _ = read_header(f)
        names = [n for n in header if n != "__metadata__" and (is_kv_scale_name(n) or remap_kv_scale_name(n)
                                                               or n.endswith((".k_scale", ".v_scale", ".kv_scale", ".q_scale")))]
        if not names:
            continue
        with safe_open(str(f), framework="pt") as fh:
            for n in names:
                out[n] = fh.get_tensor(n)
                if where is not None:
                    where[n] = f
    return out


def _bad_scale_warnings(tensors: dict, where: dict) -> list[str]:
    """One warning per scale tensor of ``tensors`` (name -> tensor; ``where``: name -> file) holding a zero,
    negative, NaN or infinite value: engines load such a scale without error (``kvcal evaluate --artifact`` of an
    export refuses it, :func:`kvcal.artifact.deployed.read_scales`)."""
    out = []
    for name, t in sorted(tensors.items()):
        v = t.float().flatten()
        bad = ~torch.isfinite(v) | (v <= 0)
        if bool(bad.any()):
            out.append(f"{where.get(name, '?')}: tensor {name} holds {v[bad][:3].tolist()} ({int(bad.sum())} of "
                       f"{v.numel()} values), not finite and > 0: engines load it without error and quantize that "
                       "layer's cache to NaN, Inf or zeros (kvcal evaluate refuses it) — re-export")
    return out


def _bad_json_warnings(f: Path, doc: dict) -> list[str]:
    """A warning naming the entries of an SGLang scales JSON ``f`` (parsed ``doc``) that are not finite and > 0."""
    import math

    sf = (doc.get("kv_cache") or {}).get("scaling_factor") or {}
    bad = [f"[{r!r}][{i!r}] = {v!r}" for r, layers in sf.items() if isinstance(layers, dict)
           for i, v in layers.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
           and not (math.isfinite(v) and v > 0)]
    if not bad:
        return []
    return [f"{f}: kv_cache.scaling_factor{', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''} ({len(bad)} "
            "entries) not finite and > 0: a zero, negative, NaN or infinite scale turns that layer's cache into NaN, "
            "Inf or zeros (kvcal evaluate refuses it) — re-export"]


def _stored_layers(tensors: dict, n: int) -> list[dict]:
    """Per-layer K/V values stored under any engine-recognised name (vLLM names first, then the
    legacy TensorRT-LLM shared factor)."""
    legacy = engine("trtllm").LEGACY_SCALE_NAME  # TensorRT-LLM's kv_cache_scaling_factor
    rows = [{"layer": i, "k": None, "v": None, "q": None} for i in range(n)]
    for name, t in sorted(tensors.items()):
        vals = [float(x) for x in t.float().flatten().tolist()]
        r = remap_kv_scale_name(name)
        if r is not None and r.layer < n and r.param == "q_scale":  # vLLM's FP8 query scale
            rows[r.layer]["q"] = vals
        elif r is not None and r.layer < n and r.param in ("k_scale", "v_scale"):
            rows[r.layer][r.param[0]] = vals[:1] if r.rule == "output_scale" else vals
            if r.rule == "kv_scale":
                rows[r.layer]["v"] = vals
        elif (m := legacy.match(name)) and int(m.group(1)) < n:
            rows[int(m.group(1))]["k"] = rows[int(m.group(1))]["v"] = vals
    return rows


def _num_layers_from_names(tensors: dict) -> int:
    import re

    idx = [int(m.group(1)) for n in tensors if (m := re.search(r"layers\.(\d+)\.", n))]
    return max(idx) + 1 if idx else 0


def _granularity(rows: list[dict]) -> str | None:
    sizes = {len(r[s]) for r in rows for s in ("k", "v") if r[s]}
    if not sizes:
        return None
    return "tensor" if sizes == {1} else "head"


def _fmt_from_configs(qc: dict | None, hq: dict | None) -> str | None:
    scheme = (qc or {}).get("kv_cache_scheme")
    if scheme:
        t = "fp8_e4m3" if (scheme.get("type"), scheme.get("num_bits")) == ("float", 8) else (
            f"{scheme.get('type')}{scheme.get('num_bits')}")
        kind = "dynamic" if scheme.get("dynamic") else "static"
        return f"{t} ({kind}, kv_cache_scheme strategy={scheme.get('strategy')})"
    algo = ((hq or {}).get("quantization") or {}).get("kv_cache_quant_algo")
    return f"{algo} (hf_quant_config.json)" if algo else None


def _refuse_recommend_output(p: Path) -> None:
    """A ``kvcal recommend`` output directory (or its ``deploy.json``) holds no scales itself: raise
    :class:`InspectError` naming the calibrated artifact it keeps (``deploy.json``'s ``artifact``), or saying that
    the chosen configuration keeps none (vLLM's default or write-time scales). Returns for any other path."""
    doc_path = p / "deploy.json" if p.is_dir() else p
    if doc_path.name != "deploy.json" or not doc_path.is_file():
        return
    try:
        doc = json.loads(doc_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return
    if not isinstance(doc, dict) or not str(doc.get("schema", "")).startswith("kvcal-recommend/"):
        return
    out = doc_path.parent
    kept = doc.get("artifact")
    what = (f"inspect the calibrated artifact it keeps: kvcal inspect {out / kept}" if isinstance(kept, str) and kept
            else "the chosen configuration keeps no calibrated artifact (vLLM's default or write-time scales: "
                 "deploy.md's vllm serve line is the whole deployment)")
    raise InspectError(f"{p} is a kvcal recommend output (deploy.md, deploy.json), not scales; {what}")


def inspect_path(path: str | os.PathLike, tp: int | None = None) -> Inspection:
    """Inspect ``path`` (see module docstring). ``tp``: TP size the SGLang JSON is checked against
    (default: the number of ranks in the file). Raises :class:`InspectError` for an unknown path."""
    p = Path(path)
    if not p.exists():
        raise InspectError(f"{p} does not exist")
    _refuse_recommend_output(p)
    if p.is_file() and p.suffix == ".json":
        return _inspect_json(p, tp)
    if (p.is_dir() and (p / "kv_scales.safetensors").is_file()) or (p.is_file() and p.suffix == ".safetensors"
                                                                    and _has_kvcal_meta(p)):
        return _inspect_artifact(p)
    if p.is_dir() and (p / "config.json").is_file():
        return _inspect_checkpoint(p, tp)
    if p.is_dir() and list(p.glob("*.safetensors")):
        return _inspect_standalone(p)
    if p.is_dir() and (p / JSON_NAME).is_file():
        return _inspect_json(p / JSON_NAME, tp)
    raise InspectError(f"{p} is not a kvcal artifact, an exported directory, a checkpoint or a scales JSON")


def _has_kvcal_meta(f: Path) -> bool:
    from kvcal.export.checkpoint import read_header

    try:
        header, _ = read_header(f)
    except KvcalError:
        return False
    return "kvcal" in (header.get("__metadata__") or {})


def _inspect_artifact(p: Path) -> Inspection:
    from kvcal.artifact import load_artifact
    from kvcal.artifact.sections import engine_section
    from kvcal.export import target_names
    from kvcal.export.base import get_target

    art = load_artifact(p)
    meta = art.metadata
    n = art.num_layers
    sec = engine_section(meta)
    nvfp4 = sec.nvfp4_dtype if sec else None  # calibrate --engine vllm --kv-cache-dtype nvfp4: per-layer outer scales
    kv = meta["kv"]
    k = kv.get("k") or {}
    ins = Inspection(art.path, "artifact", n, k.get("format"), k.get("granularity"),
                     corpus=meta.get("corpus"), model=meta.get("model"))
    for i in range(n):
        row = {"layer": i}
        for side in ("k", "v"):
            t = art.scale(i, side) if not nvfp4 else art.tensors.get(f"model.layers.{i}.self_attn.{side}_outer_scale")
            row[side] = [float(x) for x in t.flatten().tolist()] if t is not None else None
        q = art.tensors.get(f"model.layers.{i}.self_attn.q_scale")  # vLLM's FP8 query scale (calibrate --engine vllm)
        row["q"] = [float(x) for x in q.flatten().tolist()] if q is not None else None
        ins.layers.append(row)
    if sec:
        ins.notes.append(f"calibrated for {sec.engine} --kv-cache-dtype {sec.kv_cache_dtype}, backend "
                         f"{sec.backend} (FP8 write: {sec.fp8_write}): "
                         f"query quantization {sec.query_quantization}; skipped layers "
                         f"{list(sec.skip_layers) or 'none'}")
    nkv = meta["model"].get("num_kv_heads")
    qc = engine("vllm").kv_only_quantization_config(k.get("granularity", "tensor"))
    scales = {name: t for name, t in art.tensors.items() if name.endswith(("k_scale", "v_scale"))}
    if nvfp4:
        scales = {f"model.layers.{i}.self_attn.{s}_scale": art.tensors[f"model.layers.{i}.self_attn.{s}_outer_scale"]
                  for i in range(n) for s in ("k", "v")}
        ins.notes.append(f"K/V scale columns: the NVFP4 outer scales (vLLM --kv-cache-dtype {nvfp4} reads them as each "
                         "layer's k_scale/v_scale, per tensor; export --target vllm writes them so); Q scale: FP8 "
                         "query scale (used on SM100 FlashInfer trtllm-gen only). SGLang and TensorRT-LLM rows "
                         "omitted: they load no NVFP4 KV outer scales from these names")
        ins.engines["vLLM"] = engine("vllm").simulate(scales, n, nkv, qc)
    else:
        ins.engines["vLLM"] = engine("vllm").simulate(scales, n, nkv, qc)
        ins.engines["SGLang"] = engine("sglang").simulate(scales, n, nkv, qc)
        ins.engines["TensorRT-LLM"] = engine("trtllm").simulate(scales, n)
    ins.notes.append("engine rows: the artifact's names as if copied into a checkpoint with a compressed-tensors "
                     "kv_cache_scheme; use `kvcal export` to produce what each engine loads")
    from kvcal.artifact import CONTENT_HASH_KEY

    ins.notes.append(f"content hash verified ({CONTENT_HASH_KEY} {meta[CONTENT_HASH_KEY][:16]}…)"
                     if meta.get(CONTENT_HASH_KEY) else
                     f"no {CONTENT_HASH_KEY}: written before kvcal recorded one, so a hand edit that keeps every "
                     "field and scale plausible cannot be detected; re-calibrate to get a verifiable artifact")
    for name in target_names():
        ins.exportable[name] = get_target(name).can_load(meta)
    return ins


def _inspect_checkpoint(p: Path, tp: int | None) -> Inspection:
    from kvcal.export.checkpoint import INDEX, text_config
    from kvcal.export.checkpoint_json import read_config, read_hf_quant_config, read_index

    cfg = read_config(p / "config.json", InspectError)  # field types checked: one-line errors, no traceback
    tc = text_config(cfg)
    n = int(tc.get("num_hidden_layers", 0))
    nkv = tc.get("num_key_value_heads", tc.get("num_attention_heads"))
    if (p / INDEX).is_file():
        files = [p / f for f in sorted(set(read_index(p / INDEX, InspectError)["weight_map"].values()))]
    else:
        files = sorted(p.glob("*.safetensors"))
    where: dict = {}
    tensors = _kv_tensors(files, where)
    qc = cfg.get("quantization_config")
    hq = (read_hf_quant_config(p / "hf_quant_config.json", InspectError) if (p / "hf_quant_config.json").is_file()
          else None)
    ins = Inspection(p, "checkpoint", n, _fmt_from_configs(qc, hq), model={"model_type": tc.get("model_type")})
    fam = family(tc.get("model_type"))
    ins.layers = _stored_layers(_any_layout(fam, tensors) if fam else tensors, n)
    ins.granularity = _granularity(ins.layers)
    ins.warnings += _bad_scale_warnings(tensors, where)
    hf = check_transformers_kv(cfg)
    if fam is None:
        ins.engines["vLLM"] = engine("vllm").simulate(tensors, n, nkv, qc)
        ins.engines["SGLang"] = engine("sglang").simulate(tensors, n, nkv, qc)
        if tensors:
            ins.notes.append(f"model_type {tc.get('model_type')!r} is not in kvcal's layout table "
                             f"({', '.join(FAMILIES)}): engine rows use the Llama naming rules")
    else:  # each engine sees only the names its loader maps for this family (kvcal.export.layouts)
        ins.engines["vLLM"] = engine("vllm").simulate(to_canonical(fam, "vLLM", tensors), n, nkv, qc)
        ins.engines["SGLang"] = engine("sglang").simulate(to_canonical(fam, "SGLang", tensors), n, nkv, qc)
        qs = sorted(t for t in tensors if t.endswith(".q_scale"))
        if qs and fam.sglang_unknown == "raises":  # kvcal.export.layouts: its load_weights indexes params_dict[name]
            ins.engines["SGLang"].problems.append(
                f"{len(qs)} q_scale tensor(s) (e.g. {qs[0]}): SGLang's {fam.sglang} load_weights has no such "
                "parameter and stops the load with a KeyError, so the server does not start; serve this checkpoint "
                "in vLLM, or export for SGLang from an artifact without query scales (calibrate without --engine vllm)")
            ins.engines["SGLang"].layers = []
        tmpl = hf.param_template if hf is not None else None
        ins.params = _param_rows(fam, tensors, n, tmpl)
        ins.family = fam
    ins.engines["TensorRT-LLM"] = engine("trtllm").simulate(tensors, n, hq)
    if hf is not None:
        ins.engines["transformers + compressed-tensors"] = _transformers_load(hf, fam, tensors, n)
        if hf.warning():
            ins.warnings.append(hf.warning())
    if isinstance(qc, dict) and qc.get("kv_cache_scheme"):
        where, rows = "", ins.layers
        if fam is not None and fam.compressed_tensors_attaches:  # judged by the names compressed-tensors loads
            tmpl = (hf.param_template if hf is not None and hf.param_template else f"{fam.attention}.{{side}}_scale")
            rows = _stored_layers(to_canonical(fam, "transformers", tensors, tmpl), n)
            where = f" under the names compressed-tensors loads ({tmpl.replace('{side}', '{k,v}')})"
        lacking = [r["layer"] for r in rows if r["k"] is None or r["v"] is None]
        if lacking:
            ins.warnings.append(
                f"config.json declares a kv_cache_scheme but layers {_ranges(lacking)} lack a K or V scale{where}: "
                "transformers + compressed-tensors loads such a checkpoint without error and leaves the missing scale "
                "as allocated (0.0 or garbage, finite and wrong), vLLM/SGLang use 1.0; re-export with "
                "`kvcal export --target vllm --model-dir`")
    if (p / JSON_NAME).is_file():
        doc = _read_json(p / JSON_NAME)
        ranks = len((doc.get("kv_cache") or {}).get("scaling_factor") or {})
        ins.engines["SGLang (--quantization-param-path)"] = engine("sglang").simulate_json(
            doc, n, tp or ranks, tc.get("model_type"))
        ins.warnings += _bad_json_warnings(p / JSON_NAME, doc)
    _add_manifest_notes(p, ins)
    ins.notes = [x for x in ins.notes if x.removeprefix("export warning: ") not in ins.warnings]  # said once
    return ins


def _any_layout(fam, tensors: dict) -> dict:
    """Every per-layer K/V scale of ``tensors`` under any layout of ``fam``, renamed to the Llama-style
    name :func:`_stored_layers` reads (what the checkpoint *holds*, whoever loads it)."""
    import re

    out = {}
    for name, t in tensors.items():
        m = re.search(r"\.(\d+)\..*\.(k|v|kv|q)_scale$", name)
        if m and name.startswith(fam.attention.split("{i}")[0]):
            out[f"model.layers.{m.group(1)}.self_attn.{m.group(2)}_scale"] = t
    return out


def _param_rows(fam, tensors: dict, n: int, hf_template: str | None) -> list[dict]:
    """Per layer: ``{"layer": i, "tensors": [{"name": checkpoint name, "vLLM": ParamLoad, "SGLang": ...,
    "transformers": ...}]}`` for every K/V scale tensor of the layer (:func:`kvcal.export.layouts.engine_param`)."""
    import re

    from kvcal.export.layouts import ENGINES, engine_param

    rows = [{"layer": i, "tensors": []} for i in range(n)]
    for name in sorted(tensors):
        m = re.search(r"\.(\d+)\.", name)
        if not m or int(m.group(1)) >= n or not name.endswith(("k_scale", "v_scale", "kv_scale")):
            continue
        rows[int(m.group(1))]["tensors"].append(
            {"name": name, **{e: engine_param(e, fam, name, hf_template) for e in ENGINES}})
    return rows


def _transformers_load(hf, fam, tensors: dict, n: int) -> EngineLoad:
    """What ``AutoModelForCausalLM.from_pretrained`` with the installed compressed-tensors does per layer."""
    from kvcal.export.layouts import to_canonical

    rep = EngineLoad(f"transformers + compressed-tensors ({hf.versions.replace(' + compressed-tensors', ',')})")
    if not hf.applies:
        rep.problems.append(hf.reason + ("" if hf.silent else " (loading fails)"))
        for i in range(n):
            rep.layers.append(LayerLoad(i, None, None, "ignored", "scales not applied"))
        return rep
    got = to_canonical(fam, "transformers", tensors, hf.param_template) if fam else {
        k: v for k, v in tensors.items() if k.endswith(("k_scale", "v_scale"))}
    for i in range(n):
        k, v = (got.get(f"model.layers.{i}.self_attn.{s}_scale") for s in "kv")
        vals = {s: [float(x) for x in t.float().flatten().tolist()] if t is not None else None
                for s, t in (("k", k), ("v", v))}
        if k is not None and v is not None:
            rep.layers.append(LayerLoad(i, vals["k"], vals["v"], "loaded"))
        else:
            rep.layers.append(LayerLoad(i, vals["k"], vals["v"], "uninitialized",
                                        "scale missing under the parameter name: left as allocated, no error"))
    return rep


def _inspect_standalone(p: Path) -> Inspection:
    from kvcal.export.checkpoint_json import read_hf_quant_config, read_quantization_config_json

    files = sorted(p.glob("*.safetensors"))
    where: dict = {}
    tensors = _kv_tensors(files, where)
    n = _num_layers_from_names(tensors)
    qc = None
    if (p / "quantization_config.json").is_file():
        qc = read_quantization_config_json(p / "quantization_config.json", InspectError)
    hq = (read_hf_quant_config(p / "hf_quant_config.json", InspectError) if (p / "hf_quant_config.json").is_file()
          else None)
    fmt = _fmt_from_configs(qc, hq)
    if fmt is None and (p / "quantization.json").is_file():  # trtllm-legacy's snippet for the checkpoint config
        algo = ((_read_json(p / "quantization.json").get("quantization") or {}).get("kv_cache_quant_algo"))
        fmt = f"{algo} (quantization.json)" if algo else None
    ins = Inspection(p, "standalone", n, fmt)
    ins.warnings += _bad_scale_warnings(tensors, where)
    ins.layers = _stored_layers(tensors, n)
    ins.granularity = _granularity(ins.layers)
    nkv = len(ins.layers[0]["k"]) if ins.layers and ins.layers[0]["k"] else None
    ins.engines["vLLM"] = engine("vllm").simulate(tensors, n, nkv, qc)
    ins.engines["SGLang"] = engine("sglang").simulate(tensors, n, nkv, qc)
    ins.engines["TensorRT-LLM"] = engine("trtllm").simulate(tensors, n, hq)
    if qc is None:  # there is no config.json here at all: say that, not that its quantization_config is missing
        trt = any(n.startswith("transformer.layers.") for n in tensors)
        why = ("these are TensorRT-LLM names (transformer.layers.*), which vLLM and SGLang never load" if trt else
               "no config.json here (standalone tensors): vLLM and SGLang read KV scales only from a checkpoint "
               "whose config.json has a KV quantization_config (export --target vllm or modelopt with --model-dir)")
        for name in ("vLLM", "SGLang"):
            ins.engines[name].problems = [why if pr.startswith("config.json has no quantization_config") else pr
                                          for pr in ins.engines[name].problems]
    ins.notes.append("standalone tensors: layer count inferred from the names; engines see them once merged "
                     "into a checkpoint (kvcal export --model-dir)")
    _add_manifest_notes(p, ins)
    return ins


def _inspect_json(f: Path, tp: int | None) -> Inspection:
    doc = _read_json(f)
    kv = doc.get("kv_cache")
    if not isinstance(kv, dict) or not isinstance(kv.get("scaling_factor"), dict):
        raise InspectError(f"{f} is not a --quantization-param-path JSON (no kv_cache.scaling_factor)")
    sf = kv["scaling_factor"]
    for r, layers in sf.items():  # what SGLang's schema would refuse, named instead of a traceback
        if not isinstance(layers, dict):
            raise InspectError(f"{f}: kv_cache.scaling_factor[{r!r}] must map layer index -> scale, "
                               f"got {type(layers).__name__}")
        for i, v in layers.items():
            if not (isinstance(i, str) and i.isdigit()):
                raise InspectError(f"{f}: kv_cache.scaling_factor[{r!r}] has the key {i!r}, not a layer index "
                                   "(\"0\", \"1\", ...)")
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise InspectError(f"{f}: kv_cache.scaling_factor[{r!r}][{i!r}] = {v!r} is not a number")
    rank0 = sf.get("0") or next(iter(sf.values()), {})
    # layers: the highest index any rank lists, or the model's count where the export's source artifact gives it
    # (a layer removed from every rank, the last one included, is then reported, not a silently smaller count)
    n = max((int(i) + 1 for layers in sf.values() for i in layers), default=0)
    src = None
    from kvcal.export.base import MANIFEST

    if (f.parent / MANIFEST).is_file():
        art, _ = _source_artifact(f.parent, _read_json(f.parent / MANIFEST))
        src = art.num_layers if art is not None else None
        n = max(n, src or 0)
    ins = Inspection(f, "sglang-json", n, kv.get("dtype"), "tensor", model={"model_type": doc.get("model_type")})
    for r, layers in sf.items():
        lacking = [i for i in range(n) if str(i) not in layers]
        if lacking:
            ins.warnings.append(
                f"{f}: rank {r!r} has no scale for layer(s) {_ranges(lacking)} of {n} ("
                + (f"the model of the artifact it was exported from has {src}" if src else
                   "the highest layer index any rank lists") + "): SGLang refuses the file at startup — re-export")
    for i in range(n):
        v = rank0.get(str(i))
        vals = [float(v)] if v is not None else None
        ins.layers.append({"layer": i, "k": vals, "v": vals})
    ins.engines["SGLang"] = engine("sglang").simulate_json(doc, n, tp or len(sf), doc.get("model_type"))
    ins.warnings += _bad_json_warnings(f, doc)
    vl = EngineLoad("vLLM", problems=["--quantization-param-path was removed in vLLM 0.8: nothing loads, 1.0 is used"])
    ins.engines["vLLM"] = vl
    ins.notes.append(f"{len(sf)} TP rank(s) in the file; one scale per layer shared by K and V")
    _add_manifest_notes(f.parent, ins)
    return ins


def _add_manifest_notes(d: Path, ins: Inspection) -> None:
    from kvcal.export.base import MANIFEST

    if (d / MANIFEST).is_file():
        m = _read_json(d / MANIFEST)
        ins.notes.append(f"exported by kvcal {m.get('kvcal_version')} for target {m.get('target')} from "
                         f"{m.get('source_format')} per-{m.get('granularity')} artifact {m.get('artifact')}")
        ins.notes += [f"export warning: {w}" for w in m.get("warnings", [])]
        _nan_risk_from_files(d, m, ins)
        skip = m.get("kv_cache_dtype_skip_layers")
        if isinstance(skip, list) and skip:  # recorded by export --target vllm from the artifact's vllm.skip_layers
            ins.notes.append(f"serve with --kv-cache-dtype {m.get('kv_cache_dtype')} --kv-cache-dtype-skip-layers "
                             f"{' '.join(map(str, skip))}: the artifact keeps these layers in the model dtype (their "
                             "scales are written but vLLM does not use them)")
        if m.get("source_format") == "nvfp4":  # calibrate --engine vllm --kv-cache-dtype nvfp4
            ins.notes.append("the K/V scales are NVFP4 outer scales for vLLM --kv-cache-dtype nvfp4 (about observed "
                             "max / 2688); an engine row above that loads them as FP8 scales (SGLang, vLLM without "
                             "the flag) would saturate or overflow at 448 x them")


def _source_artifact(d: Path, m: dict):
    """The artifact the export in ``d`` (manifest ``m``) was written from, as :func:`kvcal.artifact.load_artifact`
    loads it and unchanged since (the manifest's ``artifact_sha256``): ``(Artifact, None)``, or ``(None, reason)``."""
    from kvcal.artifact import artifact_sha256, load_artifact
    from kvcal.export.base import MANIFEST

    src = m.get("artifact_path") or m.get("artifact")
    if not isinstance(src, str) or (not m.get("artifact_path") and not Path(src).is_absolute()):
        return None, f"{d / MANIFEST} records no absolute path of the artifact it was exported from"
    if not (Path(src) / "kv_scales.safetensors").is_file():
        return None, f"the artifact it was exported from, {src}, is gone"
    try:
        art = load_artifact(src)
        if m.get("artifact_sha256") and artifact_sha256(src) != m["artifact_sha256"]:
            return None, f"the artifact at {src} changed after the export (its sha256 differs from the manifest's)"
    except KvcalError as e:
        return None, str(e)
    return art, None


def _nan_risk_from_files(d: Path, m: dict, ins: Inspection) -> None:
    """Which exported K/V scales clip values the calibration observed, recomputed as :func:`kvcal.export.export`
    computes ``nan_risk`` — ``observed amax / (scale x 448) > 1`` (:data:`kvcal.export.base.CLIP_RTOL`), the amax
    from the source artifact's ``layers[i].{k,v}.amax`` — but from the scales in the exported files (``ins.layers``;
    ``kv_cache_scales.json`` for an sglang-json export), never from the manifest. Adds the line to the row of the
    engine that casts without saturating (SGLang), or a note when it cannot be recomputed."""
    from kvcal.export.base import CLIP_RTOL, FP8_E4M3_MAX, MANIFEST, ExportError, get_target

    try:
        t = get_target(str(m.get("target")))
    except ExportError:
        ins.warnings.append(f"{d / MANIFEST}: target {m.get('target')!r} is not one kvcal exports; re-export")
        return
    engines = t.non_saturating if m.get("granularity") == "tensor" and m.get("source_format") != "nvfp4" else ()
    if not engines:
        return
    rows = ins.layers
    if t.name == "sglang-json" and (d / JSON_NAME).is_file():  # the JSON, also beside a linked checkpoint
        rank0 = ((_read_json(d / JSON_NAME).get("kv_cache") or {}).get("scaling_factor") or {}).get("0") or {}
        rows = [{"layer": i, "k": [float(v)], "v": [float(v)]} for i in range(ins.num_layers)
                if isinstance(v := rank0.get(str(i)), (int, float)) and not isinstance(v, bool)]
    art, why = _source_artifact(d, m)
    if art is None:
        ins.notes.append(f"NaN risk in {'/'.join(engines)} not checked: {why} (its recorded observed amax is what "
                         "the scales are checked against); re-export from the artifact to check it")
        return
    stats = {e.get("layer"): e for e in art.metadata.get("layers") or [] if isinstance(e, dict)}
    clipped: dict[str, float] = {}
    checked = 0
    for r in rows:
        for side in ("k", "v"):
            amax = (stats.get(r["layer"], {}).get(side) or {}).get("amax")
            if not r.get(side) or not amax:
                continue
            sc, a = torch.tensor(r[side], dtype=torch.float32), torch.tensor(amax, dtype=torch.float32).flatten()
            if not bool((torch.isfinite(sc) & (sc > 0)).all()):
                continue  # a bad scale: its own warning (_bad_scale_warnings)
            a = a if a.numel() == sc.numel() else a.max()
            checked += 1
            ratio = float((a / (sc * FP8_E4M3_MAX)).max())
            if ratio > 1.0 + CLIP_RTOL:
                clipped[f"{side.upper()}{r['layer']}"] = ratio
    if not checked:
        ins.notes.append(f"NaN risk in {'/'.join(engines)} not checked: {art.path} records no observed amax for "
                         "the exported scales")
        return
    sides = sorted(clipped, key=lambda x: (int(x[1:]), x[0]))
    if not sides:
        return
    line = (f"{len(sides)} K/V scales clip values the calibration observed ({', '.join(sides[:6])}"
            f"{', ...' if len(sides) > 6 else ''}; up to {max(clipped.values()):.4g}x, recomputed from the files): "
            f"{'/'.join(engines)} casts to FP8 without saturating and turns those values into NaN — export with "
            "--clip-free for SGLang")
    names = [f"{e} (--quantization-param-path)" for e in engines] if t.name == "sglang-json" else []
    for name in [*names, *engines]:
        if name in ins.engines:
            ins.engines[name].notes.append(line)  # loaded, but NaN where the scales clip
            break
    else:
        ins.notes.append(line)


# ---- text ---------------------------------------------------------------------------------------


def _fmt_vals(vals: list[float] | None, granularity: str | None) -> str:
    if not vals:
        return "-"
    if len(vals) == 1:
        return f"{vals[0]:.6g}"
    unit = {"head": "heads", "channel": "head x channel"}.get(granularity or "", "values")
    return f"[{len(vals)} {unit}] {min(vals):.4g}..{max(vals):.4g}"


def _engine_line(e: EngineLoad, n: int) -> list[str]:
    lines = []
    loaded = e.count("loaded")
    if e.problems:
        head = f"  {e.engine}: NOT LOADED"
    elif loaded == n and n:
        head = f"  {e.engine}: loads K and V scales for all {n} layers"
    else:
        parts = [f"{loaded}/{n} layers loaded"]
        for st, label in (("copied", "one scale copied to both"), ("fallback", "fall back to 1.0"),
                          ("missing", "have no scale"), ("error", "startup error"),
                          ("uninitialized", "scale missing, left uninitialized (0.0 or garbage)")):
            c = e.count(st)
            if c:
                layers = [x.layer for x in e.layers if x.status == st]
                parts.append(f"{c} {label} (layers {_ranges(layers)})")
        head = f"  {e.engine}: " + ", ".join(parts)
    lines.append(head)
    lines += [f"      {m}" for m in e.problems + e.notes]
    msgs = sorted({x.message for x in e.layers if x.status == "error" and x.message})
    lines += [f"      {m}" for m in msgs[:3]]
    return lines


def _ranges(xs: list[int]) -> str:
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)


def render(ins: Inspection) -> str:
    """Human-readable report of an :class:`Inspection` (what ``kvcal inspect`` prints)."""
    L = [f"{ins.path} ({ins.kind})"]
    mt = (ins.model or {}).get("id") or (ins.model or {}).get("model_type")
    L.append(f"format: {ins.format or 'unknown'}   granularity: {ins.granularity or 'unknown'}   "
             f"layers: {ins.num_layers}" + (f"   model: {mt}" if mt else ""))
    if ins.corpus:
        c = ins.corpus
        pct = c.get("length_percentiles") or {}
        L.append(f"corpus: {c.get('path')}  samples={c.get('samples')} tokens={c.get('tokens')} "
                 f"length p50/p90/p99/max={pct.get('p50')}/{pct.get('p90')}/{pct.get('p99')}/{pct.get('max')}"
                 + (f"  truncated={c.get('truncated')}" if c.get("truncated") else ""))
    L.append("")
    has_q = any(r.get("q") for r in ins.layers)  # vLLM's FP8 query scale, where stored
    lw = (ins.model or {}).get("layer_windows")  # a model with sliding-window layers (Gemma 3)
    if lw:
        sl = [i for i, w in enumerate(lw) if w]
        L.append(f"layer types: {len(sl)} sliding-window (W = {max(lw)}: layers {_ranges(sl)}), "
                 f"{len(lw) - len(sl)} full attention (layers {_ranges([i for i, w in enumerate(lw) if not w])})")
    L.append(f"{'layer':>5}  {'K scale':<28} {'V scale':<28}" + (f" {'Q scale':<28}" if has_q else "")
             + ("  type" if lw else ""))
    for r in ins.layers:
        L.append(f"{r['layer']:>5}  {_fmt_vals(r['k'], ins.granularity):<28} {_fmt_vals(r['v'], ins.granularity):<28}"
                 + (f" {_fmt_vals(r.get('q'), ins.granularity):<28}" if has_q else "")
                 + ((f"  {'sliding' if lw[r['layer']] else 'full'}") if lw and r["layer"] < len(lw) else ""))
    L.append("")
    L.append("engines (naming rules of shared/docs/runtime-formats.md):")
    for e in ins.engines.values():
        L += _engine_line(e, ins.num_layers)
    if ins.params:
        L.append("")
        L += _param_lines(ins)
    if ins.exportable:
        L.append("")
        L.append("kvcal export targets:")
        for name, reason in ins.exportable.items():
            L.append(f"  {name}: {'ok' if reason is None else 'no - ' + reason}")
    if ins.notes or ins.warnings:
        L.append("")
        L += [f"note: {x}" for x in ins.notes]
        L += [f"warning: {x}" for x in ins.warnings]
    return "\n".join(L)


def _param_lines(ins: Inspection) -> list[str]:
    """Per layer, the parameter each engine loads each scale tensor into; consecutive layers whose
    rows differ only in the layer index are printed once (``{i}`` stands for the index)."""
    import re

    from kvcal.export.layouts import ENGINES

    fam = ins.family
    kind = f"fused {fam.projections[0]}" if fam.fused else "separate " + "/".join(fam.projections)
    out = [f"parameters each loader fills ({fam.model_type}: attention {fam.attention}, {kind}; "
           "vLLM 0.33 / SGLang 0.5.23 rules of kvcal.export.layouts; transformers = the parameter compressed-tensors "
           "attaches where it applies the scheme):"]

    def row_text(r: dict) -> list[str]:
        lines = []
        for t in r["tensors"]:
            cells = [f"{e} -> {t[e].param}" if t[e].param else f"{e}: ignored ({t[e].why})" for e in ENGINES]
            lines.append(f"    {t['name']}")
            lines += [f"        {c}" for c in cells]
        return lines or ["    no K/V scale tensor"]

    def generic(r: dict) -> tuple:
        return tuple(re.sub(rf"\.{r['layer']}\.", ".{i}.", x) for x in row_text(r))

    i = 0
    rows = ins.params
    while i < len(rows):
        j = i
        while j + 1 < len(rows) and generic(rows[j + 1]) == generic(rows[i]):
            j += 1
        if i == j:
            out.append(f"  layer {i}:")
            out += row_text(rows[i])
        else:
            out.append(f"  layers {i}-{j} ({{i}} = layer):")
            out += list(generic(rows[i]))
        i = j + 1
    return out
