"""An fp8 artifact for a tiny saved Llama, with model-metadata overrides (for the CLI input checks)."""

from __future__ import annotations

from pathlib import Path

import torch


def fp8_artifact(root: Path, tiny_dir: Path, **overrides) -> Path:
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
