"""The records of a JSONL or dataset source, with the argument and cell checks shared by
:func:`kvcal.corpus.load_corpus` and :func:`kvcal.corpus.check_corpus`."""

from __future__ import annotations

import json
from collections.abc import Iterator

from kvcal.corpus.base import _EXAMPLE, MAX_LINE_BYTES, _err, _one_line
from kvcal.corpus.jsonl import _JsonlParser
from kvcal.corpus.sources import _cause, _datasets_offline, _lines, _Source
from kvcal.errors import CorpusError


def _check_args(spath: str, text_field, messages_field) -> None:
    for opt, v in (("--text-field", text_field), ("--messages-field", messages_field)):
        if v is not None and (not isinstance(v, str) or not v.strip()):
            raise _err(spath, None, f"{opt} {v!r} must be a non-empty field name")
    if text_field is not None and messages_field is not None:
        raise _err(spath, None, "--text-field and --messages-field both given; name the one field that holds the "
                                "samples")


def _records(src: _Source, spath: str, parser: _JsonlParser, counts: dict) -> Iterator[tuple[object, str, str, bool]]:
    """Yield ``(where, format, text, add_special_tokens)`` per record of a JSONL or dataset source
    (``where``: line number, or ``"row N"``). Counts ``lines`` and ``empty`` in ``counts``."""
    if src.rows is None:
        for lineno, text in _lines(src.path, spath, src.gz):
            counts["lines"] = lineno
            if not text.strip():
                counts["empty"] += 1
                continue
            try:
                rec = json.loads(text)
            except json.JSONDecodeError as e:
                raise _err(spath, lineno, f"invalid JSON ({e.msg} at column {e.colno}); each line must be "
                                          f"one JSON object, e.g. {_EXAMPLE}") from None
            except RecursionError:
                raise _err(spath, lineno, "invalid JSON (nested too deeply); each line must be one flat JSON "
                                          f"object, e.g. {_EXAMPLE}") from None
            except ValueError as e:
                raise _err(spath, lineno, f"invalid JSON ({_one_line(e, 80)}); each line must be one JSON "
                                          f"object, e.g. {_EXAMPLE}") from None
            yield (lineno, *parser.parse(lineno, rec))
        return
    fields = parser.sample_fields
    for n, row in _dataset_iter(src, spath):
        counts["lines"] = n
        where = f"row {n}"
        rec = _drop_nulls(row)
        _check_cell_sizes(spath, where, rec)
        if isinstance(row, dict) and not any(k in rec for k in fields):
            nulls = [k for k in fields if k in row]
            if nulls:
                raise _err(spath, where, f'"{nulls[0]}" is null; fill it or leave the row out')
        yield (where, *parser.parse(where, rec))


def _dataset_iter(src: _Source, spath: str) -> Iterator[tuple[int, dict]]:
    """``(row number, row)`` of a dataset source; a read error becomes a one-line CorpusError."""
    def fail(where, e):
        return _err(spath, where, f"cannot read as {src.kind} ({_cause(e)}); "
                                  "check that the file is a valid " + src.kind + " dataset")

    try:
        with _datasets_offline():
            it = iter(src.rows())
    except CorpusError:
        raise
    except Exception as e:
        raise fail(None, e) from None
    n = 0
    while True:
        try:
            with _datasets_offline():
                row = next(it)
        except StopIteration:
            return
        except Exception as e:
            raise fail(f"row {n + 1}" if n else None, e) from None
        n += 1
        yield n, row


def _check_cell_sizes(spath: str, where, x, field: str = "") -> None:
    """Refuse a dataset row holding a string over :data:`MAX_LINE_BYTES` (UTF-8), the limit a JSONL line
    has: a CSV / parquet cell is held to the same bound (CorpusError naming the row and field)."""
    if isinstance(x, str):
        if len(x) * 4 > MAX_LINE_BYTES and len(x.encode("utf-8", "surrogatepass")) > MAX_LINE_BYTES:
            raise _err(spath, where, f"field {field or '(value)'!r} is longer than the {MAX_LINE_BYTES >> 20} MiB limit "
                                     "per sample (the JSONL line limit); split the document into several rows")
    elif isinstance(x, dict):
        for k, v in x.items():
            _check_cell_sizes(spath, where, v, f"{field}.{k}" if field else str(k))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            _check_cell_sizes(spath, where, v, f"{field}[{i}]")


def _drop_nulls(x):
    """Dict keys whose value is ``None`` removed, recursively (Arrow schemas unified over rows
    give absent fields the value null)."""
    if isinstance(x, dict):
        return {k: _drop_nulls(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [_drop_nulls(v) for v in x]
    return x


def _check_text(spath: str, where, s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _err(spath, where, f"text holds an unpaired surrogate escape ({s[e.start]!r}); "
                                 "write the character itself or a valid \\uXXXX pair") from None
