"""One artifact validator for every command, hand-edited finite values included: a table of hand-edit classes, each run through every command that reads an
artifact (export, evaluate, plan --kv-config, inspect, report), each answered with exit 2 and one line
naming the field or tensor — never a traceback, never an export that loads."""

from __future__ import annotations

import json
import re

import pytest
import torch
from click.testing import CliRunner
from helpers.export import H_KV, D, H, L, make_artifact
from safetensors import safe_open
from safetensors.torch import save_file

from kvcal.artifact import CONTENT_HASH_KEY, content_sha256, load_artifact, write_artifact
from kvcal.cli import main
from kvcal.errors import ArtifactError
from kvcal.outputs import SCALES_FILE
from kvcal.plan import tensor_name


def _read(path):
    with safe_open(str(path / SCALES_FILE), framework="pt") as fh:
        return json.loads(fh.metadata()["kvcal"]), {k: fh.get_tensor(k) for k in fh.keys()}


def _edited(src, dst, edit, resign=True, raw_meta=None):
    """Copy artifact ``src`` to ``dst`` with ``edit(meta, tensors)`` applied. ``resign``: recompute the
    content hash afterwards, as a careful editor (or an artifact from before the hash) would — so the
    check that names the defect is the one under test, not the hash."""
    meta, tensors = _read(src)
    edit(meta, tensors)
    if resign and isinstance(meta, dict):
        meta[CONTENT_HASH_KEY] = content_sha256(meta, tensors)
    dst.mkdir()
    save_file(tensors, str(dst / SCALES_FILE), metadata={"kvcal": raw_meta or json.dumps(meta), "format": "pt"})
    return dst


def _set(d, key, value):
    d[key] = value


K0, V2 = tensor_name(0, "k"), tensor_name(2, "v")
CASES = {  # class -> (edit(meta, tensors), resign, raw metadata, expected fragment of the one-line error)
    "missing key": (lambda m, t: m["model"].pop("num_kv_heads"), True, None,
                    "model.num_kv_heads must be a positive integer, but it is missing"),
    "wrong type (string boolean)": (lambda m, t: _set(m["kv"]["k"], "symmetric", "false"), True, None,
                                    "kv.k.symmetric must be true or false"),
    "wrong type (count as string)": (lambda m, t: _set(m["kv"], "sink_tokens", "4"), True, None,
                                     "kv.sink_tokens must be an integer >= 0, got '4'"),
    "wrong type (recorded statistics)": (lambda m, t: _set(m["layers"][0]["k"]["heldout"], "chosen", None), True, None,
                                         r"layers\[0\].k.heldout must be a finite number or an object of them"),
    "wrong type (corpus summary)": (lambda m, t: _set(m["corpus"], "length_percentiles", "x"), True, None,
                                    "corpus.length_percentiles must be an object or null, got 'x'"),
    "unknown format": (lambda m, t: _set(m["kv"]["v"], "format", "fp9"), True, None, "kv.v.format must be one of"),
    "bad shape": (lambda m, t: _set(t, K0, torch.full((3,), 0.02)), True, None,
                  re.escape(f"{K0} has shape [3], expected [1] for tensor granularity")),
    "bad dtype": (lambda m, t: _set(t, K0, torch.tensor([1], dtype=torch.int32)), True, None,
                  f"tensor {re.escape(K0)} has dtype int32"),
    "extra tensor": (lambda m, t: _set(t, "model.layers.0.self_attn.k_bias", torch.zeros(1)), True, None,
                     "kvcal did not write.*model.layers.0.self_attn.k_bias"),
    "extra tensor, listed": (lambda m, t: (_set(t, "extra.weight", torch.zeros(1)),
                                           m["tensor_names"].append("extra.weight")), True, None,
                             "holds tensor extra.weight, which kvcal does not write"),
    "missing tensor": (lambda m, t: t.pop(V2), True, None, f"lacks 1 tensor.*{re.escape(V2)}"),
    "absurd scale 1e30": (lambda m, t: _set(t, K0, torch.tensor([1e30])), True, None,
                          f"tensor {re.escape(K0)} holds the scale 1e\\+30, implausible"),
    "absurd scale 1e-30": (lambda m, t: _set(t, K0, torch.tensor([1e-30])), True, None,
                           f"tensor {re.escape(K0)} holds the scale 1e-30, implausible"),
    "edited content": (lambda m, t: _set(t, K0, t[K0] * 1.5), False, None, "content does not match its content_sha256"),
    "edited metadata": (lambda m, t: _set(m["kv"], "sink_tokens", 0) or _set(m["corpus"], "samples", 9), False, None,
                        "content does not match its content_sha256"),
    "non-object metadata": (lambda m, t: None, False, "[1, 2]", "metadata document must be an object, got list"),
}


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    path, _ = make_artifact(d / "art")
    cfg = {"model_type": "llama", "num_hidden_layers": L, "num_attention_heads": H, "num_key_value_heads": H_KV,
           "hidden_size": H * D, "intermediate_size": 128, "vocab_size": 128, "max_position_embeddings": 256}
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "eval.txt").write_text("The quick brown fox jumps over the lazy dog. " * 200)
    return path, d


def _commands(art, d, tmp):
    return {
        "export": ["export", "--artifact", str(art), "--target", "vllm", "--out", str(tmp / "o_export")],
        "export sglang-json": ["export", "--artifact", str(art), "--target", "sglang-json", "--out", str(tmp / "o_sj")],
        "evaluate": ["evaluate", "--artifact", str(art), "--corpus", str(d / "eval.txt"), "--context", "64"],
        "plan --kv-config": ["plan", "--model", str(d / "config.json"), "--gpu-mem", "1GiB", "--kv-config", str(art)],
        "inspect": ["inspect", str(art)],
        "report": ["report", "--artifact", str(art), "--out", str(tmp / "o_report")],
    }


def test_the_good_artifact_passes_every_command_entry(good, tmp_path):
    """The control: the unedited artifact loads (content hash verified) and export/plan/inspect accept it."""
    path, d = good
    art = load_artifact(path)
    assert art.metadata[CONTENT_HASH_KEY] == content_sha256(art.metadata, art.tensors)
    for name, args in _commands(path, d, tmp_path).items():
        if name in ("evaluate", "report"):
            continue  # need the model / write figures; the refusal cases below reach them before either
        res = CliRunner().invoke(main, args)
        assert res.exit_code == 0, (name, res.output)
    assert "content hash verified" in CliRunner().invoke(main, ["inspect", str(path)]).output


@pytest.mark.parametrize("case", list(CASES))
def test_every_command_refuses_each_class_in_one_line(good, tmp_path, case):
    """Each hand-edit class of CASES is refused by load_artifact with the expected message, and export (vllm,
    sglang-json), evaluate, plan --kv-config, inspect and report each exit 2 with exactly one error line
    matching it, no traceback and no output directory written."""
    edit, resign, raw, expected = CASES[case]
    path, d = good
    bad = _edited(path, tmp_path / "bad", edit, resign=resign, raw_meta=raw)
    with pytest.raises(ArtifactError, match=expected):
        load_artifact(bad)
    for name, args in _commands(bad, d, tmp_path).items():
        res = CliRunner().invoke(main, args)
        out = res.output
        assert res.exit_code == 2, (case, name, out)
        assert "Traceback" not in out and res.exception is None or isinstance(res.exception, SystemExit), (case, name)
        err = [ln for ln in out.splitlines() if ln.startswith("error:")]
        assert len(err) == 1 and re.search(expected, err[0]), (case, name, out)
        assert not any((tmp_path / o).exists() for o in ("o_export", "o_sj", "o_report")), (case, name)


def test_old_artifacts_without_a_content_hash_still_load(good, tmp_path):
    """Artifacts written before kvcal recorded a content hash load after every other check; inspect and export
    say that edits to them cannot be detected, and the range check still refuses an absurd scale."""
    path, _ = good
    old = _edited(path, tmp_path / "old", lambda m, t: (m.pop(CONTENT_HASH_KEY), m.pop("tensor_names"),
                                                         m["model"].pop("weights", None)), resign=False)
    assert CONTENT_HASH_KEY not in load_artifact(old).metadata
    res = CliRunner().invoke(main, ["inspect", str(old)])
    assert res.exit_code == 0 and "no content_sha256" in res.output
    res = CliRunner().invoke(main, ["export", "--artifact", str(old), "--target", "vllm", "--out", str(tmp_path / "o")])
    assert res.exit_code == 0 and "no content_sha256" in res.output
    # ...but an old artifact with an absurd scale is still refused by the range check
    worse = _edited(old, tmp_path / "worse", lambda m, t: _set(t, K0, torch.tensor([1e30])), resign=False)
    with pytest.raises(ArtifactError, match="implausible"):
        load_artifact(worse)


@pytest.mark.parametrize("marker", ["tensor_names", "model.weights"])
def test_deleting_the_content_hash_of_a_hash_era_artifact_is_refused(good, tmp_path, marker):
    """An artifact whose content_sha256 was deleted (and a scale tripled) is refused when it holds a field only
    hash-recording writers produce (tensor_names, model.weights): load_artifact raises, inspect and export exit 2
    with one line and write nothing."""
    path, _ = good

    def strip(m, t):
        m.pop(CONTENT_HASH_KEY)
        t[K0] = t[K0] * 3
        if marker == "model.weights":  # a fingerprint-era artifact whose editor also dropped tensor_names
            m.pop("tensor_names")
            m["model"]["weights"] = {"scheme": "kvcal-weights/1", "layers": []}

    bad = _edited(path, tmp_path / "bad", strip, resign=False)
    with pytest.raises(ArtifactError, match=rf"no content_sha256 although its {marker} field"):
        load_artifact(bad)
    for args in (["inspect", str(bad)],
                 ["export", "--artifact", str(bad), "--target", "vllm", "--out", str(tmp_path / "o")]):
        res = CliRunner().invoke(main, args)
        assert res.exit_code == 2 and res.output.startswith("error:") and "no content_sha256 although" in res.output
        assert len(res.output.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


def test_rewriting_a_loaded_artifact_gets_a_fresh_hash(good, tmp_path):
    """write_artifact(loaded.metadata) — what tools built on kvcal do — replaces the old hash."""
    a = load_artifact(good[0])
    t = dict(a.tensors)
    t[K0] = t[K0] * 1.01
    b = load_artifact(write_artifact(tmp_path / "b", t, a.metadata))
    assert b.metadata[CONTENT_HASH_KEY] != a.metadata[CONTENT_HASH_KEY]


def test_scale_bounds_admit_every_search_candidate(tmp_path):
    """The range check must never refuse what calibrate writes: clip 0.5, unity (1.0) and the on-the-fly
    amax/100 rule for a tiny and a large absmax all load (the bound is SCALE_SANITY = 64 around them)."""
    for amax in (1e-3, 0.6, 300.0):
        for scale in (amax / 448 * 0.5, 1.0, amax / 100, amax / 448 * 4):
            meta = {"model": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 4},
                    "kv": {s: {"format": "fp8_e4m3", "granularity": "tensor"} for s in "kv"},
                    "layers": [{"layer": 0, "k": {"amax": [amax]}, "v": {"amax": [amax]}}]}
            t = {tensor_name(0, s): torch.tensor([scale]) for s in "kv"}
            back = load_artifact(write_artifact(tmp_path / f"a{amax}_{scale}", t, meta))
            assert all(torch.equal(back.tensors[k], t[k]) for k in t)  # loaded as written, not adjusted


def test_per_channel_scales_far_below_their_head_absmax_load(tmp_path):
    """Per-channel FP8 scales are checked against the per-head absmax only from above: a quiet channel
    (1/1000 of its head's range) is legitimate, 64 x unity is not."""
    meta = {"model": {"num_layers": 1, "num_kv_heads": 2, "head_dim": 4},
            "kv": {s: {"format": "fp8_e4m3", "granularity": "channel"} for s in "kv"},
            "layers": [{"layer": 0, "k": {"amax": [5.0, 3.0]}, "v": {"amax": [5.0, 3.0]}}]}
    t = {tensor_name(0, s): torch.full((2, 1, 4), 5.0 / 448) for s in "kv"}
    t[tensor_name(0, "k")][0, 0, 0] = 5.0 / 448 / 1000
    load_artifact(write_artifact(tmp_path / "ok", t, meta))
    t[tensor_name(0, "v")][1, 0, 3] = 65.0  # > 64 x max(1, amax / 100)
    with pytest.raises(ArtifactError, match="v_scale holds the scale 65, implausible"):
        load_artifact(write_artifact(tmp_path / "bad", t, meta))


@pytest.mark.parametrize("doc, kind", [("[1, 2]", "list"), ('"text"', "string"), ("3", "number"), ("null", "null")])
def test_inspect_of_a_json_file_that_is_not_an_object(tmp_path, doc, kind):
    """kvcal inspect on a JSON file holding a list, string, number or null exits 2 with exactly the one line
    naming the file and the JSON kind and showing the expected object shape."""
    f = tmp_path / "kv_cache_scales.json"
    f.write_text(doc)
    res = CliRunner().invoke(main, ["inspect", str(f)])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert res.output.strip().splitlines() == [f"error: {f} holds a JSON {kind}, not an object; kvcal inspect reads "
                                                'JSON objects (a --quantization-param-path file is {"kv_cache": '
                                                '{"scaling_factor": ...}})']
