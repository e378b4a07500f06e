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
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvcal.errors import ArtifactError, KvcalError

SCHEMA_VERSION = 1
SCALES_FILE = "kv_scales.safetensors"
SIDES = ("k", "v")


def tensor_name(layer: int, side: str, kind: str = "scale") -> str:
    """Artifact tensor name, e.g. ``tensor_name(3, "k") == "model.layers.3.self_attn.k_scale"``."""
    if side not in SIDES:
        raise ValueError(f"side must be 'k' or 'v', got {side!r}")
    return f"model.layers.{layer}.self_attn.{side}_{kind}"


def config_hash(config_dict: dict) -> str:
    """sha256 of a model config's architecture-defining fields (stable across save/load).

    Only fields that change the shapes or meaning of K/V are hashed, so a model re-saved by a
    different transformers version still matches its artifacts.
    """
    keys = (
        "model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "hidden_size", "head_dim", "rope_theta", "vocab_size", "max_position_embeddings",
    )
    sub = {k: config_dict.get(k) for k in keys}
    return hashlib.sha256(json.dumps(sub, sort_keys=True, default=str).encode()).hexdigest()


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
    meta = dict(metadata)
    meta["schema_version"] = SCHEMA_VERSION
    meta["tensor_names"] = sorted(tensors)  # load_artifact refuses a file missing one of them, or holding others
    payload = {k: v.detach().to(torch.float32).contiguous().cpu() for k, v in tensors.items()}
    try:
        meta_json = json.dumps(meta, allow_nan=False, default=_json_default)
    except ValueError as e:
        raise ArtifactError(f"artifact metadata holds a non-finite number: {e}") from None

    def fill(tmp: Path) -> None:
        save_file(payload, str(tmp / SCALES_FILE), metadata={"kvcal": meta_json, "format": "pt"})
        for fname, content in (extra_files or {}).items():
            p = tmp / fname
            p.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, bytes):
                p.write_bytes(content)
            else:
                p.write_text(content, encoding="utf-8")

    return write_dir_atomically(Path(out_dir), fill, overwrite, ArtifactError, inputs)


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


def is_kvcal_output(path: Path) -> bool:
    """True when directory ``path`` is something kvcal wrote and ``--overwrite`` may replace: an
    artifact (``kv_scales.safetensors`` whose header carries kvcal metadata) or an export (its
    ``kvcal-export.json`` manifest names a ``kvcal_version``)."""
    import struct

    f = path / SCALES_FILE
    try:
        if f.is_file():
            with open(f, "rb") as h:
                n = struct.unpack("<Q", h.read(8))[0]
                if 0 < n <= 100_000_000:
                    header = json.loads(h.read(n))
                    if "kvcal" in (header.get("__metadata__") or {}):
                        return True
        m = path / "kvcal-export.json"
        if m.is_file():
            return "kvcal_version" in json.loads(m.read_text(encoding="utf-8"))
    except (OSError, ValueError, struct.error, AttributeError):
        return False
    return False


def check_output_dir(out: str | os.PathLike, overwrite: bool, inputs: dict[str, object] | None = None,
                     error: type[KvcalError] = ArtifactError) -> None:
    """Refuse an output directory before any work is done (and again when it is written).

    ``inputs``: option name -> path the command reads (``--corpus``, ``--artifact``,
    ``--model-dir``, …; ``None`` entries ignored). Raises ``error`` when ``out`` is, or contains, one
    of them (replacing it would destroy the input); when ``out`` exists without ``overwrite``;
    when it exists and is not a directory; when ``overwrite`` would replace a non-empty directory
    kvcal did not write (:func:`is_kvcal_output`: a mistyped ``--out . --overwrite`` must not wipe a
    working tree); when a parent of ``out`` is a file; or when the nearest existing ancestor of
    ``out`` does not take a new directory (read-only, ``/proc``, permissions — probed with an empty
    temporary directory that is removed at once)."""
    out = Path(out)
    dst = out.resolve()
    for opt, p in (inputs or {}).items():
        if p is None or isinstance(p, Artifact):
            continue
        src = Path(p).resolve()
        if src == dst or dst in src.parents:
            raise error(f"--out {out} is or contains the input {opt} {p}; writing there would destroy it — "
                        "choose an --out outside it")
    if out.exists():
        if not out.is_dir():
            raise error(f"output path {out} exists and is not a directory; choose a directory path for --out")
        if not overwrite:
            raise error(f"output directory {out} already exists; pass --overwrite to replace it")
        if any(out.iterdir()) and not is_kvcal_output(out):
            raise error(f"--overwrite replaces only directories kvcal wrote (an artifact or an export), and {out} "
                        "is neither; remove it yourself or choose another --out")
    for par in dst.parents:
        if par.exists() and not par.is_dir():
            raise error(f"cannot write {out}: {par} is a file, not a directory; choose another --out")
    # the output is staged in a sibling directory: probe that the nearest existing ancestor takes one,
    # so a read-only or pseudo-file-system --out fails now, not after the whole calibration
    anc = next(par for par in dst.parents if par.exists())
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".kvcal-probe-", dir=anc))
    except OSError as e:
        raise error(f"cannot write {out}: {anc} does not take new directories ({e.strerror or e}); "
                    "choose a writable --out") from None


def write_dir_atomically(out: Path, fill: Callable[[Path], None], overwrite: bool = False,
                         error: type[KvcalError] = ArtifactError, inputs: dict[str, object] | None = None) -> Path:
    """Create directory ``out`` atomically: ``fill(staging)`` populates a temporary sibling which
    replaces ``out`` only when ``fill`` returns normally; on any error (also Ctrl-C) nothing is
    left and an existing ``out`` is untouched. Files and the directory get normal permissions
    (``mkdtemp`` and safetensors create 0700/0600).

    Raises ``error`` (a :class:`KvcalError` subclass) for every refusal of
    :func:`check_output_dir` (``inputs`` as there) or on OS errors (read-only location, disk full).
    """
    out = Path(out)
    check_output_dir(out, overwrite, inputs, error)
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

    Raises :class:`ArtifactError` when the file is missing, truncated/corrupted, has no kvcal
    metadata, has an unknown schema version, or lacks a k/v scale for a layer that the metadata
    says is statically quantized.
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
    ver = meta.get("schema_version")
    if ver != SCHEMA_VERSION:
        raise ArtifactError(f"{f}: schema_version {ver!r} is not supported (this kvcal reads {SCHEMA_VERSION})")
    _validate_metadata(f, meta, tensors)
    listed = meta.get("tensor_names")  # absent in artifacts written before it was recorded
    if listed is not None:
        if not isinstance(listed, list) or not all(isinstance(x, str) for x in listed):
            raise ArtifactError(f"{f}: metadata tensor_names must be a list of tensor names; re-run calibration")
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
    for name, t in tensors.items():
        if name.endswith("_scale") and (not torch.isfinite(t).all() or (t <= 0).any()):
            raise ArtifactError(f"{f}: tensor {name} holds zero, negative or non-finite scales")
    if _has_calibrated_parameters(meta, tensors):
        from kvcal.plan import KVPlan

        try:  # every per-layer parameter (clip ratios, widths, levels, rounding, log8 bases) checked once, here
            KVPlan.from_artifact(tensors, meta)
        except (ValueError, KeyError, TypeError) as e:
            msg = str(e) if isinstance(e, ValueError) else f"metadata field {e} is missing or malformed"
            raise ArtifactError(f"{f}: {msg}; re-run calibration") from None
    return Artifact(path=p if p.is_dir() else p.parent, tensors=tensors, metadata=meta)


def _has_calibrated_parameters(meta: dict, tensors: dict) -> bool:
    """True when the artifact is more than static scales (integer / dynamic sides, transforms)."""
    kv = meta["kv"]
    specs = kv.get("layer_specs") or [{s: kv.get(s) for s in SIDES}]
    dynamic = any((sp.get(s) or {}).get("dynamic") for sp in specs for s in SIDES)
    return dynamic or bool(kv.get("transforms")) or any(not n.endswith(("_scale", "_zero_point")) for n in tensors)


def _validate_metadata(f: Path, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Types and consistency of the metadata fields kvcal relies on; ArtifactError naming the field."""
    if not isinstance(meta, dict):
        raise ArtifactError(f"{f}: kvcal metadata must be a JSON object")
    for section in ("model", "kv"):
        if not isinstance(meta.get(section), dict):
            raise ArtifactError(f"{f}: metadata field {section!r} is missing or not an object; re-run calibration")
    m = meta["model"]
    for key in ("num_layers", "num_kv_heads", "head_dim"):
        v = m.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ArtifactError(f"{f}: metadata model.{key} must be a positive integer, got {v!r}")
    for side in SIDES:
        spec = meta["kv"].get(side)
        if spec is not None and not isinstance(spec, dict):
            raise ArtifactError(f"{f}: metadata kv.{side} must be an object, got {type(spec).__name__}")
    n, H, D = m["num_layers"], m["num_kv_heads"], m["head_dim"]
    layer_specs = meta["kv"].get("layer_specs")
    if layer_specs is not None and (not isinstance(layer_specs, list) or len(layer_specs) != n):
        raise ArtifactError(f"{f}: metadata kv.layer_specs must list {n} layers")
    for name, t in tensors.items():
        parts = name.split(".")
        if len(parts) < 5 or parts[0] != "model" or parts[1] != "layers" or not parts[2].isdigit():
            continue
        i = int(parts[2])
        if i >= n:
            raise ArtifactError(f"{f}: tensor {name} is for layer {i} but the metadata says {n} layers")
        if name.endswith("_scale"):
            spec = (layer_specs[i] if layer_specs else meta["kv"]).get(parts[-1][0]) or {}
            allowed = {"tensor": [(1,)], "head": [(H, 1, 1)], "channel": [(H, 1, D)]}.get(spec.get("granularity"))
            if allowed and tuple(t.shape) not in allowed:
                raise ArtifactError(f"{f}: {name} has shape {list(t.shape)}, expected {list(allowed[0])} for "
                                    f"{spec.get('granularity')} granularity")


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
                "re-run `kvcal calibrate` for this model"
            )


def is_finite_number(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
