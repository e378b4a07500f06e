"""Running the CLI in-process, the model-loader stub's error, and an fp8 artifact for a tiny saved Llama with
model-metadata overrides (for the CLI input checks)."""

from __future__ import annotations

from pathlib import Path

from kvcal.errors import ModelLoadError


class LoaderCalled(ModelLoadError):
    """Raised by the :func:`no_model` stub: a user-facing error, so the CLI exits 2 with ``error: ...``."""


def run_cli(args: list[str], code: int = 0) -> str:
    """``kvcal ARGS`` in-process (click's CliRunner): it must exit with ``code`` and print no traceback, and a
    successful run must raise nothing. Returns its output."""
    from click.testing import CliRunner

    from kvcal.cli import main

    r = CliRunner().invoke(main, args)
    assert r.exit_code == code, r.output
    assert code != 0 or r.exception is None, r.exception
    assert "Traceback" not in r.output
    return r.output


def fp8_artifact(root: Path, tiny_dir: Path, **overrides) -> Path:
    import torch
    from transformers import AutoConfig

    from kvcal.artifact import write_artifact
    from kvcal.formats.spec import preset
    from kvcal.models import model_metadata
    from kvcal.plan import KVPlan

    plan = KVPlan.uniform(2, preset("fp8"))
    for lp in plan.layers:
        lp.k.scale = torch.full((1, 1, 1, 1), 0.01)
        lp.v.scale = torch.full((1, 1, 1, 1), 0.01)
    mm = model_metadata(AutoConfig.from_pretrained(tiny_dir))
    mm.update(overrides)
    return write_artifact(root / ("art" + "".join(f"-{k}" for k in overrides)), plan.to_tensors(),
                          {"model": mm, "kv": plan.kv_metadata(), "layers": []})
