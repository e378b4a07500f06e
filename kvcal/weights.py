"""A cheap fingerprint of the weights an artifact was calibrated on.

Scales are only right for the weights that produced the K/V they were fitted to: a checkpoint with
the same config but other weights (another fine-tune, layers lost from a shard, a random init) has
the same ``config_sha256`` and would accept them. ``kvcal calibrate`` records
:func:`weights_fingerprint` of the loaded model in the artifact (``model.weights``), and
``kvcal export --model-dir`` recomputes it from the checkpoint files
(:func:`fingerprint_from_files`, header reads plus a few bytes per tensor) and refuses a mismatch.

What it covers (scheme :data:`SCHEME`):

* every parameter of the decoder layers (names with ``.layers.{i}.`` ending in ``.weight`` /
  ``.bias``; attention activation scales of quantized-KV exports excluded) and the input embedding:
  everything that shapes the cached K/V. The final norm and ``lm_head`` do not, and are left out
  (a tied ``lm_head`` is the embedding anyway);
* per tensor: its name, its shape, and :data:`SAMPLES` values at evenly spaced flat indices
  ``j·(n-1)//(SAMPLES-1)``, each **rounded to bfloat16** (round to nearest even) before hashing;
* one sha256 (first 16 hex digits) per layer and one for the embedding.

Rounding to bfloat16 makes the fingerprint independent of the storage dtype of the *same* weights:
rounding is idempotent, so a value ``x`` computed in float32 (e.g. a GGUF dequantized by
transformers) and the bfloat16 copy ``round(x)`` of it written by ``save_pretrained`` both hash as
``round(x)``; float32 and bfloat16 copies of one model match, and so do a GGUF-loaded model and its
``save_pretrained`` copy (same tensor names: transformers renames GGUF tensors on load and permutes
llama q/k back). A float16 copy may not match (float16 then bfloat16 rounds twice), nor does the
original checkpoint a GGUF was quantized from: those are other weights, and the scales should be
re-calibrated on them.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import torch


def config_hash(config_dict: dict) -> str:
    """sha256 (64 hex digits) of a model config's architecture-defining fields (stable across save/load).

    Only fields that change the shapes or meaning of K/V are hashed, so a model re-saved by a
    different transformers version still matches its artifacts. Recorded as the artifact's
    ``model.config_sha256`` (by :func:`kvcal.models.model_metadata`) and checked by
    ``kvcal export --model-dir``.
    """
    sub = config_identity(config_dict)
    return hashlib.sha256(json.dumps(sub, sort_keys=True, default=str).encode()).hexdigest()


#: The config.json fields :func:`config_hash` covers.
IDENTITY_KEYS = (
    "model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "hidden_size", "head_dim", "rope_theta", "vocab_size", "max_position_embeddings",
)


def config_identity(config_dict: dict) -> dict:
    """The normalized view of a (text) config dict that :func:`config_hash` hashes: the
    :data:`IDENTITY_KEYS` fields, with the two that transformers derives when a config.json omits them
    (or writes ``null``) filled in the way transformers does — ``num_key_value_heads`` defaults to
    ``num_attention_heads`` (multi-head attention) and ``head_dim`` to ``hidden_size //
    num_attention_heads``. Both sides of a comparison — the artifact's recorded hash
    (:func:`kvcal.models.model_metadata`, from a loaded transformers config) and ``kvcal export
    --model-dir`` (from the raw config.json, e.g. Phi-3 or GPT-NeoX, which omit ``head_dim``) — hash
    this view, so the same checkpoint always gives the same hash. Configs that state both fields
    (Llama, SmolLM2) hash exactly as before this normalization existed."""
    sub = {k: config_dict.get(k) for k in IDENTITY_KEYS}
    heads, hidden = sub["num_attention_heads"], sub["hidden_size"]
    if sub["num_key_value_heads"] is None:
        sub["num_key_value_heads"] = heads
    if (sub["head_dim"] is None and isinstance(heads, int) and isinstance(hidden, int) and heads > 0
            and not isinstance(heads, bool)):
        sub["head_dim"] = hidden // heads
    return sub


SCHEME = "kvcal-weights/1: per layer and embedding, sha256[:16] of (name, shape, 32 bf16-rounded samples) per tensor"
SAMPLES = 32
_LAYER = re.compile(r"\.layers\.(\d+)\.")
#: Checkpoint tensors transformers' modules do not hold but which are no model weights: attention
#: activation scales of quantized-KV exports (vLLM / SGLang / ModelOpt / TensorRT-LLM names, e.g. a
#: ``kvcal export --model-dir`` copy).
ATTENTION_SCALE = re.compile(r"\.(?:self_attn|attention)\.(?:\w+\.)?(?:[qkv]_scale|kv_scale|prob_scale|output_scale|"
                             r"kv_cache_(?:rcp_)?scaling_factor)$")
#: safetensors dtype names -> torch dtypes (those a checkpoint's parameters use)
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def sample_indices(n: int, k: int = SAMPLES) -> list[int]:
    """``min(n, k)`` evenly spaced flat indices into a tensor of ``n`` elements (first and last included)."""
    if n <= k:
        return list(range(n))
    return [(j * (n - 1)) // (k - 1) for j in range(k)]


def layer_of(name: str) -> int | None:
    """Decoder layer index of a covered parameter name, or ``None`` (not in a layer, not a weight/bias,
    or an attention activation scale)."""
    m = _LAYER.search(name)
    if m is None or not name.endswith((".weight", ".bias")) or ATTENTION_SCALE.search(name):
        return None
    return int(m.group(1))


def _record(name: str, shape, values: torch.Tensor) -> bytes:
    b = values.to(torch.float32).to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    return f"{name}|{list(shape)}|".encode() + b + b"\n"


def _digest(records: list[bytes]) -> str:
    return hashlib.sha256(b"".join(sorted(records))).hexdigest()[:16]


def _assemble(num_layers: int, emb_name: str, groups: dict) -> dict:
    return {"scheme": SCHEME, "num_layers": num_layers, "embedding_name": emb_name,
            "embedding": _digest(groups["embedding"]) if groups.get("embedding") else None,
            "layers": [_digest(groups[i]) if groups.get(i) else None for i in range(num_layers)]}


def weights_fingerprint(model) -> dict | None:
    """Fingerprint (module docstring) of a loaded transformers causal LM's parameters, any dtype or
    device. Returns the dict stored as the artifact's ``model.weights``: ``scheme``, ``num_layers``,
    ``embedding_name`` (the input embedding's parameter name), ``embedding`` and ``layers`` (``[L]``
    hex digests; ``None`` for a layer without parameters). Returns ``None`` when some parameter is
    not materialized (``device_map`` offload to disk leaves it on the ``meta`` device)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    L = int(cfg.num_hidden_layers)
    emb = model.get_input_embeddings().weight
    emb_name, groups = "", {}
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied parameters once, under their first name
            if p.device.type == "meta":
                return None
            i = layer_of(name)
            if p is emb:
                emb_name, key = name, "embedding"
            elif i is not None and i < L:
                key = i
            else:
                continue
            idx = torch.tensor(sample_indices(p.numel()), dtype=torch.long, device=p.device)
            groups.setdefault(key, []).append(_record(name, p.shape, p.detach().reshape(-1)[idx].cpu()))
    return _assemble(L, emb_name, groups)


def fingerprint_from_files(files: list[tuple[Path, dict, int]], recorded: dict) -> dict:
    """The same fingerprint read from safetensors files without loading them: ``files`` lists
    ``(path, header, data_start)`` (header as parsed by
    :func:`kvcal.export.checkpoint.read_header`); ``recorded``: the artifact's fingerprint (its
    ``num_layers`` and ``embedding_name`` select the tensors). Reads :data:`SAMPLES` elements per
    covered tensor. A dtype outside :data:`_ST_DTYPES` gives a digest that cannot match (its tensor
    name is recorded with no values)."""
    L, emb_name = int(recorded.get("num_layers") or 0), recorded.get("embedding_name")
    groups: dict = {}
    for path, header, start in files:
        with open(path, "rb") as f:
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                i = layer_of(name)
                key = "embedding" if name == emb_name else i if i is not None and i < L else None
                if key is None:
                    continue
                shape, dt = info["shape"], _ST_DTYPES.get(info["dtype"])
                n = 1
                for s in shape:
                    n *= int(s)
                vals = []
                if dt is not None:
                    size = torch.empty((), dtype=dt).element_size()
                    b = int(info["data_offsets"][0])
                    for j in sample_indices(n):
                        f.seek(start + b + j * size)
                        vals.append(f.read(size))
                    t = torch.frombuffer(bytearray(b"".join(vals)), dtype=dt) if vals else torch.empty(0)
                else:
                    t = torch.full((1,), float("nan"))
                groups.setdefault(key, []).append(_record(name, shape, t))
    return _assemble(L, emb_name, groups)


def format_ranges(ids: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"``."""
    out: list[str] = []
    for i in sorted(set(ids)):
        if out and i == int(out[-1].rsplit("-", 1)[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ", ".join(out)


def compare_fingerprints(recorded: dict, found: dict) -> str | None:
    """``None`` when ``found`` equals ``recorded``; else what differs, e.g. ``"layers 0-3 and the
    embedding"`` or ``"layer 3 (weights missing from the checkpoint)"``."""
    rl, fl = recorded.get("layers") or [], found.get("layers") or []
    gone = [i for i, (a, b) in enumerate(zip(rl, fl, strict=False)) if a is not None and b is None]
    diff = [i for i, (a, b) in enumerate(zip(rl, fl, strict=False)) if b is not None and a != b]
    if len(rl) != len(fl):
        return f"the number of layers ({len(rl)} calibrated, {len(fl)} found)"
    parts = []
    if diff:
        parts.append(f"layer{'s' if len(diff) > 1 else ''} {format_ranges(diff)}")
    if recorded.get("embedding") != found.get("embedding"):
        parts.append("the embedding" + (" (missing from the checkpoint)" if found.get("embedding") is None else ""))
    if gone:
        parts.append(f"layer{'s' if len(gone) > 1 else ''} {format_ranges(gone)} (weights missing from the checkpoint)")
    return " and ".join(parts) or None
