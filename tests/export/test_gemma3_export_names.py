"""The KV-scale tensor names ``kvcal export`` writes for a tiny Gemma 3 (``Gemma3ForCausalLM``, ``gemma3_text``:
sliding + global layers, one KV head x head_dim 32, q/k-norm), and what vLLM's and SGLang's Gemma 3 loaders do with
them.

The golden names below are written by hand from the engines' released source (vLLM 0.33.0 wheel,
``vllm/model_executor/models/gemma3.py`` + ``models/utils.py`` + ``layers/quantization/base_config.py``; SGLang
0.5.23 wheel, ``sglang/srt/models/gemma3_causal.py`` + ``model_loader/weight_utils.py``), not computed by the code
under test. docs/gemma3-export.md has the reading.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.cli import run_cli as run
from helpers.models import calibrate_tiny_gemma3, safetensors_dir, torch_threads

from kvcal.export.checkpoint import SCALES_SHARD

NL = 4  # layers of the tiny Gemma 3: sliding 0, 1, 3 and global 2

#: the names kvcal writes for --target vllm (compressed-tensors, per tensor), one pair per layer, sliding or global
VLLM_NAMES = {f"model.layers.{i}.self_attn.{s}_scale" for i in range(NL) for s in "kv"}
#: the parameter both engines load each of them into: the attention layer's own k_scale / v_scale
ENGINE_PARAMS = {f"model.layers.{i}.self_attn.{s}_scale": f"model.layers.{i}.self_attn.attn.{s}_scale"
                 for i in range(NL) for s in "kv"}


@pytest.fixture(scope="module")
def gemma(tmp_path_factory, smollm_tokenizer):
    """(tiny Gemma 3 dir, fp8 per-tensor artifact calibrated on 8 x 64 tokens, the same artifact with q_scale)."""
    from kvcal.artifact import load_artifact, write_artifact

    with torch_threads(1):
        d, art = calibrate_tiny_gemma3(tmp_path_factory, smollm_tokenizer, "tiny-gemma3-export")
        a = load_artifact(art)
        q = {f"model.layers.{i}.self_attn.q_scale": torch.tensor([0.01 * (i + 1)]) for i in range(NL)}
        write_artifact(art.parent / "art_q", {**a.tensors, **q}, a.metadata)
        yield d, art, art.parent / "art_q"


def test_fixture_is_gemma3_text(gemma):
    """The tiny model is what the names below are for: Gemma3ForCausalLM, model_type gemma3_text, sliding and global
    layers, one KV head, k_proj / v_proj / q_norm / k_norm under model.layers.{i}.self_attn."""
    cfg = json.loads((gemma[0] / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma3ForCausalLM"] and cfg["model_type"] == "gemma3_text"
    assert cfg["num_key_value_heads"] == 1 and "full_attention" in cfg["layer_types"]
    assert "sliding_attention" in cfg["layer_types"]
    w = safetensors_dir(gemma[0])
    assert {"model.layers.2.self_attn.k_proj.weight", "model.layers.2.self_attn.k_norm.weight"} <= set(w)


def test_vllm_target_writes_the_names_vllm_gemma3_loads(gemma, tmp_path):
    """vLLM 0.33.0 ``model_executor/models/gemma3.py`` ``Gemma3ForCausalLM.load_weights``: ``AutoWeightsLoader``
    with ``hf_to_vllm_mapper`` (stacked ``.{q,k,v}_proj -> .qkv_proj`` only) merged with the quantization config's
    ``get_cache_scale_mapper()`` (``layers/quantization/base_config.py``), whose default rule
    ``(?<!\\.attn)\\.([qkv])_scale$ -> .attn.\\1_scale`` turns ``model.layers.{i}.self_attn.k_scale`` into the
    ``Attention`` parameter ``model.layers.{i}.self_attn.attn.k_scale`` (regex rules run before the stacked ones:
    ``models/utils.py`` ``WeightsMapper._map_name_with_shard``). The merged export holds exactly these k/v names for
    every layer (sliding and global alike), as float32 [1], and a compressed-tensors ``kv_cache_scheme`` with
    ``strategy: tensor`` so the parameters exist (``attention.py`` ``_init_kv_cache_quant``)."""
    from kvcal.export.layouts import engine_param, family

    d, art, _ = gemma
    out = tmp_path / "vllm"
    text = run(["export", "--artifact", str(art), "--target", "vllm", "--model-dir", str(d), "--out", str(out)])
    scales = safetensors_dir(out)
    names = {n for n in scales if n.endswith("_scale")}
    assert names == VLLM_NAMES
    assert all(scales[n].dtype == torch.float32 and tuple(scales[n].shape) == (1,) for n in names)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["kv_cache_scheme"]["strategy"] == "tensor"
    fam = family("gemma3_text")
    assert fam is not None and fam.sglang == "gemma3_causal.py"
    assert {n: engine_param("vLLM", fam, n).param for n in names} == ENGINE_PARAMS
    assert "vllm serve" in text and "SGLang loads these names too (gemma3_causal.py" in text


def test_vllm_target_names_are_what_sglang_gemma3_loads(gemma, tmp_path):
    """SGLang 0.5.23 ``srt/models/gemma3_causal.py`` ``Gemma3ForCausalLM.load_weights`` first calls
    ``model_loader/weight_utils.py`` ``maybe_remap_kv_scale_name``, which rewrites ``.k_scale`` to ``.attn.k_scale``
    (``model.layers.{i}.self_attn.k_scale -> model.layers.{i}.self_attn.attn.k_scale``, the ``RadixAttention``
    parameter that ``CompressedTensorsKVCacheMethod`` creates for a static per-tensor FP8 ``kv_cache_scheme``:
    ``layers/quantization/compressed_tensors/compressed_tensors.py`` ``get_quant_method`` / ``is_supported_scheme``).
    inspect, judging the merged export by the Gemma 3 rules, reports every layer loaded by both engines."""
    from kvcal.export.layouts import engine_param, family
    from kvcal.inspect import inspect_path

    d, art, _ = gemma
    out = tmp_path / "vllm"
    run(["export", "--artifact", str(art), "--target", "vllm", "--model-dir", str(d), "--out", str(out)])
    fam = family("gemma3_text")
    assert {n: engine_param("SGLang", fam, n).param for n in VLLM_NAMES} == ENGINE_PARAMS
    ins = inspect_path(out)
    assert ins.family is fam
    assert ins.engines["vLLM"].all_loaded and ins.engines["SGLang"].all_loaded
    assert len(ins.engines["SGLang"].layers) == NL


def test_standalone_vllm_export_names(gemma, tmp_path):
    """Without --model-dir the scales shard holds the same names (vLLM 0.33.0 ``models/gemma3.py``
    ``Gemma3ForCausalLM.load_weights`` / SGLang 0.5.23 ``models/gemma3_causal.py`` ``Gemma3ForCausalLM.load_weights``
    read them once merged into the checkpoint), and nothing else."""
    out = tmp_path / "standalone"
    run(["export", "--artifact", str(gemma[1]), "--target", "vllm", "--out", str(out)])
    assert set(safetensors_dir(out)) == VLLM_NAMES
    assert (out / SCALES_SHARD).is_file()


# checkpoint name (layer 1) -> (vLLM 0.33.0 parameter, SGLang 0.5.23 parameter); None: not loaded
A, P = "model.layers.1.self_attn", "model.layers.1.self_attn.attn"
GOLDEN = {
    f"{A}.k_scale": (f"{P}.k_scale", f"{P}.k_scale"),  # compressed-tensors (what --target vllm writes)
    f"{A}.v_scale": (f"{P}.v_scale", f"{P}.v_scale"),
    f"{A}.k_proj.k_scale": (f"{P}.k_scale", f"{P}.k_scale"),  # ModelOpt (--target modelopt)
    f"{A}.v_proj.v_scale": (f"{P}.v_scale", f"{P}.v_scale"),
    f"{A}.qkv_proj.k_scale": (f"{P}.k_scale", None),  # fused: SGLang remaps to ...qkv_proj.attn.k_scale, skipped
    f"{A}.kv_scale": (f"{P}.k_scale", f"{P}.k_scale"),  # deprecated, copied to v after loading
    f"{P}.k_scale": (f"{P}.k_scale", None),  # SGLang remaps it again to ...attn.attn.k_scale: skipped
}


@pytest.mark.parametrize("name", list(GOLDEN))
def test_gemma3_loader_rules_golden(name):
    """Per checkpoint name, the parameter each Gemma 3 loader fills: vLLM 0.33.0 ``models/gemma3.py``
    ``Gemma3ForCausalLM.load_weights`` (cache-scale regexes of ``base_config.py`` ``get_cache_scale_mapper``, then
    the stacked ``.k_proj -> .qkv_proj`` substring; unknown ``.{k,v,q}_scale`` results are ignored via
    ``_ignore_unexpected_suffixes``) and SGLang 0.5.23 ``models/gemma3_causal.py`` ``Gemma3ForCausalLM.load_weights``
    (``weight_utils.py`` ``maybe_remap_kv_scale_name``: ``.self_attn.k_proj.k_scale -> .self_attn.attn.k_scale``,
    else ``.k_scale -> .attn.k_scale``, ``.kv_scale -> .attn.k_scale``; a result that is no parameter is skipped
    with a warning)."""
    from kvcal.export.layouts import engine_param, family

    fam = family("gemma3_text")
    for engine, want in zip(("vLLM", "SGLang"), GOLDEN[name], strict=True):
        got = engine_param(engine, fam, name)
        assert got.param == want, (engine, got)
        assert (got.why == "") == (want is not None)


def test_sglang_json_is_refused_for_gemma3(gemma, tmp_path):
    """SGLang 0.5.23 ``srt/models/gemma3_causal.py`` (and ``gemma3_mm.py``) define no ``load_kv_cache_scales``, so
    ``model_executor/model_runner_components/load_model_utils.py`` ``load_kv_cache_scales`` raises RuntimeError at
    startup for ``--quantization-param-path``: kvcal refuses --target sglang-json for Gemma 3 (it used to write
    kv_cache_scales.json with model_type gemma3_text), names the reason and points to --target vllm; inspect's
    simulation of such a file reports the startup error."""
    from kvcal.engines.sglang.export import scales_json
    from kvcal.engines.sglang.loader import simulate_sglang_json

    out = tmp_path / "json"
    text = run(["export", "--artifact", str(gemma[1]), "--target", "sglang-json", "--out", str(out)], code=2)
    assert "gemma3_causal.py" in text and "load_kv_cache_scales" in text and "--target vllm" in text
    assert not out.exists()
    doc = scales_json("gemma3_text", [0.01] * NL, 1)
    rep = simulate_sglang_json(doc, NL, 1, "gemma3_text")
    assert rep.problems and not rep.all_loaded
    assert simulate_sglang_json(scales_json("llama", [0.01] * NL, 1), NL, 1, "llama").all_loaded  # the control


def test_q_scale_export_warns_that_sglang_gemma3_stops(gemma, tmp_path):
    """An artifact with query scales (calibrate --engine vllm) exports ``model.layers.{i}.self_attn.q_scale`` too,
    which vLLM 0.33.0 ``models/gemma3.py`` ``Gemma3ForCausalLM.load_weights`` maps to ``...self_attn.attn.q_scale``;
    SGLang 0.5.23 ``models/gemma3_causal.py`` ``Gemma3ForCausalLM.load_weights`` leaves it unmapped
    (``maybe_remap_kv_scale_name`` handles k/v only) and indexes ``params_dict[name]`` without a check — a KeyError
    — so the export warns that the checkpoint serves in vLLM only and does not offer SGLang."""
    d, _, art_q = gemma
    out = tmp_path / "q"
    text = run(["export", "--artifact", str(art_q), "--target", "vllm", "--model-dir", str(d), "--out", str(out)])
    names = {n for n in safetensors_dir(out) if n.endswith("_scale")}
    assert names == VLLM_NAMES | {f"model.layers.{i}.self_attn.q_scale" for i in range(NL)}
    warn = [x for x in text.splitlines() if x.startswith("warning: SGLang's gemma3_causal.py")]
    assert len(warn) == 1 and "KeyError" in warn[0] and "model.layers.0.self_attn.q_scale" in warn[0]
    assert "SGLang loads these names too" not in text


def test_inspect_flags_q_scale_for_sglang_gemma3(gemma, tmp_path):
    """A merged Gemma 3 checkpoint holding ``q_scale`` (calibrate --engine vllm): inspect says SGLang 0.5.23's
    ``gemma3_causal.py`` stops on it (KeyError, the name is not a parameter and is not remapped), naming the
    tensor, and lists no SGLang layer as loaded; vLLM still loads every layer's k/v scales."""
    from kvcal.inspect import inspect_path, render

    d, _, art_q = gemma
    out = tmp_path / "q"
    run(["export", "--artifact", str(art_q), "--target", "vllm", "--model-dir", str(d), "--out", str(out)])
    ins = inspect_path(out)
    sg = ins.engines["SGLang"]
    assert len(sg.problems) == 1 and "KeyError" in sg.problems[0] and "model.layers.0.self_attn.q_scale" in sg.problems[0]
    assert not sg.all_loaded and sg.layers == []
    assert ins.engines["vLLM"].all_loaded and len(ins.engines["vLLM"].layers) == NL
    assert "KeyError" in render(ins)
