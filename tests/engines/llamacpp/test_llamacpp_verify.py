"""``kvcal verify --engine llamacpp``: the runner's JSON contract and arithmetic on a fake ``llama_cpp`` (no engine
needed), the one-line refusals of bad input, and (engine tier) the real llama-cpp-python on the embedded model.

Claims: the runner's per-window KL(ref || pair), NLLs and top-1 agreement equal a float64 computation from the same
logits; it passes each pair's ggml type ids, ``flash_attn``, ``logits_all`` and ``n_ctx = n_batch = n_ubatch =`` the
window to ``Llama``; it reports llama.cpp's ``llama_kv_cache: size`` log line; an engine Python without
``llama_cpp`` is refused in one line. The engine tier serves 2 windows x 256 tokens with 2 pairs and checks the
document, that served = predicted does not FAIL, that the judged prediction is the one with llama.cpp's matmul input
rounding emulated (every matmul of the embedded GGUF is), and that it is the nearer one for q8_0/q8_0."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from kvcal.cli import main
from kvcal.engines import engine
from kvcal.errors import KvcalError
from kvcal.verify.pairs import PairsConfig, check_engine_python, parse_pairs

ENG = engine("llamacpp")
ROOT = Path(__file__).resolve().parents[3]
CORPUS = ROOT.parent / "shared" / "data" / "wikitext2_valid.txt"
if not CORPUS.is_file():
    CORPUS = Path("/work/shared/data/wikitext2_valid.txt")

FAKE = r'''
"""A stand-in for llama_cpp: deterministic logits from (type_k, type_v, tokens); records its calls."""
import ctypes, json, os
import numpy as np
__version__ = "fake-0.0"
GGML_TYPE_F16 = 1
GGML_TYPE_Q8_0 = 8
llama_log_callback = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
_cb = []
def llama_log_set(cb, ud):
    _cb[:] = [cb]
V = int(os.environ.get("FAKE_VOCAB", "50"))
def fake_scores(tk, tv, tokens):
    rng = np.random.default_rng(1000 + int(np.sum(tokens)))
    base = rng.standard_normal((len(tokens), V)).astype(np.float32) * 3
    noise = np.random.default_rng(7 * tk + 13 * tv).standard_normal((len(tokens), V)).astype(np.float32)
    return base + (0.0 if tk == tv == 1 else 0.05 * (tk + tv) / 8) * noise
class Llama:
    def __init__(self, model_path, **kw):
        with open(os.environ["FAKE_CALLS"], "a") as f:
            f.write(json.dumps(kw) + "\n")
        if _cb:
            _cb[0](1, b"llama_kv_cache: size =    1.00 MiB ( ", None)
            _cb[0](5, b"256 cells)\nother line\n", None)
            _cb[0](1, b"llama_kv_cache: size =    2.00 MiB ( 512 cells)\n", None)
        self.kw = kw
        self.scores = np.zeros((kw["n_ctx"], V), dtype=np.float32)
    def reset(self):
        pass
    def eval(self, tokens):
        self.scores[: len(tokens)] = fake_scores(self.kw["type_k"], self.kw["type_v"], tokens)
'''


def _fake(tmp_path):
    d = tmp_path / "fake"
    (d / "llama_cpp").mkdir(parents=True)
    (d / "llama_cpp" / "__init__.py").write_text(FAKE)
    return d


def _run_runner(tmp_path, req, fake=True):
    (tmp_path / "req.json").write_text(json.dumps(req))
    env = {**os.environ, "FAKE_CALLS": str(tmp_path / "calls.jsonl")}
    env["PYTHONPATH"] = str(_fake(tmp_path)) if fake else ""
    r = subprocess.run([sys.executable, str(ENG.RUNNER), str(tmp_path / "req.json"), str(tmp_path / "out.json")],
                       capture_output=True, text=True, env=env, cwd=str(tmp_path))
    return r, json.loads((tmp_path / "out.json").read_text())


def _logp64(s):
    s = np.asarray(s, dtype=np.float64)
    m = s.max(-1, keepdims=True)
    return s - m - np.log(np.exp(s - m).sum(-1, keepdims=True))


def test_runner_kl_nll_top1_match_float64_and_arguments(tmp_path):
    rng = np.random.default_rng(0)
    windows = rng.integers(0, 50, size=(3, 40)).tolist()
    req = {"gguf": "/m.gguf", "windows": windows, "reference": ["f16", "f16"],
           "pairs": [["q8_0", "q8_0"], ["q4_0", "iq4_nl"]], "threads": 3, "chunk_rows": 7}
    r, out = _run_runner(tmp_path, req)
    assert r.returncode == 0, r.stderr
    ns = {}
    exec(compile(FAKE, "fake", "exec"), ns)
    ids = {"f16": 1, "q8_0": 8, "q4_0": 2, "iq4_nl": 20}
    ref = [_logp64(ns["fake_scores"](1, 1, np.array(w))[:-1]) for w in windows]
    assert out["n_ctx"] == 40 and out["windows"] == 3 and out["tokens_per_window"] == 39 and out["vocab"] == 50
    for i, w in enumerate(windows):
        nll = -ref[i][np.arange(39), np.array(w[1:])].mean()
        assert out["reference"]["nll"][i] == pytest.approx(nll, rel=1e-6, abs=1e-9)
    for pair, got in zip(req["pairs"], out["pairs"], strict=True):
        assert [got["type_k"], got["type_v"]] == pair
        for i, w in enumerate(windows):
            lp = _logp64(ns["fake_scores"](ids[pair[0]], ids[pair[1]], np.array(w))[:-1])
            lr = ref[i].astype(np.float32).astype(np.float64)  # the reference is kept in float32
            kl = (np.exp(lr) * (lr - lp)).sum(-1).mean()
            assert kl > 0
            assert got["kl"][i] == pytest.approx(kl, rel=1e-6)
            assert got["nll"][i] == pytest.approx(-lp[np.arange(39), np.array(w[1:])].mean(), rel=1e-9)
            assert got["top1"][i] == pytest.approx((lr.argmax(-1) == lp.argmax(-1)).mean())
        # every kv line, in order (an iSWA cache logs two)
        assert got["kv_log"] == ("llama_kv_cache: size =    1.00 MiB ( 256 cells)\n"
                                 "llama_kv_cache: size =    2.00 MiB ( 512 cells)")
    calls = [json.loads(x) for x in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert [(c["type_k"], c["type_v"]) for c in calls] == [(1, 1), (8, 8), (2, 20)]
    for c in calls:
        assert c["n_ctx"] == c["n_batch"] == c["n_ubatch"] == 40
        assert c["flash_attn"] is True and c["logits_all"] is True and c["n_threads"] == 3
    assert not list(tmp_path.glob("kvcal-llamacpp-ref-*.npy"))  # the scratch reference is removed


def test_runner_without_llama_cpp_is_one_line_error(tmp_path):
    (tmp_path / "req.json").write_text(json.dumps({"gguf": "x", "windows": [[1, 2]], "pairs": []}))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, str(ENG.RUNNER), str(tmp_path / "req.json"), str(tmp_path / "out.json")],
                       capture_output=True, text=True, env=env)
    if r.returncode == 0:
        pytest.skip("this Python imports llama_cpp")
    assert r.returncode == 3
    err = json.loads((tmp_path / "out.json").read_text())["error"]
    assert "llama_cpp is not importable" in err and "\n" not in err


def test_runner_imports_no_kvcal():
    src = ENG.RUNNER.read_text()
    assert "import kvcal" not in src and "from kvcal" not in src


def test_parse_pairs():
    assert parse_pairs("q8_0/q8_0, q4_0/f16,q5_1,q8_0/q8_0", ENG) == [("q8_0", "q8_0"), ("q4_0", "f16"),
                                                                      ("q5_1", "q5_1")]
    for bad, said in (("q8_0/q3_k", "q3_k"), ("q8_0/q4_0/f16", "TYPE_K/TYPE_V"), ("q8_0,,q4_0", "empty"),
                      ("", "required"), ("q8_0/", "TYPE_K/TYPE_V")):
        with pytest.raises(KvcalError, match=said):
            parse_pairs(bad, ENG)


def test_engine_python_checks(tmp_path):
    with pytest.raises(KvcalError, match="no executable Python.*make llamacpp-venv"):
        check_engine_python(str(tmp_path / "nope"), ENG)
    with pytest.raises(KvcalError, match="--engine-python is required"):
        check_engine_python(None, ENG)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        with pytest.raises(KvcalError, match="llama_cpp is not importable there"):
            check_engine_python(sys.executable, ENG)


def test_config_checks():
    with pytest.raises(KvcalError, match="--windows must be at least 2"):
        PairsConfig("m", "c", "p", "q8_0", windows=1)
    with pytest.raises(KvcalError, match="--threads"):
        PairsConfig("m", "c", "p", "q8_0", threads=0)


def _cli(*argv):
    return CliRunner().invoke(main, ["verify", *argv])


def test_cli_refusals(tmp_path):
    base = ["--engine", "llamacpp", "--corpus", str(CORPUS)]
    r = _cli(*base, "--cache-types", "q8_0/q8_0", "--engine-python", sys.executable)
    assert r.exit_code != 0 and "--model is required" in r.output
    r = _cli(*base, "--model", "smollm2-135m", "--cache-types", "q8_0/q9_0", "--engine-python", sys.executable)
    assert r.exit_code != 0 and "q9_0" in r.output and "Traceback" not in r.output
    r = _cli(*base, "--model", str(tmp_path / "x.gguf"), "--cache-types", "q8_0", "--engine-python", sys.executable)
    assert r.exit_code != 0 and "does not exist" in r.output
    r = _cli(*base, "--model", "smollm2-135m", "--cache-types", "q8_0", "--engine-python", str(tmp_path / "py"))
    assert r.exit_code != 0 and "no executable Python" in r.output
    r = _cli(*base, "--model", "smollm2-135m", "--cache-types", "q8_0", "--engine-python", sys.executable,
             "--kv-cache-dtype", "fp8")
    assert r.exit_code != 0 and "takes no calibrated scale" in r.output
    r = _cli(*base, str(tmp_path), "--model", "smollm2-135m", "--cache-types", "q8_0")
    assert r.exit_code != 0 and "CHECKPOINT" in r.output
    r = _cli("--engine", "nosuch", "--corpus", str(CORPUS))
    assert r.exit_code != 0 and "unknown engine" in r.output
    # the vLLM path: llama.cpp's options refused, CHECKPOINT still required
    r = _cli("--corpus", str(CORPUS), "--model", "smollm2-135m", str(tmp_path))
    assert r.exit_code != 0 and "--engine llamacpp" in r.output
    r = _cli("--corpus", str(CORPUS))
    assert r.exit_code == 2 and "Missing argument 'CHECKPOINT'" in r.output
    for line in (x for x in r.output.splitlines() if x.startswith("Error")):
        assert len(line) < 400


def engine_python() -> str | None:
    """The engine tier's llama-cpp-python interpreter: $KVCAL_LLAMACPP_PYTHON or .venv-llamacpp/bin/python."""
    for p in (os.environ.get("KVCAL_LLAMACPP_PYTHON"), str(ROOT / ".venv-llamacpp" / "bin" / "python")):
        if p and Path(p).is_file():
            r = subprocess.run([p, "-c", "import llama_cpp"], capture_output=True,
                               env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
            if r.returncode == 0:
                return p
    return None


@pytest.mark.engine
def test_engine_tier_verify_smollm(tmp_path):
    py = engine_python()
    if py is None:
        pytest.skip("no llama-cpp-python interpreter: set KVCAL_LLAMACPP_PYTHON or run `make llamacpp-venv` "
                    "(.venv-llamacpp/bin/python)")
    from kvcal.verify.pairs import render_pairs, verify_pairs

    cfg = PairsConfig(model="smollm2-135m", corpus=str(CORPUS), engine_python=py, cache_types="q8_0/q8_0,q4_0/q4_0",
                      context=256, windows=2, threads=2)
    doc = verify_pairs(cfg, log=lambda *_: None)
    assert doc["schema"] == "kvcal-verify-pairs/1" and doc["engine"]["calibrated_scales"] is False
    assert [(r["type_k"], r["type_v"]) for r in doc["rows"]] == [("q8_0", "q8_0"), ("q4_0", "q4_0")]
    q8, q4 = doc["rows"]
    assert 0 < q8["served_kl"] < q4["served_kl"] and 0 < q8["predicted_kl"] < q4["predicted_kl"]
    for r in doc["rows"]:
        assert r["verdict"] != "FAIL", render_pairs(doc)
        assert r["kv_log"]["match"] in (True, None), r["kv_log"]
    assert "served = predicted" in render_pairs(doc)
    assert "two builds' difference" not in render_pairs(doc)  # the venv make llamacpp-venv builds is the emulated one
    # llama.cpp rounds every weight matmul's input to q8 (Q4_1/Q8_0 weights): kvcal emulates that for every matmul
    # of this GGUF, so that prediction is the one judged (tolerance: the t-interval alone); it lands near the served
    # KL, the float32-input one far below (2 x 256 tokens: 3.87e-3 served, 3.83e-3 and 2.4e-4)
    assert doc["prediction"]["judged"] == "matmul-emulated" and doc["prediction"]["not_emulated"] == []
    assert q8["prediction"] == "matmul-emulated" and q8["floor"] == 0.0 and q8["tol"] == q8["t_half_width"]
    assert q8["predicted_kl"] == q8["predicted_kl_matmul_emulated"]
    assert abs(q8["served_kl"] - q8["predicted_kl"]) < abs(q8["served_kl"] - q8["predicted_kl_float32"])


def _fake_engine_python(tmp_path) -> Path:
    """An executable that runs this Python with the fake ``llama_cpp`` importable (run_engine drops PYTHONPATH)."""
    w = tmp_path / "fake-python"
    w.write_text(f"#!/bin/sh\nPYTHONPATH={shlex.quote(str(_fake(tmp_path)))} exec {shlex.quote(sys.executable)} "
                 '"$@"\n')
    w.chmod(0o755)
    return w


@pytest.mark.parametrize("emulated", [True, False])
def test_verify_pairs_judgement_by_hand(tmp_path, monkeypatch, smollm_model, emulated):
    """The whole of verify_pairs with the fake engine (its served KLs are arbitrary) and kvcal's real prediction on
    the embedded model: which prediction is judged, and the tolerance and verdict recomputed from the document's
    per-window figures with scipy's t quantile. Every matmul of the embedded GGUF is emulated, so the matmul-emulated
    prediction is judged with the t-interval alone; with one matmul's type unknown (patched), the float32 one is,
    with the floor |mean matmul-emulated - mean float32| over --floor-windows."""
    from scipy import stats

    from kvcal.verify.pairs import render_pairs, verify_pairs

    monkeypatch.setenv("FAKE_CALLS", str(tmp_path / "calls.jsonl"))
    monkeypatch.setenv("FAKE_VOCAB", str(smollm_model.config.vocab_size))  # the runner indexes logits by token id
    if not emulated:
        real = ENG.gguf_matmul_inputs
        monkeypatch.setattr(ENG, "gguf_matmul_inputs",
                            lambda types: {**real(types), "model.layers.0.mlp.down_proj": None})
    cfg = PairsConfig(model="smollm2-135m", corpus=str(CORPUS), engine_python=str(_fake_engine_python(tmp_path)),
                      cache_types="q8_0/q8_0", context=48, windows=3, threads=1, floor_windows=2)
    doc = verify_pairs(cfg, log=lambda *_: None, model=smollm_model)
    (r,) = doc["rows"]
    pw = r["per_window"]
    judged = pw["predicted_kl_matmul_emulated"] if emulated else pw["predicted_kl_float32"]
    assert doc["prediction"]["judged"] == r["prediction"] == ("matmul-emulated" if emulated else "float32")
    assert (doc["prediction"]["not_emulated"] == []) == emulated
    assert pw["predicted_kl"] == judged and len(judged) == 3
    assert len(pw["predicted_kl_float32" if emulated else "predicted_kl_matmul_emulated"]) == 2
    d = np.array(pw["served_kl"]) - np.array(judged)
    h = stats.t.ppf(0.995, 2) * d.std(ddof=1) / np.sqrt(3)
    floor = 0.0 if emulated else abs(np.mean(pw["predicted_kl_matmul_emulated"]) - np.mean(judged[:2]))
    assert r["floor"] == pytest.approx(floor, rel=1e-12, abs=1e-15)
    assert r["tol"] == pytest.approx(h + floor, rel=1e-9)
    assert r["diff"] == pytest.approx(d.mean(), rel=1e-9, abs=1e-15)
    want = "FAIL" if abs(d.mean()) > h + floor else "PASS" if h + floor < np.mean(judged) else "INCONCLUSIVE"
    assert r["verdict"] == want
    out = render_pairs(doc)
    assert ("every weight matmul's input rounded" in out) == emulated and ("+ floor" in out) != emulated
    # the fake engine calls itself llama-cpp-python fake-0.0: the output says the served build is not the emulated one
    assert doc["engine"]["emulated"] == ENG.VERSION == "llama-cpp-python 0.3.36"
    assert "this engine is llama-cpp-python fake-0.0: a row outside its tolerance may be the two builds'" in out
