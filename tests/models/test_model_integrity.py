"""Wrong inputs that would load are refused or disclosed: a checkpoint with missing weights, a GGUF without tensors,
an export into a checkpoint whose weights differ from the calibrated ones, "held-out" figures with no
held-out split, and ``--max-seq-len`` past the model's positions. Tiny random Llamas in ``tmp_path``
(2–4 layers, hidden 64) with a byte-level tokenizer built here: no embedded model, seconds each."""

from __future__ import annotations

import json
import time

import pytest
import torch
from click.testing import CliRunner

from kvcal.cli import main
from kvcal.errors import KvcalError, ModelLoadError

LAYERS = 4


def _tokenizer():
    """A byte-level BPE tokenizer without merges (256 byte tokens + 3 specials), no files needed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    for s in ("<s>", "</s>", "<pad>"):
        vocab[s] = len(vocab)
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def _config(**kw):
    from transformers import LlamaConfig

    base = dict(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)
    return LlamaConfig(**{**base, **kw})


def save_tiny(d, seed: int = 0, dtype=torch.float32, **kw):
    """Save a seeded random tiny Llama (+ tokenizer) with ``save_pretrained`` into ``d``."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    m = LlamaForCausalLM(_config(**kw)).to(dtype)
    m.save_pretrained(d)
    _tokenizer().save_pretrained(d)
    return d


def drop_layers(d, layers: set[int], extra: dict | None = None):
    """Rewrite ``d/model.safetensors`` without the tensors of ``layers`` (plus ``extra`` tensors)."""
    from safetensors.torch import load_file, save_file

    sd = load_file(str(d / "model.safetensors"))
    sd = {k: v for k, v in sd.items() if not any(f".layers.{i}." in k for i in layers)}
    sd.update(extra or {})
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def _corpus(path, n: int = 6):
    texts = [f"Sample {i}: the quick brown fox jumps over the lazy dog near river {i}." * 2 for i in range(n)]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def _calibrate(tmp_path, model_dir, out="art", samples: int = 6, **kw):
    from kvcal.calibrate import CalibrateConfig, calibrate

    opts = dict(max_seq_len=64, reservoir=2, heldout_reservoir=2, search_tokens=32, max_queries=16)
    cfg = CalibrateConfig(corpus=str(_corpus(tmp_path / f"c{samples}.jsonl", samples)), out=str(tmp_path / out),
                          model=str(model_dir), **{**opts, **kw})
    return calibrate(cfg, log=lambda s: None, progress=False)


# ---- missing / unexpected weights at load --------------------------------------------------------

def test_checkpoint_missing_layers_is_refused_naming_them(tmp_path):
    """A checkpoint without its last layers' weights (config and tokenizer intact) is refused in one line
    naming the missing weights, never loaded with random layers."""
    from kvcal.models import load_model

    d = drop_layers(save_tiny(tmp_path / "m"), {2, 3})
    with pytest.raises(ModelLoadError) as e:
        load_model(str(d))
    msg = str(e.value)
    assert "\n" not in msg and "missing" in msg and "model.layers.2." in msg and "layers 2-3" in msg
    r = CliRunner().invoke(main, ["calibrate", "--corpus", str(_corpus(tmp_path / "c.jsonl")), "--model", str(d),
                                  "--out", str(tmp_path / "o"), "--quiet", "--max-seq-len", "64"])
    assert r.exit_code == 2 and "Traceback" not in r.output and "missing" in r.output
    assert not (tmp_path / "o").exists()


def test_checkpoint_unexpected_weights_are_refused_but_kv_scales_and_tied_head_are_not(tmp_path):
    """A clean tiny checkpoint with a tied lm_head loads (head shares the embedding), an extra KV-scale tensor
    is accepted, and an unknown weight (model.layers.7.mlp.up_proj.weight) is refused with ModelLoadError
    naming it as unexpected."""
    from kvcal.models import load_model

    d = save_tiny(tmp_path / "m")  # tie_word_embeddings: lm_head.weight is not in the file and not "missing"
    m = load_model(str(d))  # a clean checkpoint loads
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    # KV-scale tensors of a kvcal / llm-compressor export are not model weights for transformers: accepted
    drop_layers(d, set(), {"model.layers.0.self_attn.k_scale": torch.ones(1)})
    load_model(str(d))
    drop_layers(d, set(), {"model.layers.7.mlp.up_proj.weight": torch.zeros(3)})
    with pytest.raises(ModelLoadError, match=r"unexpected.*model\.layers\.7\.mlp\.up_proj\.weight"):
        load_model(str(d))


def _write_gguf(path, n_blocks: int, tensor_blocks: list[int]):
    """A llama GGUF with a vocabulary and tensors only for ``tensor_blocks`` (hidden 64)."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(n_blocks)
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(300)])
    for i in tensor_blocks:
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_without_tensors_is_refused_before_building_the_model(tmp_path, monkeypatch):
    """A GGUF with a vocabulary and no tensors is refused from its tensor list, before transformers is asked to
    build a (random, full-size) model."""
    import transformers

    from kvcal.models import load_model

    def never(*a, **k):
        raise AssertionError("from_pretrained must not run for a GGUF without tensors")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", never)
    t0 = time.perf_counter()
    with pytest.raises(ModelLoadError) as e:
        load_model(str(_write_gguf(tmp_path / "empty.gguf", 30, [])))
    assert "\n" not in str(e.value) and "no weight tensors" in str(e.value) and "empty.gguf" in str(e.value)
    assert time.perf_counter() - t0 < 10  # wall clock, 57 ms seen: catches a hang; `never` above is the real check
    with pytest.raises(ModelLoadError, match=r"no tensors for blocks 15-29 of 30"):
        load_model(str(_write_gguf(tmp_path / "part.gguf", 30, list(range(15)))))


# ---- weight fingerprint: recorded at calibration, checked by export --model-dir ----------------

def test_fingerprint_is_the_same_for_fp32_bf16_copies_and_differs_for_other_weights(tmp_path):
    """The fingerprint samples values rounded to bfloat16, so a checkpoint saved in fp32 and its bf16
    copy (same weights, another storage dtype) match, read from the loaded model or from the files;
    other weights (another seed) or lost layers do not."""
    from transformers import LlamaForCausalLM

    from kvcal.export.checkpoint import checkpoint_weights_fingerprint, open_checkpoint
    from kvcal.weights import compare_fingerprints, weights_fingerprint

    a = save_tiny(tmp_path / "a")
    m = LlamaForCausalLM.from_pretrained(a)
    fp = weights_fingerprint(m)
    assert fp["num_layers"] == LAYERS and len(fp["layers"]) == LAYERS
    m.to(torch.bfloat16).save_pretrained(tmp_path / "a16")
    m16 = LlamaForCausalLM.from_pretrained(tmp_path / "a16", dtype=torch.float32)
    assert weights_fingerprint(m16) == fp
    assert checkpoint_weights_fingerprint(open_checkpoint(a), fp) == fp
    assert checkpoint_weights_fingerprint(open_checkpoint(tmp_path / "a16"), fp) == fp
    other = checkpoint_weights_fingerprint(open_checkpoint(save_tiny(tmp_path / "b", seed=1)), fp)
    assert "layers 0-3" in compare_fingerprints(fp, other) and "embedding" in compare_fingerprints(fp, other)
    c = save_tiny(tmp_path / "c")
    drop_layers(c, {3})
    assert compare_fingerprints(fp, checkpoint_weights_fingerprint(open_checkpoint(c), fp)) == \
        "layer 3 (weights missing from the checkpoint)"
    assert compare_fingerprints(fp, fp) is None


def test_fingerprint_of_gguf_loaded_model_matches_its_hf_copy(tmp_path):
    """The GGUF path: a model loaded from a GGUF (dequantized by transformers, GGUF tensor names) and
    its HF copy (``save_pretrained`` of the loaded model, HF names) fingerprint the same, so a
    GGUF-calibrated artifact exported into the copy is not refused. GGUF written from the tiny model
    with f32 tensors in llama.cpp's layout (q/k rows permuted as convert_hf_to_gguf does)."""
    import gguf
    import numpy as np
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from kvcal.export.checkpoint import checkpoint_weights_fingerprint, open_checkpoint
    from kvcal.models import load_model
    from kvcal.weights import weights_fingerprint

    src = save_tiny(tmp_path / "src", num_hidden_layers=2)
    m = LlamaForCausalLM.from_pretrained(src)
    c = m.config

    def permute(w, n_head):  # convert_hf_to_gguf.LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]) if getattr(c, "rope_parameters", None) else 10000.0)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    tok = _tokenizer()
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([1] * len(vocab))
    w.add_token_merges([])
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    sd = m.state_dict()
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"].numpy())
    w.add_tensor("output_norm.weight", sd["model.norm.weight"].numpy())
    for i in range(c.num_hidden_layers):
        for hf, gg in names.items():
            t = sd[f"model.layers.{i}.{hf}.weight"].numpy()
            if gg == "attn_q":
                t = permute(t, c.num_attention_heads)
            elif gg == "attn_k":
                t = permute(t, c.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{gg}.weight", np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    mg = load_model(str(path))  # GGUF tensor names, q/k permuted, read back by transformers
    fp = weights_fingerprint(mg)
    assert fp == weights_fingerprint(m)
    # the HF copy of the GGUF model (transformers refuses save_pretrained of a GGUF-loaded model, so its
    # state dict goes into a plain Llama), in bfloat16 as copies usually are
    cfg = {k: v for k, v in mg.config.to_dict().items() if k != "quantization_config"}
    copy = LlamaForCausalLM(type(m.config).from_dict(cfg))
    copy.load_state_dict(mg.state_dict())
    copy.to(torch.bfloat16).save_pretrained(tmp_path / "copy")
    assert checkpoint_weights_fingerprint(open_checkpoint(tmp_path / "copy"), fp) == fp
    assert weights_fingerprint(AutoModelForCausalLM.from_pretrained(tmp_path / "copy", dtype=torch.float32)) == fp


def test_export_refuses_a_model_dir_with_other_weights_and_warns_for_old_artifacts(tmp_path):
    """The artifact records a weight fingerprint, and export refuses a --model-dir with the same config but other
    weights in one line naming the layers; the calibrated checkpoint is accepted without warning, an artifact
    without a fingerprint is exported with a one-line warning, and a malformed fingerprint is refused."""
    from kvcal.artifact import load_artifact, write_artifact
    from kvcal.export import export

    a = save_tiny(tmp_path / "a")
    res = _calibrate(tmp_path, a)
    art = load_artifact(res["out"])
    b = save_tiny(tmp_path / "b", seed=1)  # same config, other weights (another fine-tune)
    r = CliRunner().invoke(main, ["export", "--artifact", res["out"], "--target", "vllm", "--out",
                                  str(tmp_path / "no"), "--model-dir", str(b)])
    assert r.exit_code == 2 and "Traceback" not in r.output
    line = r.output.strip().splitlines()
    assert len(line) == 1 and "weights differ" in line[0] and "layers 0-3" in line[0] and "re-calibrate" in line[0]
    assert not (tmp_path / "no").exists()
    assert art.metadata["model"]["weights"]["layers"] and art.metadata["model"]["weights"]["scheme"]
    res_ok = export(art, "vllm", tmp_path / "ok", model_dir=a)  # the calibrated checkpoint: accepted, no warning
    assert not [w for w in res_ok.warnings if "fingerprint" in w]
    # an artifact written before the fingerprint existed: exported, with a one-line warning
    meta = json.loads(json.dumps(art.metadata))
    del meta["model"]["weights"]
    old = write_artifact(tmp_path / "old", art.tensors, meta)
    r = CliRunner().invoke(main, ["export", "--artifact", str(old), "--target", "vllm", "--out",
                                  str(tmp_path / "oldx"), "--model-dir", str(b)])
    assert r.exit_code == 0, r.output
    warn = [x for x in r.output.splitlines() if "fingerprint" in x]
    assert len(warn) == 1 and "cannot verify" in warn[0]
    meta = json.loads(json.dumps(art.metadata))
    meta["model"]["weights"]["layers"] = "all"  # a malformed fingerprint: one line, not a traceback
    bad = write_artifact(tmp_path / "bad", art.tensors, meta)
    r = CliRunner().invoke(main, ["export", "--artifact", str(bad), "--target", "vllm", "--out",
                                  str(tmp_path / "badx"), "--model-dir", str(a)])
    assert r.exit_code == 2 and "fingerprint is malformed" in r.output and "Traceback" not in r.output


# ---- held-out figures without a held-out split ----------------------------------------------------

def test_one_sample_report_does_not_call_calibration_data_held_out(tmp_path):
    """With one sample there is no held-out split: the metadata and every report say the figures were measured
    on the calibration data, never that they are held-out."""
    from kvcal.report.data import error_data_label

    d = save_tiny(tmp_path / "m")
    res = _calibrate(tmp_path, d, samples=1)
    cal = res["metadata"]["calibration"]
    assert cal["heldout_samples"] == 0
    assert cal["error_data"] == "calibration data (no held-out split: 1 sample)"
    assert error_data_label(res["metadata"]) == cal["error_data"]
    rep = (tmp_path / "art" / "report.md").read_text()
    assert "held-out" not in rep.lower().replace("no held-out split", "")
    assert "no held-out split: 1 sample" in rep
    from kvcal.report.disclosure import build_report
    from kvcal.report.document import to_markdown

    text = to_markdown(build_report(res["metadata"], figures=False))
    assert "held-out" not in text.lower().replace("no held-out split", "") and "no held-out split: 1 sample" in text
    full = _calibrate(tmp_path, d, out="art6", samples=6)  # with a split: labelled held-out as before
    assert full["metadata"]["calibration"]["error_data"].startswith("held-out")
    assert "## Held-out error per layer" in (tmp_path / "art6" / "report.md").read_text()


def test_one_sample_int_report_and_disclosure_are_labelled(tmp_path):
    """An int8 calibration on one sample calls nothing held-out in report.md, the summary table or the
    disclosure Markdown, and the disclosure states no held-out split: 1 sample."""
    from kvcal.report.disclosure import build_report
    from kvcal.report.document import to_markdown

    d = save_tiny(tmp_path / "m", num_hidden_layers=2)
    res = _calibrate(tmp_path, d, samples=1, preset="int8", probe_tokens=0, sink_tokens=1)  # seconds, not a minute
    rep = (tmp_path / "art" / "report.md").read_text()
    assert "held-out" not in rep.lower().replace("no held-out split", "")
    assert "held-out" not in res["table"].lower().replace("no held-out split", "")
    text = to_markdown(build_report(res["metadata"], figures=False))
    assert "held-out" not in text.lower().replace("no held-out split", "")
    assert "no held-out split: 1 sample" in text


# ---- --max-seq-len past the model's positions ----------------------------------------------------

def test_calibrate_refuses_max_seq_len_above_max_positions(tmp_path):
    """--max-seq-len 129 on a model with max_position_embeddings 128 exits 2 with the one line naming both
    numbers and writes no output; the API (max_seq_len=512) raises KvcalError the same way, nothing
    written."""
    d = save_tiny(tmp_path / "m")  # max_position_embeddings 128
    r = CliRunner().invoke(main, ["calibrate", "--corpus", str(_corpus(tmp_path / "c.jsonl")), "--model", str(d),
                                  "--out", str(tmp_path / "o"), "--quiet", "--max-seq-len", "129"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert "--max-seq-len 129 exceeds the model's max_position_embeddings 128" in r.output
    assert not (tmp_path / "o").exists()
    with pytest.raises(KvcalError, match="max_position_embeddings 128"):
        _calibrate(tmp_path, d, out="o2", max_seq_len=512)
    assert not (tmp_path / "o2").exists()


def test_quiet_silences_the_gguf_dequantization_bar(capsys):
    """transformers' GGUF loop uses a bare ``tqdm`` that ignores ``disable_progress_bar()``: inside
    ``gguf_bar_follows_transformers`` it draws nothing once transformers' bars are off (``--quiet``), draws as before
    while they are on, and the module's own ``tqdm`` is back afterwards."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    from kvcal.models.load import gguf_bar_follows_transformers

    original = gguf_utils.tqdm  # the name kvcal swaps; a transformers that renames it fails here, not silently
    was = hf_logging.is_progress_bar_enabled()
    try:
        for enabled in (False, True):
            (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
            with gguf_bar_follows_transformers():
                assert sum(gguf_utils.tqdm(range(5), desc="Converting and de-quantizing GGUF tensors...")) == 10
            assert ("Converting" in capsys.readouterr().err) == enabled
            assert gguf_utils.tqdm is original
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()
