"""Memory accounting: hand-worked SmolLM2-135M numbers, the allocation contract, the CLI."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
import torch
from click.testing import CliRunner

from kvcal.formats.granularity import PerChannelTokenGroup, PerHead, PerToken, PerTokenGroup
from kvcal.formats.memory import (
    ModelShape,
    bytes_per_token,
    bytes_per_token_exact,
    cache_bytes,
    memory_report,
    model_shape,
    side_cache_bytes,
)
from kvcal.formats.quant import quantize
from kvcal.formats.spec import PRESETS, KVCacheConfig, TensorQuantSpec, preset

SMOL = ModelShape(num_layers=30, num_kv_heads=3, head_dim=64, max_position_embeddings=8192)
L, H, D = 30, 3, 64
SIDES_X_LAYERS_X_HEADS = 2 * L * H  # 180 (head, layer, side) rows per token


def per_side(payload_bytes, param_bytes=0.0):
    """bytes/token for the model when every side stores payload + params per head."""
    return SIDES_X_LAYERS_X_HEADS * (payload_bytes + param_bytes)


# Hand-worked: per head and token, D=64 channels.
HAND = {
    "fp16": per_side(64 * 2),  # 23040
    "bf16": per_side(64 * 2),
    "fp8": per_side(64),  # 11520 (+ static per-tensor scales, per layer)
    "fp8_head": per_side(64),
    "fp8_e5m2": per_side(64),
    "int8": per_side(64, 1 * (2 + 2)),  # one g64 group: fp16 scale + fp16 zero point -> 12240
    # keys: 32 payload bytes (static per-channel); values: 32 + 2 groups x (2 + 2) = 40
    "int4_static": L * H * (32 + 40),  # 6480
    # KIVI keys: 32 + 64 channels x (2+2) bytes / 32 tokens = 40; values 40
    "kivi4": per_side(32, 8),  # 7200
    "kivi3": per_side(24, 8),  # 5760 (int3: 64 values -> 24 bytes)
    "kivi2": per_side(16, 8),  # 4320
    "int2": per_side(16, 8),
    "nvfp4": per_side(32, 4),  # 4 fp8 block scales -> 6480
}


def test_hand_worked_16bit_example():
    """A 16-bit SmolLM2 cache costs 2 sides x 30 layers x 3 KV heads x 64 dims x 2 bytes = 23,040 bytes per
    token."""
    assert bytes_per_token(SMOL, preset("fp16")) == 2 * 30 * 3 * 64 * 2 == 23040


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_smollm2_bytes_per_token_every_preset(name):
    """bytes_per_token for every preset equals its hand-worked SmolLM2 figure in HAND (a new preset without
    one fails)."""
    assert name in HAND, "add the hand-worked number for a new preset"
    assert bytes_per_token(SMOL, PRESETS[name]) == HAND[name]


@pytest.mark.parametrize("fmt,payload", [("fp8_e4m3", 64), ("fp8_e4m3fnuz", 64), ("fp8_e5m2", 64), ("int8", 64),
                                         ("int4", 32), ("int3", 24), ("int2", 16), ("nvfp4", 32)])
def test_every_format_per_token_group(fmt, payload):
    """Each format with dynamic per-token groups of 16 (NVFP4's block): 4 groups per head-token."""
    for sym in ([True] if fmt.startswith(("fp8", "nvfp4")) else [True, False]):
        spec = TensorQuantSpec(fmt, PerTokenGroup(16), symmetric=sym)
        params = 4 * (1 if fmt == "nvfp4" else 2 * (1 if sym else 2))
        assert bytes_per_token(SMOL, KVCacheConfig(spec, spec)) == per_side(payload, params)


def test_int4_group_sizes_and_fp32_scales():
    """int4 value groups of 32/64/128 (128 acting as D=64), asymmetric int8 with fp32 per-token scales and
    amortized per-channel-token-group key scales (a fractional figure, exact Fraction) give the hand-worked
    bytes per token."""
    # the README table rows: int4 preset with value groups 32/64/128 (g128 > D acts as D)
    assert bytes_per_token(SMOL, preset("int4_static").with_group_size(32)) == L * H * (32 + 32 + 2 * 4)
    assert bytes_per_token(SMOL, preset("int4_static").with_group_size(64)) == L * H * (32 + 32 + 1 * 4) == 6120
    assert bytes_per_token(SMOL, preset("int4_static").with_group_size(128)) == 6120
    spec = TensorQuantSpec("int8", PerToken(), symmetric=False, scale_dtype=torch.float32)
    assert bytes_per_token(SMOL, KVCacheConfig(spec, spec)) == per_side(64, 8)
    # amortized per-channel-token-group scales can be fractional
    k = TensorQuantSpec("int4", PerChannelTokenGroup(48), symmetric=True)
    cfg = KVCacheConfig(k, TensorQuantSpec("fp16"))
    assert bytes_per_token_exact(SMOL, cfg) == L * H * (32 + Fraction(64 * 2, 48)) + L * H * 128


def test_cache_bytes_hand_worked_window_sinks_partial_groups():
    """cache_bytes for kivi4 with a 32-token window and 4 sinks equals the hand-worked sum of dense, payload,
    key/value scale and static bytes at 100 tokens; one more token costs a whole key group; short contexts are
    dense; batch multiplies all but per-layer metadata."""
    cfg = preset("kivi4", residual_window=32, sink_tokens=4)
    T = 100  # 4 sinks + 32 window + 64 quantized = exactly 2 key groups
    dense = 2 * L * H * (4 + 32) * D * 2
    q = L * H * 64 * 32 * 2  # both sides, 32 payload bytes per token-head
    k_params = L * H * 2 * D * 4  # 2 token groups x 64 channels x (scale + zp) fp16
    v_params = L * H * 64 * 2 * 4  # 64 tokens x 2 channel groups x (scale + zp) fp16
    static = 2 * L * H * 4  # clip_ratio fp32 [H] per dynamic side and layer
    assert cache_bytes(SMOL, cfg, T) == dense + q + k_params + v_params + static
    # one more token opens a partially filled key group: whole group payload + its scales
    extra = L * H * (32 * 32 + D * 4) + L * H * (32 + 2 * 4)
    assert cache_bytes(SMOL, cfg, T + 1) - cache_bytes(SMOL, cfg, T) == extra
    # short context: everything fits in sinks + window
    assert cache_bytes(SMOL, cfg, 20) == 2 * L * H * 20 * D * 2 + static
    assert cache_bytes(SMOL, cfg, 0) == static
    # batch scales everything except per-layer metadata
    assert cache_bytes(SMOL, cfg, T, batch=3) - static == 3 * (cache_bytes(SMOL, cfg, T) - static)


def test_fp8_static_metadata_per_layer():
    """FP8 per-tensor and per-head caches at 8192 tokens add exactly their fp32 scales (2L and 2LH of 4
    bytes), and the int4 preset's static bytes are its per-channel key scale and zero point plus a clip ratio
    per head, by hand."""
    assert cache_bytes(SMOL, preset("fp8"), 8192) == 11520 * 8192 + 2 * L * 4
    assert cache_bytes(SMOL, preset("fp8_head"), 8192) == 11520 * 8192 + 2 * L * H * 4
    # int4 preset keys: per-channel scale + zero point [1,H,1,D] fp32
    r = memory_report(SMOL, preset("int4_static"), 0)
    assert r.static == L * (H * D * 4 * 2 + H * 4)


@pytest.mark.parametrize("name", ["int8", "int4_static", "kivi4", "kivi3", "kivi2", "nvfp4", "fp8_head"])
@pytest.mark.parametrize("n_q", [1, 31, 32, 45])
def test_contract_matches_quantized_tensor_bytes(name, n_q):
    """What quantize() returns for n_q tokens is what the contract allocates for them."""
    shape = ModelShape(1, 2, 40, None)  # D=40: partial channel groups and int3 units too
    cfg = preset(name)
    x = torch.randn(3, 2, n_q, 40, generator=torch.Generator().manual_seed(n_q))
    for spec in (cfg.key, cfg.value):
        part = side_cache_bytes(spec, 2, 40, n_q, 3)
        qt = quantize(x, spec)
        assert qt.payload_nbytes == part["payload"]
        dyn = qt.param_nbytes if spec.dynamic else 0
        if spec.format.value == "nvfp4":
            dyn = qt.scale.numel()  # global scale is per-layer metadata
        if spec.token_group:  # + the open group's raw min / max, float32 [B,H,2,D] (no residual window)
            dyn += 3 * 2 * 2 * 40 * 4
        assert dyn == part["params"]
        if not spec.dynamic:
            assert qt.param_nbytes == part["static"]
    assert cache_bytes(shape, cfg, n_q, 3) == sum(
        sum(side_cache_bytes(s, 2, 40, n_q, 3).values()) for s in (cfg.key, cfg.value))


def test_model_shape_sources_and_errors():
    """model_shape reads a config dict and a nested text_config to SmolLM2's shape and an attribute object to
    its head_dim shape; a missing num_hidden_layers, a zero dimension, a negative context, batch 0 and a
    per-layer list of the wrong length raise ValueError naming what is wrong."""
    cfg = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
           "max_position_embeddings": 8192}
    assert model_shape(cfg) == SMOL
    assert model_shape({"text_config": cfg}) == SMOL

    class Obj:
        num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim = 2, 4, 2, 16
        max_position_embeddings = None

    assert model_shape(Obj()) == ModelShape(2, 2, 16)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        model_shape({"num_attention_heads": 4, "hidden_size": 64})
    with pytest.raises(ValueError, match="positive"):
        ModelShape(0, 1, 1)
    with pytest.raises(ValueError, match="context"):
        cache_bytes(SMOL, preset("fp8"), -1)
    with pytest.raises(ValueError, match="batch"):
        cache_bytes(SMOL, preset("fp8"), 1, batch=0)
    with pytest.raises(ValueError, match="per-layer"):
        bytes_per_token(SMOL, [preset("fp8")] * 3)


def test_per_layer_configs():
    """Per-layer configs (10 kivi4 layers, 20 kivi2) average to the hand-computed bytes per token, and the
    memory report records a per-head key granularity."""
    mixed = [preset("kivi4")] * 10 + [preset("kivi2")] * 20
    assert bytes_per_token(SMOL, mixed) == (10 * 7200 + 20 * 4320) / 30
    k = TensorQuantSpec("fp8_e4m3", PerHead())
    assert memory_report(SMOL, KVCacheConfig(k, k), 10).config["k"]["granularity"] == "head"


# ---- CLI -----------------------------------------------------------------------------------------

@pytest.fixture
def config_json(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                             "hidden_size": 576, "max_position_embeddings": 8192}))
    return str(p)


def test_cli_memory(config_json):
    """kvcal memory prints the hand-worked 16-bit bytes per token and total, its --json total equals
    cache_bytes for the same options; a key group longer than --context, --group-size 0 and --granularity with
    nvfp4 exit 2 with their messages; asymmetric per-token int3 gives the hand-worked bytes per token."""
    from kvcal.cli import main

    r = CliRunner().invoke(main, ["memory", "--model", config_json, "--format", "fp16"])
    assert r.exit_code == 0, r.output
    assert "bytes per token: 23040" in r.output and "188743680" in r.output
    r = CliRunner().invoke(main, ["memory", "--model", config_json, "--format", "int4_static", "--group-size", "64",
                                  "--residual-window", "128", "--sinks", "4", "--context", "1000",
                                  "--batch", "2", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    cfg = preset("int4_static", residual_window=128, sink_tokens=4).with_group_size(64)
    assert d["bytes_per_token"] == 6120 and d["bytes"]["total"] == cache_bytes(SMOL, cfg, 1000, 2)
    # a key group longer than the context must not size a cache larger than the 16-bit one
    r = CliRunner().invoke(main, ["memory", "--model", config_json, "--format", "int4", "--group-size", "100000",
                                  "--context", "8192"])
    assert r.exit_code == 2 and "longer than --context 8192" in r.output
    r = CliRunner().invoke(main, ["memory", "--model", config_json, "--format", "kivi4", "--group-size", "0"])
    assert r.exit_code == 2 and "Invalid value for '--group-size': 0 is not in the range 1<=x" in r.output
    r = CliRunner().invoke(main, ["memory", "--model", config_json, "--format", "nvfp4", "--granularity", "head"])
    assert r.exit_code == 2 and "do not apply to nvfp4" in r.output  # was silently ignored
    r = CliRunner().invoke(main, ["memory", "--model", config_json, "--format", "int3", "--granularity", "token",
                                  "--asymmetric", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["bytes_per_token"] == per_side(24, 4)


def test_cli_memory_errors(config_json, tmp_path):
    """kvcal memory exits 2 with a message for an unknown KV format (int7), --sinks -1, and a --model file
    that is not JSON (an error: line, no traceback)."""
    from kvcal.cli import main

    r = CliRunner().invoke(main, ["memory", "--model", config_json, "--format", "int7"])
    assert r.exit_code == 2 and "unknown KV format" in r.output
    r = CliRunner().invoke(main, ["memory", "--model", config_json, "--format", "fp8", "--sinks", "-1"])
    assert r.exit_code == 2 and "Invalid value for '--sinks': -1 is not in the range 0<=x" in r.output
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    r = CliRunner().invoke(main, ["memory", "--model", str(bad), "--format", "fp8"])
    assert r.exit_code == 2 and "error:" in r.output and "Traceback" not in r.output


def test_cli_memory_refuses_context_above_model_maximum(config_json):
    """--context 16384 on a model with max_position_embeddings 8192 exits 2 naming both (no traceback);
    --context 8192 is accepted and its JSON total equals cache_bytes."""
    from kvcal.cli import main

    r = CliRunner().invoke(main, ["memory", "--model", config_json, "--format", "fp8", "--context", "16384"])
    assert r.exit_code == 2 and "exceeds the model's max_position_embeddings 8192" in r.output
    assert "Traceback" not in r.output
    r = CliRunner().invoke(main, ["memory", "--model", config_json, "--format", "fp8", "--context", "8192", "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["bytes"]["total"] == cache_bytes(SMOL, preset("fp8"), 8192, 1)
