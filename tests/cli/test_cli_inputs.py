"""Every input error before the expensive part; integer options at their extremes; fuzzed corpora and
artifact metadata through the CLI. The model loader is replaced by a recorder that raises, so a test
fails if a command reaches it with bad input (not a timing test), and nothing expensive ever runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from helpers.cli import LoaderCalled, fp8_artifact
from helpers.models import TINY_LLAMA_8, save_tiny_llama
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvcal.cli import main

VALUES = (-(2**63), -1, 0, 1, 2**63, 10**100)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm_tokenizer):
    """A 2-layer random Llama (max 128 positions) saved with the embedded model's tokenizer."""
    return save_tiny_llama(tmp_path_factory, smollm_tokenizer, "tiny", vocab_size=len(smollm_tokenizer), **TINY_LLAMA_8)


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_dir):
    """Valid inputs every case starts from."""
    d = tmp_path_factory.mktemp("inputs")
    (d / "c.jsonl").write_text("".join(json.dumps({"text": f"sample {i} about caches and keys"}) + "\n"
                                       for i in range(6)), encoding="utf-8")
    (d / "long.txt").write_text("Once upon a time a model cached keys and values. " * 40, encoding="utf-8")
    (d / "short.txt").write_text("Too short.\n", encoding="utf-8")
    return {"dir": d, "corpus": d / "c.jsonl", "long": d / "long.txt", "short": d / "short.txt",
            "art": fp8_artifact(d, tiny_dir), "other_art": fp8_artifact(d, tiny_dir, num_kv_heads=3)}


def _ok(r) -> None:
    """Exit 0 or 2, and never a traceback."""
    assert r.exit_code in (0, 2), (r.exit_code, r.output, r.exception)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output, r.output


# ---------------------------------------------------------------------------------------------- before the model


def _write(d: Path, name: str, text: str) -> str:
    (d / name).write_text(text, encoding="utf-8")
    return str(d / name)


def bad_cases(f, tiny_dir, tmp):
    """(id, argv, message regex) — each refused with exit 2 before the model loader is called."""
    cal = ["calibrate", "--model", str(tiny_dir), "--out", str(tmp / "out")]
    ev = ["evaluate", "--artifact", str(f["art"]), "--model", str(tiny_dir), "--context", "32"]
    import datasets

    datasets.Dataset.from_list([{"body": "some text here"}]).to_parquet(str(tmp / "c.parquet"))
    (tmp / "afile").write_text("x")
    return [
        ("unknown_extension", [*cal, "--corpus", _write(tmp, "c.xlsx", "x")], r"unknown corpus extension '\.xlsx'"),
        ("invalid_json", [*cal, "--corpus", _write(tmp, "bad.jsonl", '{"text": "ok fine"}\n{"text": }\n')],
         r"bad\.jsonl:2: invalid JSON"),
        ("no_known_field", [*cal, "--corpus", _write(tmp, "nf.jsonl", '{"body": "x"}\n')], r"nf\.jsonl:1: no known field"),
        ("chat_part_type", [*cal, "--corpus", _write(tmp, "p.jsonl", '{"messages": [{"role": "user", "content": [1]}]}\n')],
         r"p\.jsonl:1: messages\[0\]\.content\[0\] must be a content part"),
        ("missing_column", [*cal, "--corpus", str(tmp / "c.parquet"), "--text-field", "text"],
         r"c\.parquet:row 1: no 'text' field \(--text-field; keys: body\)"),
        ("split_on_file", [*cal, "--corpus", str(f["corpus"]), "--split", "test"], r"--split 'test' applies to datasets"),
        ("hub_id_not_cached", [*cal, "--corpus", "acme/never-downloaded"], r"not a dataset in the local Hugging Face cache; kvcal never downloads"),
        ("out_is_a_file", [*cal[:-1], str(tmp / "afile"), "--corpus", str(f["corpus"])], r"not a directory"),
        ("seed_negative", [*cal, "--corpus", str(f["corpus"]), "--seed", "-1"], r"--seed.*-1 is not in the range"),
        ("max_seq_len_past_model", [*cal, "--corpus", str(f["corpus"]), "--max-seq-len", "4096"],
         r"--max-seq-len 4096 exceeds the model's max_position_embeddings 128"),
        ("eval_short_corpus", [*ev, "--corpus", str(f["short"])], r"has \d+ tokens; context 32 needs at least 32"),
        ("eval_other_model", [*ev, "--corpus", str(f["long"]), "--artifact", str(f["other_art"])],
         r"num_kv_heads is 3 in the artifact but 2"),
        ("eval_bad_corpus", [*ev, "--corpus", _write(tmp, "e.jsonl", '["a"]\n')], r"e\.jsonl:1: expected a JSON object"),
        ("eval_context_past_model", [*ev[:-1], "1024", "--corpus", str(f["long"])], r"exceeds the model's"),
        ("eval_context_list_range", [*ev[:-1], "32,1", "--corpus", str(f["long"])], r"1 is not in the range 2<=x"),
        ("eval_json_unwritable", [*ev, "--corpus", str(f["long"]), "--json", str(tmp / "afile" / "e.json")],
         r"--json"),
    ]


def test_bad_inputs_fail_before_the_model_loads(no_model, files, tiny_dir, tmp_path):
    """Each of >= 15 bad CLI inputs exits 2 with its one-line message, before the (stubbed) model loader is
    called and without creating --out; valid inputs do reach the stub."""
    import re

    cases = bad_cases(files, tiny_dir, tmp_path)
    assert len(cases) >= 15
    for name, argv, pattern in cases:
        r = CliRunner().invoke(main, argv)
        _ok(r)
        assert r.exit_code == 2, (name, r.output)
        assert re.search(pattern, r.output), (name, r.output)
        assert not no_model, f"{name}: the model loader was called before the error ({r.output})"
        assert not (tmp_path / "out").exists(), name
    # the stub is really on the path: valid inputs reach it (and still leave nothing behind)
    for argv in (["calibrate", "--model", str(tiny_dir), "--out", str(tmp_path / "out"), "--corpus", str(files["corpus"]),
                  "--max-seq-len", "64"],
                 ["evaluate", "--artifact", str(files["art"]), "--model", str(tiny_dir), "--context", "32",
                  "--corpus", str(files["long"])]):
        r = CliRunner().invoke(main, argv)
        assert r.exit_code == 2 and "model loader reached (stub)" in r.output, r.output
    # the loader receives the ModelSource the preflight resolved (resolve_model runs once per command)
    assert [m.path for m in no_model] == [str(tiny_dir)] * 2
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------- integer extremes


def integer_options(cmd: click.Command) -> list[click.Option]:
    """Every integer option of a command: click INT / IntRange types and comma-separated integer lists."""
    return [p for p in cmd.params if isinstance(p, click.Option) and not p.is_flag and (
        isinstance(p.type, click.types.IntParamType) or hasattr(p.callback, "kvcal_int_list"))]


def base_args(files, tiny_dir, out: Path) -> dict[str, list[str]]:
    """Valid arguments per command; an integer option is then appended (the last value wins)."""
    return {
        "calibrate": ["calibrate", "--corpus", str(files["corpus"]), "--model", str(tiny_dir), "--out", str(out),
                      "--max-seq-len", "64"],
        "export": ["export", "--artifact", str(files["art"]), "--target", "sglang-json", "--out", str(out)],
        "inspect": ["inspect", str(files["art"])],
        "memory": ["memory", "--model", str(tiny_dir / "config.json"), "--format", "int4"],
        "plan": ["plan", "--model", str(tiny_dir / "config.json"), "--gpu-mem", "80GiB"],
        "evaluate": ["evaluate", "--artifact", str(files["art"]), "--corpus", str(files["long"]), "--model",
                     str(tiny_dir), "--context", "32"],
        "recommend": ["recommend", "--engine", "vllm", "--corpus", str(files["long"]), "--model", str(tiny_dir),
                      "--out", str(out), "--context", "32", "--probe-tokens", "64", "--windows", "1"],
        # no engine is started: the engine Python does not exist (a one-line refusal after the options are parsed)
        "verify": ["verify", str(tiny_dir), "--corpus", str(files["long"]), "--engine-python", str(out / "python")],
    }


def test_every_integer_option_at_its_extremes(no_model, files, tiny_dir, tmp_path, monkeypatch, smollm_tokenizer):
    """Every integer option of every command at -2^63, -1, 0, 1, 2^63, 10^100: exit 0 or 2, never a
    traceback, huge values refused by a range/error line, and no output left on failure."""
    import kvcal.models

    monkeypatch.setattr(kvcal.models, "load_tokenizer", lambda model, **kw: smollm_tokenizer)  # the same files, loaded once
    found = {name: integer_options(cmd) for name, cmd in main.commands.items()}
    assert sum(map(len, found.values())) >= 20
    n = 0
    for name, opts in found.items():
        for opt in opts:
            flag = max(opt.opts, key=len)
            for v in VALUES:
                out = tmp_path / f"out{n}"
                n += 1
                bases = base_args(files, tiny_dir, out)
                assert name in bases, f"add valid base arguments for `kvcal {name}` to base_args"
                r = CliRunner().invoke(main, [*bases[name], flag, str(v)])
                _ok(r)
                if r.exit_code == 2 and v in (-(2**63), 2**63, 10**100):
                    assert "range" in r.output or "exceeds" in r.output or "error:" in r.output, (flag, v, r.output)
                if r.exit_code != 0:
                    assert not out.exists(), (flag, v)
    assert n == 6 * sum(map(len, found.values()))


def test_sizes_with_units_at_extremes(tiny_dir):
    """--gpu-mem / --reserve (sizes with units, percentages) at the integer extremes, huge digit strings,
    non-finite floats: exit 0 or 2, never a traceback; past 2^63 - 1 bytes refused by name."""
    sizes = [f"{v}{u}" for v in VALUES for u in ("", "GiB", "KB")] + ["1" + "0" * 5000, "1e400GiB", "nanGiB", "inf"]
    for flag in ("--gpu-mem", "--reserve"):
        for v in sizes + (["-5%", "1e400%", "nan%", "1" + "0" * 5000 + "%"] if flag == "--reserve" else []):
            r = CliRunner().invoke(main, ["plan", "--model", str(tiny_dir / "config.json"), "--gpu-mem", "80GiB", flag, v])
            _ok(r)
    r = CliRunner().invoke(main, ["plan", "--model", str(tiny_dir / "config.json"), "--gpu-mem", str(2**63)])
    assert r.exit_code == 2 and "is more than 9223372036854775807 bytes (2^63 - 1, 8 EiB)" in r.output
    r = CliRunner().invoke(main, ["plan", "--model", str(tiny_dir / "config.json"), "--gpu-mem", str(2**63 - 1)])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("flag,value,lo,hi", [("--seed", "4294967296", 0, 2**32 - 1), ("--max-seq-len", "1", 2, 2**31 - 1),
                                              ("--batch-size", "0", 1, 2**31 - 1)])
def test_range_message_names_the_option_and_range(files, tiny_dir, tmp_path, flag, value, lo, hi):
    """An out-of-range --seed / --max-seq-len / --batch-size exits 2 with click's message naming the option
    and its range."""
    r = CliRunner().invoke(main, ["calibrate", "--corpus", str(files["corpus"]), "--model", str(tiny_dir), flag, value])
    assert r.exit_code == 2
    assert f"Invalid value for '{flag}': {value} is not in the range {lo}<=x<={hi}" in r.output


# ---------------------------------------------------------------------------------------------- fuzz

hypothesis = pytest.importorskip("hypothesis")

KEYS = ["text", "prompt", "completion", "response", "messages", "turns", "role", "content", "type", "tool_calls",
        "image_url", "id"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                    st.text(max_size=30), st.sampled_from(["user", "assistant", "system", "tool", "text", "wizard"]))
json_values = st.recursive(scalars, lambda c: st.one_of(
    st.lists(c, max_size=4), st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=6)), c, max_size=4)),
    max_leaves=20)
records = st.one_of(
    st.dictionaries(st.sampled_from(KEYS), json_values, max_size=3),
    st.fixed_dictionaries({"messages": st.lists(st.dictionaries(st.sampled_from(["role", "content", "tool_calls"]),
                                                                json_values, max_size=3), max_size=3)}),
    json_values)
lines = st.one_of(records.map(json.dumps), st.text(max_size=40))
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@pytest.fixture(scope="module")
def fuzz_env(tmp_path_factory, smollm_tokenizer):
    return tmp_path_factory.mktemp("fuzz")


def _calibrate(tiny_dir, corpus: Path, out: Path, extra=()):
    return CliRunner().invoke(main, ["calibrate", "--corpus", str(corpus), "--model", str(tiny_dir), "--out", str(out),
                                     "--max-seq-len", "64", *extra])


def _fuzz_calibrate(tiny_dir, fuzz_env, smollm_tokenizer, strategy, settings_, suffix: str, write) -> None:
    """Hypothesis over ``strategy``: ``write(path, example)`` writes a corpus; ``kvcal calibrate`` on it
    (model loader stubbed, the embedded tokenizer) exits 0 or 2 without a traceback and leaves no output."""
    import kvcal.models

    counter = iter(range(10**6))

    @settings_
    @given(strategy)
    def run(example):
        k = next(counter)
        corpus = fuzz_env / f"{suffix}{k}{'.jsonl' if suffix == 'f' else '.json'}"
        write(corpus, example)
        out = fuzz_env / f"{suffix}out{k}"
        _ok(_calibrate(tiny_dir, corpus, out))
        assert not out.exists()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kvcal.models, "load_model", lambda *a, **k: (_ for _ in ()).throw(LoaderCalled("stub")))
        mp.setattr(kvcal.models, "load_tokenizer", lambda model, **kw: smollm_tokenizer)
        run()


def test_fuzz_corpus_lines(tiny_dir, fuzz_env, smollm_tokenizer):
    """Hypothesis: a text corpus of arbitrary lines (surrogates included) makes calibrate exit 0 or 2
    without a traceback and leave no output."""
    _fuzz_calibrate(tiny_dir, fuzz_env, smollm_tokenizer, st.lists(lines, max_size=6), FUZZ, "f",
                    lambda p, body: p.write_text("\n".join(body) + "\n", encoding="utf-8", errors="surrogatepass"))


def test_fuzz_json_array_corpus_through_datasets(tiny_dir, fuzz_env, smollm_tokenizer):
    """Hypothesis: a JSON-array corpus of arbitrary records (read through datasets) makes calibrate exit 0
    or 2 without a traceback and leave no output."""
    _fuzz_calibrate(tiny_dir, fuzz_env, smollm_tokenizer, st.lists(records, max_size=4),
                    settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True),
                    "a", lambda p, rows: p.write_text(json.dumps(rows), encoding="utf-8"))


def _edit(meta, path: list, value, drop: bool):
    """``meta`` with the field at ``path`` (indices into nested keys/lists, taken modulo) replaced or removed."""
    if not path or not isinstance(meta, dict | list) or not meta:
        return value
    keys = list(meta) if isinstance(meta, dict) else list(range(len(meta)))
    k = keys[path[0] % len(keys)]
    out = dict(meta) if isinstance(meta, dict) else list(meta)
    if len(path) == 1 and drop:
        out.pop(k)
    else:
        out[k] = _edit(meta[k], path[1:], value, drop)
    return out


def test_fuzz_artifact_metadata_through_inspect_and_export(files, fuzz_env):
    """Hypothesis: artifact metadata with a field edited or dropped (rehashed or not) makes inspect and
    export exit 0 or 2 without a traceback; a failed export leaves no output."""
    from safetensors.torch import load_file, save_file

    from kvcal.artifact import CONTENT_HASH_KEY, content_sha256

    src = Path(files["art"])
    f = src / "kv_scales.safetensors"
    tensors = load_file(str(f))
    from safetensors import safe_open

    with safe_open(str(f), framework="pt") as fh:
        meta = json.loads(fh.metadata()["kvcal"])
    counter = iter(range(10**6))

    @FUZZ
    @given(st.lists(st.integers(0, 50), min_size=1, max_size=5), json_values, st.booleans(), st.booleans())
    def run(path, value, drop, rehash):
        k = next(counter)
        art = fuzz_env / f"art{k}"
        shutil.copytree(src, art)
        m = _edit(meta, path, value, drop)
        if rehash and isinstance(m, dict):  # past the edit check: the edited fields reach every reader
            m = {**m, CONTENT_HASH_KEY: content_sha256(m, tensors)}
        save_file(tensors, str(art / "kv_scales.safetensors"), metadata={"kvcal": json.dumps(m)})
        _ok(CliRunner().invoke(main, ["inspect", str(art)]))
        out = fuzz_env / f"exp{k}"
        r = CliRunner().invoke(main, ["export", "--artifact", str(art), "--target", "vllm", "--out", str(out)])
        _ok(r)
        if r.exit_code != 0:
            assert not out.exists()

    run()


# ---------------------------------------------------------------------------------------------- GGUF conversion cache


def test_gguf_cache_key_follows_the_file(tmp_path, monkeypatch):
    """The GGUF conversion cache key is stable for the same file and changes with its mtime or bytes; HF
    directories get no cache entry."""
    import os

    from kvcal.models import ModelSource, gguf_cache_dir

    monkeypatch.setenv("KVCAL_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + b"\0" * 60)
    src = ModelSource(str(f), str(tmp_path), f.name)
    a = gguf_cache_dir(src)
    assert a.parent == tmp_path / "cache" / "gguf" and gguf_cache_dir(src) == a
    os.utime(f, ns=(1, 1))  # same bytes, another mtime: another entry
    assert gguf_cache_dir(src) != a
    f.write_bytes(b"GGUF" + b"\0" * 61)
    assert gguf_cache_dir(src) != a
    assert gguf_cache_dir(ModelSource("d", str(tmp_path))) is None  # HF directories read their own files


@pytest.mark.model
def test_gguf_tokenizer_and_config_from_the_cache_equal_the_conversion(tmp_path, monkeypatch):
    """The embedded GGUF's tokenizer/config: converted once (5-15 s), then read from the cache (about 1 s):
    the same ids on every shipped chat and text corpus, the same chat template and the same model metadata."""
    from kvcal.models import load_model_config, load_tokenizer, model_metadata, resolve_model

    monkeypatch.setenv("KVCAL_CACHE", str(tmp_path))
    converted, cached = load_tokenizer(None), load_tokenizer(None)
    assert str(tmp_path) in cached.name_or_path and str(tmp_path) not in converted.name_or_path
    sets = Path(__file__).resolve().parents[2] / "calibration_sets"
    chats = [json.loads(line)["messages"] for line in (sets / "chat.jsonl").read_text().splitlines() if line.strip()]
    assert len(chats) == 44
    for m in chats:
        assert converted.apply_chat_template(m, tokenize=False) == cached.apply_chat_template(m, tokenize=False)
    text = (sets / "chat.txt").read_text()
    assert converted(text)["input_ids"] == cached(text)["input_ids"]
    assert converted.all_special_tokens == cached.all_special_tokens and len(converted) == len(cached)
    src = resolve_model(None)
    assert model_metadata(load_model_config(None), src) == model_metadata(load_model_config(None), src)


# ---------------------------------------------------------------------------------------------- end to end


def test_calibrate_and_evaluate_on_a_parquet_chat_log(tiny_dir, tmp_path):
    """A Parquet export of OpenAI-format chat logs through the real calibrate and evaluate (tiny model)."""
    import hashlib

    import datasets

    from kvcal.artifact import load_artifact

    rows = [{"messages": [{"role": "user", "content": [{"type": "text", "text": f"Question {i}: what is cached?"},
                                                       {"type": "image_url", "image_url": {"url": f"u{i}"}}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "Keys and values. " * (i + 3)}]}]}
            for i in range(8)]
    p = tmp_path / "logs.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(p))
    out = tmp_path / "art"
    r = CliRunner().invoke(main, ["calibrate", "--corpus", str(p), "--model", str(tiny_dir), "--out", str(out),
                                  "--max-seq-len", "64", "--batch-size", "4", "--quiet"])
    assert r.exit_code == 0, r.output
    assert "[messages; parquet]" in r.output and "dropped    8 image_url chat content part(s)" in r.output
    meta = load_artifact(out).metadata["corpus"]
    assert (meta["source"], meta["format"], meta["sha256"]) == ("parquet", "messages",
                                                                hashlib.sha256(p.read_bytes()).hexdigest())
    r = CliRunner().invoke(main, ["evaluate", "--artifact", str(out), "--corpus", str(p), "--model", str(tiny_dir),
                                  "--context", "32", "--windows", "1", "--no-baselines", "--mode", "teacher_forced",
                                  "--json", str(tmp_path / "e.json"), "--quiet"])
    assert r.exit_code in (0, 1), r.output
    assert json.loads((tmp_path / "e.json").read_text())["corpus"]["kind"] == "parquet"
