"""Subprocess half of ``tests/export/test_real_loader.py``: load kvcal exports through a *real* transformers +
compressed-tensors stack and report what it did.

Run as ``PYTHONPATH=<dir with transformers 5.23.0> python tests/export/hf_loader_probe.py SPEC.json OUT.pt``
(the project's own transformers is 5.24, whose attention forward no longer takes ``past_key_values``,
so compressed-tensors 0.20.1 ignores KV schemes there; 5.23.0 lives in a separate ``pip install
--target`` directory so the project's venv is untouched). SPEC::

    {"ids": [[int]], "base": <unquantized checkpoint dir>,
     "cases": [{"name": str, "export": <kvcal export --model-dir dir>, "artifact": <artifact dir>}],
     "missing": {"export": <export with one scale tensor removed>, "name": <that tensor's name>}}

OUT (``torch.save``): ``transformers`` (version), ``base_logits`` (unquantized ``[B, S, V]``
float32), and per case: ``missing_keys``, ``unexpected_keys``, ``scales`` ({param name: float32
tensor} of every attention module's ``k_scale``/``v_scale``), ``hook_calls`` ({"k": n, "v": n}:
calls of compressed-tensors' KV fake-quant, counted at ``modeling.kvcache.forward_quantize``),
``ct_logits`` (compressed-tensors' forward), ``protocol_a`` (kvcal's Protocol A of the artifact on
the *unquantized* checkpoint, same transformers), ``unity`` (Protocol A with every scale 1.0) and
``check`` (kvcal.export.hf_loader.check_transformers_kv verdict on the export's config);
``missing``: the same load facts for the export with a scale removed.
"""

from __future__ import annotations

import json
import sys
from collections import Counter

import torch


def main(spec_path: str, out_path: str) -> None:
    import transformers
    from compressed_tensors.modeling import kvcache
    from transformers import AutoModelForCausalLM

    from kvcal.artifact import load_artifact
    from kvcal.capture.hooks import attention_hook
    from kvcal.evaluate.protocol_a import plan_hook
    from kvcal.export.hf_loader import check_transformers_kv
    from kvcal.plan import KVPlan

    spec = json.loads(open(spec_path, encoding="utf-8").read())
    calls: Counter = Counter()
    original = kvcache.forward_quantize

    def counting(module, value, base_name, args):  # the KV hook's quantizer (QuantizedKVCache.forward)
        calls[base_name] += 1
        return original(module, value, base_name, args)

    kvcache.forward_quantize = counting
    ids = torch.tensor(spec["ids"], dtype=torch.long)

    def load(path):
        model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, dtype=torch.float32)
        model.eval()
        scales = {f"{n}.{s}": getattr(m, s).detach().clone() for n, m in model.named_modules()
                  for s in ("k_scale", "v_scale") if isinstance(getattr(m, s, None), torch.Tensor)}
        return model, {"missing_keys": sorted(info["missing_keys"]), "unexpected_keys": sorted(info["unexpected_keys"]),
                       "scales": scales}

    out = {"transformers": transformers.__version__}
    base, _ = load(spec["base"])
    with torch.no_grad():
        out["base_logits"] = base(ids).logits.float()
    for case in spec["cases"]:
        model, facts = load(case["export"])
        calls.clear()
        with torch.no_grad():
            facts["ct_logits"] = model(ids).logits.float()
        facts["hook_calls"] = dict(calls)
        cfg = json.loads(open(f"{case['export']}/config.json", encoding="utf-8").read())
        facts["check"] = check_transformers_kv(cfg).applies
        art = load_artifact(case["artifact"])
        plan = KVPlan.from_artifact(art.tensors, art.metadata)
        with torch.no_grad(), attention_hook(base, plan_hook(plan)):
            facts["protocol_a"] = base(ids).logits.float()
        for lp in plan.layers:  # the all-1.0 plan: what an engine that drops the scales falls back to
            for sp in (lp.k, lp.v):
                sp.scale = torch.ones_like(sp.scale)
        with torch.no_grad(), attention_hook(base, plan_hook(plan)):
            facts["unity"] = base(ids).logits.float()
        out[case["name"]] = facts
    if spec.get("missing"):
        _, facts = load(spec["missing"]["export"])
        out["missing"] = facts
    torch.save(out, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
