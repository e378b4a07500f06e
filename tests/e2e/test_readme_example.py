"""The README's own serving command on the committed worked example runs clean.

``kvcal export --artifact artifacts/smollm2-135m-fp8 --target vllm --model-dir HF_DIR --out OUT``, run as the
README writes it with HF_DIR the embedded model's checkpoint, prints no note that the artifact lacks a
``content_sha256`` and no warning that it records no weights fingerprint."""

from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvcal.cli import main

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "artifacts" / "smollm2-135m-fp8"
#: the one warning that is about this machine's transformers, not the artifact: true of every vLLM export here
ENVIRONMENT = re.compile(r"^warning: transformers \S+ \+ compressed-tensors \S+ \(installed here\) would silently ignore")


def readme_export_lines() -> list[str]:
    """Every ``kvcal export`` line of the README's shell blocks."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return [ln.strip() for b in blocks for ln in b.splitlines() if ln.strip().startswith("kvcal export ")]


def test_the_committed_example_records_its_hash_and_weights_fingerprint():
    """The committed artifacts/smollm2-135m-fp8 loads (its content hash verified) and records a 64-hex content_sha256
    and a weights fingerprint of SmolLM2-135M's 30 decoder layers: num_layers 30 in the model and the fingerprint, 30
    per-layer 16-hex digests and one for the embedding."""
    from kvcal.artifact import CONTENT_HASH_KEY, load_artifact

    meta = load_artifact(EXAMPLE).metadata  # load_artifact verifies the content hash it finds
    assert re.fullmatch(r"[0-9a-f]{64}", meta.get(CONTENT_HASH_KEY) or ""), meta.get(CONTENT_HASH_KEY)
    # SmolLM2-135M has 30 decoder layers (its config.json): the fingerprint covers each of them and the embedding
    w = meta["model"].get("weights")
    assert isinstance(w, dict) and meta["model"]["num_layers"] == w["num_layers"] == 30
    assert len(w["layers"]) == 30 and all(re.fullmatch(r"[0-9a-f]{16}", x) for x in [*w["layers"], w["embedding"]])


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, smollm_model, smollm_tokenizer):
    """The embedded model as a plain Hugging Face checkpoint (kvcal.models.save_hf_checkpoint's steps, from the
    session's already loaded model)."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(smollm_model.config)  # the session's model keeps its own config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    plain.load_state_dict(smollm_model.state_dict())
    d = tmp_path_factory.mktemp("smollm2-hf")
    plain.save_pretrained(d)
    smollm_tokenizer.save_pretrained(d)
    return d


def test_readme_export_command_prints_no_warning(hf_dir, tmp_path, monkeypatch):
    """Every ``kvcal export`` line of the README's bash blocks, run as written with HF_DIR the embedded SmolLM2
    checkpoint, exits 0 and prints no warning except the one about this machine's transformers ignoring the scales, and
    no line about content_sha256 or a weights fingerprint."""
    lines = readme_export_lines()
    assert lines, "the README has no kvcal export line"
    monkeypatch.chdir(REPO)  # the README's paths are relative to the repository
    for i, line in enumerate(lines):
        args = [{"HF_DIR": str(hf_dir), "OUT": str(tmp_path / f"out{i}")}.get(a, a) for a in shlex.split(line)[1:]]
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 0, r.output
        out = r.output.splitlines()
        bad = [x for x in out if x.startswith("warning:") and not ENVIRONMENT.match(x)]
        assert bad == [], bad
        assert not [x for x in out if "content_sha256" in x or "fingerprint" in x], r.output
