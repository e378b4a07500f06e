"""The evaluation token stream and its windows (one tokenization, one windowing path).

* :func:`tokenize_text`: a whole text tokenized at once, no special tokens (no BOS) — the protocol
  of the prior-art baselines (``shared/docs/prior-art.md``); int64 ``[n]``.
* :func:`corpus_stream`: a corpus file as one int64 stream ``[n]``: a ``.txt``/``.txt.gz`` through
  :func:`tokenize_text`, anything else :func:`kvcal.corpus.load_corpus` reads (JSONL, datasets;
  chat template applied) as its samples concatenated in file order.
* :func:`cut_windows`: consecutive, non-overlapping ``window``-token windows ``[k, window]`` of a
  stream, after ``skip`` windows (so calibration/probe and evaluation windows can be kept apart);
  a short stream gives fewer windows (``k`` may be 0), never a partial one.
* :func:`text_windows` = :func:`cut_windows` of :func:`tokenize_text`.
* :func:`served_bos`: the BOS id a tokenizer puts in front of every text it encodes (Gemma's), or
  ``None`` (SmolLM2's plain tokenizer adds none). Where there is one, :func:`cut_windows` ``bos=``
  starts every window with it, as the model is served: a window is BOS + ``window - 1`` stream tokens
  (position 0 is never predicted, so every window still predicts ``window - 1`` tokens). Without a BOS
  the windows are the prior-art protocol's, unchanged.
"""

from __future__ import annotations

import torch


def tokenize_text(tokenizer, text: str) -> torch.Tensor:
    """``text`` tokenized at once with ``add_special_tokens=False`` (no BOS): int64 ``[n]``."""
    return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]


def served_bos(tokenizer) -> int | None:
    """The BOS token id ``tokenizer`` adds in front of a plain text (``tokenizer("a")``, special tokens on, as a
    server encodes a prompt), or ``None`` when it adds none or has no BOS."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer("a").input_ids
    return int(bos) if len(ids) and int(ids[0]) == int(bos) else None


def cut_windows(ids: torch.Tensor, window: int, n: int, skip: int = 0, bos: int | None = None) -> torch.Tensor:
    """Consecutive ``window``-token windows of ``ids`` ``[L]``: a view ``[k, window]``,
    ``k = min(n, max(0, (L - skip·window) // window))``, starting at token ``skip·window``.

    ``bos``: a token id (:func:`served_bos`): each window is ``bos`` followed by ``window - 1`` consecutive
    stream tokens (a new ``[k, window]`` tensor; the stream is cut in steps of ``window - 1``, ``skip`` counts
    such windows)."""
    if bos is None:
        start = skip * window
        k = min(n, max(0, (ids.numel() - start) // window))
        return ids[start : start + k * window].view(k, window)
    step = window - 1
    if step < 1:
        raise ValueError(f"a window with a BOS needs at least 2 tokens, got {window}")
    start = skip * step
    k = min(n, max(0, (ids.numel() - start) // step))
    body = ids[start : start + k * step].view(k, step)
    return torch.cat([torch.full((k, 1), int(bos), dtype=ids.dtype), body], dim=1)


def text_windows(tokenizer, text: str, window: int, n_windows: int, skip_windows: int = 0) -> torch.Tensor:
    """Tokenize ``text`` at once (no BOS added) and cut consecutive ``window``-token windows.

    Returns int64 ``[n, window]`` with ``n <= n_windows`` (fewer if the text is short), starting
    after ``skip_windows`` windows (so calibration and evaluation windows can be kept apart).
    Matches the protocol of the baselines in ``shared/docs/prior-art.md``; the same windows as
    ``kvcal evaluate`` cuts from a ``.txt`` corpus holding ``text``.
    """
    return cut_windows(tokenize_text(tokenizer, text), window, n_windows, skip_windows)


def corpus_stream(path: str, tokenizer, text_field: str | None = None, messages_field: str | None = None,
                  split: str | None = None, vocab_size: int | None = None,
                  checked: bool = False) -> tuple[torch.Tensor, dict]:
    """The evaluation token stream: a ``.txt`` file tokenized at once (no BOS; the prior-art
    protocol), or any other corpus :func:`kvcal.corpus.load_corpus` reads (JSONL, datasets; chat
    template applied; ``text_field``/``messages_field``/``split`` as there), its samples
    concatenated in file order. Returns ``(ids int64 [n], info)`` with ``info = {"path", "sha256",
    "kind", "tokens"}``; ``info["kind"]`` is ``txt`` or the corpus source (``jsonl``, ``parquet``,
    ...); ``sha256`` of the file's bytes (``.txt``) or as the corpus loader records it. Invalid
    UTF-8 in a ``.txt`` is decoded with ``errors="replace"``. ``vocab_size``: the model's vocabulary
    size (default: the tokenizer's ``kvcal_vocab_size``, :func:`kvcal.corpus.vocab_limit`); a token id at or
    above it is refused naming its line. ``checked``: the caller's preflight has checked ``path`` with these
    options (:class:`kvcal.inputs.CorpusInput`); not checked again. Raises :class:`~kvcal.errors.KvcalError`."""
    import gzip
    import hashlib
    from pathlib import Path

    from kvcal.corpus import check_corpus, check_text_ids, load_corpus, vocab_limit

    p = Path(path)
    name = p.name.lower()
    if name.endswith((".txt", ".txt.gz")) and p.is_file():
        if not checked:  # refuses the options
            check_corpus(path, text_field=text_field, messages_field=messages_field, split=split)
        raw = p.read_bytes()
        sha = hashlib.sha256(raw).hexdigest()
        text = (gzip.decompress(raw) if name.endswith(".gz") else raw).decode("utf-8", errors="replace")
        ids = tokenize_text(tokenizer, text)
        check_text_ids(str(path), 1, text, ids, tokenizer, vocab_limit(tokenizer, vocab_size), False)
        kind = "txt"
    else:
        c = load_corpus(str(path), tokenizer, max_seq_len=1 << 20, text_field=text_field,
                        messages_field=messages_field, split=split, vocab_size=vocab_size)
        ids = torch.cat(c.samples) if c.samples else torch.zeros(0, dtype=torch.long)
        kind, sha = c.source, c.sha256
    return ids.long(), {"path": str(path), "sha256": sha, "kind": kind, "tokens": int(ids.numel())}
