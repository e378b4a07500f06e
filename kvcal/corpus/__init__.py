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

from kvcal.corpus.base import MAX_LINE_BYTES
from kvcal.corpus.check import check_corpus
from kvcal.corpus.encode import check_text_ids, out_of_vocab_error, vocab_limit
from kvcal.corpus.jsonl import ACCEPTED_FIELDS, CHAT_ROLES, JSONL_FORMATS
from kvcal.corpus.load import load_corpus
from kvcal.corpus.shape import Corpus, format_shape
from kvcal.corpus.sources import EXTENSIONS, MAX_DECOMPRESSED_BYTES, MAX_EXPANSION, TABLE_EXTENSIONS, sniff
from kvcal.corpus.txt import MAX_DOCUMENT_CHARS, txt_token_bound

__all__ = ["ACCEPTED_FIELDS", "CHAT_ROLES", "EXTENSIONS", "JSONL_FORMATS", "MAX_DECOMPRESSED_BYTES", "MAX_DOCUMENT_CHARS",
           "MAX_EXPANSION", "MAX_LINE_BYTES", "TABLE_EXTENSIONS", "Corpus", "check_corpus", "check_text_ids",
           "format_shape", "load_corpus", "out_of_vocab_error", "sniff", "txt_token_bound", "vocab_limit"]
