"""Derive the per-format copies of ``chat.jsonl`` (run from anywhere: ``python calibration_sets/derive.py``).

``chat.jsonl`` is the source; ``text.jsonl``, ``prompt.jsonl``, ``prompt_completion.jsonl``,
``turns.jsonl``, ``chat.jsonl.gz`` and ``chat.txt`` hold the same conversations in another corpus
format, so the formats can be compared on identical content. The output is deterministic (gzip without a timestamp); ``--check`` exits 1 when a
derived file is out of date. Uses only the standard library.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "chat.jsonl"


def flatten(messages: list[dict]) -> str:
    """A conversation as plain text: ``Role: content`` blocks separated by blank lines."""
    return "\n\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in messages)


def _jsonl(records) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")


def derived() -> dict[str, bytes]:
    """File name -> exact bytes of every derived file."""
    raw = SOURCE.read_bytes()
    convs = [json.loads(line) for line in raw.decode("utf-8").splitlines() if line.strip()]
    text, prompt, pc, turns, docs = [], [], [], [], []
    for c in convs:
        msgs = c["messages"]
        users = [m["content"] for m in msgs if m["role"] == "user"]
        first_user = next(i for i, m in enumerate(msgs) if m["role"] == "user")
        reply = next((m["content"] for m in msgs[first_user + 1:] if m["role"] == "assistant"), None)
        text.append({"id": c["id"], "text": flatten(msgs)})
        prompt.append({"id": c["id"], "prompt": msgs[first_user]["content"]})
        if reply is not None:
            pc.append({"id": c["id"], "prompt": msgs[first_user]["content"], "response": reply})
        turns.append({"id": c["id"], "turns": users})
        docs.append(f"= Conversation {c['id']} =\n\n{flatten(msgs)}\n")
    return {
        "text.jsonl": _jsonl(text),
        "prompt.jsonl": _jsonl(prompt),
        "prompt_completion.jsonl": _jsonl(pc),
        "turns.jsonl": _jsonl(turns),
        "chat.jsonl.gz": gzip.compress(raw, compresslevel=9, mtime=0),
        "chat.txt": "\n".join(docs).encode("utf-8"),
    }


def main(argv: list[str]) -> int:
    stale = []
    for name, data in derived().items():
        path = HERE / name
        if name.endswith(".gz"):
            same = path.exists() and gzip.decompress(path.read_bytes()) == gzip.decompress(data)
        else:
            same = path.exists() and path.read_bytes() == data
        if same:
            continue
        stale.append(name)
        if "--check" not in argv:
            path.write_bytes(data)
    if "--check" in argv and stale:
        print("out of date: " + ", ".join(stale) + "; run python calibration_sets/derive.py", file=sys.stderr)
        return 1
    for name in stale:
        print(f"wrote {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
