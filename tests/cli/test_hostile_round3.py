"""Hostile input: acceptance bars, comma-separated options, signals, special files,
environment variables and messages that tell the truth. Each case is refused in one line (exit 2) before
any model loads, or handled as docs/bad-input.md says."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from kvcal.cli import main
from kvcal.errors import KvcalError
from kvcal.options import parse_bar, split_list

ALL = ("ppl", "delta_ppl", "kl_mean", "kl_p999", "top1_agree", "greedy_agree", "greedy_prefix")


@pytest.fixture()
def corpus(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text("".join(f'{{"text": "sample number {i} with a few words in it"}}\n' for i in range(8)))
    return p


def one_error_line(r, *words):
    assert r.exit_code == 2, r.output
    lines = [x for x in r.output.strip().splitlines() if x.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in r.output, r.output
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


# ---- bars: only measured metrics, and a bar that can both pass and fail --------------------------------------
@pytest.mark.parametrize("bar, words", [
    ("greedy_agree>=0.5", ["'greedy_agree' is not measured by kvcal recommend", "generates no text",
                           "measures ppl, delta_ppl, kl_mean, kl_p999, top1_agree"]),
    ("greedy_prefix>=0.5", ["'greedy_prefix' is not measured by kvcal recommend"]),
    ("kl_mean<=-1", ["'kl_mean<=-1' can never pass", "kl_mean lies in [0, inf)"]),
    ("top1_agree>=2", ["'top1_agree>=2' can never pass", "[0, 1]"]),
    ("kl_mean<=1e999", ["'kl_mean<=1e999'", "not a finite number"]),
    ("top1_agree<=1", ["always passes"]),
    ("kl_mean>=0", ["always passes"]),
    ("kl_mean<=1e-3,kl_mean>=1e-2", ["can never pass together"]),
    ("kl_mean<=1e-2,", ["has an empty item"]),
    ("kl_mean<=1e-2,kl_mean<=1e-2", ["is named twice"]),
])
def test_recommend_refuses_bars_it_cannot_judge_before_the_model_loads(corpus, tmp_path, no_model, bar, words):
    """recommend refuses every --accept bar it cannot judge — a metric its rows never have (greedy_agree with
    --engine vllm) or a bound outside the metric's range (kl_mean<=-1, top1_agree>=2, kl_mean<=1e999) — in one
    line before the model loads, writing nothing."""
    out = tmp_path / "rec"
    r = CliRunner().invoke(main, ["recommend", "--engine", "vllm", "--corpus", str(corpus), "--out", str(out),
                                  "--accept", bar, "--quiet"])
    one_error_line(r, *words)
    assert no_model == [] and not out.exists()


@pytest.mark.parametrize("args, bar, words", [
    ([], "greedy_agree>=0.5", ["teacher-forced rows would fail it; add --mode decode"]),
    (["--mode", "decode", "--greedy-tokens", "0"], "greedy_prefix>=0.5", ["--greedy-tokens 0"]),
    (["--mode", "decode", "--vllm-dtype", "fp8"], "greedy_agree>=0.5", ["--vllm-dtype rows are teacher-forced"]),
    ([], "top1_agree>=2", ["can never pass"]),
    ([], "kl_mean<=1e999", ["not a finite number"]),
])
def test_evaluate_refuses_bars_it_cannot_judge(corpus, tmp_path, no_model, args, bar, words):
    """kvcal evaluate judges every row on every clause: a greedy clause with teacher-forced rows (the default
    modes) failed every such row; refused before the artifact or the model is read."""
    r = CliRunner().invoke(main, ["evaluate", "--artifact", str(tmp_path / "none"), "--corpus", str(corpus),
                                  "--accept", bar, *args])
    one_error_line(r, *words)
    assert no_model == []


def test_evaluate_decode_only_may_judge_greedy_agreement():
    """With --mode decode alone (greedy tokens on, no vLLM rows) every row carries greedy agreement."""
    from kvcal.cli.quality import evaluate_bar

    assert evaluate_bar("greedy_agree>=0.5,kl_mean<=1e-2", ("decode",), 32, ()) == [
        ("greedy_agree", ">=", 0.5), ("kl_mean", "<=", 1e-2)]


@pytest.mark.parametrize("bar", ["kl_mean<=0", "top1_agree>=1", "delta_ppl<=-0.5", "ppl<=1", "kl_mean>0",
                                 "top1_agree<1", "kl_mean<=1e-3,kl_mean>=1e-4"])
def test_bars_at_the_edge_of_the_range_are_accepted(bar):
    """Attainable bounds (KL exactly 0 with every layer at 16 bits, full agreement) stay accepted."""
    assert parse_bar(bar, ALL, "kvcal evaluate")


def test_verify_metric_list_is_the_one_it_measures():
    """kvcal verify names its own metrics (no greedy agreement): the list parse_bar is given."""
    with pytest.raises(KvcalError, match="'greedy_agree' is not measured by kvcal verify"):
        parse_bar("greedy_agree>=0.5", ALL[:5], "kvcal verify")


# ---- one parser for every comma-separated option -------------------------------------------------------------
@pytest.mark.parametrize("value, words", [
    ("", "is empty"), (" ", "is empty"), (",", "is empty"), (",,", "is empty"),
    ("a,,b", "has an empty item"), ("a,", "has an empty item"), (",a", "has an empty item"),
    ("a,a", "'a' is named twice"),
])
def test_split_list_rules(value, words):
    """split_list refuses an empty value (empty, blank or only commas: "is empty"), an empty item at either end or
    between commas ("has an empty item") and an item named twice, each with a one-line KvcalError that starts with the
    option's name."""
    with pytest.raises(KvcalError, match=words) as e:
        split_list(value, "--x", "thing", "a,b")
    assert "\n" not in str(e.value) and str(e.value).startswith("--x")


@pytest.mark.parametrize("cmd, opt", [
    (["evaluate", "--artifact", "A", "--corpus", "{c}"], "--vllm-dtype"),
    (["evaluate", "--artifact", "A", "--corpus", "{c}"], "--mode"),
    (["recommend", "--engine", "vllm", "--corpus", "{c}", "--out", "{o}"], "--dtypes"),
    (["plan", "--gpu-mem", "80GiB"], "--kv-config"),
    (["memory", "--format", "vllm:fp8"], "--skip-layers"),
    (["calibrate", "--corpus", "{c}", "--out", "{o}", "--engine", "vllm", "--kv-cache-dtype", "fp8"], "--skip-layers"),
    (["evaluate", "--artifact", "A", "--corpus", "{c}"], "--accept"),
    (["recommend", "--engine", "vllm", "--corpus", "{c}", "--out", "{o}"], "--accept"),
])
@pytest.mark.parametrize("value", [",", "", "x,,y"])
def test_every_comma_option_refuses_empty_lists_alike(corpus, tmp_path, no_model, cmd, opt, value):
    """Every comma-separated option refuses an empty list or an empty item alike (kvcal.options.split_list):
    exit 2, one line naming the option, before the model loads, nothing written."""
    args = [a.format(c=corpus, o=tmp_path / "o") for a in cmd] + [opt, value]
    r = CliRunner().invoke(main, args)
    line = one_error_line(r, opt)
    assert ("is empty" in line) if value.strip(",") == "" else ("has an empty item" in line)
    assert no_model == [] and not (tmp_path / "o").exists()


@pytest.mark.parametrize("opt", ["--context", "--batch"])
@pytest.mark.parametrize("value, words", [(",", "is empty"), ("64,64", "is named twice"), ("64,,32", "empty item")])
def test_integer_lists_follow_the_same_rules(corpus, opt, value, words):
    """evaluate's integer lists --context and --batch follow split_list's rules: "," is refused as "is empty", "64,64"
    as "is named twice" and "64,,32" as having an "empty item", each with exit 2 and no traceback."""
    r = CliRunner().invoke(main, ["evaluate", "--artifact", "A", "--corpus", str(corpus), opt, value])
    assert r.exit_code == 2 and words in r.output and "Traceback" not in r.output


# ---- every suggestion can be followed as written ------------------------------------------------------------
def _export_options() -> set[str]:
    return {o for p in main.commands["export"].params for o in p.opts}


@pytest.mark.parametrize("vllm_calibrated, clipped_scales", [(True, False), (True, True), (False, True)])
def test_export_suggestions_name_only_flags_the_user_can_act_on(tmp_path, vllm_calibrated, clipped_scales):
    """A vLLM checkpoint whose searched scales clip names the flag that gives SGLang-safe scales (--clip-free),
    never "drop --clipped-scales" (the searched scales are --target vllm's default whether or not it was given);
    every option its messages name is one `kvcal export` has, and a suggested --headroom is accepted."""
    import re

    from helpers.export import make_artifact

    from kvcal.artifact import load_artifact
    from kvcal.export import export

    path, _ = make_artifact(tmp_path / "art", clip=0.8)
    art = load_artifact(path)
    if vllm_calibrated:
        art.metadata["vllm"] = {"kv_cache_dtype": "fp8"}  # what calibrate --engine vllm --kv-cache-dtype fp8 records
    res = export(art, "vllm", tmp_path / "out", clipped_scales=clipped_scales)
    text = "\n".join(res.warnings + res.notes)
    assert any("without saturating" in w for w in res.notes)  # the clip is still reported for SGLang
    assert "--clip-free" in text and "without --clipped-scales" not in text, text
    # flags inside a quoted command of another subcommand (`kvcal calibrate ...`) are that command's, not export's
    own = re.sub(r"`kvcal (?!export)[a-z]+[^`]*`", "", text)
    assert set(re.findall(r"(?<!calibrate )(--[a-z][a-z-]+)", own)) <= _export_options(), text
    for m in set(re.findall(r"--headroom ([0-9.]+)", text)):
        export(art, "vllm", tmp_path / f"h{m}", headroom=float(m))


# ---- SIGTERM / SIGHUP clean up like Ctrl-C --------------------------------------------------------------------
def test_every_command_handles_errors_and_signals():
    """Every command runs under kvcal.cli.common.user_errors, which turns SIGTERM / SIGHUP into the Ctrl-C path."""
    assert [n for n, c in main.commands.items() if not getattr(c.callback, "kvcal_user_errors", False)] == []


@pytest.mark.parametrize("signame, status", [("SIGTERM", 143), ("SIGHUP", 129)])
@pytest.mark.parametrize("command", ["export", "report"])
def test_a_terminating_signal_mid_write_leaves_nothing_and_says_so(tmp_path, monkeypatch, signame, status, command):
    """A terminating signal (SIGTERM as from timeout, kill or docker stop) while a temporary output
    `.OUT.tmp-XXXXXXXX/` exists arrives as kvcal.errors.Terminated (a KeyboardInterrupt): the temporary output
    is removed, one line says what happened, the exit status is 128 + the signal number, and the handlers are
    restored afterwards."""
    import os
    import signal

    from helpers.export import make_artifact

    import kvcal.outputs

    art, _ = make_artifact(tmp_path / "art")
    work = tmp_path / "work"
    work.mkdir()
    sig = getattr(signal, signame)
    # run as from a terminal: the signal's default action in force (under `nohup` SIGHUP arrives ignored, and kvcal
    # rightly leaves an ignored SIGHUP ignored: test_an_ignored_sighup_stays_ignored)
    outer = signal.signal(sig, signal.SIG_DFL)
    before = signal.getsignal(sig)
    real_replace = os.replace

    def killed(src, dst):  # the output is complete in its temporary path: the signal lands before the rename
        os.kill(os.getpid(), sig)
        return real_replace(src, dst)

    real_claim = kvcal.outputs._rename_noreplace

    def killed_claim(src, dst):  # a new --out is claimed by a no-replace rename: the signal lands before it
        os.kill(os.getpid(), sig)
        return real_claim(src, dst)

    monkeypatch.setattr(kvcal.outputs.os, "replace", killed)
    monkeypatch.setattr(kvcal.outputs, "_rename_noreplace", killed_claim)
    args = (["export", "--artifact", str(art), "--target", "vllm", "--out", str(work / "out")] if command == "export"
            else ["report", "--artifact", str(art), "--out", str(work / "out")])
    try:
        r = CliRunner().invoke(main, args)
        after = signal.getsignal(sig)
    finally:
        monkeypatch.undo()
        signal.signal(sig, outer)
    assert r.exit_code == status, r.output
    assert f"terminated by {signame}: nothing was written" in r.output and "Traceback" not in r.output
    left = [p.name for p in work.rglob("*")]
    assert [n for n in left if ".tmp-" in n] == [], left
    assert after == before


def test_an_ignored_sighup_stays_ignored(tmp_path, monkeypatch):
    """Under `nohup` (SIGHUP ignored by the parent) a hangup mid-write does not stop kvcal: the export completes
    (exit 0, its files written, no temporary left) and SIGHUP is still ignored afterwards."""
    import os
    import signal

    from helpers.export import make_artifact

    import kvcal.outputs

    art, _ = make_artifact(tmp_path / "art")
    work = tmp_path / "work"
    work.mkdir()
    outer = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    real_replace = os.replace

    def hung_up(src, dst):
        os.kill(os.getpid(), signal.SIGHUP)
        return real_replace(src, dst)

    monkeypatch.setattr(kvcal.outputs.os, "replace", hung_up)
    try:
        r = CliRunner().invoke(main, ["export", "--artifact", str(art), "--target", "vllm", "--out", str(work / "out")])
        after = signal.getsignal(signal.SIGHUP)
    finally:
        monkeypatch.undo()
        signal.signal(signal.SIGHUP, outer)
    assert r.exit_code == 0, r.output
    assert (work / "out" / "kvcal-kv-scales.safetensors").is_file()
    assert [p.name for p in work.rglob("*") if ".tmp-" in p.name] == []
    assert after == signal.SIG_IGN


def test_sigterm_during_calibrate_says_how_to_resume(tmp_path, corpus, monkeypatch):
    """calibrate's own interrupt message (resume hint) reports SIGTERM as such, exit 143."""
    import os
    import signal
    from pathlib import Path

    import kvcal.calibrate as cal

    out = tmp_path / "a"

    def killed(cfg, **kw):
        Path(cal.checkpoint_path(str(out))).write_bytes(b"x")
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(cal, "calibrate", killed)
    r = CliRunner().invoke(main, ["calibrate", "--corpus", str(corpus), "--out", str(out), "--checkpoint-every", "5"])
    assert r.exit_code == 143, r.output
    assert "terminated by SIGTERM: no artifact was written; resume with the same command plus --resume" in r.output
    assert not out.exists()


# ---- special files: binary formats named as text, an empty table, a decompression bomb ------------------------
def _parquet(path, texts):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": pa.array(texts, pa.string())}), path)
    return path


def _make(kind, d):
    import gzip
    import json

    rows = "".join(json.dumps({"text": f"sample {i} with a few words"}) + "\n" for i in range(4)).encode()
    if kind == "parquet_as_jsonl":
        return _parquet(d / "data.jsonl", ["a b c", "d e f"])
    if kind == "gzip_as_jsonl":
        (d / "data.jsonl").write_bytes(gzip.compress(rows))
        return d / "data.jsonl"
    if kind == "text_as_gz":
        (d / "data.jsonl.gz").write_bytes(rows)
        return d / "data.jsonl.gz"
    if kind == "parquet_in_gz":
        (d / "data.jsonl.gz").write_bytes(gzip.compress(_parquet(d / "x.parquet", ["a b"]).read_bytes()))
        return d / "data.jsonl.gz"
    if kind == "gzip_parquet_as_jsonl":
        (d / "data.jsonl").write_bytes(gzip.compress(_parquet(d / "x.parquet", ["a b"]).read_bytes()))
        return d / "data.jsonl"
    if kind == "gguf_as_txt":
        (d / "data.txt").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 64)
        return d / "data.txt"
    if kind == "safetensors_as_jsonl":
        hdr = json.dumps({"__metadata__": {"format": "pt"}}).encode()
        (d / "data.jsonl").write_bytes(len(hdr).to_bytes(8, "little") + hdr)
        return d / "data.jsonl"
    if kind == "zip_as_csv":
        import zipfile

        with zipfile.ZipFile(d / "data.csv", "w") as z:
            z.writestr("a.csv", "text\nhello\n")
        return d / "data.csv"
    if kind == "arrow_as_jsonl":
        import pyarrow as pa

        with pa.OSFile(str(d / "data.jsonl"), "wb") as f, pa.ipc.new_file(f, pa.schema([("text", pa.string())])) as w:
            w.write_table(pa.table({"text": ["a b c"]}))
        return d / "data.jsonl"
    if kind == "utf16_jsonl":
        (d / "data.jsonl").write_bytes(rows.decode().encode("utf-16"))
        return d / "data.jsonl"
    if kind == "text_as_parquet":
        (d / "data.parquet").write_bytes(rows)
        return d / "data.parquet"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind, words", [
    ("parquet_as_jsonl", ["is a Parquet file, not JSONL text", "give it the .parquet extension"]),
    ("gzip_as_jsonl", ["is gzip-compressed data", "give it the .jsonl.gz extension"]),
    ("text_as_gz", ["is JSON lines text, not gzip-compressed", "give it the .jsonl extension"]),
    ("parquet_in_gz", ["decompresses to a Parquet file", ".parquet extension"]),
    ("gzip_parquet_as_jsonl", ["is gzip-compressed data holding a Parquet file", "gunzip", ".parquet extension"]),
    ("gguf_as_txt", ["is a GGUF model file", "--model"]),
    ("safetensors_as_jsonl", ["is a safetensors file"]),
    ("zip_as_csv", ["is a zip archive"]),
    ("arrow_as_jsonl", ["is an Arrow IPC file", ".arrow extension"]),
    ("utf16_jsonl", ["is UTF-16 text", "iconv -f utf-16 -t utf-8"]),
    ("text_as_parquet", ["is JSON lines text, not a Parquet file", ".jsonl extension"]),
])
def test_binary_files_are_named_by_their_first_bytes(tmp_path, no_model, kind, words):
    """A binary corpus file (e.g. Parquet named data.jsonl) is recognised by its first bytes before any text is
    decoded: the one-line message names what the file is, and nothing suggests a latin1 re-encoding (which would
    corrupt it)."""
    path = _make(kind, tmp_path)
    r = CliRunner().invoke(main, ["calibrate", "--corpus", str(path), "--out", str(tmp_path / "o")])
    line = one_error_line(r, str(path), *words)
    assert "latin1" not in line and no_model == [] and not (tmp_path / "o").exists()


def test_non_utf8_text_is_not_told_to_assume_latin1(tmp_path):
    """A cp1252-encoded JSONL line ("café") is refused by check_corpus with a CorpusError naming the file, line 1 and
    the offending byte 0xe9, telling the user to re-encode it from the encoding it was written in, and never suggesting
    latin1."""
    from kvcal.corpus import check_corpus
    from kvcal.errors import CorpusError

    p = tmp_path / "c.jsonl"
    p.write_bytes('{"text": "café"}\n'.encode("cp1252"))
    with pytest.raises(CorpusError, match=r"c.jsonl:1: not valid UTF-8 \(byte 0xe9") as e:
        check_corpus(str(p))
    assert "latin1" not in str(e.value) and "the encoding it was written in" in str(e.value)


def test_a_zero_row_parquet_file_has_no_samples(tmp_path, no_model):
    """A valid Parquet file with zero rows is refused by calibrate and recommend in one line as holding no
    samples, not as an unreadable parquet file."""
    p = _parquet(tmp_path / "empty.parquet", [])
    for cmd in (["calibrate", "--corpus", str(p), "--out", str(tmp_path / "o")],
                ["recommend", "--engine", "vllm", "--corpus", str(p), "--out", str(tmp_path / "o")]):
        line = one_error_line(CliRunner().invoke(main, cmd), f"{p}: no samples: the parquet data holds no rows")
        assert "valid parquet" not in line and "ArrowInvalid" not in line
    assert no_model == [] and not (tmp_path / "o").exists()


def test_a_decompression_bomb_is_refused_at_the_bound(tmp_path, no_model, monkeypatch):
    """A compressed corpus is read only up to kvcal.corpus.MAX_DECOMPRESSED_BYTES (or MAX_EXPANSION x its size,
    whichever is more): past it, one line within seconds (even with --max-samples 2), before the model loads;
    within it, the file is read to its end. Here the bound is lowered to 1 MiB so that the test writes 4 MiB."""
    import gzip
    import time

    import kvcal.corpus.sources as C

    monkeypatch.setattr(C, "MAX_DECOMPRESSED_BYTES", 1 << 20)
    p = tmp_path / "bomb.jsonl.gz"
    line = b'{"text": "the same line again and again"}\n'
    with gzip.open(p, "wb") as f:
        f.write(line * ((4 << 20) // len(line)) + b"not json\n")
    assert p.stat().st_size * C.MAX_EXPANSION < 1 << 20  # the fixed bound applies, not the ratio
    t0 = time.perf_counter()
    r = CliRunner().invoke(main, ["calibrate", "--corpus", str(p), "--max-samples", "2", "--out", str(tmp_path / "o")])
    one_error_line(r, "bomb.jsonl.gz:", "expands past 1 MiB when decompressed", "zcat")
    assert time.perf_counter() - t0 < 10 and no_model == [] and not (tmp_path / "o").exists()
    monkeypatch.setattr(C, "MAX_DECOMPRESSED_BYTES", 16 << 20)  # within the bound: read to the end, bad line named
    r = CliRunner().invoke(main, ["calibrate", "--corpus", str(p), "--max-samples", "2", "--out", str(tmp_path / "o")])
    one_error_line(r, "invalid JSON")


# ---- the environment is input too -----------------------------------------------------------------------------
TORCHRUN = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("env, words", [
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' is not an integer >= 1"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0' is not an integer >= 1"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE='2' asks for 2 processes, but RANK is not set"),
    ({**TORCHRUN, "RANK": "2"}, "RANK='2' is not an integer in [0, 1]"),
    ({**TORCHRUN, "RANK": "x"}, "RANK='x'"),
    ({**TORCHRUN, "LOCAL_RANK": "-1"}, "LOCAL_RANK='-1'"),
    ({**TORCHRUN, "MASTER_PORT": "99999"}, "MASTER_PORT='99999' is not an integer in [1, 65535]"),
    ({**TORCHRUN, "MASTER_ADDR": ""}, "MASTER_ADDR is not set"),
    ({"KVCAL_KERNELS": "cuda"}, "KVCAL_KERNELS='cuda' is not one of auto, torch, triton"),
])
def test_environment_variables_are_validated_in_one_line(corpus, tmp_path, monkeypatch, no_model, env, words):
    """torchrun's environment variables (e.g. WORLD_SIZE=abc) and kvcal's own are validated before the model
    loads, each refused in one line naming the variable."""
    for k in (*TORCHRUN, "LOCAL_WORLD_SIZE", "KVCAL_KERNELS"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    r = CliRunner().invoke(main, ["calibrate", "--corpus", str(corpus), "--out", str(tmp_path / "o")])
    one_error_line(r, "environment variable", words)
    assert no_model == [] and not (tmp_path / "o").exists()


def test_kvcal_cache_pointing_at_a_file_is_named(tmp_path, monkeypatch):
    """KVCAL_CACHE set to an existing regular file makes ``kvcal memory`` exit 2 with one error line naming the variable
    and saying it is a file, not a directory."""
    f = tmp_path / "file"
    f.write_text("x")
    monkeypatch.setenv("KVCAL_CACHE", str(f))
    r = CliRunner().invoke(main, ["memory", "--format", "int4"])
    one_error_line(r, "KVCAL_CACHE=", "is a file, not a directory")


def test_kernel_backend_names_agree():
    """The KVCAL_KERNELS values the environment check accepts (kvcal.options.KERNEL_BACKENDS) are exactly the kernel
    backends kvcal.kernels defines (BACKENDS), in the same order."""
    from kvcal.kernels import BACKENDS
    from kvcal.options import KERNEL_BACKENDS

    assert KERNEL_BACKENDS == BACKENDS


def test_a_valid_torchrun_environment_passes_the_check():
    """check_distributed_environment accepts a complete torchrun environment (WORLD_SIZE 2, RANK 0, LOCAL_RANK 0,
    MASTER_ADDR, MASTER_PORT 29500) and returns its world size 2; with none of the variables set it returns 1."""
    from kvcal.options import check_distributed_environment

    assert check_distributed_environment(TORCHRUN) == 2 and check_distributed_environment({}) == 1


def test_triton_kernels_asked_for_without_triton_is_named(monkeypatch):
    """KVCAL_KERNELS=triton without triton installed was a ValueError mid-run; now one line before any work."""
    import importlib.util

    from kvcal.options import check_environment

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    with pytest.raises(KvcalError, match=r"KVCAL_KERNELS='triton' asks for the Triton kernels, but triton is not inst"):
        check_environment({"KVCAL_KERNELS": "triton"})


# ---- recommend's output is kvcal's output ----------------------------------------------------------------------
def _fake_recommend_output(d):
    import json

    from helpers.export import make_artifact

    make_artifact(d / "artifact")  # recommend writes its artifact, then deploy.json
    (d / "deploy.json").write_text(json.dumps({"schema": "kvcal-recommend/1", "passed": True}) + "\n")
    (d / "deploy.md").write_text("# deploy\n")
    return d


def test_recommend_recognises_its_own_output_and_offers_overwrite(corpus, tmp_path, no_model):
    """`recommend --out O` onto its own earlier output recognises it as kvcal's: without --overwrite it is
    refused naming --overwrite; with it the run goes ahead (here: to the stubbed model loader)."""
    out = _fake_recommend_output(tmp_path / "rec")
    base = ["recommend", "--engine", "vllm", "--corpus", str(corpus), "--out", str(out), "--context", "16",
            "--probe-tokens", "16", "--windows", "1"]
    line = one_error_line(CliRunner().invoke(main, base), "already exists (a kvcal output); pass --overwrite")
    assert "did not write" not in line and no_model == []
    r = CliRunner().invoke(main, [*base, "--overwrite"])
    one_error_line(r, "model loader reached")  # every check passed: the run would replace it
    assert no_model and (out / "deploy.json").is_file()  # untouched until a new output is complete
    assert "--overwrite" in {o for p in main.commands["recommend"].params for o in p.opts}
    from kvcal.outputs import RECOMMEND_DOC, RECOMMEND_SCHEMA_PREFIX
    from kvcal.recommend import SCHEMA

    assert SCHEMA.startswith(RECOMMEND_SCHEMA_PREFIX) and RECOMMEND_DOC == "deploy.json"  # what recommend writes


@pytest.mark.parametrize("case, words", [
    ("foreign_file", "holds 1 file(s) kvcal did not write (first: notes.txt)"),
    ("artifact", "holds a kvcal calibration artifact (kv_scales.safetensors), not a kvcal recommend output"),
    ("inside", "lies inside"),
    ("foreign_in_checkpoint", "holds 1 file(s) kvcal did not write (first: checkpoint/mine.txt)"),
])
def test_recommend_overwrite_keeps_the_contract(corpus, tmp_path, no_model, case, words):
    """The same --overwrite contract as calibrate/export: never a directory holding a file kvcal did not write,
    never an output of another kind, never a new output nested inside one."""
    from helpers.export import make_artifact

    out = tmp_path / "rec"
    if case == "foreign_file":
        _fake_recommend_output(out)
        (out / "notes.txt").write_text("mine")
    elif case == "artifact":
        make_artifact(out)
    elif case == "inside":
        make_artifact(tmp_path / "outer")
        out = tmp_path / "outer" / "rec"
    else:  # the checkpoint recommend's export line writes inside its output is kvcal's, a file added to it is not
        _fake_recommend_output(out)
        art, _ = make_artifact(tmp_path / "art")
        assert CliRunner().invoke(main, ["export", "--artifact", str(art), "--target", "vllm", "--out",
                                         str(out / "checkpoint")]).exit_code == 0
        (out / "checkpoint" / "mine.txt").write_text("mine")
    r = CliRunner().invoke(main, ["recommend", "--engine", "vllm", "--corpus", str(corpus), "--out", str(out),
                                  "--overwrite"])
    one_error_line(r, words)
    assert no_model == []


def test_export_does_not_overwrite_a_recommend_output(tmp_path):
    """export --overwrite onto a directory holding a kvcal recommend output is refused in one line (exit 2) that names
    it a recommend output, not a kvcal export, and its deploy.json is left in place."""
    from helpers.export import make_artifact

    rec = _fake_recommend_output(tmp_path / "rec")
    art, _ = make_artifact(tmp_path / "art")
    r = CliRunner().invoke(main, ["export", "--artifact", str(art), "--target", "vllm", "--out", str(rec),
                                  "--overwrite"])
    one_error_line(r, "holds a kvcal recommend output (deploy.json), not a kvcal export")
    assert (rec / "deploy.json").is_file()


# ---- beyond the 13: special files and CSV dialects (the classes the issue names) -------------------------------
@pytest.mark.parametrize("kind, words", [
    ("fifo", "is a named pipe (FIFO), not a regular file"),
    ("device", "is a character device, not a regular file"),
])
def test_pipes_and_devices_are_refused_without_reading(tmp_path, no_model, kind, words):
    """A named pipe as --corpus blocked forever without a writer (and can be read only once: kvcal reads a corpus
    twice); /dev/zero under a corpus name never ends. Refused from its file type, nothing read."""
    import os
    import time

    p = tmp_path / "c.jsonl"
    if kind == "fifo":
        os.mkfifo(p)
    else:
        p.symlink_to("/dev/zero")
    t0 = time.perf_counter()
    r = CliRunner().invoke(main, ["calibrate", "--corpus", str(p), "--out", str(tmp_path / "o")])
    one_error_line(r, words, "save it to a file first")
    assert time.perf_counter() - t0 < 10 and no_model == []


@pytest.mark.parametrize("header, words", [
    ("text;id", "holds semicolons: a semicolon-separated file read as comma-separated CSV"),
    ("text\tid", "holds tabs: a tab-separated file"),
    ("Text,id", "field names are exact, 'Text' is not 'text'; pass --text-field Text"),
])
def test_csv_dialects_are_named(tmp_path, no_model, header, words):
    """A semicolon- or tab-separated .csv was "no known field (keys: text;id)"; a capitalised header named no fix."""
    p = tmp_path / "c.csv"
    sep = ";" if ";" in header else "\t" if "\t" in header else ","
    p.write_text(header + "\n" + f"hello world here{sep}1\n")
    r = CliRunner().invoke(main, ["calibrate", "--corpus", str(p), "--out", str(tmp_path / "o")])
    one_error_line(r, words)
    assert no_model == []


@pytest.mark.parametrize("bar, words", [("kl_mean<=-1", "can never pass"), ("top1_agree>=2", "can never pass"),
                                        ("kl_mean<=1e999", "not a finite number"),
                                        ("greedy_agree>=0.5", "not measured by verify")])
def test_verify_refuses_the_same_bars(corpus, tmp_path, bar, words):
    """kvcal verify judges served rows on --accept: the same rules as evaluate and recommend, before any engine."""
    r = CliRunner().invoke(main, ["verify", str(tmp_path / "ckpt"), "--corpus", str(corpus), "--engine-python",
                                  "/nonexistent/python", "--accept", bar])
    one_error_line(r, words)
