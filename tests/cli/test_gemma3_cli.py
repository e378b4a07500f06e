"""Every command on a tiny random Gemma 3 (sliding + global layers, one KV head, q/k-norm, a tokenizer that adds
BOS): calibrate (fp8), evaluate (teacher-forced and decode), memory, plan, inspect, export --target vllm run to
completion (exit 0, no traceback) and state figures checked here by hand."""

from __future__ import annotations

import json

import pytest
from helpers.cli import run_cli as run
from helpers.models import calibrate_tiny_gemma3, torch_threads

TEXT = "calibration_sets/text.jsonl"
PER_TOKEN_LAYER = 2 * 1 * 32 * 2
#: a random-weight model's perplexity (~5e4) moves by tens under any cache format, so the default ΔPPL bars are
#: a coin toss there: these tests check what evaluate measures and counts, not whether a bar passes
ACCEPT = "kl_mean<=1"  # bf16 bytes per token per layer: K and V, 1 KV head x 32


@pytest.fixture(scope="module")
def gemma(tmp_path_factory, smollm_tokenizer):
    """(model dir, fp8 artifact calibrated on 8 x 64 tokens); single-threaded for the module."""
    with torch_threads(1):
        yield calibrate_tiny_gemma3(tmp_path_factory, smollm_tokenizer, "tiny-gemma3")


def test_calibrate_writes_every_layer(gemma):
    """The fp8 artifact calibrated on the tiny Gemma 3 records its shape (4 layers, 1 KV head, head_dim 32) and holds
    exactly one k_scale and one v_scale for each of the 4 layers, sliding and global alike."""
    from kvcal.artifact import load_artifact

    art = load_artifact(gemma[1])
    assert art.metadata["model"]["num_layers"] == 4 and art.metadata["model"]["num_kv_heads"] == 1
    assert art.metadata["model"]["head_dim"] == 32
    assert set(art.tensors) == {f"model.layers.{i}.self_attn.{s}_scale" for i in range(4) for s in "kv"}


def test_evaluate_teacher_forced_and_decode(gemma, tmp_path, one_thread):
    """Both modes run on the sliding layers; the artifact's decode row reads the runtime cache (which used to
    refuse sliding layers after Protocol A had run) and its measured allocation equals the contract."""
    d, art = gemma
    js = tmp_path / "e.json"
    run(["evaluate", "--accept", ACCEPT, "--model", str(d), "--artifact", str(art), "--corpus", TEXT, "--context", "32", "--windows", "2",
         "--mode", "teacher_forced,decode", "--greedy-tokens", "4", "--json", str(js), "--quiet"])
    doc = json.loads(js.read_text())
    rows = {(r["method"], r["mode"]) for r in doc["results"]}
    assert {("artifact", "teacher_forced"), ("artifact", "decode")} <= rows
    measured = {m["method"]: m for m in doc["memory"]["measured"]}
    assert measured["artifact"]["allocated_bytes"] == measured["artifact"]["expected_bytes"]
    # fp8 per-tensor at 31 cached tokens: sliding layers 7 tokens, the global one 31; 64 bytes/token/layer + 8 scales
    assert measured["artifact"]["allocated_bytes"] == (3 * 7 + 31) * 64 + 8 * 4
    # at context 32: (3*7 + 32) tokens; the bf16 reference counts the same tokens: (3*7 + 32) * 128
    fp8 = doc["memory"]["cache_bytes"]["artifact"][0]
    assert fp8["bytes"] == (3 * 7 + 32) * 64 + 32 and fp8["vs_16bit"] == fp8["bytes"] / ((3 * 7 + 32) * 128)


def test_memory_counts_sliding_layers(gemma):
    """bf16 at 256 tokens: 3 sliding layers hold W-1 = 7 tokens, the global layer 256: (3*7 + 256) * 128 bytes."""
    out = run(["memory", "--model", str(gemma[0]), "--format", "bf16", "--context", "256"])
    assert f"cache bytes (context 256, batch 1): {(3 * 7 + 256) * PER_TOKEN_LAYER} " in out


def test_plan_inspect_export(gemma, tmp_path):
    """On the tiny Gemma 3 each command exits 0 without a traceback: plan's max concurrency at context 256 for bf16
    and fp8 equals a hand count over the sliding and global layers; inspect
    names the layer types exactly (3 sliding-window layers 0, 1, 3 with W = 8, 1 full-attention layer 2); export
    --target vllm --model-dir prints a ``vllm serve`` command and writes a checkpoint holding k_scale and v_scale for
    all 4 layers."""
    d, art = gemma
    out = run(["plan", "--model", str(d), "--gpu-mem", "1GiB"])
    # hand count: budget = 1 GiB - bf16 weights (parameters counted here from the saved model) - 10% reserve
    # (floor); a sequence at the model max 256 holds 3 sliding layers x (W - 1 = 7) + 256 global tokens of
    # 1 KV head x head_dim 32 x K and V: 128 B/token/layer in bf16, 64 in fp8 (+ 8 fp32 scales once per cache)
    from transformers import AutoModelForCausalLM

    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(str(d)).parameters())
    budget = 2**30 - 2 * params - (2**30 // 10)
    want = (budget // ((3 * 7 + 256) * 128), (budget - 8 * 4) // ((3 * 7 + 256) * 64))
    table = out.split("max concurrency at each context:")[1].splitlines()
    row = next(ln.split() for ln in table if ln.split()[:1] == ["256"])
    assert (int(row[1].replace(",", "")), int(row[2].replace(",", ""))) == want, (row, want)
    out = run(["inspect", str(art)])
    assert "layer types: 3 sliding-window (W = 8: layers 0-1,3), 1 full attention (layers 2)" in out
    out = run(["export", "--artifact", str(art), "--target", "vllm", "--model-dir", str(d), "--out", str(tmp_path / "x")])
    assert "vllm serve" in out
    from helpers.models import safetensors_dir

    names = set(safetensors_dir(tmp_path / "x"))
    assert {f"model.layers.{i}.self_attn.{s}_scale" for i in range(4) for s in "kv"} <= names


def test_evaluate_windows_start_with_bos_as_served(gemma, tmp_path, one_thread):
    """The tiny Gemma's tokenizer adds BOS (token 1), so every evaluation window is BOS + 15 stream tokens of the
    .txt tokenized at once; the 16-bit perplexity equals one computed here in float64 from the model's logits on
    windows built by hand (same fp32 forward, so the bound is fp32 rounding of the mean log-probability:
    1e-5 relative), and the document says how the windows start."""
    import math

    import torch

    from kvcal.models import load_model, load_tokenizer

    d, art = gemma
    corpus = "calibration_sets/longdocs.txt"
    js = tmp_path / "e.json"
    run(["evaluate", "--accept", ACCEPT, "--model", str(d), "--artifact", str(art), "--corpus", corpus, "--context", "16", "--windows",
         "2", "--mode", "teacher_forced", "--no-baselines", "--json", str(js), "--quiet"])
    doc = json.loads(js.read_text())
    assert doc["corpus"]["bos_token_id"] == 1 and "starts with BOS (token 1)" in doc["corpus"]["window_source"]
    tok = load_tokenizer(str(d))
    with open(corpus, encoding="utf-8") as f:
        ids = tok(f.read(), add_special_tokens=False).input_ids
    wins = torch.tensor([[1, *ids[0:15]], [1, *ids[15:30]]])
    m = load_model(str(d))
    with torch.no_grad():
        lp = torch.log_softmax(m(wins).logits.double(), -1)[:, :-1]
    nll = -lp.gather(-1, wins[:, 1:, None]).mean().item()
    ref = next(r for r in doc["results"] if r["method"] == "16-bit")
    assert ref["tokens"] == 30
    assert math.isclose(ref["ppl"], math.exp(nll), rel_tol=1e-5)


def test_int4_pre_rope_keys_per_layer_type(gemma, tmp_path, one_thread):
    """--preset int4 stores keys pre-RoPE; Gemma 3 rotates them with base 10k on sliding layers and 1M on the
    global one, so the artifact carries the global layer's own table (k_rope_inv_freq) beside rotary.inv_freq
    (the first pre-RoPE layer's), the loaded plan gives every layer the table the model rotated it with
    (kvcal.models.rope_tables, itself checked against the model's k_norm output in
    tests/formats/test_rope_per_layer_type.py), and both evaluation modes run on it (decode reads the runtime
    cache, whose sliding layers re-rotate at their absolute positions), memory equal to the contract."""
    import torch

    from kvcal.artifact import load_artifact
    from kvcal.models import load_model, rope_tables
    from kvcal.plan import KVPlan

    d = gemma[0]
    out = tmp_path / "int4"
    run(["calibrate", "--model", str(d), "--corpus", TEXT, "--max-samples", "6", "--max-seq-len", "32",
         "--preset", "int4", "--sinks", "1", "--probe-tokens", "0", "--out", str(out), "--quiet"])
    art = load_artifact(out)
    assert [t["k"] for t in art.metadata["kv"]["transforms"]] == ["pre_rope"] * 4
    assert {n for n in art.tensors if "rope" in n} == {"model.layers.2.self_attn.k_rope_inv_freq"}
    plan = KVPlan.from_artifact(art.tensors, art.metadata)
    want = rope_tables(load_model(str(d)))
    for i in range(4):
        assert torch.equal(plan.layers[i].k.rope.inv_freq, want[i].inv_freq), i
    assert not torch.equal(want[0].inv_freq, want[2].inv_freq)
    js = tmp_path / "e.json"
    run(["evaluate", "--accept", ACCEPT, "--model", str(d), "--artifact", str(out), "--corpus", TEXT, "--context", "24", "--windows", "2",
         "--mode", "teacher_forced,decode", "--greedy-tokens", "4", "--no-baselines", "--json", str(js), "--quiet"])
    doc = json.loads(js.read_text())
    measured = {m["method"]: m for m in doc["memory"]["measured"]}
    assert measured["artifact"]["allocated_bytes"] == measured["artifact"]["expected_bytes"]


def test_bits_budget_counts_what_sliding_layers_hold(gemma, tmp_path, one_thread):
    """--bits 4 at --budget-context 64 on the tiny Gemma (W = 8: three sliding layers hold 7 tokens, the global
    one 64): the budget is 4 bits per element the cache holds, (3·7 + 64) tokens × 2 sides × 1 head × 32, not
    4 · 64 · 4 layers; the recorded average is 8 · cache bytes / those elements (worked by hand here) and within
    budget, the cache bytes are the runtime's contract for those layer types, and every spec costs a sliding
    layer less than the global one (7 vs 64 tokens)."""
    from kvcal.artifact import load_artifact
    from kvcal.formats.memory import cache_bytes
    from kvcal.models import load_model_config
    from kvcal.plan import KVPlan

    d = gemma[0]
    out = tmp_path / "bits"
    run(["calibrate", "--model", str(d), "--corpus", TEXT, "--max-samples", "6", "--max-seq-len", "32",
         "--bits", "4", "--budget-context", "64", "--sinks", "1", "--probe-tokens", "0", "--out", str(out), "--quiet"])
    art = load_artifact(out)
    summ = art.metadata["calibration"]
    held = (3 * 7 + 64) * 2 * 1 * 32
    total = summ["cache_bytes_at_context"]
    assert summ["average_bits"] == 8.0 * total / held and summ["average_bits"] <= 4.0
    plan = KVPlan.from_artifact(art.tensors, art.metadata)
    assert total == cache_bytes(load_model_config(str(d)), [plan.kv_config(i) for i in range(4)], 64)
    table = summ["allocation"]["table"]
    for side in "kv":
        slid = next(r for r in table if r["layer"] == 0 and r["side"] == side)["bytes"]
        glob = next(r for r in table if r["layer"] == 2 and r["side"] == side)["bytes"]
        assert all(a < b for a, b in zip(slid, glob, strict=True)), (side, slid, glob)


def test_int8_nvfp4_and_report(gemma, tmp_path, one_thread):
    """--preset int8 and --engine vllm --kv-cache-dtype nvfp4 --skip-layers auto calibrate every layer of the
    tiny Gemma (per-layer scales for all 4 layers; nvfp4's outer scales for both sides, 1 KV head x 32 = 2 NVFP4
    blocks of 16), and report renders the FP8 artifact with an evaluation that states the BOS windows."""
    from kvcal.artifact import load_artifact

    d, fp8 = gemma
    i8 = tmp_path / "int8"
    run(["calibrate", "--model", str(d), "--corpus", TEXT, "--max-samples", "6", "--max-seq-len", "32",
         "--preset", "int8", "--sinks", "1", "--probe-tokens", "0", "--out", str(i8), "--quiet"])
    art = load_artifact(i8)
    assert {lm["layer"] for lm in art.metadata["layers"]} == {0, 1, 2, 3}
    nv = tmp_path / "nvfp4"
    run(["calibrate", "--model", str(d), "--corpus", TEXT, "--max-samples", "8", "--max-seq-len", "32",
         "--engine", "vllm", "--kv-cache-dtype", "nvfp4", "--skip-layers", "auto", "--max-skip", "1",
         "--out", str(nv), "--quiet"])
    art = load_artifact(nv)
    assert {f"model.layers.{i}.self_attn.{s}_outer_scale" for i in range(4) for s in "kv"} <= set(art.tensors)
    assert len(art.metadata["vllm"]["skip_layers"]) == 1
    assert len(art.metadata["vllm"]["skip_layers_choice"]["sensitivity"]) == 4
    js = tmp_path / "e.json"
    run(["evaluate", "--accept", ACCEPT, "--model", str(d), "--artifact", str(fp8), "--corpus", TEXT, "--context",
         "24", "--windows", "2", "--mode", "teacher_forced", "--no-baselines", "--json", str(js), "--quiet"])
    rep = tmp_path / "rep"
    run(["report", "--artifact", str(fp8), "--eval", str(js), "--out", str(rep)])
    md = (rep / "report.md").read_text()
    assert "Gemma3ForCausalLM" in md and "BOS" in md
    # memory per layer type: the artifact records the windows, so the report's figures count 3 sliding layers at
    # min(context, 7) tokens: at 256 tokens (the max context) (3·7 + 256) x 64 bytes + 8 fp32 scales, by hand
    assert load_artifact(fp8).metadata["model"]["layer_windows"] == [8, 8, 0, 8]
    assert "3 of 4 layers are sliding-window layers (W = 8)" in md
    assert "92% of the cached tokens at 256 tokens" in md  # 256 / (3·7 + 256) = 0.924
    from kvcal.report.data import memory_summary

    mem = memory_summary(load_artifact(fp8).metadata, contexts=[256], batches=[1])
    assert mem["cache_bytes"][1] == [(3 * 7 + 256) * 64 + 8 * 4]
