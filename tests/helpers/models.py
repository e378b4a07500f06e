"""Tiny random models saved as Hugging Face checkpoints (a Llama, a Gemma 3 with sliding and global layers), a
checkpoint directory's tensors, and the tiny-Gemma-3 fp8 artifact the CLI and export tests calibrate."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path


def save_tiny_llama(tmp_path_factory, tokenizer, name: str, **config) -> Path:
    """A tiny random Llama (seed 0) saved with ``save_pretrained`` plus ``tokenizer`` into a fresh
    ``tmp_path_factory`` directory ``name``; ``config``: LlamaConfig fields. Returns the directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp(name)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**config)).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


def safetensors_dir(d) -> dict:
    """Every tensor of every ``*.safetensors`` file in directory ``d`` (an exported checkpoint's shards), by name."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def shrink_kv(model_dir: Path, out_dir: Path, factor: float = 2.0 ** -7) -> Path:
    """A copy of the tiny Llama in ``model_dir`` (weights, config, tokenizer) into ``out_dir`` whose keys and values
    are ``factor`` times the original and whose function is unchanged: every ``k_proj``/``v_proj`` weight times
    ``factor``, every ``q_proj``/``o_proj`` weight divided by it (a power of two: exact, so the scores Q·K and the
    output o_proj(V) are the original's). With 2^-7 the keys and values (~1e-3) fall below e4m3's smallest normal
    (2^-6) at vLLM's default scales (1.0): FP8 codes, and NVFP4 block scales, round to a few subnormal steps or 0,
    while calibrated scales keep e4m3's full 3-bit mantissa — calibration beats 1.0 by a wide margin on any machine
    (on the original random model the two are near ties that rounding decides). Returns ``out_dir``."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out_dir)
    f = out_dir / "model.safetensors"
    w = load_file(f)
    for k in w:
        if k.endswith(("k_proj.weight", "v_proj.weight")):
            w[k] = w[k] * factor
        elif k.endswith(("q_proj.weight", "o_proj.weight")):
            w[k] = w[k] / factor
    save_file(w, f, metadata={"format": "pt"})
    return out_dir


def offset_keys(model_dir: Path, layers=(0, 1), channels: int = 4, offset: float = 40.0, seed: int = 0) -> Path:
    """Give the tiny Llama in ``model_dir`` (saved with ``attention_bias=True``) large per-channel key offsets in
    ``layers``, as q/k projection biases produce in real models (Qwen2-style): ``channels`` channels of each KV
    head's ``k_proj`` bias set to ``±offset`` (seeded signs and channels), the rest of the weights unchanged. The
    keys of those layers then have a range set by the offsets, far above their spread — the early-layer keys that
    per-tensor FP8 serves worst. Edits ``model.safetensors`` in place; returns ``model_dir``."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    f = Path(model_dir) / "model.safetensors"
    w = load_file(f)
    g = torch.Generator().manual_seed(seed)
    for i in layers:
        b = w[f"model.layers.{i}.self_attn.k_proj.bias"].clone()
        for h in range(cfg["num_key_value_heads"]):
            ch = torch.randperm(hd, generator=g)[:channels]
            sign = torch.randint(0, 2, (channels,), generator=g).float() * 2 - 1
            b[h * hd + ch] = sign * offset
        w[f"model.layers.{i}.self_attn.k_proj.bias"] = b
    save_file(w, f, metadata={"format": "pt"})
    return Path(model_dir)


#: a tiny Gemma 3 (Gemma3ForCausalLM): 4 layers, sliding window 8 on layers 0, 1, 3 and a global layer 2, one KV
#: head x head_dim 32, q/k-norm (Gemma3Attention always has them), 256 positions
TINY_GEMMA3 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=32, sliding_window=8, query_pre_attn_scalar=32,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                   max_position_embeddings=256, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)


def save_tiny_gemma3(tmp_path_factory, tokenizer, name: str, bos: bool = True, **config) -> Path:
    """A tiny random Gemma 3 (seed 0, :data:`TINY_GEMMA3` updated by ``config``) saved with ``tokenizer`` into a
    fresh directory ``name``. ``bos``: the saved tokenizer adds its BOS token in front of every text, as Gemma's
    does (a TemplateProcessing post-processor on the SmolLM2 vocabulary; SmolLM2's own adds none). Returns the
    directory."""
    import copy

    import torch
    from tokenizers.processors import TemplateProcessing
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    d = tmp_path_factory.mktemp(name)
    tok = copy.deepcopy(tokenizer)
    if bos:
        b, i = tok.bos_token, tok.bos_token_id
        tok.backend_tokenizer.post_processor = TemplateProcessing(single=f"{b}:0 $A:0", pair=f"{b}:0 $A:0 $B:1",
                                                                  special_tokens=[(b, i)])
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(**{"vocab_size": len(tok), "bos_token_id": tok.bos_token_id, **TINY_GEMMA3, **config})
    Gemma3ForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d


#: the 2-layer, 2-KV-head x head_dim 16 tiny Llama several modules calibrate end to end
TINY_LLAMA_16 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                     pad_token_id=2, tie_word_embeddings=True)
#: the 2-layer, head_dim 8 tiny Llama with 128 positions the CLI tests use
TINY_LLAMA_8 = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=128)


@contextmanager
def torch_threads(n: int = 1):
    """``torch.set_num_threads(n)`` inside the block; the previous count is restored afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def calibrate_tiny_gemma3(tmp_path_factory, tokenizer, name: str) -> tuple[Path, Path]:
    """A tiny Gemma 3 (:func:`save_tiny_gemma3`, directory ``name``) and an fp8 artifact ``kvcal calibrate``
    writes for it from calibration_sets/text.jsonl (8 samples x 64 tokens, default options); the command must
    exit 0 without a traceback. Returns ``(model dir, artifact dir)``."""
    from helpers.cli import run_cli

    d = save_tiny_gemma3(tmp_path_factory, tokenizer, name)
    art = tmp_path_factory.mktemp(f"{name}-art") / "art"
    run_cli(["calibrate", "--model", str(d), "--corpus", "calibration_sets/text.jsonl", "--max-samples", "8",
             "--max-seq-len", "64", "--out", str(art), "--quiet"])
    return d, art
