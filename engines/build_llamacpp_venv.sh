#!/usr/bin/env bash
# Builds llama-cpp-python (the llama.cpp that kvcal/engines/llamacpp/ emulates) in a venv of its own, beside kvcal's
# .venv, never inside it: `kvcal verify --engine llamacpp --engine-python VENV/bin/python` runs
# kvcal/engines/llamacpp/runner.py there (numpy + llama_cpp only).
# The registry publishes llama-cpp-python as an sdist: pip compiles llama.cpp (CPU backend) from it: 462 CPU-seconds
# without the multimodal library (2026-12-06, AVX-512 EPYC), 4-8 min wall on 2 cores.
# KVCAL_LLAMACPP_WHEEL=path/to/llama_cpp_python-0.3.36-*.whl installs a wheel built before instead.
# Usage: engines/build_llamacpp_venv.sh VENV_DIR [PYTHON]
set -euo pipefail
VENV="$1"
PYTHON="${2:-python3}"
LLAMACPP_VERSION="${LLAMACPP_VERSION:-0.3.36}"
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
if [ -n "${KVCAL_LLAMACPP_WHEEL:-}" ]; then
  "$PY" -m pip install -q "$KVCAL_LLAMACPP_WHEEL" numpy
else
  # only the library: no tests, examples, tools or server, no multimodal library (LLAVA_BUILD: mtmd, 51 of the
  # sources; llama_cpp imports it only for image chat handlers); tuned to this CPU (GGML_NATIVE), no libcurl
  CMAKE_ARGS="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_NATIVE=ON -DLLAMA_CURL=OFF" \
  CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$PY" -m pip install -q --no-binary llama-cpp-python "llama-cpp-python==$LLAMACPP_VERSION" numpy
fi
"$PY" -c "import llama_cpp, numpy; print('llama_cpp', llama_cpp.__version__, 'numpy', numpy.__version__)"
touch "$VENV/.installed"
