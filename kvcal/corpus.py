"""Calibration corpora: files → token-id sequences, and their deployment shape.

A corpus is what a server would see. :func:`load_corpus` reads one file, turns every sample into
the exact token ids the model would process (chat template applied where the sample is a chat),
and returns a :class:`Corpus` whose :meth:`Corpus.shape` (sample count, token count, length
percentiles in tokens, truncation count) is printed before calibrating (:func:`format_shape`).

Formats
-------
JSONL (``.jsonl``, ``.ndjson``, gzip-compressed ``.jsonl.gz``/``.ndjson.gz``), one JSON object per
line. The first matching key decides the format of a line; other keys (``question_id``,
``category``, ``task_id``, ...) are ignored.

============================  ==================  =====================================================
line                          format              token ids
============================  ==================  =====================================================
``{"messages": [{"role",     ``messages``        ``apply_chat_template(messages, tokenize=False)``, then
"content"}, ...]}``                               tokenized *without* adding special tokens again (the
                                                  template already holds them). A conversation that
                                                  ends with a non-assistant turn gets
                                                  ``add_generation_prompt=True`` (the sample ends where
                                                  the model starts answering); one that ends with an
                                                  assistant turn is rendered as is (the cache after
                                                  that reply was generated). Extra message keys
                                                  (``name``, ``tool_call_id``, ...) go to the template.
``{"turns": [str, ...]}``     ``turns``           user turns (MT-Bench style). The assistant replies
                                                  between them are not in the file; each renders as an
                                                  *empty* assistant message, so the template's role
                                                  markers are real but no reply text is invented (the
                                                  sample is a lower bound on the served length).
                                                  ``add_generation_prompt=True`` at the end.
``{"prompt", "completion"``   ``prompt_           with a chat template: ``[user: prompt, assistant:
| "response"}``               completion``        completion]`` rendered like ``messages``; without
                                                  one: ``prompt + completion`` concatenated as is
                                                  (no separator added) and tokenized with the
                                                  tokenizer's special tokens (e.g. BOS).
``{"prompt": str}``           ``prompt``          raw text, as ``/v1/completions`` receives it:
                                                  tokenized with special tokens, no chat template
                                                  (e.g. HumanEval code prompts).
``{"text": str}``             ``text``            raw text, tokenized with special tokens.
============================  ==================  =====================================================

Plain text (``.txt``, ``.txt.gz``), format ``txt``: if the file has wikitext-style top-level
headings (a line `` = Title = ``; `` = = Section = = `` is not top level), each heading starts a
new article that runs to the next heading (paragraphs are grouped into articles, the text kept
as in the file). Without such headings, blank lines separate documents. Each document is
tokenized whole (with special tokens) and cut into consecutive ``max_seq_len``-token windows; a
window is not a truncation, and the last, shorter window is kept when it has ``>= min_tokens``
tokens (otherwise counted in ``dropped_short``). A document that grows past
:data:`MAX_DOCUMENT_CHARS` is split there at a line boundary, which bounds memory.

A file with several JSONL formats has format ``mixed``.

Selection
---------
``max_samples=N`` with more eligible samples than N keeps a seeded uniform random subset of N
(reservoir sampling with ``random.Random(seed)``, so memory stays ``O(N)`` samples) and returns
it in file order: the subset is deployment-shaped (not biased to the start of the file), the
same ``seed`` and file give the same subset, and ``Corpus.available`` tells how many there were.

Bad input
---------
Every problem a user can cause raises :class:`kvcal.errors.CorpusError` with a one-line message
``path:line: what is wrong; how to fix`` (``path: ...`` for problems of the whole file). Empty
or whitespace-only lines are skipped and counted (``skipped_empty``); samples shorter than
``min_tokens`` are dropped and counted (``dropped_short``). A line over :data:`MAX_LINE_BYTES`
is refused before it is decoded or tokenized (nothing is read past that limit), so a 50 MB
line costs 8 MiB of memory, not a hang. Samples longer than ``max_seq_len`` keep their first
``max_seq_len`` tokens and are counted in ``truncated``, or raise under ``strict=True``.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvcal.errors import CorpusError

#: Longest accepted line, in bytes (8 MiB). Longer lines are refused with a CorpusError.
MAX_LINE_BYTES = 8 * 1024 * 1024
#: A ``.txt`` document is split (at a line boundary) once it holds this many characters.
MAX_DOCUMENT_CHARS = 8 * 1024 * 1024
#: JSONL formats, in the order their keys are looked for on a line.
#: Roles a ``messages`` record may use (OpenAI chat roles; Llama 3's ``ipython`` tool role).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")
JSONL_FORMATS = ("messages", "turns", "prompt_completion", "prompt", "text")
ACCEPTED_FIELDS = 'text, prompt, prompt + completion|response, messages, turns'
EXTENSIONS = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz", ".txt", ".txt.gz")

_EXAMPLE = '{"text": "..."}'
# First try of the prefix-tokenization shortcut: this many characters per wanted token.
_CHARS_PER_TOKEN = 16
_CUT_MARGIN = 16  # tokens next to a character cut that may differ from the full tokenization


@dataclass(frozen=True)
class Corpus:
    """Token sequences of one corpus file and how they were obtained.

    ``samples``: 1-D ``int64`` CPU tensors of token ids, ``min_tokens <= len <= max_seq_len``,
    in file order. ``sha256``: hex digest of the raw file bytes (compressed bytes for ``.gz``).
    ``format``: ``text | prompt | prompt_completion | messages | turns | txt | mixed``.
    ``truncated``: returned samples cut to ``max_seq_len`` tokens (``.txt`` windows are not
    truncations). ``skipped_empty``: empty/whitespace-only lines (``.txt``: blank lines are
    separators and are not counted). ``dropped_short``: samples or windows under ``min_tokens``.
    ``lines``: physical lines read. ``available``: eligible samples before ``max_samples``.
    """

    path: str
    sha256: str
    format: str
    samples: list[torch.Tensor]
    truncated: int
    skipped_empty: int
    dropped_short: int
    lines: int
    max_seq_len: int = 0
    min_tokens: int = 2
    available: int = 0
    seed: int = 0
    formats: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def lengths(self) -> list[int]:
        """Sample lengths in tokens, in sample order."""
        return [int(s.numel()) for s in self.samples]

    def shape(self) -> dict:
        """Deployment shape of the returned samples (all lengths in tokens).

        Keys: ``samples``, ``tokens`` (total), ``p50``/``p90``/``p99`` (``numpy.percentile``,
        linear interpolation, floats), ``max``, ``min``, ``mean``, ``truncated``, ``max_seq_len``,
        ``min_tokens``, ``format``, ``formats`` (samples per line format), ``available``,
        ``skipped_empty``, ``dropped_short``, ``lines``, ``path``, ``sha256``, ``seed``.
        Percentiles are 0 for a corpus without samples.
        """
        n = np.asarray(self.lengths, dtype=np.int64)
        has = n.size > 0
        pct = np.percentile(n, [50, 90, 99]) if has else np.zeros(3)
        return {
            "path": self.path,
            "sha256": self.sha256,
            "format": self.format,
            "formats": dict(self.formats),
            "samples": int(n.size),
            "available": int(self.available),
            "tokens": int(n.sum()),
            "p50": float(pct[0]),
            "p90": float(pct[1]),
            "p99": float(pct[2]),
            "max": int(n.max()) if has else 0,
            "min": int(n.min()) if has else 0,
            "mean": float(n.mean()) if has else 0.0,
            "truncated": int(self.truncated),
            "max_seq_len": int(self.max_seq_len),
            "min_tokens": int(self.min_tokens),
            "skipped_empty": int(self.skipped_empty),
            "dropped_short": int(self.dropped_short),
            "lines": int(self.lines),
            "seed": int(self.seed),
        }


def format_shape(shape: dict) -> str:
    """Multi-line human-readable summary of :meth:`Corpus.shape` (lengths in tokens).

    Missing keys (e.g. a shape read back from older artifact metadata) print as 0 / "?".
    """
    g = shape.get
    n = int(g("samples", 0))
    sel = ""
    if g("available", n) > n:
        sel = f" (seeded subset of {g('available'):,}, seed {g('seed', 0)})"
    fmt = str(g("format", "?"))
    if fmt == "mixed" and g("formats"):
        fmt += " (" + ", ".join(f"{k} {v}" for k, v in g("formats").items()) + ")"
    return "\n".join([
        f"corpus     {g('path', '?')}  [{fmt}]  sha256 {str(g('sha256', '?'))[:12]}",
        f"samples    {n:,}{sel}  from {g('lines', 0):,} lines; {g('skipped_empty', 0):,} empty lines "
        f"skipped, {g('dropped_short', 0):,} samples under {g('min_tokens', 2)} tokens dropped",
        f"tokens     {g('tokens', 0):,} total, mean {g('mean', 0.0):.1f} per sample",
        f"length     p50 {g('p50', 0):.0f}  p90 {g('p90', 0):.0f}  p99 {g('p99', 0):.0f}  "
        f"max {g('max', 0):,}  min {g('min', 0):,} tokens",
        f"truncated  {g('truncated', 0):,} of {n:,} samples cut to max_seq_len {g('max_seq_len', 0):,} tokens",
    ])


# ----------------------------------------------------------------------------------------------
# reading


def _err(path: str, line: int | None, msg: str) -> CorpusError:
    msg = " ".join(str(msg).split("\n"))
    return CorpusError(f"{path}:{line}: {msg}" if line is not None else f"{path}: {msg}")


def _one_line(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_path(path: str) -> tuple[Path, str]:
    p = Path(path).expanduser()
    name = p.name.lower()
    ext = next((e for e in sorted(EXTENSIONS, key=len, reverse=True) if name.endswith(e)), None)
    if not p.exists():
        raise _err(path, None, "no such file; pass an existing corpus file (.jsonl, .jsonl.gz or .txt)")
    if p.is_dir():
        raise _err(path, None, "is a directory; pass a corpus file (.jsonl, .jsonl.gz or .txt) inside it")
    if ext is None:
        hint = " (one JSON object per line? rename it to .jsonl)" if name.endswith(".json") else ""
        raise _err(path, None, f"unknown corpus extension {p.suffix or '(none)'!r}{hint}; "
                               f"use one of {', '.join(EXTENSIONS)}")
    return p, ext


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
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                raise _err(path, lineno, f"line is longer than the {MAX_LINE_BYTES >> 20} MiB limit per line; "
                                         "split it into several samples/lines (a .txt corpus is cut into "
                                         "windows); kvcal stops reading at the limit")
            raw = raw.rstrip(b"\n").rstrip(b"\r")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise _err(path, lineno, f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} "
                                         "of the line); re-encode the file as UTF-8, e.g. "
                                         "`iconv -f latin1 -t utf-8`") from None
            if lineno == 1 and text.startswith("\ufeff"):
                text = text[1:]
            yield lineno, text


# ----------------------------------------------------------------------------------------------
# tokenization


class _Encoder:
    """Tokenizes text to ids, at most ``max_seq_len`` of them, without tokenizing megabytes of
    text that would be cut anyway."""

    def __init__(self, tokenizer, max_seq_len: int):
        self.tok = tokenizer
        self.max_seq_len = max_seq_len

    def ids(self, text: str, special: bool) -> list[int]:
        return list(self.tok(text, add_special_tokens=special, verbose=False)["input_ids"])

    def head(self, text: str, special: bool) -> tuple[list[int], int, bool]:
        """First ``max_seq_len`` ids of ``text``, the token count (exact, or a lower bound when
        the text was only partly tokenized) and whether the count is exact.

        Long texts are tokenized on a character prefix that grows 4x until it yields more than
        ``max_seq_len + 16`` tokens; BPE is local, so those first ``max_seq_len`` ids equal the
        full tokenization's.
        """
        want = self.max_seq_len + _CUT_MARGIN
        cut = _CHARS_PER_TOKEN * want
        while cut < len(text):
            ids = self.ids(text[:cut], special)
            if len(ids) > want:
                return ids[: self.max_seq_len], len(ids) - _CUT_MARGIN, False
            cut *= 4
        ids = self.ids(text, special)
        return ids, len(ids), True


def _render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    out = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    if not isinstance(out, str):  # some versions may wrap a batch
        out = out[0] if isinstance(out, list | tuple) and out and isinstance(out[0], str) else str(out)
    return out


def _has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _type_name(x) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(x), type(x).__name__)


class _JsonlParser:
    """Validates one JSONL record and returns ``(format, text, add_special_tokens)``."""

    def __init__(self, path: str, tokenizer):
        self.path = path
        self.tok = tokenizer
        self.chat_ok = _has_chat_template(tokenizer)

    def _need_chat(self, lineno: int, fmt: str) -> None:
        if not self.chat_ok:
            name = getattr(self.tok, "name_or_path", "") or type(self.tok).__name__
            raise _err(self.path, lineno, f"a {fmt!r} sample needs a chat template, but the tokenizer "
                                          f"({name}) has none; use a chat/instruct model, or convert the "
                                          'corpus to {"text": ...} lines')

    def _str(self, lineno: int, rec: dict, key: str) -> str:
        v = rec[key]
        if not isinstance(v, str):
            raise _err(self.path, lineno, f'"{key}" must be a string, got {_type_name(v)}; '
                                          f'write it as {{"{key}": "..."}}')
        return v

    def _chat(self, lineno: int, messages: list[dict], agp: bool) -> str:
        try:
            return _render_chat(self.tok, messages, agp)
        except Exception as e:  # jinja errors, raise_exception() in templates, ...
            raise _err(self.path, lineno, f"the tokenizer's chat template rejected this conversation "
                                          f"({type(e).__name__}: {_one_line(e)}); fix the roles/order "
                                          "the template expects") from None

    def parse(self, lineno: int, rec) -> tuple[str, str, bool]:
        path = self.path
        if not isinstance(rec, dict):
            raise _err(path, lineno, f"expected a JSON object, got {_type_name(rec)}; write one object "
                                     f"per line, e.g. {_EXAMPLE}")
        present = [k for k in ("messages", "turns", "prompt", "text") if k in rec]
        if len(present) > 1:  # which one the service sees is ambiguous: refuse rather than drop one silently
            raise _err(path, lineno, f"the record has both {' and '.join(repr(k) for k in present[:2])}; "
                                     f"keep one sample field per line (use one of {ACCEPTED_FIELDS})")
        if "messages" in rec:
            return "messages", self._messages(lineno, rec["messages"]), False
        if "turns" in rec:
            return "turns", self._turns(lineno, rec["turns"]), False
        if "prompt" in rec:
            prompt = self._str(lineno, rec, "prompt")
            ckey = "completion" if "completion" in rec else "response" if "response" in rec else None
            if ckey is None:
                return "prompt", prompt, True
            completion = self._str(lineno, rec, ckey)
            if self.chat_ok:
                conv = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
                return "prompt_completion", self._chat(lineno, conv, False), False
            return "prompt_completion", prompt + completion, True
        if "text" in rec:
            return "text", self._str(lineno, rec, "text"), True
        keys = ", ".join(list(rec)[:8]) or "none"
        hint = ' ("completion"/"response" need a "prompt")' if ("completion" in rec or "response" in rec) else ""
        raise _err(path, lineno, f"no known field (keys: {_one_line(keys, 80)}){hint}; "
                                 f"use one of {ACCEPTED_FIELDS}")

    def _messages(self, lineno: int, messages) -> str:
        path = self.path
        if not isinstance(messages, list) or not messages:
            got = "an empty list" if isinstance(messages, list) else _type_name(messages)
            raise _err(path, lineno, f'"messages" must be a non-empty list of {{"role", "content"}} objects, '
                                     f'got {got}; write [{{"role": "user", "content": "..."}}, ...]')
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise _err(path, lineno, f"messages[{i}] must be an object, got {_type_name(m)}; write it as "
                                         '{"role": "user", "content": "..."}')
            for key in ("role", "content"):
                if key not in m:
                    raise _err(path, lineno, f'messages[{i}] has no "{key}"; every message needs '
                                             '"role" and "content" strings')
                if not isinstance(m[key], str):
                    fix = ('use "system", "user", "assistant" or "tool"' if key == "role"
                           else "flatten content parts into one string")
                    raise _err(path, lineno, f"messages[{i}].{key} must be a string, got {_type_name(m[key])}; {fix}")
            if m["role"] not in CHAT_ROLES:
                raise _err(path, lineno, f"messages[{i}].role {_one_line(m['role'], 40)!r} is not a chat role; "
                                         f"use one of {', '.join(CHAT_ROLES)}")
        self._need_chat(lineno, "messages")
        agp = messages[-1]["role"] != "assistant"
        return self._chat(lineno, messages, agp)

    def _turns(self, lineno: int, turns) -> str:
        path = self.path
        if not isinstance(turns, list) or not turns:
            got = "an empty list" if isinstance(turns, list) else _type_name(turns)
            raise _err(path, lineno, f'"turns" must be a non-empty list of user-turn strings, got {got}; '
                                     'use "messages" for role-tagged conversations')
        for i, t in enumerate(turns):
            if not isinstance(t, str):
                raise _err(path, lineno, f"turns[{i}] must be a string, got {_type_name(t)}; "
                                         '"turns" holds user turns only (use "messages" for roles)')
        self._need_chat(lineno, "turns")
        conv: list[dict] = []
        for i, t in enumerate(turns):
            if i:
                conv.append({"role": "assistant", "content": ""})
            conv.append({"role": "user", "content": t})
        return self._chat(lineno, conv, True)


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
    try:
        f = gzip.open(p, "rb") if gz else open(p, "rb")
        with f:
            while raw := f.readline(MAX_LINE_BYTES + 1):
                if len(raw) < 512 and _is_title(raw.decode("utf-8", errors="replace").lstrip("\ufeff")):
                    return True
    except (OSError, EOFError, zlib.error):
        return False  # the parsing pass reports it with a line number
    return False


# ----------------------------------------------------------------------------------------------
# loading


class _Reservoir:
    """Seeded uniform subset of at most ``k`` items from a stream (all if ``k`` is None)."""

    def __init__(self, k: int | None, seed: int):
        self.k = k
        self.rng = random.Random(seed)
        self.items: list = []
        self.seen = 0

    def add(self, item) -> None:
        self.seen += 1
        if self.k is None or len(self.items) < self.k:
            self.items.append(item)
            return
        j = self.rng.randrange(self.seen)
        if j < self.k:
            self.items[j] = item


def load_corpus(
    path,
    tokenizer,
    *,
    max_seq_len: int,
    max_samples: int | None = None,
    strict: bool = False,
    seed: int = 0,
    min_tokens: int = 2,
) -> Corpus:
    """Read a corpus file into token-id samples (see the module docstring for formats and rules).

    Args:
        path: ``.jsonl``/``.ndjson`` (optionally ``.gz``) or ``.txt``/``.txt.gz`` file.
        tokenizer: a transformers tokenizer (its chat template renders chat samples).
        max_seq_len: longest sample in tokens; longer samples keep their first ``max_seq_len``
            tokens (counted in ``truncated``); ``.txt`` documents are cut into windows this long.
        max_samples: keep a seeded random subset of this many samples, in file order.
        strict: raise instead of truncating a sample longer than ``max_seq_len``.
        seed: seed of the ``max_samples`` subset.
        min_tokens: shorter samples/windows are dropped and counted in ``dropped_short``.

    Returns:
        :class:`Corpus` with ``min_tokens <= len(sample) <= max_seq_len`` for every sample.

    Raises:
        CorpusError: one line ``path:line: what; how to fix`` for a missing file, a directory, an
            unknown extension, unreadable/corrupt gzip data, a line over :data:`MAX_LINE_BYTES`,
            non-UTF-8 bytes, invalid JSON, a non-object line, no known field, wrongly typed
            fields, a chat sample without a chat template, a rejected chat conversation, an
            over-long sample under ``strict``, bad arguments, or no samples left at all.
    """
    spath = str(path)
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 1:
        raise _err(spath, None, f"min_tokens={min_tokens!r} must be an integer >= 1 token")
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < min_tokens:
        raise _err(spath, None, f"max_seq_len={max_seq_len!r} must be an integer >= min_tokens={min_tokens} "
                                "tokens; pass a larger --max-seq-len")
    if max_samples is not None and (isinstance(max_samples, bool) or not isinstance(max_samples, int)
                                    or max_samples < 1):
        raise _err(spath, None, f"max_samples={max_samples!r} must be a positive integer or None")

    p, ext = _check_path(spath)
    sha = _sha256(p, spath)
    gz = ext.endswith(".gz")
    enc = _Encoder(tokenizer, max_seq_len)
    keep = _Reservoir(max_samples, seed)
    counts = {"lines": 0, "empty": 0, "short": 0, "docs": 0}
    seen_formats: set[str] = set()

    def offer(lineno: int, ids: list[int], truncated: bool, fmt: str) -> None:
        if len(ids) < min_tokens:
            counts["short"] += 1
            return
        keep.add((keep.seen, torch.tensor(ids, dtype=torch.int64), truncated, fmt))
        seen_formats.add(fmt)

    if ext.startswith((".txt",)):
        fmt = "txt"

        def counted(it):
            for lineno, text in it:
                counts["lines"] = lineno
                yield lineno, text

        docs = _txt_documents(counted(_lines(p, spath, gz)), _has_titles(p, gz))
        for start, doc in docs:
            counts["docs"] += 1
            try:
                ids = enc.ids(doc, True)
            except Exception as e:
                raise _err(spath, start, f"cannot tokenize the document starting here "
                                         f"({type(e).__name__}: {_one_line(e)})") from None
            for w in range(0, len(ids), max_seq_len):
                offer(start, ids[w: w + max_seq_len], False, "txt")
    else:
        parser = _JsonlParser(spath, tokenizer)
        for lineno, text in _lines(p, spath, gz):
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
            lfmt, s, special = parser.parse(lineno, rec)
            try:
                s.encode("utf-8")
            except UnicodeEncodeError as e:
                raise _err(spath, lineno, f"text holds an unpaired surrogate escape ({s[e.start]!r}); "
                                          "write the character itself or a valid \\uXXXX pair") from None
            try:
                ids, n_tokens, exact = enc.head(s, special)
            except Exception as e:
                raise _err(spath, lineno, f"cannot tokenize this sample ({type(e).__name__}: "
                                          f"{_one_line(e)})") from None
            cut = n_tokens > max_seq_len
            if cut and strict:
                n = n_tokens if exact else len(enc.ids(s, special))  # error path: count them all
                raise _err(spath, lineno, f"sample is {n:,} tokens, longer than max_seq_len={max_seq_len:,}; "
                                          "shorten it, raise --max-seq-len, or drop --strict to keep its "
                                          "first max_seq_len tokens")
            offer(lineno, ids[:max_seq_len], cut, lfmt)
        fmt = next(iter(seen_formats)) if len(seen_formats) == 1 else "mixed"

    chosen = sorted(keep.items, key=lambda it: it[0])  # back to file (and window) order
    formats: dict[str, int] = {}
    for *_, f in chosen:
        formats[f] = formats.get(f, 0) + 1
    if not chosen:
        if fmt == "txt":
            what = f"{counts['docs']:,} documents, {counts['short']:,} windows"
        else:
            what = f"{counts['empty']:,} empty, {counts['short']:,} samples"
        raise _err(spath, None, f"no samples: {counts['lines']:,} lines, {what} shorter than "
                                f"min_tokens={min_tokens} tokens; add samples with text in them")
    return Corpus(
        path=spath,
        sha256=sha,
        format=fmt,
        samples=[t for _, t, _, _ in chosen],
        truncated=sum(1 for _, _, c, _ in chosen if c),
        skipped_empty=counts["empty"],
        dropped_short=counts["short"],
        lines=counts["lines"],
        max_seq_len=max_seq_len,
        min_tokens=min_tokens,
        available=keep.seen,
        seed=seed,
        formats=formats,
    )
