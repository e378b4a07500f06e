"""Output-path safety and atomic writes for every file and directory kvcal writes.

kvcal replaces an existing output only when it wrote it (:func:`kvcal_file_kind`: artifact header,
export manifest, recommendation schema, report marks, PNG software chunk) and git tracks none of it;
it refuses an output that is, or contains, one of the command's inputs. Writing is atomic: into a
temporary sibling that is renamed into place only when complete (:func:`write_file_atomically`,
:func:`write_dir_atomically`). Pure Python (``git`` is run as a subprocess when present)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from kvcal.errors import ArtifactError, KvcalError

SCALES_FILE = "kv_scales.safetensors"


def _safetensors_metadata(f: Path) -> dict:
    """The ``__metadata__`` of safetensors file ``f`` read from its header alone (no tensor data); ``{}``
    when ``f`` is not a readable safetensors file."""
    import struct

    try:
        with open(f, "rb") as h:
            n = struct.unpack("<Q", h.read(8))[0]
            if not 0 < n <= 100_000_000:
                return {}
            header = json.loads(h.read(n))
        meta = header.get("__metadata__") if isinstance(header, dict) else None
        return meta if isinstance(meta, dict) else {}
    except (OSError, ValueError, struct.error):
        return {}


def _output_kind(path: Path) -> str | None:
    """``"artifact"`` when directory ``path`` holds a ``kv_scales.safetensors`` whose header carries kvcal
    metadata, ``"export"`` when its ``kvcal-export.json`` manifest names a ``kvcal_version``,
    ``"recommendation"`` when its ``deploy.json`` has a ``kvcal-recommend/`` schema, else None."""
    if "kvcal" in _safetensors_metadata(path / SCALES_FILE):
        return "artifact"
    for name, key, kind in ((EXPORT_MANIFEST, "kvcal_version", "export"), (RECOMMEND_DOC, "schema", "recommendation")):
        m = path / name
        try:
            if m.is_file() and m.stat().st_size <= _MAX_JSON_BYTES:
                d = json.loads(m.read_text(encoding="utf-8"))
                if isinstance(d, dict) and key in d and (kind != "recommendation"
                                                         or str(d[key]).startswith(RECOMMEND_SCHEMA_PREFIX)):
                    return kind
        except (OSError, ValueError, TypeError):
            return None
    return None


#: Kinds of output directory :func:`_output_kind` finds, with how a message describes them.
DIR_KINDS = {
    "artifact": "a kvcal calibration artifact (kv_scales.safetensors)",
    "export": "a kvcal export (kvcal-export.json)",
    "recommendation": "a kvcal recommend output (deploy.json)",
}
#: what ``kvcal recommend`` writes: ``deploy.md`` and ``deploy.json`` (schema ``kvcal-recommend/<n>``) beside the
#: calibrated artifacts it keeps (sub-directories that are artifacts)
RECOMMEND_DOC = "deploy.json"
RECOMMEND_FILES = ("deploy.md", "deploy.json")
RECOMMEND_SCHEMA_PREFIX = "kvcal-recommend/"


def is_kvcal_output(path: Path) -> bool:
    """True when directory ``path`` is something kvcal wrote: an artifact (``kv_scales.safetensors``
    whose header carries kvcal metadata), an export (its ``kvcal-export.json`` manifest names a
    ``kvcal_version``) or a ``kvcal recommend`` output (``deploy.json`` with a ``kvcal-recommend/`` schema). Whether ``--overwrite`` may replace it also depends on :func:`foreign_files`
    and :func:`git_tracked_files` (see :func:`check_output_dir`)."""
    return _output_kind(Path(path)) is not None


# ---- single files kvcal writes, and how it knows them again ------------------------------------
# One provenance rule for every output: a directory is kvcal's when it is an artifact or an export
# (above); a single file is kvcal's when it carries kvcal's mark in its own format (below). A command
# replaces only outputs of the kind it writes, never one of its inputs, and writes through a
# temporary sibling renamed into place (write_dir_atomically / write_file_atomically).

#: Names :func:`kvcal_file_kind` returns, with how a message describes them.
FILE_KINDS = {
    "evaluation": "a kvcal evaluation (kvcal evaluate --json)",
    "verification": "a kvcal verification (kvcal verify --json)",
    "report": "a kvcal report (kvcal report)",
    "figure": "a kvcal report figure",
    "checkpoint": "a kvcal calibration checkpoint",
    "artifact": "a kvcal artifact's scales file",
    "export-manifest": "a kvcal export manifest",
}
EXPORT_MANIFEST = "kvcal-export.json"
EVAL_SCHEMA = "kvcal-eval/1"
#: last line of a ``report.md`` written by ``kvcal report`` (an HTML comment: invisible when rendered)
REPORT_MD_MARK = "<!-- written by kvcal report"
#: ``<meta>`` tag in the ``<head>`` of a ``report.html`` written by kvcal
REPORT_HTML_MARK = '<meta name="generator" content="kvcal'
#: PNG ``tEXt`` ``Software`` value of a kvcal figure starts with this
PNG_SOFTWARE = "kvcal "
_MAX_JSON_BYTES = 256 * 2**20


def kvcal_file_kind(path: str | os.PathLike) -> str | None:
    """What kvcal wrote at file ``path`` (a key of :data:`FILE_KINDS`), or None for a file kvcal did not
    write, a missing or unreadable one.

    Marks: an evaluation JSON has ``"schema": "kvcal-eval/1"`` and a ``kvcal_version``; ``report.md`` ends
    with :data:`REPORT_MD_MARK`; ``report.html`` has :data:`REPORT_HTML_MARK`; a figure PNG has a ``Software``
    text chunk starting ``kvcal``; a checkpoint is a torch zip file that loads with ``weights_only=True`` (no
    code can run) into a dict with a ``fingerprint`` string; ``kv_scales.safetensors`` has kvcal metadata.
    ``report.md`` / ``report.html`` / ``figures/*.png`` inside an artifact directory count as kvcal's even
    without the mark (``kvcal calibrate`` writes ``report.md`` there; earlier releases wrote no mark)."""
    p = Path(path)
    if not p.is_file():
        return None
    suffix = p.suffix.lower()
    try:
        if suffix == ".json":
            if p.stat().st_size > _MAX_JSON_BYTES:
                return None
            d = json.loads(p.read_text(encoding="utf-8"))
            if not isinstance(d, dict) or not isinstance(d.get("kvcal_version"), str):
                return None
            if d.get("schema") == EVAL_SCHEMA:
                return "evaluation"
            if d.get("schema") == "kvcal-verify/1":
                return "verification"
            return "export-manifest" if p.name == EXPORT_MANIFEST else None
        if suffix == ".safetensors":
            return "artifact" if "kvcal" in _safetensors_metadata(p) else None
        if suffix == ".pt":
            import torch

            try:  # weights_only: tensors, numbers, strings and containers only — a planted pickle cannot run
                st = torch.load(p, weights_only=True, mmap=True, map_location="cpu")
            except Exception:  # torch raises many types for a foreign or damaged file
                return None
            return "checkpoint" if isinstance(st, dict) and isinstance(st.get("fingerprint"), str) else None
        if suffix in (".md", ".html", ".png"):
            if _marked(p, suffix):
                return "figure" if suffix == ".png" else "report"
            in_artifact = (p.name in ("report.md", "report.html") and _output_kind(p.parent) == "artifact") or (
                suffix == ".png" and p.parent.name == "figures" and _output_kind(p.parent.parent) == "artifact")
            return ("figure" if suffix == ".png" else "report") if in_artifact else None
    except (OSError, ValueError):
        return None
    return None


def _marked(p: Path, suffix: str) -> bool:
    """True when report file ``p`` carries kvcal's mark (see :func:`kvcal_file_kind`)."""
    if suffix == ".png":
        from PIL import Image  # a matplotlib dependency

        try:
            with Image.open(p) as im:
                return str(im.info.get("Software", "")).startswith(PNG_SOFTWARE)
        except Exception:  # PIL raises several types for a damaged image
            return False
    with open(p, "rb") as h:
        if suffix == ".html":
            return REPORT_HTML_MARK.encode() in h.read(4096)
        h.seek(max(0, p.stat().st_size - 1024))
        return REPORT_MD_MARK.encode() in h.read()


def foreign_files(path: str | os.PathLike) -> list[Path]:
    """Files under directory ``path`` that kvcal did not write, sorted; ``--overwrite`` would delete them.

    In an artifact directory every file must be one :func:`kvcal_file_kind` recognizes (scales, report,
    figures, evaluations); in an export every file must be listed in its manifest's ``files`` (exports
    written before the list was recorded: none can be told apart, so none is counted); in a ``kvcal recommend``
    output only ``deploy.md``, ``deploy.json`` and the kvcal files of artifact / export sub-directories (the
    artifact it keeps, the checkpoint its ``kvcal export`` line writes there) are kvcal's; in
    any other directory every file is foreign."""
    path = Path(path)
    files = sorted(f for f in path.rglob("*") if f.is_file() or f.is_symlink())
    kind = _output_kind(path)
    if kind == "artifact":
        return [f for f in files if kvcal_file_kind(f) is None]
    if kind == "recommendation":  # its kept artifact/, and the checkpoint its printed export line writes inside it
        subs = {d.name: d for d in path.iterdir()
                if d.is_dir() and not d.is_symlink() and _output_kind(d) in ("artifact", "export")}
        foreign_in_subs = {f for d in subs.values() for f in foreign_files(d)}
        return [f for f in files
                if not ((f.parent == path and f.name in RECOMMEND_FILES and not f.is_symlink())
                        or (f.relative_to(path).parts[0] in subs and f not in foreign_in_subs))]
    if kind == "export":
        try:
            listed = json.loads((path / EXPORT_MANIFEST).read_text(encoding="utf-8")).get("files")
        except (OSError, ValueError, AttributeError):
            listed = None
        if not isinstance(listed, list):
            return []
        keep = {*map(str, listed), EXPORT_MANIFEST}
        return [f for f in files if str(f.relative_to(path)) not in keep]
    return files


def git_tracked_files(path: str | os.PathLike) -> list[str]:
    """Paths (relative to ``path``) of the files git tracks under directory ``path``: committed files that
    ``--overwrite`` must never delete (a worked example in a checkout). Empty when ``path`` is not in a git
    work tree or git is not installed (then nothing can be known to be committed)."""
    import subprocess

    try:
        r = subprocess.run(["git", "-C", str(path), "ls-files", "-z", "--", "."], capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return []
    if r.returncode != 0:
        return []
    return [x for x in r.stdout.decode("utf-8", errors="replace").split("\0") if x]


def is_git_tracked(path: str | os.PathLike) -> bool:
    """True when git tracks file ``path`` (a committed file: no kvcal command may replace it). False when it is
    untracked, not in a git work tree, its directory does not exist, or git is not installed."""
    import subprocess

    p = Path(os.path.abspath(path))
    try:
        r = subprocess.run(["git", "-C", str(p.parent), "ls-files", "-z", "--", p.name], capture_output=True,
                           timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0 and bool(r.stdout.strip(b"\0"))


def _check_inputs(out: Path, inputs: dict[str, object] | None, error: type[KvcalError], flag: str,
                  contains: bool) -> None:
    """Refuse ``out`` when it is one of ``inputs`` (option -> path; ``None`` and loaded artifacts skipped)
    or, with ``contains``, a directory holding one."""
    dst = out.resolve()
    for opt, p in (inputs or {}).items():
        if p is None or not isinstance(p, (str, os.PathLike)):  # a loaded artifact, not a path
            continue
        src = Path(p).resolve()
        if src == dst or (contains and dst in src.parents):
            raise error(f"{flag} {out} is {'or contains ' if contains else ''}the input {opt} {p}; writing there "
                        f"would destroy it — choose {'an ' + flag + ' outside it' if contains else 'another ' + flag}")


def _check_parents_writable(out: Path, error: type[KvcalError], flag: str, noun: str) -> None:
    """Refuse when a parent of ``out`` is a file or the nearest existing ancestor does not take new entries
    (read-only, ``/proc``, permissions — probed with an empty temporary directory removed at once)."""
    dst = out.resolve()
    for par in dst.parents:
        if par.exists() and not par.is_dir():
            raise error(f"cannot write {flag} {out}: {par} is a file, not a directory; choose another {flag}")
    # the output is staged in a sibling: probe that the nearest existing ancestor takes one, so a read-only
    # or pseudo-file-system location fails now, not after the whole run
    anc = next(par for par in dst.parents if par.exists())
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".kvcal-probe-", dir=anc))
    except OSError as e:
        raise error(f"cannot write {flag} {out}: {anc} does not take new {noun} "
                    f"({e.strerror or e}); choose a writable {flag}") from None


def check_output_dir(out: str | os.PathLike, overwrite: bool, inputs: dict[str, object] | None = None,
                     error: type[KvcalError] = ArtifactError, kind: str | None = None) -> None:
    """Refuse an output directory before any work is done (and again when it is written).

    ``inputs``: option name -> path the command reads (``--corpus``, ``--artifact``,
    ``--model-dir``, …; ``None`` entries ignored). Raises ``error`` when ``out`` is, or contains, one
    of them (replacing it would destroy the input); when it exists and is not a directory; when it
    holds files kvcal did not write (a directory that is not an artifact or an export — a mistyped
    ``--out .`` must not wipe a working tree —, or a stray file in one: :func:`foreign_files`) or files
    git tracks (a committed worked example: :func:`git_tracked_files`), with or without ``overwrite``,
    and without suggesting it; when ``kind`` (a key of :data:`DIR_KINDS`: what the command writes) is given
    and ``out`` holds a kvcal output of another kind (``export --overwrite`` must not delete an artifact);
    when it exists without ``overwrite``; when ``out`` lies inside a kvcal output directory (an artifact or
    an export: a new output nested in one would be mistaken for part of it, and ``--overwrite`` of that one
    would delete it); when a parent of ``out`` is a file; or when the nearest existing ancestor of ``out``
    does not take a new directory."""
    if kind is not None and kind not in DIR_KINDS:
        raise ValueError(f"unknown output directory kind {kind!r}")
    out = Path(out)
    _check_inputs(out, inputs, error, "--out", contains=True)
    for anc in out.resolve().parents:
        held = _output_kind(anc) if anc.is_dir() else None
        if held and held != "recommendation":  # recommend's own export line writes OUT/checkpoint inside its output
            raise error(f"--out {out} lies inside {anc}, which is {DIR_KINDS[held]}; kvcal does not nest a new output "
                        "inside another one — choose an --out outside it")
    if out.exists():
        if not out.is_dir():
            raise error(f"output path {out} exists and is not a directory; choose a directory path for --out")
        if any(out.iterdir()):
            if not is_kvcal_output(out):
                raise error(f"output directory {out} holds files kvcal did not write; --overwrite replaces only "
                            "directories kvcal wrote (an artifact, an export or a recommend output) — choose another "
                            "--out")
            tracked = git_tracked_files(out)
            if tracked:
                raise error(f"output directory {out} holds {len(tracked)} file(s) tracked by git (first: {tracked[0]}), "
                            "e.g. a committed worked example; kvcal never replaces committed files — choose another "
                            "--out")
            held = _output_kind(out)
            if kind is not None and held != kind:
                raise error(f"output directory {out} holds {DIR_KINDS[held]}, not {DIR_KINDS[kind]}; --overwrite "
                            "replaces only an output of the kind this command writes — choose another --out")
            foreign = foreign_files(out)
            if foreign:
                raise error(f"output directory {out} holds {len(foreign)} file(s) kvcal did not write (first: "
                            f"{foreign[0].relative_to(out)}); --overwrite replaces only directories kvcal wrote and "
                            "would delete them — move them away or choose another --out")
        if not overwrite:
            raise error(f"output directory {out} already exists ({'a kvcal output' if any(out.iterdir()) else 'empty'}); "
                        "pass --overwrite to replace it")
    _check_parents_writable(out, error, "--out", "directories")


def check_output_file(path: str | os.PathLike, kind: str, inputs: dict[str, object] | None = None,
                      error: type[KvcalError] = KvcalError, flag: str = "--out") -> None:
    """Refuse an output file before any work is done (and again when it is written).

    ``kind``: what the command writes (a key of :data:`FILE_KINDS`); an existing file is replaced only when
    :func:`kvcal_file_kind` finds that same kind. ``inputs``: option name -> path the command reads.
    ``flag``: the option that named the file, for the message. Raises ``error`` when ``path`` is one of the
    inputs, is a directory or a broken link, is tracked by git (:func:`is_git_tracked`: a committed file, e.g.
    a worked example's evaluation — refused even when kvcal wrote it), exists and is not a ``kind`` kvcal
    wrote (a file kvcal did not write, an artifact, a corpus), when a parent is a file, or when the location
    does not take new files."""
    if kind not in FILE_KINDS:
        raise ValueError(f"unknown output kind {kind!r}")
    p = Path(path)
    _check_inputs(p, inputs, error, flag, contains=False)
    if p.is_dir():
        raise error(f"{flag} {p} is a directory; give a file path")
    if os.path.lexists(p) and not p.exists():
        raise error(f"{flag} {p} is a broken link; remove it or choose another {flag}")
    if p.exists():
        if is_git_tracked(p):
            raise error(f"{p} is tracked by git (a committed file); kvcal never replaces committed files — choose "
                        f"another {flag}")
        found = kvcal_file_kind(p)
        if found != kind:
            desc = FILE_KINDS[found] if found else "a file kvcal did not write"
            raise error(f"{p} exists and is {desc}, not {FILE_KINDS[kind]}; kvcal replaces only files of the kind "
                        f"it writes — choose another {flag}")
    _check_parents_writable(p, error, flag, "files")


def write_file_atomically(path: str | os.PathLike, content: str | bytes | Callable[[Path], None], kind: str,
                          inputs: dict[str, object] | None = None, error: type[KvcalError] = KvcalError,
                          flag: str = "--out", hint: str = "") -> Path:
    """Write one file atomically and return its path: ``content`` (text is UTF-8) or ``content(tmp)``
    fills a temporary sibling, which replaces ``path`` (``os.replace``) only when complete; on any error
    (also Ctrl-C) nothing is left and an existing file is untouched. Permissions follow the umask.

    Raises ``error`` for every refusal of :func:`check_output_file` (``kind``, ``inputs``, ``flag`` as
    there) or on OS errors (read-only location, disk full; ``hint`` ends that message)."""
    p = Path(path)
    check_output_file(p, kind, inputs, error, flag)
    parent = Path(os.path.abspath(p)).parent  # the link's directory when p is a link: os.replace swaps the link
    try:
        parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{p.name}.tmp-", dir=parent)
    except OSError as e:
        raise error(f"cannot write {p}: {e.strerror or e}; choose a writable {flag}") from None
    tmp = Path(name)
    try:
        if callable(content):
            os.close(fd)
            content(tmp)
        else:
            with os.fdopen(fd, "wb") as fh:
                fh.write(content.encode("utf-8") if isinstance(content, str) else content)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, p)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise error(f"cannot write {p}: {e.strerror or e}; nothing was written" + (f" — {hint}" if hint else "")) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return p


def _rename_noreplace(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst`` only if ``dst`` does not exist, atomically where the kernel can (Linux
    ``renameat2(RENAME_NOREPLACE)``, glibc >= 2.28): raises ``FileExistsError`` when ``dst`` exists, even one that
    appeared a moment ago. Elsewhere (no ``renameat2``, or a filesystem that refuses the flag) the check and the
    rename are two steps, and a directory created between them is still refused by ``rename`` unless empty."""
    import ctypes
    import errno

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        fn = None
    if fn is not None:
        at_fdcwd, noreplace = -100, 1
        if fn(at_fdcwd, os.fsencode(str(src)), at_fdcwd, os.fsencode(str(dst)), noreplace) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
        if err not in (errno.EINVAL, errno.ENOSYS):
            raise OSError(err, os.strerror(err), str(dst))
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)


def _identity(p: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(p, follow_symlinks=False)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def write_dir_atomically(out: Path, fill: Callable[[Path], None], overwrite: bool = False,
                         error: type[KvcalError] = ArtifactError, inputs: dict[str, object] | None = None,
                         kind: str | None = None) -> Path:
    """Create directory ``out`` atomically: ``fill(staging)`` populates a temporary sibling which
    replaces ``out`` only when ``fill`` returns normally; on any error (also Ctrl-C) nothing is
    left and an existing ``out`` is untouched. Files and the directory get normal permissions
    (``mkdtemp`` and safetensors create 0700/0600).

    The output is claimed at the end, never assumed: a new ``out`` is renamed into place only if nothing
    appeared there during the run (:func:`_rename_noreplace`); with ``overwrite``, only the directory checked at
    the start (same device and inode) is replaced, and a directory that appeared in its place meanwhile is kept.
    Of two runs racing to one ``--out``, one writes and the other refuses.

    Raises ``error`` (a :class:`KvcalError` subclass) for every refusal of
    :func:`check_output_dir` (``inputs`` and ``kind`` as there), for an ``out`` another process wrote during the
    run, or on OS errors (read-only location, disk full).
    """
    out = Path(out)
    check_output_dir(out, overwrite, inputs, error, kind)
    before = _identity(out)  # what --overwrite may replace: this directory, checked above, and no other
    parent = out.resolve().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent))
    except OSError as e:
        raise error(f"cannot write to {parent}: {e.strerror}; choose a writable --out") from None
    raced = (f"{out} was written by another process while this run was working (two runs with one --out?); "
             "nothing of this run was written: choose another --out")
    try:
        umask = os.umask(0)
        os.umask(umask)
        fill(tmp)
        os.chmod(tmp, 0o777 & ~umask)
        for p in tmp.rglob("*"):
            if p.is_file() and os.stat(p).st_nlink > 1:
                continue  # a hard link into a source checkpoint: its permissions are the source's, leave them
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)
        now = _identity(out)
        if before is not None and now == before:
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=parent))
            os.replace(out, old / "x")  # moved aside (one rename), then checked: still what was checked at the start
            if _identity(old / "x") != before:
                os.replace(old / "x", out)
                shutil.rmtree(old, ignore_errors=True)
                raise FileExistsError
            try:
                _rename_noreplace(tmp, out)
            except BaseException:
                if not os.path.lexists(out):
                    os.replace(old / "x", out)  # put the checked directory back
                raise
            shutil.rmtree(old, ignore_errors=True)
        elif now is None:
            _rename_noreplace(tmp, out)
        else:
            raise FileExistsError
    except FileExistsError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise error(raced) from None
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise error(f"failed writing {out}: {e.strerror or e}; nothing was written") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def write_files_atomically(files: list[tuple[Path, str | bytes, str]], inputs: dict[str, object] | None = None,
                           error: type[KvcalError] = KvcalError, flag: str = "--out") -> list[Path]:
    """Write several files as one output: ``files`` ``[(path, content, kind)]`` (text is UTF-8), each checked as
    :func:`check_output_file` checks it before anything is written; every file is first written to a temporary
    sibling, and only when all are complete are they renamed into place. On any error (a full disk, Ctrl-C) the
    temporaries and every directory this call created are removed and the existing files are untouched, so
    "nothing was written" holds. Returns the paths. Raises ``error`` (one line naming the path and the cause)."""
    for path, _, kind in files:
        check_output_file(Path(path), kind, inputs, error, flag)
    made: list[Path] = []  # directories this call created, deepest last
    staged: list[tuple[Path, Path]] = []
    umask = os.umask(0)
    os.umask(umask)

    def clean() -> None:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        for d in reversed(made):
            try:
                d.rmdir()
            except OSError:
                pass

    current = None
    try:
        for path, content, _ in files:
            current = Path(path)
            parent = Path(os.path.abspath(current)).parent
            missing = []
            q = parent
            while not q.exists():
                missing.append(q)
                q = q.parent
            parent.mkdir(parents=True, exist_ok=True)
            made += [m for m in reversed(missing) if m not in made]
            fd, name = tempfile.mkstemp(prefix=f".{current.name}.tmp-", dir=parent)
            staged.append((Path(name), current))
            with os.fdopen(fd, "wb") as fh:
                fh.write(content.encode("utf-8") if isinstance(content, str) else content)
            os.chmod(name, 0o666 & ~umask)
        for tmp, path in staged:
            current = path
            os.replace(tmp, path)
    except OSError as e:
        clean()
        raise error(f"cannot write {current}: {e.strerror or e}; nothing was written") from None
    except BaseException:
        clean()
        raise
    return [path for _, path in staged]

