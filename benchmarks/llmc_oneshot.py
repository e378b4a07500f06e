"""Run llm-compressor's `oneshot` with a kv_cache_scheme (FP8 per-tensor) and print its time.

Runs inside a separate venv that has llmcompressor (it is not a kvcal dependency); invoked by
benchmarks/bench_calibrate.py as: PY llmc_oneshot.py MODEL_DIR TOKENS.pt. Prints one JSON line.
"""

import json
import sys
import time

import torch
from datasets import Dataset
from llmcompressor import oneshot
from transformers import AutoModelForCausalLM, AutoTokenizer

RECIPE = """
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      kv_cache_scheme:
        num_bits: 8
        type: float
        strategy: tensor
        dynamic: false
        symmetric: true
"""


def main():
    model_dir, tokens = sys.argv[1], sys.argv[2]
    ids = torch.load(tokens)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    t = time.perf_counter()
    oneshot(model=model, dataset=ds, recipe=RECIPE, max_seq_length=ids.shape[1],
            num_calibration_samples=ids.shape[0], processor=tok, batch_size=8)
    dt = time.perf_counter() - t
    scales = {n: float(p.detach().float().reshape(-1)[0]) for n, p in model.named_parameters() if n.endswith(("k_scale", "v_scale"))}
    if not scales:
        scales = {n: float(b.float().reshape(-1)[0]) for n, b in model.named_buffers() if n.endswith(("k_scale", "v_scale"))}
    print(json.dumps({"seconds": dt, "num_scales": len(scales),
                      "k_scale_layer0": scales.get("model.layers.0.self_attn.k_scale")}))


if __name__ == "__main__":
    main()
