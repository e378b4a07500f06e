"""What the weight checks of issue 22 cost on the embedded model (SmolLM2-135M GGUF, 272 tensors).

Times: the GGUF tensor check before loading (kvcal.models.gguf_header) against gguf.GGUFReader on the
same file; weights_fingerprint of the loaded model (what calibrate adds); the bfloat16 HF copy of the
GGUF model written with save_pretrained; the fingerprint read back from that copy's files (what
export --model-dir adds), and whether it equals the recorded one (it must: same weights).

  .venv/bin/python benchmarks/bench_weights_fingerprint.py
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    from transformers import LlamaForCausalLM

    from kvcal.export.checkpoint import checkpoint_weights_fingerprint, open_checkpoint
    from kvcal.models import EMBEDDED_GGUF, embedded_model_dir, gguf_header, load_model
    from kvcal.weights import compare_fingerprints, weights_fingerprint

    path = embedded_model_dir() / EMBEDDED_GGUF
    t = time.perf_counter()
    _, names = gguf_header(path)
    t_hdr = time.perf_counter() - t
    import gguf

    t = time.perf_counter()
    gguf.GGUFReader(str(path))
    t_reader = time.perf_counter() - t
    print(f"GGUF header ({len(names)} tensors): kvcal.models.gguf_header {t_hdr * 1e3:.1f} ms, "
          f"gguf.GGUFReader {t_reader * 1e3:.0f} ms")
    model = load_model(None)
    t = time.perf_counter()
    fp = weights_fingerprint(model)
    print(f"weights_fingerprint(loaded GGUF model, {len(fp['layers'])} layers): {(time.perf_counter() - t) * 1e3:.1f} ms")
    with tempfile.TemporaryDirectory() as d:
        cfg = {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"}
        copy = LlamaForCausalLM(type(model.config).from_dict(cfg))
        copy.load_state_dict(model.state_dict())
        copy.to(torch.bfloat16).save_pretrained(Path(d))
        t = time.perf_counter()
        found = checkpoint_weights_fingerprint(open_checkpoint(d), fp)
        t_files = time.perf_counter() - t
        size = sum(p.stat().st_size for p in Path(d).glob("*.safetensors"))
        print(f"fingerprint from the bf16 HF copy's files ({size / 2**20:.0f} MiB): {t_files * 1e3:.1f} ms; "
              f"equal to the recorded one: {found == fp} (difference: {compare_fingerprints(fp, found)})")


if __name__ == "__main__":
    main()
