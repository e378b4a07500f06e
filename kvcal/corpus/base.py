"""Limits and error helpers shared by the corpus readers (:mod:`kvcal.corpus`)."""

from __future__ import annotations

from kvcal.errors import CorpusError

#: Longest accepted line, in bytes (8 MiB). Longer lines are refused with a CorpusError.
MAX_LINE_BYTES = 8 * 1024 * 1024

_EXAMPLE = '{"text": "..."}'


# ----------------------------------------------------------------------------------------------
# reading


def _err(path: str, line: int | None, msg: str) -> CorpusError:
    msg = " ".join(str(msg).split("\n"))
    return CorpusError(f"{path}:{line}: {msg}" if line is not None else f"{path}: {msg}")


def _one_line(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
