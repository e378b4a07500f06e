"""Artifact writing/loading: atomicity, refusal of bad scales, strict loading."""

from __future__ import annotations

import json
import os

import pytest
import torch

from kvcal.artifact import check_model_match, load_artifact, write_artifact
from kvcal.errors import ArtifactError
from kvcal.outputs import SCALES_FILE
from kvcal.plan import tensor_name

META = {"model": {"id": "t", "num_layers": 2, "num_kv_heads": 3, "head_dim": 8, "config_sha256": "abc"},
        "kv": {"k": {"format": "fp8_e4m3", "granularity": "tensor", "dynamic": False},
               "v": {"format": "fp8_e4m3", "granularity": "tensor", "dynamic": False}}}


def tensors(v=0.01):
    return {tensor_name(i, s): torch.tensor([v]) for i in range(2) for s in ("k", "v")}


def test_round_trip_and_schema(tmp_path):
    """A written artifact loads with schema_version 1, the V scale written for layer 1 and its extra file,
    leaves no temporary directory, and gets the umask's ordinary directory and file permissions."""
    out = write_artifact(tmp_path / "a", tensors(), META, extra_files={"report.md": "hi"})
    art = load_artifact(out)
    assert art.metadata["schema_version"] == 1
    assert torch.equal(art.scale(1, "v"), torch.tensor([0.01]))
    assert (out / "report.md").read_text() == "hi"
    assert sorted(os.listdir(tmp_path)) == ["a"]  # no temp dirs left
    umask = os.umask(0)
    os.umask(umask)
    assert (out.stat().st_mode & 0o777) == 0o777 & ~umask  # a normal directory, not mkdtemp's 0700
    assert ((out / SCALES_FILE).stat().st_mode & 0o777) == 0o666 & ~umask


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_scales_refused_naming_layer_and_side(tmp_path, bad):
    """A zero, negative, NaN or infinite scale is refused by write_artifact with an ArtifactError naming
    model.layers.1.self_attn.v_scale, and nothing is written."""
    t = tensors()
    t[tensor_name(1, "v")] = torch.tensor([bad])
    with pytest.raises(ArtifactError, match=r"model\.layers\.1\.self_attn\.v_scale"):
        write_artifact(tmp_path / "a", t, META)
    assert not (tmp_path / "a").exists() and os.listdir(tmp_path) == []


def test_existing_dir_needs_overwrite(tmp_path):
    """Writing into an existing artifact raises an ArtifactError suggesting --overwrite; with overwrite=True
    the new scale (0.02 as float32, compared exactly) replaces the old and no temporary directory is left."""
    write_artifact(tmp_path / "a", tensors(), META)
    with pytest.raises(ArtifactError, match="--overwrite"):
        write_artifact(tmp_path / "a", tensors(0.02), META)
    write_artifact(tmp_path / "a", tensors(0.02), META, overwrite=True)
    assert float(load_artifact(tmp_path / "a").scale(0, "k")) == float(torch.tensor(0.02))  # float32 storage, exact
    assert sorted(os.listdir(tmp_path)) == ["a"]


def test_overwrite_replaces_only_kvcal_outputs_and_never_an_input(tmp_path):
    """``--overwrite`` must not wipe a directory kvcal did not write (a mistyped ``--out .``), nor an
    ``--out`` that is or contains an input; an empty directory or an artifact / export is fine;
    a parent that is a file is refused before any work."""
    from kvcal.outputs import check_output_dir, is_kvcal_output

    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("important")
    with pytest.raises(ArtifactError, match="replaces only directories kvcal wrote"):
        write_artifact(user, tensors(), META, overwrite=True)
    assert (user / "notes.txt").read_text() == "important" and not is_kvcal_output(user)
    # a foreign safetensors file (no kvcal metadata) is not a kvcal artifact either
    from safetensors.torch import save_file

    save_file(tensors(), str(user / SCALES_FILE))
    assert not is_kvcal_output(user)
    (user / SCALES_FILE).write_bytes(b"\xff" * 20)  # garbage header
    assert not is_kvcal_output(user)
    empty = tmp_path / "empty"
    empty.mkdir()
    write_artifact(empty, tensors(), META, overwrite=True)
    assert is_kvcal_output(empty)
    write_artifact(empty, tensors(0.02), META, overwrite=True)  # an artifact may be replaced
    exp = tmp_path / "exp"
    exp.mkdir()
    (exp / "kvcal-export.json").write_text('{"kvcal_version": "0.1"}')
    assert is_kvcal_output(exp)
    (exp / "kvcal-export.json").write_text('{"other": 1}')
    assert not is_kvcal_output(exp)
    # the output must not be or contain an input, even an artifact with --overwrite
    corpus = tmp_path / "cc" / "chat.jsonl"
    corpus.parent.mkdir()
    corpus.write_text("{}")
    for out in (corpus.parent, tmp_path):
        with pytest.raises(ArtifactError, match="is or contains the input --corpus"):
            check_output_dir(out, True, {"--corpus": str(corpus)})
    with pytest.raises(ArtifactError, match="is or contains the input --artifact"):
        write_artifact(empty, tensors(), META, overwrite=True, inputs={"--artifact": empty / SCALES_FILE})
    assert float(load_artifact(empty).scale(0, "k")) == float(torch.tensor(0.02))
    check_output_dir(tmp_path / "new", False, {"--corpus": str(corpus)})  # a sibling is fine
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ArtifactError, match="is a file, not a directory"):
        check_output_dir(afile / "sub", False)
    with pytest.raises(ArtifactError, match="not a directory"):
        check_output_dir(afile, True)


def test_truncated_and_foreign_files_refused(tmp_path):
    """load_artifact refuses a truncated scales file (corrupted or truncated), a safetensors file without
    kvcal metadata, and a missing directory, each with an ArtifactError."""
    out = write_artifact(tmp_path / "a", tensors(), META)
    f = out / SCALES_FILE
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ArtifactError, match="corrupted or truncated"):
        load_artifact(out)
    from safetensors.torch import save_file

    save_file(tensors(), str(f))
    with pytest.raises(ArtifactError, match="no kvcal metadata"):
        load_artifact(out)
    with pytest.raises(ArtifactError, match="no artifact"):
        load_artifact(tmp_path / "missing")


def test_missing_layer_refused(tmp_path):
    """An artifact without layer 1's K scale is refused at load with an ArtifactError naming missing k_scale
    for layers [1]."""
    t = tensors()
    del t[tensor_name(1, "k")]
    out = write_artifact(tmp_path / "a", t, META)
    with pytest.raises(ArtifactError, match=r"missing k_scale for layers \[1\]"):
        load_artifact(out)


def test_mixed_per_layer_specs_check_each_layer(tmp_path):
    """A --bits artifact can mix static and dynamic sides across layers (``kv.layer_specs``)."""
    meta = json.loads(json.dumps(META))
    dyn = {"format": "int4", "granularity": "token_group", "dynamic": True}
    meta["kv"]["layer_specs"] = [{"k": META["kv"]["k"], "v": META["kv"]["v"]}, {"k": dyn, "v": dyn}]
    t = tensors()
    del t[tensor_name(1, "k")], t[tensor_name(1, "v")]
    load_artifact(write_artifact(tmp_path / "a", t, meta))
    del t[tensor_name(0, "v")]
    with pytest.raises(ArtifactError, match=r"missing v_scale for layers \[0\]"):
        load_artifact(write_artifact(tmp_path / "b", t, meta))


def test_model_mismatch_names_the_field():
    """check_model_match on a model with 4 KV heads for an artifact of 3 raises an ArtifactError naming
    num_kv_heads and both values."""
    other = dict(META["model"], num_kv_heads=4)
    with pytest.raises(ArtifactError, match="num_kv_heads is 3 in the artifact but 4"):
        check_model_match(META, other)


def test_model_mismatch_names_the_artifacts_model_to_pass():
    """Run on another model (e.g. `kvcal evaluate` without --model, which loads the embedded default), the
    error names the model the artifact was calibrated for as the --model to pass, besides re-calibrating."""
    other = dict(META["model"], id="smollm2-135m", num_layers=30)
    with pytest.raises(ArtifactError, match=r"num_layers is 2 in the artifact but 30 .*pass --model t \(the model"):
        check_model_match(META, other)


def test_non_finite_metadata_refused(tmp_path):
    """A NaN anywhere in the metadata is refused by write_artifact (non-finite) and nothing is written."""
    meta = json.loads(json.dumps(META))
    meta["layers"] = [{"x": float("nan")}]
    with pytest.raises(ArtifactError, match="non-finite"):
        write_artifact(tmp_path / "a", tensors(), meta)
    assert os.listdir(tmp_path) == []


def test_read_only_location(tmp_path, monkeypatch):
    """A location we may not write to (simulated: CI runs as root, which ignores permissions)."""
    import tempfile

    def deny(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkdtemp", deny)
    with pytest.raises(ArtifactError, match="cannot write .*Permission denied.*choose a writable --out"):
        write_artifact(tmp_path / "a", tensors(), META)
    assert not (tmp_path / "a").exists()


def test_disk_full_during_write_leaves_nothing(tmp_path, monkeypatch):
    """ENOSPC while saving the scales raises an ArtifactError ending nothing was written, and leaves no file
    or directory."""
    import errno

    import safetensors.torch as st

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(st, "save_file", full)
    with pytest.raises(ArtifactError, match="No space left on device; nothing was written"):
        write_artifact(tmp_path / "a", tensors(), META)
    assert os.listdir(tmp_path) == []


def test_disk_full_on_overwrite_keeps_the_old_artifact(tmp_path, monkeypatch):
    """ENOSPC during an overwrite raises ArtifactError and leaves the previous artifact (scale 0.5) loadable
    and alone in the directory."""
    import errno

    write_artifact(tmp_path / "a", tensors(0.5), META)

    def full(path, content, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    import pathlib

    monkeypatch.setattr(pathlib.Path, "write_text", full)
    with pytest.raises(ArtifactError):
        write_artifact(tmp_path / "a", tensors(0.25), META, extra_files={"report.md": "x"}, overwrite=True)
    assert float(load_artifact(tmp_path / "a").scale(0, "k")) == 0.5
    assert sorted(os.listdir(tmp_path)) == ["a"]


@pytest.mark.parametrize("edit, match", [
    (lambda m: m["model"].pop("num_layers"), "model.num_layers must be a positive integer"),
    (lambda m: m["model"].__setitem__("num_layers", "thirty"), "model.num_layers must be a positive integer"),
    (lambda m: m.__setitem__("kv", "fp8"), "metadata field kv must be an object, got 'fp8'"),
    (lambda m: m["model"].__setitem__("num_layers", 1), "is for layer 1 but the metadata says 1 layers"),
])
def test_hand_edited_metadata_gets_one_line_errors(tmp_path, edit, match):
    """A hand-edited metadata (num_layers missing or a string, kv a string, fewer layers than tensors) is
    refused at load with an ArtifactError naming the field."""
    meta = json.loads(json.dumps(META))
    edit(meta)
    out = write_artifact(tmp_path / "a", tensors(), meta)
    with pytest.raises(ArtifactError, match=match):
        load_artifact(out)


def test_scale_shape_must_match_granularity(tmp_path):
    """A [5] K scale in a per-tensor artifact is refused at load with an ArtifactError naming the shape found
    and the [1] expected."""
    t = tensors()
    t[tensor_name(0, "k")] = torch.full((5,), 0.01)
    with pytest.raises(ArtifactError, match=r"k_scale has shape \[5\], expected \[1\] for tensor granularity"):
        load_artifact(write_artifact(tmp_path / "a", t, META))
