"""kvcal evaluate: acceptance parsing, decode mode, the kvcal-eval/1 JSON, CLI exit codes.

Tiny random Llama models for the logic; one test on the embedded model (marked ``model``)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from helpers.models import TINY_LLAMA_8, save_tiny_llama
from helpers.runtime import make_plan, tiny_model, write_tiny_artifact
from helpers.tokenizers import CharTok

from kvcal.errors import KvcalError
from kvcal.evaluate import (
    DEFAULT_ACCEPT,
    EvalConfig,
    default_accept,
    evaluate,
    judge,
    parse_accept,
    to_json,
)

TOP_KEYS = {"schema", "artifact", "corpus", "model", "regimes", "results", "per_layer", "memory", "notes",
            "methods", "description", "passed", "exit_code"}
ROW_KEYS = {"method", "mode", "context", "batch", "ppl", "delta_ppl", "kl_mean", "kl_p999", "top1_agree",
            "greedy_agree", "greedy_prefix", "tokens", "windows", "status", "criteria", "failed"}


def test_parse_accept_table():
    """parse_accept reads 'kl_mean<=2e-3,delta_ppl<=0.05' and ' top1_agree >= 0.9 ' into (metric, op, value)
    tuples; an unknown metric, a missing operator, empty text and a non-number are refused with KvcalError."""
    assert parse_accept("kl_mean<=2e-3,delta_ppl<=0.05") == [("kl_mean", "<=", 2e-3), ("delta_ppl", "<=", 0.05)]
    assert parse_accept(" top1_agree >= 0.9 ") == [("top1_agree", ">=", 0.9)]
    for bad, msg in [("kl<=1", "unknown"), ("kl_mean=1", "METRIC<=VALUE"), ("", "empty"),
                     ("kl_mean<=abc", "METRIC<=VALUE"), ("kl_mean<=1..2", "not a number")]:
        with pytest.raises(KvcalError, match=msg):
            parse_accept(bad)


def test_judge_and_defaults():
    """judge reports a failed bound with its values, PASS when all hold, FAIL on NaN or a missing metric;
    default_accept picks the bar of a plan's mean payload bits (hand-worked for k4v2 and a mixed plan)."""
    row = {"kl_mean": 3e-3, "delta_ppl": 0.01, "top1_agree": 0.95}
    assert judge(row, parse_accept("kl_mean<=2e-3,delta_ppl<=0.05")) == ("FAIL", ["kl_mean=0.003 not <= 0.002"])
    assert judge(row, parse_accept("kl_mean<=5e-3,top1_agree>=0.9"))[0] == "PASS"
    assert judge({"kl_mean": float("nan")}, parse_accept("kl_mean<=1"))[0] == "FAIL"  # NaN never passes
    assert judge({}, parse_accept("greedy_agree>=0.5"))[0] == "FAIL"  # missing metric fails
    assert default_accept(make_plan("fp8")) == DEFAULT_ACCEPT[8]
    assert default_accept(make_plan("kivi4")) == DEFAULT_ACCEPT[4]
    assert default_accept(make_plan("kivi3")) == DEFAULT_ACCEPT[3]
    assert default_accept(make_plan("kivi2")) == DEFAULT_ACCEPT[2]
    assert default_accept(make_plan("int4_static")) == DEFAULT_ACCEPT[4]
    assert default_accept(make_plan("bf16")) == DEFAULT_ACCEPT[16]
    # mixed plans (--bits, k4v2) are held to the bar of their mean payload bits, not their weakest side
    from kvcal.formats.granularity import PerChannelTokenGroup, PerToken
    from kvcal.formats.spec import TensorQuantSpec
    from kvcal.plan import KVPlan, LayerPlan, SidePlan

    def side(bits):
        return SidePlan(TensorQuantSpec(f"int{bits}", PerToken()), clip_ratio=torch.ones(2))

    k4v2 = KVPlan([LayerPlan(SidePlan(TensorQuantSpec("int4", PerChannelTokenGroup(8), symmetric=False),
                                      clip_ratio=torch.ones(2)), side(2))] * 3)
    assert default_accept(k4v2) == DEFAULT_ACCEPT[3]  # mean (4 + 2) / 2 = 3
    mixed = KVPlan([LayerPlan(side(2), side(3))] + [LayerPlan(side(4), side(5))] * 3)
    assert default_accept(mixed) == DEFAULT_ACCEPT[4]  # (2 + 3 + 3·(4 + 5)) / 8 = 4.0, though one side is int2


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


def test_evaluate_json_document(tmp_path, tiny):
    """evaluate's JSON document: schema, artifact sha256 (recomputed here), every method × mode row with its
    token count, 16-bit reference zeros, per-layer KL, bytes per token and measured == expected bytes."""
    art = write_tiny_artifact(tmp_path, tiny, make_plan("int8", sinks=1))
    corpus = tmp_path / "c.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 12)
    cfg = EvalConfig(str(art), str(corpus), contexts=(48,), batches=(2,), windows=2, decode_tokens=3,
                     greedy_tokens=3, per_layer_tokens=32)
    doc = evaluate(cfg, log=lambda s: None, progress=False, model=tiny, tokenizer=CharTok())
    assert TOP_KEYS <= set(doc) and doc["schema"] == "kvcal-eval/1"
    import hashlib
    from pathlib import Path

    f = Path(art) / "kv_scales.safetensors" if Path(art).is_dir() else Path(art)
    assert doc["artifact"]["sha256"] == hashlib.sha256(f.read_bytes()).hexdigest()  # what `kvcal report` checks
    methods = {"16-bit", "artifact", "bf16-cache", "fp8-unity", "fp8-absmax", "kivi4", "kivi2"}
    assert set(doc["methods"]) == methods
    assert doc["regimes"] == [{"context": 48, "batch": 2}]
    rows = doc["results"]
    assert {(r["method"], r["mode"]) for r in rows} == {(m, mo) for m in methods for mo in ("teacher_forced", "decode")}
    for r in rows:
        assert ROW_KEYS <= set(r)
        assert r["status"] == ("REFERENCE" if r["method"] == "16-bit" else r["status"])
        assert r["status"] in ("PASS", "FAIL", "INCONCLUSIVE", "REFERENCE")
        assert r["tokens"] == (2 * 47 if r["mode"] == "teacher_forced" else 2 * 3)
        if r["method"] == "16-bit":
            assert r["kl_mean"] == 0.0 and r["delta_ppl"] == 0.0
    dec = {r["method"]: r for r in rows if r["mode"] == "decode"}
    assert dec["artifact"]["greedy_agree"] is not None and 0 <= dec["kivi2"]["greedy_prefix"] <= 1
    assert set(doc["per_layer"]) == methods - {"16-bit"}
    assert len(doc["per_layer"]["artifact"]["k_attention_kl"]) == 2
    mem = doc["memory"]
    assert mem["bytes_per_token"]["fp8-unity"] * 2 == mem["bytes_per_token_16bit"]
    assert all(m["allocated_bytes"] == m["expected_bytes"] for m in mem["measured"])
    assert "throughput" in doc["description"] and any("not measured" in n for n in doc["notes"])
    assert doc["passed"] is all(r["status"] == "PASS" for r in rows if r["method"] == "artifact")
    assert json.loads(to_json(doc))["schema"] == "kvcal-eval/1"


# ---- CLI ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm_tokenizer):
    """A tiny random Llama saved as an HF directory with the embedded model's tokenizer."""
    return save_tiny_llama(tmp_path_factory, smollm_tokenizer, "tinyllama", vocab_size=len(smollm_tokenizer), **TINY_LLAMA_8)


def _cli_artifact(tmp_path, tiny_dir, name="fp8"):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_dir)
    from kvcal.formats.spec import preset
    from kvcal.plan import KVPlan

    plan = KVPlan.uniform(2, preset(name))
    for lp in plan.layers:
        lp.k.scale = torch.full((1, 1, 1, 1), 0.01)
        lp.v.scale = torch.full((1, 1, 1, 1), 0.01)
    return write_tiny_artifact(tmp_path, m, plan)


def test_cli_exit_codes(tmp_path, tiny_dir):
    """`kvcal evaluate` exits 0 on PASS (stage lines under --quiet), 1 on FAIL, 2 on a bad --accept, a context
    past max_position_embeddings (also before loading, from metadata) and an unwritable --json."""
    from kvcal.cli import main

    art = _cli_artifact(tmp_path, tiny_dir)
    corpus = tmp_path / "c.txt"
    corpus.write_text("Once upon a time there was a small model that cached keys and values. " * 8)
    base = ["evaluate", "--artifact", str(art), "--corpus", str(corpus), "--model", str(tiny_dir), "--context", "32",
            "--windows", "2", "--no-baselines", "--quiet", "--decode-tokens", "2", "--greedy-tokens", "2"]
    # one window has no spread: its bound is infinite, so the bar cannot be passed, only found undecided (exit 1)
    one = [*base]
    one[one.index("--windows") + 1] = "1"
    r = CliRunner().invoke(main, [*one, "--accept", "kl_mean<=10"])
    assert r.exit_code == 1 and "artifact: INCONCLUSIVE" in r.output, r.output
    # KL over 2 windows of a tiny model is far below 10 nats: the one-sided bound (t_{0.95,1} = 6.31 x sd / sqrt 2)
    # of two per-window KLs each < 1 is < 10, so the bar passes on its bound
    r = CliRunner().invoke(main, [*base, "--accept", "kl_mean<=10", "--json", str(tmp_path / "e.json")])
    assert r.exit_code == 0, r.output
    assert "artifact: PASS" in r.output
    # --quiet drops the progress bars, not the stage lines
    assert "teacher-forced: 2 windows x 32 tokens" in r.output and "decode: 2 windows x 32 tokens, batch 1" in r.output
    doc = json.loads((tmp_path / "e.json").read_text())
    assert doc["schema"] == "kvcal-eval/1" and doc["passed"] and doc["exit_code"] == 0
    r = CliRunner().invoke(main, [*base, "--mode", "teacher_forced", "--accept", "kl_mean<=0,ppl<=1"])  # attainable, never met
    assert r.exit_code == 1, r.output
    assert "artifact: FAIL" in r.output and "FAIL (" in r.output
    r = CliRunner().invoke(main, [*base, "--accept", "kl<=1"])
    assert r.exit_code == 2 and "error:" in r.output and "unknown" in r.output
    r = CliRunner().invoke(main, [*base, "--context", "4096"])
    assert r.exit_code == 2 and "max_position_embeddings 128" in r.output  # kvcal.models.check_max_positions
    # refused from the artifact's metadata, before any model is loaded (this --model does not exist)
    no_model = [*base[:6], str(tmp_path / "no-such-model"), *base[7:]]
    r = CliRunner().invoke(main, [*no_model, "--context", "4096"])
    assert r.exit_code == 2 and "max_position_embeddings 128 (artifact metadata)" in r.output
    # an unwritable --json is refused before the evaluation runs
    (tmp_path / "afile").write_text("x")
    r = CliRunner().invoke(main, [*no_model, "--json", str(tmp_path / "afile" / "e.json")])
    assert r.exit_code == 2 and "cannot write --json" in r.output and "Traceback" not in r.output


def test_cli_refuses_other_model(tmp_path, tiny_dir):
    """`kvcal evaluate` with an artifact made for 3 KV heads exits 2 naming num_kv_heads."""
    from transformers import AutoModelForCausalLM

    from kvcal.cli import main

    m = AutoModelForCausalLM.from_pretrained(tiny_dir)
    art = write_tiny_artifact(tmp_path, m, make_plan("fp8"), num_kv_heads=3)
    corpus = tmp_path / "c.txt"
    corpus.write_text("text " * 100)
    r = CliRunner().invoke(main, ["evaluate", "--artifact", str(art), "--corpus", str(corpus), "--model",
                                  str(tiny_dir), "--context", "16", "--quiet"])
    assert r.exit_code == 2 and "num_kv_heads" in r.output


# ---- embedded model ----------------------------------------------------------------------------------

@pytest.mark.model
def test_embedded_runtime_matches_protocol_a(smollm_model, smollm_tokenizer, shared_data):
    """SmolLM2-135M, FP8 unity with a sink, through the runtime cache (prefill 128 tokens, then 8 decode
    steps of one token), checked where the arithmetic is shared and nowhere else:

    - prefill logits == Protocol A on the same ``[1, 128]`` ids, exactly (same shapes, same kernels);
    - every layer's cache holds exactly ``plan.fake_quant`` of the keys/values the model handed it —
      prefill and each decode step (FP8 per-tensor fake-quant is elementwise, so exact);
    - the decoded logits == Protocol A over all 136 ids with the decode steps' own keys/values
      substituted, up to float32 reassociation only. A decode step computes its new token's K/V
      with a 1-row matmul, the reference with a 136-row one; an ulp of difference can cross an
      FP8 rounding boundary and move an element by a whole e4m3 step (0.0625·|x| at most) — no
      bound holds on that, so the substitution removes it: with the codes equal, what is left is
      the reassociation of fp32 sums. Its size: each fp32 dot product of length n ≤ 1536 carries
      a relative error ≤ γ_n ≈ n·2⁻²⁴ ≈ 9.2e-5 of the sum of its |terms| (Higham, Thm. 3.1); with
      RMSNorm renormalising every layer's input, that is ~1e-2 per logit of |terms| ~ 10² at worst, and
      1e-1 leaves 10x for propagation through 30 layers (an order-of-magnitude argument; the typical
      √n·2⁻²⁴ error is 100x smaller, ~5e-5 seen). The greedy token must agree wherever the
      reference's top-2 margin exceeds twice the difference (a difference below half the margin
      cannot reorder them, so a failure there means a real mismatch, not rounding);
    - allocated bytes == the accounting.
    """
    from kvcal.capture.hooks import attention_hook
    from kvcal.evaluate import fp8_plan, plan_hook, text_windows
    from kvcal.runtime import QuantizedKVCache

    text = (shared_data / "wikitext2_valid.txt").read_text(encoding="utf-8")[:20000]
    ids = text_windows(smollm_tokenizer, text, 136, 2)
    L = smollm_model.config.num_hidden_layers
    plan = fp8_plan(L, [(1.0, 1.0)] * L)
    plan.sink_tokens = 1
    cache = QuantizedKVCache(plan, smollm_model.config)
    received: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {i: [] for i in range(L)}
    for i, layer in enumerate(cache.layers):
        def update(k, v, *args, _orig=layer.update, _i=i, **kwargs):
            received[_i].append((k.clone(), v.clone()))
            return _orig(k, v, *args, **kwargs)

        layer.update = update
    with torch.no_grad():
        pre = smollm_model(ids[:, :128], cache=cache, use_cache=True).logits
        steps = [smollm_model(ids[:, t : t + 1], cache=cache, use_cache=True).logits[:, -1] for t in range(128, 136)]
        with attention_hook(smollm_model, plan_hook(plan)):
            ref_pre = smollm_model(ids[:, :128], use_cache=False).logits
    assert torch.equal(pre, ref_pre)
    assert all(len(r) == 9 for r in received.values())
    for i in range(L):
        for j, side in enumerate(("k", "v")):
            x = torch.cat([r[j] for r in received[i]], dim=2)  # [1, 3, 136, 64] as the model produced them
            stored = getattr(cache.layers[i], side).read()
            assert torch.equal(stored, plan.fake_quant(i, side, x)), (i, side)

    def substituted(module, q, k, v, mask, kwargs):
        i = module.layer_idx
        k, v = k.clone(), v.clone()
        k[:, :, 128:] = torch.cat([r[0] for r in received[i][1:]], dim=2)
        v[:, :, 128:] = torch.cat([r[1] for r in received[i][1:]], dim=2)
        return plan.fake_quant(i, "k", k), plan.fake_quant(i, "v", v)

    with torch.no_grad(), attention_hook(smollm_model, substituted):
        ref = smollm_model(ids, use_cache=False).logits[:, 128:]
    dec = torch.stack(steps, 1)
    diff = (dec - ref).abs().max().item()
    assert diff < 1e-1
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * diff
    assert torch.equal(dec.argmax(-1)[clear], ref.argmax(-1)[clear])
    assert cache.allocated_bytes() == cache.expected_bytes()
    assert cache.layers[5].k.data.dtype == torch.float8_e4m3fn


def test_eval_config_refuses_a_device_torch_cannot_use():
    """EvalConfig refuses ``--device cuda`` on a CPU-only torch, and an unknown device name, with a one-line
    KvcalError before anything loads; the default device is cpu."""
    from kvcal.evaluate.run import EvalConfig

    if not torch.cuda.is_available():
        with pytest.raises(KvcalError, match="--device cuda: this torch build .* use --device cpu"):
            EvalConfig("a", "c", device="cuda")
    with pytest.raises(KvcalError, match="choose cpu, cuda or cuda:N"):
        EvalConfig("a", "c", device="tpu")
    assert EvalConfig("a", "c").device == "cpu"


def test_decode_tokens_above_the_context_are_disclosed(tmp_path, tiny):
    """--decode-tokens above context − 1 decodes context − 1 tokens at that context (11 at context 12, all 20
    at 48); the JSON records the count per context and a note says why."""
    art = write_tiny_artifact(tmp_path, tiny, make_plan("int8", sinks=1))
    corpus = tmp_path / "c.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 12)
    cfg = EvalConfig(str(art), str(corpus), contexts=(12, 48), batches=(1,), windows=1, decode_tokens=20,
                     greedy_tokens=0, baselines=False, modes=("decode",), per_layer_tokens=32)
    doc = evaluate(cfg, log=lambda s: None, progress=False, model=tiny, tokenizer=CharTok())
    assert doc["description"]["decode_tokens_by_context"] == {"12": 11, "48": 20}
    assert any("--decode-tokens 20 exceeds context 12 − 1: 11 tokens decoded at context 12" in n for n in doc["notes"])
    assert {r["context"]: r["tokens"] for r in doc["results"] if r["method"] == "artifact"} == {12: 11, 48: 20}
