"""The shipped calibration_sets/: every file loads, matches its README entry, and stays in sync."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from kvcal.corpus import load_corpus

SETS = Path(__file__).resolve().parents[2] / "calibration_sets"

# file -> (format, samples at max_seq_len=2048), as listed in calibration_sets/README.md
EXPECTED = {
    "chat.jsonl": ("messages", 44),
    "chat.jsonl.gz": ("messages", 44),
    "tool_use.jsonl": ("messages", 20),
    "code.jsonl": ("prompt_completion", 30),
    "longdocs.txt": ("txt", 6),
    "text.jsonl": ("text", 44),
    "prompt.jsonl": ("prompt", 44),
    "prompt_completion.jsonl": ("prompt_completion", 44),
    "turns.jsonl": ("turns", 44),
    "chat.txt": ("txt", 44),
}


def test_inventory_matches_readme_and_folder():
    """The calibration_sets/ folder holds exactly the files listed in EXPECTED, each named in its README, and
    the folder stays under 1 MB."""
    files = {p.name for p in SETS.iterdir() if p.is_file()} - {"README.md", "derive.py"}
    assert files == set(EXPECTED)
    readme = (SETS / "README.md").read_text(encoding="utf-8")
    for name in EXPECTED:
        assert f"`{name}`" in readme
    assert sum(p.stat().st_size for p in SETS.iterdir()) < 1_000_000


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_set_loads(smollm_tokenizer, name):
    """Each shipped set loads with the format and sample count its README states at max_seq_len=2048
    (hand-counted table EXPECTED), with nothing truncated or skipped as empty."""
    fmt, n = EXPECTED[name]
    c = load_corpus(SETS / name, smollm_tokenizer, max_seq_len=2048)
    assert (c.format, len(c), c.truncated, c.skipped_empty) == (fmt, n, 0, 0)


def test_chat_demo_set_is_varied(smollm_tokenizer):
    """chat.jsonl has at least 40 samples from at most 40 to at least 550 tokens, unique ids, at least 10
    system prompts and at least 10 multi-turn conversations."""
    c = load_corpus(SETS / "chat.jsonl", smollm_tokenizer, max_seq_len=2048)
    assert len(c) >= 40 and min(c.lengths) <= 40 and max(c.lengths) >= 550
    recs = [json.loads(line) for line in (SETS / "chat.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len({r["id"] for r in recs}) == len(recs)
    assert sum(r["messages"][0]["role"] == "system" for r in recs) >= 10
    assert sum(sum(m["role"] == "user" for m in r["messages"]) >= 2 for r in recs) >= 10


def test_tool_use_set_holds_tool_call_json():
    """Every tool_use.jsonl conversation has an assistant message whose JSON content holds tool_calls, a tool
    message, and ends with an assistant turn."""
    for line in (SETS / "tool_use.jsonl").read_text(encoding="utf-8").splitlines():
        msgs = json.loads(line)["messages"]
        calls = [json.loads(m["content"]) for m in msgs if m["role"] == "assistant" and m["content"].startswith("{")]
        assert calls and all("tool_calls" in c for c in calls)
        assert any(m["role"] == "tool" for m in msgs) and msgs[-1]["role"] == "assistant"


def test_derived_formats_are_in_sync():
    """The derived files in calibration_sets/ equal what derive.py regenerates from their sources (derive.py
    --check exits 0)."""
    spec = importlib.util.spec_from_file_location("kvcal_sets_derive", SETS / "derive.py")
    derive = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(derive)
    assert derive.main(["--check"]) == 0
