"""kvcal recommend --engine llamacpp end to end on a tiny random Llama (CliRunner): every K/V cache-type pair's
bytes by hand, each status from Student-t bounds recomputed here, cheapest PASS chosen, its KL equal to Protocol A's
on the same windows, the folklore pairs measured beside it, the llama-server line; refusals before the model loads."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from kvcal.cli import main

REPO = Path(__file__).resolve().parents[2]
CHAT = REPO / "calibration_sets" / "chat.jsonl"
# head_dim 64: llama.cpp rotates quantized caches in blocks of 64 and quantizes in blocks of 32
L, H_KV, D = 2, 1, 64

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("tiny-llama-llamacpp")
    cfg = LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=128, num_hidden_layers=L,
                      num_attention_heads=2, num_key_value_heads=H_KV, head_dim=D, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(d)
    smollm_tokenizer.save_pretrained(d)
    return d


def run(args):
    return CliRunner().invoke(main, ["recommend", "--engine", "llamacpp", "--quiet", *map(str, args)])


#: ggml row bytes of one token's K or V in one layer (H_KV x D = 64 values): q4_0 2 blocks x 18 B, q8_0 2 x 34 B,
#: f16 64 x 2 B (ggml's type sizes: block_q4_0 = fp16 d + 16 B, block_q8_0 = fp16 d + 32 B)
ROW = {"q4_0": 2 * 18, "q8_0": 2 * 34, "f16": 128}


def _upper_lower(xs, up_level, lo_level):
    from scipy.stats import t

    m, n = statistics.fmean(xs), len(xs)
    s = statistics.stdev(xs) / math.sqrt(n)
    return m + t.ppf(up_level, n - 1) * s, m - t.ppf(lo_level, n - 1) * s


def test_recommend_pairs_end_to_end(tiny_dir, tmp_path):
    """Every ordered pair of q4_0, q8_0, f16 but f16/f16 (8 rows); bytes = L x (row_k + row_v); a measured row's
    status is PASS iff its KL upper bound (pass level) is inside the bar, FAIL iff the lower (fail level) is outside;
    the chosen row is the cheapest PASS and every cheaper row was measured and did not pass; q8_0/q8_0 and
    q4_0/q4_0 are measured on the chosen row's windows; the chosen KL equals Protocol A's (teacher_forced with the
    engine's plan) on the same windows."""
    out = tmp_path / "rec"
    # on this random model q8_0/q8_0 costs KL ~1e-6 and pairs with a q4_0 side ~1e-4: a bar 10x from both
    accept = "kl_mean<=1e-5"
    r = run(["--corpus", CHAT, "--model", tiny_dir, "--out", out, "--context", 64, "--windows", 2, "--max-windows", 4,
             "--cache-types", "q4_0,q8_0,f16", "--accept", accept])
    doc = json.loads((out / "deploy.json").read_text())
    md = (out / "deploy.md").read_text()
    ev = doc["data"]["evaluation"]
    cands = doc["candidates"]
    assert doc["menu"] == "pairs" and len(cands) == 8
    assert {(c["type_k"], c["type_v"]) for c in cands} == {(k, v) for k in ROW for v in ROW} - {("f16", "f16")}
    for c in cands:
        assert c["bytes_per_token"] == L * (ROW[c["type_k"]] + ROW[c["type_v"]])
        assert c["vs_16bit"] == c["bytes_per_token"] / (L * 2 * ROW["f16"])
        if "kl_mean" not in c:
            assert c["status"] == "NOT-MEASURED"
            continue
        kl = c["per_window"]["kl_mean"]
        assert len(kl) == c["windows"] in (2, 4)
        up, lo = _upper_lower(kl, ev["pass_level"], ev["fail_level"])
        assert c["bounds"]["kl_mean"]["upper"] == pytest.approx(up, rel=1e-9)
        assert c["status"] == ("PASS" if up <= 1e-5 else "FAIL" if lo > 1e-5 else "INCONCLUSIVE")
    common = {c["dtype"]: c for c in cands if c["dtype"] in ("q8_0/q8_0", "q4_0/q4_0")}
    assert doc["common"] == ["q8_0/q8_0", "q4_0/q4_0"] and all("kl_mean" in c for c in common.values())
    ch = doc["chosen"]
    assert r.exit_code == 0 and ch is not None
    assert ch["bytes_per_token"] > min(c["bytes_per_token"] for c in cands)  # the cheapest pair did not pass
    ok = [c for c in cands if c["status"] == "PASS"]
    assert ch["bytes_per_token"] == min(c["bytes_per_token"] for c in ok)
    assert all(c["status"] in ("FAIL", "INCONCLUSIVE") for c in cands if c["bytes_per_token"] < ch["bytes_per_token"])
    assert all(c["windows"] >= ch["windows"] for c in common.values())
    serve = f"llama-server -m {tiny_dir} -fa on -ctk {ch['type_k']} -ctv {ch['type_v']}"
    assert doc["commands"] == {"export": None, "serve": serve} and serve in md and serve in r.output
    assert "not a GGUF file" in " ".join(doc["notes"])
    # Protocol A on the same windows, with the engine's plan, through a different code path (teacher_forced)
    from kvcal.engines import engine
    from kvcal.evaluate.protocol_a import teacher_forced
    from kvcal.evaluate.windows import corpus_stream, cut_windows
    from kvcal.models import load_model, load_tokenizer

    tok = load_tokenizer(str(tiny_dir))
    ids, _ = corpus_stream(str(CHAT), tok)
    windows = cut_windows(ids, 64, ch["windows"])
    model = load_model(str(tiny_dir))
    # a llama checkpoint: llama.cpp's converter interleaves each query/key head, and recommend says it did
    assert model.config.model_type == "llama" and doc["kq_interleaved"] is True
    plan = engine("llamacpp").pair_plan(ch["type_k"], ch["type_v"], L, model_type="llama")
    res = teacher_forced(model, windows, {"x": plan}, progress=False)
    assert res["x"]["kl_mean"] == pytest.approx(ch["kl_mean"], rel=1e-12)  # same forward; float64 window sums
    assert res["x"]["delta_ppl"] == pytest.approx(ch["delta_ppl"], rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("args,words", [
    (["--dtypes", "fp8"], "--dtypes: not with --engine llamacpp"),
    (["--max-skip", "2"], "--max-skip: not with --engine llamacpp"),
    (["--cache-types", "q4_0,q3_k"], "--cache-types: unknown llama.cpp cache type 'q3_k'"),
    (["--cache-types", "q4_0,q4_0"], "is named twice"),
    (["--cache-types", "q8_0", "--max-windows", "1", "--windows", "2"], "--max-windows 1 is below --windows 2"),
])
def test_recommend_pairs_refusals(tmp_path, args, words):
    """Bad options: exit 2 with one line naming the option, before any model loads (the model path does not
    exist), no output directory."""
    out = tmp_path / "rec"
    r = run(["--corpus", CHAT, "--model", tmp_path / "no-model", "--out", out, *args])
    assert r.exit_code == 2, r.output
    assert words in r.output and "Traceback" not in r.output
    assert not out.exists()


def test_checkpoint_of_an_unread_conversion_is_refused(tmp_path, smollm_tokenizer):
    """A checkpoint whose llama.cpp conversion kvcal has not read (Granite: ``conversion/granite.py`` permutes q/k in
    one class and not in another) would have its blocks of 32 guessed: exit 2, one line naming --model, the
    model_type and the fix (the .gguf), before weights load (config only), no output directory."""
    from transformers import GraniteConfig

    d = tmp_path / "granite"
    GraniteConfig(vocab_size=49152, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512).save_pretrained(d)
    smollm_tokenizer.save_pretrained(d)
    out = tmp_path / "rec"
    r = run(["--corpus", CHAT, "--model", d, "--out", out, "--cache-types", "q8_0"])
    assert r.exit_code == 2, r.output
    assert f"--model {d}: model_type 'granite'" in r.output and "pass the .gguf" in r.output
    assert "Traceback" not in r.output and not out.exists()


def test_nothing_passes_says_what_is_closest(tiny_dir, tmp_path):
    """A bar no pair can meet (KL <= 1e-12): exit 1, every pair measured (none passed), and a note naming the pair
    whose KL bound is lowest and the 16-bit cache as the safe choice."""
    out = tmp_path / "rec"
    r = run(["--corpus", CHAT, "--model", tiny_dir, "--out", out, "--context", 64, "--windows", 2, "--max-windows", 2,
             "--cache-types", "q8_0,f16", "--accept", "kl_mean<=1e-12"])
    assert r.exit_code == 1, r.output
    doc = json.loads((out / "deploy.json").read_text())
    assert doc["chosen"] is None and doc["commands"] is None
    assert all("kl_mean" in c and c["status"] != "PASS" for c in doc["candidates"])
    best = min(doc["candidates"], key=lambda c: c["bounds"]["kl_mean"]["bound"])
    assert any(f"closest by its KL bound: {best['dtype']}" in n and "-ctk f16 -ctv f16" in n for n in doc["notes"])


def test_cache_types_only_with_llamacpp(tmp_path):
    """--cache-types belongs to llama.cpp: refused with --engine vllm."""
    r = CliRunner().invoke(main, ["recommend", "--engine", "vllm", "--corpus", str(CHAT), "--out",
                                  str(tmp_path / "o"), "--cache-types", "q8_0"])
    assert r.exit_code == 2 and "--cache-types: not with --engine vllm" in r.output
