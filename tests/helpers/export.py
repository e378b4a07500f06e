"""Builders shared by the export / inspect tests: realistic artifacts and tiny HF checkpoints."""

from __future__ import annotations

from pathlib import Path

import torch

from kvcal.artifact import write_artifact
from kvcal.plan import tensor_name

FMT_MAX = {"fp8_e4m3": 448.0, "fp8_e4m3fnuz": 240.0, "fp8_e5m2": 57344.0, "int8": 127.0, "int4": 7.0}
L, H_KV, H, D = 4, 2, 4, 16  # tiny Llama: 4 layers, 4 query heads, 2 KV heads, head_dim 16 (hidden 64)


def make_artifact(
    out: Path,
    fmt: str = "fp8_e4m3",
    granularity: str = "tensor",
    clip: float = 1.0,
    key_position: str = "post_rope",
    dynamic: bool = False,
    symmetric: bool = True,
    num_layers: int = L,
    seed: int = 0,
    with_amax: bool = True,
    amax_per_head: dict | None = None,
    model_type: str = "llama",
    num_kv_heads: int = H_KV,
) -> tuple[Path, dict]:
    """Write an artifact with seeded per-head absmax (keys larger than values, as in real models)
    and scales ``clip * amax / fmt_max`` (``clip < 1`` means calibration clipped). ``amax_per_head``:
    ``{(layer, side): [H_KV floats]}`` measured on a model, used instead of the seeded values.
    ``model_type`` / ``num_kv_heads``: the model section (tiny configs of other families). Returns
    the path and ``{(layer, side): (scale tensor, amax per head list)}``."""
    g = torch.Generator().manual_seed(seed)
    tensors, layers, truth = {}, [], {}
    for i in range(num_layers):
        entry = {"layer": i}
        for side, base in (("k", 12.0), ("v", 3.0)):
            amax = (base * (0.5 + torch.rand(num_kv_heads, generator=g))).tolist()
            if amax_per_head is not None:
                amax = [float(x) for x in amax_per_head[(i, side)]]
            a = torch.tensor(amax)
            if granularity == "tensor":
                s = (a.max() * clip / FMT_MAX[fmt]).reshape(1)
            elif granularity == "head":
                s = (a * clip / FMT_MAX[fmt]).reshape(num_kv_heads, 1, 1)
            else:  # channel
                s = (a.reshape(num_kv_heads, 1, 1) * torch.linspace(0.2, 1.0, D).reshape(1, 1, D)) * clip / FMT_MAX[fmt]
            tensors[tensor_name(i, side)] = s
            truth[(i, side)] = (s.clone(), amax)
            entry[side] = {"clip_ratio": clip, "heldout": {"chosen": 0.01, "absmax": 0.012, "unity": 0.5}}
            if with_amax:
                entry[side]["amax"] = amax
        layers.append(entry)
    spec = {"format": fmt, "granularity": granularity, "group_size": None, "symmetric": symmetric,
            "dynamic": dynamic}
    meta = {
        "kvcal_version": "0.1.0",
        "model": {"id": "tiny-llama", "config_sha256": "0" * 64, "architecture": "LlamaForCausalLM",
                  "model_type": model_type, "num_layers": num_layers, "num_attention_heads": H, "num_kv_heads": num_kv_heads,
                  "head_dim": D, "max_position_embeddings": 256, "weight_precision": "float32"},
        "kv": {"quantized_tensors": ["k", "v"], "key_position": key_position, "k": dict(spec), "v": dict(spec),
               "residual_window": 0, "sink_tokens": 0},
        "calibration": {"objective": "attention_kl", "seed": 0},
        "corpus": {"path": "calibration_sets/chat.jsonl", "sha256": "ab" * 32, "samples": 64, "tokens": 20000,
                   "length_percentiles": {"p50": 280, "p90": 480, "p99": 512, "max": 512}, "truncated": 3},
        "layers": layers,
    }
    return write_artifact(out, tensors, meta), truth


def make_checkpoint(out: Path, sharded: bool = True, num_layers: int = L) -> Path:
    """Save a randomly initialised tiny Llama with ``save_pretrained`` (two shards if ``sharded``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=num_layers, hidden_size=64, intermediate_size=128, num_attention_heads=H,
                      num_key_value_heads=H_KV, vocab_size=128, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out, max_shard_size="400KB" if sharded else "50GB")
    return out


def edited_copy(src: Path, dst: Path, edit, resign: bool = False) -> Path:
    """A copy ``dst`` of the artifact directory ``src`` whose kv_scales.safetensors has ``edit(meta, tensors)``
    applied (the parsed ``kvcal`` metadata and the tensor dict, edited in place); the file's other header
    entries are kept, and so is the metadata string itself when ``edit`` left the metadata as it was.
    ``resign``: recompute the content hash after the edit, as a writer other than kvcal might. Returns ``dst``."""
    import json
    import shutil

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from kvcal.artifact import CONTENT_HASH_KEY, content_sha256

    shutil.copytree(src, dst)
    f = dst / "kv_scales.safetensors"
    with safe_open(str(f), "pt") as fh:
        header = fh.metadata()
    tensors = load_file(str(f))
    meta = json.loads(header["kvcal"])
    edit(meta, tensors)
    if resign:
        meta[CONTENT_HASH_KEY] = content_sha256(meta, tensors)
    if meta != json.loads(header["kvcal"]):
        header = {**header, "kvcal": json.dumps(meta)}
    save_file(tensors, str(f), metadata=header)
    return dst

