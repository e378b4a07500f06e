"""Checkpoint JSON read by inspect / export: malformed config.json and index.json give one-line errors
(no traceback), and the config hash an artifact records matches the one export computes from the same
checkpoint's config.json (Phi-3 / GPT-NeoX configs omit head_dim / num_key_value_heads)."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner
from helpers.export import make_artifact, make_checkpoint

from kvcal.cli import main


@pytest.mark.parametrize("config_cls", ["Phi3Config", "GPTNeoXConfig"])
def test_config_hash_of_the_calibrated_checkpoint_matches_export(tmp_path, config_cls):
    """Export --model-dir on the phi3 / gpt_neox checkpoint the artifact was calibrated on finds no config
    difference although its config.json omits head_dim: the metadata calibrate records (head_dim /
    num_key_value_heads filled in by transformers) matches the raw config.json; a real difference still warns."""
    import transformers
    from transformers import AutoConfig

    from kvcal.export.checkpoint import check_matches
    from kvcal.models import model_metadata

    cls = getattr(transformers, config_cls)
    cls(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=128, vocab_size=128,
        max_position_embeddings=256).save_pretrained(tmp_path / "ckpt")
    raw = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert raw.get("head_dim") is None  # the case: config.json leaves head_dim to transformers
    mmeta = model_metadata(AutoConfig.from_pretrained(tmp_path / "ckpt"))  # what calibrate records
    assert mmeta["head_dim"] == 64 // 4 and mmeta["num_kv_heads"] == 4
    meta = {"model": mmeta}
    assert check_matches(meta, raw, tmp_path / "ckpt") == []
    # and a real difference still warns
    assert check_matches(meta, {**raw, "vocab_size": 256}, tmp_path / "ckpt")


@pytest.fixture(scope="module")
def good_ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", sharded=True)


def _edit(d, name, fn):
    p = d / name
    p.write_text(json.dumps(fn(json.loads(p.read_text()) if p.is_file() else None)))


# (file, edit of its parsed JSON, field the one-line error must name)
_BAD = [
    ("model.safetensors.index.json", lambda j: {**j, "weight_map": 5}, "weight_map"),
    ("model.safetensors.index.json", lambda j: {**j, "weight_map": {"a": 5}}, 'weight_map["a"]'),
    ("model.safetensors.index.json", lambda j: [1], "not an object"),
    ("model.safetensors.index.json", lambda j: {"metadata": {}}, "weight_map"),
    ("config.json", lambda j: [], "not an object"),
    ("config.json", lambda j: {**j, "quantization_config": "x"}, "quantization_config"),
    ("config.json", lambda j: {**j, "quantization_config": {"quant_method": "compressed-tensors",
                                                            "kv_cache_scheme": [1]}},
     "quantization_config.kv_cache_scheme"),
    ("config.json", lambda j: {**j, "num_hidden_layers": "four"}, "num_hidden_layers"),
    ("config.json", lambda j: {**j, "text_config": 3}, "text_config"),
    ("hf_quant_config.json", lambda j: {"quantization": "x"}, "quantization"),  # ModelOpt's file
]


@pytest.mark.parametrize("command", ["inspect", "export"])
@pytest.mark.parametrize("case", range(len(_BAD)))
def test_malformed_checkpoint_json_is_a_one_line_error(tmp_path, good_ckpt, command, case):
    """A checkpoint whose config.json / index.json / hf_quant_config.json has a field of the wrong JSON type is
    refused by `kvcal inspect` and `kvcal export --model-dir`: exit 2, one error line naming the file and the
    field, no traceback, nothing written."""
    name, edit, field = _BAD[case]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(good_ckpt, ckpt)
    _edit(ckpt, name, edit)
    if command == "inspect":
        args = ["inspect", str(ckpt)]
    else:
        art, _ = make_artifact(tmp_path / "art")
        target = "modelopt" if name == "hf_quant_config.json" else "vllm"  # the target that reads the file
        args = ["export", "--artifact", str(art), "--target", target, "--model-dir", str(ckpt),
                "--out", str(tmp_path / "out")]
    r = CliRunner().invoke(main, args)
    out = r.output + (str(r.exception) if r.exception and not isinstance(r.exception, SystemExit) else "")
    assert r.exit_code == 2, out
    assert "Traceback" not in out and not (r.exception and not isinstance(r.exception, SystemExit))
    err = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and name in err[0] and field in err[0], r.output
    assert not (tmp_path / "out").exists()


def test_standalone_quantization_config_json_of_the_wrong_type(tmp_path):
    """A standalone vLLM export's quantization_config.json whose quantization_config is a string: one line."""
    art, _ = make_artifact(tmp_path / "art")
    assert CliRunner().invoke(main, ["export", "--artifact", str(art), "--target", "vllm", "--out",
                                     str(tmp_path / "o")]).exit_code == 0
    (tmp_path / "o" / "quantization_config.json").write_text(json.dumps({"quantization_config": "x"}))
    r = CliRunner().invoke(main, ["inspect", str(tmp_path / "o")])
    assert r.exit_code == 2 and not (r.exception and not isinstance(r.exception, SystemExit)), r.output
    assert "quantization_config.json: quantization_config is a JSON string" in r.output
