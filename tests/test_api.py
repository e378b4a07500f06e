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


@pytest.mark.parametrize("opts, named", [(["--residual-window", "128"], "--residual-window"),
                                         (["--sinks", "4"], "--sinks"), (["--granularity", "head"], "--granularity"),
                                         (["--group-size", "32"], "--group-size"), (["--asymmetric"], "--asymmetric"),
                                         (["--skip-layers", "0,0"], "layer 0 is named twice")])
def test_memory_vllm_refuses_options_vllm_has_no_place_for(opts, named):
    """`kvcal memory --format vllm:fp8` refuses (exit 2, one line naming the option) a residual window, sinks,
    a granularity, group size or symmetry (vLLM's --kv-cache-dtype fixes the page layout; none of them changes
    the bytes it allocates, so the figure printed would silently leave them out) and a layer named twice."""
    r = CliRunner().invoke(main, ["memory", "--format", "vllm:fp8", "--context", "64", *opts])
    assert r.exit_code == 2, r.output
    assert r.output.startswith("error: ") and r.output.count("\n") == 1 and named in r.output, r.output


def test_memory_vllm_context_past_max_positions_is_refused_as_for_other_formats():
    """`--context` above the model's max_position_embeddings (8192 for the embedded SmolLM2): refused for
    vllm:fp8 with the same one-line error as for the plain fp8 layout (vLLM also refuses such a max_model_len)."""
    outs = [CliRunner().invoke(main, ["memory", "--format", f, "--context", "9000"]) for f in ("fp8", "vllm:fp8")]
    assert [r.exit_code for r in outs] == [2, 2], [r.output for r in outs]
    assert outs[1].output == outs[0].output and "max_position_embeddings 8192" in outs[0].output


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
    """api.calibrate validates its options through CalibrateConfig: --bits with --preset is refused (after the
    corpus check, which comes first as in the CLI)."""
    (tmp_path / "c.jsonl").write_text('{"text": "hello"}\n')
    with pytest.raises(KvcalError, match="give one of them"):
        api.calibrate(str(tmp_path / "c.jsonl"), preset="int4", bits=4.0)
