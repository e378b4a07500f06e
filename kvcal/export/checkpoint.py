"""Merging exported scales into a copy of a Hugging Face safetensors checkpoint directory.

The copy never rewrites the source: weight files are hard-linked into the output (falling back to a
copy across file systems), every other file (configs, tokenizer files) is copied so it can be edited safely, the scales go into a *new* shard (:data:`SCALES_SHARD`), and
``model.safetensors.index.json`` maps their names to it (the index is created when the source is a
single ``model.safetensors``; that file is then linked as :data:`SINGLE_RENAMED`, because
transformers loads ``model.safetensors`` in preference to an index and would miss the new shard).

Stale KV scales already in a weight shard are a trap: vLLM and SGLang read *every tensor of
every shard the index lists* (vLLM ``weight_utils.safetensors_weights_iterator``; the index only
selects files), so an old ``k_scale`` left in a shard would be loaded too and whichever file is
read last wins. Pointing the index elsewhere is therefore not enough: a shard that holds stale
KV-scale tensors is written into the output as a *filtered copy* — the same file name and header
metadata, every other tensor's bytes copied verbatim (streamed, no decode), only the stale scale
tensors left out. The source file is untouched and the user is told which shards were copied.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch

from kvcal.artifact.io import save_safetensors
from kvcal.export.base import MANIFEST, ExportError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SINGLE_RENAMED = "model-00001-of-00001.safetensors"
SCALES_SHARD = "kvcal-kv-scales.safetensors"
_CHUNK = 16 << 20


def read_header(path: Path) -> tuple[dict, int]:
    """Parse a safetensors header without reading tensor data.

    Returns ``(header, data_start)``: ``header`` maps tensor name -> ``{"dtype", "shape",
    "data_offsets": [begin, end]}`` (byte offsets relative to ``data_start``) plus an optional
    ``"__metadata__"`` dict. Raises :class:`ExportError` for a truncated or non-safetensors file.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError("shorter than 8 bytes")
            n = int.from_bytes(raw, "little")
            if n > 100 << 20:
                raise ValueError(f"header length {n} is implausible")
            header = json.loads(f.read(n))
        return header, 8 + n
    except (OSError, ValueError) as e:
        raise ExportError(f"{path} is not a readable safetensors file ({e})") from None


def filtered_copy(src: Path, dst: Path, drop: set[str]) -> list[str]:
    """Write ``dst``: the safetensors file ``src`` without the tensors named in ``drop``.

    Kept tensors keep their dtype, shape, order and bytes (copied in 16 MiB chunks, never decoded);
    ``__metadata__`` is preserved; the header is space-padded to 8-byte alignment as safetensors
    writes it. Returns the kept tensor names.
    """
    header, start = read_header(src)
    meta = header.pop("__metadata__", None)
    kept = sorted((k for k in header if k not in drop), key=lambda k: header[k]["data_offsets"][0])
    new: dict = {}
    if meta is not None:
        new["__metadata__"] = meta
    off = 0
    for k in kept:
        b, e = header[k]["data_offsets"]
        new[k] = {"dtype": header[k]["dtype"], "shape": header[k]["shape"], "data_offsets": [off, off + e - b]}
        off += e - b
    hb = json.dumps(new, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        fo.write(len(hb).to_bytes(8, "little"))
        fo.write(hb)
        for k in kept:
            b, e = header[k]["data_offsets"]
            fi.seek(start + b)
            left = e - b
            while left:
                chunk = fi.read(min(_CHUNK, left))
                if not chunk:
                    raise ExportError(f"{src} is truncated (tensor {k})")
                fo.write(chunk)
                left -= len(chunk)
    return kept


#: File suffixes hard-linked rather than copied: weight files, large and never edited in place.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".npz")


def link_or_copy(src: Path, dst: Path) -> None:
    """Put ``src`` (symlinks followed, e.g. hub-cache blobs) at ``dst``: weight files
    (:data:`WEIGHT_SUFFIXES`) are hard-linked (copied if linking fails, e.g. across file systems);
    every other file — ``config.json``, tokenizer and generation configs, JSON a user may edit — is
    copied, so editing the export in place can never change the source checkpoint through a shared
    inode."""
    real = Path(os.path.realpath(src))  # hub-cache snapshots are relative symlinks to ../../blobs/<hash>
    if not real.is_file():
        raise ExportError(f"{src} is a broken link or not a file (it resolves to {real}); fix or remove it in "
                          "--model-dir")
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.name.endswith(WEIGHT_SUFFIXES):
        try:
            os.link(real, dst)  # the blob itself: os.link would otherwise link the (relative) symlink
            return
        except OSError:
            pass
    shutil.copy2(real, dst)


def check_member(model_dir: Path, name: object, where: str) -> str:
    """Return ``name`` when it is a relative file name that stays inside ``model_dir``; raise
    :class:`ExportError` (one line naming ``where`` and the entry) when it is not a non-empty string, is
    absolute (POSIX or Windows drive), or has a ``..`` component — an index mapping weights to
    ``../outside/w.safetensors`` would otherwise make kvcal read and write outside --model-dir / --out.
    The check is lexical: a hub-cache snapshot's files are symlinks into ``../../blobs`` (outside the
    directory by design) and are read through; what kvcal *writes* is named by ``name``, not the link."""
    bad = None
    if not isinstance(name, str) or not name:
        bad = "is not a file name"
    elif (PurePosixPath(name).is_absolute() or PureWindowsPath(name).is_absolute() or PureWindowsPath(name).drive
          or name.startswith(("/", "\\"))):
        bad = "is an absolute path"
    elif ".." in PurePosixPath(name.replace("\\", "/")).parts:
        bad = "climbs out of the directory with '..'"
    else:
        root = os.path.abspath(model_dir)
        if not os.path.normpath(os.path.join(root, name)).startswith(root + os.sep):
            bad = "lies outside the directory"
    if bad:
        raise ExportError(f"{where} entry {name!r} {bad}; a checkpoint's files must lie inside --model-dir "
                          f"{model_dir} — fix the entry (a plain shard file name such as model-00001-of-00002.safetensors)")
    return name


def staged_path(staging: Path, rel: str | os.PathLike) -> Path:
    """``staging / rel``, checked to lie inside ``staging`` (lexically): every file an export writes
    goes through here, so no entry of a source checkpoint can make kvcal write outside --out.
    Raises :class:`ExportError` otherwise."""
    root = os.path.abspath(staging)
    dst = os.path.normpath(os.path.join(root, rel))
    if not dst.startswith(root + os.sep):
        raise ExportError(f"refusing to write {rel!s}: it lies outside the output directory; nothing was written")
    return Path(dst)


@dataclass
class Checkpoint:
    """A source checkpoint: ``path``, parsed ``config`` (config.json), ``shards`` (safetensors
    file names the loaders read) and ``index`` (parsed index JSON, or None for one file)."""

    path: Path
    config: dict
    shards: list[str]
    index: dict | None


def open_checkpoint(model_dir: str | os.PathLike) -> Checkpoint:
    """Read a HF checkpoint directory's config and shard list; :class:`ExportError` when it has
    no config.json or no safetensors weights (``.bin`` checkpoints: convert them first)."""
    p = Path(model_dir)
    if not p.is_dir():
        raise ExportError(f"--model-dir {p} is not a directory")
    cfg_path = p / "config.json"
    if not cfg_path.is_file():
        raise ExportError(f"--model-dir {p} has no config.json; pass a Hugging Face checkpoint directory")
    from kvcal.export.checkpoint_json import read_config, read_index

    config = read_config(cfg_path, ExportError)  # field types checked once: one-line errors, no traceback
    index = None
    if (p / INDEX).is_file():
        index = read_index(p / INDEX, ExportError)  # an object whose weight_map maps str -> str
        wm = index.get("weight_map", {}) if isinstance(index, dict) else None
        if not isinstance(wm, dict):
            raise ExportError(f"{p / INDEX} has no weight_map object; the checkpoint index is malformed")
        shards = sorted({check_member(p, v, f"{p / INDEX} weight_map[{k!r}]") for k, v in wm.items()})
        missing = [s for s in shards if not (p / s).is_file()]
        if missing:
            raise ExportError(f"{p / INDEX} lists missing shard files {missing[:3]}; the checkpoint is incomplete")
    elif (p / SINGLE).is_file():
        shards = [SINGLE]
    else:
        raise ExportError(f"--model-dir {p} has no model.safetensors or {INDEX}; only safetensors checkpoints "
                          "can be merged (convert .bin weights with save_pretrained(safe_serialization=True))")
    return Checkpoint(p, config, shards, index)


def text_config(config: dict) -> dict:
    """The language-model part of a (possibly multimodal) config.json dict."""
    return config.get("text_config") or config


def check_matches(meta: dict, config: dict, path: Path) -> list[str]:
    """Refuse a checkpoint whose layer count / KV heads / head_dim / model_type differ from the
    artifact's (:class:`ExportError` naming the field); return warnings for softer mismatches (a
    config that differs from the calibrated one in other fields: another fine-tune, rope_theta, ...)."""
    tc = text_config(config)
    m = meta["model"]
    heads = tc.get("num_attention_heads")
    hd = tc.get("head_dim") or (tc["hidden_size"] // heads if tc.get("hidden_size") and heads else None)
    have = {
        "num_layers": tc.get("num_hidden_layers"),
        "num_kv_heads": tc.get("num_key_value_heads", heads),
        "head_dim": hd,
        "model_type": tc.get("model_type", config.get("model_type")),
    }
    for key, val in have.items():
        if val is not None and m.get(key) is not None and val != m.get(key):
            raise ExportError(
                f"artifact does not match --model-dir {path}: {key} is {m.get(key)!r} in the artifact but "
                f"{val!r} in config.json; export the artifact calibrated for this model"
            )
    from kvcal.weights import config_hash

    warnings = []
    if m.get("config_sha256") and config_hash(tc) != m["config_sha256"]:
        warnings.append(f"{path}/config.json differs from the config the artifact was calibrated on (sha256; the "
                        "shapes match): scales from another model or fine-tune, or another rope_theta, need not fit "
                        "this one — re-calibrate on this checkpoint unless it is the same model re-saved")
    return warnings


def checkpoint_weights_fingerprint(ckpt: Checkpoint, recorded: dict) -> dict:
    """The weight fingerprint (:mod:`kvcal.weights`) of ``ckpt``'s safetensors shards, read from the
    files (headers plus a few bytes per tensor, no weights loaded); ``recorded``: the artifact's
    ``model.weights``, which selects the tensors. A shard kvcal wrote (:data:`SCALES_SHARD`) is skipped."""
    from kvcal.weights import fingerprint_from_files

    files = [(ckpt.path / s, *read_header(ckpt.path / s)) for s in ckpt.shards if s != SCALES_SHARD]
    return fingerprint_from_files(files, recorded)


def check_weights(meta: dict, ckpt: Checkpoint) -> list[str]:
    """Refuse a checkpoint whose weights differ from those the artifact was calibrated on (the
    fingerprint in ``meta["model"]["weights"]``, :mod:`kvcal.weights`): :class:`ExportError` naming
    the layers that differ or are missing. Returns a one-line warning instead when the artifact
    records no fingerprint (written before kvcal recorded one, or calibrated with weights offloaded
    to disk) or one of another scheme: the weights cannot be verified then."""
    from kvcal.weights import SCHEME, compare_fingerprints

    rec = meta["model"].get("weights")
    if not isinstance(rec, dict) or rec.get("scheme") != SCHEME:
        why = "records no weight fingerprint" if rec is None else "records a weight fingerprint of another scheme"
        return [f"the artifact {why}, so kvcal cannot verify that --model-dir {ckpt.path} holds the weights it was "
                "calibrated on (re-calibrate with this kvcal to record one)"]
    L, layers = rec.get("num_layers"), rec.get("layers")
    if not (isinstance(L, int) and isinstance(layers, list) and len(layers) == L
            and all(x is None or isinstance(x, str) for x in layers) and isinstance(rec.get("embedding_name"), str)):
        raise ExportError("the artifact's model.weights fingerprint is malformed (num_layers, layers, embedding_name); "
                          "the metadata was edited — re-run calibration")
    diff = compare_fingerprints(rec, checkpoint_weights_fingerprint(ckpt, rec))
    if diff:
        raise ExportError(f"--model-dir {ckpt.path} is not the checkpoint the artifact was calibrated on: its weights "
                          f"differ in {diff} (the config matches); scales fitted to other weights are wrong for these "
                          f"— re-calibrate on this checkpoint (kvcal calibrate --model {ckpt.path}) or pass the "
                          "checkpoint the artifact was calibrated on")
    return []


def merge_into_copy(
    ckpt: Checkpoint,
    staging: Path,
    new_tensors: dict[str, torch.Tensor],
    is_stale: Callable[[str], bool],
    replace_files: dict[str, dict],
) -> list[str]:
    """Populate ``staging`` with a copy of ``ckpt`` whose engines load ``new_tensors``.

    ``new_tensors``: name -> tensor written (as given: callers pass float32) into
    :data:`SCALES_SHARD`; ``is_stale(name)``: True for existing tensors to remove (old KV scales;
    names in ``new_tensors`` are always removed from the old shards); ``replace_files``: file name
    -> JSON dict written instead of the source's file (``config.json``, ``hf_quant_config.json``).
    Returns notes for the user. Raises :class:`ExportError` for unreadable shards.
    """

    notes: list[str] = []
    src = ckpt.path
    skip = {INDEX, SCALES_SHARD, MANIFEST, *replace_files}
    weight_map: dict[str, str] = {}
    total = 0
    stale_report: dict[str, list[str]] = {}
    carried: dict[str, torch.Tensor] = {}
    shard_set = set(ckpt.shards)
    for shard in ckpt.shards:
        header, _ = read_header(src / shard)
        names = [k for k in header if k != "__metadata__"]
        drop = {k for k in names if k in new_tensors or is_stale(k)}
        if shard == SCALES_SHARD:  # re-export over an earlier kvcal export: carry what we don't replace
            from safetensors import safe_open

            with safe_open(str(src / shard), framework="pt") as fh:
                carried = {k: fh.get_tensor(k) for k in names if k not in drop}
            continue
        out_name = SINGLE_RENAMED if (ckpt.index is None and shard == SINGLE) else shard
        if drop:
            kept = filtered_copy(src / shard, staged_path(staging, out_name), drop)
            stale_report[shard] = sorted(drop)
        else:
            link_or_copy(src / shard, staged_path(staging, out_name))
            kept = names
        for k in kept:
            weight_map[k] = out_name
            b, e = header[k]["data_offsets"]
            total += e - b
    for root, dirs, files in os.walk(src, followlinks=True):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for fname in files:
            rel = os.path.relpath(os.path.join(root, fname), src)
            if rel in skip or rel in shard_set or fname.startswith("."):
                continue
            link_or_copy(src / rel, staged_path(staging, rel))
    shard_tensors = {**carried, **{k: v.detach().contiguous().cpu() for k, v in new_tensors.items()}}
    save_safetensors(shard_tensors, staging / SCALES_SHARD, {"format": "pt", "producer": "kvcal"})
    for k, t in shard_tensors.items():
        weight_map[k] = SCALES_SHARD
        total += t.numel() * t.element_size()
    index = {"metadata": {**((ckpt.index or {}).get("metadata") or {}), "total_size": total},
             "weight_map": dict(sorted(weight_map.items()))}
    (staging / INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    for fname, obj in replace_files.items():
        staged_path(staging, fname).write_text(json.dumps(obj, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    if ckpt.index is None:
        notes.append(f"single-file checkpoint: weights linked as {SINGLE_RENAMED} and {INDEX} created "
                     "(transformers would otherwise load model.safetensors alone and miss the scales)")
    for shard, names in stale_report.items():
        notes.append(
            f"replaced {len(names)} existing KV-scale tensors ({', '.join(names[:3])}{'...' if len(names) > 3 else ''}): "
            f"{shard} was written as a filtered copy without them (other tensors byte-identical; the source "
            "is untouched) because vLLM/SGLang read every tensor of every listed shard"
        )
    return notes
