"""kvcal.api: the command functions return what the CLI prints, and bad input is one KvcalError line."""

import json

import pytest
from click.testing import CliRunner

from kvcal import api
from kvcal.cli import main
from kvcal.errors import KvcalError

# SmolLM2-135M (embedded): 30 layers, 3 KV heads, head_dim 64 (its GGUF header)
L, H, D = 30, 3, 64


def test_memory_fp8_is_one_byte_per_element_plus_static_scales():
    """fp8 per-tensor: K and V payload 1 byte per element (2·L·H·D bytes/token, hand-computed), 16-bit is twice
    that, and the cache adds one float32 scale per layer and side (2·L·4 bytes) on top of the payload."""
    res = api.memory("smollm2-135m", "fp8", context=1000, batch=2)
    assert res.bytes_16bit == 2 * L * H * D * 2
    assert res.report.bytes_per_token == 2 * L * H * D
    assert res.report.total == 2 * 1000 * 2 * L * H * D + 2 * L * 4
    assert res.to_dict()["format"] == "fp8"


def test_memory_vllm_skip_layers_are_counted_at_16_bits():
    """vllm:fp8 with layers 0,1 at 16 bits: 28 layers at 1 byte/element and 2 at 2 bytes (hand-computed)."""
    res = api.memory("smollm2-135m", "vllm:fp8", skip_layers="0,1", context=4096)
    per_layer = 2 * H * D
    assert res.vllm["bytes_per_token"] == 28 * per_layer + 2 * 2 * per_layer
    assert res.vllm["skip_layers"] == [0, 1]
    assert res.to_dict()["bytes_per_token"] == res.vllm["bytes_per_token"]


def test_memory_json_matches_the_api(tmp_path):
    """`kvcal memory --json` prints exactly MemoryResult.to_dict()."""
    out = CliRunner().invoke(main, ["memory", "--format", "int4", "--context", "512", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output) == api.memory("smollm2-135m", "int4", context=512).to_dict()


@pytest.mark.parametrize("text, field", [("[1, 2]", "JSON array"), ('{"num_hidden_layers": "x"}', "num_hidden_layers"),
                                         ("{not json", "not readable JSON")])
@pytest.mark.parametrize("command", [["memory", "--format", "fp8"], ["plan", "--gpu-mem", "24GiB"]])
def test_bad_config_json_is_one_line_naming_the_file(tmp_path, text, field, command):
    """memory and plan read a config.json through the checked reader: a file of the wrong shape is refused in
    one line naming the file and the field (before: 'model config lacks hidden_size' for a JSON array)."""
    f = tmp_path / "config.json"
    f.write_text(text)
    out = CliRunner().invoke(main, [*command, "--model", str(f)])
    assert out.exit_code == 2, out.output
    lines = out.output.strip().splitlines()
    assert len(lines) == 1 and str(f) in lines[0] and field in lines[0], out.output
    with pytest.raises(KvcalError, match=field):
        api.memory(str(f), "fp8") if command[0] == "memory" else api.capacity(str(f), "24GiB")


def test_calibrate_options_are_checked_before_anything_loads(tmp_path):
    """api.calibrate validates its options through CalibrateConfig: --bits with --preset is refused."""
    with pytest.raises(KvcalError, match="give one of them"):
        api.calibrate(str(tmp_path / "c.jsonl"), preset="int4", bits=4.0)
