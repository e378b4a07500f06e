"""Calibration reliability: data-parallel calibration over 2 gloo ranks gives what 1 process gives; resumable
runs, device_map, and models without a KV cache. Uses a tiny random Llama with the embedded tokenizer's vocabulary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers.models import TINY_LLAMA_16, save_tiny_llama

from kvcal.artifact import load_artifact
from kvcal.calibrate import CalibrateConfig, calibrate, checkpoint_path
from kvcal.errors import KvcalError, ModelLoadError

REPO = Path(__file__).resolve().parents[2]
CHAT = REPO / "calibration_sets" / "chat.jsonl"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm_tokenizer):
    return save_tiny_llama(tmp_path_factory, smollm_tokenizer, "tiny-llama", vocab_size=49152, **TINY_LLAMA_16)


def _cfg(tiny_dir, out, **kw):
    base = dict(corpus=str(CHAT), out=str(out), model=str(tiny_dir), max_samples=12, max_seq_len=96, batch_size=2,
                reservoir=3, heldout_reservoir=2, max_queries=16)
    base.update(kw)
    return CalibrateConfig(**base)


def _same_artifact(a: Path, b: Path):
    A, B = load_artifact(a), load_artifact(b)
    assert sorted(A.tensors) == sorted(B.tensors)
    for k in A.tensors:
        assert torch.equal(A.tensors[k], B.tensors[k]), k
    la, lb = A.metadata["layers"], B.metadata["layers"]
    for x, y in zip(la, lb, strict=True):
        for side in ("k", "v"):
            assert x[side]["heldout"] == y[side]["heldout"]
            assert x[side]["channel_absmax"] == y[side]["channel_absmax"]
    assert A.metadata["corpus"] == B.metadata["corpus"]


def _cli(args, env_extra=None, torchrun=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env_extra or {})}
    if torchrun:
        import socket

        with socket.socket() as s:  # a free port (a fixed one collides with another run of this test on the machine)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", str(torchrun),
               "--master-port", str(port), "-m", "kvcal", *args]
    else:
        cmd = [sys.executable, "-m", "kvcal", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def test_two_gloo_ranks_give_the_same_artifact_as_one_process(tiny_dir, tmp_path):
    """torchrun with 2 gloo ranks writes (from rank 0 only) an artifact whose tensors, held-out errors,
    channel absmax and corpus record equal the single-process run's exactly."""
    args = ["calibrate", "--corpus", str(CHAT), "--model", str(tiny_dir), "--max-samples", "12",
            "--max-seq-len", "96", "--batch-size", "2", "--quiet"]
    one = _cli([*args, "--out", str(tmp_path / "one")])
    assert one.returncode == 0, one.stderr[-2000:]
    two = _cli([*args, "--out", str(tmp_path / "two")], torchrun=2)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "data-parallel over 2 ranks" in two.stdout
    assert two.stdout.count("artifact:") == 1  # only rank 0 writes and reports
    _same_artifact(tmp_path / "one", tmp_path / "two")


def test_interrupted_run_resumes_to_an_identical_artifact(tiny_dir, tmp_path, monkeypatch):
    """A calibration interrupted at batch 4 leaves no artifact and a checkpoint at batch 3; --resume
    produces the uninterrupted run's artifact exactly and removes the checkpoint; a foreign or missing checkpoint is refused."""
    from kvcal.models import load_model, load_tokenizer

    tok = load_tokenizer(str(tiny_dir))
    model = load_model(str(tiny_dir))
    calibrate(_cfg(tiny_dir, tmp_path / "ref"), log=lambda s: None, progress=False, model=model, tokenizer=tok)

    out = tmp_path / "run"
    real = model.model.forward
    calls = {"n": 0}

    def boom(*a, **k):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(model.model, "forward", boom)
    with pytest.raises(KeyboardInterrupt):
        calibrate(_cfg(tiny_dir, out, checkpoint_every=1), log=lambda s: None, progress=False, model=model, tokenizer=tok)
    monkeypatch.setattr(model.model, "forward", real)
    assert not out.exists(), "an interrupted run must not leave a partial artifact"
    ck = Path(checkpoint_path(str(out)))
    assert torch.load(ck, weights_only=False)["next_batch"] == 3
    calibrate(_cfg(tiny_dir, out, checkpoint_every=1, resume=True), log=lambda s: None, progress=False,
              model=model, tokenizer=tok)
    _same_artifact(tmp_path / "ref", out)
    assert not ck.exists(), "the checkpoint is removed once the artifact is written"

    # a checkpoint from another run is refused, naming the fix
    torch.save({"fingerprint": "other"}, ck)
    with pytest.raises(KvcalError, match="different run"):
        calibrate(_cfg(tiny_dir, out, resume=True, overwrite=True), log=lambda s: None, progress=False,
                  model=model, tokenizer=tok)
    ck.unlink()
    with pytest.raises(KvcalError, match="no checkpoint"):
        calibrate(_cfg(tiny_dir, out, resume=True, overwrite=True), log=lambda s: None, progress=False,
                  model=model, tokenizer=tok)


def test_ctrl_c_message_says_how_to_resume(tmp_path, monkeypatch):
    """Ctrl-C during `kvcal calibrate --checkpoint-every` exits 130 saying no artifact was written and
    naming --resume; no output directory is left."""
    import kvcal.calibrate as cal
    from kvcal.cli import main

    out = tmp_path / "a"

    def interrupted(cfg, **kw):
        Path(cal.checkpoint_path(str(out))).write_bytes(b"x")
        raise KeyboardInterrupt

    monkeypatch.setattr(cal, "calibrate", interrupted)
    r = CliRunner().invoke(main, ["calibrate", "--corpus", str(CHAT), "--out", str(out), "--checkpoint-every", "5"])
    assert r.exit_code == 130
    assert "no artifact was written" in r.output and "--resume" in r.output
    assert not out.exists()


def test_device_map_auto_captures_the_same_statistics(tiny_dir, tmp_path):
    """device_map='auto' gives the same artifact (tensors, held-out errors, channel absmax, corpus) as the
    plain load, exactly."""
    from kvcal.models import load_tokenizer

    tok = load_tokenizer(str(tiny_dir))
    calibrate(_cfg(tiny_dir, tmp_path / "plain"), log=lambda s: None, progress=False, tokenizer=tok)
    calibrate(_cfg(tiny_dir, tmp_path / "auto", device_map="auto"), log=lambda s: None, progress=False, tokenizer=tok)
    _same_artifact(tmp_path / "plain", tmp_path / "auto")


def test_architecture_without_kv_cache_is_refused(tmp_path):
    """A Mamba config (no attention layers) is refused with ModelLoadError 'no attention layers and
    therefore no KV cache'."""
    from transformers import MambaConfig

    from kvcal.models import model_metadata

    with pytest.raises(ModelLoadError, match="no attention layers and therefore no KV cache"):
        model_metadata(MambaConfig(hidden_size=32, num_hidden_layers=2, vocab_size=100))


def test_metadata_json_is_valid(tiny_dir, tmp_path):
    """Artifact metadata serializes as strict JSON (no NaN/inf); every layer's channel_absmax is [H_kv][D] =
    [2][16], non-negative, and its maximum is the layer's recorded amax exactly; every stored FP8 scale is
    clip_ratio x amax / 448 (kvcal's convention: e4m3 per-tensor scale = clip amax / 448)."""
    from kvcal.models import load_tokenizer

    calibrate(_cfg(tiny_dir, tmp_path / "m"), log=lambda s: None, progress=False,
              tokenizer=load_tokenizer(str(tiny_dir)))
    art = load_artifact(tmp_path / "m")
    meta = art.metadata
    json.dumps(meta, allow_nan=False)
    assert len(meta["layers"]) == 2
    for lm in meta["layers"]:
        for side in ("k", "v"):
            m = lm[side]
            ca = torch.tensor(m["channel_absmax"], dtype=torch.float64)
            assert ca.shape == (2, 16) and bool((ca >= 0).all()) and float(ca.max()) > 0
            assert [float(ca.max())] == m["amax"]  # max is exact: the same float32 values, per tensor
            scale = float(art.tensors[f"model.layers.{lm['layer']}.self_attn.{side}_scale"])
            assert m["scale"] == [scale]
            # scale, clip_ratio and amax are float32 values: clip_ratio x amax / 448 in float64 is within two
            # float32 roundings (relative 2^-23 each) of the stored scale
            want = m["clip_ratio"][0] * m["amax"][0] / 448
            assert abs(scale - want) <= 2 * 2.0**-23 * want, (lm["layer"], side, scale, want)


def test_interrupted_checkpoint_write_leaves_no_temp_file(tmp_path, monkeypatch):
    """A checkpoint write interrupted mid-save (Ctrl-C) leaves no ``.tmp-PID`` file beside the checkpoint
    and the previous checkpoint intact; a disk error (ENOSPC) is a one-line KvcalError naming the file."""
    import errno

    from kvcal.calibrate import save_checkpoint
    from kvcal.capture.checkpoint import Checkpointing
    from kvcal.errors import KvcalError

    ck = Checkpointing(str(tmp_path / "run.checkpoint.pt"), every=1)
    save_checkpoint(ck.path, {"fingerprint": "run", "batch": 1})  # a kvcal checkpoint names its run
    real_save = torch.save

    def interrupted(obj, f, *a, **k):
        real_save(obj, f, *a, **k)  # the temp file exists, then the user presses Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(ck.path, {"fingerprint": "run", "batch": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.checkpoint.pt"]
    assert torch.load(tmp_path / "run.checkpoint.pt")["batch"] == 1

    def full(obj, f, *a, **k):
        Path(f).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(KvcalError, match="cannot write .*run.checkpoint.pt: No space left.*drop --checkpoint-every"):
        save_checkpoint(ck.path, {"fingerprint": "run", "batch": 3})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.checkpoint.pt"]


def test_model_dir_without_tokenizer_says_what_to_copy(tmp_path):
    """A model directory with a config but no tokenizer files is refused in one line that names the
    tokenizer files to copy."""
    from kvcal.models import load_tokenizer

    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelLoadError, match="has no tokenizer files .*copy the model's tokenizer.json") as e:
        load_tokenizer(str(d))
    assert "\n" not in str(e.value)
