"""Shared fixtures (and nothing else: helper functions live in ``tests/helpers/``). The embedded model is loaded
once per session (about 16 s)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.register_assert_rewrite("helpers")  # before any test module imports a helper

from helpers.cli import LoaderCalled  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} not present")
    return SHARED_DATA


@pytest.fixture()
def no_model(monkeypatch):
    """``kvcal.models.load_model`` records its calls and raises (exit 2): nothing expensive runs, and a test
    can assert that a command refused its input before the model loads (the list of calls stays empty)."""
    import kvcal.models

    calls = []

    def stub(model, *a, **kw):
        calls.append(model)
        raise LoaderCalled("model loader reached (stub)")

    monkeypatch.setattr(kvcal.models, "load_model", stub)
    return calls


@pytest.fixture(scope="session")
def smollm_tokenizer():
    from kvcal.models import load_tokenizer

    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="session")
def smollm_model():
    import torch

    from kvcal.models import load_model

    torch.manual_seed(0)
    return load_model("smollm2-135m")


@pytest.fixture
def one_thread():
    """Tiny models run ~30x faster single-threaded on a loaded 2-core CPU; the thread count is restored."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
