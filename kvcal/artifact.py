"""kvcal artifacts: a directory with ``kv_scales.safetensors`` (+ ``report.md``).

Tensor names (float32), the names vLLM / SGLang / compressed-tensors load
(see ``shared/docs/runtime-formats.md``):

* ``model.layers.{i}.self_attn.k_scale`` / ``.v_scale`` — static dequantization multipliers,
  ``x ≈ q * scale``. Shape ``[1]`` (per-tensor), ``[H_kv, 1, 1]`` (per-head) or
  ``[H_kv, 1, D]`` (per-channel; kvcal runtime only).
* optional kvcal-only tensors beside them: ``{k,v}_zero_point`` (asymmetric static, same shape
  as the scale), ``{k,v}_clip_ratio`` ``[H_kv]`` (dynamic formats: calibrated fraction of the
  per-group absmax/min-max range), ``k_mean`` ``[H_kv, 1, D]`` (per-channel key centering).

Metadata: one JSON document stored in the safetensors header under the key ``"kvcal"`` with
``schema_version`` (:data:`SCHEMA_VERSION`). Writing is atomic: everything goes into a temporary
sibling directory which is renamed into place only when complete.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shlex
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvcal.errors import ArtifactError, KvcalError
from kvcal.plan import tensor_name  # noqa: F401  (re-exported: the naming rule lives in kvcal.plan)
from kvcal.weights import config_hash  # noqa: F401  (re-exported: model identity lives in kvcal.weights)

SCHEMA_VERSION = 1
SCALES_FILE = "kv_scales.safetensors"
SIDES = ("k", "v")


@dataclass
class Artifact:
    """A loaded artifact: ``tensors`` (name -> float32 tensor), ``metadata`` (dict), ``path``."""

    path: Path
    tensors: dict[str, torch.Tensor]
    metadata: dict

    @property
    def num_layers(self) -> int:
        return int(self.metadata["model"]["num_layers"])

    def scale(self, layer: int, side: str) -> torch.Tensor | None:
        return self.tensors.get(tensor_name(layer, side))

    def get(self, layer: int, side: str, kind: str) -> torch.Tensor | None:
        return self.tensors.get(tensor_name(layer, side, kind))


def validate_scales(tensors: dict[str, torch.Tensor]) -> None:
    """Refuse zero, negative, NaN or Inf scales, naming the layer and side.

    Raises :class:`ArtifactError`. Engines silently produce garbage (or fall back to 1.0) on such
    scales, so kvcal never writes one.
    """
    for name, t in tensors.items():
        if not name.endswith("_scale"):
            continue
        bad = ~torch.isfinite(t) | (t <= 0)
        if bool(bad.any()):
            vals = t[bad].flatten()[:3].tolist()
            raise ArtifactError(
                f"refusing to write {name}: scales must be finite and > 0, got {vals} "
                f"({int(bad.sum())} bad of {t.numel()}); the calibration data for this layer is "
                "probably degenerate (all zeros or non-finite activations)"
            )


def write_artifact(
    out_dir: str | os.PathLike,
    tensors: dict[str, torch.Tensor],
    metadata: dict,
    extra_files: dict[str, str | bytes] | None = None,
    overwrite: bool = False,
    inputs: dict[str, object] | None = None,
) -> Path:
    """Write an artifact directory atomically and return its path.

    ``tensors``: name -> tensor (stored as contiguous float32). ``metadata``: JSON-serializable
    dict (``schema_version`` is set here). ``extra_files``: file name -> text/bytes written beside
    (e.g. ``report.md``). ``inputs``: paths the caller read (see :func:`check_output_dir`).
    Raises :class:`ArtifactError` if ``out_dir`` exists and ``overwrite`` is False (or it is not a
    kvcal output), if it is or contains an input, if a scale is invalid, or if the location is not
    writable; nothing partial is left.
    """
    from safetensors.torch import save_file

    validate_scales(tensors)
    meta = {k: v for k, v in metadata.items() if k != CONTENT_HASH_KEY}  # a loaded artifact's hash is re-made
    meta["schema_version"] = SCHEMA_VERSION
    meta["tensor_names"] = sorted(tensors)  # load_artifact refuses a file missing one of them, or holding others
    payload = {k: v.detach().to(torch.float32).contiguous().cpu() for k, v in tensors.items()}
    try:
        meta = json.loads(json.dumps(meta, allow_nan=False, default=_json_default))  # the form load_artifact sees
    except ValueError as e:
        raise ArtifactError(f"artifact metadata holds a non-finite number: {e}") from None
    meta[CONTENT_HASH_KEY] = content_sha256(meta, payload)  # load_artifact refuses a file edited after this
    meta_json = json.dumps(meta, allow_nan=False)

    def fill(tmp: Path) -> None:
        save_file(payload, str(tmp / SCALES_FILE), metadata={"kvcal": meta_json, "format": "pt"})
        for fname, content in (extra_files or {}).items():
            p = tmp / fname
            p.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, bytes):
                p.write_bytes(content)
            else:
                p.write_text(content, encoding="utf-8")

    return write_dir_atomically(Path(out_dir), fill, overwrite, ArtifactError, inputs, kind="artifact")


def artifact_sha256(path: str | os.PathLike) -> str:
    """Hex sha256 of an artifact's ``kv_scales.safetensors`` (``path``: the directory or the file):
    what ``kvcal evaluate`` records so a report can tell which artifact an evaluation measured.
    Raises :class:`ArtifactError` when the file cannot be read."""
    p = Path(path)
    f = p / SCALES_FILE if p.is_dir() else p
    try:
        return hashlib.sha256(f.read_bytes()).hexdigest()
    except OSError as e:
        raise ArtifactError(f"cannot read {f}: {e.strerror}") from None


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
        if p is None or isinstance(p, Artifact):
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


def write_dir_atomically(out: Path, fill: Callable[[Path], None], overwrite: bool = False,
                         error: type[KvcalError] = ArtifactError, inputs: dict[str, object] | None = None,
                         kind: str | None = None) -> Path:
    """Create directory ``out`` atomically: ``fill(staging)`` populates a temporary sibling which
    replaces ``out`` only when ``fill`` returns normally; on any error (also Ctrl-C) nothing is
    left and an existing ``out`` is untouched. Files and the directory get normal permissions
    (``mkdtemp`` and safetensors create 0700/0600).

    Raises ``error`` (a :class:`KvcalError` subclass) for every refusal of
    :func:`check_output_dir` (``inputs`` and ``kind`` as there) or on OS errors (read-only location, disk full).
    """
    out = Path(out)
    check_output_dir(out, overwrite, inputs, error, kind)
    parent = out.resolve().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent))
    except OSError as e:
        raise error(f"cannot write to {parent}: {e.strerror}; choose a writable --out") from None
    try:
        umask = os.umask(0)
        os.umask(umask)
        fill(tmp)
        os.chmod(tmp, 0o777 & ~umask)
        for p in tmp.rglob("*"):
            if p.is_file() and os.stat(p).st_nlink > 1:
                continue  # a hard link into a source checkpoint: its permissions are the source's, leave them
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)
        if out.exists():
            old = parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise error(f"failed writing {out}: {e.strerror or e}; nothing was written") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _json_default(o):
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def load_artifact(path: str | os.PathLike) -> Artifact:
    """Load an artifact directory (or its ``kv_scales.safetensors`` file) strictly.

    Raises :class:`ArtifactError` (one line naming the field or tensor and how to fix it) when the
    file is missing, truncated/corrupted, has no kvcal metadata, has an unknown schema version, a
    metadata field of the wrong type or missing (:func:`validate_metadata_schema`), a tensor of
    another dtype, name or shape than kvcal writes, a missing or extra tensor, a scale that is not
    finite and > 0 or is implausible for the recorded calibration range (:func:`validate_tensors`),
    calibrated parameters that do not rebuild into a plan, or content that does not match its
    recorded :data:`CONTENT_HASH_KEY` (edited after writing), or no hash although the metadata shows a
    writer that records one (:func:`_refuse_stripped_hash`). Artifacts written before the hash was
    recorded carry none; they load after the same checks (``kvcal inspect`` and ``kvcal export`` say
    that edits to them cannot be detected).
    """
    from safetensors import safe_open

    p = Path(path)
    f = p / SCALES_FILE if p.is_dir() else p
    if not f.exists():
        raise ArtifactError(f"no artifact at {p}: expected {f} (run `kvcal calibrate --out DIR` first)")
    try:
        with safe_open(str(f), framework="pt") as fh:
            header = fh.metadata() or {}
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    except Exception as e:  # safetensors raises several types for corrupted files
        raise ArtifactError(f"{f} is corrupted or truncated ({type(e).__name__}: {e}); re-run calibration") from None
    if "kvcal" not in header:
        raise ArtifactError(f"{f} has no kvcal metadata in its header; it was not written by kvcal")
    try:
        meta = json.loads(header["kvcal"])
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{f}: kvcal metadata is not valid JSON ({e})") from None
    ver = meta.get("schema_version") if isinstance(meta, dict) else None
    if isinstance(meta, dict) and ver != SCHEMA_VERSION:
        raise ArtifactError(f"{f}: schema_version {ver!r} is not supported (this kvcal reads {SCHEMA_VERSION})")
    _validate_metadata(f, meta, tensors)
    listed = meta.get("tensor_names")  # absent in artifacts written before it was recorded
    if listed is not None:
        lost, extra = sorted(set(listed) - set(tensors)), sorted(set(tensors) - set(listed))
        if lost:
            raise ArtifactError(f"{f}: lacks {len(lost)} tensor(s) it was written with (first: {lost[0]}); the file "
                                "was edited or is incomplete — re-run calibration")
        if extra:
            raise ArtifactError(f"{f}: holds {len(extra)} tensor(s) kvcal did not write (first: {extra[0]}); the file "
                                "was edited — re-run calibration")
    n = int(meta["model"]["num_layers"])
    layer_specs = meta["kv"].get("layer_specs")
    for side in SIDES:
        missing = []
        for i in range(n):
            spec = (layer_specs[i] if layer_specs else meta["kv"]).get(side)
            if spec is None or spec.get("dynamic") or spec.get("format") in ("fp16", "bf16"):
                continue
            if tensor_name(i, side) not in tensors:
                missing.append(i)
        if missing:
            raise ArtifactError(
                f"{f}: missing {side}_scale for layers {missing[:5]}{'...' if len(missing) > 5 else ''} "
                f"({len(missing)} of {n}); the file is incomplete"
            )
    validate_tensors(f, meta, tensors)
    if _has_calibrated_parameters(meta, tensors):
        from kvcal.plan import KVPlan

        try:  # every per-layer parameter (clip ratios, widths, levels, rounding, log8 bases) checked once, here
            KVPlan.from_artifact(tensors, meta)
        except (ValueError, KeyError, TypeError) as e:
            msg = str(e) if isinstance(e, ValueError) else f"metadata field {e} is missing or malformed"
            raise ArtifactError(f"{f}: {msg}; re-run calibration") from None
    recorded = meta.get(CONTENT_HASH_KEY)
    if recorded is None:
        _refuse_stripped_hash(f, meta)
    if recorded is not None and recorded != content_sha256(meta, tensors):
        raise ArtifactError(
            f"{f}: content does not match its {CONTENT_HASH_KEY}: scales or metadata were changed after kvcal wrote "
            "the file, so it is not what was calibrated and measured — re-run `kvcal calibrate` (kvcal refuses "
            "edited artifacts rather than serve them)")
    return Artifact(path=p if p.is_dir() else p.parent, tensors=tensors, metadata=meta)


def _refuse_stripped_hash(f: Path, meta: dict) -> None:
    """Refuse an artifact without :data:`CONTENT_HASH_KEY` whose metadata shows a writer that records one.

    Only artifacts written before kvcal recorded the hash may lack it (the committed
    ``artifacts/smollm2-135m-fp8``). Every :func:`write_artifact` that records the hash also records
    ``tensor_names``, and ``model.weights`` (the weight fingerprint, :mod:`kvcal.weights`) came after the
    hash; the writer of the released worked example wrote neither. So a hash-less artifact holding either
    field most likely had its hash deleted — the way to make a hand edit (a tripled scale) pass as an old
    artifact. (``tensor_names`` predates the hash by some hours of unreleased 0.1.0 development; an
    artifact from that window is refused too and must be re-calibrated, which is the safe side.) Raises
    :class:`ArtifactError` naming the field that gives it away."""
    model = meta.get("model") if isinstance(meta.get("model"), dict) else {}
    marker = next((name for name, present in (("tensor_names", "tensor_names" in meta),
                                              ("model.weights", "weights" in model)) if present), None)
    if marker is not None:
        raise ArtifactError(
            f"{f}: has no {CONTENT_HASH_KEY} although its {marker} field shows it was written by a kvcal that records "
            "one: the hash was removed, so edits cannot be ruled out — re-run `kvcal calibrate` (kvcal refuses "
            "edited artifacts rather than serve them)")


def _has_calibrated_parameters(meta: dict, tensors: dict) -> bool:
    """True when the artifact is more than static scales (integer / dynamic sides, transforms)."""
    kv = meta["kv"]
    specs = kv.get("layer_specs") or [{s: kv.get(s) for s in SIDES}]
    dynamic = any((sp.get(s) or {}).get("dynamic") for sp in specs for s in SIDES)
    return dynamic or bool(kv.get("transforms")) or any(not n.endswith(("_scale", "_zero_point")) for n in tensors)


def _validate_metadata(f: Path, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Types and consistency of the metadata fields kvcal relies on (:func:`validate_metadata_schema`);
    ArtifactError naming the field. The tensors are checked against it by :func:`validate_tensors`."""
    validate_metadata_schema(f, meta)


def check_model_match(meta: dict, model_meta: dict) -> None:
    """Refuse an artifact made for another model; the message says which field differs.

    ``model_meta`` is the ``"model"`` section kvcal builds for the loaded model
    (see :func:`kvcal.models.model_metadata`). Raises :class:`ArtifactError`.
    """
    a = meta["model"]
    for key in ("num_layers", "num_kv_heads", "head_dim", "config_sha256"):
        if a.get(key) != model_meta.get(key):
            raise ArtifactError(
                f"artifact was calibrated for a different model: {key} is {a.get(key)!r} in the artifact "
                f"but {model_meta.get(key)!r} for the loaded model ({model_meta.get('id')}); "
                + (f"pass --model {shlex.quote(str(a['id']))} (the model the artifact was calibrated for), or "
                   if a.get("id") and a.get("id") != model_meta.get("id") else "")
                + "re-run `kvcal calibrate` for this model"
            )


def is_finite_number(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


# ---- the one artifact validator ----------------------------------------------------------------
# Every command that reads an artifact (export, evaluate, plan --kv-config, inspect, report, the
# runtime cache) goes through load_artifact, which runs the checks below in this order: metadata
# schema (types, not truthiness), tensor dtypes and names, shapes against the stated granularity,
# missing/extra tensors, finite positive scales, scales against the recorded calibration ranges,
# the calibrated per-layer parameters (KVPlan.from_artifact), and last the content hash — so a
# specific defect is named precisely and any other edit is still caught by the hash.

#: Metadata field that holds :func:`content_sha256` (written by :func:`write_artifact`).
CONTENT_HASH_KEY = "content_sha256"

#: Tensor kinds kvcal writes per layer and side (``model.layers.{i}.self_attn.{k,v}_{kind}``).
TENSOR_KINDS = ("scale", "zero_point", "clip_ratio", "mean", "rounding", "channel_bits", "levels", "trellis",
                "scale_base", "rope_inv_freq")
#: Tensors outside the per-layer K/V pattern: the query scale (per layer) and the RoPE table.
_OTHER_TENSOR = ("q_scale",)
#: vLLM NVFP4 outer scales (``model.layers.{i}.self_attn.{k,v}_outer_scale``, float32 ``[1]``; written by
#: ``calibrate --engine vllm --kv-cache-dtype nvfp4``, :mod:`kvcal.search.vllm_nvfp4`): accepted only when
#: the metadata's ``vllm.kv_cache_dtype`` is an nvfp4 dtype, and then required for every layer.
_OUTER_KIND = "outer_scale"
#: e4m3 max x E2M1 max: the NVFP4 amax rule's divisor (outer = amax / 2688).
_NVFP4_AMAX_DIVISOR = 448.0 * 6.0
_ROPE_TENSOR = "rotary.inv_freq"

#: A static scale is refused when it lies outside ``[amax / fmt_max / SCALE_SANITY,
#: SCALE_SANITY * max(1, amax / 100)]`` for the calibration absmax ``amax`` the artifact records for
#: that layer and side. The search's candidates (runtime-formats.md, ``calibration.candidates``) span
#: clip 0.5 (scale = amax/fmt_max x 0.5), headroom 4, unity (1.0) and the on-the-fly rule
#: (amax/100 for V): every one of them lies a factor 32 or more inside these bounds, while a hand-typed
#: 1e30 or 1e-30 lies twenty orders of magnitude outside.
SCALE_SANITY = 64.0

_FMT_MAX = {"fp8_e4m3": 448.0, "fp8_e4m3fnuz": 240.0, "fp8_e5m2": 57344.0}  # kvcal.formats.fp8 (OCP, AMD)


def _kind(v) -> str:
    return "null" if v is None else {bool: "boolean", int: "integer", float: "number", str: "string",
                                     list: "list", dict: "object"}.get(type(v), type(v).__name__)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# field checks: (predicate, what the field must be)
_POS_INT = (lambda v: _is_int(v) and v >= 1, "a positive integer")
_NONNEG_INT = (lambda v: _is_int(v) and v >= 0, "an integer >= 0")
_BOOL = (lambda v: isinstance(v, bool), "true or false (a JSON boolean, not a string)")
_STR = (lambda v: isinstance(v, str), "a string")
_OBJ = (lambda v: isinstance(v, dict), "an object")
_LIST = (lambda v: isinstance(v, list), "a list")
_POS_NUM = (lambda v: _is_num(v) and v > 0, "a finite number > 0")
_NUM_LIST = (lambda v: isinstance(v, list) and all(_is_num(x) for x in v), "a list of finite numbers")
_STR_LIST = (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings")


def _optional(check):
    pred, what = check
    return (lambda v: v is None or pred(v), f"{what} or null")


def _one_of(*choices):
    return (lambda v: v in choices, "one of " + ", ".join(repr(c) for c in choices))


_GRANULARITIES = ("tensor", "head", "channel", "token", "token_group", "channel_token_group")


def _formats() -> tuple[str, ...]:
    from kvcal.formats.spec import QFormat

    return tuple(f.value for f in QFormat)


# section -> {field: (check, required)}; fields not listed are allowed (forward compatibility: a
# newer kvcal's optional fields, e.g. a weights fingerprint) and covered by the content hash
_TOP_SCHEMA = {
    "schema_version": (_POS_INT, True), "model": (_OBJ, True), "kv": (_OBJ, True),
    "kvcal_version": (_STR, False), "created": (_STR, False), "calibration": (_OBJ, False),
    "corpus": (_OBJ, False), "layers": (_LIST, False), "tensor_names": (_STR_LIST, False),
    CONTENT_HASH_KEY: ((lambda v: isinstance(v, str) and len(v) == 64, "a 64-digit hex sha256"), False),
}
_MODEL_SCHEMA = {
    "num_layers": (_POS_INT, True), "num_kv_heads": (_POS_INT, True), "head_dim": (_POS_INT, True),
    "num_attention_heads": (_POS_INT, False), "max_position_embeddings": (_optional(_POS_INT), False),
    "id": (_optional(_STR), False), "config_sha256": (_optional(_STR), False), "architecture": (_optional(_STR), False),
    "model_type": (_optional(_STR), False), "weight_precision": (_optional(_STR), False),
    "layer_windows": ((lambda v: isinstance(v, list) and all(_is_int(w) and (w == 0 or w >= 2) for w in v)
                       and any(v), "a list of per-layer sliding windows (0: full attention, >= 2 tokens), one "
                       "sliding at least"), False),
}
_KV_SCHEMA = {
    "k": (_OBJ, True), "v": (_OBJ, True),
    "quantized_tensors": ((lambda v: isinstance(v, list) and all(x in SIDES for x in v), "a list of 'k' / 'v'"), False),
    "key_position": (_one_of("post_rope", "pre_rope"), False),
    "residual_window": (_NONNEG_INT, False), "sink_tokens": (_NONNEG_INT, False), "key_centering": (_BOOL, False),
    "layer_specs": (_optional(_LIST), False), "transforms": (_optional(_LIST), False),
    "rope_attention_scaling": (_POS_NUM, False),
}


def _spec_schema() -> dict:
    return {
        "format": (_one_of(*_formats()), True), "granularity": (_one_of(*_GRANULARITIES), True),
        "group_size": (_optional(_POS_INT), False), "symmetric": (_BOOL, False), "dynamic": (_BOOL, False),
        "scale_dtype": (_optional(_STR), False), "bits": (_optional(_POS_NUM), False),
    }


_NUM_OR_LIST = (lambda v: _is_num(v) or _NUM_LIST[0](v), "a finite number or a list of them")
_ERRORS = (lambda v: _is_num(v) or (isinstance(v, dict) and all(_is_num(x) for x in v.values())),
           "a finite number or an object of them (the search's errors)")
_LAYER_SIDE_SCHEMA = {"scale": (_NUM_LIST, False), "amax": (_NUM_LIST, False), "clip_ratio": (_NUM_OR_LIST, False),
                      "heldout": (_ERRORS, False), "calib": (_ERRORS, False)}
_CORPUS_SCHEMA = {  # the corpus summary inspect and report print
    "path": (_optional(_STR), False), "sha256": (_optional(_STR), False), "format": (_optional(_STR), False),
    "samples": (_optional(_NONNEG_INT), False), "tokens": (_optional(_NONNEG_INT), False),
    "truncated": (_optional(_NONNEG_INT), False), "length_percentiles": (_optional(_OBJ), False),
}

_VLLM_SCHEMA = {  # calibrate --engine vllm (kvcal.search.vllm_fp8.vllm_metadata): what inspect and report print
    "engine": ((lambda v: v == "vllm", '"vllm"'), True), "kv_cache_dtype": (_STR, True),
    "skip_layers": ((lambda v: isinstance(v, list) and all(_is_int(x) and x >= 0 for x in v),
                     "a list of layer indices"), False),
    "query_quantization": (_STR, False),
    "q_scale": ((lambda v: isinstance(v, list) and all(isinstance(r, list) and all(_is_num(x) for x in r) for r in v),
                 "a list (one per layer) of lists of finite numbers"), False),
    "k_outer_scale": (_NUM_LIST, False), "v_outer_scale": (_NUM_LIST, False),  # nvfp4 (kvcal.search.vllm_nvfp4)
}


def _check_section(f: Path, where: str, obj, schema: dict) -> None:
    """Check the fields of ``obj`` (metadata section ``where``) against ``schema``; ArtifactError
    naming the field, what it must be, what it is, and how to fix it."""
    if not isinstance(obj, dict):
        raise ArtifactError(f"{f}: metadata {where or 'document'} must be an object, got {_kind(obj)}; "
                            "re-run calibration")
    for key, ((pred, what), required) in schema.items():
        field_name = f"{where}.{key}" if where else key
        if key not in obj:
            if required:
                raise ArtifactError(f"{f}: metadata field {field_name} must be {what}, but it is missing; the file "
                                    "was edited or is not a kvcal artifact — re-run calibration")
            continue
        v = obj[key]
        if not pred(v):
            raise ArtifactError(f"{f}: metadata field {field_name} must be {what}, got {v!r} ({_kind(v)}); "
                                "fix the field or re-run calibration")


def validate_metadata_schema(f: Path, meta) -> None:
    """Strict types of every metadata field kvcal reads (module docstring): required keys present,
    booleans are JSON booleans (``"symmetric": "false"`` is refused, not read as true), counts are
    integers, formats/granularities are known names, per-layer lists have one entry per layer.
    Unknown fields are allowed (a newer kvcal's optional fields; the content hash covers them).
    Raises :class:`ArtifactError` naming the field."""
    _check_section(f, "", meta, _TOP_SCHEMA)
    _check_section(f, "model", meta["model"], _MODEL_SCHEMA)
    kv = meta["kv"]
    _check_section(f, "kv", kv, _KV_SCHEMA)
    n = meta["model"]["num_layers"]
    lw = meta["model"].get("layer_windows")
    if lw is not None and len(lw) != n:
        raise ArtifactError(f"{f}: metadata model.layer_windows must list {n} layers (model.num_layers), got "
                            f"{len(lw)}; re-run calibration")
    spec_schema = _spec_schema()
    for side in SIDES:
        _check_section(f, f"kv.{side}", kv[side], spec_schema)
    for key in ("layer_specs", "transforms"):
        lst = kv.get(key)
        if lst is not None and len(lst) != n:
            raise ArtifactError(f"{f}: metadata kv.{key} must list {n} layers (model.num_layers), got {len(lst)}; "
                                "re-run calibration")
    for i, ls in enumerate(kv.get("layer_specs") or []):
        for side in SIDES:
            _check_section(f, f"kv.layer_specs[{i}]", ls, {side: (_OBJ, True)})
            _check_section(f, f"kv.layer_specs[{i}].{side}", ls[side], spec_schema)
    for i, tr in enumerate(kv.get("transforms") or []):
        _check_section(f, f"kv.transforms[{i}]", tr, {s: (_STR, False) for s in SIDES})
    if meta.get("corpus") is not None:
        _check_section(f, "corpus", meta["corpus"], _CORPUS_SCHEMA)
    if meta.get("vllm") is not None:
        _check_section(f, "vllm", meta["vllm"], _VLLM_SCHEMA)
        bad = [x for x in meta["vllm"].get("skip_layers") or [] if x >= n]
        if bad:  # export would print a --kv-cache-dtype-skip-layers naming no layer of the model
            raise ArtifactError(f"{f}: metadata field vllm.skip_layers names layer(s) {bad} but the model has {n} "
                                "layers (model.num_layers); fix the field or re-run calibration")
        if n and len(set(meta["vllm"].get("skip_layers") or [])) >= n:  # every layer at 16 bits: nothing in the dtype
            raise ArtifactError(f"{f}: metadata field vllm.skip_layers keeps all {n} layers at 16 bits, so nothing would "
                                f"be stored in --kv-cache-dtype {meta['vllm'].get('kv_cache_dtype')} (the 16-bit cache "
                                "under its name); leave at least one layer out or re-run calibration")
    for j, lm in enumerate(meta.get("layers") or []):
        _check_section(f, f"layers[{j}]", lm, {"layer": ((lambda v: _is_int(v) and 0 <= v < n,
                                                           f"a layer index in 0..{n - 1}"), True)})
        for side in (*SIDES, "q"):  # "q": vLLM's query scale (calibrate --engine vllm)
            if lm.get(side) is not None:
                _check_section(f, f"layers[{j}].{side}", lm[side], _LAYER_SIDE_SCHEMA)


def content_sha256(meta: dict, tensors: dict[str, torch.Tensor]) -> str:
    """Hex sha256 over an artifact's content: the metadata (canonical JSON, sorted keys, without the
    :data:`CONTENT_HASH_KEY` field itself) and every tensor's name, dtype, shape and bytes in name
    order. :func:`write_artifact` stores it in the metadata; :func:`load_artifact` recomputes it, so a
    scale or field changed after kvcal wrote the file is told from one kvcal wrote."""
    h = hashlib.sha256()
    body = {k: v for k, v in meta.items() if k != CONTENT_HASH_KEY}
    h.update(json.dumps(body, sort_keys=True, allow_nan=False, separators=(",", ":")).encode())
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"\n{name}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _parse_tensor_name(name: str) -> tuple[int, str, str] | None:
    """``model.layers.{i}.self_attn.{side}_{kind}`` -> ``(i, side, kind)``; ``q_scale`` -> ``(i, "q", "scale")``;
    anything else ``None``."""
    parts = name.split(".")
    if len(parts) != 5 or parts[:2] != ["model", "layers"] or not parts[2].isdigit() or parts[3] != "self_attn":
        return None
    if parts[4] in _OTHER_TENSOR:
        return int(parts[2]), "q", "scale"
    side, _, kind = parts[4].partition("_")
    if side not in SIDES or kind not in (*TENSOR_KINDS, _OUTER_KIND):
        return None
    return int(parts[2]), side, kind


def validate_tensors(f: Path, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Tensor checks against the (schema-checked) metadata: float32 dtype (kvcal writes nothing else;
    an int32 or float16 tensor was put there by hand), names kvcal writes, layer indices within
    ``model.num_layers``, scale and zero-point shapes consistent with the side's granularity
    (``tensor`` ``[1]``, ``head`` ``[H_kv,1,1]``, ``channel`` ``[H_kv,1,D]``), and scales finite, > 0
    and within :data:`SCALE_SANITY` of the calibration range the metadata records for that layer and
    side. Raises :class:`ArtifactError` naming the tensor."""
    m = meta["model"]
    n, H, D = m["num_layers"], m["num_kv_heads"], m["head_dim"]
    kv = meta["kv"]
    specs = kv.get("layer_specs")
    for name, t in sorted(tensors.items()):
        if t.dtype != torch.float32:
            raise ArtifactError(f"{f}: tensor {name} has dtype {str(t.dtype).replace('torch.', '')}; kvcal writes "
                                "float32 tensors only, so the file was edited — re-run calibration")
        if name == _ROPE_TENSOR:
            continue
        parsed = _parse_tensor_name(name)
        if parsed is None:
            raise ArtifactError(f"{f}: holds tensor {name}, which kvcal does not write (names are "
                                "model.layers.{i}.self_attn.{k,v}_{" + ",".join(TENSOR_KINDS) + "}); remove it or "
                                "re-run calibration")
        i, side, kind = parsed
        if i >= n:
            raise ArtifactError(f"{f}: tensor {name} is for layer {i} but the metadata says {n} layers")
        if kind == _OUTER_KIND:
            _check_outer_scale(f, meta, name, t, i, side)
            continue
        if side == "q":  # vLLM's static FP8 query scale (kvcal.search.vllm_fp8): per tensor or per KV-head group
            if tuple(t.shape) not in ((1,), (H, 1, 1)):
                raise ArtifactError(f"{f}: {name} has shape {list(t.shape)}, expected [1] (per tensor) or {[H, 1, 1]} "
                                    f"(one per KV-head group, model.num_kv_heads {H}); the file was edited — re-run "
                                    "calibration")
            if not bool((torch.isfinite(t) & (t > 0)).all()):
                raise ArtifactError(f"{f}: tensor {name} holds zero, negative or non-finite scales "
                                    f"({t.flatten()[:3].tolist()}); re-run calibration")
            continue
        spec = (specs[i] if specs else kv)[side]
        if kind == "rope_inv_freq":  # a pre-RoPE key layer's own RoPE table (models with one per layer type)
            trs = kv.get("transforms") or []
            if side != "k" or i >= len(trs) or trs[i].get("k") != "pre_rope":
                raise ArtifactError(f"{f}: holds {name}, a RoPE table, but layer {i}'s keys are not stored pre-RoPE "
                                    "(kv.transforms); remove it or re-run calibration")
            if tuple(t.shape) != (D // 2,) or not bool((torch.isfinite(t) & (t > 0)).all()):
                raise ArtifactError(f"{f}: {name} must hold {D // 2} finite positive RoPE frequencies (head_dim {D} / 2), "
                                    f"got shape {list(t.shape)}; the file was edited — re-run calibration")
            continue
        if kind in ("scale", "zero_point"):
            allowed = {"tensor": (1,), "head": (H, 1, 1), "channel": (H, 1, D)}.get(spec["granularity"])
            if allowed and not spec.get("dynamic", False) and tuple(t.shape) != allowed:
                raise ArtifactError(f"{f}: {name} has shape {list(t.shape)}, expected {list(allowed)} for "
                                    f"{spec['granularity']} granularity (model.num_kv_heads {H}, head_dim {D}); "
                                    "the file was edited — re-run calibration")
        if kind == "scale":
            bad = ~torch.isfinite(t) | (t <= 0)
            if bool(bad.any()):
                raise ArtifactError(f"{f}: tensor {name} holds zero, negative or non-finite scales "
                                    f"({t[bad].flatten()[:3].tolist()}); re-run calibration")
    if _nvfp4_dtype(meta):
        lost = [f"model.layers.{i}.self_attn.{s}_{_OUTER_KIND}" for i in range(n) for s in SIDES
                if f"model.layers.{i}.self_attn.{s}_{_OUTER_KIND}" not in tensors]
        if lost:
            raise ArtifactError(f"{f}: metadata says vllm.kv_cache_dtype {_nvfp4_dtype(meta)} but {len(lost)} NVFP4 "
                                f"outer scale(s) are missing (first: {lost[0]}); the file is incomplete — re-run "
                                "calibration")
    _check_scale_ranges(f, meta, tensors)


def _nvfp4_dtype(meta: dict) -> str | None:
    """The vLLM nvfp4 dtype the artifact was calibrated for (``vllm.kv_cache_dtype``), else ``None``."""
    d = (meta.get("vllm") or {}).get("kv_cache_dtype")
    return d if isinstance(d, str) and d.startswith("nvfp4") else None


def _check_outer_scale(f: Path, meta: dict, name: str, t: torch.Tensor, i: int, side: str) -> None:
    """An NVFP4 outer scale tensor: only in an nvfp4 artifact, shape ``[1]``, finite and > 0, and within
    :data:`SCALE_SANITY` of the amax rule for the calibration absmax ``layers[i].{side}.amax``
    (``[amax/2688/64, 64·max(1, amax/100)]``; the search's candidates — amax/2688 x 2^(-4/8..7/8) and
    1.0 — lie well inside). Raises :class:`ArtifactError` naming the tensor."""
    if not _nvfp4_dtype(meta):
        have = (meta.get("vllm") or {}).get("kv_cache_dtype")
        raise ArtifactError(f"{f}: holds {name}, a vLLM NVFP4 outer scale, but the metadata says "
                            + (f"vllm.kv_cache_dtype {have!r}" if have else "no vllm nvfp4 calibration")
                            + "; kvcal writes outer scales only for --engine vllm --kv-cache-dtype nvfp4 — remove it "
                            "or re-run calibration")
    if tuple(t.shape) != (1,):
        raise ArtifactError(f"{f}: {name} has shape {list(t.shape)}, expected [1] (vLLM loads one outer scale per "
                            "layer and side); the file was edited — re-run calibration")
    v = float(t.reshape(-1)[0])
    if not math.isfinite(v) or v <= 0:
        raise ArtifactError(f"{f}: tensor {name} holds the non-positive or non-finite scale {v}; re-run calibration")
    rec = next((lm.get(side) for lm in meta.get("layers") or [] if lm.get("layer") == i), None) or {}
    amax = rec.get("amax")
    if amax:
        a = max(float(x) for x in amax)
        lo, hi = a / _NVFP4_AMAX_DIVISOR / SCALE_SANITY, SCALE_SANITY * max(1.0, a / 100.0)
        if a > 0 and not lo <= v <= hi:
            raise ArtifactError(f"{f}: tensor {name} holds the outer scale {v:.4g}, implausible for the calibration "
                                f"absmax {a:.4g} recorded for layer {i} {side.upper()} (a plausible NVFP4 outer scale "
                                f"lies in [{lo:.3g}, {hi:.3g}]); the file was edited — re-run calibration")


def _check_scale_ranges(f: Path, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Static FP8 scales against the calibration absmax recorded in ``layers[i].{k,v}.amax`` (see
    :data:`SCALE_SANITY`)."""
    kv = meta["kv"]
    specs = kv.get("layer_specs")
    for lm in meta.get("layers") or []:
        i = lm["layer"]
        for side in SIDES:
            rec = lm.get(side) or {}
            spec = (specs[i] if specs else kv)[side]
            fmax = _FMT_MAX.get(spec["format"])
            t = tensors.get(tensor_name(i, side))
            amax = rec.get("amax")
            if fmax is None or spec.get("dynamic", False) or t is None or not amax:
                continue
            a = torch.tensor(amax, dtype=torch.float64).flatten()
            s = t.double().flatten()
            # per-tensor (against the max over heads) / per-head: one recorded absmax per scale; per-channel
            # scales under a per-head absmax get only the upper bound (a channel may be far below its head)
            per_value = a.numel() == s.numel() or s.numel() == 1
            if a.numel() != s.numel():
                a = a.max().expand(s.shape)
            if not bool((a > 0).all()):
                continue
            lo = a / fmax / SCALE_SANITY if per_value else torch.zeros_like(a)
            hi = SCALE_SANITY * torch.clamp(a / 100.0, min=1.0)
            bad = (s < lo) | (s > hi)
            if bool(bad.any()):
                j = int(bad.nonzero()[0][0])
                raise ArtifactError(
                    f"{f}: tensor {tensor_name(i, side)} holds the scale {float(s[j]):.4g}, implausible for the "
                    f"calibration absmax {float(a[j]):.4g} recorded for layer {i} {side.upper()} (a plausible "
                    f"{spec['format']} scale lies in [{float(lo[j]):.3g}, {float(hi[j]):.3g}]); the file was "
                    "edited — re-run calibration")
