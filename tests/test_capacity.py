"""Capacity planner: sizes, parameter counts and capacities hand-computed for SmolLM2-135M."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvcal.capacity import (
    PlanConfig,
    max_batch,
    max_context,
    param_count,
    parse_reserve,
    parse_size,
    plan_capacity,
    render_plan,
)
from kvcal.errors import KvcalError

# SmolLM2-135M(-Instruct) config.json, the fields the planner reads
SMOL = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "max_position_embeddings": 8192, "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False}
# embeddings 49152*576; per layer: attention 576*576*2 + 576*192*2, MLP 3*576*1536, norms 2*576; final norm 576
SMOL_PARAMS = 49152 * 576 + 30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576) + 576
GiB = 2**30


@pytest.mark.parametrize("text,want", [
    ("80GiB", 80 * GiB), ("80GB", 80 * 10**9), ("24G", 24 * GiB), ("512MiB", 512 * 2**20), ("1.5GiB", 3 * GiB // 2),
    ("2TB", 2 * 10**12), ("1000", 1000), (4096, 4096), (" 16 gib ", 16 * GiB),
])
def test_parse_size(text, want):
    """parse_size reads binary (GiB, G, MiB) and decimal (GB, TB) units, fractions, plain integers and padded
    lowercase text to the hand-computed byte counts."""
    assert parse_size(text) == want


@pytest.mark.parametrize("bad", ["80 GiBs", "abc", "-1G", "", "G", "1e3GB"])
def test_parse_size_rejects(bad):
    """Unreadable sizes (a misspelt unit, words, negative, empty, a bare unit, exponent notation) raise
    KvcalError whose message shows the 80GiB form."""
    with pytest.raises(KvcalError, match="80GiB"):
        parse_size(bad)


def test_parse_reserve():
    """parse_reserve reads a percentage of GPU memory or a fixed size with its description; 150% and x% raise
    KvcalError naming the reserve."""
    assert parse_reserve("10%", 1000) == (100, "10% of GPU memory")
    assert parse_reserve("4GiB", 10) == (4 * GiB, "fixed 4GiB")
    for bad in ("150%", "x%"):
        with pytest.raises(KvcalError, match="reserve"):
            parse_reserve(bad, 1000)


def test_param_count_smollm2():
    """param_count of SmolLM2-135M gives the hand-computed split and the 134,515,008 total; an
    untied head, attention/MLP biases, Qwen2's QKV biases and a nested text_config change it by hand-computed
    amounts; MoE configs and a missing intermediate_size raise KvcalError."""
    p = param_count(SMOL)
    assert SMOL_PARAMS == 134_515_008
    assert p == {"embeddings": 28_311_552, "attention": 26_542_080, "mlp": 79_626_240, "norms": 35_136,
                 "lm_head": 0, "total": SMOL_PARAMS}
    untied = param_count({**SMOL, "tie_word_embeddings": False})
    assert untied["lm_head"] == 49152 * 576 and untied["total"] == SMOL_PARAMS + 49152 * 576
    biased = param_count({**SMOL, "attention_bias": True, "mlp_bias": True})
    assert biased["total"] - SMOL_PARAMS == 30 * ((576 + 2 * 192 + 576) + (2 * 1536 + 576))
    assert param_count({**SMOL, "model_type": "qwen2"})["total"] - SMOL_PARAMS == 30 * (576 + 2 * 192)
    assert param_count({"text_config": SMOL})["total"] == SMOL_PARAMS
    with pytest.raises(KvcalError, match="mixture of experts"):
        param_count({**SMOL, "num_local_experts": 8})
    with pytest.raises(KvcalError, match="intermediate_size"):
        param_count({k: v for k, v in SMOL.items() if k != "intermediate_size"})


def test_plan_smollm2_1gib_hand_computed():
    """The 1 GiB capacity plan for SmolLM2 matches hand-worked figures: weights, reserve and KV budget,
    bytes/token per option, max context per batch (including kivi2's whole 32-token key groups and raw
    min/max), max concurrency per context, and the rendered text."""
    plan = plan_capacity(SMOL, PlanConfig("1GiB", kv_configs="fp8,kivi2"), "smollm2-135m")
    weights = SMOL_PARAMS * 2  # bf16
    reserve = int(GiB * 0.10)  # 107,374,182
    budget = GiB - weights - reserve
    assert (weights, budget) == (269_030_016, 697_337_626)
    assert plan.weights["bytes"] == weights and plan.reserve["bytes"] == reserve and plan.kv_budget == budget
    assert [o["name"] for o in plan.options] == ["bf16", "fp8", "kivi2"]
    # bytes/token: 16-bit 2*30*3*64*2 = 23040; fp8 11520; kivi2 90 heads*(16+8 K + 16+8 V) = 4320
    assert [o["bytes_per_token"] for o in plan.options] == [23040, 11520, 4320]
    rows = {r["batch"]: r for r in plan.max_context}
    assert sorted(rows) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    # batch 1, 16-bit: floor(697337626 / 23040) = 30266 tokens fit -> capped at 8192
    assert rows[1]["bf16"] == {"max_context": 8192, "fits": 30266, "capped": True}
    # batch 8, 16-bit: floor(697337626 / (8*23040)) = 3783
    assert rows[8]["bf16"] == {"max_context": 3783, "fits": 3783, "capped": False}
    # batch 32, fp8 (+240 B of fp32 scales): floor((697337626 - 240) / (32*11520)) = 1891
    assert rows[32]["fp8"]["max_context"] == 1891
    # batch 32, kivi2: 5044 by bytes/token, but keys are allocated in whole 32-token groups and
    # each sequence keeps its open key group's float32 raw min / max (2*64*4 = 512 B per head-layer):
    # T=5024 -> K 5024*16 + 157*64*4, V 5024*24, + 512 per head-layer = 241,664; x90x32 + 720 = 695,993,040 <= budget
    # T=5025 -> K 5056*16 + 158*64*4, V 5025*24, + 512 = 242,456; x90x32 + 720 = 698,274,000 > budget
    assert rows[32]["kivi2"]["max_context"] == 5024
    conc = {r["context"]: r for r in plan.max_concurrency}
    assert sorted(conc) == [1024, 2048, 4096, 8192]  # 1k..128k capped at the model max
    # 8192 tokens: 16-bit floor(697337626 / 188743680) = 3; fp8 floor((b-240)/94371840) = 7;
    # kivi2 floor((b-720)/35435520) = 19
    assert (conc[8192]["bf16"], conc[8192]["fp8"], conc[8192]["kivi2"]) == (3, 7, 19)
    assert conc[1024]["bf16"] == 697_337_626 // (1024 * 23040) == 29
    text = render_plan(plan)
    for s in ("269,030,016", "697,337,626", "10% of GPU memory", "8,192*(30,266)", "3,783", "5,024",
              "weight precision is independent"):
        assert s in text


def test_search_is_exact_against_cache_bytes():
    """max_context and max_batch are the exact boundary of cache_bytes for four presets and two budgets: the
    answer fits and one more token (or sequence) does not."""
    from kvcal.formats.memory import cache_bytes, model_shape
    from kvcal.formats.spec import preset

    shape = model_shape(SMOL)
    for name in ("bf16", "int4_static", "kivi4", "nvfp4"):
        cfg = preset(name, residual_window=64, sink_tokens=4)
        for budget in (10**6, 123_456_789):
            t = max_context(shape, cfg, 3, budget)
            assert cache_bytes(shape, cfg, t, 3) <= budget < cache_bytes(shape, cfg, t + 1, 3)
            b = max_batch(shape, cfg, 1000, budget)
            assert b == 0 or cache_bytes(shape, cfg, 1000, b) <= budget
            assert cache_bytes(shape, cfg, 1000, b + 1) > budget


def test_plan_errors(tmp_path):
    """A GPU smaller than the weights (no room for a KV cache), an unknown KV config (fp9) and an unknown
    weights dtype (int3) raise KvcalError with those messages."""
    with pytest.raises(KvcalError, match="no room for a KV cache"):
        plan_capacity(SMOL, PlanConfig("256MiB"))
    with pytest.raises(KvcalError, match="neither a preset"):
        plan_capacity(SMOL, PlanConfig("8GiB", kv_configs="fp9"))
    with pytest.raises(KvcalError, match="weights-dtype"):
        PlanConfig("8GiB", weights_dtype="int3")


def test_plan_with_artifact_kv_config(tmp_path):
    """An artifact as --kv-config is planned with 11,520 bytes/token plus its 720 bytes of per-head fp32
    scales (hand-computed concurrency 7 at 8192 tokens), and an artifact of another model (4 layers) raises
    KvcalError naming num_layers=4."""
    from helpers.report import make_artifact

    art = make_artifact(tmp_path / "a", num_layers=30, num_kv_heads=3, head_dim=64, per_head=True)
    plan = plan_capacity(SMOL, PlanConfig("1GiB", kv_configs=f"fp8,{art}"))
    opt = plan.options[-1]
    assert opt["name"] == "a" and opt["bytes_per_token"] == 11520 and "fp8_e4m3 head" in opt["description"]
    # per-head fp32 scales: 2*30*3*4 = 720 static bytes -> floor((b - 720) / (8192*11520)) = 7
    assert plan.max_concurrency[-1]["a"] == 7
    small = make_artifact(tmp_path / "small")
    with pytest.raises(KvcalError, match="num_layers=4"):
        plan_capacity(SMOL, PlanConfig("1GiB", kv_configs=str(small)))


def test_plan_options_sharing_a_name_keep_their_own_numbers(tmp_path, monkeypatch):
    """Plan options that share a name (an artifact directory named like a preset, two artifacts with one
    basename) each keep their own capacity, labelled by the path given; an option listed twice and a bare
    name that is both a preset and a directory are refused."""
    from helpers.report import make_artifact, make_meta, make_tensors

    from kvcal.artifact import write_artifact

    a = make_artifact(tmp_path / "x" / "int4", num_layers=30, num_kv_heads=3, head_dim=64, per_head=True)
    meta = make_meta(num_layers=30, num_kv_heads=3, head_dim=64)
    meta["kv"]["sink_tokens"] = 2048  # 16-bit sinks: a different cache size than ``a``
    b = write_artifact(tmp_path / "y" / "int4", make_tensors(meta), meta)
    plan = plan_capacity(SMOL, PlanConfig("1GiB", kv_configs=f"int4,{a},{b}"))
    names = [o["name"] for o in plan.options]
    assert names == ["bf16", "int4", str(a), str(b)]
    alone = {n: plan_capacity(SMOL, PlanConfig("1GiB", kv_configs=n)) for n in ("int4", str(a), str(b))}
    for n, p in alone.items():
        own = p.options[-1]["name"]
        assert [r[n] for r in plan.max_concurrency] == [r[own] for r in p.max_concurrency]
        assert [r[n] for r in plan.max_context] == [r[own] for r in p.max_context]
    assert [r[str(a)] for r in plan.max_concurrency] != [r[str(b)] for r in plan.max_concurrency]
    with pytest.raises(KvcalError, match="twice"):
        plan_capacity(SMOL, PlanConfig("1GiB", kv_configs=f"{a},{a}"))
    monkeypatch.chdir(tmp_path / "x")
    with pytest.raises(KvcalError, match="both a preset and a directory"):
        plan_capacity(SMOL, PlanConfig("1GiB", kv_configs="int4"))
    assert plan_capacity(SMOL, PlanConfig("1GiB", kv_configs="./int4")).options[-1]["name"] == "int4"


def test_cli_plan(tmp_path):
    """kvcal plan --json reports the hand-computed GPU memory, reserve, fp32 weights and KV budget and the
    options asked for; the text output lists max concurrency and kivi2; an unreadable --gpu-mem exits 2 with
    output starting error: cannot read size."""
    from kvcal.cli import main

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(SMOL))
    r = CliRunner().invoke(main, ["plan", "--model", str(cfg), "--gpu-mem", "24G", "--reserve", "2GiB",
                                  "--weights-dtype", "fp32", "--kv-config", "fp8,int4", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["gpu_mem_bytes"] == 24 * GiB and d["reserve"]["bytes"] == 2 * GiB
    assert d["weights"]["bytes"] == SMOL_PARAMS * 4
    assert d["kv_budget_bytes"] == 22 * GiB - SMOL_PARAMS * 4
    assert [o["name"] for o in d["options"]] == ["bf16", "fp8", "int4"]
    r = CliRunner().invoke(main, ["plan", "--model", str(cfg), "--gpu-mem", "80GiB"])
    assert r.exit_code == 0 and "max concurrency at each context" in r.output and "kivi2" in r.output
    r = CliRunner().invoke(main, ["plan", "--model", str(cfg), "--gpu-mem", "eighty"])
    assert r.exit_code == 2 and r.output.startswith("error: cannot read size")


def test_real_smollm2_config_matches_hand_count():
    """The embedded model's own config (no weights loaded) gives the hand-computed count."""
    from kvcal.models import load_model_config

    try:
        conf = load_model_config("smollm2-135m")
    except KvcalError as e:
        pytest.skip(str(e))
    assert param_count(conf)["total"] == SMOL_PARAMS
