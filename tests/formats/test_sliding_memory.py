"""Memory that knows sliding windows: kvcal's cache (what each layer holds), vLLM 0.33's pages (its
SlidingWindowSpec admission bound and hybrid grouping, read from vllm/v1/kv_cache_interface.py and
vllm/v1/core/kv_cache_planning.py), and `kvcal memory` on a GGUF answered from its header in seconds."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from kvcal.cli import main
from kvcal.engines.vllm.memory import vllm_cache_bytes, vllm_layer_tokens
from kvcal.formats.memory import ModelShape, cache_bytes, model_shape
from kvcal.formats.spec import preset

#: Gemma 3 270M: 18 layers, every 6th global, the others sliding window 512; 1 KV head x 256
GEMMA = ModelShape(18, 1, 256, 32768, tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(18)))


def test_model_shape_reads_layer_types():
    """model_shape turns a config's layer_types into per-layer windows (sliding_attention: the config's sliding_window
    8, full_attention: 0); all-full layer types give no windows (None), and an unsupported type (chunked_attention) is a
    ValueError naming it."""
    cfg = {"num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
           "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"] * 2}
    assert model_shape(cfg).layer_windows == (8, 0, 8, 0)
    assert model_shape({**cfg, "layer_types": ["full_attention"] * 4}).layer_windows is None
    with pytest.raises(ValueError, match="chunked_attention"):
        model_shape({**cfg, "layer_types": ["chunked_attention"] * 4})


def test_kvcal_cache_counts_sliding_layers_by_hand():
    """bf16 at 32768: 3 global layers x 32768 tokens + 15 sliding x 511, each token 2 x 256 x 2 = 1024 bytes."""
    assert cache_bytes(GEMMA, preset("bf16"), 32768) == (3 * 32768 + 15 * 511) * 1024 == 108_512_256
    # below the window every layer holds every token
    assert cache_bytes(GEMMA, preset("bf16"), 300) == 18 * 300 * 1024
    # the same shape without layer types counts every layer at full length (the old figure)
    full = ModelShape(18, 1, 256, 32768)
    assert cache_bytes(full, preset("bf16"), 32768) == 18 * 32768 * 1024


def test_vllm_pages_for_sliding_layers_by_hand():
    """fp8 (512 bytes per token per layer). At 32768: each global layer 2048 blocks of 16 = 32768 slots; each
    sliding layer ceil(min(511 + 2048, 32768) / 16) + 1 = 160 + 1 = 161 blocks = 2576 slots. At 100 tokens a
    sliding layer still takes its +1 block: ceil(100/16) + 1 = 8 blocks = 128 slots, a global one 7 = 112."""
    assert vllm_layer_tokens(512, 32768) == 2576 and vllm_layer_tokens(0, 32768) == 32768
    assert vllm_cache_bytes(GEMMA, "fp8", 32768) == (3 * 32768 + 15 * 2576) * 512 == 70_115_328
    assert vllm_cache_bytes(GEMMA, "fp8", 100, 2) == 2 * (3 * 112 + 15 * 128) * 512
    # a larger max_num_batched_tokens keeps more in-flight slots: min(511 + 8192, 32768) -> 544 + 1 blocks
    assert vllm_cache_bytes(GEMMA, "fp8", 32768, max_num_batched_tokens=8192) == (3 * 32768 + 15 * 545 * 16) * 512


def test_vllm_hybrid_group_padding():
    """5 sliding + 2 full layers: group size min(5, 2) = 2 (5 is not under 1.5 x 2), so the sliding type is
    padded to 6 layers: one padding layer's sliding pages more. 3 sliding + 2 full: 3 is not under 1.5 x 2 = 3
    (vLLM's test is strict), so the group size is 2 again and the sliding type is padded to 4."""
    w = (8, 8, 0, 8, 8, 0, 8)
    shp = ModelShape(7, 1, 32, 256, w)
    per = 2 * 32  # fp8: K and V, 1 head x 32
    s_tok, f_tok = vllm_layer_tokens(8, 200), vllm_layer_tokens(0, 200)
    assert (s_tok, f_tok) == (224, 208)  # sliding: ceil(min(7 + 2048, 200) / 16) + 1 = 14 blocks; full: 13
    assert vllm_cache_bytes(shp, "fp8", 200) == (6 * s_tok + 2 * f_tok) * per
    shp2 = ModelShape(5, 1, 32, 256, (8, 0, 8, 0, 8))
    assert vllm_cache_bytes(shp2, "fp8", 200) == (4 * s_tok + 2 * f_tok) * per


def write_header_gguf(path: Path) -> Path:
    """A GGUF holding Gemma 3 270M's header fields (and a 262,144-entry vocabulary) but no weights."""
    import gguf

    w = gguf.GGUFWriter(str(path), "gemma3")
    for k, v in {"block_count": 18, "context_length": 32768, "embedding_length": 640, "feed_forward_length": 2048,
                 "attention.head_count": 4, "attention.head_count_kv": 1, "attention.key_length": 256,
                 "attention.value_length": 256, "attention.sliding_window": 512}.items():
        w.add_uint32(f"gemma3.{k}", v)
    w.add_token_list([f"t{i}" for i in range(262144)])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path


def test_memory_on_a_gguf_reads_its_header(tmp_path, monkeypatch):
    """kvcal memory on a Gemma 3 GGUF answers from the header (transformers' conversion would first decode all
    262,144 vocabulary strings, 41 s on 2 cores): 18 layers, every 6th global (transformers' Gemma3TextConfig
    rule), bf16 at 32768 = 108,512,256 bytes as counted by hand above; plan counts the vocabulary."""
    import kvcal.models

    monkeypatch.setenv("KVCAL_CACHE", str(tmp_path / "cache"))

    def no_conversion(*a, **k):
        raise AssertionError("transformers' full GGUF conversion was reached")

    monkeypatch.setattr(kvcal.models, "load_model_config", no_conversion)
    f = write_header_gguf(tmp_path / "g.gguf")
    fields = kvcal.models.gguf_config_fields(str(f))
    assert model_shape(fields) == GEMMA
    assert fields["vocab_size"] == 262144 and fields["tie_word_embeddings"] is True
    r = CliRunner().invoke(main, ["memory", "--model", str(f), "--format", "bf16", "--context", "32768"])
    assert r.exit_code == 0, r.output
    assert "cache bytes (context 32768, batch 1): 108512256 " in r.output
    assert "15 sliding-window (W = 512), 3 full-attention" in r.output
    r = CliRunner().invoke(main, ["plan", "--model", str(f), "--gpu-mem", "8GiB"])
    assert r.exit_code == 0, r.output
    assert "15 of 18 layers are sliding-window layers" in r.output
