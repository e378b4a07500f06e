"""kvcal's `kvcal memory --format llamacpp:<type>` lines against the lines llama.cpp logs when it allocates the cache.

    .venv/bin/python diagnostics/llamacpp_kv_log.py --engine-python .venv-llamacpp/bin/python \
        [--models smollm2-135m,gemma3-270m] [--contexts 4096,32768] [--type q8_0]

For each model and context, loads the GGUF in llama-cpp-python (the engine's own venv) with llama-server's defaults
(`-fa on -ub 512`, no `--swa-full`) and the cache type, captures every `llama_kv_cache: size = ...` line llama.cpp
logs (nothing is evaluated), and compares them with `kvcal memory`'s (`kvcal.api.memory`). Prints each pair of
lines and `equal` / `DIFFERS`; exit 1 on a difference.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

LOAD = r'''
import sys, llama_cpp
path, n_ctx, t = sys.argv[1], int(sys.argv[2]), getattr(llama_cpp, "GGML_TYPE_" + sys.argv[3].upper())
llama_cpp.Llama(path, n_ctx=n_ctx, n_batch=512, n_ubatch=512, flash_attn=True, type_k=t, type_v=t, swa_full=False,
                verbose=True, n_threads=1)
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine-python", required=True)
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--type", default="q8_0")
    a = ap.parse_args()
    from kvcal.api import memory
    from kvcal.models import resolve_model

    bad = 0
    for name in a.models.split(","):
        src = resolve_model(name)
        gguf = Path(src.path) / src.gguf_file
        for ctx in (int(c) for c in a.contexts.split(",")):
            want = memory(name, f"llamacpp:{a.type}", context=ctx).engine["log_line"].splitlines()
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            r = subprocess.run([a.engine_python, "-c", LOAD, str(gguf), str(ctx), a.type], capture_output=True,
                               text=True, env=env)
            got = [ln.strip() for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("llama_kv_cache: size")]
            same = got == want
            bad += not same
            print(f"{name} -c {ctx} -ctk/-ctv {a.type}: {'equal' if same else 'DIFFERS'}")
            n = max(len(got), len(want))
            for g, w in zip(got + [""] * (n - len(got)), want + [""] * (n - len(want)), strict=True):
                print(f"  llama.cpp: {g}\n  kvcal:     {w}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
