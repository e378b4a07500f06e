"""Corpora users have, read through ``datasets``: Parquet / Arrow / CSV / JSON files, save_to_disk
directories, cached hub datasets; OpenAI-format chats (content parts, tool calls); field mapping.

The reference for every source is the same records written as JSONL (whose token ids
tests/corpus/test_corpus.py checks against the tokenizer directly): a source must give exactly the JSONL ids.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvcal.corpus import check_corpus, format_shape, load_corpus
from kvcal.errors import CorpusError

datasets = pytest.importorskip("datasets")

ROWS = [
    {"text": "The quick brown fox jumps over the lazy dog.", "id": 1},
    {"text": "A KV cache stores keys and values of past tokens.", "id": 2},
    {"text": "Quantizing it to FP8 halves its memory.", "id": 3},
]
CHAT_ROWS = [
    {"messages": [{"role": "user", "content": "What is a KV cache?"},
                  {"role": "assistant", "content": "Stored keys and values."}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why quantize it?"}]},
]


@pytest.fixture(scope="module")
def tok(smollm_tokenizer):
    return smollm_tokenizer


def jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def ids(c):
    return [s.tolist() for s in c.samples]


def reference(tok, tmp_path, rows, **kw):
    return ids(load_corpus(jsonl(tmp_path / "ref.jsonl", rows), tok, max_seq_len=256, **kw))


def _write(kind: str, tmp_path: Path, rows) -> Path:
    ds = datasets.Dataset.from_list(rows) if kind != "json_array" else None
    if kind == "parquet":
        ds.to_parquet(str(tmp_path / "c.parquet"))
        return tmp_path / "c.parquet"
    if kind == "csv":
        ds.to_csv(str(tmp_path / "c.csv"), index=False)
        return tmp_path / "c.csv"
    if kind == "json_lines":
        ds.to_json(str(tmp_path / "c.json"))  # JSON lines under a .json name
        return tmp_path / "c.json"
    if kind == "json_array":
        (tmp_path / "c.json").write_text(json.dumps(rows), encoding="utf-8")
        return tmp_path / "c.json"
    if kind == "arrow":
        ds.save_to_disk(str(tmp_path / "saved"))
        shutil.copy(next((tmp_path / "saved").glob("*.arrow")), tmp_path / "c.arrow")
        return tmp_path / "c.arrow"
    if kind == "save_to_disk":
        ds.save_to_disk(str(tmp_path / "saved"))
        return tmp_path / "saved"
    raise AssertionError(kind)


KINDS = ["parquet", "csv", "json_lines", "json_array", "arrow", "save_to_disk"]


@pytest.mark.parametrize("kind", KINDS)
def test_dataset_files_equal_jsonl(tok, tmp_path, kind):
    """Each dataset file kind (Parquet, Arrow, CSV, JSON lines, JSON array, save_to_disk) gives exactly
    the token ids of the same records written as JSONL, with format text, 3 rows, its source named in
    check_corpus and the shape line."""
    p = _write(kind, tmp_path, ROWS)
    c = load_corpus(p, tok, max_seq_len=256)
    assert ids(c) == reference(tok, tmp_path, ROWS)
    assert c.format == "text" and c.lines == 3 and c.split is None
    assert c.source == {"json_lines": "json", "json_array": "json"}.get(kind, kind)
    assert check_corpus(p) == {"source": c.source, "split": None, "records": 3, "formats": {"text": 3}}
    shape = format_shape(c.shape())
    assert f"[text; {c.source}]" in shape and "from 3 rows" in shape


@pytest.mark.parametrize("kind", ["parquet", "json_array", "save_to_disk"])
def test_chat_datasets_equal_jsonl(tok, tmp_path, kind):
    """Chat rows stored as Parquet, a JSON array or a save_to_disk directory give exactly the token ids of the
    same chats written as JSONL."""
    p = _write(kind, tmp_path, CHAT_ROWS)
    assert ids(load_corpus(p, tok, max_seq_len=256)) == reference(tok, tmp_path, CHAT_ROWS)


def test_dataset_dict_splits(tok, tmp_path):
    """A saved DatasetDict reads its train split by default and --split test on request (ids equal the JSONL
    reference of those rows); an unknown split and an ambiguous dict without train raise CorpusError naming
    the splits and --split."""
    d = datasets.DatasetDict(train=datasets.Dataset.from_list(ROWS[:2]), test=datasets.Dataset.from_list(ROWS[2:]))
    d.save_to_disk(str(tmp_path / "dd"))
    c = load_corpus(tmp_path / "dd", tok, max_seq_len=256)  # default: train
    assert (c.split, ids(c)) == ("train", reference(tok, tmp_path, ROWS[:2]))
    c = load_corpus(tmp_path / "dd", tok, max_seq_len=256, split="test")
    assert (c.split, ids(c)) == ("test", reference(tok, tmp_path, ROWS[2:]))
    assert "save_to_disk, split test" in format_shape(c.shape())
    with pytest.raises(CorpusError, match=r"dd: the dataset has no split 'dev' \(splits: train, test\); pass --split"):
        check_corpus(tmp_path / "dd", split="dev")
    datasets.DatasetDict(a=d["train"], b=d["test"]).save_to_disk(str(tmp_path / "ab"))
    with pytest.raises(CorpusError, match=r"the dataset has splits a, b; choose one with --split"):
        check_corpus(tmp_path / "ab")


def test_split_refused_for_single_files(tok, tmp_path):
    """--split on a single Parquet file or on a save_to_disk directory without splits raises CorpusError
    saying the split does not apply."""
    p = _write("parquet", tmp_path, ROWS)
    with pytest.raises(CorpusError, match=r"--split 'test' applies to datasets with splits.*drop --split"):
        load_corpus(p, tok, max_seq_len=64, split="test")
    with pytest.raises(CorpusError, match=r"--split 'test': this directory has no splits"):
        check_corpus(_write("save_to_disk", tmp_path, ROWS), split="test")


def _hub_snapshot(cache: Path, repo: str, rows) -> None:
    """The huggingface_hub cache layout of a dataset repo (refs/main -> snapshots/<commit>/...)."""
    root = cache / f"datasets--{repo.replace('/', '--')}"
    commit = "0" * 40
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    snap = root / "snapshots" / commit / "data"
    snap.mkdir(parents=True)
    datasets.Dataset.from_list(rows).to_parquet(str(snap / "train-00000-of-00001.parquet"))


def test_hub_dataset_from_local_cache_only(tok, tmp_path, monkeypatch):
    """A dataset name found in the local Hugging Face cache loads as source hub, split train, with the JSONL
    reference ids, even with offline mode off; an uncached name raises a one-line CorpusError saying kvcal
    never downloads, and HF_HUB_OFFLINE is left as it was."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    _hub_snapshot(cache, "acme/prod-logs", ROWS)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # even when the user's env allows downloads
    c = load_corpus("acme/prod-logs", tok, max_seq_len=256)
    assert (c.source, c.split, ids(c)) == ("hub", "train", reference(tok, tmp_path, ROWS))
    with pytest.raises(CorpusError) as ei:
        check_corpus("acme/not-cached")
    msg = str(ei.value)
    assert msg.startswith("acme/not-cached: not a file and not a dataset in the local Hugging Face cache; kvcal never "
                          "downloads at run time") and "\n" not in msg
    assert constants.HF_HUB_OFFLINE is False  # restored


def test_text_and_messages_field_mapping(tok, tmp_path):
    """--text-field and --messages-field select another column (Parquet and JSONL) with the JSONL reference
    ids; a missing field, both flags together, and a field flag on a .txt corpus raise CorpusError naming the
    row, keys or fix."""
    rows = [{"body": r["text"], "text": "ignored when --text-field names another column"} for r in ROWS]
    p = _write("parquet", tmp_path, rows)
    assert ids(load_corpus(p, tok, max_seq_len=256, text_field="body")) == reference(tok, tmp_path, ROWS)
    conv = [{"conversation": r["messages"]} for r in CHAT_ROWS]
    q = jsonl(tmp_path / "conv.jsonl", conv)  # the mapping applies to JSONL too
    assert ids(load_corpus(q, tok, max_seq_len=256, messages_field="conversation")) == reference(tok, tmp_path, CHAT_ROWS)
    with pytest.raises(CorpusError, match=r"c\.parquet:row 1: no 'prompt' field \(--text-field; keys: body, text\)"):
        check_corpus(p, text_field="prompt")
    with pytest.raises(CorpusError, match=r"--text-field and --messages-field both given"):
        check_corpus(p, text_field="body", messages_field="conversation")
    with pytest.raises(CorpusError, match=r"a \.txt corpus is raw text: drop them"):
        check_corpus(_txt(tmp_path), text_field="body")


def _txt(tmp_path: Path) -> Path:
    (tmp_path / "t.txt").write_text("some text here\n", encoding="utf-8")
    return tmp_path / "t.txt"


def test_null_field_in_a_row_is_named(tmp_path):
    """A JSON array whose second row has text null raises CorpusError naming n.json:row 2 and the fix."""
    p = tmp_path / "n.json"
    p.write_text(json.dumps([{"text": "fine"}, {"text": None}]), encoding="utf-8")
    with pytest.raises(CorpusError, match=r'n\.json:row 2: "text" is null; fill it or leave the row out'):
        check_corpus(p)


def test_unreadable_dataset_files_are_one_line(tmp_path):
    """A garbage Parquet file and a ragged CSV raise one-line CorpusErrors naming the reader's error (line 3
    of the CSV), and a directory with no dataset or data files is refused."""
    (tmp_path / "bad.parquet").write_bytes(b"garbage")
    (tmp_path / "bad.csv").write_text('a,b\n1,2\n1,2,3\n', encoding="utf-8")
    for name, pattern in (("bad.parquet", r"is not a Parquet file \(no PAR1 magic\): it starts like text; check that it is a "
                                          r"valid parquet file"),
                          ("bad.csv", r"cannot read as csv \(ParserError: .*Expected 2 fields in line 3, saw 3")):
        with pytest.raises(CorpusError, match=pattern) as ei:
            check_corpus(tmp_path / name)
        assert "\n" not in str(ei.value)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.md").write_text("hello")
    with pytest.raises(CorpusError, match=r"d: is a directory without a save_to_disk dataset or readable data files"):
        check_corpus(tmp_path / "d")


# ---------------------------------------------------------------------------------------------- OpenAI chats

OPENAI = [
    {"messages": [
        {"role": "system", "content": [{"type": "text", "text": "You are terse."}]},
        {"role": "user", "content": [{"type": "text", "text": "What is in this image?"},
                                     {"type": "image_url", "image_url": {"url": "https://x/cat.png"}},
                                     {"type": "text", "text": "Answer in one word."}]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "look", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a cat"},
        {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAA", "format": "wav"}}]},
    ]},
]
# the same conversation as plain strings: text parts joined with "\n" (vLLM), other parts dropped,
# null assistant content rendered as "" (its tool_calls go to the template, which ignores them here)
FLAT = [
    {"messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is in this image?\nAnswer in one word."},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": "a cat"},
        {"role": "user", "content": ""},
    ]},
]


@pytest.mark.parametrize("kind", ["jsonl", "json_array", "parquet"])
def test_openai_content_parts_and_tool_calls(tok, tmp_path, kind):
    """OpenAI-format chats (content parts, an image and an audio part, an assistant tool call) from JSONL, a
    JSON array or Parquet give the ids of the hand-flattened reference chats, count the dropped parts and the
    tool-call turn, and report that SmolLM2's template does not render tool_calls."""
    rows = OPENAI
    if kind == "parquet":  # a Parquet column has one type: every content is a list of parts there
        rows = json.loads(json.dumps(OPENAI).replace('"content": "a cat"', '"content": [{"type": "text", "text": "a cat"}]'))
    p = jsonl(tmp_path / "o.jsonl", rows) if kind == "jsonl" else _write(kind, tmp_path, rows)
    c = load_corpus(p, tok, max_seq_len=512)
    assert ids(c) == reference(tok, tmp_path, FLAT)
    assert c.dropped_parts == {"image_url": 1, "input_audio": 1}
    assert c.tool_call_turns == 1 and c.tool_calls_rendered is False  # SmolLM2's template has no tool_calls
    shape = format_shape(c.shape())
    assert "dropped    1 image_url, 1 input_audio chat content part(s)" in shape
    assert "1 assistant turns with tool_calls (the chat template does not render tool_calls" in shape


def test_tool_calls_rendered_by_a_template_that_knows_them(tok, tmp_path):
    """With a chat template that renders tool_calls, the corpus records them as rendered and the decoded
    sample shows the call."""
    import copy

    t = copy.deepcopy(tok)
    t.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
                       "{% if m.tool_calls %}{% for c in m.tool_calls %}[call {{ c.function.name }}]{% endfor %}"
                       "{% endif %}\n{% endfor %}")
    c = load_corpus(jsonl(tmp_path / "o.jsonl", OPENAI), t, max_seq_len=512)
    assert c.tool_calls_rendered is True
    assert "assistant: [call look]" in t.decode(c.samples[0])


@pytest.mark.parametrize("name", ["chat", "tool_use", "code"])
def test_shipped_sets_as_parquet_give_the_same_ids(tok, tmp_path, name):
    """calibration_sets/README.md: a Parquet export of a shipped JSONL set loads to the same token ids."""
    src = Path(__file__).resolve().parents[2] / "calibration_sets" / f"{name}.jsonl"
    ds = datasets.load_dataset("json", data_files=str(src), split="train", cache_dir=str(tmp_path / "cache"))
    ds.to_parquet(str(tmp_path / f"{name}.parquet"))
    a = load_corpus(src, tok, max_seq_len=2048)
    b = load_corpus(tmp_path / f"{name}.parquet", tok, max_seq_len=2048)
    assert ids(a) == ids(b) and len(a) in (44, 20, 30) and a.format == b.format
