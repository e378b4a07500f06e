"""Read back what an export deployed: the scales in the files ``kvcal export`` wrote, as an :class:`Artifact`.

``kvcal evaluate --artifact OUT`` judges an export directory (or the checkpoint ``kvcal export --model-dir`` wrote)
through :func:`load_deployed`: the source artifact's metadata (model identity, format, per-layer statistics: found
through ``kvcal-export.json``, which records its path and content hash) with the scale tensors replaced by the
values read from the exported files, by the names each engine loads (runtime-formats.md):

=================  ==========================================================================================
``vllm``           ``model.layers.{i}.self_attn.{k,v,q}_scale`` (any ``*.safetensors`` of the directory)
``modelopt``       ``model.layers.{i}.self_attn.{k,v}_proj.{k,v}_scale``
``trtllm-legacy``  ``transformer.layers.{i}.attention.kv_cache_scaling_factor`` — one scale for K and V
``sglang-json``    ``kv_cache_scales.json`` ``kv_cache.scaling_factor["0"][str(i)]`` — one scale for K and V
=================  ==========================================================================================

Scales stay in the checkpoint convention (the dequantization multiplier, ``clip / 448``); an ``fp8_e4m3fnuz``
artifact's export (``scale x 240/448``) is converted back to its ``clip / 240``. Reading only: nothing is written.
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path

import torch

from kvcal.artifact.io import Artifact, artifact_sha256, load_artifact
from kvcal.engines import engine
from kvcal.errors import ArtifactError
from kvcal.outputs import EXPORT_MANIFEST
from kvcal.plan import tensor_name


def is_export(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory ``kvcal export`` wrote (it holds ``kvcal-export.json``)."""
    return (Path(path) / EXPORT_MANIFEST).is_file()


def _tensors(d: Path, wanted: set[str]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for f in sorted(d.rglob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as fh:
                for k in fh.keys():
                    if k in wanted:
                        out[k] = fh.get_tensor(k).float()
        except Exception as e:  # safetensors raises several types for corrupted files
            raise ArtifactError(f"{f} is corrupted or truncated ({type(e).__name__}: {e}); re-export") from None
    return out


#: ``{attention path}.layers.{i}.{...}.{k,v,q}_scale`` in any model family (Llama ``model.layers.{i}.self_attn``,
#: GPT-NeoX ``gpt_neox.layers.{i}.attention``, ...; modelopt's ``.k_proj.k_scale``): the layer index and the side
_SCALE_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:[^.]+\.)*?([kvq])_scale$")


def _attention_scales(d: Path, target: str, num_layers: int) -> dict[str, list[torch.Tensor]]:
    """The ``k``/``v`` (and ``q`` where the checkpoint holds one) scale of every layer in the ``*.safetensors`` of
    ``d``, found by name whatever the model family's attention path (:data:`_SCALE_NAME`; for ``modelopt`` the
    ``{k,v}_proj.{k,v}_scale`` names). Raises :class:`ArtifactError` for a missing k/v scale, two tensors for one
    layer and side, or a q_scale on only some layers (vLLM would serve the others at 1.0: not one configuration)."""
    from safetensors import safe_open

    found: dict[tuple[int, str], str] = {}
    for f in sorted(d.rglob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as fh:
                keys = list(fh.keys())
        except Exception as e:  # safetensors raises several types for corrupted files
            raise ArtifactError(f"{f} is corrupted or truncated ({type(e).__name__}: {e}); re-export") from None
        for k in keys:
            m = _SCALE_NAME.search(k)
            if not m or int(m.group(1)) >= num_layers:
                continue
            side = m.group(2)
            if target == "modelopt" and side != "q" and not k.endswith(f"{side}_proj.{side}_scale"):
                continue
            if target == "vllm" and k.endswith(f"{side}_proj.{side}_scale"):
                continue
            key = (int(m.group(1)), side)
            if key in found and found[key] != k:
                raise ArtifactError(f"{d}: two tensors hold layer {key[0]}'s {side}_scale ({found[key]}, {k}); an "
                                    "engine would load one of them — re-export into a clean directory")
            found[key] = k
    t = _tensors(d, set(found.values()))
    out: dict[str, list[torch.Tensor]] = {}
    for s in ("k", "v"):
        missing = [i for i in range(num_layers) if (i, s) not in found]
        if missing:
            raise ArtifactError(f"{d}: the {target} export lacks layer {missing[0]}'s {s}_scale ({len(missing)} of "
                                f"{num_layers} layers); it was edited or is incomplete — re-export")
        out[s] = [t[found[(i, s)]] for i in range(num_layers)]
    qs = [i for i in range(num_layers) if (i, "q") in found]
    if qs and len(qs) != num_layers:
        raise ArtifactError(f"{d}: layers {qs[:6]} hold a q_scale and {num_layers - len(qs)} others do not: vLLM would "
                            "serve those at 1.0, a mix kvcal evaluate does not emulate — re-export")
    if qs:
        out["q"] = [t[found[(i, "q")]] for i in range(num_layers)]
    return out


def read_scales(d: Path, target: str, num_layers: int) -> dict[str, list[torch.Tensor]]:
    """The per-layer scales an export directory ``d`` of ``target`` holds: ``{"k": [L tensors], "v": [...]}`` plus
    ``"q"`` where every layer has one (vllm). Shared targets give the one per-layer value to both sides.
    Raises :class:`ArtifactError` naming the first missing scale or a non-finite / non-positive one."""
    if target == "sglang-json":
        f = d / engine("sglang").JSON_FILE  # the target's file (kvcal.engines.sglang)
        try:
            doc = json.loads(f.read_text(encoding="utf-8"))
        except OSError as e:
            raise ArtifactError(f"{d / EXPORT_MANIFEST} names target {target} but {f} cannot be read ({e.strerror}): "
                                "the export is incomplete or its manifest was edited — re-export") from None
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            raise ArtifactError(f"{f} is not readable JSON ({e}); it was edited — re-export") from None
        per = ((doc.get("kv_cache") or {}).get("scaling_factor") or {}).get("0") if isinstance(doc, dict) else None
        if not isinstance(per, dict):
            raise ArtifactError(f"{f}: no kv_cache.scaling_factor for rank \"0\" (the file was edited or is not "
                                "kvcal's export); re-export")
        vals = []
        for i in range(num_layers):
            v = per.get(str(i))
            if v is None:
                raise ArtifactError(f"{f}: kv_cache.scaling_factor[\"0\"] has no scale for layer {i} (the model has "
                                    f"{num_layers} layers); the file was edited — re-export")
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ArtifactError(f"{f}: kv_cache.scaling_factor[\"0\"][\"{i}\"] = {v!r} is not a number; the file "
                                    "was edited — re-export")
            vals.append(torch.tensor([float(v)]))
        out = {"k": vals, "v": [v.clone() for v in vals]}
    elif target == "trtllm-legacy":
        # the one K/V scale per layer ``i`` (vllm and modelopt names are matched by _SCALE_NAME; kvcal.engines.trtllm)
        name = {i: engine("trtllm").LEGACY_SCALE_TEMPLATE.format(i=i) for i in range(num_layers)}
        t = _tensors(d, set(name.values()))
        missing = [name[i] for i in range(num_layers) if name[i] not in t]
        if missing:
            raise ArtifactError(f"{d}: the {target} export lacks {missing[0]} ({len(missing)} of {num_layers} "
                                "layers); it was edited or is incomplete — re-export")
        out = {"k": [t[name[i]] for i in range(num_layers)]}
        out["v"] = [k.clone() for k in out["k"]]
    elif target in ("vllm", "modelopt"):
        out = _attention_scales(d, target, num_layers)
    else:
        raise ArtifactError(f"{d / EXPORT_MANIFEST}: target {target!r} is not one kvcal exports; re-export")
    for s, vals in out.items():
        for i, v in enumerate(vals):
            if not bool(torch.isfinite(v).all()) or not bool((v > 0).all()):
                raise ArtifactError(f"{d}: layer {i} {s}_scale is {v.reshape(-1).tolist()}, not finite and > 0; "
                                    "re-export")
    return out


def load_deployed(path: str | os.PathLike) -> Artifact:
    """An export directory (``kvcal export --out``, with or without ``--model-dir``) as an :class:`Artifact` whose
    scale tensors are exactly the exported ones (float32, shaped as the source artifact's: ``[1]`` per tensor,
    ``[H_kv, 1, 1]`` per head) and whose metadata is the source artifact's with ``layers[i].{k,v}.scale`` set to
    them and a ``deployed`` section (``target``, ``path``, ``source_artifact``, ``scales``: the set the export
    wrote, ``changed``: how many K/V scales differ from the artifact's). The artifact it came from must still be
    where ``kvcal-export.json`` says and unchanged (its ``artifact_sha256``). Raises :class:`ArtifactError` (one
    line) for a missing or malformed manifest, a missing or changed source artifact, or missing / bad scales."""
    d = Path(path)
    f = d / EXPORT_MANIFEST
    try:
        man = json.loads(f.read_text(encoding="utf-8"))
        target, src = man["target"], man.get("artifact_path") or man["artifact"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ArtifactError(f"{f}: not a kvcal export manifest ({type(e).__name__}: {e}); re-export") from None
    if man.get("source_format") == "nvfp4" or not isinstance(src, str):
        raise ArtifactError(f"{d}: a {man.get('source_format')} export cannot be evaluated from its files; evaluate "
                            f"its artifact ({src}) with --vllm-dtype")
    sp = Path(src)
    if not man.get("artifact_path") and not sp.is_absolute():  # relative to a working directory nobody recorded
        raise ArtifactError(f"{f}: records the artifact only as the relative path {src!r} (an export of an earlier "
                            "kvcal), which kvcal will not guess against this directory: re-export it with this kvcal")
    if not (sp / "kv_scales.safetensors").is_file():
        raise ArtifactError(f"{d}: the artifact it was exported from, {src}, is gone (kvcal evaluate reads the model "
                            "and format from it): keep the artifact where it was, or re-export from it")
    art = load_artifact(sp)
    want = man.get("artifact_sha256")
    if want is not None and artifact_sha256(sp) != want:
        raise ArtifactError(f"{d}: the artifact at {src} changed after the export (sha256 differs from "
                            "kvcal-export.json's artifact_sha256): re-export from it, or evaluate the artifact itself")
    n = art.num_layers
    got = read_scales(d, target, n)
    fmt = art.metadata["kv"]["k"]["format"]
    conv = 240.0 / 448.0 if fmt == "fp8_e4m3fnuz" else 1.0  # kvcal.export.base.prepare_scales, inverted
    tensors = dict(art.tensors)
    meta = copy.deepcopy(art.metadata)
    changed = 0
    q_from_checkpoint = False
    for i in range(n):
        for s in ("k", "v"):
            name = tensor_name(i, s)
            orig = art.tensors.get(name)
            if orig is None:
                raise ArtifactError(f"{sp}: has no {name} to replace; not a static-scale artifact")
            v = got[s][i].reshape(-1) / conv
            if v.numel() == 1 and orig.numel() > 1:
                v = v.expand(orig.numel())
            if v.numel() != orig.numel():
                raise ArtifactError(f"{d}: layer {i} {s}_scale has {v.numel()} values, the artifact {orig.numel()}; "
                                    "re-export")
            v = v.reshape(orig.shape).to(torch.float32).contiguous()
            changed += int(not torch.equal(v, orig))
            tensors[name] = v
            lm = next((e for e in meta.get("layers") or [] if e.get("layer") == i), None)
            if lm is not None and isinstance(lm.get(s), dict):
                lm[s]["scale"] = v.reshape(-1).tolist()
        if "q" in got:
            q = tensor_name(i, "k").replace("k_scale", "q_scale")
            qv = got["q"][i].reshape(-1) / conv
            if q in tensors:
                shape = tensors[q].shape
            else:  # kept from the --model-dir checkpoint: vLLM reads it, so the evaluation must too
                shape = (1,) if qv.numel() == 1 else (int(meta["model"].get("num_kv_heads") or 1),)
                q_from_checkpoint = True
            want_n = int(torch.Size(shape).numel())
            if qv.numel() != want_n and qv.numel() % want_n == 0:
                # per query head [H_q] (kvcal.engines.vllm.export.vllm_q_scale): vLLM's loader keeps each group's max
                qv = qv.reshape(want_n, -1).amax(1)
            if qv.numel() != want_n:
                raise ArtifactError(f"{d}: layer {i} q_scale has {qv.numel()} values, the artifact {want_n}; "
                                    "re-export")
            tensors[q] = qv.reshape(shape).to(torch.float32)
    meta["deployed"] = {"target": target, "path": str(d.resolve()), "source_artifact": str(sp.resolve()),
                        "scales": man.get("scales"), "changed": changed, "source_hash_checked": want is not None,
                        "q_scale_from_checkpoint": q_from_checkpoint}
    return Artifact(path=d, tensors=tensors, metadata=meta)


def load_artifact_or_export(path: str | os.PathLike) -> Artifact:
    """:func:`load_deployed` for an export directory, else :func:`kvcal.artifact.load_artifact`; a directory that
    is neither is refused naming both (:class:`ArtifactError`)."""
    p = Path(path)
    if is_export(p):
        return load_deployed(p)
    if p.is_dir() and not (p / "kv_scales.safetensors").exists():
        raise ArtifactError(f"{p} is neither a kvcal artifact (kv_scales.safetensors: `kvcal calibrate --out`) nor a "
                            f"kvcal export ({EXPORT_MANIFEST}: `kvcal export --out`); give one of them")
    return load_artifact(p)


__all__ = ["is_export", "read_scales", "load_deployed", "load_artifact_or_export"]
