"""Exporters: golden names per target, engine remapping rules, checkpoint merges, TP JSON, FNUZ,
SGLang headroom, refusals, atomic output, CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers.export import H_KV, L, make_artifact, make_checkpoint
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kvcal.cli import main
from kvcal.engines.sglang.loader import simulate_sglang, simulate_sglang_json
from kvcal.engines.trtllm.loader import simulate_trtllm
from kvcal.engines.vllm.loader import simulate_vllm
from kvcal.errors import KvcalError
from kvcal.export import ExportError, export, get_target, targets_that_can_load
from kvcal.export.checkpoint import INDEX, SCALES_SHARD, SINGLE_RENAMED
from kvcal.inspect import inspect_path

# ---- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sharded_ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-sharded", sharded=True)


@pytest.fixture(scope="module")
def single_ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-single", sharded=False)


@pytest.fixture
def art(tmp_path):
    return make_artifact(tmp_path / "art")


def tensors_in(path):
    with safe_open(str(path), framework="pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}


def checkpoint_tensors(d):
    """All tensors an engine would read: every tensor of every shard the index lists."""
    index = json.loads((d / INDEX).read_text())
    out = {}
    for f in sorted(set(index["weight_map"].values())):
        out.update(tensors_in(d / f))
    return out


def vllm_names(i):
    return {"k": f"model.layers.{i}.self_attn.k_scale", "v": f"model.layers.{i}.self_attn.v_scale"}


# ---- golden names per target -----------------------------------------------------------------------


def test_vllm_golden_names_and_kv_cache_scheme(tmp_path, art):
    """The vLLM export writes exactly the golden {k,v}_scale names per layer as float32 [1] tensors equal to
    the artifact's scales, a kv_cache_scheme that compressed-tensors' own QuantizationArgs /
    QuantizationConfig parse as 8-bit float static symmetric per tensor, a vllm serve command, and
    compressed-tensors is an alias of vllm."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig

    path, truth = art
    res = export(path, "vllm", tmp_path / "out")
    t = tensors_in(tmp_path / "out" / SCALES_SHARD)
    assert set(t) == {n for i in range(L) for n in vllm_names(i).values()}
    for i in range(L):
        for side in "kv":
            x = t[vllm_names(i)[side]]
            assert x.dtype == torch.float32 and tuple(x.shape) == (1,)
            assert torch.equal(x, truth[(i, side)][0])
    qc = json.loads((tmp_path / "out" / "quantization_config.json").read_text())["quantization_config"]
    args = QuantizationArgs(**qc["kv_cache_scheme"])
    assert (args.num_bits, args.type, args.strategy, args.dynamic, args.symmetric) == (8, "float", "tensor", False, True)
    assert QuantizationConfig.model_validate(qc).kv_cache_scheme == args
    assert res.serve.startswith("vllm serve") and "--kv-cache-dtype fp8" in res.serve
    assert get_target("compressed-tensors") is get_target("vllm")


def test_vllm_per_head_attn_head(tmp_path):
    """A per-head artifact exports [H_kv, 1, 1] scales equal to the artifact's with strategy attn_head; the
    vLLM loader simulator loads every layer and the SGLang one reports an error on every layer (scalars only)
    instead of passing silently."""
    from compressed_tensors.quantization import QuantizationArgs

    path, truth = make_artifact(tmp_path / "art", granularity="head")
    export(path, "vllm", tmp_path / "out")
    t = tensors_in(tmp_path / "out" / SCALES_SHARD)
    for i in range(L):
        x = t[vllm_names(i)["k"]]
        assert tuple(x.shape) == (H_KV, 1, 1) and torch.equal(x, truth[(i, "k")][0])
    qc = json.loads((tmp_path / "out" / "quantization_config.json").read_text())["quantization_config"]
    assert QuantizationArgs(**qc["kv_cache_scheme"]).strategy == "attn_head"
    vl = simulate_vllm(t, L, H_KV, qc)
    assert vl.all_loaded
    sg = simulate_sglang(t, L, H_KV, qc)  # SGLang loads scalars only: must be reported, not silently passed
    assert sg.count("error") == L


def test_modelopt_golden_names(tmp_path, art):
    """The ModelOpt export writes exactly k_proj.k_scale / v_proj.v_scale per layer with the artifact's
    values, and an hf_quant_config.json naming modelopt and FP8 KV."""
    path, truth = art
    export(path, "modelopt", tmp_path / "out")
    t = tensors_in(tmp_path / "out" / SCALES_SHARD)
    want = {f"model.layers.{i}.self_attn.{p}" for i in range(L) for p in ("k_proj.k_scale", "v_proj.v_scale")}
    assert set(t) == want
    assert torch.equal(t["model.layers.2.self_attn.v_proj.v_scale"], truth[(2, "v")][0])
    hq = json.loads((tmp_path / "out" / "hf_quant_config.json").read_text())
    assert hq["producer"]["name"] == "modelopt" and hq["quantization"]["kv_cache_quant_algo"] == "FP8"


def test_trtllm_legacy_golden_names(tmp_path, art):
    """The TensorRT-LLM legacy export writes per layer kv_cache_scaling_factor = max(k, v) of the artifact
    exactly (float32 [1]) and its reciprocal within one rounding, an FP8 quantization.json, and the
    TensorRT-LLM simulator loads every layer."""
    path, truth = art
    export(path, "trtllm-legacy", tmp_path / "out")
    t = tensors_in(tmp_path / "out" / "kv_cache_scales.safetensors")
    assert set(t) == {f"transformer.layers.{i}.attention.{n}" for i in range(L)
                      for n in ("kv_cache_scaling_factor", "kv_cache_rcp_scaling_factor")}
    for i in range(L):
        s = t[f"transformer.layers.{i}.attention.kv_cache_scaling_factor"]
        want = torch.maximum(truth[(i, "k")][0], truth[(i, "v")][0])
        assert s.dtype == torch.float32 and tuple(s.shape) == (1,) and torch.equal(s, want)
        assert torch.allclose(t[f"transformer.layers.{i}.attention.kv_cache_rcp_scaling_factor"], 1 / want)  # 1 rounding
    q = json.loads((tmp_path / "out" / "quantization.json").read_text())
    assert q["quantization"]["kv_cache_quant_algo"] == "FP8"
    assert simulate_trtllm(t, L).all_loaded


def test_sglang_json_tp2(tmp_path, art):
    """The SGLang JSON for TP=2 holds, for ranks 0 and 1 and every layer, max(k, v) of the artifact exactly,
    model_type llama and dtype float8_e4m3fn; the SGLang simulator loads it at TP=2 and reports problems at
    TP=1 or for another model type; the serve command passes --tp 2 and the file."""
    path, truth = art
    res = export(path, "sglang-json", tmp_path / "out", tp=2)
    doc = json.loads((tmp_path / "out" / "kv_cache_scales.json").read_text())
    assert doc["model_type"] == "llama" and doc["kv_cache"]["dtype"] == "float8_e4m3fn"
    sf = doc["kv_cache"]["scaling_factor"]
    assert list(sf) == ["0", "1"]
    for r in ("0", "1"):
        assert list(sf[r]) == [str(i) for i in range(L)]
        for i in range(L):
            want = float(torch.maximum(truth[(i, "k")][0], truth[(i, "v")][0]))
            assert sf[r][str(i)] == want
    assert simulate_sglang_json(doc, L, tp_size=2, model_type="llama").all_loaded
    assert simulate_sglang_json(doc, L, tp_size=1, model_type="llama").problems  # rank count must equal TP
    assert simulate_sglang_json(doc, L, tp_size=2, model_type="qwen2").problems
    assert "--tp 2" in res.serve and "--quantization-param-path" in res.serve


# ---- engine remapping rules (the independent reference) -------------------------------------------


CT_QC = {"quant_method": "compressed-tensors", "config_groups": {},
         "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}}


@pytest.mark.parametrize(
    "names, status, k, v",
    [
        ({"model.layers.0.self_attn.k_scale": 0.5, "model.layers.0.self_attn.v_scale": 0.25}, "loaded", 0.5, 0.25),
        ({"model.layers.0.self_attn.k_proj.k_scale": 0.5, "model.layers.0.self_attn.v_proj.v_scale": 0.25},
         "loaded", 0.5, 0.25),
        ({"model.layers.0.self_attn.qkv_proj.k_scale": 0.5, "model.layers.0.self_attn.qkv_proj.v_scale": 0.25},
         "loaded", 0.5, 0.25),
        ({"model.layers.0.self_attn.kv_scale": 0.5}, "copied", 0.5, 0.5),  # deprecated single scale
        ({"model.layers.0.self_attn.k_scale": 0.5}, "copied", 0.5, 0.5),  # only one
        ({}, "fallback", 1.0, 1.0),  # none: silent 1.0
        ({"model.layers.0.self_attn.k_proj.v_scale": 0.5, "model.layers.0.attention.k_scale": 0.5},
         "fallback", 1.0, 1.0),  # near-miss names are not loaded
    ],
)
def test_vllm_simulator_rules(names, status, k, v):
    """The vLLM loader simulator follows vLLM's name rules per case: k/v_scale, k_proj/v_proj and qkv_proj
    names load; kv_scale or a lone k_scale is copied to the other side; no scale or near-miss names fall back
    to 1.0."""
    tensors = {n: torch.tensor([x]) for n, x in names.items()}
    lay = simulate_vllm(tensors, 1, H_KV, CT_QC).layers[0]
    assert (lay.status, lay.k, lay.v) == (status, [k], [v])


def test_vllm_simulator_shapes_and_config():
    """The vLLM simulator reads the first element of old output_scale tensors under quant_method fp8 (vLLM 0.33
    maps them only in Fp8Config/QuarkConfig.get_cache_scale_mapper) and, under compressed-tensors, ignores them
    with a note (the layer falls back to 1.0); it errors on per-head shapes under a per-tensor scheme, falls back
    without a quantization_config, and reports a problem for another quant_method."""
    old = {"model.layers.0.self_attn.k_proj.output_scale": torch.tensor([0.5, 9.0]),
           "model.layers.0.self_attn.v_proj.output_scale": torch.tensor([0.25])}
    assert simulate_vllm(old, 1, H_KV, {"quant_method": "fp8"}).layers[0].k == [0.5]  # first element only
    ct = simulate_vllm(old, 1, H_KV, CT_QC)
    assert (ct.layers[0].status, ct.layers[0].k, ct.layers[0].v) == ("fallback", [1.0], [1.0])
    assert any("output_scale" in n and "compressed-tensors" in n for n in ct.notes)
    per_head = {vllm_names(0)["k"]: torch.ones(H_KV, 1, 1), vllm_names(0)["v"]: torch.ones(H_KV, 1, 1)}
    assert simulate_vllm(per_head, 1, H_KV, CT_QC).layers[0].status == "error"  # needs attn_head
    ok = {n: torch.tensor([0.1]) for n in vllm_names(0).values()}
    assert simulate_vllm(ok, 1, H_KV, None).layers[0].status == "fallback"  # no quantization_config
    assert simulate_vllm(ok, 1, H_KV, {"quant_method": "awq"}).problems


@pytest.mark.parametrize("target", ["vllm", "modelopt"])
def test_merged_checkpoint_engines_find_every_layer(tmp_path, art, sharded_ckpt, target):
    """A vLLM or ModelOpt export merged into a sharded checkpoint is loaded on every layer by the vLLM and
    SGLang simulators (and TensorRT-LLM's for ModelOpt) with the artifact's K and V values (max(k, v) for
    TensorRT-LLM)."""
    path, truth = art
    out = tmp_path / "merged"
    export(path, target, out, model_dir=sharded_ckpt)
    tensors = checkpoint_tensors(out)
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg.get("quantization_config") if target == "vllm" else {"quant_method": "modelopt"}
    engines = [simulate_vllm(tensors, L, H_KV, qc), simulate_sglang(tensors, L, H_KV, qc)]
    if target == "modelopt":
        engines.append(simulate_trtllm(tensors, L, json.loads((out / "hf_quant_config.json").read_text())))
    for rep in engines:
        assert rep.all_loaded, (rep.engine, rep.problems, [x.message for x in rep.layers])
        for lay in rep.layers:
            if rep.engine == "TensorRT-LLM":
                assert lay.k == [float(torch.maximum(truth[(lay.layer, "k")][0], truth[(lay.layer, "v")][0]))]
            else:
                assert lay.k == truth[(lay.layer, "k")][0].tolist() and lay.v == truth[(lay.layer, "v")][0].tolist()


# ---- checkpoint merges ---------------------------------------------------------------------------------


def test_sharded_two_file_merge(tmp_path, art, sharded_ckpt):
    """Merging into a two-shard checkpoint hard-links the weight shards, keeps every source weight_map entry,
    maps the new scales to the scales shard, recomputes total_size from the tensors, writes a parseable
    per-tensor scheme, copies (not links) editable files, and leaves the source untouched."""
    from compressed_tensors.quantization import QuantizationConfig

    path, _ = art
    src_index = json.loads((sharded_ckpt / INDEX).read_text())
    src_files = sorted(os.listdir(sharded_ckpt))
    src_cfg = (sharded_ckpt / "config.json").read_bytes()
    shards = sorted(set(src_index["weight_map"].values()))
    assert len(shards) == 2
    out = tmp_path / "merged"
    export(path, "vllm", out, model_dir=sharded_ckpt)
    for s in shards:  # weights hard-linked, never rewritten
        assert os.stat(out / s).st_ino == os.stat(sharded_ckpt / s).st_ino
    index = json.loads((out / INDEX).read_text())
    for name, f in src_index["weight_map"].items():
        assert index["weight_map"][name] == f
    for i in range(L):
        for n in vllm_names(i).values():
            assert index["weight_map"][n] == SCALES_SHARD
    sizes = sum(t.numel() * t.element_size() for t in checkpoint_tensors(out).values())
    assert index["metadata"]["total_size"] == sizes
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert QuantizationConfig.model_validate(qc).kv_cache_scheme.strategy == "tensor"
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == L
    assert (out / "generation_config.json").is_file()
    # files a user may edit are copies, never a shared inode with the source (editing the export in
    # place must not change the checkpoint); only weight shards are linked
    for f in ("generation_config.json", "config.json"):
        assert not os.path.samefile(out / f, sharded_ckpt / f)
    # the source is untouched
    assert sorted(os.listdir(sharded_ckpt)) == src_files
    assert (sharded_ckpt / "config.json").read_bytes() == src_cfg


def test_single_file_checkpoint_gets_an_index(tmp_path, art, single_ckpt):
    """Merging into a single-file checkpoint removes model.safetensors (hard-linked under a new name instead),
    writes an index mapping every source weight to it, and notes the index."""
    path, _ = art
    out = tmp_path / "merged"
    res = export(path, "vllm", out, model_dir=single_ckpt)
    assert not (out / "model.safetensors").exists()  # transformers would load it alone and miss the scales
    assert os.stat(out / SINGLE_RENAMED).st_ino == os.stat(single_ckpt / "model.safetensors").st_ino
    index = json.loads((out / INDEX).read_text())
    names = set(load_file(single_ckpt / "model.safetensors"))
    assert {n for n, f in index["weight_map"].items() if f == SINGLE_RENAMED} == names
    assert any("index" in n for n in res.notes)


def test_existing_scales_replaced_and_config_merged(tmp_path, art, single_ckpt):
    """Merging into an FP8 checkpoint that already has 9 stale KV-scale tensors replaces them (noted), keeps
    every weight byte-identical, leaves the source untouched, merges the quantization_config (static KV
    scheme, weight groups and ignore kept), and the vLLM simulator loads the new values."""
    from compressed_tensors.quantization import QuantizationConfig

    path, truth = art
    src = tmp_path / "fp8ckpt"
    src.mkdir()
    weights = load_file(single_ckpt / "model.safetensors")
    stale = {f"model.layers.{i}.self_attn.{s}_scale": torch.tensor([1.0], dtype=torch.bfloat16)
             for i in range(L) for s in "kv"}
    stale["model.layers.0.self_attn.kv_scale"] = torch.tensor([2.0])
    save_file({**weights, **stale}, str(src / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((single_ckpt / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                                                        "strategy": "channel", "symmetric": True,
                                                                        "dynamic": False}}},
        "ignore": ["lm_head"],
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True,
                            "dynamic": True},
    }
    (src / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "merged"
    res = export(path, "vllm", out, model_dir=src)
    assert any("replaced 9 existing KV-scale tensors" in n for n in res.notes)
    shard = tensors_in(out / SINGLE_RENAMED)
    assert set(shard) == set(weights)  # stale scales gone from the copied shard ...
    for n, t in weights.items():  # ... every weight byte-identical
        assert torch.equal(shard[n], t)
    assert set(tensors_in(src / "model.safetensors")) == set(weights) | set(stale)  # source untouched
    tensors = checkpoint_tensors(out)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qc)
    assert parsed.kv_cache_scheme.dynamic is False and "group_0" in parsed.config_groups and qc["ignore"] == ["lm_head"]
    rep = simulate_vllm(tensors, L, H_KV, qc)
    assert rep.all_loaded  # one scale per name, no duplicates, the new values
    assert rep.layers[0].k == truth[(0, "k")][0].tolist()


def test_checkpoint_mismatch_and_overlap_refused(tmp_path, sharded_ckpt):
    """Export refuses an artifact with 3 layers into a 4-layer checkpoint (naming both), an --out inside
    --model-dir (overlaps), and a merge for the standalone-only trtllm-legacy target, writing nothing."""
    path, _ = make_artifact(tmp_path / "art", num_layers=3)
    with pytest.raises(ExportError, match="num_layers is 3 in the artifact but 4 in config.json"):
        export(path, "vllm", tmp_path / "o", model_dir=sharded_ckpt)
    path4, _ = make_artifact(tmp_path / "art4")
    with pytest.raises(ExportError, match="overlaps"):
        export(path4, "vllm", sharded_ckpt / "sub", model_dir=sharded_ckpt)
    with pytest.raises(ExportError, match="standalone"):
        export(path4, "trtllm-legacy", tmp_path / "o", model_dir=sharded_ckpt)
    assert not (tmp_path / "o").exists()


# ---- conversions and warnings ------------------------------------------------------------------------


def test_fnuz_artifact_exported_in_ocp_convention(tmp_path):
    """An e4m3fnuz artifact is exported in the OCP convention: scale x 448 equals the calibrated clip
    (scale_fnuz x 240) within three float32 roundings, the ROCm-doubled scale clips nothing calibrated, and
    the SGLang JSON holds max(k, v) x 240/448 within float32 rounding."""
    path, truth = make_artifact(tmp_path / "art", fmt="fp8_e4m3fnuz")
    res = export(path, "vllm", tmp_path / "out")
    t = tensors_in(tmp_path / "out" / SCALES_SHARD)
    assert any("fnuz" in n for n in res.notes)
    for i in range(L):
        s_fnuz = truth[(i, "k")][0]
        clip = s_fnuz * 240.0  # the calibrated clip point
        s = t[vllm_names(i)["k"]]
        # OCP hardware: exactly the calibrated clip, up to float32 ·240/448 and ·448 (3 roundings ≤ 2e-7)
        assert torch.allclose(s * 448.0, clip, rtol=1e-6)
        rocm = 2 * s  # vLLM/SGLang double loaded scales on FNUZ hardware
        assert bool((rocm * 240.0 >= clip).all())  # ROCm: nothing the calibration kept is clipped
    doc_res = export(path, "sglang-json", tmp_path / "json")
    assert doc_res.tensors["0"].item() == pytest.approx(  # float32 vs float64 ·240/448: ≤ 2 eps32
        float(torch.maximum(truth[(0, "k")][0], truth[(0, "v")][0])) * 240 / 448, rel=1e-6)


def test_sglang_headroom_warning_when_calibration_clipped(tmp_path):
    """Clipped scales that SGLang would load (sglang-json with --clipped-scales; a per-tensor vllm checkpoint,
    whose default is the searched scales) are warned about, naming the fix that flag's target has (drop
    --clipped-scales / --clip-free); TensorRT-LLM, which saturates, is not warned; --headroom 1.1 gives scales >=
    amax/448 x 1.1 and no warning; headroom below 1, above 16, inf or NaN is refused and writes nothing; 16 is
    accepted."""
    path, truth = make_artifact(tmp_path / "art", clip=0.8)  # calibration clipped 20% of the range
    res = export(path, "sglang-json", tmp_path / "a", clipped_scales=True)  # opted into the clipped scales
    warn = [w for w in res.warnings if "without saturating" in w]
    assert warn and "without --clipped-scales" in warn[0]
    vres = export(path, "vllm", tmp_path / "b")
    warn = [w for w in vres.notes if "without saturating" in w]
    assert warn and "--clip-free" in warn[0]  # SGLang loads this checkpoint too: a note (vLLM is the target)
    assert not vres.warnings
    assert not export(path, "trtllm-legacy", tmp_path / "c").warnings  # TensorRT-LLM saturates
    res = export(path, "sglang-json", tmp_path / "d", headroom=1.1)
    assert not res.warnings
    for i in range(L):
        amax = max(max(truth[(i, "k")][1]), max(truth[(i, "v")][1]))
        assert res.tensors[str(i)].item() >= amax / 448 * 1.1 * (1 - 1e-6)  # float32 rounding (≤ 2 eps32) below
    unclipped, _ = make_artifact(tmp_path / "art2", clip=1.0)
    assert not export(unclipped, "sglang-json", tmp_path / "e").warnings
    # below 1 and NaN / inf: what is valid (a number >= 1.0) and why, without the upper bound that does not apply
    for bad, why in ((0.5, "a margin below 1 clips values the calibration observed"),
                     (float("nan"), "not a finite number"), (float("inf"), "not a finite number")):
        with pytest.raises(ExportError, match=r"^--headroom must be a number >= 1\.0") as e:
            export(unclipped, "sglang-json", tmp_path / "f", headroom=bad)
        assert str(e.value).endswith(why) and "16" not in str(e.value), str(e.value)
    # --headroom 1e9 would raise layer 0's k_scale to 2.4e7 (every K/V flushed to 0 in FP8)
    for bad in (1e9, 16.5):
        with pytest.raises(ExportError, match="must be at most 16"):
            export(unclipped, "sglang-json", tmp_path / "g", headroom=bad)
    assert not (tmp_path / "f").exists() and not (tmp_path / "g").exists()
    export(unclipped, "sglang-json", tmp_path / "h", headroom=16.0)  # the bound itself is accepted


# ---- refusals ------------------------------------------------------------------------------------------


def test_refuses_per_channel_int4_for_vllm(tmp_path):
    """Exporting a per-channel int4 artifact to vLLM raises a one-line ExportError naming the format and
    target and saying no target can load it, and writes nothing."""
    path, _ = make_artifact(tmp_path / "art", fmt="int4", granularity="channel")
    with pytest.raises(ExportError) as e:
        export(path, "vllm", tmp_path / "out")
    msg = str(e.value)
    assert "per-channel int4" in msg and "vllm" in msg and "no export target can load it" in msg
    assert "\n" not in msg and not (tmp_path / "out").exists()


def test_refusal_lists_targets_that_can_load(tmp_path):
    """An int8 artifact refused by vLLM names trtllm-legacy as the target that can load it, and that export
    succeeds."""
    path, _ = make_artifact(tmp_path / "art", fmt="int8")
    with pytest.raises(ExportError, match="targets that can load it: trtllm-legacy"):
        export(path, "vllm", tmp_path / "out")
    assert export(path, "trtllm-legacy", tmp_path / "t").tensors


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        ({"key_position": "pre_rope"}, "pre-RoPE"),
        ({"dynamic": True}, "dynamic"),
        ({"symmetric": False}, "asymmetric"),
        ({"fmt": "fp8_e5m2"}, "fp8_e5m2"),
        ({"granularity": "head"}, "per-head"),  # for the per-tensor-only targets
    ],
)
def test_can_load_table(tmp_path, kwargs, reason):
    """The SGLang JSON target refuses pre-RoPE, dynamic, asymmetric, fp8_e5m2 and per-head artifacts with the
    reason named, and a per-head artifact is loadable by vllm and compressed-tensors only."""
    path, _ = make_artifact(tmp_path / "art", **kwargs)
    from kvcal.artifact import load_artifact

    meta = load_artifact(path).metadata
    assert get_target("sglang-json").can_load(meta) is not None
    assert reason in get_target("sglang-json").can_load(meta)
    if kwargs == {"granularity": "head"}:
        assert targets_that_can_load(meta) == ["vllm", "compressed-tensors"]


# ---- output handling -----------------------------------------------------------------------------------


def test_out_exists_refused_unless_overwrite(tmp_path, art):
    """Exporting into an existing export raises ExportError suggesting --overwrite; with overwrite a ModelOpt
    export replaces the vLLM one entirely (no stale quantization_config.json)."""
    path, _ = art
    export(path, "vllm", tmp_path / "out")
    with pytest.raises(ExportError, match="--overwrite"):
        export(path, "vllm", tmp_path / "out")
    export(path, "modelopt", tmp_path / "out", overwrite=True)
    assert (tmp_path / "out" / "hf_quant_config.json").is_file()
    assert not (tmp_path / "out" / "quantization_config.json").exists()


def test_failed_export_leaves_nothing(tmp_path, art, monkeypatch):
    """A target that fails with ENOSPC after writing a partial file raises ExportError saying nothing was
    written, and leaves no output or staging directory."""
    path, _ = art
    tgt = get_target("vllm")

    def boom(ctx, staging):
        (staging / "partial").write_text("x")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tgt, "write", boom)
    with pytest.raises(ExportError, match="nothing was written"):
        export(path, "vllm", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


# ---- CLI -----------------------------------------------------------------------------------------------


def test_cli_export_and_refusal(tmp_path, art):
    """kvcal export prints the SGLang serve command with --tp 2; a per-channel int4 artifact exits 2 with one
    error: line; an unknown target, --out onto the artifact and --overwrite onto a user directory exit 2 with
    their messages (the last two leaving the directories as they were); an earlier export is replaced."""
    path, _ = art
    r = CliRunner().invoke(main, ["export", "--artifact", str(path), "--target", "sglang-json",
                                  "--out", str(tmp_path / "o"), "--tp", "2"])
    assert r.exit_code == 0, r.output
    assert "serve: python -m sglang.launch_server" in r.output and "--tp 2" in r.output
    bad, _ = make_artifact(tmp_path / "int4", fmt="int4", granularity="channel")
    r = CliRunner().invoke(main, ["export", "--artifact", str(bad), "--target", "vllm", "--out", str(tmp_path / "x")])
    assert r.exit_code == 2
    assert r.output.startswith("error: cannot export") and r.output.count("\n") == 1
    assert "Traceback" not in r.output
    r = CliRunner().invoke(main, ["export", "--artifact", str(path), "--target", "tgi", "--out", str(tmp_path / "y")])
    assert r.exit_code == 2 and "unknown export target 'tgi'" in r.output
    # --out onto the artifact itself is refused (it would delete the source kv_scales.safetensors)
    before = sorted(p.name for p in path.iterdir())
    r = CliRunner().invoke(main, ["export", "--artifact", str(path), "--target", "vllm", "--out", str(path), "--overwrite"])
    assert r.exit_code == 2 and "is or contains the input --artifact" in r.output
    assert sorted(p.name for p in path.iterdir()) == before
    user = tmp_path / "mine"
    (user / "sub").mkdir(parents=True)
    r = CliRunner().invoke(main, ["export", "--artifact", str(path), "--target", "vllm", "--out", str(user), "--overwrite"])
    assert r.exit_code == 2 and "replaces only directories kvcal wrote" in r.output and (user / "sub").is_dir()
    # an earlier export may be replaced
    for _ in range(2):
        r = CliRunner().invoke(main, ["export", "--artifact", str(path), "--target", "vllm", "--out", str(tmp_path / "v"),
                                      "--overwrite"])
        assert r.exit_code == 0, r.output


def test_export_error_is_kvcal_error():
    """ExportError is a subclass of KvcalError."""
    assert issubclass(ExportError, KvcalError)


# ---- round trip: export -> inspect -> same numbers ---------------------------------------------------------


@pytest.mark.parametrize("target, combined", [("vllm", False), ("modelopt", False),
                                              ("trtllm-legacy", True), ("sglang-json", True)])
def test_round_trip_export_inspect(tmp_path, art, target, combined):
    """Inspecting each target's export gives back the artifact's K and V scales per layer (max(k, v) on both
    sides for the combined-scale targets)."""
    path, truth = art
    export(path, target, tmp_path / "out", tp=2)
    ins = inspect_path(tmp_path / "out")
    assert ins.num_layers == L
    for row in ins.layers:
        i = row["layer"]
        k, v = truth[(i, "k")][0], truth[(i, "v")][0]
        if combined:
            m = torch.maximum(k, v).tolist()
            assert row["k"] == m and row["v"] == m
        else:
            assert row["k"] == k.tolist() and row["v"] == v.tolist()


def test_round_trip_merged_checkpoint(tmp_path, sharded_ckpt):
    """Inspecting a per-head vLLM export merged into a checkpoint gives back the artifact's per-head K scales,
    loaded by vLLM, with SGLang reporting an error on every layer."""
    path, truth = make_artifact(tmp_path / "art", granularity="head")
    export(path, "vllm", tmp_path / "out", model_dir=sharded_ckpt)
    ins = inspect_path(tmp_path / "out")
    assert ins.kind == "checkpoint" and ins.granularity == "head"
    assert [r["k"] for r in ins.layers] == [truth[(i, "k")][0].flatten().tolist() for i in range(L)]
    assert ins.engines["vLLM"].all_loaded
    assert ins.engines["SGLang"].count("error") == L  # per-head: SGLang cannot load it, and says so


def test_q_scale_passed_through_when_artifact_has_query_stats(tmp_path):
    """An artifact holding q_scale tensors exports them unchanged to vLLM, and the artifact made
    without them holds none (the control)."""
    from kvcal.artifact import load_artifact, write_artifact

    path, _ = make_artifact(tmp_path / "art")
    a = load_artifact(path)
    tensors = {**a.tensors, **{f"model.layers.{i}.self_attn.q_scale": torch.tensor([0.02 + i]) for i in range(L)}}
    write_artifact(tmp_path / "art_q", tensors, a.metadata)
    res = export(tmp_path / "art_q", "vllm", tmp_path / "out")
    t = tensors_in(tmp_path / "out" / SCALES_SHARD)
    assert torch.equal(t["model.layers.3.self_attn.q_scale"], torch.tensor([3.02]))
    assert "model.layers.0.self_attn.q_scale" in res.tensors
    assert "model.layers.0.self_attn.q_scale" not in tensors_in(tmp_path / "art" / "kv_scales.safetensors")


def test_tp_that_the_model_heads_cannot_split_is_refused(tmp_path):
    """SmolLM2-135M has 9 attention / 3 KV heads: an export for TP=2 (or any TP that does not divide them) is
    refused with exit 2 naming the TPs that do, nothing written; TP=3 is exported."""
    from click.testing import CliRunner

    from kvcal.cli import main

    art = Path(__file__).resolve().parents[2] / "artifacts" / "smollm2-135m-fp8"
    # a huge --tp (it once hung) is now refused by the option's own range, before the export looks at heads
    r = CliRunner().invoke(main, ["export", "--artifact", str(art), "--target", "sglang-json", "--tp", str(10**11),
                                  "--out", str(tmp_path / "huge")])
    assert r.exit_code == 2 and "--tp" in r.output and "Traceback" not in r.output and not (tmp_path / "huge").exists()
    for tp, fix in ((2, "choose --tp from 1, 3, 9"), (4, "from 1, 3, 9"), (2**31 - 1, "from 1, 3, 9")):
        r = CliRunner().invoke(main, ["export", "--artifact", str(art), "--target", "sglang-json", "--tp", str(tp),
                                      "--out", str(tmp_path / f"tp{tp}")])
        assert r.exit_code == 2 and f"cannot split over {tp} ranks" in r.output and fix in r.output, r.output
        assert "Traceback" not in r.output and not (tmp_path / f"tp{tp}").exists()
    r = CliRunner().invoke(main, ["export", "--artifact", str(art), "--target", "sglang-json", "--tp", "3",
                                  "--out", str(tmp_path / "tp3")])
    assert r.exit_code == 0 and "cannot split" not in r.output
    r = CliRunner().invoke(main, ["export", "--artifact", str(art), "--target", "vllm", "--out", str(tmp_path / "v")])
    assert r.exit_code == 0 and "next: merge into the checkpoint with --model-dir" in r.output
    # the suggested serve line names the merged checkpoint, never the standalone directory (no weights in it)
    nxt = next(line for line in r.output.splitlines() if line.startswith("next:"))
    assert "vllm serve MERGED_OUT" in nxt and str(tmp_path / "v") not in nxt
    r = CliRunner().invoke(main, ["export", "--artifact", str(art), "--target", "vllm", "--out", str(tmp_path / "v 2")])
    nxt = next(line for line in r.output.splitlines() if line.startswith("next:"))  # a path the shell must quote
    assert r.exit_code == 0 and "vllm serve MERGED_OUT --kv-cache-dtype" in nxt and "v 2" not in nxt, nxt


@pytest.mark.parametrize("later", ["static_int5", "dynamic_int6", "static_fp8_head"])
def test_every_layer_must_be_loadable_not_just_layer_0(tmp_path, later):
    """Per-layer specs (``kv.layer_specs``, e.g. from --bits or the API): a layer other than 0 in a format,
    mode or granularity engines cannot load is refused by name, before anything is written."""
    from kvcal.artifact import write_artifact
    from kvcal.formats.granularity import PerToken
    from kvcal.formats.spec import TensorQuantSpec
    from kvcal.plan import KVPlan, LayerPlan, SidePlan

    D = 16
    fp8 = SidePlan(TensorQuantSpec("fp8_e4m3"), scale=torch.full((1, 1, 1, 1), 0.01))
    other = {"static_int5": SidePlan(TensorQuantSpec("int5"), scale=torch.full((1, 1, 1, 1), 0.3)),
             "dynamic_int6": SidePlan(TensorQuantSpec("int6", PerToken()), clip_ratio=torch.full((H_KV,), 0.9)),
             "static_fp8_head": SidePlan(TensorQuantSpec("fp8_e4m3", "head"), scale=torch.full((1, H_KV, 1, 1), 0.01))}[later]
    plan = KVPlan([LayerPlan(fp8, fp8)] + [LayerPlan(other, other) for _ in range(L - 1)])
    meta = {"model": {"num_layers": L, "num_kv_heads": H_KV, "head_dim": D}, "kv": plan.kv_metadata()}
    assert "layer_specs" in meta["kv"]
    write_artifact(tmp_path / "art", plan.to_tensors(), meta)
    assert targets_that_can_load(meta) == []
    for target in ("vllm", "modelopt", "trtllm-legacy", "sglang-json", "compressed-tensors"):
        r = CliRunner().invoke(main, ["export", "--artifact", str(tmp_path / "art"), "--target", target,
                                      "--out", str(tmp_path / f"out_{target}")])
        assert r.exit_code == 2 and "(layer 1)" in r.output and "Traceback" not in r.output, r.output
        assert not (tmp_path / f"out_{target}").exists()


@pytest.mark.parametrize("target", ["vllm", "modelopt", "sglang-json"])
def test_export_copies_editable_files_and_links_only_weights(tmp_path, art, sharded_ckpt, target):
    """modelopt / sglang-json exports hard-link only the weight shards (.safetensors) from the source;
    config.json, the index and the tokenizer files are copies, so editing the export leaves the source as it was."""
    path, _ = art
    out = tmp_path / target
    export(path, target, out, model_dir=sharded_ckpt)
    for f in sorted(sharded_ckpt.iterdir()):
        if not (out / f.name).exists():
            continue
        linked = os.path.samefile(out / f.name, f)
        assert linked == f.name.endswith(".safetensors"), f.name
    shards = sorted(set(json.loads((sharded_ckpt / INDEX).read_text())["weight_map"].values()))
    assert all(os.path.samefile(out / s, sharded_ckpt / s) for s in shards)  # shards not copied


def test_config_that_differs_from_the_calibrated_one_is_warned(tmp_path, sharded_ckpt):
    """A --model-dir whose config differs from the calibrated one (here rope_theta) is exported with a warning,
    from the calibrated config's sha256 the artifact records; the same config gives no warning."""
    import shutil

    from kvcal.artifact import load_artifact, write_artifact
    from kvcal.export.checkpoint import text_config
    from kvcal.weights import config_hash

    cfg = json.loads((sharded_ckpt / "config.json").read_text())
    path, _ = make_artifact(tmp_path / "art")
    meta = load_artifact(path).metadata
    meta["model"]["config_sha256"] = config_hash(text_config(cfg))
    same = write_artifact(tmp_path / "same", load_file(path / "kv_scales.safetensors"), meta)
    assert not [w for w in export(same, "vllm", tmp_path / "o1", model_dir=sharded_ckpt).warnings if "differs" in w]
    other = tmp_path / "other-ckpt"
    shutil.copytree(sharded_ckpt, other)
    (other / "config.json").write_text(json.dumps({**cfg, "rope_theta": 123456.0}))
    ws = export(same, "vllm", tmp_path / "o2", model_dir=other).warnings
    assert any("differs from the config the artifact was calibrated on" in w and "re-calibrate" in w for w in ws)


def _hub_snapshot(tmp_path, ckpt):
    """A Hugging Face hub-cache layout: snapshots/<rev>/* are relative symlinks to ../../blobs/<hash>."""
    root = tmp_path / "models--org--tiny"
    (root / "blobs").mkdir(parents=True)
    snap = root / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(ckpt.iterdir())):
        blob = root / "blobs" / f"blob{i}"
        blob.write_bytes(f.read_bytes())
        os.symlink(os.path.join("..", "..", "blobs", blob.name), snap / f.name)
    return snap


@pytest.mark.parametrize("target", ["vllm", "modelopt", "sglang-json"])
def test_export_from_a_hub_cache_snapshot_links_the_blobs(tmp_path, art, sharded_ckpt, target):
    """An export from a hub-cache snapshot (relative symlinks into blobs/) hard-links the blobs, never the
    symlinks (no broken link), writes config.json as a regular file, and leaves the permissions of the source's
    weight files unchanged."""
    path, _ = art
    snap = _hub_snapshot(tmp_path, sharded_ckpt)
    shards = sorted(set(json.loads((sharded_ckpt / INDEX).read_text())["weight_map"].values()))
    blob0 = Path(os.path.realpath(snap / shards[0]))
    os.chmod(blob0, 0o600)
    out = tmp_path / "out"
    export(path, target, out, model_dir=snap)
    for s in shards:
        assert not (out / s).is_symlink() and os.path.samefile(out / s, os.path.realpath(snap / s))
    assert not (out / "config.json").is_symlink() and (out / "config.json").is_file()
    assert (blob0.stat().st_mode & 0o777) == 0o600  # the source's permissions are the source's


def test_export_names_a_broken_link_and_follows_linked_dirs(tmp_path, art, sharded_ckpt):
    """A merge follows a symlinked directory in the checkpoint (its file copied) and refuses a broken symlink
    with an ExportError naming it, writing nothing."""
    import shutil

    path, _ = art
    src = tmp_path / "ckpt"
    shutil.copytree(sharded_ckpt, src)
    ext = tmp_path / "ext"
    ext.mkdir()
    (ext / "chat_template.jinja").write_text("{{ messages }}")
    os.symlink(ext, src / "extras")
    export(path, "vllm", tmp_path / "o1", model_dir=src)
    assert (tmp_path / "o1" / "extras" / "chat_template.jinja").read_text() == "{{ messages }}"
    os.symlink(tmp_path / "missing.json", src / "tokenizer_config.json")
    with pytest.raises(ExportError, match="tokenizer_config.json is a broken link"):
        export(path, "vllm", tmp_path / "o2", model_dir=src)
    assert not (tmp_path / "o2").exists()


def test_sglang_json_leaves_out_kv_scales_already_in_the_checkpoint(tmp_path, art, single_ckpt, sharded_ckpt):
    """sglang-json leaves out the checkpoint's own k_scale/v_scale tensors (SGLang may load both beside the
    JSON), as the vllm target does: every other tensor is byte-identical and the source is untouched; in a
    sharded checkpoint only the shard holding them is rewritten and the index loses their names."""
    path, _ = art
    src = tmp_path / "fp8ckpt"
    src.mkdir()
    weights = load_file(single_ckpt / "model.safetensors")
    stale = {f"model.layers.{i}.self_attn.{s}_scale": torch.tensor([9.0]) for i in range(L) for s in "kv"}
    save_file({**weights, **stale}, str(src / "model.safetensors"), metadata={"format": "pt"})
    (src / "config.json").write_text((single_ckpt / "config.json").read_text())
    res = export(path, "sglang-json", tmp_path / "o", model_dir=src)
    out = tensors_in(tmp_path / "o" / "model.safetensors")
    assert set(out) == set(weights)
    assert all(torch.equal(out[k], weights[k]) for k in weights)
    assert set(tensors_in(src / "model.safetensors")) == set(weights) | set(stale)  # source untouched
    assert any(f"holding {2 * L} KV-scale tensors" in n and "filtered copies" in n for n in res.notes), res.notes
    assert not res.warnings or not [w for w in res.warnings if "KV-scale" in w]
    # a sharded checkpoint: only the shard with the scales is rewritten, and the index loses their names
    src2 = tmp_path / "fp8sharded"
    src2.mkdir()
    index = json.loads((sharded_ckpt / INDEX).read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    for f in sharded_ckpt.iterdir():
        (src2 / f.name).write_bytes(f.read_bytes())
    save_file({**load_file(sharded_ckpt / shard), **stale}, str(src2 / shard), metadata={"format": "pt"})
    index["weight_map"].update(dict.fromkeys(stale, shard))
    index["metadata"] = {"total_size": 1000}
    (src2 / INDEX).write_text(json.dumps(index))
    export(path, "sglang-json", tmp_path / "o2", model_dir=src2)
    got = json.loads((tmp_path / "o2" / INDEX).read_text())
    assert not set(stale) & set(got["weight_map"])
    assert got["metadata"]["total_size"] == 1000 - 4 * len(stale)  # one float32 each
    assert checkpoint_tensors(tmp_path / "o2").keys() == checkpoint_tensors(sharded_ckpt).keys()
    # a checkpoint without KV scales is linked unchanged
    res3 = export(path, "sglang-json", tmp_path / "o3", model_dir=single_ckpt)
    assert any("linked unchanged" in n for n in res3.notes)
    assert (tmp_path / "o3" / "model.safetensors").stat().st_ino == (single_ckpt / "model.safetensors").stat().st_ino


# ---- the SGLang path is safe by default; single-scale exports report their cost ---------------


def test_exports_write_the_searched_scales_and_sglang_gets_the_clip_free_ones(tmp_path):
    """The targets of saturating engines (vllm, modelopt, trtllm-legacy) write exactly the searched scales, the
    artifact's tensors, by default — the scales calibrate measured. sglang-json, read only by SGLang (which casts
    without saturating), writes the clip-free set; an artifact recording none gets the amax rule (amax / 448, the
    search's absmax candidate) on its clipped sides, and the note says so. A vllm checkpoint whose scales clip
    records the NaN risk in kvcal-export.json (engines, the clipped sides); --clip-free gives it SGLang-safe
    scales; --clipped-scales keeps sglang-json's searched scales (warned); the two flags together are refused."""
    path, truth = make_artifact(tmp_path / "art", clip=0.8)
    v = export(path, "vllm", tmp_path / "v")
    t = tensors_in(v.out / SCALES_SHARD)
    for i in range(L):
        for side in ("k", "v"):
            assert torch.equal(t[vllm_names(i)[side]].reshape(-1), truth[(i, side)][0].reshape(-1))  # bit for bit
    manifest = json.loads((tmp_path / "v" / "kvcal-export.json").read_text())
    assert manifest["scales"] == "searched"
    assert manifest["nan_risk"]["engines"] == ["SGLang"]
    assert manifest["nan_risk"]["scales"] == [f"{s}{i}" for i in range(L) for s in ("K", "V")]
    assert manifest["nan_risk"]["worst_ratio"] == pytest.approx(1 / 0.8, rel=1e-5)  # amax / (0.8 amax), float32
    res = export(path, "sglang-json", tmp_path / "sj")
    assert not [w for w in res.warnings if "without saturating" in w]
    assert any("amax rule" in n for n in res.notes)
    doc = json.loads((tmp_path / "sj" / "kv_cache_scales.json").read_text())
    for i in range(L):
        amax = max(max(truth[(i, "k")][1]), max(truth[(i, "v")][1]))  # the K/V max, observed in calibration
        # float32 scale: amax / 448 rounded to nearest, so allow one float32 ulp below it
        assert doc["kv_cache"]["scaling_factor"]["0"][str(i)] >= amax / 448 * (1 - 2**-23)
    assert json.loads((tmp_path / "sj" / "kvcal-export.json").read_text())["nan_risk"] is None
    cf = tensors_in(export(path, "vllm", tmp_path / "vcf", clip_free=True).out / SCALES_SHARD)
    for i in range(L):
        for side in ("k", "v"):
            assert float(cf[vllm_names(i)[side]]) >= max(truth[(i, side)][1]) / 448 * (1 - 2**-23)
    clipped = export(path, "sglang-json", tmp_path / "sj2", clipped_scales=True)
    for i in range(L):  # opted in: exactly the calibrated max(k, v)
        assert clipped.tensors[str(i)].item() == float(torch.maximum(truth[(i, "k")][0], truth[(i, "v")][0]))
    trt = export(path, "trtllm-legacy", tmp_path / "trt")
    assert trt.tensors["transformer.layers.0.attention.kv_cache_scaling_factor"].item() == float(
        torch.maximum(truth[(0, "k")][0], truth[(0, "v")][0]))
    with pytest.raises(ExportError, match="give one"):
        export(path, "vllm", tmp_path / "both", clip_free=True, clipped_scales=True)
    assert not (tmp_path / "both").exists()
    r = CliRunner().invoke(main, ["export", "--artifact", str(path), "--target", "sglang-json", "--out",
                                  str(tmp_path / "cli"), "--clipped-scales"])
    assert r.exit_code == 0 and "without saturating" in r.output


def test_clipped_scales_with_headroom_is_refused_not_dropped(tmp_path):
    """--headroom raises every scale to at least margin x observed max / 448, so with it --clipped-scales (the searched
    scales where they clip) could not be honoured: the pair is refused in one line naming both flags, and writes
    nothing (issue 40, class 5: the flag was silently dropped, the written scales clipping nothing). Each flag alone
    still does what it says: --clipped-scales writes the calibrated max(k, v) (clip 0.8 of the observed max), and
    --headroom 2 writes scales >= 2 x observed max / 448 (one float32 rounding below allowed). An artifact that
    records no observed max (--headroom ignored there, noted) keeps --clipped-scales' scales with both flags."""
    path, truth = make_artifact(tmp_path / "art", clip=0.8)
    with pytest.raises(ExportError) as e:
        export(path, "sglang-json", tmp_path / "both", clipped_scales=True, headroom=2.0)
    assert str(e.value) == ("--clipped-scales with --headroom 2: --headroom raises every scale to at least 2x the one "
                            "that just holds the observed max, so no scale would clip and the searched scales "
                            "--clipped-scales asks for would not be written; give one of the two")
    assert not (tmp_path / "both").exists()
    r = CliRunner().invoke(main, ["export", "--artifact", str(path), "--target", "sglang-json", "--out",
                                  str(tmp_path / "cli"), "--headroom", "2", "--clipped-scales"])
    assert r.exit_code == 2 and r.output.strip() == f"error: {e.value}", r.output
    assert not (tmp_path / "cli").exists()
    clipped = export(path, "sglang-json", tmp_path / "c", clipped_scales=True)
    raised = export(path, "sglang-json", tmp_path / "h", headroom=2.0)
    for i in range(L):
        calibrated = torch.maximum(truth[(i, "k")][0], truth[(i, "v")][0])
        assert clipped.tensors[str(i)].item() == float(calibrated)
        amax = max(max(truth[(i, "k")][1]), max(truth[(i, "v")][1]))
        assert raised.tensors[str(i)].item() >= 2 * amax / 448 * (1 - 2**-23)
    bare, bare_truth = make_artifact(tmp_path / "bare", clip=0.8, with_amax=False)
    res = export(bare, "sglang-json", tmp_path / "b", clipped_scales=True, headroom=2.0)
    assert any("--headroom ignored" in n for n in res.notes)
    assert res.tensors["0"].item() == float(torch.maximum(bare_truth[(0, "k")][0], bare_truth[(0, "v")][0]))


def test_clip_free_suggestion_removes_the_nan_risk(tmp_path):
    """The flag the vllm export's NaN warning suggests (--clip-free) is one export accepts, and the checkpoint it
    gives serves every side at a scale covering the observed max (here for searched scales 20x below it), with no
    warning."""
    path, truth = make_artifact(tmp_path / "art", clip=0.05)
    res = export(path, "vllm", tmp_path / "a")
    warn = next(w for w in res.notes if "without saturating" in w)
    assert "--clip-free" in warn
    h = export(path, "vllm", tmp_path / "cf", clip_free=True)
    assert not [w for w in h.warnings + h.notes if "without saturating" in w], h.warnings
    t = tensors_in(h.out / SCALES_SHARD)
    for i in range(L):
        for side in ("k", "v"):  # amax / 448 in float32: one rounding, within 2^-24 relative
            assert float(t[vllm_names(i)[side]]) >= max(truth[(i, side)][1]) / 448 * (1 - 2**-23), (i, side)


def test_single_scale_targets_report_the_shared_scale_cost(tmp_path):
    """sglang-json / trtllm-legacy serve max(K, V) per layer, so the side with the smaller scale is quantized
    served/own times coarser: export names the worst layers and records every layer's ratio in the manifest,
    equal to the ratio computed here independently from the artifact's scales."""
    path, truth = make_artifact(tmp_path / "art")  # keys ~4x values (base 12 vs 3)
    res = export(path, "sglang-json", tmp_path / "a")
    rows = json.loads((tmp_path / "a" / "kvcal-export.json").read_text())["shared_scale"]
    ratios = []
    for i in range(L):
        k, v = float(truth[(i, "k")][0]), float(truth[(i, "v")][0])
        # ratios of float32 scales, float32 vs float64 division: ≤ eps32; a swapped K/V ratio is ≥ 4x off
        assert rows[i]["ratio"]["v"] == pytest.approx(max(k, v) / v, rel=1e-6)
        assert rows[i]["ratio"]["k"] == pytest.approx(max(k, v) / k, rel=1e-6)
        ratios.append((max(k, v) / min(k, v), i))
    line = next(n for n in res.notes + res.warnings if n.startswith("K and V share one scale"))
    r, i = max(ratios)
    side = "V" if float(truth[(i, "v")][0]) < float(truth[(i, "k")][0]) else "K"
    assert f"worst: layer {i} {side} {r:.1f}x" in line
    assert any(line == n for n in res.notes)  # under MAX_HEADROOM (16x): a note, not a warning
    # 40x apart (the committed example's layer 0: K otf 0.0539, V absmax 0.00134): a warning
    big, _ = make_artifact(tmp_path / "big", clip=1.0)
    meta, t = _read_artifact(big)
    t["model.layers.0.self_attn.v_scale"] = t["model.layers.0.self_attn.k_scale"] / 40
    from kvcal.artifact import write_artifact

    big2 = write_artifact(tmp_path / "big2", t, {k: v for k, v in meta.items() if k != "tensor_names"})
    res = export(big2, "trtllm-legacy", tmp_path / "b")
    assert any(w.startswith("K and V share one scale") and "layer 0 V 40.0x" in w for w in res.warnings)
    assert not [n for n in export(path, "vllm", tmp_path / "c").notes if n.startswith("K and V share")]


def test_log_interpolation_of_recorded_errors():
    """Hand-worked: errors 1.0 at scale 0.01 and 3.0 at scale 1.0; at 0.1 (halfway in log10) -> 2.0."""
    from kvcal.export.base import _interp_log

    assert _interp_log([(0.01, 1.0), (1.0, 3.0)], 0.1) == pytest.approx(2.0)  # log10 of decimals: float64 noise
    assert _interp_log([(0.01, 1.0), (1.0, 3.0)], 2.0) is None  # beyond the recorded candidates
    assert _interp_log([(0.01, 1.0), (1.0, 3.0)], 0.01) == 1.0


def _read_artifact(path):
    from safetensors import safe_open

    with safe_open(str(path / "kv_scales.safetensors"), framework="pt") as fh:
        return json.loads(fh.metadata()["kvcal"]), {k: fh.get_tensor(k) for k in fh.keys()}


def test_clip_free_of_an_artifact_recording_none_says_how_many_sides_got_the_amax_rule(tmp_path):
    """An artifact (clip 0.9: every searched scale clips) whose layer 0 serves amax / 448 (clips nothing) and whose
    layer 1 alone records a clip-free choice (amax / 448 x 1.1), as an older kvcal's partial records: --clip-free on
    vllm and the sglang-json default write layer 1's recorded choice, keep layer 0's searched scale and give
    layers 2-3 the amax rule; the note counts them (2 of 2 recorded differ; 4 of the 6 sides without one by the
    amax rule, 2 kept) and kvcal-export.json's scales says 4 sides are by the amax rule, not measured. The counts
    and values are recomputed here from make_artifact's amax."""
    from helpers.export import edited_copy

    src, truth = make_artifact(tmp_path / "src", clip=0.9)
    amax = {(i, s): max(truth[(i, s)][1]) for i in range(L) for s in "kv"}
    own = {(1, s): torch.tensor([amax[(1, s)] / 448 * 1.1], dtype=torch.float32) for s in "kv"}

    def edit(meta, tensors):
        for s in "kv":
            tensors[f"model.layers.0.self_attn.{s}_scale"] = torch.tensor([amax[(0, s)] / 448], dtype=torch.float32)
            meta["layers"][1][s]["clip_free"] = {"scale": own[(1, s)].tolist(), "heldout": 0.01}

    path = edited_copy(src, tmp_path / "art", edit, resign=True)
    want = {}
    for i in range(L):
        for s in "kv":
            a = torch.tensor([amax[(i, s)]], dtype=torch.float32)
            want[(i, s)] = (own[(i, s)] if i == 1 else
                            torch.tensor([amax[(0, s)] / 448], dtype=torch.float32) if i == 0 else a / 448)
    by_rule = sum(1 for i in range(L) for s in "kv" if i >= 2)  # clipped and without a recorded choice
    assert by_rule == 4
    res = export(path, "vllm", tmp_path / "v", clip_free=True)
    t = tensors_in(res.out / SCALES_SHARD)
    for (i, s), w in want.items():
        assert torch.equal(t[vllm_names(i)[s]].reshape(-1), w), (i, s)
    note = next(n for n in res.notes if "recorded clip-free scales differ" in n)
    assert note.startswith("2 of 2 recorded clip-free scales differ from the searched ones")
    assert f"; {by_rule} of the 6 sides without one get the amax rule" in note and ", 2 keep the searched scale" in note
    assert any(n.startswith(f"k/v scales: clip-free (nothing the calibration observed saturates), {by_rule} of 8 "
                            "sides by the amax rule (not measured)") for n in res.notes)
    scales = f"clip_free ({by_rule} sides by the amax rule, not measured)"
    assert json.loads((tmp_path / "v" / "kvcal-export.json").read_text())["scales"] == scales
    sj = export(path, "sglang-json", tmp_path / "sj")
    assert json.loads((tmp_path / "sj" / "kvcal-export.json").read_text())["scales"] == (
        scales + ", as one shared max(K, V) scale per layer")
    doc = json.loads((tmp_path / "sj" / "kv_cache_scales.json").read_text())
    for i in range(L):
        assert doc["kv_cache"]["scaling_factor"]["0"][str(i)] == float(torch.maximum(want[(i, "k")], want[(i, "v")]))
    assert any(f"{by_rule} of the 6 sides without one get the amax rule" in n for n in sj.notes)
    full, _ = make_artifact(tmp_path / "full", clip=1.0)  # nothing clips, nothing recorded: no side by the rule
    export(full, "sglang-json", tmp_path / "f")
    assert json.loads((tmp_path / "f" / "kvcal-export.json").read_text())["scales"] == (
        "clip_free, as one shared max(K, V) scale per layer")


def test_shared_targets_headline_the_measured_shared_figures(tmp_path):
    """trtllm-legacy and sglang-json write max(K, V) per layer, so export's headline held-out means are the search's
    measurement at that shared scale (layers[i].shared[set].heldout, averaged here over the layers), not the separate
    K/V figures, and kvcal-export.json's scales says the files hold one shared max(K, V) scale per layer; where the
    recorded shared scale is not the one written (--headroom raised it) the headline says the shared scale is not
    measured and gives the separate figures (layers[i].{k,v}.heldout.chosen) as such."""
    from helpers.export import edited_copy

    src, truth = make_artifact(tmp_path / "src", clip=1.0)
    figs = {i: {"k": 0.001 * (i + 1), "v": 0.02 * (i + 2)} for i in range(L)}  # distinct from heldout.chosen 0.01

    def edit(meta, tensors):
        for i in range(L):
            m = float(torch.maximum(tensors[f"model.layers.{i}.self_attn.k_scale"],
                                    tensors[f"model.layers.{i}.self_attn.v_scale"]))
            meta["layers"][i]["shared"] = {w: {"scale": m, "heldout": dict(figs[i])} for w in ("searched", "clip_free")}

    path = edited_copy(src, tmp_path / "art", edit, resign=True)
    k = sum(f["k"] for f in figs.values()) / L
    v = sum(f["v"] for f in figs.values()) / L
    want = f"at the shared max(K, V) scale the files hold: K attention KL {k:.3e}, V output error {v:.3e})"
    for target, kw, which in (("trtllm-legacy", {}, "searched"), ("sglang-json", {"clipped_scales": True}, "searched"),
                              ("sglang-json", {}, "clip_free")):
        out = tmp_path / f"{target}-{which}"
        res = export(path, target, out, **kw)
        head = next(n for n in res.notes if n.startswith("k/v scales:"))
        assert ", served as one shared max(K, V) scale per layer (held-out mean over 4 layers" in head, head
        assert head.endswith(want), head
        man = json.loads((out / "kvcal-export.json").read_text())
        assert man["scales"] == f"{which}, as one shared max(K, V) scale per layer"
    res = export(path, "trtllm-legacy", tmp_path / "h", headroom=2.0)
    head = next(n for n in res.notes if n.startswith("k/v scales:"))
    sep = sum(lm[s]["heldout"]["chosen"] for lm in load_artifact_meta(path)["layers"] for s in "k") / L
    assert f"of the separate K and V scales: K attention KL {sep:.3e}" in head and "records no measurement" in head
    assert json.loads((tmp_path / "h" / "kvcal-export.json").read_text())["scales"] == (
        "searched + headroom, as one shared max(K, V) scale per layer")
    v = export(path, "vllm", tmp_path / "v")  # separate K and V scales: the separate figures, no shared wording
    assert not any("shared" in n for n in v.notes if n.startswith("k/v scales:"))


def load_artifact_meta(path):
    from kvcal.artifact import load_artifact

    return load_artifact(path).metadata


# ---- error texts (issue 38/40 follow-ups) -----------------------------------------------------------------------


def test_wrong_target_manifest_and_edited_json_are_named(tmp_path):
    """load_deployed of a vllm export whose kvcal-export.json was edited to say sglang-json names the manifest, the
    target and the missing kv_cache_scales.json with the OS reason (no OS text where a layer belongs); an sglang-json
    export missing layer 2 names layer 2; a non-number names the entry. One line each."""
    from kvcal.artifact.deployed import load_deployed
    from kvcal.errors import ArtifactError

    path, _ = make_artifact(tmp_path / "art")
    export(path, "vllm", tmp_path / "v")
    man = json.loads((tmp_path / "v" / "kvcal-export.json").read_text())
    man["target"] = "sglang-json"
    (tmp_path / "v" / "kvcal-export.json").write_text(json.dumps(man))
    with pytest.raises(ArtifactError) as e:
        load_deployed(tmp_path / "v")
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path / 'v' / 'kvcal-export.json'} names target sglang-json but "
                          f"{tmp_path / 'v' / 'kv_cache_scales.json'} cannot be read (No such file or directory)"), msg
    assert "layer" not in msg and "\n" not in msg
    export(path, "sglang-json", tmp_path / "s")
    f = tmp_path / "s" / "kv_cache_scales.json"
    doc = json.loads(f.read_text())
    del doc["kv_cache"]["scaling_factor"]["0"]["2"]
    f.write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match=r'scaling_factor\["0"\] has no scale for layer 2 \(the model has 4 layers\)'):
        load_deployed(tmp_path / "s")
    doc["kv_cache"]["scaling_factor"]["0"]["2"] = "x"
    f.write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match=r'scaling_factor\["0"\]\["2"\] = \'x\' is not a number'):
        load_deployed(tmp_path / "s")


def test_shared_scale_line_names_the_layers_with_the_worst_measured_cost(tmp_path):
    """With the shared scale's held-out error measured per layer (layers[i].shared), the shared-scale line of a
    trtllm-legacy export names the three layers whose V error it raises most, in that order, with the measured
    increase — here costs assigned in the reverse order of the ratios, so the largest ratio is named last or not at
    all. The increase and ratio are recomputed from the records (V own error heldout.chosen = 0.01)."""
    from helpers.export import edited_copy

    src, truth = make_artifact(tmp_path / "src", clip=1.0)  # keys ~4x values: V is served coarser in every layer
    ratio = {i: float(truth[(i, "k")][0]) / float(truth[(i, "v")][0]) for i in range(L)}
    assert all(r > 1 for r in ratio.values())
    by_ratio = sorted(ratio, key=ratio.get)  # smallest ratio first: it gets the largest cost
    cost = {i: 0.01 * (2.0 + 0.5 * (L - rank)) for rank, i in enumerate(by_ratio)}

    def edit(meta, tensors):
        for i in range(L):
            k = float(tensors[f"model.layers.{i}.self_attn.k_scale"])
            meta["layers"][i]["shared"] = {"searched": {"scale": k, "heldout": {"k": 0.01, "v": cost[i]}}}

    path = edited_copy(src, tmp_path / "art", edit, resign=True)
    res = export(path, "trtllm-legacy", tmp_path / "t")
    line = next(n for n in res.notes + res.warnings if n.startswith("K and V share one scale per layer (max of the "
                                                                    "two): "))
    inc = {i: cost[i] / 0.01 - 1 for i in range(L)}
    worst = sorted(inc, key=inc.get, reverse=True)[:3]
    want = ", ".join(f"layer {i} V {ratio[i]:.1f}x (held-out attention error {inc[i]:+.0%})" for i in worst)
    assert f"worst: {want};" in line, line
    assert worst[0] == by_ratio[0] and by_ratio[-1] not in worst


def test_headroom_nan_and_clipped_scales_on_nvfp4_are_one_line_refusals(tmp_path):
    """`kvcal export --headroom nan` exits 2 with one line saying a number >= 1.0 is valid (no maximum of 16); an
    NVFP4 artifact (vLLM outer scales) refuses --clipped-scales in one line naming the artifact, where it used to be
    accepted silently; without the flag it exports."""
    from kvcal.artifact import write_artifact

    path, truth = make_artifact(tmp_path / "art")
    r = CliRunner().invoke(main, ["export", "--artifact", str(path), "--target", "vllm", "--out",
                                  str(tmp_path / "o"), "--headroom", "nan"])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "16" not in r.output, r.output
    assert "--headroom must be a number >= 1.0" in r.output and "not a finite number" in r.output
    meta, t = _read_artifact(path)
    spec = {"format": "nvfp4", "granularity": "token_group", "group_size": 16, "symmetric": True,
            "scale_dtype": "float8_e4m3fn", "dynamic": True, "bits": 4}
    meta["kv"]["k"], meta["kv"]["v"] = dict(spec), dict(spec)
    outer = {}
    for i in range(L):
        for s in "kv":
            outer[f"model.layers.{i}.self_attn.{s}_outer_scale"] = torch.tensor([max(truth[(i, s)][1]) / 2688])
    meta["vllm"] = {"engine": "vllm", "vllm_version": "0.33.0", "kv_cache_dtype": "nvfp4", "skip_layers": [],
                    "query_quantization": "fp8_e4m3 static q_scale per tensor"}
    nv = write_artifact(tmp_path / "nv", outer, {k: v for k, v in meta.items() if k != "tensor_names"})
    with pytest.raises(ExportError) as e:
        export(nv, "vllm", tmp_path / "n", clipped_scales=True)
    assert str(e.value).startswith(f"--clipped-scales: {nv} holds vLLM NVFP4 outer scales") and "\n" not in str(e.value)
    assert not (tmp_path / "n").exists()
    export(nv, "vllm", tmp_path / "n")
