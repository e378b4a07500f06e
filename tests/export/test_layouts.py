"""KV-scale names per model family and loader (kvcal.export.layouts), the vLLM export's names, and what
``kvcal inspect`` reports per layer — on tiny ``save_pretrained`` checkpoints of six families.

The golden table below is written by hand from the loaders' released source (vLLM 0.33.0
``base_config.get_cache_scale_mapper`` + ``models/utils.py``; SGLang 0.5.23 ``weight_utils.maybe_remap_kv_scale_name``
and the ``load_weights`` of ``llama.py`` / ``qwen2.py`` / ``mixtral.py`` / ``qwen3_moe.py``; compressed-tensors
0.20.1 ``initialize.py``), not computed by the code under test.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from helpers.export import H, make_artifact
from safetensors.torch import load_file, save_file

from kvcal.cli import main
from kvcal.export.checkpoint import INDEX, SCALES_SHARD
from kvcal.export.hf_loader import check_transformers_kv
from kvcal.export.layouts import FAMILIES, engine_param, family
from kvcal.inspect import inspect_path, render

NL = 2  # layers of the tiny checkpoints
ATTN = "model.layers.1.self_attn"
VATTN = f"{ATTN}.attn"
NEOX = "gpt_neox.layers.1.attention"

# (family, checkpoint name) -> (vLLM param, SGLang param, transformers param); None = ignored
GOLDEN = {
    # Llama: every layout loads in vLLM; SGLang's maybe_remap has no qkv_proj rule; transformers only {attn}.k_scale
    ("llama", f"{ATTN}.k_scale"): (f"{VATTN}.k_scale", f"{VATTN}.k_scale", f"{ATTN}.k_scale"),
    ("llama", f"{ATTN}.k_proj.k_scale"): (f"{VATTN}.k_scale", f"{VATTN}.k_scale", None),
    ("llama", f"{ATTN}.qkv_proj.v_scale"): (f"{VATTN}.v_scale", None, None),
    ("llama", f"{ATTN}.kv_scale"): (f"{VATTN}.k_scale", f"{VATTN}.k_scale", None),
    # Phi-3 (fused qkv_proj): same loaders as Llama (vLLM and SGLang subclass the Llama model)
    ("phi3", f"{ATTN}.v_scale"): (f"{VATTN}.v_scale", f"{VATTN}.v_scale", f"{ATTN}.v_scale"),
    ("phi3", f"{ATTN}.qkv_proj.k_scale"): (f"{VATTN}.k_scale", None, None),
    ("phi3", f"{ATTN}.v_proj.v_scale"): (f"{VATTN}.v_scale", f"{VATTN}.v_scale", None),
    # GPT-NeoX (fused query_key_value, attention at gpt_neox.layers.{i}.attention; vLLM Transformers backend)
    ("gpt_neox", f"{NEOX}.k_scale"): ("model.layers.1.attention.attn.k_scale", None, None),
    ("gpt_neox", f"{NEOX}.query_key_value.k_scale"): (None, None, None),
    ("gpt_neox", f"{ATTN}.k_scale"): (None, None, None),  # the Llama name kvcal used to write for every family
    ("gpt_neox", f"{NEOX}.kv_scale"): ("model.layers.1.attention.attn.k_scale", None, None),
    # Qwen2 / Mixtral / Qwen3-MoE: SGLang's load_weights does not remap; only its own parameter name loads
    ("qwen2", f"{ATTN}.k_scale"): (f"{VATTN}.k_scale", None, f"{ATTN}.k_scale"),
    ("qwen2", f"{ATTN}.k_proj.k_scale"): (f"{VATTN}.k_scale", None, None),
    ("qwen2", f"{VATTN}.v_scale"): (f"{VATTN}.v_scale", f"{VATTN}.v_scale", None),
    ("mixtral", f"{ATTN}.qkv_proj.k_scale"): (f"{VATTN}.k_scale", None, None),
    ("mixtral", f"{ATTN}.kv_scale"): (f"{VATTN}.k_scale", None, None),
    ("qwen3_moe", f"{ATTN}.v_scale"): (f"{VATTN}.v_scale", None, f"{ATTN}.v_scale"),
    ("qwen3_moe", f"{VATTN}.k_scale"): (f"{VATTN}.k_scale", f"{VATTN}.k_scale", None),
}


@pytest.mark.parametrize(("fam", "name"), list(GOLDEN))
def test_engine_param_golden(fam, name):
    """engine_param maps each checkpoint scale name to the vLLM / SGLang / transformers parameter of the
    hand-written GOLDEN table (from the loaders' released source), gives a reason exactly when a name is
    ignored, and marks vLLM kv_scale names as filling both sides."""
    want = dict(zip(("vLLM", "SGLang", "transformers"), GOLDEN[(fam, name)], strict=True))
    for engine, param in want.items():
        got = engine_param(engine, FAMILIES[fam], name)
        assert got.param == param, (engine, got)
        assert (got.why == "") == (param is not None)
    if name.endswith("kv_scale"):
        assert engine_param("vLLM", FAMILIES[fam], name).sides == "kv"  # copied to v after loading


def _tiny(model_type: str):
    """A 2-layer config of the family: hidden 64, 4 heads of 16, 2 KV heads (GPT-NeoX: 4, it has no GQA)."""
    from transformers import AutoConfig

    common = dict(num_hidden_layers=NL, hidden_size=64, intermediate_size=128, num_attention_heads=H,
                  vocab_size=128, max_position_embeddings=256)
    extra = {
        "llama": dict(num_key_value_heads=2),
        "phi3": dict(num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        "gpt_neox": dict(rotary_pct=1.0),
        "qwen2": dict(num_key_value_heads=2),
        "mixtral": dict(num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1),
        "qwen3_moe": dict(num_key_value_heads=2, head_dim=16, num_experts=2, num_experts_per_tok=1,
                          moe_intermediate_size=32),
    }[model_type]
    return AutoConfig.for_model(model_type, **common, **extra)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("families")
    out = {}
    torch.manual_seed(0)
    for mt in FAMILIES:
        cfg = _tiny(mt)
        d = root / mt
        AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
        out[mt] = d
    return out


@pytest.mark.parametrize("mt", list(FAMILIES))
def test_vllm_export_names_and_inspect_per_layer(tmp_path, checkpoints, mt):
    """For each of six families, a vLLM export into a tiny checkpoint writes exactly the family's {k,v}_scale
    names per layer, inspect reports every one loaded by vLLM (SGLang only for Llama and Phi-3, with one
    warning for Qwen2 / Mixtral / Qwen3-MoE; transformers except GPT-NeoX), and the rendered text names the
    family's attention path."""
    fam = family(mt)
    nkv = 4 if mt == "gpt_neox" else 2
    art, _ = make_artifact(tmp_path / "art", model_type=mt, num_kv_heads=nkv, num_layers=NL)
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["export", "--artifact", str(art), "--target", "vllm", "--model-dir",
                                  str(checkpoints[mt]), "--out", str(out)])
    assert r.exit_code == 0, r.output
    sglang_warn = [x for x in r.output.splitlines() if x.startswith("warning: SGLang's ")]
    assert len(sglang_warn) == (1 if mt in ("qwen2", "mixtral", "qwen3_moe") else 0)
    names = sorted(load_file(out / SCALES_SHARD))
    attn = "gpt_neox.layers.{i}.attention" if mt == "gpt_neox" else "model.layers.{i}.self_attn"
    assert names == sorted(f"{attn.format(i=i)}.{s}_scale" for i in range(NL) for s in "kv")
    ins = inspect_path(out)
    assert ins.family is fam and [r["layer"] for r in ins.params] == list(range(NL))
    for row in ins.params:
        i = row["layer"]
        by_name = {t["name"]: t for t in row["tensors"]}
        assert sorted(by_name) == sorted(f"{attn.format(i=i)}.{s}_scale" for s in "kv")
        for name, t in by_name.items():
            side = name[-7]
            vattn = "model.layers.{i}.attention" if mt == "gpt_neox" else "model.layers.{i}.self_attn"
            assert t["vLLM"].param == f"{vattn.format(i=i)}.attn.{side}_scale"  # the export loads in vLLM
            sglang_loads = mt in ("llama", "phi3")
            assert (t["SGLang"].param is not None) == sglang_loads, t["SGLang"]
            assert (t["transformers"].param == name) == (mt != "gpt_neox")
    assert ins.engines["vLLM"].all_loaded
    sg = ins.engines["SGLang"]
    assert sg.all_loaded if mt in ("llama", "phi3") else sg.count("fallback") == NL
    text = render(ins)
    assert f"parameters each loader fills ({mt}: attention {attn}" in text
    assert "layers 0-1 ({i} = layer):" in text


def test_inspect_ignored_layouts_per_layer(tmp_path, checkpoints):
    """A Qwen2 checkpoint with ModelOpt names in layer 0 and fused-qkv names in layer 1: the per-layer report
    names what each loader does with each tensor, and the engine verdicts follow it."""
    src = checkpoints["qwen2"]
    d = tmp_path / "qwen2-mixed"
    d.mkdir()
    w = load_file(src / "model.safetensors")
    extra = {n: torch.tensor([0.02]) for n in (
        "model.layers.0.self_attn.k_proj.k_scale", "model.layers.0.self_attn.v_proj.v_scale",
        "model.layers.1.self_attn.qkv_proj.k_scale", "model.layers.1.self_attn.qkv_proj.v_scale")}
    save_file({**w, **extra}, str(d / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {}, "format": "dense",
                                  "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                      "symmetric": True, "dynamic": False}}
    (d / "config.json").write_text(json.dumps(cfg))
    ins = inspect_path(d)
    t0 = {t["name"]: t for t in ins.params[0]["tensors"]}["model.layers.0.self_attn.k_proj.k_scale"]
    assert t0["vLLM"].param == "model.layers.0.self_attn.attn.k_scale"
    assert t0["SGLang"].param is None and "model.layers.0.self_attn.qkv_proj.k_scale" in t0["SGLang"].why
    assert t0["transformers"].param is None
    assert ins.engines["vLLM"].all_loaded and ins.engines["SGLang"].count("fallback") == NL
    text = render(ins)
    assert "  layer 0:\n    model.layers.0.self_attn.k_proj.k_scale\n        vLLM -> model.layers.0.self_attn.attn.k_scale" \
        in text
    assert "SGLang: ignored (looked up as model.layers.1.self_attn.qkv_proj.k_scale" in text
    # compressed-tensors loads neither layout (not its parameter names): every layer would be left uninitialized
    warn = [w for w in ins.warnings if "lack a K or V scale" in w]
    assert len(warn) == 1 and "layers 0-1 " in warn[0] and "model.layers.{i}.self_attn.{k,v}_scale" in warn[0]
    hf = next(e for name, e in ins.engines.items() if name.startswith("transformers + compressed-tensors"))
    assert hf.count("loaded") == 0


def test_inspect_warns_declared_scheme_with_a_missing_scale(tmp_path, checkpoints):
    """A vllm export whose config.json declares a kv_cache_scheme but lacks layer 1's v_scale gets exactly one
    inspect warning naming the layer (transformers + compressed-tensors load such a checkpoint without error and
    with a garbage scale, see tests/export/test_real_loader.py); the complete export gets none."""
    art, _ = make_artifact(tmp_path / "art", num_layers=NL)
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["export", "--artifact", str(art), "--target", "vllm", "--model-dir",
                                  str(checkpoints["llama"]), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert not [w for w in inspect_path(out).warnings if "lack a K or V scale" in w]
    tensors = {k: v for k, v in load_file(out / SCALES_SHARD).items() if k != "model.layers.1.self_attn.v_scale"}
    (out / SCALES_SHARD).unlink()
    save_file(tensors, str(out / SCALES_SHARD))
    idx = json.loads((out / INDEX).read_text())
    del idx["weight_map"]["model.layers.1.self_attn.v_scale"]
    (out / INDEX).write_text(json.dumps(idx))
    r = CliRunner().invoke(main, ["inspect", str(out)])
    assert r.exit_code == 0
    lines = [x for x in r.output.splitlines() if "lack a K or V scale" in x]
    assert len(lines) == 1 and lines[0].startswith("warning: config.json declares a kv_cache_scheme but layers 1 ")


def test_inspect_and_export_state_the_installed_transformers_verdict(tmp_path, checkpoints):
    """The one-line warning appears exactly when the installed pair's signature check says it drops the scales
    (the canary in test_real_loader.py ties that check to an actual load)."""
    art, _ = make_artifact(tmp_path / "art", num_layers=NL)
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["export", "--artifact", str(art), "--target", "vllm", "--model-dir",
                                  str(checkpoints["llama"]), "--out", str(out)])
    chk = check_transformers_kv(json.loads((out / "config.json").read_text()))
    assert chk is not None
    drop = [x for x in r.output.splitlines() if "would silently ignore" in x]
    assert len(drop) == (0 if chk.applies else 1)
    text = render(inspect_path(out))
    assert (f"warning: {chk.warning()}" in text) == (not chk.applies)
    # gpt_neox: no transformers version attaches scales to query_key_value attention
    art, _ = make_artifact(tmp_path / "art-neox", model_type="gpt_neox", num_kv_heads=4, num_layers=NL)
    r = CliRunner().invoke(main, ["export", "--artifact", str(art), "--target", "vllm", "--model-dir",
                                  str(checkpoints["gpt_neox"]), "--out", str(tmp_path / "neox")])
    line = next(x for x in r.output.splitlines() if "would silently ignore" in x)
    assert "GPTNeoXAttention has no k_proj/v_proj/qkv_proj/kv_b_proj child" in line
    assert "vLLM" in line and "5.23.0" not in line  # no transformers version applies them: none is offered
