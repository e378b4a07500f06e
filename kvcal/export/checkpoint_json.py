"""The one validated reader of a Hugging Face checkpoint's ``config.json`` and
``model.safetensors.index.json`` (used by ``kvcal export --model-dir`` and ``kvcal inspect``).

Both commands index into these files (``config["quantization_config"]["kv_cache_scheme"]``,
``index["weight_map"].values()``); a file of the wrong shape — a list instead of an object, a
number where a mapping belongs — would otherwise surface as an ``AttributeError`` / ``TypeError``
deep inside. Here every field kvcal reads is type-checked once, and a bad one raises the caller's
:class:`~kvcal.errors.KvcalError` subclass with one line naming the file and the field.

Shapes checked (transformers ``PretrainedConfig`` / ``huggingface_hub`` sharded-index conventions):

* config.json: a JSON object; ``text_config`` (multimodal configs), ``quantization_config`` and its
  ``kv_cache_scheme`` objects when present and not ``null``; ``num_hidden_layers``,
  ``num_attention_heads``, ``num_key_value_heads``, ``hidden_size``, ``head_dim`` positive integers when
  present and not ``null``; ``model_type`` a string when present.
* model.safetensors.index.json: a JSON object whose ``weight_map`` is an object mapping tensor-name
  strings to non-empty shard-file-name strings.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvcal.errors import KvcalError

_INT_FIELDS = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size", "head_dim")


def json_kind(x) -> str:
    """The JSON type name of a parsed value (``"object"``, ``"array"``, ``"string"``, ...)."""
    if isinstance(x, bool):
        return "boolean"
    return {dict: "object", list: "array", str: "string", int: "number", float: "number"}.get(type(x), "null")


def _load(path: Path, error: type[KvcalError]):
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path} is not readable JSON ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None


def _need_object(path: Path, field: str, value, error: type[KvcalError], allow_null: bool = True) -> None:
    if value is None and allow_null:
        return
    if not isinstance(value, dict):
        raise error(f"{path}: {field} is a JSON {json_kind(value)}, not an object; fix or restore the file from the "
                    "original checkpoint")


def validate_config(path: Path, config, error: type[KvcalError] = KvcalError) -> dict:
    """Check a parsed ``config.json`` (module docstring) and return it; ``error`` (naming ``path`` and
    the field) when a field kvcal reads has the wrong JSON type."""
    _need_object(path, "the file", config, error, allow_null=False)
    _need_object(path, "text_config", config.get("text_config"), error)
    parts = [("", config)]
    if isinstance(config.get("text_config"), dict):
        parts.append(("text_config.", config["text_config"]))
    for prefix, c in parts:
        qc = c.get("quantization_config")
        _need_object(path, f"{prefix}quantization_config", qc, error)
        if isinstance(qc, dict):
            _need_object(path, f"{prefix}quantization_config.kv_cache_scheme", qc.get("kv_cache_scheme"), error)
        for key in _INT_FIELDS:
            v = c.get(key)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise error(f"{path}: {prefix}{key} is {json.dumps(v)}, not a positive integer; fix or restore the "
                            "file from the original checkpoint")
        if c.get("model_type") is not None and not isinstance(c["model_type"], str):
            raise error(f"{path}: {prefix}model_type is a JSON {json_kind(c['model_type'])}, not a string")
    return config


def read_config(path: str | Path, error: type[KvcalError] = KvcalError) -> dict:
    """Read and validate a checkpoint's ``config.json`` at ``path`` (:func:`validate_config`)."""
    return validate_config(Path(path), _load(Path(path), error), error)


def validate_index(path: Path, index, error: type[KvcalError] = KvcalError) -> dict:
    """Check a parsed ``model.safetensors.index.json`` and return it: an object whose ``weight_map``
    maps tensor-name strings to non-empty shard-file-name strings; ``error`` naming the field otherwise."""
    _need_object(path, "the file", index, error, allow_null=False)
    if "weight_map" not in index:
        raise error(f"{path} has no weight_map (tensor name -> shard file); fix or restore the file from the "
                    "original checkpoint")
    wm = index["weight_map"]
    _need_object(path, "weight_map", wm, error, allow_null=False)
    for name, shard in wm.items():
        if not isinstance(shard, str) or not shard:
            raise error(f"{path}: weight_map[{json.dumps(name)}] is {json.dumps(shard)}, not a shard file name "
                        "string; fix or restore the file from the original checkpoint")
    return index


def read_index(path: str | Path, error: type[KvcalError] = KvcalError) -> dict:
    """Read and validate a checkpoint's ``model.safetensors.index.json`` at ``path`` (:func:`validate_index`)."""
    return validate_index(Path(path), _load(Path(path), error), error)


def validate_hf_quant_config(path: Path, doc, error: type[KvcalError] = KvcalError) -> dict:
    """Check a parsed ModelOpt ``hf_quant_config.json`` and return it: an object whose ``quantization``
    (when present and not ``null``) is an object; ``error`` naming the field otherwise."""
    _need_object(path, "the file", doc, error, allow_null=False)
    _need_object(path, "quantization", doc.get("quantization"), error)
    return doc


def read_hf_quant_config(path: str | Path, error: type[KvcalError] = KvcalError) -> dict:
    """Read and validate a ModelOpt ``hf_quant_config.json`` at ``path`` (:func:`validate_hf_quant_config`)."""
    return validate_hf_quant_config(Path(path), _load(Path(path), error), error)


def read_quantization_config_json(path: str | Path, error: type[KvcalError] = KvcalError) -> dict | None:
    """The ``quantization_config`` of a standalone ``quantization_config.json`` (what ``kvcal export
    --target vllm`` writes without ``--model-dir``): ``None`` when absent, else an object whose
    ``kv_cache_scheme`` (when present) is an object; ``error`` naming the field otherwise."""
    doc = _load(Path(path), error)
    _need_object(Path(path), "the file", doc, error, allow_null=False)
    qc = doc.get("quantization_config")
    _need_object(Path(path), "quantization_config", qc, error)
    if isinstance(qc, dict):
        _need_object(Path(path), "quantization_config.kv_cache_scheme", qc.get("kv_cache_scheme"), error)
    return qc
