"""A tokenizer that is not the model's: token ids at or above the model's ``vocab_size`` (they would index past
its embedding: an ``IndexError`` traceback from inside the forward pass) are refused by every command that feeds
token ids to the model — one ``error:`` line naming the corpus file and line, the token id and the model's
vocab_size, with the fix — before the model loads and before anything is written."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from helpers.models import TINY_LLAMA_8, save_tiny_llama

from kvcal.cli import main

VOCAB = 49000  # the embedded SmolLM2 tokenizer has 49152 tokens: ids 49000.. have no embedding row here


@pytest.fixture(scope="module")
def setup(tmp_path_factory, smollm_tokenizer):
    """A tiny random Llama with ``VOCAB`` embedding rows saved with the 49152-token SmolLM2 tokenizer, a
    word the tokenizer encodes as one id >= VOCAB, and a JSONL (word on line 3) and a .txt (line 2) corpus."""
    from helpers.cli import fp8_artifact

    tok = smollm_tokenizer
    assert len(tok) > VOCAB
    tid, word = next((i, tok.decode([i])) for i in range(VOCAB, len(tok))
                     if tok.decode([i]).startswith(" ") and tok.decode([i])[1:].isalpha()
                     and tok(tok.decode([i]), add_special_tokens=False)["input_ids"] == [i])
    d = save_tiny_llama(tmp_path_factory, tok, "small_vocab", vocab_size=VOCAB, tie_word_embeddings=True,
                        **TINY_LLAMA_8)
    data = tmp_path_factory.mktemp("vocab_inputs")
    texts = ["The quick brown fox jumps over the lazy dog near the river bank." for _ in range(6)]
    texts[2] = f"A sentence with a rare word:{word} and more text after it, enough for a sample."
    (data / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    (data / "c.txt").write_text(f"First line of plain text.\nSecond line with{word} inside.\n"
                                + "Filler text that goes on. " * 40 + "\n", encoding="utf-8")
    return {"model": d, "token_id": tid, "art": fp8_artifact(data, d), "jsonl": (data / "c.jsonl", 3),
            "txt": (data / "c.txt", 2)}


@pytest.mark.parametrize("kind", ["jsonl", "txt"])
@pytest.mark.parametrize("command", ["calibrate", "evaluate", "recommend"])
def test_token_id_past_the_model_vocab_is_one_line_before_the_model_loads(setup, no_model, tmp_path, command, kind):
    """calibrate / evaluate / recommend on a corpus whose tokenization holds an id >= the model's vocab_size:
    exit 2, one `error:` line naming corpus:line, the token id, vocab_size 49000 and the fix; no traceback,
    the model loader never reached, and no output (directory or JSON file) written."""
    corpus, line = setup[kind]
    out = tmp_path / "out"
    model = str(setup["model"])
    args = {
        "calibrate": ["calibrate", "--model", model, "--corpus", str(corpus), "--out", str(out), "--max-seq-len", "64",
                      "--quiet"],
        "evaluate": ["evaluate", "--artifact", str(setup["art"]), "--model", model, "--corpus", str(corpus),
                     "--context", "16", "--windows", "2", "--json", str(out), "--quiet"],
        "recommend": ["recommend", "--engine", "vllm", "--model", model, "--corpus", str(corpus), "--out", str(out),
                      "--context", "16", "--quiet"],
    }[command]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2, (r.output, r.exception)
    errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in r.output, r.output
    msg = errors[0]
    assert msg.startswith(f"error: {corpus}:{line}: token id {setup['token_id']} is outside the model's vocabulary "
                          f"(vocab_size {VOCAB})"), msg
    assert "use the model's own tokenizer" in msg
    assert no_model == [] and not out.exists()
