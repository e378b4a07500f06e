"""Corpus formats → token ids, deployment shape, and hostile input (kvcal.corpus)."""

from __future__ import annotations

import copy
import gzip
import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kvcal.corpus import MAX_LINE_BYTES, Corpus, format_shape, load_corpus
from kvcal.errors import CorpusError

CHAT = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is a KV cache?"},
    {"role": "assistant", "content": "It stores keys and values of past tokens so they are not recomputed."},
    {"role": "user", "content": "Why quantize it?"},
]


@pytest.fixture(scope="module")
def tok(smollm_tokenizer):
    return smollm_tokenizer


@pytest.fixture(scope="module")
def plain_tok(smollm_tokenizer):
    t = copy.deepcopy(smollm_tokenizer)
    t.chat_template = None
    return t


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return path


def enc(tok, text: str, special: bool = True) -> list[int]:
    return tok(text, add_special_tokens=special)["input_ids"]


def chat_ids(tok, messages, agp: bool) -> list[int]:
    s = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=agp)
    return enc(tok, s, special=False)


def ids(c: Corpus) -> list[list[int]]:
    return [s.tolist() for s in c.samples]


# ---------------------------------------------------------------------------------------------- formats


def test_each_jsonl_format_gives_independent_token_ids(tok, tmp_path):
    """Each JSONL record kind (text, prompt, prompt/completion, prompt/response, messages ending with a user
    or assistant turn, turns) gives exactly the ids of an independent encode or apply_chat_template call
    (generation prompt only after a user turn), and the mixed file's counts are recorded."""
    recs = [
        {"text": "The quick brown fox jumps over the lazy dog.", "id": 7},
        {"prompt": "def add(a, b):\n", "task_id": "x/1"},
        {"prompt": "Translate 'cat' to French.", "completion": "chat"},
        {"prompt": "Name a prime.", "response": "Seven."},
        {"messages": CHAT},
        {"messages": CHAT[:3]},
        {"turns": ["Write a haiku about rain.", "Now make it about snow."], "question_id": 1},
    ]
    c = load_corpus(write_jsonl(tmp_path / "m.jsonl", recs), tok, max_seq_len=4096)
    want = [
        enc(tok, recs[0]["text"]),
        enc(tok, recs[1]["prompt"]),
        chat_ids(tok, [{"role": "user", "content": "Translate 'cat' to French."},
                       {"role": "assistant", "content": "chat"}], False),
        chat_ids(tok, [{"role": "user", "content": "Name a prime."},
                       {"role": "assistant", "content": "Seven."}], False),
        chat_ids(tok, CHAT, True),  # ends with a user turn: generation prompt
        chat_ids(tok, CHAT[:3], False),  # ends with the assistant: as is
        chat_ids(tok, [{"role": "user", "content": "Write a haiku about rain."},
                       {"role": "assistant", "content": ""},
                       {"role": "user", "content": "Now make it about snow."}], True),
    ]
    assert ids(c) == want
    assert all(s.dtype == torch.int64 and s.dim() == 1 for s in c.samples)
    assert c.format == "mixed"
    assert c.formats == {"text": 1, "prompt": 1, "prompt_completion": 2, "messages": 2, "turns": 1}
    assert (c.truncated, c.skipped_empty, c.dropped_short, c.lines, c.available) == (0, 0, 0, 7, 7)
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert want[4][0] == im_start and tok.decode(want[4]).endswith("<|im_start|>assistant\n")
    assert tok.decode(want[5]).endswith("<|im_end|>\n")


@pytest.mark.parametrize("fmt", ["text", "prompt", "prompt_completion", "messages", "turns"])
def test_single_format_files_report_their_format(tok, tmp_path, fmt):
    """A file whose records are all of one kind reports that format and its 2 samples."""
    rec = {
        "text": {"text": "hello there world"},
        "prompt": {"prompt": "hello there world"},
        "prompt_completion": {"prompt": "hi", "completion": " there"},
        "messages": {"messages": CHAT},
        "turns": {"turns": ["hi", "and?"]},
    }[fmt]
    c = load_corpus(write_jsonl(tmp_path / "a.jsonl", [rec, rec]), tok, max_seq_len=512)
    assert c.format == fmt and len(c) == 2
    # each sample is exactly the ids of an independent encode / apply_chat_template call (as in the mixed file)
    want = {
        "text": lambda: enc(tok, rec["text"]),
        "prompt": lambda: enc(tok, rec["prompt"]),
        "prompt_completion": lambda: chat_ids(tok, [{"role": "user", "content": "hi"},
                                                    {"role": "assistant", "content": " there"}], False),
        "messages": lambda: chat_ids(tok, CHAT, True),
        "turns": lambda: chat_ids(tok, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""},
                                        {"role": "user", "content": "and?"}], True),
    }[fmt]()
    assert ids(c) == [want, want]


def test_prompt_completion_without_chat_template_concatenates(plain_tok, tmp_path):
    """With a tokenizer without a chat template, prompt/completion records encode as the plain concatenation
    of the two strings."""
    c = load_corpus(write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "def f(x):\n", "completion": "    return x\n"}]),
                    plain_tok, max_seq_len=512)
    assert ids(c) == [enc(plain_tok, "def f(x):\n    return x\n")]


def test_mt_bench_turns_chat_template(tok, shared_data):
    """The 80 MT-Bench questions load as turns without truncation; the first sample starts with <|im_start|>
    and equals apply_chat_template of its two turns with an empty assistant reply between, and the corpus hash
    is the file's known sha256."""
    c = load_corpus(shared_data / "mt_bench_questions.jsonl", tok, max_seq_len=2048)
    assert len(c) == 80 and c.format == "turns" and c.truncated == 0
    first = json.loads((shared_data / "mt_bench_questions.jsonl").read_text().splitlines()[0])
    assert c.samples[0][0].item() == 1 == tok.convert_tokens_to_ids("<|im_start|>")
    conv = [{"role": "user", "content": first["turns"][0]}, {"role": "assistant", "content": ""},
            {"role": "user", "content": first["turns"][1]}]
    assert c.samples[0].tolist() == chat_ids(tok, conv, True)
    assert c.sha256 == "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7"


def test_humaneval_gz_prompts(tok, shared_data):
    """The gzipped HumanEval file loads as 164 prompt samples, the first equal to an independent encode of its
    prompt."""
    c = load_corpus(shared_data / "humaneval.jsonl.gz", tok, max_seq_len=2048)
    assert len(c) == 164 and c.format == "prompt"
    first = json.loads(gzip.open(shared_data / "humaneval.jsonl.gz", "rt").readline())
    assert c.samples[0].tolist() == enc(tok, first["prompt"])


# ---------------------------------------------------------------------------------------------- txt


def test_txt_articles_and_windows(tok, tmp_path):
    """A .txt corpus splits at level-1 = Title = headings (subheadings stay inside) and cuts each article into
    128-token windows equal to slices of an independent encode, with line count recorded."""
    body1 = " ".join(f"word{i}" for i in range(300))
    text = (" = Alpha = \n \n First paragraph of alpha . \n \n = = Part = = \n \n " + body1 + " \n \n"
            " = Beta = \n \n Beta is short . \n")
    p = tmp_path / "w.txt"
    p.write_text(text, encoding="utf-8")
    c = load_corpus(p, tok, max_seq_len=128, min_tokens=2)
    alpha = " = Alpha = \n \n First paragraph of alpha . \n \n = = Part = = \n \n " + body1
    beta = " = Beta = \n \n Beta is short ."
    a_ids, b_ids = enc(tok, alpha.strip()), enc(tok, beta.strip())
    want = [a_ids[i:i + 128] for i in range(0, len(a_ids), 128)] + [b_ids]
    want = [w for w in want if len(w) >= 2]
    assert ids(c) == want
    assert c.format == "txt" and c.truncated == 0 and c.lines == text.count("\n")
    assert all(len(w) == 128 for w in want[:-2])


def test_txt_without_headings_splits_on_blank_lines(tok, tmp_path):
    """A .txt without headings splits at blank (or whitespace-only) lines into paragraphs encoded
    independently, and a one-token paragraph is dropped and counted below min_tokens=2."""
    p = tmp_path / "plain.txt"
    p.write_text("Para one line a.\nline b.\n\n\nPara two.\n   \nx\n", encoding="utf-8")
    c = load_corpus(p, tok, max_seq_len=64, min_tokens=2)
    assert ids(c) == [enc(tok, "Para one line a.\nline b."), enc(tok, "Para two.")]
    assert c.dropped_short == 1  # "x" is one token


def test_txt_document_split_at_size_limit(tok, tmp_path, monkeypatch):
    """A document over MAX_DOCUMENT_CHARS (patched to 30) is split at a line boundary into pieces encoded
    independently."""
    import kvcal.corpus.txt as corpus_txt

    monkeypatch.setattr(corpus_txt, "MAX_DOCUMENT_CHARS", 30)
    p = tmp_path / "big.txt"
    p.write_text("= T =\nline one is here\nline two is here\nline three here\n", encoding="utf-8")
    c = load_corpus(p, tok, max_seq_len=512)
    assert ids(c) == [enc(tok, "= T =\nline one is here\nline two is here"), enc(tok, "line three here")]


def test_format_shape_tolerates_partial_dict():
    """format_shape renders a shape dict with only counts and percentiles, and an old shape without a source
    shows the [txt] format and line count without inventing a source."""
    text = format_shape({"samples": 3, "tokens": 30, "p50": 10.0, "p90": 12.0, "p99": 12.0, "max": 12})
    assert "samples    3" in text and "p90 12" in text
    # a shape recorded before datasets sources (no "source"): no source is made up for it
    old = format_shape({"path": "a.txt", "format": "txt", "samples": 1, "lines": 4})
    assert "[txt]" in old and "from 4 lines" in old


def test_txt_remainder_window_below_min_tokens_is_dropped_and_counted(tok, tmp_path):
    """A document one token longer than max_seq_len yields one window, and its one-token remainder is dropped
    and counted, not truncated."""
    doc = " ".join(["alpha"] * 50)
    n = len(enc(tok, doc))
    p = tmp_path / "r.txt"
    p.write_text(doc + "\n", encoding="utf-8")
    c = load_corpus(p, tok, max_seq_len=n - 1, min_tokens=2)
    assert len(c) == 1 and c.dropped_short == 1 and c.truncated == 0


def test_wikitext_windows(tok, shared_data):
    """WikiText-2 validation loads as the window count recomputed from its title lines and an independent
    encode of each article (ceil(n/512) per article, at least 500), no token lost or truncated, max window
    512, and the file's line count."""
    path = shared_data / "wikitext2_valid.txt"
    c = load_corpus(path, tok, max_seq_len=512, min_tokens=1)
    lines = path.read_text(encoding="utf-8").split("\n")
    title = re.compile(r"^ = [^=].* = $")
    starts = [i for i, line in enumerate(lines) if title.match(line)]
    articles = ["\n".join(lines[a:b]).strip() for a, b in zip(starts, starts[1:] + [len(lines)], strict=True)]
    lens = [len(enc(tok, a)) for a in articles]
    want_windows = sum(-(-n // 512) for n in lens)
    assert c.format == "txt" and c.truncated == 0
    assert len(c) == want_windows >= 500 and c.dropped_short == 0
    assert sum(c.lengths) == sum(lens) and max(c.lengths) == 512
    assert c.lines == len(lines) - 1  # the file ends with a newline


# ---------------------------------------------------------------------------------------------- shape


def test_shape_percentiles_match_numpy(tok, tmp_path):
    """The corpus shape's p50/p90/p99 and mean of 57 random lengths equal numpy's, with the sample, token, max
    and truncated counts recomputed independently, and the rendered shape and JSON are well formed."""
    rng = np.random.default_rng(0)
    recs = [{"text": " ".join(["tok"] * int(k))} for k in rng.integers(2, 300, size=57)]
    c = load_corpus(write_jsonl(tmp_path / "s.jsonl", recs), tok, max_seq_len=200)
    n = np.array(c.lengths)
    sh = c.shape()
    for key, q in (("p50", 50), ("p90", 90), ("p99", 99)):
        assert sh[key] == pytest.approx(float(np.percentile(n, q)))
    assert sh["samples"] == 57 and sh["tokens"] == int(n.sum()) and sh["max"] == int(n.max()) == 200
    assert sh["mean"] == pytest.approx(float(n.mean()))
    assert sh["truncated"] == int(sum(len(enc(tok, r["text"])) > 200 for r in recs)) > 0
    assert sh["max_seq_len"] == 200 and sh["format"] == "text" and sh["sha256"] == c.sha256
    text = format_shape(sh)
    assert "p50" in text and "p99" in text and "truncated" in text and str(sh["samples"]) in text
    assert len(text.splitlines()) >= 4
    json.dumps(sh)  # metadata-safe


def test_sha256_of_raw_bytes(tok, tmp_path):
    """The corpus sha256 is hashlib's sha256 of the file's raw bytes."""
    import hashlib

    p = write_jsonl(tmp_path / "h.jsonl", [{"text": "abc def"}])
    assert load_corpus(p, tok, max_seq_len=8).sha256 == hashlib.sha256(p.read_bytes()).hexdigest()


# ---------------------------------------------------------------------------------------------- options


def test_truncation_counted_and_keeps_first_tokens(tok, tmp_path):
    """A sample longer than max_seq_len keeps its first 100 ids of an independent encode and is counted;
    strict mode refuses it with the file:line and its token count, and accepts it at max_seq_len equal to its
    length."""
    long = " ".join(f"w{i}" for i in range(4000))  # long enough for the prefix shortcut
    p = write_jsonl(tmp_path / "t.jsonl", [{"text": long}, {"text": "short one"}])
    c = load_corpus(p, tok, max_seq_len=100)
    assert c.truncated == 1 and ids(c)[0] == enc(tok, long)[:100] and ids(c)[1] == enc(tok, "short one")
    n = len(enc(tok, long))
    with pytest.raises(CorpusError, match=rf"t\.jsonl:1: sample is {n:,} tokens, longer than max_seq_len=100;"):
        load_corpus(p, tok, max_seq_len=100, strict=True)
    with pytest.raises(CorpusError, match=rf"t\.jsonl:1: sample is {n:,} tokens"):
        load_corpus(p, tok, max_seq_len=n - 1, strict=True)
    assert load_corpus(p, tok, max_seq_len=n, strict=True).truncated == 0


def test_whitespace_dominated_long_line_still_truncates_exactly(tok, tmp_path):
    """A long whitespace-dominated line truncates to exactly the first 50 ids of an independent encode."""
    long = (" " * 200 + "x ") * 300
    p = write_jsonl(tmp_path / "ws.jsonl", [{"text": long}])
    c = load_corpus(p, tok, max_seq_len=50)
    assert ids(c) == [enc(tok, long)[:50]] and c.truncated == 1


def test_empty_lines_and_short_samples_are_counted(tok, tmp_path):
    """Blank and whitespace lines are counted as skipped empty (3), samples below min_tokens as dropped short
    (2, an empty text included), and all 6 lines as read."""
    p = write_jsonl(tmp_path / "e.jsonl", ["", "   ", {"text": "a"}, {"text": ""}, {"text": "two words here"}, "\t"])
    c = load_corpus(p, tok, max_seq_len=64, min_tokens=2)
    assert (len(c), c.skipped_empty, c.dropped_short, c.lines) == (1, 3, 2, 6)


def test_bom_is_stripped(tok, tmp_path):
    """A UTF-8 byte-order mark is stripped from JSONL (ids equal the plain encode, CRLF accepted) and from
    .txt (two articles found)."""
    p = tmp_path / "bom.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + json.dumps({"text": "hello world"}).encode() + b"\r\n")
    assert ids(load_corpus(p, tok, max_seq_len=64)) == [enc(tok, "hello world")]
    t = tmp_path / "bom.txt"
    t.write_bytes(b"\xef\xbb\xbf = Title = \n\nSome text here .\n = Next = \nMore .\n")
    assert len(load_corpus(t, tok, max_seq_len=64)) == 2


def test_gz_equals_plain(tok, tmp_path):
    """A gzipped JSONL gives the same ids as the plain file, while the recorded hash is of the compressed
    bytes (differs)."""
    recs = [{"messages": CHAT}, {"text": "plain text sample"}]
    plain = write_jsonl(tmp_path / "c.jsonl", recs)
    gz = tmp_path / "c.jsonl.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    a, b = load_corpus(plain, tok, max_seq_len=256), load_corpus(gz, tok, max_seq_len=256)
    assert ids(a) == ids(b) and a.sha256 != b.sha256


def test_max_samples_seeded_subset_in_file_order(tok, tmp_path):
    """max_samples picks a seeded subset (same seed same ids, another seed others) kept in file order and not
    just the first ones, records 50 available, and a cap above the size keeps everything."""
    recs = [{"text": f"sample number {i} " * 2} for i in range(50)]
    p = write_jsonl(tmp_path / "n.jsonl", recs)
    full = ids(load_corpus(p, tok, max_seq_len=64))
    a = load_corpus(p, tok, max_seq_len=64, max_samples=10, seed=3)
    b = load_corpus(p, tok, max_seq_len=64, max_samples=10, seed=3)
    c = load_corpus(p, tok, max_seq_len=64, max_samples=10, seed=4)
    assert ids(a) == ids(b) and ids(a) != ids(c)
    pos = [full.index(x) for x in ids(a)]
    assert len(pos) == 10 and pos == sorted(pos) and pos != list(range(10))
    assert a.available == 50 and a.shape()["available"] == 50 and "seeded subset of 50" in format_shape(a.shape())
    assert ids(load_corpus(p, tok, max_seq_len=64, max_samples=100)) == full


# ---------------------------------------------------------------------------------------------- hostile input


def _write(data, name: str):
    def make(tmp_path: Path) -> Path:
        p = tmp_path / name
        d = data() if callable(data) else data
        p.write_bytes(d.encode("utf-8") if isinstance(d, str) else d)
        return p

    return make


def _gz(data: bytes, name: str, cut: int | None = None):
    def make(tmp_path: Path) -> Path:
        p = tmp_path / name
        z = gzip.compress(data)
        p.write_bytes(z[:cut] if cut else z)
        return p

    return make


GOOD = '{"text": "fine line here"}\n'
ROWS = 2000
HOSTILE = [
    # id, file builder, expected line (None: whole file), message regex
    ("invalid_json", _write(GOOD + '{"text": "a",}\n', "bad.jsonl"), 2, r"invalid JSON"),
    ("truncated_json", _write(GOOD + GOOD + '{"text": "a\n', "bad.jsonl"), 3, r"invalid JSON"),
    ("deep_json", _write("[" * 100000 + "]" * 100000 + "\n", "deep.jsonl"), 1, r"invalid JSON \(nested too deeply\)"),
    ("not_object_list", _write(GOOD + '["a", "b"]\n', "bad.jsonl"), 2, r"expected a JSON object, got a list"),
    ("not_object_str", _write('"just text"\n', "bad.jsonl"), 1, r"expected a JSON object, got a string"),
    ("no_known_field", _write(GOOD + '{"content": "x", "id": 3}\n', "bad.jsonl"), 2,
     r"no known field \(keys: content, id\); use one of text, prompt"),
    ("completion_without_prompt", _write('{"completion": "x"}\n', "bad.jsonl"), 1, r'need a "prompt"'),
    # a record with both a prompt and a long text is refused, not read as the prompt alone
    ("prompt_and_text", _write(GOOD + '{"prompt": "Summarize.", "text": "a long document"}\n', "bad.jsonl"), 2,
     r"the record has both 'prompt' and 'text'; keep one sample field per line"),
    ("messages_and_text", _write('{"text": "x", "messages": [{"role": "user", "content": "hi"}]}\n', "bad.jsonl"), 1,
     r"both 'messages' and 'text'"),
    ("unknown_role", _write(GOOD + '{"messages": [{"role": "wizard", "content": "hi there friend"}]}\n', "bad.jsonl"),
     2, r"messages\[0\]\.role 'wizard' is not a chat role; use one of system, developer, user, assistant, tool"),
    ("text_not_string", _write('{"text": 5}\n', "bad.jsonl"), 1, r'"text" must be a string, got a number'),
    ("text_null", _write('{"text": null}\n', "bad.jsonl"), 1, r'"text" must be a string, got null'),
    ("prompt_list", _write('{"prompt": ["a"]}\n', "bad.jsonl"), 1, r'"prompt" must be a string, got a list'),
    ("completion_not_string", _write('{"prompt": "a", "response": {"x": 1}}\n', "bad.jsonl"), 1,
     r'"response" must be a string, got an object'),
    ("messages_not_list", _write('{"messages": "hi"}\n', "bad.jsonl"), 1, r'"messages" must be a non-empty list'),
    ("messages_empty", _write('{"messages": []}\n', "bad.jsonl"), 1, r"got an empty list"),
    ("message_not_object", _write('{"messages": ["hi"]}\n', "bad.jsonl"), 1, r"messages\[0\] must be an object"),
    ("role_not_string", _write('{"messages": [{"role": 1, "content": "x"}]}\n', "bad.jsonl"), 1,
     r"messages\[0\]\.role must be a string"),
    ("content_missing", _write('{"messages": [{"role": "user"}]}\n', "bad.jsonl"), 1, r'messages\[0\] has no "content"'),
    ("content_not_string", _write('{"messages": [{"role": "user", "content": 5}]}\n', "bad.jsonl"), 1,
     r"messages\[0\]\.content must be a string or a list of content parts, got a number"),
    ("content_part_not_object", _write('{"messages": [{"role": "user", "content": ["x"]}]}\n', "bad.jsonl"), 1,
     r'messages\[0\]\.content\[0\] must be a content part with a "type", got a string'),
    ("content_part_text_missing", _write('{"messages": [{"role": "user", "content": [{"type": "text"}]}]}\n',
                                         "bad.jsonl"), 1, r"messages\[0\]\.content\[0\]\.text must be a string, got null"),
    ("content_null_user", _write('{"messages": [{"role": "user", "content": null}]}\n', "bad.jsonl"), 1,
     r'messages\[0\]\.content is null; .*null only for an assistant turn with "tool_calls"'),
    ("tool_calls_not_list", _write('{"messages": [{"role": "assistant", "content": null, "tool_calls": "f()"}]}\n',
                                   "bad.jsonl"), 1, r"messages\[0\]\.tool_calls must be a list, got a string"),
    ("turns_not_list", _write('{"turns": "hi"}\n', "bad.jsonl"), 1, r'"turns" must be a non-empty list'),
    ("turns_not_strings", _write('{"turns": ["a", {"role": "user"}]}\n', "bad.jsonl"), 1,
     r"turns\[1\] must be a string, got an object"),
    ("lone_surrogate", _write('{"text": "bad \\ud800 here"}\n', "bad.jsonl"), 1, r"unpaired surrogate"),
    ("non_utf8", _write((GOOD * 3 + '{"text": "caf').encode() + b"\xe9" + b'"}\n', "latin1.jsonl"), 4,
     r"not valid UTF-8 \(byte 0xe9"),
    ("non_utf8_txt", _write(b"ok line\n\nbad \xff\xfe\n", "bad.txt"), 3, r"not valid UTF-8 \(byte 0xff"),
    ("huge_line", _write(lambda: GOOD + "x" * (MAX_LINE_BYTES + 10) + "\n", "huge.jsonl"), 2, r"longer than the 8 MiB limit"),
    ("huge_line_txt", _write(lambda: "x" * (MAX_LINE_BYTES + 1), "huge.txt"), 1, r"longer than the 8 MiB limit"),
    ("empty_file", _write("", "empty.jsonl"), None, r"no samples: 0 lines"),
    ("only_blank_lines", _write("\n  \n\t\n", "blank.jsonl"), None, r"no samples: 3 lines, 3 empty"),
    ("all_too_short", _write('{"text": "a"}\n{"text": ""}\n\n', "short.jsonl"), None,
     r"no samples: 3 lines, 1 empty, 2 samples shorter than min_tokens=2 tokens"),
    ("empty_txt", _write("\n\n   \n", "empty.txt"), None, r"no samples: 3 lines, 0 documents"),
    ("short_txt", _write("a\n\nb\n", "short.txt"), None, r"no samples: 3 lines, 2 documents, 2 windows shorter"),
    ("corrupt_gz", _write(b"\x1f\x8b\x08\x00garbage-not-deflate" * 3, "bad.jsonl.gz"), 1, r"corrupt or truncated gzip"),
    ("not_gz", _write(GOOD, "plain.jsonl.gz"), None, r"is JSON lines text, not gzip-compressed; give it the \.jsonl"),
    ("truncated_gz", _gz("".join(json.dumps({"text": f"row {i} {i * 7919 % 10007}"}) + "\n" for i in range(ROWS)).encode(),
                         "cut.jsonl.gz", cut=2000), None, r"corrupt or truncated gzip"),
    ("unknown_ext", _write(GOOD, "corpus.xlsx"), None, r"unknown corpus extension '\.xlsx'; use one of \.jsonl"),
    ("no_ext", _write(GOOD, "corpus"), None, r"unknown corpus extension '\(none\)'"),
]


@pytest.mark.parametrize("case", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_input_one_line_error(tok, tmp_path, case):
    """Each hostile file in HOSTILE raises a CorpusError within 20 s (a hang check) whose one line starts with the path
    (and line where known), matches the expected pattern and says what is wrong and how to fix it."""
    _, make, line, pattern = case
    p = make(tmp_path)
    t0 = time.perf_counter()
    with pytest.raises(CorpusError) as ei:
        load_corpus(p, tok, max_seq_len=256)
    msg = str(ei.value)
    assert time.perf_counter() - t0 < 20  # wall clock: ≤ 0.11 s seen on a loaded 2-core CPU; catches a hang only
    assert "\n" not in msg and str(p) in msg, msg
    if line is not None:
        assert msg.startswith(f"{p}:{line}: "), msg
    elif "gzip" not in pattern:
        assert msg.startswith(f"{p}: "), msg
    assert re.search(pattern, msg), msg
    assert "; " in msg  # what is wrong; how to fix


def test_fifty_megabyte_line_is_refused_fast(tok, tmp_path):
    """A 50 MiB JSONL line is refused with big.jsonl:1 and the 8 MiB limit, in under 5 s (a hang or quadratic
    scan would take far longer)."""
    p = tmp_path / "big.jsonl"
    with open(p, "wb") as f:
        f.write(b'{"text": "')
        f.write(b"a" * (50 << 20))
        f.write(b'"}\n')
    t0 = time.perf_counter()
    with pytest.raises(CorpusError, match=r"big\.jsonl:1: line is longer than the 8 MiB limit"):
        load_corpus(p, tok, max_seq_len=2048)
    # wall clock: 0.4 s seen on a loaded 2-core CPU (12x margin for slower machines); catches a hang or a
    # quadratic scan of the line — the limit itself is checked by the message above
    assert time.perf_counter() - t0 < 5


def test_missing_file_and_directory(tok, tmp_path):
    """A missing corpus path and a directory raise CorpusError naming the path (no such file / is a
    directory)."""
    with pytest.raises(CorpusError, match=r"nope\.jsonl: no such file"):
        load_corpus(tmp_path / "nope.jsonl", tok, max_seq_len=64)
    d = tmp_path / "dir.jsonl"
    d.mkdir()
    with pytest.raises(CorpusError, match=r"dir\.jsonl: is a directory"):
        load_corpus(d, tok, max_seq_len=64)


@pytest.mark.parametrize("rec", [{"messages": CHAT}, {"turns": ["a", "b"]}], ids=["messages", "turns"])
def test_chat_corpus_without_chat_template(plain_tok, tmp_path, rec):
    """A messages or turns record with a tokenizer that has no chat template raises CorpusError naming
    chat.jsonl:2 and the need for a template."""
    p = write_jsonl(tmp_path / "chat.jsonl", [{"text": "fine"}, rec])
    with pytest.raises(CorpusError, match=r"chat\.jsonl:2: a '(messages|turns)' sample needs a chat template"):
        load_corpus(p, plain_tok, max_seq_len=64)


def test_chat_template_error_is_a_corpus_error(tmp_path, tok):
    """An exception raised by the chat template (with a newline in its text) becomes a one-line CorpusError
    naming tpl.jsonl:1."""
    t = copy.deepcopy(tok)
    t.chat_template = "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools\nhere') }}" \
                      "{% endif %}{{ m['content'] }}{% endfor %}"
    p = write_jsonl(tmp_path / "tpl.jsonl", [{"messages": [{"role": "tool", "content": "x"}]}])
    with pytest.raises(CorpusError, match=r"tpl\.jsonl:1: the tokenizer's chat template rejected") as ei:
        load_corpus(p, t, max_seq_len=64)
    assert "\n" not in str(ei.value)


@pytest.mark.parametrize("kw", [dict(max_seq_len=0), dict(max_seq_len=1, min_tokens=2), dict(max_seq_len=8, max_samples=0),
                                dict(max_seq_len=8, min_tokens=0)])
def test_bad_arguments(tok, tmp_path, kw):
    """max_seq_len 0, min_tokens above max_seq_len, max_samples 0 and min_tokens 0 raise CorpusError prefixed
    with the corpus path."""
    p = write_jsonl(tmp_path / "ok.jsonl", [{"text": "fine"}])
    with pytest.raises(CorpusError, match=r"ok\.jsonl: "):
        load_corpus(p, tok, **kw)
