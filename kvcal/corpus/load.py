"""Reading a corpus into token ids: :func:`load_corpus` (seeded reservoir subset, truncation counts;
the formats and rules are described in :mod:`kvcal.corpus`)."""

from __future__ import annotations

import random

from kvcal.corpus.base import _err, _one_line
from kvcal.corpus.encode import _Encoder, check_text_ids, out_of_vocab_error, vocab_limit
from kvcal.corpus.jsonl import _JsonlParser
from kvcal.corpus.records import _check_args, _check_text, _records
from kvcal.corpus.shape import Corpus
from kvcal.corpus.sources import _lines, _resolve
from kvcal.corpus.txt import _has_titles, _txt_documents

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
