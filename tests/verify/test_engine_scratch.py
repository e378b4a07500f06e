"""The engine subprocess of ``kvcal verify`` (:func:`kvcal.verify.engine.run_engine`) leaves nothing in the user's
``$TMPDIR`` on any exit (issue 40, class 6): vLLM writes a ``vllm_dist_<uuid>`` file to its temporary directory and
leaves it when it is stopped. A fake engine (a shell script given as the engine's Python) writes such a file to its
``$TMPDIR``, records where that was and what it was told, then answers, refuses, crashes or hangs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from kvcal.errors import KvcalError
from kvcal.verify.engine import run_engine

REPO = Path(__file__).resolve().parents[2]

#: what the fake engine does after writing its scratch file (``$3``: the result path the runner is given)
ENDINGS = {
    "result": "echo '{\"runs\": {}}' > \"$3\"; exit 0",
    "refusal": "echo '{\"error\": \"cannot serve\"}' > \"$3\"; exit 3",
    "crash": "echo 'RuntimeError: boom' >&2; exit 1",
    # a child of the engine (as vLLM's compile workers are) holds on; the engine waits for it
    "hang": "sleep 300 & echo $! > {mark}/child; echo ready > {mark}/ready; wait",
}


def _fake_engine(tmp_path: Path, ending: str) -> tuple[Path, Path]:
    """An executable fake engine Python in ``tmp_path``, and the folder it records into."""
    mark = tmp_path / "mark"
    mark.mkdir()
    py = tmp_path / "fake-python"
    py.write_text("#!/bin/sh\n"
                  'echo rendezvous > "$TMPDIR/vllm_dist_0123456789abcdef"\n'
                  f'echo "$TMPDIR" > {mark}/tmpdir; echo "$TEMP:$TMP" > {mark}/temp_tmp\n'
                  f'echo "$TORCHINDUCTOR_CACHE_DIR" > {mark}/inductor\n'
                  + ENDINGS[ending].replace("{mark}", str(mark)) + "\n")
    py.chmod(0o755)
    return py, mark


def _gone(pid: int) -> bool:
    """No such process, or a zombie waiting for a reaper (it runs nothing, holds no file)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.fixture
def user_tmp(tmp_path, monkeypatch):
    """The user's temporary directory for this test (``TMPDIR`` and :mod:`tempfile`'s cached one)."""
    d = tmp_path / "user-tmp"
    d.mkdir()
    monkeypatch.setenv("TMPDIR", str(d))
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    # torch inductor writes its default TORCHINDUCTOR_CACHE_DIR into os.environ once it has compiled anything in
    # this process (torch._inductor.runtime.cache_dir_utils.cache_dir): a user who never set it starts without it
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    return d


@pytest.mark.parametrize("ending, error", [("result", None), ("refusal", "engine refused: cannot serve"),
                                           ("crash", "the engine exited with status 1: RuntimeError: boom"),
                                           ("hang", "the engine did not finish within 2 s (--timeout)")])
def test_the_engine_scratch_is_removed_on_every_exit(tmp_path, user_tmp, ending, error):
    """The engine's TMPDIR, TEMP and TMP name one directory kvcal made for the run inside the user's temporary
    directory (the fake writes its vllm_dist_ file there); after a result, a refusal, a crash or a timeout the
    user's temporary directory is empty again, and after the timeout the engine's child process is gone too.
    torch inductor's compile cache is pointed at its default place under the user's temporary directory (shared
    by runs, not removed)."""
    py, mark = _fake_engine(tmp_path, ending)
    work = tmp_path / "work"
    work.mkdir()
    if error is None:
        assert run_engine(py, {"runs": []}, work, timeout_s=60) == {"runs": {}}
    else:
        with pytest.raises(KvcalError) as e:
            run_engine(py, {"runs": []}, work, timeout_s=2)
        assert error in str(e.value) and "\n" not in str(e.value)
    scratch = Path((mark / "tmpdir").read_text().strip())
    assert scratch.parent == user_tmp and scratch.name.startswith("kvcal-engine-tmp-")
    assert (mark / "temp_tmp").read_text().strip() == f"{scratch}:{scratch}"
    assert Path((mark / "inductor").read_text().strip()).parent == user_tmp
    assert list(user_tmp.iterdir()) == []  # the vllm_dist_ file went with its directory
    if ending == "hang":
        assert _gone(int((mark / "child").read_text()))


DRIVER = """
import signal, sys
from pathlib import Path
from kvcal.cli.common import user_errors
from kvcal.verify.engine import run_engine
signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C, even where the test runner ignores SIGINT
user_errors(lambda: run_engine(Path(sys.argv[1]), {"runs": []}, Path(sys.argv[2]), 300))()
"""


@pytest.mark.parametrize("sig, status, said", [(signal.SIGTERM, 143, "terminated by SIGTERM"),
                                               (signal.SIGINT, 130, "interrupted")])
def test_a_stopped_kvcal_takes_the_engine_and_its_scratch_with_it(tmp_path, sig, status, said):
    """kvcal (its CLI error handling around run_engine, in a process of its own) gets SIGTERM or Ctrl-C while the
    engine runs: kvcal exits 128 + the signal number saying so, the engine's child process is gone and the user's
    temporary directory holds nothing."""
    py, mark = _fake_engine(tmp_path, "hang")
    work, user = tmp_path / "work", tmp_path / "user-tmp"
    work.mkdir()
    user.mkdir()
    env = {**os.environ, "TMPDIR": str(user), "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(py), str(work)], env=env, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 60
        while not (mark / "ready").is_file() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert (mark / "ready").is_file(), proc.communicate(timeout=10)[1]
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == status, err
    assert err.strip() == f"{said}: nothing was written (temporary output removed)"
    assert list(user.iterdir()) == []
    assert _gone(int((mark / "child").read_text()))
    assert not Path((mark / "tmpdir").read_text().strip()).exists()
