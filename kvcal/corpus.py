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
tokenized whole (with special tokens) and cut into consecutive ``max_seq_len``-token windows (where the
tokenizer adds a BOS, e.g. Gemma's, every window starts with it, as the model is served: the first
window's own, then BOS + ``max_seq_len - 1`` tokens; SmolLM2's adds none, its windows are unchanged); a
window is not a truncation, and the last, shorter window is kept when it has ``>= min_tokens``
tokens (otherwise counted in ``dropped_short``). A document that grows past
:data:`MAX_DOCUMENT_CHARS` is split there at a line boundary, which bounds memory.

A file with several JSONL formats has format ``mixed``.

Chat records in the OpenAI format are accepted as served: a message ``content`` may be a list
of content parts (``[{"type": "text", "text": ...}, {"type": "image_url", ...}]``); the text
parts are joined with ``"\n"`` (as vLLM's OpenAI server does, ``vllm/entrypoints/chat_utils.py``)
and every other part (images, audio, files) is dropped and counted per type in the corpus
report (``dropped_parts``). An assistant turn with ``tool_calls`` may have ``content: null``
(rendered as ``""`` with its ``tool_calls`` passed to the chat template); such turns are
counted (``tool_call_turns``), and the report says when the chat template does not render
``tool_calls`` at all (their arguments are then not in the samples).

Datasets (through the ``datasets`` library, no parser of kvcal's own)
--------------------------------------------------------------------
``.parquet``, ``.arrow``, ``.csv`` and ``.json`` (a JSON array of objects, or JSON lines) files,
a directory written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (or a directory
of such data files), and a Hugging Face hub dataset id (``owner/name`` or ``owner/name:config``)
that is already in the local cache (the hub cache or the ``datasets`` cache; nothing is ever
downloaded: both libraries run offline while the corpus loads). Every row is a record with the
same field detection as a JSONL line; errors name ``path:row N``. Columns that a row leaves
empty (``null``, e.g. from a schema unified over rows) count as absent. ``split`` chooses the
split of a dataset with several (default ``train``, or the only one). ``text_field`` /
``messages_field`` (``--text-field`` / ``--messages-field``, also for JSONL) name the column
that holds the raw text / the conversation when it is not called ``text`` / ``messages``.

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
import shlex
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvcal.errors import CorpusError

if TYPE_CHECKING:
    import torch  # imported where samples are built: check_corpus runs before torch is imported

#: Longest accepted line, in bytes (8 MiB). Longer lines are refused with a CorpusError.
MAX_LINE_BYTES = 8 * 1024 * 1024
#: A compressed corpus (``.jsonl.gz``, ``.txt.gz``) is read up to this many decompressed bytes, or 32 times its
#: own size when that is more (:data:`MAX_EXPANSION`): the work a small file can cause stays bounded (a 20 MB
#: ``.gz`` that expands to 3 GB was parsed for minutes). kvcal reads at most ``--max-samples`` samples of it.
MAX_DECOMPRESSED_BYTES = 256 * 1024 * 1024
#: A compressed corpus may expand to this many times its size beyond :data:`MAX_DECOMPRESSED_BYTES`.
MAX_EXPANSION = 32
#: A ``.txt`` document is split (at a line boundary) once it holds this many characters.
MAX_DOCUMENT_CHARS = 8 * 1024 * 1024
#: JSONL formats, in the order their keys are looked for on a line.
#: Roles a ``messages`` record may use (OpenAI chat roles; Llama 3's ``ipython`` tool role).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")
JSONL_FORMATS = ("messages", "turns", "prompt_completion", "prompt", "text")
ACCEPTED_FIELDS = 'text, prompt, prompt + completion|response, messages, turns'
#: Single-file datasets read by the ``datasets`` packaged builder of the same name.
TABLE_EXTENSIONS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".json": "json"}
EXTENSIONS = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz", ".txt", ".txt.gz", *TABLE_EXTENSIONS)
#: A hub dataset id, optionally with a config name: ``owner/name``, ``name``, ``owner/name:config``.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?(:[\w.-]+)?$")

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
    ``lines``: physical lines (rows, for a dataset) read. ``available``: eligible samples before
    ``max_samples``. ``source``: ``jsonl | txt | parquet | arrow | csv | json | save_to_disk |
    data_dir | hub``; ``split``: the dataset split read (``None`` for files without splits).
    ``dropped_parts``: non-text chat content parts dropped, per part type, over all rows read;
    ``tool_call_turns``: assistant turns with ``tool_calls``; ``tool_calls_rendered``: whether
    the chat template mentions ``tool_calls`` at all.
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
    source: str = "jsonl"
    split: str | None = None
    dropped_parts: dict[str, int] = field(default_factory=dict)
    tool_call_turns: int = 0
    tool_calls_rendered: bool = True

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
        ``skipped_empty``, ``dropped_short``, ``lines``, ``path``, ``sha256``, ``seed``,
        ``source``, ``split``, ``dropped_parts``, ``tool_call_turns``, ``tool_calls_rendered``.
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
            "source": self.source,
            "split": self.split,
            "dropped_parts": dict(self.dropped_parts),
            "tool_call_turns": int(self.tool_call_turns),
            "tool_calls_rendered": bool(self.tool_calls_rendered),
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
    src = g("source")  # absent in shapes recorded before datasets sources: say nothing about it
    table = src not in (None, "jsonl", "txt")
    where = (f"; {src}" if src else "") + (f", split {g('split')}" if g("split") else "")
    lines = [
        f"corpus     {g('path', '?')}  [{fmt}{where}]  sha256 {str(g('sha256', '?'))[:12]}",
        f"samples    {n:,}{sel}  from {g('lines', 0):,} {'rows' if table else 'lines'}; {g('skipped_empty', 0):,} "
        f"empty lines skipped, {g('dropped_short', 0):,} samples under {g('min_tokens', 2)} tokens dropped",
        f"tokens     {g('tokens', 0):,} total, mean {g('mean', 0.0):.1f} per sample",
        f"length     p50 {g('p50', 0):.0f}  p90 {g('p90', 0):.0f}  p99 {g('p99', 0):.0f}  "
        f"max {g('max', 0):,}  min {g('min', 0):,} tokens",
        f"truncated  {g('truncated', 0):,} of {n:,} samples cut to max_seq_len {g('max_seq_len', 0):,} tokens",
    ]
    if g("dropped_parts"):
        parts = ", ".join(f"{v:,} {k}" for k, v in g("dropped_parts").items())
        lines.append(f"dropped    {parts} chat content part(s): not text, not in the samples (text parts kept)")
    if g("tool_call_turns"):
        note = ("rendered by the chat template" if g("tool_calls_rendered", True) else
                "the chat template does not render tool_calls: their arguments are not in the samples")
        lines.append(f"tool calls {g('tool_call_turns'):,} assistant turns with tool_calls ({note})")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# reading


def _err(path: str, line: int | None, msg: str) -> CorpusError:
    msg = " ".join(str(msg).split("\n"))
    return CorpusError(f"{path}:{line}: {msg}" if line is not None else f"{path}: {msg}")


def vocab_limit(tokenizer, vocab_size: int | None = None) -> int | None:
    """The model vocabulary size token ids are checked against: ``vocab_size`` when given, else the
    ``kvcal_vocab_size`` that :func:`kvcal.models.load_tokenizer` sets (the model config's ``vocab_size``);
    ``None``: not checked."""
    return vocab_size if vocab_size is not None else getattr(tokenizer, "kvcal_vocab_size", None)


def out_of_vocab_error(path: str, where, token_id: int, vocab_size: int) -> CorpusError:
    """The one-line :class:`CorpusError` for a token id the model's embedding has no row for (``where``: the
    line or ``"row N"``; ``None``: the file as a whole)."""
    return _err(path, where, f"token id {token_id} is outside the model's vocabulary (vocab_size "
                             f"{vocab_size}): the tokenizer is not this model's; use the model's own tokenizer "
                             "(copy its tokenizer.json and tokenizer_config.json into the model directory)")


def check_text_ids(path: str, first_line: int, text: str, ids, tokenizer, limit: int | None,
                   special: bool) -> None:
    """Refuse token ids ``ids`` (a list or int64 tensor ``[n]``: ``text`` tokenized with
    ``add_special_tokens=special``; ``text`` starts at line ``first_line`` of ``path``) at or above ``limit``,
    naming the line where the first such token starts (from the tokenizer's character offsets; the text's
    first line without them). Raises :func:`out_of_vocab_error`; nothing when ``limit`` is ``None``."""
    if limit is None:
        return
    if hasattr(ids, "numel"):  # an int64 tensor [n]
        if ids.numel() == 0 or int(ids.max()) < limit:
            return
        i = int((ids >= limit).nonzero()[0, 0])
    else:  # a list of ids
        if not ids or max(ids) < limit:
            return
        i = next(j for j, t in enumerate(ids) if t >= limit)
    line = first_line
    try:
        start = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)["offset_mapping"][i][0]
        line += text.count("\n", 0, start)
    except Exception:  # a slow tokenizer has no offsets: the text's first line
        pass
    raise out_of_vocab_error(path, line, int(ids[i]), limit)


def _one_line(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
    """Validates one JSONL record / dataset row and returns ``(format, text, add_special_tokens)``.

    ``tokenizer=None``: validation only (:func:`check_corpus`): chat samples are not rendered and
    come back as ``""``. ``text_field`` / ``messages_field``: the record's key holding the raw
    text / the conversation (then no other field is looked at). Counts non-text content parts
    dropped (``dropped``, per type) and assistant turns with ``tool_calls`` (``tool_call_turns``).
    """

    def __init__(self, path: str, tokenizer, text_field: str | None = None, messages_field: str | None = None):
        self.path = path
        self.tok = tokenizer
        self.chat_ok = tokenizer is None or _has_chat_template(tokenizer)
        self.mapped = ((text_field, "text", "--text-field") if text_field is not None else
                       (messages_field, "messages", "--messages-field") if messages_field is not None else None)
        self.dropped: dict[str, int] = {}
        self.tool_call_turns = 0

    @property
    def sample_fields(self) -> tuple[str, ...]:
        """Record keys that can hold a sample (for the null check of dataset rows)."""
        return (self.mapped[0],) if self.mapped else ("messages", "turns", "prompt", "text")

    def _need_chat(self, lineno: int, fmt: str) -> None:
        if not self.chat_ok:
            name = getattr(self.tok, "name_or_path", "") or type(self.tok).__name__
            raise _err(self.path, lineno, f"a {fmt!r} sample needs a chat template, but the tokenizer "
                                          f"({name}) has none; use a chat/instruct model, or convert the "
                                          'corpus to {"text": ...} lines')

    def _str(self, lineno: int, rec: dict, key: str) -> str:
        v = rec[key]
        if not isinstance(v, str):
            if self.mapped is not None and key == self.mapped[1]:  # the user's field, not kvcal's internal name
                field, _, option = self.mapped
                raise _err(self.path, lineno, f"{field!r} ({option} {field}) must hold a string, got {_type_name(v)}; "
                                              f"pass the name of the field that holds the {key}")
            raise _err(self.path, lineno, f'"{key}" must be a string, got {_type_name(v)}; '
                                          f'write it as {{"{key}": "..."}}')
        return v

    def _chat(self, lineno: int, messages: list[dict], agp: bool) -> str:
        if self.tok is None:  # validation only
            return ""
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
        if self.mapped is not None:
            key, target, option = self.mapped
            if key not in rec:
                keys = ", ".join(str(k) for k in list(rec)[:8]) or "none"
                raise _err(path, lineno, f"no {key!r} field ({option}; keys: {_one_line(keys, 80)}); pass the "
                                         f"name of the field that holds the {target}")
            rec = {target: rec[key]}
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
        known = ("text", "prompt", "messages", "turns")
        for k in rec:
            if not isinstance(k, str):
                continue
            for sep, name in ((";", "semicolon"), ("\t", "tab"), ("|", "pipe")):
                if sep in k and any(part.strip().lower() in known for part in k.split(sep)):
                    raise _err(path, lineno, f"the column name {k!r} holds {name}s: a {name}-separated file read as "
                                             "comma-separated CSV (kvcal reads commas only); save it with commas "
                                             "(quoting text that holds commas), or as JSON lines (.jsonl)")
            if k.strip().lower() in known and k not in known:  # "Text", " text": names are exact
                flag = "--messages-field" if k.strip().lower() in ("messages", "turns") else "--text-field"
                raise _err(path, lineno, f"no known field (keys: {_one_line(keys, 80)}): field names are exact, "
                                         f"{k!r} is not {k.strip().lower()!r}; pass {flag} {shlex.quote(k)} or "
                                         "rename it")
        raise _err(path, lineno, f"no known field (keys: {_one_line(keys, 80)}){hint}; "
                                 f"use one of {ACCEPTED_FIELDS}")

    def _messages(self, lineno: int, messages) -> str:
        path = self.path
        if not isinstance(messages, list) or not messages:
            got = "an empty list" if isinstance(messages, list) else _type_name(messages)
            raise _err(path, lineno, f'"messages" must be a non-empty list of {{"role", "content"}} objects, '
                                     f'got {got}; write [{{"role": "user", "content": "..."}}, ...]')
        conv = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise _err(path, lineno, f"messages[{i}] must be an object, got {_type_name(m)}; write it as "
                                         '{"role": "user", "content": "..."}')
            if "role" not in m:
                raise _err(path, lineno, f'messages[{i}] has no "role"; every message needs "role" and "content"')
            if not isinstance(m["role"], str):
                raise _err(path, lineno, f"messages[{i}].role must be a string, got {_type_name(m['role'])}; "
                                         'use "system", "user", "assistant" or "tool"')
            if m["role"] not in CHAT_ROLES:
                raise _err(path, lineno, f"messages[{i}].role {_one_line(m['role'], 40)!r} is not a chat role; "
                                         f"use one of {', '.join(CHAT_ROLES)}")
            calls = m.get("tool_calls")
            if calls is not None and not isinstance(calls, list):
                raise _err(path, lineno, f"messages[{i}].tool_calls must be a list, got {_type_name(calls)}; write "
                                         '[{"type": "function", "function": {"name": ..., "arguments": ...}}]')
            content = m.get("content")
            if content is None:
                if not (m["role"] == "assistant" and calls):
                    what = ' has no "content"' if "content" not in m else ".content is null"
                    raise _err(path, lineno, f"messages[{i}]{what}"
                                             '; every message needs "role" and "content" (null only for an '
                                             'assistant turn with "tool_calls")')
                content = ""
            elif isinstance(content, list):
                content = self._parts(lineno, i, content)
            elif not isinstance(content, str):
                raise _err(path, lineno, f"messages[{i}].content must be a string or a list of content parts, got "
                                         f'{_type_name(content)}; write "..." or [{{"type": "text", "text": "..."}}]')
            if calls:
                self.tool_call_turns += 1
            conv.append({**m, "content": content})
        self._need_chat(lineno, "messages")
        agp = conv[-1]["role"] != "assistant"
        return self._chat(lineno, conv, agp)

    def _parts(self, lineno, i: int, parts: list) -> str:
        """OpenAI content parts → the text parts joined with ``"\\n"`` (vLLM's join); every other
        part type is dropped and counted in ``self.dropped``."""
        texts = []
        for j, part in enumerate(parts):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                got = _type_name(part) if not isinstance(part, dict) else "an object without a string \"type\""
                raise _err(self.path, lineno, f"messages[{i}].content[{j}] must be a content part with a \"type\", "
                                              f'got {got}; write {{"type": "text", "text": "..."}}')
            if part["type"] == "text":
                if not isinstance(part.get("text"), str):
                    raise _err(self.path, lineno, f"messages[{i}].content[{j}].text must be a string, got "
                                                  f'{_type_name(part.get("text"))}; write {{"type": "text", "text": "..."}}')
                texts.append(part["text"])
            else:
                kind = _one_line(part["type"], 40)
                self.dropped[kind] = self.dropped.get(kind, 0) + 1
        return "\n".join(texts)

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


#: check_corpus results of this process, keyed by path, options and the file's size and mtime: the CLI
#: checks a corpus before importing torch and the API checks it again; the second check is free.
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


def load_corpus(
    path,
    tokenizer,
    *,
    max_seq_len: int,
    max_samples: int | None = None,
    strict: bool = False,
    seed: int = 0,
    min_tokens: int = 2,
    text_field: str | None = None,
    messages_field: str | None = None,
    split: str | None = None,
    vocab_size: int | None = None,
) -> Corpus:
    """Read a corpus into token-id samples (see the module docstring for formats and rules).

    Args:
        path: ``.jsonl``/``.ndjson`` (optionally ``.gz``), ``.txt``/``.txt.gz``, ``.parquet``,
            ``.arrow``, ``.csv``, ``.json`` file, a ``save_to_disk`` directory or a hub dataset id
            in the local cache.
        tokenizer: a transformers tokenizer (its chat template renders chat samples).
        max_seq_len: longest sample in tokens; longer samples keep their first ``max_seq_len``
            tokens (counted in ``truncated``); ``.txt`` documents are cut into windows this long.
        max_samples: keep a seeded random subset of this many samples, in file order.
        strict: raise instead of truncating a sample longer than ``max_seq_len``.
        seed: seed of the ``max_samples`` subset.
        min_tokens: shorter samples/windows are dropped and counted in ``dropped_short``.
        text_field / messages_field: the record field holding the raw text / the conversation
            (default: detected from ``text``, ``prompt``, ``messages``, ``turns``).
        split: dataset split (datasets with several; default ``train`` or the only one).
        vocab_size: the model's vocabulary size; a sample holding a token id at or above it is refused
            (default: the tokenizer's ``kvcal_vocab_size``, see :func:`vocab_limit`).

    Returns:
        :class:`Corpus` with ``min_tokens <= len(sample) <= max_seq_len`` for every sample.

    Raises:
        CorpusError: one line ``path:line: what; how to fix`` (``path:row N:`` for datasets) for a
            missing file, an unknown extension, a hub id not in the local cache, a missing split,
            unreadable/corrupt data, a line over :data:`MAX_LINE_BYTES`, non-UTF-8 bytes, invalid
            JSON, a non-object record, no known (or mapped) field, wrongly typed fields, a chat
            sample without a chat template, a rejected chat conversation, an over-long sample
            under ``strict``, a token id outside the model's vocabulary (the tokenizer is not the
            model's), bad arguments, or no samples left at all.
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
    _check_args(spath, text_field, messages_field)

    src = _resolve(spath, split)
    if src.kind == "txt" and (text_field is not None or messages_field is not None):
        raise _err(spath, None, "--text-field / --messages-field apply to JSONL and datasets; a .txt corpus is "
                                "raw text: drop them")
    sha = src.sha256()
    p, gz = src.path, src.gz
    enc = _Encoder(tokenizer, max_seq_len)
    keep = _Reservoir(max_samples, seed)
    counts = {"lines": 0, "empty": 0, "short": 0, "docs": 0}
    seen_formats: set[str] = set()
    parser = None

    import torch

    limit = vocab_limit(tokenizer, vocab_size)

    def offer(lineno, ids: list[int], truncated: bool, fmt: str) -> None:
        if len(ids) < min_tokens:
            counts["short"] += 1
            return
        if limit is not None and max(ids) >= limit:  # would index past the model's embedding
            raise out_of_vocab_error(spath, lineno, next(t for t in ids if t >= limit), limit)
        keep.add((keep.seen, torch.tensor(ids, dtype=torch.int64), truncated, fmt))
        seen_formats.add(fmt)

    if src.kind == "txt":
        fmt = "txt"

        def counted(it):
            for lineno, text in it:
                counts["lines"] = lineno
                yield lineno, text

        docs = _txt_documents(counted(_lines(p, spath, gz)), _has_titles(p, gz))
        bos = getattr(tokenizer, "bos_token_id", None)  # the BOS the tokenizer adds to every text, if any
        bos = bos if bos is not None and enc.ids("a", True)[:1] == [bos] else None
        for start, doc in docs:
            counts["docs"] += 1
            try:
                ids = enc.ids(doc, True)
            except Exception as e:
                raise _err(spath, start, f"cannot tokenize the document starting here "
                                         f"({type(e).__name__}: {_one_line(e)})") from None
            check_text_ids(spath, start, doc, ids, tokenizer, limit, True)  # the document keeps its line breaks
            if bos is None or max_seq_len < 2:
                for w in range(0, len(ids), max_seq_len):
                    offer(start, ids[w: w + max_seq_len], False, "txt")
            else:  # every window starts with the BOS the tokenizer put in front of the document, as served
                offer(start, ids[:max_seq_len], False, "txt")
                for w in range(max_seq_len, len(ids), max_seq_len - 1):
                    offer(start, [bos, *ids[w: w + max_seq_len - 1]], False, "txt")
    else:
        parser = _JsonlParser(spath, tokenizer, text_field, messages_field)
        for lineno, lfmt, s, special in _records(src, spath, parser, counts):
            _check_text(spath, lineno, s)
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
        unit = "lines" if src.kind in ("txt", "jsonl") else "rows"
        raise _err(spath, None, f"no samples: {counts['lines']:,} {unit}, {what} shorter than "
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
        source=src.kind,
        split=src.split,
        dropped_parts=dict(parser.dropped) if parser else {},
        tool_call_turns=parser.tool_call_turns if parser else 0,
        tool_calls_rendered="tool_calls" in str(getattr(tokenizer, "chat_template", None) or ""),
    )
