"""The preflight (kvcal.inputs): every command resolves its model and checks its corpus once, before the model
loads, and a bad corpus is refused before torch is imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.cli import LoaderCalled, fp8_artifact, run_cli
from helpers.models import TINY_LLAMA_16, save_tiny_llama

REPO = Path(__file__).resolve().parents[1]
CORPUS = str(REPO / "calibration_sets" / "text.jsonl")
#: an FP8 kv_cache_scheme as kvcal export writes it (what kvcal verify reads from config.json)
SCHEME = {"quant_method": "compressed-tensors", "format": "dense", "quantization_status": "frozen",
          "config_groups": {}, "ignore": [], "kv_cache_scheme": {"num_bits": 8, "type": "float", "symmetric": True,
                                                                 "group_size": None, "strategy": "tensor",
                                                                 "dynamic": False}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm_tokenizer):
    """A tiny random Llama directory, an fp8 artifact for it and an exported-style checkpoint (the same model with
    an FP8 kv_cache_scheme and k/v scales)."""
    import torch
    from safetensors.torch import save_file

    d = save_tiny_llama(tmp_path_factory, smollm_tokenizer, "inputs-tiny", vocab_size=len(smollm_tokenizer),
                        **TINY_LLAMA_16)
    art = fp8_artifact(tmp_path_factory.mktemp("inputs-art"), d)
    ck = save_tiny_llama(tmp_path_factory, smollm_tokenizer, "inputs-ck", vocab_size=len(smollm_tokenizer),
                         **TINY_LLAMA_16)
    cfg = json.loads((ck / "config.json").read_text())
    cfg["quantization_config"] = SCHEME
    (ck / "config.json").write_text(json.dumps(cfg))
    save_file({f"model.layers.{i}.self_attn.{x}_scale": torch.tensor([0.05]) for i in range(2) for x in "kv"},
              str(ck / "kvcal-kv-scales.safetensors"))
    return {"model": d, "artifact": art, "checkpoint": ck}


@pytest.fixture()
def counted(monkeypatch):
    """Counts of ``load_model_config`` and ``check_corpus`` calls and of ``resolve_model`` calls given a string
    (a :class:`~kvcal.models.ModelSource` handed on is already resolved and passes through), in every module
    that holds the name, and a stop where the weights (verify: the engine) would load: the run ends there with
    the stub's one-line error."""
    import kvcal.corpus
    import kvcal.corpus.check
    import kvcal.models
    import kvcal.models.config
    import kvcal.models.gguf
    import kvcal.models.load
    import kvcal.models.source
    import kvcal.verify
    from kvcal.models import ModelSource

    counts = {"load_model_config": 0, "check_corpus": 0, "resolve_model": 0}

    def counting(name, fn):
        def wrapper(*a, **k):
            if name != "resolve_model" or not isinstance(a[0], ModelSource):
                counts[name] += 1
            return fn(*a, **k)
        return wrapper

    for name, mods in (("load_model_config", (kvcal.models, kvcal.models.config)),
                       ("check_corpus", (kvcal.corpus, kvcal.corpus.check)),
                       ("resolve_model", (kvcal.models, kvcal.models.config, kvcal.models.gguf, kvcal.models.load,
                                          kvcal.models.source))):
        w = counting(name, getattr(mods[-1], name))
        for m in mods:
            monkeypatch.setattr(m, name, w)

    def stop(*a, **k):
        raise LoaderCalled("model loader reached (stub)")

    monkeypatch.setattr(kvcal.models, "load_model", stop)
    monkeypatch.setattr(kvcal.verify, "run_engine", stop)
    return counts


def _argv(command: str, tiny: dict, tmp_path: Path) -> list[str]:
    m = str(tiny["model"])
    return {
        "calibrate": ["calibrate", "--model", m, "--corpus", CORPUS, "--max-samples", "8", "--max-seq-len", "64",
                      "--out", str(tmp_path / "art")],
        "calibrate --bits": ["calibrate", "--model", m, "--corpus", CORPUS, "--max-samples", "8", "--max-seq-len",
                             "64", "--bits", "6", "--out", str(tmp_path / "art")],
        "calibrate --engine vllm": ["calibrate", "--model", m, "--corpus", CORPUS, "--max-samples", "8",
                                    "--max-seq-len", "64", "--engine", "vllm", "--kv-cache-dtype", "fp8",
                                    "--out", str(tmp_path / "art")],
        "evaluate": ["evaluate", "--artifact", str(tiny["artifact"]), "--model", m, "--corpus", CORPUS,
                     "--context", "64", "--windows", "1"],
        "recommend": ["recommend", "--engine", "vllm", "--model", m, "--corpus", CORPUS, "--out",
                      str(tmp_path / "rec"), "--context", "64", "--probe-tokens", "64", "--windows", "1",
                      "--backend", "cpu"],
        "verify": ["verify", str(tiny["checkpoint"]), "--corpus", CORPUS, "--context", "64", "--windows", "2",
                   "--engine-python", sys.executable],
    }[command]


@pytest.mark.parametrize("command", ["calibrate", "calibrate --bits", "calibrate --engine vllm", "evaluate",
                                     "recommend", "verify"])
def test_each_command_reads_the_model_config_once_and_checks_the_corpus_once(command, tiny, counted, tmp_path):
    """Run through the CLI up to where the weights (verify: the engine) load, each command checks its corpus
    once, resolves its ``--model`` once and reads its model's config once — the tokenizer and the weights
    included, which take the resolved source and the vocabulary size from the preflight. verify reads the
    checkpoint's config.json itself and never loads a config through the models package; its one resolution is
    the tokenizer's, of the scale-free view it builds of the checkpoint (a directory the preflight cannot know)."""
    out = run_cli(_argv(command, tiny, tmp_path), code=2)
    assert "model loader reached (stub)" in out, out
    want = 0 if command == "verify" else 1
    assert counted == {"load_model_config": want, "check_corpus": 1, "resolve_model": 1}, (command, counted)


def test_a_model_directory_without_a_tokenizer_is_refused_in_the_preflight(tiny, counted, tmp_path):
    """A model directory with its config and weights but no tokenizer file is refused in one line naming the files
    to copy, by the preflight: before its config is read, before any tokenizer or weight loads."""
    import shutil

    d = tmp_path / "no-tok"
    d.mkdir()
    for f in tiny["model"].iterdir():
        if "token" not in f.name and f.name != "vocab.json" and f.is_file():
            shutil.copy(f, d / f.name)
    assert (d / "config.json").exists()
    out = run_cli(["calibrate", "--model", str(d), "--corpus", CORPUS, "--out", str(tmp_path / "art")], code=2)
    assert f"{d} has no tokenizer files" in out and "copy the model's tokenizer.json" in out, out
    assert "model loader reached" not in out and len(out.strip().splitlines()) == 1, out
    assert counted == {"load_model_config": 0, "check_corpus": 1, "resolve_model": 1}, counted


def test_a_bad_corpus_is_refused_before_torch_is_imported(tmp_path):
    """calibrate, evaluate, recommend and verify refuse a corpus that does not parse in one line, exit 2, with
    torch (and transformers) still not imported: the api checks the corpus before anything else."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": 3}\n')
    script = f"""
import sys
from click.testing import CliRunner
from kvcal.cli import main
bad = {str(bad)!r}
for argv in (["calibrate", "--corpus", bad, "--out", {str(tmp_path / "a")!r}],
             ["evaluate", "--artifact", "x", "--corpus", bad],
             ["recommend", "--engine", "vllm", "--corpus", bad, "--out", {str(tmp_path / "r")!r}],
             ["verify", "ck", "--corpus", bad, "--engine-python", sys.executable]):
    r = CliRunner().invoke(main, argv)
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and "bad.jsonl:2" in lines[0], (argv, r.output)
    assert "torch" not in sys.modules and "transformers" not in sys.modules, argv
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


def test_a_checked_corpus_is_handed_on_not_checked_again(tmp_path, monkeypatch):
    """corpus_input returns the CorpusInput it is given for the same path and options (no second check), and
    checks again when the options differ; preflight takes it as its corpus."""
    import kvcal.corpus
    from kvcal.inputs import check_corpus_input, corpus_input

    c = check_corpus_input(CORPUS)
    assert c.checked["records"] > 0 and c.options == {"text_field": None, "messages_field": None, "split": None}

    def no_check(*a, **k):
        raise AssertionError("checked again")

    monkeypatch.setattr(kvcal.corpus, "check_corpus", no_check)
    assert corpus_input(CORPUS, c, text_field=None) is c
    with pytest.raises(AssertionError, match="checked again"):
        corpus_input(CORPUS, c, text_field="text")


def test_model_inputs_equal_what_the_models_package_reads(tiny):
    """The preflight's model fields are what kvcal.models reads separately: the config's shape, maximum positions
    and vocabulary size, the resolved source; an already-loaded model's come from its config, a checkpoint's from
    its config.json dict."""
    from kvcal.formats.memory import model_shape
    from kvcal.inputs import preflight, resolve_model_inputs
    from kvcal.models import load_model_config, max_positions, model_vocab_size, resolve_model

    m = str(tiny["model"])
    pre = preflight(m, CORPUS)
    assert pre.model.source == resolve_model(m)
    assert pre.model.shape == model_shape(load_model_config(m))
    assert pre.model.max_positions == max_positions(m) == 512
    assert pre.model.vocab_size == model_vocab_size(m)
    assert pre.corpus.path == CORPUS and pre.eval_corpus is None

    class Loaded:
        config = load_model_config(m)

    got = resolve_model_inputs(None, loaded=Loaded())
    assert (got.shape, got.max_positions, got.vocab_size) == (pre.model.shape, 512, pre.model.vocab_size)
    ck = json.loads((tiny["checkpoint"] / "config.json").read_text())
    got = resolve_model_inputs(str(tiny["checkpoint"]), config=ck)
    assert (got.source, got.shape, got.max_positions, got.vocab_size) == (None, pre.model.shape, 512,
                                                                           pre.model.vocab_size)


def test_the_api_takes_a_built_config_and_checks_outputs_after_the_options(tiny, counted):
    """api.evaluate runs a config object built by the caller as is, calling check_outputs with it once before
    anything loads; given options instead, an option error comes before check_outputs is called."""
    from kvcal import api
    from kvcal.errors import KvcalError
    from kvcal.evaluate import EvalConfig

    cfg = EvalConfig(artifact=str(tiny["artifact"]), corpus=CORPUS, model=str(tiny["model"]), contexts=(64,),
                     windows=1)
    seen = []
    with pytest.raises(LoaderCalled):
        api.evaluate(config=cfg, check_outputs=seen.append, log=lambda s: None, progress=False)
    assert seen == [cfg] and counted == {"load_model_config": 1, "check_corpus": 1, "resolve_model": 1}
    with pytest.raises(KvcalError, match="--windows must be at least 1"):
        api.evaluate(str(tiny["artifact"]), CORPUS, windows=0, check_outputs=seen.append)
    assert seen == [cfg]
