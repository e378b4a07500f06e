"""Finding a corpus source: a file (sniffed by its bytes, not only its extension), a dataset
directory or a cached hub dataset, and reading a file's lines within :data:`MAX_LINE_BYTES` and
the decompression bound (:data:`MAX_DECOMPRESSED_BYTES`, :data:`MAX_EXPANSION`)."""

from __future__ import annotations

import gzip
import hashlib
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvcal.corpus.base import MAX_LINE_BYTES, _err, _one_line
from kvcal.errors import CorpusError

#: A compressed corpus (``.jsonl.gz``, ``.txt.gz``) is read up to this many decompressed bytes, or 32 times its
#: own size when that is more (:data:`MAX_EXPANSION`): the work a small file can cause stays bounded (a 20 MB
#: ``.gz`` that expands to 3 GB was parsed for minutes). kvcal reads at most ``--max-samples`` samples of it.
MAX_DECOMPRESSED_BYTES = 256 * 1024 * 1024
#: A compressed corpus may expand to this many times its size beyond :data:`MAX_DECOMPRESSED_BYTES`.
MAX_EXPANSION = 32
#: Single-file datasets read by the ``datasets`` packaged builder of the same name.
TABLE_EXTENSIONS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".json": "json"}
EXTENSIONS = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz", ".txt", ".txt.gz", *TABLE_EXTENSIONS)
#: A hub dataset id, optionally with a config name: ``owner/name``, ``name``, ``owner/name:config``.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?(:[\w.-]+)?$")


_KINDS = ".jsonl, .jsonl.gz, .txt, .parquet, .arrow, .csv, .json, a save_to_disk directory or a cached hub dataset id"


@dataclass
class _Source:
    """A resolved ``--corpus``: a line file (``path``, ``gz``) or a dataset (``rows()`` yields dicts)."""

    kind: str
    sha256: object  # () -> str, computed when the corpus is loaded (not by check_corpus)
    path: Path | None = None
    gz: bool = False
    rows: object = None  # () -> iterator of dict
    split: str | None = None
    workdir: object = None  # TemporaryDirectory holding a prepared (Arrow) copy while the source lives


def decompressed_limit(p: Path) -> int:
    """Decompressed bytes kvcal reads of the compressed corpus file ``p`` (see :data:`MAX_DECOMPRESSED_BYTES`)."""
    try:
        size = p.stat().st_size
    except OSError:
        size = 0
    return max(MAX_DECOMPRESSED_BYTES, MAX_EXPANSION * size)


#: ``(magic prefix, what the file is, the extension kvcal reads it under or None)``: binary formats recognised by
#: their first bytes before any text is decoded (never "re-encode it" for a file that is not text).
_MAGIC = (
    (b"PAR1", "a Parquet file", ".parquet"),
    (b"\x1f\x8b", "gzip-compressed data", ".jsonl.gz"),
    (b"GGUF", "a GGUF model file (weights, not text)", None),
    (b"ARROW1", "an Arrow IPC file", ".arrow"),
    (b"\xff\xff\xff\xff", "an Arrow IPC stream (a datasets .arrow file)", ".arrow"),
    (b"PK\x03\x04", "a zip archive (a .zip, a torch checkpoint, an .xlsx or .docx)", None),
    (b"PK\x05\x06", "an empty zip archive", None),
    (b"\xfd7zXZ\x00", "xz-compressed data", None),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed data", None),
    (b"7z\xbc\xaf\x27\x1c", "a 7-Zip archive", None),
    (b"%PDF-", "a PDF document", None),
    (b"\x89PNG\r\n\x1a\n", "a PNG image", None),
    (b"\x7fELF", "an executable (ELF)", None),
    (b"\xff\xfe", "UTF-16 text (little-endian byte-order mark)", None),
    (b"\xfe\xff", "UTF-16 text (big-endian byte-order mark)", None),
)


def sniff(head: bytes) -> tuple[str, str | None] | None:
    """What a file starting with ``head`` is when it is not UTF-8 text: ``(description, extension kvcal reads it
    under or None)`` for the formats of :data:`_MAGIC`, a safetensors file (an 8-byte header length, then its JSON
    header) and other binary data (NUL bytes); ``None`` for what may be text."""
    for magic, what, ext in _MAGIC:
        if head.startswith(magic):
            return what, ext
    if head.startswith(b"BZh") and head[3:4].isdigit():
        return "bzip2-compressed data", None
    if len(head) >= 10 and head[8:9] == b"{" and 2 <= int.from_bytes(head[:8], "little") < 1 << 30:
        return "a safetensors file (tensors: model weights or a kvcal artifact, not text)", None
    if b"\x00" in head:
        return "binary data (NUL bytes in its first bytes)", None
    return None


def _looks_like(head: bytes) -> tuple[str, str]:
    """``(what, extension)``: a short guess at the text a file starting with ``head`` holds, for messages."""
    t = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    return {b"{": ("JSON lines text", ".jsonl"), b"[": ("JSON text", ".json")}.get(t[:1], ("text", ".txt"))


def _check_magic(p: Path, path: str, ext: str) -> None:
    """Refuse a corpus file whose first bytes say it is not what its extension promises, naming what it is
    (a Parquet file named data.jsonl, gzip data named .jsonl or plain text named .jsonl.gz, a model file, an
    archive, UTF-16 text) instead of decoding it as text and advising a re-encoding. Raises CorpusError."""
    try:
        with open(p, "rb") as f:
            head = f.read(4096)
    except OSError:
        return  # reading reports it with the right message
    found = sniff(head)
    gz = ext.endswith(".gz")
    if ext in (".parquet", ".arrow"):
        ok = head.startswith(b"PAR1") if ext == ".parquet" else head.startswith((b"ARROW1", b"\xff\xff\xff\xff"))
        if ok or not head:
            return
        kind = "a Parquet file (no PAR1 magic)" if ext == ".parquet" else "an Arrow file (no Arrow magic)"
        what, hint = found or _looks_like(head)
        if found is None and hint == ".txt":  # neither binary nor JSON: damaged, or text under the wrong name
            raise _err(path, None, f"is not {kind}: it starts like text; check that it is a valid {ext[1:]} file, "
                                   "or give a text corpus its own extension (.txt, .jsonl, .csv)")
        fix = f"give it the {hint} extension" if hint and hint != ext else "pass the corpus file itself"
        raise _err(path, None, f"is {what}, not {kind}; {fix}")
    if gz:
        if not head or head.startswith(b"\x1f\x8b"):
            try:
                with gzip.open(p, "rb") as f:
                    inner = f.read(4096)
            except (OSError, EOFError, zlib.error):
                return  # the reading pass names the line of the damage
            found = sniff(inner)
            if found is None or found[0].startswith("gzip"):
                return
            what, hint = found
            raise _err(path, None, f"decompresses to {what}, not {'text' if ext.startswith('.txt') else 'JSON lines'}; "
                                   + (f"decompress it and give it the {hint} extension" if hint else
                                      "pass a corpus of text (.jsonl.gz / .txt.gz hold gzip-compressed text)"))
        what, hint = found or (f"{_looks_like(head)[0]}, not gzip-compressed", ext[:-3])
        fix = f"give it the {hint} extension" if hint and hint != ext else "pass the corpus file itself"
        raise _err(path, None, f"is {what}{'' if found is None else ', not gzip-compressed text'}; {fix}")
    if found is None:
        return
    what, hint = found
    if hint == ".jsonl.gz":  # gzip: what does it hold?
        try:
            with gzip.open(p, "rb") as f:
                inner = sniff(f.read(4096))
        except (OSError, EOFError, zlib.error):
            inner = None
        if inner is not None:
            raise _err(path, None, f"is gzip-compressed data holding {inner[0]}, not text; decompress it (gunzip)"
                                   + (f" and give it the {inner[1]} extension" if inner[1] else " and pass a text corpus"))
    if hint == ".jsonl.gz" and ext in (".txt",):
        hint = ".txt.gz"
    if hint == ".jsonl.gz" and ext in (".csv", ".json"):
        hint = None
        fix = "decompress it (gunzip); kvcal reads gzip only as .jsonl.gz / .txt.gz"
    elif what.startswith("UTF-16"):
        fix = "re-encode it as UTF-8, e.g. `iconv -f utf-16 -t utf-8 IN > OUT`"
    elif what.startswith("a GGUF"):
        fix = "a model is passed with --model; give --corpus a text corpus"
    else:
        fix = f"give it the {hint} extension" if hint else "pass a text corpus (or a format kvcal reads: " + _KINDS + ")"
    raise _err(path, None, f"is {what}, not {'text' if ext == '.txt' else ext[1:].upper() + ' text'}; {fix}")


def _special_file(p: Path) -> str | None:
    """What ``p`` is when it exists and is neither a regular file nor a directory (links followed): a named pipe
    (reading it blocks until a writer comes, and twice is impossible), a device (``/dev/zero`` never ends), a
    socket; else ``None``."""
    import stat

    try:
        mode = p.stat().st_mode
    except OSError:
        return None
    for test, what in ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return None


def _resolve(path: str, split: str | None) -> _Source:
    """Resolve ``path`` to a :class:`_Source` (nothing tokenized; datasets opened lazily where possible)."""
    p = Path(path).expanduser()
    name = p.name.lower()
    ext = next((e for e in sorted(EXTENSIONS, key=len, reverse=True) if name.endswith(e)), None)
    if not p.exists():
        if ext is None and _HUB_ID.match(str(path)):
            return _hub_source(path, split)
        raise _err(path, None, f"no such file; pass an existing corpus ({_KINDS})")
    if p.is_dir():
        return _dir_source(path, p, split)
    special = _special_file(p)
    if special:
        raise _err(path, None, f"is {special}, not a regular file; kvcal reads a corpus twice (checked before the model "
                               "loads, then sampled), which a pipe or device cannot give: save it to a file first "
                               "(e.g. `cat SOURCE > corpus.jsonl`)")
    if ext is None:
        raise _err(path, None, f"unknown corpus extension {p.suffix or '(none)'!r}; use one of {', '.join(EXTENSIONS)} "
                               "(or a save_to_disk directory / cached hub dataset id)")
    if split is not None:
        raise _err(path, None, f"--split {split!r} applies to datasets with splits (a save_to_disk DatasetDict "
                               "directory or a hub dataset); a single file has none: drop --split")
    if p.is_file():
        _check_magic(p, path, ext)
    if ext == ".parquet":
        _check_parquet_rows(p, path)
    if ext in TABLE_EXTENSIONS:
        builder = TABLE_EXTENSIONS[ext]
        d, work = _prepare(path, builder, lambda ds, cache: ds.load_dataset(builder, data_files=str(p), split="train",
                                                                            cache_dir=cache))
        return _Source(builder, lambda: _sha256(p, path), path=p, rows=lambda: d, workdir=work)
    kind = "txt" if ext.startswith(".txt") else "jsonl"
    return _Source(kind, lambda: _sha256(p, path), path=p, gz=ext.endswith(".gz"))


def _check_parquet_rows(p: Path, path: str) -> None:
    """A valid Parquet file with zero rows is a corpus with no samples (datasets fails on it with ArrowInvalid:
    "BatchSize must be greater than 0"); a footer that does not parse is left to the reading pass. Raises
    CorpusError."""
    try:
        import pyarrow.parquet as pq

        rows = pq.ParquetFile(p).metadata.num_rows
    except Exception:  # pyarrow raises several types for a damaged footer: datasets' read names it
        return
    if rows == 0:
        raise _err(path, None, "no samples: the parquet data holds no rows (a valid file with an empty table); add "
                               "samples or pass another corpus")


class _datasets_offline:
    """Context manager: import ``datasets`` with hub access off (``HF_HUB_OFFLINE`` for ``datasets``
    and ``huggingface_hub``, restored on exit) and its progress bars / cache warnings silenced.
    Yields the ``datasets`` module."""

    def __enter__(self):
        import datasets
        import datasets.config as dconf
        from huggingface_hub import constants as hconst

        self._old = (dconf.HF_HUB_OFFLINE, hconst.HF_HUB_OFFLINE, datasets.logging.get_verbosity(),
                     datasets.is_progress_bar_enabled())
        dconf.HF_HUB_OFFLINE = hconst.HF_HUB_OFFLINE = True
        datasets.logging.set_verbosity(datasets.logging.CRITICAL + 10)  # its read errors reach the user as ours
        datasets.disable_progress_bars()
        return datasets

    def __exit__(self, *exc):
        import datasets
        import datasets.config as dconf
        from huggingface_hub import constants as hconst

        dconf.HF_HUB_OFFLINE, hconst.HF_HUB_OFFLINE, verbosity, bars = self._old
        datasets.logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()
        return False


def _cause(e: BaseException) -> str:
    """``Type: message`` of the innermost cause of ``e`` (datasets wraps parser errors), one line."""
    seen = {id(e)}
    while (e.__cause__ or e.__context__) is not None and id(e.__cause__ or e.__context__) not in seen:
        e = e.__cause__ or e.__context__
        seen.add(id(e))
    return f"{type(e).__name__}: {_one_line(e, 200)}"


def _prepare(path: str, kind: str, load, what: str | None = None):
    """``load(datasets, cache_dir)`` with hub access off, into a temporary ``datasets`` cache that lives
    as long as the returned TemporaryDirectory (a memory-mapped Arrow copy: typed columns, mixed-type
    JSON decoded, nothing left in the user's cache). Returns ``(dataset, tmpdir)``; a read error is
    one CorpusError line."""
    import tempfile

    work = tempfile.TemporaryDirectory(prefix="kvcal-corpus-")
    try:
        with _datasets_offline() as ds:
            return load(ds, work.name), work
    except CorpusError:
        work.cleanup()
        raise
    except Exception as e:
        work.cleanup()
        if "corresponds to no data" in str(e):  # datasets' message for a split with no rows: say what it means
            raise _err(path, None, f"no samples: the {kind} data holds no rows (an empty JSON array, a CSV with only a "
                                   "header, an empty table); add samples or pass another corpus") from None
        raise _err(path, None, what.format(cause=_cause(e)) if what else
                   f"cannot read as {kind} ({_cause(e)}); check that it is a valid {kind} file") from None


def _pick_split(path: str, d, split: str | None):
    """``(dataset, split)`` from a DatasetDict-like ``d`` (``split`` None: ``train`` or the only one)."""
    names = list(d.keys())
    if split is None:
        if "train" in names or len(names) == 1:
            split = "train" if "train" in names else names[0]
        else:
            raise _err(path, None, f"the dataset has splits {', '.join(names)}; choose one with --split")
    elif split not in names:
        raise _err(path, None, f"the dataset has no split {split!r} (splits: {', '.join(names) or 'none'}); "
                               "pass --split with one of them")
    return d[split], split


def _dataset_rows(path: str, d, split: str | None, what: str):
    """A :class:`_Source` ``rows`` callable and the split for a Dataset/IterableDataset or a dict of them."""
    if isinstance(d, dict):  # DatasetDict / IterableDatasetDict
        d, split = _pick_split(path, d, split)
    elif split is not None:
        raise _err(path, None, f"--split {split!r}: this {what} has no splits (one dataset); drop --split")
    return (lambda: d), split


def _files_sha256(files: list[Path], root: Path | None = None) -> str:
    """sha256 over ``(relative name, bytes)`` of ``files`` in sorted order (a dataset's identity)."""
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(str(f.relative_to(root) if root else f.name).encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda fh=fh: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _dir_files(p: Path) -> list[Path]:
    return [f for f in p.rglob("*") if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts)]


def _dir_source(path: str, p: Path, split: str | None) -> _Source:
    """A ``save_to_disk`` directory (memory-mapped, nothing copied) or a directory of data files (streamed)."""
    saved = (p / "dataset_dict.json").is_file() or (p / "state.json").is_file()
    work = None
    try:
        if saved:
            with _datasets_offline() as ds:
                d = ds.load_from_disk(str(p))
        else:
            d, work = _prepare(path, "data directory", lambda ds, cache: ds.load_dataset(str(p), cache_dir=cache),
                               "is a directory without a save_to_disk dataset or readable data files ({cause}); "
                               f"pass a corpus file or directory ({_KINDS})")
    except CorpusError:
        raise
    except Exception as e:
        raise _err(path, None, f"cannot read this save_to_disk directory ({_cause(e)}); "
                               "re-create it with Dataset.save_to_disk") from None
    rows, split = _dataset_rows(path, d, split, "directory")
    return _Source("save_to_disk" if saved else "data_dir", lambda: _files_sha256(_dir_files(p), p), rows=rows,
                   split=split, workdir=work)


def _hub_source(path: str, split: str | None) -> _Source:
    """A hub dataset id from the local cache only: the hub snapshot (``huggingface_hub``) when there
    is one, otherwise ``datasets``' own cache of a dataset loaded before. Never downloads."""
    repo, _, config = str(path).partition(":")
    local = None
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(repo, repo_type="dataset", local_files_only=True)
    except Exception:  # not in the hub cache: try the datasets cache below
        local = None
    work = None
    try:
        if local is not None:
            d, work = _prepare(path, "dataset", lambda ds, cache: ds.load_dataset(local, name=config or None,
                                                                                  cache_dir=cache))
        else:
            with _datasets_offline() as ds:
                d = ds.load_dataset(repo, name=config or None)
    except Exception as e:
        found = f"found in the hub cache at {local} but unreadable ({_cause(e)})" if local else "not a file and not a dataset in the local Hugging Face cache"
        raise _err(path, None, f"{found}; kvcal never downloads at run time: load it once with "
                               f"`datasets.load_dataset({repo!r})` where the hub is reachable, or pass a local "
                               f"corpus ({_KINDS})") from None
    rows, split = _dataset_rows(path, d, split, "dataset")
    if local is not None:
        root = Path(local)
        sha = lambda: _files_sha256(_dir_files(root), root)  # noqa: E731
    else:
        ds_obj = rows()
        sha = lambda: _files_sha256([Path(f["filename"]) for f in getattr(ds_obj, "cache_files", [])])  # noqa: E731
    return _Source("hub", sha, rows=rows, split=split, workdir=work)


def _sha256(p: Path, path: str) -> str:
    h = hashlib.sha256()
    try:
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except OSError as e:
        raise _err(path, None, f"cannot read ({e.strerror or e}); check the file's permissions") from None
    return h.hexdigest()


def _lines(p: Path, path: str, gz: bool) -> Iterator[tuple[int, str]]:
    """Yield ``(line_number, text)`` (1-based, newline stripped, UTF-8 BOM stripped on line 1).

    Reads at most :data:`MAX_LINE_BYTES` + 1 bytes per line. Raises CorpusError on long lines,
    non-UTF-8 bytes, and corrupt gzip streams.
    """
    try:
        f = gzip.open(p, "rb") if gz else open(p, "rb")
    except OSError as e:
        raise _err(path, None, f"cannot open ({e.strerror or e}); check the file's permissions") from None
    lineno = 0
    limit = decompressed_limit(p) if gz else None
    with f:
        while True:
            try:
                raw = f.readline(MAX_LINE_BYTES + 1)
            except (OSError, EOFError, zlib.error) as e:
                raise _err(path, lineno + 1, f"corrupt or truncated gzip data ({_one_line(e)}); "
                                             "re-create the file with gzip") from None
            if not raw:
                return
            lineno += 1
            if limit is not None and f.tell() > limit:
                raise _err(path, lineno, f"expands past {limit >> 20} MiB when decompressed (the bound for a "
                                         f"compressed corpus: {MAX_DECOMPRESSED_BYTES >> 20} MiB or {MAX_EXPANSION}x "
                                         "its size), far more text than calibration reads; keep a part of it, e.g. "
                                         "`zcat IN.gz | head -n 100000 | gzip > part.jsonl.gz`")
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                raise _err(path, lineno, f"line is longer than the {MAX_LINE_BYTES >> 20} MiB limit per line; "
                                         "split it into several samples/lines (a .txt corpus is cut into "
                                         "windows); kvcal stops reading at the limit")
            raw = raw.rstrip(b"\n").rstrip(b"\r")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                what = sniff(raw[:4096]) if lineno == 1 else None
                if what is not None or b"\x00" in raw:  # binary data: a re-encoding would corrupt it
                    raise _err(path, lineno, f"is {what[0] if what else 'binary data (NUL bytes)'}, not UTF-8 text; "
                                             "pass a text corpus") from None
                raise _err(path, lineno, f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} "
                                         "of the line); re-encode the file as UTF-8 from the encoding it was "
                                         "written in (`file -i` may name it; then `iconv -f THAT -t utf-8`)"
                                         ) from None
            if lineno == 1 and text.startswith("\ufeff"):
                text = text[1:]
            yield lineno, text
