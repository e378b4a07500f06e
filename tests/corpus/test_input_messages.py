"""Messages for bad CLI / corpus input name the thing the user wrote."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kvcal.cli import main


def _int_list_options():
    return [(name, p) for name, cmd in main.commands.items() for p in cmd.params
            if isinstance(p, click.Option) and hasattr(p.callback, "kvcal_int_list")]


@pytest.mark.parametrize("value", ["128,,64", "1024,", ",1024"])
def test_integer_list_with_an_empty_item_is_refused(value):
    """An empty item in an integer-list option (`--context 128,,64`) is refused, not dropped."""
    opts = _int_list_options()
    assert any(p.name == "contexts" for _, p in opts)
    for _name, p in opts:
        with pytest.raises(click.BadParameter, match="empty item"):
            p.callback(None, p, value)
        assert p.callback(None, p, "64") == (64,)  # a plain value still parses
    r = CliRunner().invoke(main, ["evaluate", "--artifact", "x", "--corpus", "y", "--context", value])
    assert r.exit_code == 2 and "empty item" in r.output and "Traceback" not in r.output


# ---- corpus messages ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,content", [("empty.json", "[]"), ("header.csv", "text\n"), ("header2.csv", "id,text\n")])
def test_a_corpus_without_rows_says_no_samples(tmp_path, name, content):
    """An empty JSON array / header-only CSV is refused in one line as having no samples (not with the
    datasets library's 'corresponds to no data')."""
    from kvcal.corpus import check_corpus
    from kvcal.errors import CorpusError

    (tmp_path / name).write_text(content)
    with pytest.raises(CorpusError) as ei:
        check_corpus(str(tmp_path / name))
    msg = str(ei.value)
    assert "no samples" in msg and "corresponds to no data" not in msg and "\n" not in msg


@pytest.mark.parametrize("name,content", [("empty.jsonl", ""), ("blank.jsonl", "\n\n"), ("empty.txt", ""),
                                          ("blank.txt", "\n  \n\n")])
def test_an_empty_file_says_no_samples_before_any_tokenizer(tmp_path, name, content):
    """An empty or blank .jsonl / .txt is refused as having no samples by the tokenizer-free check (what the CLI
    runs before importing torch)."""
    from kvcal.corpus import check_corpus
    from kvcal.errors import CorpusError

    (tmp_path / name).write_text(content)
    with pytest.raises(CorpusError, match="no samples") as ei:
        check_corpus(str(tmp_path / name))
    assert "\n" not in str(ei.value)


def test_text_field_of_the_wrong_type_names_the_field(tmp_path):
    """`--text-field id` on an integer column is refused naming the row, the field and the type it holds."""
    from kvcal.corpus import check_corpus
    from kvcal.errors import CorpusError

    (tmp_path / "c.csv").write_text("id,body\n1,hello\n")
    with pytest.raises(CorpusError, match=r"row 1: 'id' \(--text-field id\) must hold a string, got a number"):
        check_corpus(str(tmp_path / "c.csv"), text_field="id")
    assert check_corpus(str(tmp_path / "c.csv"), text_field="body")["records"] == 1


@pytest.mark.parametrize("kind", ["csv", "parquet"])
def test_a_table_cell_over_the_line_limit_is_refused_like_a_jsonl_line(tmp_path, kind):
    """A CSV / parquet cell over MAX_LINE_BYTES (8 MiB) is refused, as a JSONL line over it is."""
    from kvcal.corpus import MAX_LINE_BYTES, check_corpus
    from kvcal.errors import CorpusError

    big, ok = "x" * (MAX_LINE_BYTES + 1), "y" * 1000
    p = tmp_path / f"c.{kind}"
    if kind == "csv":
        p.write_text(f"text\n{ok}\n{big}\n")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": [ok, big]}), p)
    with pytest.raises(CorpusError, match=r"row 2: field 'text' is longer than the 8 MiB limit"):
        check_corpus(str(p))
    (tmp_path / "j.jsonl").write_text('{"text": "' + big + '"}\n')  # the JSONL bound it matches
    with pytest.raises(CorpusError, match="8 MiB"):
        check_corpus(str(tmp_path / "j.jsonl"))


def test_txt_token_bound_holds_and_refuses_a_short_corpus_before_anything_loads(tmp_path, smollm_tokenizer,
                                                                                 shared_data, monkeypatch):
    """``txt_token_bound`` (3·bytes + 1) is an upper bound of what evaluate's tokenization gives —
    checked on real text, multi-byte characters and invalid bytes with the embedded tokenizer — and
    `kvcal evaluate` refuses a .txt shorter than one window from it, after the artifact's own checks
    and before the tokenizer or model loads."""
    import kvcal.models
    from kvcal.corpus import txt_token_bound

    samples = {
        "wiki.txt": (shared_data / "wikitext2_valid.txt").read_bytes()[:20000],
        "unicode.txt": "naïve café — 東京 😀 ﬁ ㍻\n".encode() * 50,
        "invalid.txt": b"\xff\xfe\x80 abc \xc3\x28" * 40,
    }
    for name, raw in samples.items():
        (tmp_path / name).write_bytes(raw)
        text = raw.decode("utf-8", errors="replace")
        n = len(smollm_tokenizer(text, add_special_tokens=False).input_ids)
        assert n <= txt_token_bound(tmp_path / name), name
    assert txt_token_bound(tmp_path / "x.jsonl") is None

    def no_load(*a, **k):
        raise AssertionError("loaded something")

    monkeypatch.setattr(kvcal.models, "load_model", no_load)
    monkeypatch.setattr(kvcal.models, "load_tokenizer", no_load)
    (tmp_path / "short.txt").write_text("short text here.\n")
    art = Path(__file__).resolve().parents[2] / "artifacts" / "smollm2-135m-fp8"
    r = CliRunner().invoke(main, ["evaluate", "--artifact", str(art), "--corpus",
                                  str(tmp_path / "short.txt"), "--context", "1024"])
    assert r.exit_code == 2 and "has at most 52 tokens" in r.output and "Traceback" not in r.output
