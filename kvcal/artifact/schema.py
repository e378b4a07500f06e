"""The artifact metadata schema: each section's keys and value checks
(:func:`validate_metadata_schema`) and the content hash stored in it (:func:`content_sha256`)."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch

from kvcal.engines import engine, with_attr
from kvcal.errors import ArtifactError

SIDES = ("k", "v")


# ---- the one artifact validator ----------------------------------------------------------------
# Every command that reads an artifact (export, evaluate, plan --kv-config, inspect, report, the
# runtime cache) goes through load_artifact, which runs the checks below in this order: metadata
# schema (types, not truthiness), tensor dtypes and names, shapes against the stated granularity,
# missing/extra tensors, finite positive scales, scales against the recorded calibration ranges,
# the calibrated per-layer parameters (KVPlan.from_artifact), and last the content hash — so a
# specific defect is named precisely and any other edit is still caught by the hash.

#: Metadata field that holds :func:`content_sha256` (written by :func:`write_artifact`).
CONTENT_HASH_KEY = "content_sha256"


def _kind(v) -> str:
    return "null" if v is None else {bool: "boolean", int: "integer", float: "number", str: "string",
                                     list: "list", dict: "object"}.get(type(v), type(v).__name__)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# field checks: (predicate, what the field must be)
_POS_INT = (lambda v: _is_int(v) and v >= 1, "a positive integer")
_NONNEG_INT = (lambda v: _is_int(v) and v >= 0, "an integer >= 0")
_BOOL = (lambda v: isinstance(v, bool), "true or false (a JSON boolean, not a string)")
_STR = (lambda v: isinstance(v, str), "a string")
_OBJ = (lambda v: isinstance(v, dict), "an object")
_LIST = (lambda v: isinstance(v, list), "a list")
_POS_NUM = (lambda v: _is_num(v) and v > 0, "a finite number > 0")
_NUM_LIST = (lambda v: isinstance(v, list) and all(_is_num(x) for x in v), "a list of finite numbers")
_STR_LIST = (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings")


def _optional(check):
    pred, what = check
    return (lambda v: v is None or pred(v), f"{what} or null")


def _one_of(*choices):
    return (lambda v: v in choices, "one of " + ", ".join(repr(c) for c in choices))


_GRANULARITIES = ("tensor", "head", "channel", "token", "token_group", "channel_token_group")


def _formats() -> tuple[str, ...]:
    from kvcal.formats.spec import QFormat

    return tuple(f.value for f in QFormat)


# section -> {field: (check, required)}; fields not listed are allowed (forward compatibility: a
# newer kvcal's optional fields, e.g. a weights fingerprint) and covered by the content hash
_TOP_SCHEMA = {
    "schema_version": (_POS_INT, True), "model": (_OBJ, True), "kv": (_OBJ, True),
    "kvcal_version": (_STR, False), "created": (_STR, False), "calibration": (_OBJ, False),
    "corpus": (_OBJ, False), "layers": (_LIST, False), "tensor_names": (_STR_LIST, False),
    CONTENT_HASH_KEY: ((lambda v: isinstance(v, str) and len(v) == 64, "a 64-digit hex sha256"), False),
}
_MODEL_SCHEMA = {
    "num_layers": (_POS_INT, True), "num_kv_heads": (_POS_INT, True), "head_dim": (_POS_INT, True),
    "num_attention_heads": (_POS_INT, False), "max_position_embeddings": (_optional(_POS_INT), False),
    "id": (_optional(_STR), False), "config_sha256": (_optional(_STR), False), "architecture": (_optional(_STR), False),
    "model_type": (_optional(_STR), False), "weight_precision": (_optional(_STR), False),
    "layer_windows": ((lambda v: isinstance(v, list) and all(_is_int(w) and (w == 0 or w >= 2) for w in v)
                       and any(v), "a list of per-layer sliding windows (0: full attention, >= 2 tokens), one "
                       "sliding at least"), False),
}
_KV_SCHEMA = {
    "k": (_OBJ, True), "v": (_OBJ, True),
    "quantized_tensors": ((lambda v: isinstance(v, list) and all(x in SIDES for x in v), "a list of 'k' / 'v'"), False),
    "key_position": (_one_of("post_rope", "pre_rope"), False),
    "residual_window": (_NONNEG_INT, False), "sink_tokens": (_NONNEG_INT, False), "key_centering": (_BOOL, False),
    "layer_specs": (_optional(_LIST), False), "transforms": (_optional(_LIST), False),
    "rope_attention_scaling": (_POS_NUM, False),
}


def _spec_schema() -> dict:
    return {
        "format": (_one_of(*_formats()), True), "granularity": (_one_of(*_GRANULARITIES), True),
        "group_size": (_optional(_POS_INT), False), "symmetric": (_BOOL, False), "dynamic": (_BOOL, False),
        "scale_dtype": (_optional(_STR), False), "bits": (_optional(_POS_NUM), False),
    }


_NUM_OR_LIST = (lambda v: _is_num(v) or _NUM_LIST[0](v), "a finite number or a list of them")
_ERRORS = (lambda v: _is_num(v) or (isinstance(v, dict) and all(_is_num(x) for x in v.values())),
           "a finite number or an object of them (the search's errors)")
_LAYER_SIDE_SCHEMA = {"scale": (_NUM_LIST, False), "amax": (_NUM_LIST, False), "clip_ratio": (_NUM_OR_LIST, False),
                      "heldout": (_ERRORS, False), "calib": (_ERRORS, False)}
_CORPUS_SCHEMA = {  # the corpus summary inspect and report print
    "path": (_optional(_STR), False), "sha256": (_optional(_STR), False), "format": (_optional(_STR), False),
    "samples": (_optional(_NONNEG_INT), False), "tokens": (_optional(_NONNEG_INT), False),
    "truncated": (_optional(_NONNEG_INT), False), "length_percentiles": (_optional(_OBJ), False),
}

def _check_section(f: Path, where: str, obj, schema: dict) -> None:
    """Check the fields of ``obj`` (metadata section ``where``) against ``schema``; ArtifactError
    naming the field, what it must be, what it is, and how to fix it."""
    if not isinstance(obj, dict):
        raise ArtifactError(f"{f}: metadata {where or 'document'} must be an object, got {_kind(obj)}; "
                            "re-run calibration")
    for key, ((pred, what), required) in schema.items():
        field_name = f"{where}.{key}" if where else key
        if key not in obj:
            if required:
                raise ArtifactError(f"{f}: metadata field {field_name} must be {what}, but it is missing; the file "
                                    "was edited or is not a kvcal artifact — re-run calibration")
            continue
        v = obj[key]
        if not pred(v):
            raise ArtifactError(f"{f}: metadata field {field_name} must be {what}, got {v!r} ({_kind(v)}); "
                                "fix the field or re-run calibration")


def validate_metadata_schema(f: Path, meta) -> None:
    """Strict types of every metadata field kvcal reads (module docstring): required keys present,
    booleans are JSON booleans (``"symmetric": "false"`` is refused, not read as true), counts are
    integers, formats/granularities are known names, per-layer lists have one entry per layer.
    Unknown fields are allowed (a newer kvcal's optional fields; the content hash covers them).
    Raises :class:`ArtifactError` naming the field."""
    _check_section(f, "", meta, _TOP_SCHEMA)
    _check_section(f, "model", meta["model"], _MODEL_SCHEMA)
    kv = meta["kv"]
    _check_section(f, "kv", kv, _KV_SCHEMA)
    n = meta["model"]["num_layers"]
    lw = meta["model"].get("layer_windows")
    if lw is not None and len(lw) != n:
        raise ArtifactError(f"{f}: metadata model.layer_windows must list {n} layers (model.num_layers), got "
                            f"{len(lw)}; re-run calibration")
    spec_schema = _spec_schema()
    for side in SIDES:
        _check_section(f, f"kv.{side}", kv[side], spec_schema)
    for key in ("layer_specs", "transforms"):
        lst = kv.get(key)
        if lst is not None and len(lst) != n:
            raise ArtifactError(f"{f}: metadata kv.{key} must list {n} layers (model.num_layers), got {len(lst)}; "
                                "re-run calibration")
    for i, ls in enumerate(kv.get("layer_specs") or []):
        for side in SIDES:
            _check_section(f, f"kv.layer_specs[{i}]", ls, {side: (_OBJ, True)})
            _check_section(f, f"kv.layer_specs[{i}].{side}", ls[side], spec_schema)
    for i, tr in enumerate(kv.get("transforms") or []):
        _check_section(f, f"kv.transforms[{i}]", tr, {s: (_STR, False) for s in SIDES})
    if meta.get("corpus") is not None:
        _check_section(f, "corpus", meta["corpus"], _CORPUS_SCHEMA)
    for name in with_attr("check_section"):  # an engine's section (calibrate --engine NAME): the engine checks it
        if meta.get(name) is not None:
            engine(name).check_section(f, meta)
    for j, lm in enumerate(meta.get("layers") or []):
        _check_section(f, f"layers[{j}]", lm, {"layer": ((lambda v: _is_int(v) and 0 <= v < n,
                                                           f"a layer index in 0..{n - 1}"), True)})
        for side in (*SIDES, "q"):  # "q": vLLM's query scale (calibrate --engine vllm)
            if lm.get(side) is not None:
                _check_section(f, f"layers[{j}].{side}", lm[side], _LAYER_SIDE_SCHEMA)


#: The field checker and the checks an engine's section schema uses (``check_section`` of its facade, e.g.
#: :func:`kvcal.engines.vllm.section.check_section`).
check_fields, is_int, is_num, STR, NUM_LIST = _check_section, _is_int, _is_num, _STR, _NUM_LIST


def content_sha256(meta: dict, tensors: dict[str, torch.Tensor]) -> str:
    """Hex sha256 over an artifact's content: the metadata (canonical JSON, sorted keys, without the
    :data:`CONTENT_HASH_KEY` field itself) and every tensor's name, dtype, shape and bytes in name
    order. :func:`write_artifact` stores it in the metadata; :func:`load_artifact` recomputes it, so a
    scale or field changed after kvcal wrote the file is told from one kvcal wrote."""
    h = hashlib.sha256()
    body = {k: v for k, v in meta.items() if k != CONTENT_HASH_KEY}
    h.update(json.dumps(body, sort_keys=True, allow_nan=False, separators=(",", ":")).encode())
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"\n{name}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
