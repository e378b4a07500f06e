"""Checkpoint JSON read by inspect / export: malformed config.json and index.json give one-line errors
(no traceback), and the config hash an artifact records matches the one export computes from the same
checkpoint's config.json (Phi-3 / GPT-NeoX configs omit head_dim / num_key_value_heads)."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner
from export_helpers import make_artifact, make_checkpoint

from kvcal.cli import main


@pytest.mark.parametrize("config_cls", ["Phi3Config", "GPTNeoXConfig"])
def test_config_hash_of_the_calibrated_checkpoint_matches_export(tmp_path, config_cls):
    """Tester: export --model-dir on the very phi3 / gpt_neox checkpoint the artifact was calibrated on warned
    'config.json differs', because calibrate hashed head_dim / num_key_value_heads filled in and export hashed
    the raw config.json, which omits them."""
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
