"""kvcal's vLLM export loaded by a *real* loader: transformers + compressed-tensors.

Every other export test checks kvcal's own simulation of the engines' naming rules. Here a tiny random
Llama (``save_pretrained``), artifacts whose scales are the model's measured per-head absmax / 448 (per
tensor and per head), and ``kvcal export --target vllm --model-dir`` are loaded with
``AutoModelForCausalLM.from_pretrained`` in a subprocess whose ``PYTHONPATH`` puts transformers 5.23.0
first (installed by ``make venv`` with ``pip install --no-deps --target .venv/tf523``; the project's own
transformers 5.24 is not a loader that applies KV schemes, see the canary below).

Exact logits: compressed-tensors' fake quant (``forward_helpers._quantize`` / ``_dequantize``,
``quant_args.round_to_quantized_type_args``) computes ``clamp(x / scale, -448, 448)`` cast to
``float8_e4m3fn`` and back, times ``scale``, in float32 for a float32 model; kvcal's
``quantize_fp8`` / ``dequantize_fp8`` compute the same float32 operations in the same order. compressed-
tensors applies it at the cache update, kvcal (Protocol A) at the attention-function call; between the
two the cache hands the same tensors through, and both runs use the same transformers and weights. So the
arithmetic is shared and the logits must be bit-identical — no tolerance.

The canary runs under the project's transformers: today (5.24 + compressed-tensors 0.20.1) the same export
loads with its scales as unexpected keys, nothing attached and logits equal to the unquantized model's.
When upstream fixes the argument name, the canary fails: then update ``docs/serving.md``, the export /
inspect warning tests and this file.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers.export import H_KV, L, make_artifact, make_checkpoint
from safetensors.torch import load_file, save_file

from kvcal.cli import main
from kvcal.export.checkpoint import INDEX, SCALES_SHARD
from kvcal.export.hf_loader import check_transformers_kv

#: where ``make venv`` installs transformers 5.23.0 (``pip install --no-deps --target``); override with
#: KVCAL_TF523_DIR
TF523 = Path(os.environ.get("KVCAL_TF523_DIR") or Path(sys.prefix) / "tf523")
PROBE = Path(__file__).with_name("hf_loader_probe.py")
DROPPED = "model.layers.1.self_attn.k_scale"


def _tf523_or_skip() -> Path:
    if (TF523 / "transformers" / "__init__.py").is_file():
        return TF523
    msg = (f"transformers 5.23.0 is not installed at {TF523} (run `make venv`, or `pip install --no-deps --target "
           f"{TF523} transformers==5.23.0`); the real-loader test needs it")
    if os.environ.get("CI"):
        pytest.fail(msg)  # CI builds the venv with `make venv`, so there the test must run
    pytest.skip(msg)


def _measured_amax(ckpt: Path, ids: torch.Tensor) -> dict:
    """Per-head absmax of every layer's post-RoPE K and V on ``ids`` (kvcal's capture hook)."""
    from transformers import AutoModelForCausalLM

    from kvcal.capture.hooks import capture_kv

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    amax: dict = {}

    def on_layer(i, q, k, v, module):
        for side, t in (("k", k), ("v", v)):
            amax[(i, side)] = t.abs().amax(dim=(0, 2, 3)).tolist()  # [B,H_kv,S,D] -> [H_kv]

    with torch.no_grad(), capture_kv(model, on_layer):
        model(ids)
    assert len(amax) == 2 * L
    return amax


def _export(art: Path, ckpt: Path, out: Path) -> str:
    r = CliRunner().invoke(main, ["export", "--artifact", str(art), "--target", "vllm", "--model-dir", str(ckpt),
                                  "--out", str(out)])
    assert r.exit_code == 0, r.output
    return r.output


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("real_loader")
    ckpt = make_checkpoint(root / "tiny", sharded=True)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    amax = _measured_amax(ckpt, ids)
    cases = {}
    for gran in ("tensor", "head"):
        art, _ = make_artifact(root / f"art-{gran}", granularity=gran, amax_per_head=amax)
        out = root / f"export-{gran}"
        text = _export(art, ckpt, out)
        cases[gran] = {"artifact": art, "export": out, "output": text,
                       "scales": load_file(out / SCALES_SHARD)}
    # the same per-tensor export with one scale tensor removed (a hand-merged checkpoint that lost one)
    miss = root / "export-missing"
    shutil.copytree(cases["tensor"]["export"], miss)
    tensors = {k: v for k, v in load_file(miss / SCALES_SHARD).items() if k != DROPPED}
    (miss / SCALES_SHARD).unlink()
    save_file(tensors, str(miss / SCALES_SHARD), metadata={"format": "pt"})
    index = json.loads((miss / INDEX).read_text())
    del index["weight_map"][DROPPED]
    (miss / INDEX).write_text(json.dumps(index))
    return {"root": root, "ckpt": ckpt, "ids": ids, "cases": cases, "missing": miss}


@pytest.fixture(scope="module")
def probe(exports):
    tf = _tf523_or_skip()
    root = exports["root"]
    spec = {"ids": exports["ids"].tolist(), "base": str(exports["ckpt"]),
            "cases": [{"name": g, "export": str(c["export"]), "artifact": str(c["artifact"])}
                      for g, c in exports["cases"].items()],
            "missing": {"export": str(exports["missing"]), "name": DROPPED}}
    (root / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tf), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    r = subprocess.run([sys.executable, str(PROBE), str(root / "spec.json"), str(root / "out.pt")],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return torch.load(root / "out.pt", weights_only=False)


@pytest.mark.parametrize("gran", ["tensor", "head"])
def test_transformers_523_loads_and_applies_the_export(exports, probe, gran):
    """transformers 5.23.0 + compressed-tensors load the vLLM export (per tensor and per head) with no missing or
    unexpected key and attach every layer's k_scale/v_scale bit-equal to the exported tensor, float32, in its shape ([1]
    or [H_kv, 1, 1]); the KV fake-quant hook runs once per layer and side, kvcal's signature check agrees the scheme
    applies, and the logits are bit-identical to kvcal's Protocol A of the same artifact (shared arithmetic: no
    tolerance) and differ from the unquantized model's and from Protocol A with every scale 1.0."""
    assert probe["transformers"] == "5.23.0"
    got = probe[gran]
    exported = exports["cases"][gran]["scales"]
    assert got["missing_keys"] == [] and got["unexpected_keys"] == []
    # every layer's k_scale / v_scale attached, bit-equal to the export, in its shape ([1] or [H_kv,1,1])
    assert sorted(got["scales"]) == sorted(f"model.layers.{i}.self_attn.{s}_scale" for i in range(L) for s in "kv")
    for name, t in got["scales"].items():
        want = exported[name]
        assert t.dtype == torch.float32 and tuple(t.shape) == tuple(want.shape), name
        assert torch.equal(t, want), name
    assert tuple(exported["model.layers.0.self_attn.k_scale"].shape) == ((1,) if gran == "tensor" else (H_KV, 1, 1))
    # compressed-tensors' KV hook ran: one K and one V fake-quant per layer for the one forward pass
    assert got["hook_calls"] == {"k": L, "v": L}
    assert got["check"] is True  # kvcal's signature check agrees this pair applies the scheme
    # logits: exactly kvcal's Protocol A of the same artifact (shared arithmetic, module docstring) ...
    assert torch.equal(got["ct_logits"], got["protocol_a"])
    # ... and not the unquantized model's, nor those of the all-1.0 fallback plan
    assert not torch.equal(got["ct_logits"], probe["base_logits"])
    assert not torch.equal(got["ct_logits"], got["unity"])


def test_transformers_523_loads_a_missing_scale_uninitialized(probe):
    """The failure ``kvcal inspect`` warns about: a declared kv_cache_scheme with a scale missing loads without
    error, the scale only listed as missing and left as compressed-tensors allocated it (``torch.empty`` in
    ``quantization/lifecycle/initialize.py``; seen as 0.0 in the issue and 1.2e-38 here), not the exported value
    nor a 1.0 fallback."""
    got = probe["missing"]
    assert got["missing_keys"] == [DROPPED] and got["unexpected_keys"] == []
    assert DROPPED in got["scales"]  # the parameter exists, holding whatever the allocation held
    assert not torch.equal(got["scales"][DROPPED], probe["tensor"]["scales"][DROPPED])


def test_canary_project_transformers_drops_kv_scales_silently(exports):
    """Today's silent drop under the project's transformers (5.24 + compressed-tensors 0.20.1). When this
    fails, upstream applies KV schemes again: update docs/serving.md and the warning tests."""
    from transformers import AutoModelForCausalLM

    case = exports["cases"]["tensor"]
    names = sorted(case["scales"])
    model, info = AutoModelForCausalLM.from_pretrained(case["export"], output_loading_info=True,
                                                       dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(exports["ckpt"], dtype=torch.float32)
    assert sorted(info["unexpected_keys"]) == names  # loaded "fine", the 2*L scales merely unexpected
    assert not any(hasattr(m, "k_scale") or hasattr(m, "v_scale") for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model.eval()(exports["ids"]).logits, base.eval()(exports["ids"]).logits)
    # what kvcal says about it: the signature check, and the one-line warning of `kvcal export`
    cfg = json.loads((case["export"] / "config.json").read_text())
    chk = check_transformers_kv(cfg)
    assert chk is not None and not chk.applies and chk.silent
    assert "LlamaAttention.forward takes" in chk.reason and "cache" in chk.forward_params
    lines = [x for x in case["output"].splitlines() if "would silently ignore" in x]
    assert len(lines) == 1 and lines[0].startswith("warning: transformers ") and "vLLM" in lines[0]
    assert lines[0].endswith("past_key_values (5.23.0 checked)")  # the version the probe above loaded with
