"""Quantize + dequantize throughput per KV format on this machine (torch reference path).

Throughput is input bytes / (time of quantize + dequantize), in GB/s (1e9 bytes/s), for a
bf16 K/V tensor ``[B, H_kv, S, D]``. The baseline, measured in the same run on the same tensor, is a
plain ``x.to(torch.float8_e4m3fn)`` copy; ``ratio`` = format throughput / baseline throughput.

    .venv/bin/python benchmarks/bench_formats.py [--tokens 4096] [--batch 4] [--reps 5] [--threads N]
"""

from __future__ import annotations

import argparse
import time

import torch

from kvcal.formats.granularity import PerChannelTokenGroup, PerTensor, PerToken, PerTokenGroup
from kvcal.formats.quant import dequantize, fake_quant, quantize
from kvcal.formats.spec import TensorQuantSpec


def _time(fn, reps: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(a.batch, a.heads, a.tokens, a.head_dim, generator=g) * 2).to(torch.bfloat16)
    nbytes = x.numel() * x.element_size()
    one = torch.ones(1, 1, 1, 1)

    base_t = _time(lambda: x.to(torch.float8_e4m3fn), a.reps)
    base = nbytes / base_t / 1e9
    cases = [
        ("fp8_e4m3 per-tensor (static scale)", TensorQuantSpec("fp8_e4m3", PerTensor()), {"scale": one}),
        ("fp8_e5m2 per-tensor (static scale)", TensorQuantSpec("fp8_e5m2", PerTensor()), {"scale": one}),
        ("fp8_e4m3 per-token (dynamic)", TensorQuantSpec("fp8_e4m3", PerToken()), {}),
        ("int8 token g64 asym", TensorQuantSpec("int8", PerTokenGroup(64), symmetric=False), {}),
        ("int8 per-token sym", TensorQuantSpec("int8", PerToken()), {}),
        ("int4 token g32 asym", TensorQuantSpec("int4", PerTokenGroup(32), symmetric=False), {}),
        ("int4 channel-token g32 asym (KIVI K)", TensorQuantSpec("int4", PerChannelTokenGroup(32), symmetric=False), {}),
        ("int3 token g32 asym", TensorQuantSpec("int3", PerTokenGroup(32), symmetric=False), {}),
        ("int2 token g32 asym", TensorQuantSpec("int2", PerTokenGroup(32), symmetric=False), {}),
        ("nvfp4 (blocks of 16)", TensorQuantSpec("nvfp4"), {"global_scale": torch.tensor(1.0)}),
    ]
    print(f"input: bf16 {list(x.shape)} = {nbytes / 1e6:.1f} MB, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, best of {a.reps}")
    print(f"baseline x.to(torch.float8_e4m3fn): {base:.3f} GB/s")
    print(f"{'format':40s} {'q+dq GB/s':>10s} {'ratio':>7s} {'fake_quant GB/s':>16s} {'ratio':>7s}")
    for name, spec, kw in cases:
        t_qdq = _time(lambda spec=spec, kw=kw: dequantize(quantize(x, spec, **kw)), a.reps)
        t_fq = _time(lambda spec=spec, kw=kw: fake_quant(x, spec, **kw), a.reps)
        r1, r2 = nbytes / t_qdq / 1e9, nbytes / t_fq / 1e9
        print(f"{name:40s} {r1:10.3f} {r1 / base:7.3f} {r2:16.3f} {r2 / base:7.3f}")


if __name__ == "__main__":
    main()
