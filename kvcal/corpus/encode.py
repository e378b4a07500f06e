"""Samples → token ids: the tokenizer wrapper that renders chat templates and cuts long texts
(:class:`_Encoder`), and the vocabulary bound every token id is checked against."""

from __future__ import annotations

from kvcal.corpus.base import _err
from kvcal.errors import CorpusError

# First try of the prefix-tokenization shortcut: this many characters per wanted token.
_CHARS_PER_TOKEN = 16
_CUT_MARGIN = 16  # tokens next to a character cut that may differ from the full tokenization


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
