"""Artifact I/O: the loaded :class:`Artifact`, :func:`write_artifact` (atomic, with the content hash),
:func:`load_artifact` (strict: schema, tensors, hash), :func:`artifact_sha256` and the model-match check
(the file layout is described in :mod:`kvcal.artifact`)."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

import torch

from kvcal.artifact.schema import CONTENT_HASH_KEY, SIDES, content_sha256, validate_metadata_schema
from kvcal.artifact.validate import check_recorded_scales, validate_scales, validate_tensors
from kvcal.errors import ArtifactError
from kvcal.outputs import SCALES_FILE, write_dir_atomically
from kvcal.plan import tensor_name

SCHEMA_VERSION = 1


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


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str]) -> None:
    """``safetensors.torch.save_file`` whose failure to write is an ``OSError`` (what
    :func:`kvcal.outputs.write_dir_atomically` turns into one line naming the path and the cause): safetensors raises
    its own ``SafetensorError`` — not an ``OSError`` — when the write fails, e.g. on a full disk
    (``No space left on device``), which would otherwise end in a traceback."""
    import errno

    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except OSError:
        raise
    except Exception as e:  # safetensors.SafetensorError (a failed write), whose text names the OS cause
        raise OSError(errno.EIO, f"{e}") from None


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
        save_safetensors(payload, tmp / SCALES_FILE, {"kvcal": meta_json, "format": "pt"})
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
    check_recorded_scales(f, meta, tensors)  # a forged file (hash recomputed) with swapped or edited scales
    _check_model_id(f, meta)
    return Artifact(path=p if p.is_dir() else p.parent, tensors=tensors, metadata=meta)


def _model_config_file(model_id: str) -> Path | None:
    """The ``config.json`` that ``model_id`` names on this machine — a local Hugging Face directory, or a hub id in
    the local Hugging Face cache (never downloaded) — or ``None`` (the embedded GGUF models, a .gguf file, a model
    not here)."""
    try:
        p = Path(model_id).expanduser()
        if p.is_dir():
            return p / "config.json" if (p / "config.json").is_file() else None
        if p.exists() or model_id.count("/") != 1 or model_id.startswith((".", "/", "~")):
            return None
    except (OSError, ValueError, RuntimeError):  # a name no file system takes (a NUL byte, too long, ~nobody)
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(model_id, "config.json")
    except Exception:  # an id huggingface_hub refuses as a repo name: not a hub model
        return None
    return Path(hit) if isinstance(hit, str) and Path(hit).is_file() else None


def _check_model_id(f: Path, meta: dict) -> None:
    """The recorded ``model.id`` must name the model whose configuration the artifact records (``model.config_sha256``,
    :func:`kvcal.weights.config_hash` of its config.json's text config) wherever that model is on this machine
    (:func:`_model_config_file`; config.json hashed as export does, and where that differs, the config transformers
    loads from it hashed as calibrate does); an id kvcal cannot resolve here is not checked. Raises :class:`ArtifactError` naming
    the file, the field and the fix."""
    m = meta["model"]
    mid, want = m.get("id"), m.get("config_sha256")
    if not isinstance(mid, str) or not mid or not isinstance(want, str):
        return
    cfg_file = _model_config_file(mid)
    if cfg_file is None:
        return
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # not a readable config: nothing to compare (loading that model would name it)
    if not isinstance(cfg, dict):
        return
    from kvcal.weights import config_hash

    got = config_hash(cfg.get("text_config") or cfg)
    if got != want:  # confirmed as calibrate hashed it (a loaded transformers config: a nested text_config's
        # config.json may omit fields equal to their defaults) before the artifact is refused
        from kvcal.errors import ModelLoadError
        from kvcal.models.config import load_model_config

        try:
            loaded = load_model_config(str(cfg_file.parent))
        except ModelLoadError:
            return  # not a config transformers reads: loading that model would name it
        tc = loaded.get_text_config() if hasattr(loaded, "get_text_config") else loaded
        got = config_hash(tc.to_dict())
    if got != want:
        raise ArtifactError(
            f"{f}: metadata field model.id {mid!r} names a model whose config ({cfg_file}, sha256 {got[:16]}…) is not "
            f"the one the artifact records (model.config_sha256 {want[:16]}…): the id was changed after calibration, "
            f"or the model at that path was replaced — re-run `kvcal calibrate --model {shlex.quote(mid)}`")


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
