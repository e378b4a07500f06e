"""``kvcal inspect``: artifacts, checkpoints, exports and scales JSON, with per-engine load verdicts."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from helpers.export import L, make_artifact, make_checkpoint
from safetensors.torch import load_file, save_file

from kvcal.cli import main
from kvcal.export import export
from kvcal.inspect import InspectError, inspect_path, render


@pytest.fixture(scope="module")
def plain_ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", sharded=False)


def test_inspect_artifact(tmp_path):
    """inspect on a per-tensor FP8 artifact reports its kind, format, granularity and layer count, layer 1's K
    scale equal to the one written, every export target possible, and renders the corpus, a written V scale
    and vLLM loading all 4 layers."""
    path, truth = make_artifact(tmp_path / "art")
    ins = inspect_path(path)
    assert (ins.kind, ins.format, ins.granularity, ins.num_layers) == ("artifact", "fp8_e4m3", "tensor", L)
    assert ins.layers[1]["k"] == truth[(1, "k")][0].tolist()
    assert all(reason is None for reason in ins.exportable.values())
    text = render(ins)
    assert "corpus: calibration_sets/chat.jsonl" in text and "samples=64" in text
    assert f"{truth[(0, 'v')][0].item():.6g}" in text
    assert "vLLM: loads K and V scales for all 4 layers" in text


def test_inspect_per_channel_int4_artifact(tmp_path):
    """A per-channel int4 artifact is reported as exportable to no target, a vLLM startup error on every
    layer, and its scales rendered as [32 head x channel]."""
    path, _ = make_artifact(tmp_path / "art", fmt="int4", granularity="channel")
    ins = inspect_path(path)
    assert all(reason is not None for reason in ins.exportable.values())
    assert ins.engines["vLLM"].count("error") == L
    text = render(ins)
    assert "[32 head x channel]" in text and "[32 heads]" not in text and "startup error" in text


def test_inspect_plain_checkpoint_says_engines_fall_back(plain_ckpt):
    """A checkpoint without KV scales or quantization_config has no layer scale, and vLLM is reported NOT
    LOADED with every layer falling back, naming the missing quantization_config."""
    ins = inspect_path(plain_ckpt)
    assert ins.kind == "checkpoint" and all(r["k"] is None for r in ins.layers)
    vl = ins.engines["vLLM"]
    assert vl.problems and vl.count("fallback") == L
    text = render(ins)
    assert "vLLM: NOT LOADED" in text and "no quantization_config" in text


def test_inspect_checkpoint_with_misnamed_scales(tmp_path, plain_ckpt):
    """In a compressed-tensors checkpoint, a K-only scale in layer 0 is reported copied to V by vLLM and an
    unrecognised name in layer 1 leaves layers 1-3 falling back to 1.0."""
    d = tmp_path / "ck"
    d.mkdir()
    w = load_file(plain_ckpt / "model.safetensors")
    extra = {"model.layers.0.self_attn.k_scale": torch.tensor([0.1]),  # layer 0: only K -> copied
             "model.layers.1.self_attn.attention.k_scale": torch.tensor([0.1])}  # not a recognised name
    save_file({**w, **extra}, str(d / "model.safetensors"))
    cfg = json.loads((plain_ckpt / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {},
                                  "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}}
    (d / "config.json").write_text(json.dumps(cfg))
    ins = inspect_path(d)
    vl = ins.engines["vLLM"]
    assert vl.layers[0].status == "copied" and vl.count("fallback") == L - 1
    assert "fall back to 1.0 (layers 1-3)" in render(ins)


def test_inspect_json_tp_mismatch(tmp_path):
    """An SGLang scales JSON exported for TP=2 loads in SGLang at its own TP, is reported with a TP=4 problem
    when inspected for TP=4, and vLLM (which removed the JSON path) reports a problem."""
    path, _ = make_artifact(tmp_path / "art")
    export(path, "sglang-json", tmp_path / "out", tp=2)
    f = tmp_path / "out" / "kv_cache_scales.json"
    assert inspect_path(f).engines["SGLang"].all_loaded
    bad = inspect_path(f, tp=4).engines["SGLang"]
    assert bad.problems and "TP=4" in bad.problems[0]
    assert inspect_path(f).engines["vLLM"].problems  # removed in vLLM 0.8


def test_inspect_cli(tmp_path):
    """kvcal inspect exits 0 on an artifact listing its export targets, exits 2 with output starting
    error: (no traceback) on a missing path, and inspect_path raises InspectError on an empty directory."""
    path, _ = make_artifact(tmp_path / "art")
    r = CliRunner().invoke(main, ["inspect", str(path)])
    assert r.exit_code == 0 and "kvcal export targets:" in r.output
    r = CliRunner().invoke(main, ["inspect", str(tmp_path / "nope")])
    assert r.exit_code == 2 and r.output.startswith("error: ") and "Traceback" not in r.output
    (tmp_path / "empty").mkdir()
    with pytest.raises(InspectError):
        inspect_path(tmp_path / "empty")


def test_inspect_recommend_output_names_what_to_inspect(tmp_path):
    """`kvcal inspect` on a `kvcal recommend` output directory (or its deploy.json) says what it is and names the
    kept artifact to inspect, or says that the chosen configuration keeps none (vLLM's default scales)."""
    rec = tmp_path / "rec"
    make_artifact(rec / "artifact-nvfp4")
    (rec / "deploy.json").write_text(json.dumps({"schema": "kvcal-recommend/1", "artifact": "artifact-nvfp4"}))
    for target in (rec, rec / "deploy.json"):
        r = CliRunner().invoke(main, ["inspect", str(target)])
        assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
        assert "kvcal recommend output" in r.output and f"kvcal inspect {rec / 'artifact-nvfp4'}" in r.output
    (rec / "deploy.json").write_text(json.dumps({"schema": "kvcal-recommend/1", "artifact": None}))
    with pytest.raises(InspectError, match="keeps no calibrated artifact"):
        inspect_path(rec)


def test_inspect_hand_written_json_with_bad_values(tmp_path):
    """In a SGLang scales JSON, a zero, negative or NaN scale makes the SGLang verdict a finite-and-positive
    problem with no layer loaded; a non-numeric value exits 2 naming scaling_factor['0']['2'], and a rank that
    is a list raises InspectError (must map layer index)."""
    path, _ = make_artifact(tmp_path / "art")
    export(path, "sglang-json", tmp_path / "out", tp=1)
    f = tmp_path / "out" / "kv_cache_scales.json"
    doc = json.loads(f.read_text())
    good = inspect_path(f).engines["SGLang"]
    assert good.all_loaded and not good.problems
    # zero / negative / NaN scales: SGLang would load them; the verdict must not say "loaded"
    for bad_value in (0.0, -0.5, float("nan")):
        d = json.loads(json.dumps(doc))
        d["kv_cache"]["scaling_factor"]["0"]["1"] = bad_value
        f.write_text(json.dumps(d))
        sg = inspect_path(f).engines["SGLang"]
        assert sg.problems and "finite and > 0" in sg.problems[0] and not sg.all_loaded, bad_value
        assert sg.count("loaded") == 0
    # non-numeric values and a rank that is not a mapping: one-line errors naming the entry, no traceback
    d = json.loads(json.dumps(doc))
    d["kv_cache"]["scaling_factor"]["0"]["2"] = "abc"
    f.write_text(json.dumps(d))
    r = CliRunner().invoke(main, ["inspect", str(f)])
    assert r.exit_code == 2 and "scaling_factor['0']['2'] = 'abc' is not a number" in r.output
    assert "Traceback" not in r.output
    d["kv_cache"]["scaling_factor"]["0"] = [1.0, 2.0]
    f.write_text(json.dumps(d))
    with pytest.raises(InspectError, match="must map layer index"):
        inspect_path(f)


def test_inspect_standalone_export_without_config_says_so(tmp_path):
    """Inspect of a standalone trtllm-legacy export (no config.json) tells vLLM and SGLang that these are
    TensorRT-LLM names, never that 'config.json has no quantization_config'."""
    path, _ = make_artifact(tmp_path / "art")
    export(path, "trtllm-legacy", tmp_path / "t")
    assert not (tmp_path / "t" / "config.json").exists()
    ins = inspect_path(tmp_path / "t")
    assert ins.kind == "standalone" and ins.format == "FP8 (quantization.json)"
    for name in ("vLLM", "SGLang"):
        probs = ins.engines[name].problems
        assert probs and probs[0].startswith("these are TensorRT-LLM names (transformer.layers.*)")
        assert not any(p.startswith("config.json has no quantization_config") for p in probs)


# ---- an export's NaN risk and bad scales: from the files, never from kvcal-export.json ------------------------


def _sglang_risk_line(ins) -> str | None:
    return next((n for e, row in ins.engines.items() if e.startswith("SGLang") for n in row.notes
                 if "without saturating" in n), None)


def test_inspect_export_recomputes_nan_risk_from_the_scale_files(tmp_path):
    """An unclipped artifact exported for vllm, then its scale file edited so K1 and V2 clip (x0.5, x0.8) and
    kvcal-export.json left saying nan_risk null: inspect's SGLang row names exactly the sides whose file scale
    clips the artifact's recorded amax (amax / (scale x 448) > 1, recomputed here from the file and the amax
    make_artifact drew) with the worst ratio; with the artifact gone it says it could not check, not the manifest."""
    import shutil

    path, truth = make_artifact(tmp_path / "art", clip=1.0)
    out = tmp_path / "v"
    export(path, "vllm", out)
    man = json.loads((out / "kvcal-export.json").read_text())
    assert man["nan_risk"] is None
    f = out / "kvcal-kv-scales.safetensors"
    t = load_file(f)
    t["model.layers.1.self_attn.k_scale"] = t["model.layers.1.self_attn.k_scale"] * 0.5
    t["model.layers.2.self_attn.v_scale"] = t["model.layers.2.self_attn.v_scale"] * 0.8
    f.unlink()
    save_file(t, f, metadata={"format": "pt"})
    rtol = 1e-5  # kvcal.export.base.CLIP_RTOL: a scale exactly at amax/448 (float32 rounding) does not clip
    ratios = {f"{s.upper()}{i}": max(truth[(i, s)][1]) / (float(t[f"model.layers.{i}.self_attn.{s}_scale"]) * 448)
              for i in range(L) for s in "kv"}
    want = [k for k, r in ratios.items() if r > 1 + rtol]
    assert want == ["K1", "V2"]
    line = _sglang_risk_line(inspect_path(out))
    assert line and line.startswith(f"2 K/V scales clip values the calibration observed (K1, V2; up to "
                                    f"{max(ratios[k] for k in want):.4g}x"), line
    shutil.rmtree(tmp_path / "art")
    ins = inspect_path(out)
    assert _sglang_risk_line(ins) is None
    assert any(n.startswith("NaN risk in SGLang not checked") and str(tmp_path / "art") in n for n in ins.notes)


def test_inspect_export_clipped_manifest_but_unclipped_files(tmp_path):
    """A clipping vllm export (clip 0.9) whose file scales were raised back to amax / 448: the manifest still
    records nan_risk, but inspect reports no NaN risk (the files clip nothing)."""
    path, truth = make_artifact(tmp_path / "art", clip=0.9)
    out = tmp_path / "v"
    export(path, "vllm", out)
    assert json.loads((out / "kvcal-export.json").read_text())["nan_risk"]["scales"]
    assert _sglang_risk_line(inspect_path(out)) is not None
    f = out / "kvcal-kv-scales.safetensors"
    t = load_file(f)
    for i in range(L):
        for s in "kv":
            t[f"model.layers.{i}.self_attn.{s}_scale"] = torch.tensor([max(truth[(i, s)][1]) / 448 * 1.01])
    f.unlink()
    save_file(t, f, metadata={"format": "pt"})
    assert _sglang_risk_line(inspect_path(out)) is None


@pytest.mark.parametrize("bad", [float("nan"), 0.0, -0.5, float("inf")])
def test_inspect_export_flags_a_bad_scale(tmp_path, plain_ckpt, bad):
    """A NaN, zero, negative or infinite scale in an export (a vllm checkpoint export, a standalone export, an
    sglang-json file) is a warning naming the file and the tensor (or JSON entry) — what `kvcal evaluate --artifact`
    refuses — in inspect's output and the CLI's."""
    path, _ = make_artifact(tmp_path / "art")
    for out, model_dir in ((tmp_path / "ck", plain_ckpt), (tmp_path / "st", None)):
        export(path, "vllm", out, model_dir=model_dir)
        f = out / "kvcal-kv-scales.safetensors"
        t = load_file(f)
        t["model.layers.3.self_attn.v_scale"] = torch.tensor([bad])
        f.unlink()
        save_file(t, f, metadata={"format": "pt"})
        ins = inspect_path(out)
        w = [x for x in ins.warnings if "model.layers.3.self_attn.v_scale" in x]
        assert len(w) == 1 and w[0].startswith(f"{f}: tensor model.layers.3.self_attn.v_scale holds")
        assert "not finite and > 0" in w[0]
        r = CliRunner().invoke(main, ["inspect", str(out)])
        assert r.exit_code == 0 and f"warning: {w[0]}" in r.output
    export(path, "sglang-json", tmp_path / "s")
    f = tmp_path / "s" / "kv_cache_scales.json"
    doc = json.loads(f.read_text())
    doc["kv_cache"]["scaling_factor"]["0"]["2"] = bad
    f.write_text(json.dumps(doc))
    w = [x for x in inspect_path(f).warnings if "not finite and > 0" in x]
    assert len(w) == 1 and w[0].startswith(f"{f}: kv_cache.scaling_factor['0']['2'] = {bad!r}")


def test_inspect_json_with_a_layer_removed_reports_it(tmp_path):
    """An sglang-json export (TP 2, 4 layers) with the last layer removed from every rank still counts the 4 layers
    of the artifact it was exported from and warns, per rank, that layer 3 has no scale (its row empty, SGLang's row
    a startup error); a copy without the manifest, missing layer 1, counts 4 from the highest index and names
    layer 1; a key that is not a layer index is refused in one line."""
    path, _ = make_artifact(tmp_path / "art")
    export(path, "sglang-json", tmp_path / "s", tp=2)
    f = tmp_path / "s" / "kv_cache_scales.json"
    doc = json.loads(f.read_text())
    for r in ("0", "1"):
        del doc["kv_cache"]["scaling_factor"][r]["3"]
    f.write_text(json.dumps(doc))
    ins = inspect_path(f)
    assert ins.num_layers == L and ins.layers[3]["k"] is None
    w = [x for x in ins.warnings if "has no scale" in x]
    assert w == [f"{f}: rank {r!r} has no scale for layer(s) 3 of 4 (the model of the artifact it was exported from "
                 "has 4): SGLang refuses the file at startup — re-export" for r in ("0", "1")]
    assert ins.engines["SGLang"].count("error") == L
    lone = tmp_path / "lone.json"
    doc = json.loads(json.dumps(doc))
    doc["kv_cache"]["scaling_factor"]["0"]["3"] = doc["kv_cache"]["scaling_factor"]["0"].pop("1")
    lone.write_text(json.dumps(doc))
    ins = inspect_path(lone)
    assert ins.num_layers == L
    assert any(x.startswith(f"{lone}: rank '0' has no scale for layer(s) 1 of 4 (the highest layer index")
               for x in ins.warnings), ins.warnings
    doc["kv_cache"]["scaling_factor"]["0"]["x"] = 0.1
    lone.write_text(json.dumps(doc))
    r = CliRunner().invoke(main, ["inspect", str(lone)])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "has the key 'x', not a layer index" in r.output
