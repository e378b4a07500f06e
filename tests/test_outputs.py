"""No command overwrites its own inputs or a file kvcal did
not write, the default ``--out`` is never a committed example, and ``--resume`` never unpickles code.

Tiny random Llama models only."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers.models import TINY_LLAMA_16, save_tiny_llama

from kvcal.cli import main

REPO = Path(__file__).resolve().parents[1]
CHAT = REPO / "calibration_sets" / "chat.jsonl"


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _one_error_line(r) -> str:
    """The CLI's refusal: exit 2, exactly one line ``error: ...``, no traceback."""
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output, r.output
    err = [ln for ln in lines if ln.startswith("error: ")]
    assert len(err) == 1, r.output
    return err[0]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm_tokenizer):
    """A tiny random Llama (2 layers, 2 KV heads × head_dim 16) with the embedded model's tokenizer."""
    return save_tiny_llama(tmp_path_factory, smollm_tokenizer, "tiny-llama", vocab_size=len(smollm_tokenizer), **TINY_LLAMA_16)


def _tiny_artifact(tmp_path: Path, tiny_dir: Path) -> Path:
    from transformers import AutoModelForCausalLM

    from kvcal.artifact import write_artifact
    from kvcal.formats.spec import preset
    from kvcal.models import model_metadata
    from kvcal.plan import KVPlan

    m = AutoModelForCausalLM.from_pretrained(tiny_dir)
    plan = KVPlan.uniform(2, preset("fp8"))
    for lp in plan.layers:
        lp.k.scale = torch.full((1, 1, 1, 1), 0.01)
        lp.v.scale = torch.full((1, 1, 1, 1), 0.01)
    meta = {"model": model_metadata(m.config), "kv": plan.kv_metadata(), "layers": []}
    return write_artifact(tmp_path / "art", plan.to_tensors(), meta, extra_files={"report.md": "# calibration\n"})


# ---- evaluate --json ---------------------------------------------------------------------------------

def test_evaluate_json_never_overwrites_an_input_or_a_foreign_file(tmp_path, tiny_dir):
    """``evaluate --json`` onto the artifact's kv_scales.safetensors, the corpus, or any file kvcal did not write
    is refused before the evaluation runs; a new path is written (atomically), and kvcal's own evaluation may be
    replaced."""
    art = _tiny_artifact(tmp_path, tiny_dir)
    corpus = tmp_path / "c.txt"
    corpus.write_text("Once upon a time there was a small model that cached keys and values. " * 8)
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": true}\n')
    base = ["evaluate", "--artifact", str(art), "--corpus", str(corpus), "--model", str(tiny_dir), "--context", "32",
            "--windows", "2", "--no-baselines", "--quiet", "--decode-tokens", "2", "--greedy-tokens", "2",  # a bound needs 2
            "--accept", "kl_mean<=10"]
    scales = art / "kv_scales.safetensors"
    before = {p: _sha(p) for p in (scales, corpus, notes, art / "report.md")}
    for target, says in ((scales, "kvcal artifact"), (corpus, "input --corpus"), (notes, "kvcal did not write"),
                         (art / "report.md", "is a kvcal report")):
        r = CliRunner().invoke(main, [*base, "--json", str(target)])
        line = _one_error_line(r)
        assert says in line and "PASS" not in r.output, (target, r.output)
    assert {p: _sha(p) for p in before} == before
    out = tmp_path / "sub" / "e.json"
    r = CliRunner().invoke(main, [*base, "--json", str(out)])
    assert r.exit_code == 0 and "artifact: PASS" in r.output, r.output
    assert json.loads(out.read_text())["schema"] == "kvcal-eval/1"
    assert sorted(p.name for p in out.parent.iterdir()) == ["e.json"]  # no temporary file left beside it
    first = out.read_text()
    r = CliRunner().invoke(main, [*base, "--json", str(out)])  # kvcal's own evaluation: replaced
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["created"] >= json.loads(first)["created"]


def test_single_file_writer_refusals(tmp_path):
    """The one single-file writer every command uses (kvcal.outputs.write_file_atomically)."""
    from kvcal.errors import KvcalError
    from kvcal.outputs import check_output_file, kvcal_file_kind, write_file_atomically

    doc = json.dumps({"schema": "kvcal-eval/1", "kvcal_version": "0", "results": []})
    p = write_file_atomically(tmp_path / "a" / "e.json", doc, kind="evaluation", flag="--json")
    assert kvcal_file_kind(p) == "evaluation" and p.read_text() == doc
    assert oct(p.stat().st_mode & 0o777) != oct(0o600)  # normal permissions, not mkstemp's 0600
    user = tmp_path / "user.json"
    user.write_text('{"schema": "kvcal-eval/1"}')  # looks like one but kvcal did not write it (no version)
    assert kvcal_file_kind(user) is None
    with pytest.raises(KvcalError, match="kvcal did not write"):
        write_file_atomically(user, doc, kind="evaluation", flag="--json")
    assert user.read_text() == '{"schema": "kvcal-eval/1"}'
    with pytest.raises(KvcalError, match="is the input --eval"):
        check_output_file(p, "evaluation", {"--eval": str(p)}, flag="--json")
    with pytest.raises(KvcalError, match="is a directory"):
        check_output_file(tmp_path / "a", "evaluation", flag="--json")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(KvcalError, match="is a file, not a directory"):
        check_output_file(tmp_path / "afile" / "e.json", "evaluation", flag="--json")
    link = tmp_path / "dangling.json"
    link.symlink_to(tmp_path / "nowhere")
    with pytest.raises(KvcalError, match="broken link"):
        check_output_file(link, "evaluation", flag="--json")

    def boom(tmp: Path) -> None:
        tmp.write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(KvcalError, match="No space left on device"):
        write_file_atomically(p, boom, kind="evaluation", flag="--json")
    assert p.read_text() == doc and sorted(x.name for x in p.parent.iterdir()) == ["e.json"]


# ---- report --out ------------------------------------------------------------------------------------

def test_report_never_overwrites_a_users_report(tmp_path):
    """``kvcal report --out DIR`` refuses, before writing anything, a DIR holding a report.md / report.html
    kvcal did not write."""
    from helpers.export import make_artifact

    from kvcal.outputs import kvcal_file_kind
    from kvcal.report.disclosure import write_report

    art = make_artifact(tmp_path / "art")[0]
    mine = tmp_path / "docs"
    mine.mkdir()
    for name in ("report.md", "report.html"):
        (mine / name).write_text(f"my own {name}\n")
        r = CliRunner().invoke(main, ["report", "--artifact", str(art), "--out", str(mine)])
        line = _one_error_line(r)
        assert name in line and "kvcal did not write" in line, r.output
        assert not (mine / "figures").exists()  # refused before anything was written
        (mine / name).unlink()
    (mine / "figures").mkdir()
    (mine / "figures" / "kv_ranges.png").write_bytes(b"\x89PNG\r\n\x1a\nmine")
    r = CliRunner().invoke(main, ["report", "--artifact", str(art), "--out", str(mine)])
    assert "kv_ranges.png" in _one_error_line(r)
    assert (mine / "figures" / "kv_ranges.png").read_bytes() == b"\x89PNG\r\n\x1a\nmine"
    shutil.rmtree(mine / "figures")
    (mine / "notes.txt").write_text("kept")
    res = write_report(art, out=mine)  # a directory with other files is fine: only kvcal's names are written
    assert (mine / "notes.txt").read_text() == "kept"
    assert kvcal_file_kind(Path(res["markdown"])) == "report" and kvcal_file_kind(Path(res["html"])) == "report"
    assert all(kvcal_file_kind(Path(f)) == "figure" for f in res["figures"])
    write_report(art, out=mine)  # kvcal's own report: replaced (into the artifact directory: test_report.py)
    r = CliRunner().invoke(main, ["report", "--artifact", str(art), "--out", str(art / "kv_scales.safetensors")])
    assert "not a directory" in _one_error_line(r)


# ---- calibrate --out default and --overwrite on committed files ------------------------------------------

def _git(cwd: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                   capture_output=True)


@pytest.fixture()
def tracked_example(tmp_path):
    """A git checkout holding a committed worked example at artifacts/smollm2-135m-fp8 (as this repo does)."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    from helpers.export import make_artifact

    repo = tmp_path / "repo"
    repo.mkdir()
    ex = make_artifact(repo / "artifacts" / "smollm2-135m-fp8")[0]
    (ex / "eval_1024.json").write_text(json.dumps({"schema": "kvcal-eval/1", "kvcal_version": "0", "results": []}))
    (repo / "c.jsonl").write_text(CHAT.read_text())
    _git(repo, "init", "-q")
    _git(repo, "add", "artifacts")
    _git(repo, "commit", "-q", "-m", "worked example")
    return repo, ex


def test_calibrate_default_out_is_never_the_committed_example(tracked_example, tiny_dir, monkeypatch):
    """``kvcal calibrate`` without ``--out`` (even with ``--overwrite``) writes kvcal_out/<model>-<preset> and
    leaves the committed example artifacts/smollm2-135m-fp8 byte for byte as it was."""
    from kvcal.calibrate import CalibrateConfig, calibrate
    from kvcal.models import load_model, load_tokenizer

    repo, ex = tracked_example
    before = {p: _sha(p) for p in ex.rglob("*") if p.is_file()}
    monkeypatch.chdir(repo)
    cfg = CalibrateConfig(corpus="c.jsonl", max_samples=8, max_seq_len=64, batch_size=4, reservoir=2,
                          heldout_reservoir=2, max_queries=16, overwrite=True)  # --model left at its default name
    res = calibrate(cfg, log=lambda s: None, progress=False, model=load_model(str(tiny_dir)),
                    tokenizer=load_tokenizer(str(tiny_dir)))
    assert Path(res["out"]) == Path("kvcal_out/smollm2-135m-fp8")
    assert (repo / "kvcal_out" / "smollm2-135m-fp8" / "kv_scales.safetensors").is_file()
    assert {p: _sha(p) for p in ex.rglob("*") if p.is_file()} == before


def test_refusals_never_suggest_overwrite_on_committed_or_foreign_files(tracked_example, tmp_path):
    """``--out`` on the committed example: refused with and without ``--overwrite`` (git tracks it), and the
    message does not suggest ``--overwrite``; same for a directory holding files kvcal did not write — also an
    artifact directory with a stray user file (``--overwrite`` would have deleted it)."""
    from helpers.export import make_artifact

    from kvcal.errors import KvcalError
    from kvcal.outputs import check_output_dir, foreign_files

    repo, ex = tracked_example
    before = {p: _sha(p) for p in ex.rglob("*") if p.is_file()}
    for extra in ([], ["--overwrite"]):
        r = CliRunner().invoke(main, ["calibrate", "--corpus", str(repo / "c.jsonl"), "--out", str(ex), "--quiet",
                                      *extra])
        line = _one_error_line(r)
        assert "tracked by git" in line and "pass --overwrite" not in line, r.output
    assert {p: _sha(p) for p in ex.rglob("*") if p.is_file()} == before
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("important")
    r = CliRunner().invoke(main, ["calibrate", "--corpus", str(CHAT), "--out", str(user), "--quiet"])
    line = _one_error_line(r)
    assert "kvcal did not write" in line and "pass --overwrite" not in line, r.output
    art = make_artifact(tmp_path / "art")[0]
    (art / "my-notes.txt").write_text("keep me")
    assert foreign_files(art) == [art / "my-notes.txt"]
    for ow in (False, True):
        with pytest.raises(KvcalError, match="my-notes.txt") as e:
            check_output_dir(art, ow)
        assert "pass --overwrite" not in str(e.value)
    (art / "my-notes.txt").unlink()
    with pytest.raises(KvcalError, match="pass --overwrite"):  # a plain kvcal artifact: the flag is the answer
        check_output_dir(art, False)
    check_output_dir(art, True)


def test_export_records_its_files_and_overwrite_keeps_a_stray_file(tmp_path):
    """The export's kvcal-export.json lists exactly the files export wrote, and export --overwrite over a
    directory holding a stray user file (README.txt) is refused with an ExportError naming it, the file left
    unchanged."""
    from helpers.export import make_artifact

    from kvcal.export import export
    from kvcal.export.base import ExportError

    art = make_artifact(tmp_path / "art")[0]
    res = export(art, "vllm", tmp_path / "exp")
    manifest = json.loads((tmp_path / "exp" / "kvcal-export.json").read_text())
    assert sorted(manifest["files"]) == sorted(res.files)
    (tmp_path / "exp" / "README.txt").write_text("mine")
    with pytest.raises(ExportError, match="README.txt"):
        export(art, "vllm", tmp_path / "exp", overwrite=True)
    assert (tmp_path / "exp" / "README.txt").read_text() == "mine"


# ---- --resume never unpickles ------------------------------------------------------------------------

class _Planted:
    """Unpickling this runs ``open(marker, 'w').write('pwned')`` (what a planted checkpoint can do)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


def test_resume_never_executes_a_planted_checkpoint(tmp_path, tiny_dir):
    """``--resume`` with a planted ``<out>.checkpoint.pt`` pickle is refused in one line and executes nothing
    (the checkpoint is checked before anything is unpickled)."""
    from kvcal.calibrate import checkpoint_path

    out = tmp_path / "art"
    marker = tmp_path / "PWNED"
    ck = Path(checkpoint_path(str(out)))
    torch.save({"fingerprint": _Planted(str(marker)), "next_batch": 0}, ck)
    r = CliRunner().invoke(main, ["calibrate", "--corpus", str(CHAT), "--model", str(tiny_dir), "--out", str(out),
                                  "--max-samples", "4", "--max-seq-len", "32", "--resume", "--quiet"])
    line = _one_error_line(r)
    assert not marker.exists(), "the planted checkpoint executed code"
    assert str(ck) in line and "not a kvcal checkpoint" in line, r.output
    assert not out.exists()
    # a plain pickle file (not even torch's zip format) and a checkpoint file kvcal did not write: same refusal,
    # and --checkpoint-every does not replace a file kvcal did not write at that path
    import pickle

    ck.write_bytes(pickle.dumps(_Planted(str(marker))))
    r = CliRunner().invoke(main, ["calibrate", "--corpus", str(CHAT), "--model", str(tiny_dir), "--out", str(out),
                                  "--max-samples", "4", "--max-seq-len", "32", "--resume", "--quiet"])
    assert "not a kvcal checkpoint" in _one_error_line(r) and not marker.exists()
    ck.write_text("my file")
    r = CliRunner().invoke(main, ["calibrate", "--corpus", str(CHAT), "--model", str(tiny_dir), "--out", str(out),
                                  "--max-samples", "4", "--max-seq-len", "32", "--checkpoint-every", "1", "--quiet"])
    assert "kvcal did not write" in _one_error_line(r) and ck.read_text() == "my file"


def test_resume_refuses_a_malformed_checkpoint_in_one_line(tmp_path, tiny_dir, monkeypatch):
    """A safe-to-load file with the run's fingerprint but a broken state is one line, not a traceback."""
    import kvcal.calibrate as cal
    import kvcal.capture.run as capture_run
    from kvcal.errors import KvcalError
    from kvcal.models import load_model, load_tokenizer

    out = tmp_path / "art"
    seen = {}

    def grab(ck):  # learn this run's fingerprint, then plant a state with it
        seen["fp"] = ck.fingerprint
        raise KvcalError("stop")

    cfg = cal.CalibrateConfig(corpus=str(CHAT), out=str(out), max_samples=4, max_seq_len=32, resume=True,
                              reservoir=2, heldout_reservoir=2, max_queries=16)
    model, tok = load_model(str(tiny_dir)), load_tokenizer(str(tiny_dir))
    with monkeypatch.context() as m:
        m.setattr(capture_run, "load_checkpoint", grab)  # run_capture reads the checkpoint through it
        with pytest.raises(KvcalError, match="stop"):
            cal.calibrate(cfg, log=lambda s: None, progress=False, model=model, tokenizer=tok)
    torch.save({"fingerprint": seen["fp"], "next_batch": "x"}, cal.checkpoint_path(str(out)))
    with pytest.raises(KvcalError, match="malformed"):
        cal.calibrate(cfg, log=lambda s: None, progress=False, model=model, tokenizer=tok)


# ---- export --model-dir: no index entry may lead outside --model-dir / --out ---------------------------

def test_export_refuses_index_entries_outside_the_model_dir(tmp_path):
    """An index entry mapping weights outside the model directory (``../outside/w.safetensors``) is refused in
    one line; export writes nothing outside --out."""
    from helpers.export import make_artifact, make_checkpoint

    from kvcal.export.base import ExportError
    from kvcal.export.checkpoint import staged_path

    art = make_artifact(tmp_path / "art")[0]
    src = make_checkpoint(tmp_path / "m" / "src")
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first_shard = sorted(set(index["weight_map"].values()))[0]
    (tmp_path / "m" / "outside").mkdir()
    shutil.copy(src / first_shard, tmp_path / "m" / "outside" / "w.safetensors")
    o = tmp_path / "o"  # --out o/x: the staging sibling's ../outside is o/outside, the user's file
    (o / "outside").mkdir(parents=True)
    victim = o / "outside" / "w.safetensors"
    victim.write_bytes(b"the user's file")
    before = _sha(victim)
    (tmp_path / "abs.safetensors").write_bytes(victim.read_bytes())
    for entry in ("../outside/w.safetensors", str(tmp_path / "abs.safetensors"), "sub/../../outside/w.safetensors"):
        bad = dict(index, weight_map={k: (entry if v == first_shard else v) for k, v in index["weight_map"].items()})
        index_path.write_text(json.dumps(bad))
        r = CliRunner().invoke(main, ["export", "--artifact", str(art), "--target", "vllm", "--model-dir", str(src),
                                      "--out", str(o / "x")])
        line = _one_error_line(r)
        assert repr(entry) in line and "inside --model-dir" in line, r.output
        assert _sha(victim) == before and not (o / "x").exists()
        assert sorted(x.name for x in o.iterdir()) == ["outside"]  # no staging directory left either
    # the writer's own guard: a path leaving the staging directory is refused whatever the caller passes
    with pytest.raises(ExportError, match="outside the output directory"):
        staged_path(tmp_path / "stage", "../outside/w.safetensors")
    assert staged_path(tmp_path / "stage", "sub/w.safetensors") == tmp_path / "stage" / "sub" / "w.safetensors"


def test_single_file_writers_never_replace_a_committed_file(tracked_example):
    """Every single-file writer refuses a file git tracks (e.g. the committed example's eval_1024.json), even
    one kvcal wrote; an untracked kvcal file beside it is still replaced."""
    from kvcal.errors import KvcalError
    from kvcal.outputs import check_output_file, write_file_atomically

    repo, ex = tracked_example
    (ex / "report.md").write_text("# committed report\n")
    _git(repo, "add", "artifacts")
    _git(repo, "commit", "-q", "-m", "report")
    before = {p: _sha(p) for p in ex.rglob("*") if p.is_file()}
    doc = json.dumps({"schema": "kvcal-eval/1", "kvcal_version": "0", "results": [1]})
    with pytest.raises(KvcalError, match="tracked by git.*never replaces committed files"):
        write_file_atomically(ex / "eval_1024.json", doc, "evaluation", flag="--json")
    r = CliRunner().invoke(main, ["report", "--artifact", str(ex), "--out", str(ex)])
    line = _one_error_line(r)
    assert "report" in line and "tracked by git" in line, r.output
    assert {p: _sha(p) for p in ex.rglob("*") if p.is_file()} == before
    assert not (ex / "figures").exists()
    untracked = ex / "eval_2048.json"
    untracked.write_text(json.dumps({"schema": "kvcal-eval/1", "kvcal_version": "0", "results": []}))
    check_output_file(untracked, "evaluation", flag="--json")  # kvcal's own, uncommitted: replaceable
    write_file_atomically(untracked, doc, "evaluation", flag="--json")
    assert untracked.read_text() == doc


def test_report_never_replaces_another_artifacts_report(tmp_path):
    """``report --artifact A --out B`` with B another artifact's directory is refused (by artifact sha256);
    a byte-identical copy of A is accepted."""
    from helpers.export import make_artifact

    from kvcal.report.disclosure import write_report

    a = make_artifact(tmp_path / "a", seed=0)[0]
    b = make_artifact(tmp_path / "b", seed=1)[0]
    write_report(b)  # B's own report, figures included
    before = {p: _sha(p) for p in b.rglob("*") if p.is_file()}
    assert {"report.md", "report.html"} <= {p.name for p in before}
    r = CliRunner().invoke(main, ["report", "--artifact", str(a), "--out", str(b)])
    line = _one_error_line(r)
    assert "holds another artifact" in line and str(b) in line, r.output
    assert {p: _sha(p) for p in b.rglob("*") if p.is_file()} == before
    shutil.copytree(a, tmp_path / "a2")  # the same artifact elsewhere: its report is this one's
    r = CliRunner().invoke(main, ["report", "--artifact", str(a), "--out", str(tmp_path / "a2")])
    assert r.exit_code == 0, r.output


# ---- --overwrite replaces only an output of the same kind; no output nested inside another ----------------

def test_overwrite_replaces_only_an_output_of_the_same_kind(tmp_path):
    """``--overwrite`` replaces only an output of the same kind: export only an export, calibrate
    (write_artifact) only an artifact."""
    from helpers.export import make_artifact

    from kvcal.artifact import write_artifact
    from kvcal.outputs import check_output_dir

    a = make_artifact(tmp_path / "a", seed=0)[0]
    b = make_artifact(tmp_path / "b", seed=1)[0]
    before = {p: _sha(p) for p in b.rglob("*") if p.is_file()}
    r = CliRunner().invoke(main, ["export", "--artifact", str(a), "--target", "vllm", "--out", str(b), "--overwrite"])
    line = _one_error_line(r)
    assert "calibration artifact" in line and "not a kvcal export" in line, r.output
    assert {p: _sha(p) for p in b.rglob("*") if p.is_file()} == before
    exp = tmp_path / "exp"
    assert CliRunner().invoke(main, ["export", "--artifact", str(a), "--target", "vllm", "--out", str(exp)]).exit_code == 0
    r = CliRunner().invoke(main, ["export", "--artifact", str(b), "--target", "vllm", "--out", str(exp), "--overwrite"])
    assert r.exit_code == 0, r.output  # an export over an export: replaced
    exp_before = {p: _sha(p) for p in exp.rglob("*") if p.is_file()}
    from kvcal.artifact import load_artifact
    from kvcal.errors import KvcalError

    art = load_artifact(a)
    with pytest.raises(KvcalError, match="holds a kvcal export.*not a kvcal calibration artifact"):
        write_artifact(exp, art.tensors, art.metadata, overwrite=True)  # what calibrate --overwrite writes through
    with pytest.raises(KvcalError, match="holds a kvcal export"):
        check_output_dir(exp, True, kind="artifact")  # calibrate's early check
    assert {p: _sha(p) for p in exp.rglob("*") if p.is_file()} == exp_before
    write_artifact(b, art.tensors, art.metadata, overwrite=True)  # an artifact over an artifact: replaced
    assert all(torch.equal(load_artifact(b).tensors[k], t) for k, t in art.tensors.items())


def test_no_output_is_nested_inside_another_kvcal_output(tracked_example, tmp_path):
    """An --out inside an artifact or an export (the committed example included) is refused, for calibrate and
    for export, and the example is left as it was."""
    from helpers.export import make_artifact

    repo, ex = tracked_example
    before = sorted(p.name for p in ex.iterdir())
    r = CliRunner().invoke(main, ["calibrate", "--corpus", str(repo / "c.jsonl"), "--out", str(ex / "sub"), "--quiet"])
    line = _one_error_line(r)
    assert "lies inside" in line and "calibration artifact" in line, r.output
    a = make_artifact(tmp_path / "a")[0]
    for out in (ex / "sub", a / "sub" / "deeper"):
        r = CliRunner().invoke(main, ["export", "--artifact", str(a), "--target", "vllm", "--out", str(out)])
        assert "lies inside" in _one_error_line(r), r.output
    exp = tmp_path / "exp"
    assert CliRunner().invoke(main, ["export", "--artifact", str(a), "--target", "vllm", "--out", str(exp)]).exit_code == 0
    r = CliRunner().invoke(main, ["export", "--artifact", str(a), "--target", "sglang-json", "--out", str(exp / "sg")])
    assert "lies inside" in _one_error_line(r) and "kvcal export" in r.output, r.output
    assert sorted(p.name for p in ex.iterdir()) == before and not (a / "sub").exists() and not (exp / "sg").exists()


# ---- two runs, one --out: one writes, the other refuses (issue 40, class 2) -------------------------------------


def _leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_run_never_replaces_an_out_another_run_wrote_meanwhile(tmp_path, overwrite):
    """Run A's fill starts run B on the same --out, and B completes first (a new --out; or, with --overwrite, B
    replaces the output both checked at the start). A then refuses in one line, B's output is intact, and no
    staging or moved-aside directory is left."""
    from kvcal.errors import ArtifactError
    from kvcal.outputs import write_dir_atomically

    out = tmp_path / "out"
    if overwrite:
        write_dir_atomically(out, lambda d: (d / "kvcal-export.json").write_text('{"kvcal_version": "0"}'),
                             kind="export")

    def fill_b(d: Path) -> None:
        (d / "kvcal-export.json").write_text('{"kvcal_version": "B"}')

    def fill_a(d: Path) -> None:
        (d / "kvcal-export.json").write_text('{"kvcal_version": "A"}')
        write_dir_atomically(out, fill_b, overwrite=overwrite, kind="export")  # the other run, finishing first

    with pytest.raises(ArtifactError, match="written by another process") as e:
        write_dir_atomically(out, fill_a, overwrite=overwrite, kind="export")
    assert "\n" not in str(e.value)
    assert json.loads((out / "kvcal-export.json").read_text())["kvcal_version"] == "B"
    assert _leftovers(tmp_path, "out") == []


def test_an_empty_directory_that_appears_at_out_is_not_replaced(tmp_path):
    """A directory created at --out during the run (here empty: plain rename would silently replace it) is kept,
    and the run refuses."""
    from kvcal.errors import ArtifactError
    from kvcal.outputs import write_dir_atomically

    out = tmp_path / "out"

    def fill(d: Path) -> None:
        (d / "f").write_text("x")
        out.mkdir()

    with pytest.raises(ArtifactError, match="written by another process"):
        write_dir_atomically(out, fill)
    assert out.is_dir() and list(out.iterdir()) == []
    assert _leftovers(tmp_path, "out") == []


def test_export_and_calibrate_writers_race_safely(tmp_path, monkeypatch):
    """The commands that write a directory go through the same claim: an export whose target writer lets another
    export finish at the same --out first refuses (exit 2, one line) and leaves the other's files; an artifact write
    (calibrate's writer) whose safetensors save lets another artifact write finish first refuses likewise."""
    import safetensors.torch as st
    from helpers.cli import run_cli
    from helpers.export import make_artifact

    from kvcal.export import get_target

    art, _ = make_artifact(tmp_path / "art")
    out = tmp_path / "exp"
    t = get_target("vllm")
    real_write = type(t).write
    state = {"inner": False}

    def racing_write(self, ctx, staging):
        if not state["inner"]:
            state["inner"] = True
            run_cli(["export", "--artifact", str(art), "--target", "modelopt", "--out", str(out)])
        return real_write(self, ctx, staging)

    monkeypatch.setattr(type(t), "write", racing_write)
    msg = run_cli(["export", "--artifact", str(art), "--target", "vllm", "--out", str(out)], code=2)
    assert "written by another process" in msg
    assert json.loads((out / "kvcal-export.json").read_text())["target"] == "modelopt"
    monkeypatch.undo()

    from kvcal.artifact import load_artifact, write_artifact

    a = load_artifact(art)
    real_save = st.save_file
    state["inner"] = False

    def racing_save(*args, **kw):
        if not state["inner"]:
            state["inner"] = True
            write_artifact(tmp_path / "art2", a.tensors, {**a.metadata, "created": "B"})
        return real_save(*args, **kw)

    monkeypatch.setattr(st, "save_file", racing_save)
    from kvcal.errors import ArtifactError

    with pytest.raises(ArtifactError, match="written by another process"):
        write_artifact(tmp_path / "art2", a.tensors, {**a.metadata, "created": "A"})
    monkeypatch.undo()
    assert load_artifact(tmp_path / "art2").metadata["created"] == "B"
    assert _leftovers(tmp_path, "art2") == [] and _leftovers(tmp_path, "exp") == []


# ---- a full disk: one line naming the path and the cause, exit 2, nothing left (issue 40, class 3) --------------


@pytest.fixture
def full_fs(tmp_path):
    """A 256 KiB tmpfs at tmp_path/fs, filled but for 2 KiB (root may mount one; skipped where it cannot)."""
    import os

    d = tmp_path / "fs"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(d)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip() or r.returncode})")
    try:
        st = os.statvfs(d)
        (d / "filler").write_bytes(b"\0" * (st.f_bavail * st.f_frsize - 2048))
        yield d
    finally:
        subprocess.run(["umount", str(d)], capture_output=True)


def test_every_writer_reports_a_full_disk_in_one_line_and_leaves_nothing(full_fs, tmp_path):
    """On a full filesystem the artifact writer (calibrate's), export (standalone safetensors, whose library raises
    its own error type) and report each end in one line naming the path and "No space left on device", exit 2 from
    the CLI, and leave nothing behind: no staging directory, no partial file, no empty figures/ directory."""
    from helpers.cli import run_cli
    from helpers.export import make_artifact

    from kvcal.artifact import load_artifact, write_artifact
    from kvcal.errors import ArtifactError

    art, _ = make_artifact(tmp_path / "art")
    a = load_artifact(art)
    big = {k: v.expand(4096).clone() if v.numel() == 1 else v for k, v in a.tensors.items()}  # > 2 KiB of tensors
    with pytest.raises(ArtifactError, match="No space left on device") as e:
        write_artifact(full_fs / "art", big, a.metadata)
    assert "\n" not in str(e.value) and str(full_fs / "art") in str(e.value)
    assert sorted(p.name for p in full_fs.iterdir()) == ["filler"]
    msg = run_cli(["export", "--artifact", str(art), "--target", "vllm", "--out", str(full_fs / "exp")], code=2)
    assert "No space left on device" in msg and "Traceback" not in msg
    assert sorted(p.name for p in full_fs.iterdir()) == ["filler"]
    rep = full_fs / "rep"
    rep.mkdir()
    msg = run_cli(["report", "--artifact", str(art), "--out", str(rep)], code=2)
    assert "No space left on device" in msg and "nothing was written" in msg
    assert list(rep.iterdir()) == []


def test_single_file_writer_on_a_full_disk_says_so_and_leaves_nothing(full_fs):
    """The one-file writer behind `evaluate --json` and `verify --json` (and calibrate's --checkpoint-every state) on a
    full filesystem: one line naming the path and "No space left on device", no temporary sibling or partial file
    left."""
    from kvcal.errors import KvcalError
    from kvcal.outputs import write_file_atomically

    out = full_fs / "e.json"
    with pytest.raises(KvcalError, match="No space left on device") as e:
        write_file_atomically(out, "x" * 65536, "evaluation", flag="--json")
    assert "\n" not in str(e.value) and str(out) in str(e.value)
    assert sorted(p.name for p in full_fs.iterdir()) == ["filler"]
