"""Plain-text corpora: wikitext-style articles or blank-line separated documents, each bounded
by :data:`MAX_DOCUMENT_CHARS` (the windowing rules are in :mod:`kvcal.corpus`)."""

from __future__ import annotations

import gzip
import re
import zlib
from collections.abc import Iterator
from pathlib import Path

from kvcal.corpus.base import MAX_LINE_BYTES
from kvcal.corpus.sources import decompressed_limit

#: A ``.txt`` document is split (at a line boundary) once it holds this many characters.
MAX_DOCUMENT_CHARS = 8 * 1024 * 1024


# ----------------------------------------------------------------------------------------------
# txt documents

_TITLE = re.compile(r"^\s*= (?!=)(.*\S)? =\s*$")


def _is_title(line: str) -> bool:
    """A wikitext top-level heading `` = Title = `` (not `` = = Section = = ``)."""
    return bool(_TITLE.match(line)) and not line.strip().startswith("= =")


def _txt_documents(lines: Iterator[tuple[int, str]], titled: bool) -> Iterator[tuple[int, str]]:
    """Yield ``(first_line, document_text)``; see the module docstring for the rules."""
    buf: list[str] = []
    start = 0
    size = 0
    for lineno, text in lines:
        blank = not text.strip()
        boundary = _is_title(text) if titled else blank
        if boundary or size > MAX_DOCUMENT_CHARS:
            doc = "\n".join(buf).strip()
            if doc:
                yield start, doc
            buf, size = [], 0
        if not buf and blank:
            continue
        if not buf:
            start = lineno
        buf.append(text)
        size += len(text) + 1
    doc = "\n".join(buf).strip()
    if doc:
        yield start, doc


def _has_titles(p: Path, gz: bool) -> bool:
    limit = decompressed_limit(p) if gz else None
    try:
        f = gzip.open(p, "rb") if gz else open(p, "rb")
        with f:
            while raw := f.readline(MAX_LINE_BYTES + 1):
                if limit is not None and f.tell() > limit:
                    return False  # the reading pass refuses it
                if len(raw) < 512 and _is_title(raw.decode("utf-8", errors="replace").lstrip("\ufeff")):
                    return True
    except (OSError, EOFError, zlib.error):
        return False  # the parsing pass reports it with a line number
    return False


def txt_token_bound(path) -> int | None:
    """An upper bound on the tokens of a plain ``.txt`` corpus (not ``.gz``) tokenized at once without
    special tokens (how ``kvcal evaluate`` reads it), from its size alone: no tokenizer, no torch.

    Every token of a byte-level BPE (GPT-2 / Llama-3 / SmolLM) or byte-fallback SentencePiece
    (Llama-2) vocabulary covers at least one UTF-8 byte of the text, apart from at most one
    SentencePiece dummy-prefix token; the text is the file decoded with ``errors="replace"``, whose
    U+FFFD replacements are 3 bytes for each invalid byte. So ``tokens ≤ 3·size + 1``. Returns
    ``None`` for anything else (JSONL and datasets get chat templates and per-sample special tokens)."""
    p = Path(str(path)).expanduser()
    if p.suffix.lower() != ".txt" or not p.is_file():
        return None
    return 3 * p.stat().st_size + 1
