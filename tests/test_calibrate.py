"""End to end on the embedded SmolLM2-135M: calibrate on real prompts, check the artifact."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
from click.testing import CliRunner

from kvcal.artifact import load_artifact
from kvcal.calibrate import CalibrateConfig, calibrate
from kvcal.cli import main
from kvcal.plan import tensor_name

pytestmark = pytest.mark.model


def _check(meta: dict, tensors: dict, granularity: str):
    assert meta["model"]["num_layers"] == 30
    assert meta["kv"]["key_position"] == "post_rope"
    assert meta["kv"]["k"]["format"] == "fp8_e4m3" and meta["kv"]["k"]["granularity"] == granularity
    shape = (1,) if granularity == "tensor" else (3, 1, 1)
    for i in range(30):
        for side in ("k", "v"):
            s = tensors[tensor_name(i, side)]
            assert tuple(s.shape) == shape and s.dtype == torch.float32
            assert torch.isfinite(s).all() and (s > 0).all()
            h = meta["layers"][i][side]["heldout"]
            assert h["chosen"] <= h["absmax"] + 1e-12, (i, side, h)
            assert h["chosen"] <= h["unity"] + 1e-12, (i, side, h)
    assert len(meta["layers"]) == 30


def _mt_bench_renderings(path, tokenizer, max_seq_len: int) -> list[list[int]]:
    """Independent reference, one per line of MT-Bench's questions file: the tokenizer's own
    ``apply_chat_template(..., tokenize=True, add_generation_prompt=True)`` of the user turns with an empty
    assistant reply between them (what kvcal's ``turns`` format documents), cut to ``max_seq_len`` tokens."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        conv: list[dict] = []
        for i, turn in enumerate(json.loads(line)["turns"]):
            if i:
                conv.append({"role": "assistant", "content": ""})
            conv.append({"role": "user", "content": turn})
        ids = tokenizer.apply_chat_template(conv, tokenize=True, add_generation_prompt=True)["input_ids"]
        out.append(list(ids)[:max_seq_len])
    return out


def _assert_chat_template_applied(corp: dict, cfg, tokenizer) -> None:
    """The samples kvcal calibrated on (the same seeded subset, reloaded) equal, in file order, the chat-template
    renderings of distinct MT-Bench lines, each starting with <|im_start|>; the artifact's recorded token
    count is the sum of those renderings' lengths and differs from the plain-text tokenization's."""
    from pathlib import Path

    from kvcal.corpus import load_corpus

    path = Path(cfg.corpus)
    want = _mt_bench_renderings(path, tokenizer, cfg.max_seq_len)
    got = load_corpus(cfg.corpus, tokenizer, max_seq_len=cfg.max_seq_len, max_samples=cfg.max_samples,
                      seed=cfg.seed).samples
    assert len(got) == corp["samples"]
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    lines, j = [], 0
    for sample in got:
        while j < len(want) and want[j] != sample.tolist():
            j += 1
        assert j < len(want), "a calibration sample is no chat-template rendering of an MT-Bench line"
        assert want[j][0] == start
        lines.append(j)
        j += 1
    assert corp["tokens"] == sum(len(want[i]) for i in lines)
    rows = path.read_text(encoding="utf-8").splitlines()
    plain = sum(min(len(tokenizer("\n".join(json.loads(rows[i])["turns"]))["input_ids"]), cfg.max_seq_len)
                for i in lines)
    assert plain != corp["tokens"]  # the check tells a templated corpus from a plain one


def test_calibrate_mt_bench_chat_template(tmp_path, shared_data, smollm_model, smollm_tokenizer):
    """FP8 per-tensor calibration of SmolLM2 on 12 MT-Bench prompts writes 30 layers of positive finite
    float32 scales whose held-out KL is no worse than absmax and unity, records format turns, 3 held-out
    samples and the candidate set searched, and its report names the weight and KV precisions and the
    corpus. The chat template was applied: every calibration sample is, token for token, the tokenizer's
    own apply_chat_template rendering of one MT-Bench line (see _mt_bench_renderings), and the recorded
    token count is the sum of those renderings' lengths (plain text of the turns would give another)."""
    out = tmp_path / "art"
    cfg = CalibrateConfig(corpus=str(shared_data / "mt_bench_questions.jsonl"), out=str(out), max_samples=12,
                          max_seq_len=160, reservoir=4, heldout_reservoir=3, max_queries=48, seed=0)
    res = calibrate(cfg, log=lambda s: None, progress=False, model=smollm_model, tokenizer=smollm_tokenizer)
    art = load_artifact(out)
    _check(art.metadata, art.tensors, "tensor")
    corp = art.metadata["corpus"]
    assert corp["format"] == "turns" and corp["samples"] == 12
    _assert_chat_template_applied(corp, cfg, smollm_tokenizer)
    assert art.metadata["calibration"]["heldout_samples"] == 3
    # the metadata names the candidate set that was actually searched (not a stale literal)
    assert art.metadata["calibration"]["candidates"] == ("absmax, unity, otf (amax/200 K, amax/100 V), clip 0.95, 0.9, "
                                                         "0.8, headroom 1.25, 1.5, 2, 4")
    report = (out / "report.md").read_text()
    assert "Weight precision" in report and "Q4_1" in report and "fp8_e4m3" in report
    assert "mt_bench_questions.jsonl" in report
    assert res["table"].count("\n") == 30


def test_calibrate_wikitext_per_head(tmp_path, shared_data, smollm_model, smollm_tokenizer):
    """FP8 per-head calibration of SmolLM2 on WikiText-2 text writes a [3, 1, 1] positive finite float32 scale
    per layer and side (held-out KL no worse than absmax and unity) and records the txt corpus format."""
    out = tmp_path / "art_head"
    cfg = CalibrateConfig(corpus=str(shared_data / "wikitext2_valid.txt"), out=str(out), max_samples=10,
                          max_seq_len=192, granularity="head", reservoir=4, heldout_reservoir=3, max_queries=48)
    calibrate(cfg, log=lambda s: None, progress=False, model=smollm_model, tokenizer=smollm_tokenizer)
    art = load_artifact(out)
    _check(art.metadata, art.tensors, "head")
    assert art.metadata["corpus"]["format"] == "txt"


def test_cli_calibrate_bad_corpus_is_one_line_and_writes_nothing(tmp_path):
    """A corpus with invalid JSON on line 2 gives exit 2 and one error line naming bad.jsonl:2, no traceback,
    and leaves neither the output directory nor a staging directory."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine sample"}\n{"text": oops}\n')
    out = tmp_path / "never"
    r = CliRunner().invoke(main, ["calibrate", "--corpus", str(bad), "--out", str(out), "--quiet"])
    assert r.exit_code == 2
    err = r.output.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "bad.jsonl:2" in err[0]
    assert "Traceback" not in r.output
    assert not out.exists() and not list(tmp_path.glob(".never*"))


def test_cli_refuses_existing_output(tmp_path):
    """calibrate --out into an existing directory without --overwrite exits 2 with a message suggesting
    --overwrite."""
    corpus = tmp_path / "c.jsonl.gz"
    with gzip.open(corpus, "wt") as f:
        f.write(json.dumps({"text": "hello there"}) + "\n")
    out = tmp_path / "exists"
    out.mkdir()
    r = CliRunner().invoke(main, ["calibrate", "--corpus", str(corpus), "--out", str(out), "--quiet"])
    assert r.exit_code == 2 and "--overwrite" in r.output


@pytest.mark.parametrize("args, match", [
    (["--batch-size", "0"], "Invalid value for '--batch-size': 0 is not in the range 1<=x"),
    (["--preset", "int4", "--format", "fp8_e5m2"], "--format applies to --preset fp8 only"),
    (["--preset", "int8", "--granularity", "head"], "--granularity applies to --preset fp8 only"),
    (["--bits", "4", "--format", "fp8_e5m2"], "--bits 4 allocates integer formats per layer (drop --format)"),
    # an explicit option equal to its default, or --preset beside --bits, is not silently dropped
    (["--preset", "int8", "--format", "fp8_e4m3", "--granularity", "tensor"],
     "--format/--granularity apply to --preset fp8 only"),
    (["--preset", "int4", "--bits", "4"], "replaces --preset; give one of them"),
    # an infeasible budget is refused before capture, search and the sensitivity probe
    (["--bits", "2.0"], "raise --bits to at least 2.09"),
    (["--bits", "3", "--residual-window", "5000"], "above any allowed --bits (2-16)"),
    (["--budget-context", "0"], "Invalid value for '--budget-context': 0 is not in the range 1<=x"),
    (["--out", ""], "--out is empty"),
    (["--out", "/proc/kvcal-out"], "does not take new directories"),
    (["--sinks", "4"], "--sinks applies to integer presets and --bits only"),
    (["--preset", "int4", "--sinks", "600", "--max-seq-len", "512"], "leaves no quantized token"),
    (["--device", "cuda:7"], "--device cuda:7"),
])
def test_cli_refuses_conflicting_or_invalid_options(tmp_path, args, match):
    """Each conflicting or invalid calibrate option set exits 2 with the expected message in its output (no
    traceback) and writes no output directory."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"text": "hello there"}) + "\n")
    r = CliRunner().invoke(main, ["calibrate", "--corpus", str(corpus), "--out", str(tmp_path / "o"), "--quiet", *args])
    assert r.exit_code == 2 and match in r.output and "Traceback" not in r.output
    assert not (tmp_path / "o").exists()


def test_cli_overwrite_never_destroys_inputs_or_foreign_dirs(tmp_path):
    """``calibrate --overwrite`` with ``--out`` holding the corpus, or a directory kvcal did not write, is
    refused at once (before the model loads) and deletes nothing; an ``--out`` below a file is refused too."""
    d = tmp_path / "cc"
    d.mkdir()
    corpus = d / "chat.jsonl"
    corpus.write_text(json.dumps({"text": "hello there"}) + "\n")
    r = CliRunner().invoke(main, ["calibrate", "--corpus", str(corpus), "--out", str(d), "--overwrite", "--quiet"])
    assert r.exit_code == 2 and "is or contains the input --corpus" in r.output and corpus.exists()
    user = tmp_path / "d"
    user.mkdir()
    (user / "notes.txt").write_text("important")
    r = CliRunner().invoke(main, ["calibrate", "--corpus", str(corpus), "--out", str(user), "--overwrite", "--quiet"])
    assert r.exit_code == 2 and "replaces only directories kvcal wrote" in r.output
    assert (user / "notes.txt").read_text() == "important" and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["calibrate", "--corpus", str(corpus), "--out", str(corpus / "sub"), "--quiet"])
    assert r.exit_code == 2 and "is a file, not a directory" in r.output


def test_cli_out_is_an_existing_file(tmp_path):
    """calibrate --out pointing at an existing file exits 2 saying it exists and is not a directory, even with
    --overwrite."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"text": "hello there"}) + "\n")
    r = CliRunner().invoke(main, ["calibrate", "--corpus", str(corpus), "--out", str(corpus), "--overwrite", "--quiet"])
    assert r.exit_code == 2 and "exists and is not a directory" in r.output


def test_shared_capture_gives_the_fresh_capture_artifact(tmp_path, tmp_path_factory, shared_data, smollm_tokenizer,
                                                         monkeypatch):
    """recommend's calibrations share one capture (``captures``): the per-KV-head vLLM fp8 artifact calibrated
    after a per-tensor one on the same capture equals, tensor for tensor and bit for bit, the one a fresh capture
    gives; the capture runs once for the two, again for other capture settings (a tiny Llama: 2 layers)."""
    from helpers.models import TINY_LLAMA_16, save_tiny_llama

    import kvcal.calibrate as C
    from kvcal.models import load_model

    d = save_tiny_llama(tmp_path_factory, smollm_tokenizer, "tiny-shared-capture", vocab_size=49152, **TINY_LLAMA_16)
    model = load_model(str(d))
    calls = []
    real = C.run_capture
    monkeypatch.setattr(C, "run_capture", lambda *a, **k: calls.append(1) or real(*a, **k))
    common = dict(corpus=str(shared_data / "wikitext2_valid.txt"), model=str(d), max_samples=8, max_seq_len=96,
                  batch_size=2, reservoir=3, heldout_reservoir=2, max_queries=16, engine="vllm", kv_cache_dtype="fp8")
    run = lambda out, captures=None, **kw: calibrate(  # noqa: E731
        CalibrateConfig(out=str(tmp_path / out), **common, **kw), log=lambda s: None, progress=False,
        model=model, tokenizer=smollm_tokenizer, captures=captures)
    shared: dict = {}
    run("tensor", shared)
    run("head_shared", shared, granularity="head")
    assert len(calls) == 1 and len(shared) == 1
    run("head_fresh", granularity="head")
    run("other", shared, search_tokens=64)  # another capture setting: captured again
    assert len(calls) == 3 and len(shared) == 2
    a, b = load_artifact(tmp_path / "head_shared"), load_artifact(tmp_path / "head_fresh")
    assert sorted(a.tensors) == sorted(b.tensors) and a.tensors
    for name in a.tensors:
        assert torch.equal(a.tensors[name], b.tensors[name]), name
    assert a.metadata["layers"] == b.metadata["layers"]
