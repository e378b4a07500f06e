"""Validating a corpus without a tokenizer or model (:func:`check_corpus`, cached per file state)."""

from __future__ import annotations

from pathlib import Path

from kvcal.corpus.base import _err
from kvcal.corpus.jsonl import _JsonlParser
from kvcal.corpus.records import _check_args, _check_text, _records
from kvcal.corpus.sources import _lines, _resolve
from kvcal.corpus.txt import _txt_documents


def check_corpus(path, *, text_field: str | None = None, messages_field: str | None = None,
                 split: str | None = None) -> dict:
    """Validate a corpus without a tokenizer or model: source, format, every record's fields and
    types (what :func:`load_corpus` checks except chat-template rendering and token counts).
    Cheap enough to run before anything expensive; reads the whole file once.

    Returns ``{"source", "split", "records", "formats": {format: count}}``. Raises
    :class:`~kvcal.errors.CorpusError` (the same one-line messages as :func:`load_corpus`).
    """
    spath = str(path)
    _check_args(spath, text_field, messages_field)
    key = _check_key(spath, text_field, messages_field, split)
    if key is not None and key in _CHECKED:
        return dict(_CHECKED[key])
    res = _check(spath, text_field, messages_field, split)
    if key is not None:
        _CHECKED[key] = dict(res)
    return res


#: check_corpus results of this process, keyed by path, options and the file's size and mtime: a second check of
#: an unchanged file is free (the commands check once, kvcal.inputs; a caller checking again pays nothing).
_CHECKED: dict[tuple, dict] = {}


def _check_key(spath: str, *opts) -> tuple | None:
    p = Path(spath).expanduser()
    try:
        st = p.stat()
    except OSError:
        return None  # hub ids and missing paths are not memoized
    if p.is_dir():
        return None
    return (str(p.resolve()), st.st_size, st.st_mtime_ns, *opts)


def _check(spath: str, text_field, messages_field, split) -> dict:
    src = _resolve(spath, split)
    if src.kind == "txt":
        if text_field is not None or messages_field is not None:
            raise _err(spath, None, "--text-field / --messages-field apply to JSONL and datasets; a .txt corpus is "
                                    "raw text: drop them")
        n = sum(1 for _ in _txt_documents(_lines(src.path, spath, src.gz), False))
        if n == 0:
            raise _err(spath, None, "no samples: the file holds no text (only blank lines or nothing); "
                                    "add documents to it")
        return {"source": "txt", "split": None, "records": n, "formats": {"txt": n}}
    parser = _JsonlParser(spath, None, text_field, messages_field)
    counts = {"lines": 0, "empty": 0}
    formats: dict[str, int] = {}
    for where, fmt, text, _ in _records(src, spath, parser, counts):
        _check_text(spath, where, text)
        formats[fmt] = formats.get(fmt, 0) + 1
    if not formats:  # decided here, before any tokenizer or model loads (load_corpus says the same later)
        raise _err(spath, None, f"no samples: {counts['lines']:,} lines, {counts['empty']:,} empty; "
                                "add samples with text in them")
    return {"source": src.kind, "split": src.split, "records": sum(formats.values()), "formats": formats}
