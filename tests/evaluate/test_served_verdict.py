"""Issue 40, class 1: an artifact calibrated for a vLLM dtype and backend is judged as that engine serves it.

`calibrate --engine vllm --kv-cache-dtype fp8 --backend cpu` makes an artifact vLLM's CPU build serves with a
truncating FP8 write; `kvcal evaluate` of it (no --vllm-dtype given) adds the vllm:fp8 row on the cpu write path and
that row alone sets `passed`, the verdict and the exit code — kvcal's own runtime row (a rounding write) is shown
beside it and never decides."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.models import TINY_LLAMA_16, save_tiny_llama

REPO = Path(__file__).resolve().parents[2]
CHAT = REPO / "calibration_sets" / "chat.jsonl"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm_tokenizer):
    return save_tiny_llama(tmp_path_factory, smollm_tokenizer, "tiny-llama-served", vocab_size=49152, **TINY_LLAMA_16)


@pytest.fixture(scope="module")
def cpu_artifact(tiny_dir, tmp_path_factory):
    from kvcal.calibrate import CalibrateConfig, calibrate

    out = tmp_path_factory.mktemp("art") / "cpu"
    calibrate(CalibrateConfig(corpus=str(CHAT), out=str(out), model=str(tiny_dir), max_samples=12, max_seq_len=96,
                              batch_size=2, reservoir=3, heldout_reservoir=2, max_queries=16, engine="vllm",
                              kv_cache_dtype="fp8", backend="cpu"), log=lambda s: None, progress=False)
    return out


def _run(art, tiny_dir, accept):
    from kvcal import api

    return api.evaluate(str(art), str(CHAT), model=str(tiny_dir), contexts=(48,), windows=4,
                        modes=("teacher_forced",), baselines=False, accept=accept, log=lambda s: None, progress=False)


def test_engine_artifact_is_judged_by_its_served_row(cpu_artifact, tiny_dir):
    doc = _run(cpu_artifact, tiny_dir, "kl_mean<=100")
    assert doc["judged_method"] == "vllm:fp8"
    assert "backend cpu" in doc["methods"]["vllm:fp8"]["label"]  # the write path it was calibrated for
    served = next(r for r in doc["results"] if r["method"] == "vllm:fp8")
    runtime = next(r for r in doc["results"] if r["method"] == "artifact")
    assert served["status"] == "PASS" and doc["passed"] and doc["verdict"] == "PASS"
    # a bar just under the served row's lower bound: that row FAILs on its bound, so the run fails, whatever the
    # runtime row (rounding write) measures
    lo = served["bounds"]["kl_mean"]["lower"]
    doc2 = _run(cpu_artifact, tiny_dir, f"kl_mean<={lo * 0.99:.6e}")
    s2 = next(r for r in doc2["results"] if r["method"] == "vllm:fp8")
    assert s2["status"] == "FAIL" and not doc2["passed"] and doc2["exit_code"] == 1 and doc2["verdict"] == "FAIL"
    # where the runtime row's upper bound is below the served row's lower bound (truncation costs more than
    # rounding), a bar between them passes the runtime row and still fails the run: the served row decides
    if runtime["bounds"]["kl_mean"]["upper"] < lo:
        bar = (runtime["bounds"]["kl_mean"]["upper"] + lo) / 2
        doc3 = _run(cpu_artifact, tiny_dir, f"kl_mean<={bar:.6e}")
        rows = {r["method"]: r["status"] for r in doc3["results"]}
        assert rows["artifact"] == "PASS" and rows["vllm:fp8"] == "FAIL" and not doc3["passed"]
    assert any("judged as it serves it" in n for n in doc["notes"])
