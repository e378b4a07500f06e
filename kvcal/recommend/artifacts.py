"""The calibrated artifacts recommend makes: the engine's scales read back from one (:func:`_artifact_scales`) and
the chosen 16-bit layers recorded in the kept one (:func:`record_skip_layers`)."""

from __future__ import annotations

from pathlib import Path

from kvcal.recommend.config import RecommendConfig


def _artifact_scales(kv_cache_dtype: str, artifact_dir: Path, num_layers: int) -> dict:
    """The calibrated scales of the artifact in ``artifact_dir`` for the probe and the plans, as the engine it was
    calibrated for reads them (the engine whose metadata section it holds: its ``calibrated_scales``,
    :func:`kvcal.engines.vllm.probe.vllm_scales`)."""
    from kvcal.artifact import load_artifact
    from kvcal.artifact.sections import engine_sections
    from kvcal.engines import engine

    art = load_artifact(artifact_dir)
    name = engine_sections(art.metadata)[0][0]
    return engine(name).calibrated_scales(kv_cache_dtype, art.tensors, art.metadata, num_layers)


def record_skip_layers(artifact_dir: Path, chosen: dict, cfg: RecommendConfig, sensitivity: list[float],
                       probe: dict, bytes_per_token_16bit: int) -> None:
    """Record the chosen configuration's 16-bit layers in its calibrated artifact (rewritten in place,
    tensors unchanged): ``vllm.skip_layers`` = ``chosen["skip_layers"]`` and ``vllm.skip_layers_choice`` =
    ``{"method": "recommend", "choice", "max_skip", "max_bytes_per_token", "bytes_per_token",
    "bytes_per_token_16bit", "sensitivity" (KL per layer, nats), "probe"}``, the fields ``kvcal calibrate
    --skip-layers`` writes (:func:`kvcal.engines.vllm.skip.choose_skip_layers_for_artifact`), so that ``kvcal export``
    prints and records the same ``--kv-cache-dtype-skip-layers`` as deploy.md, and ``inspect``/``report``
    state them. ``report.md`` is re-rendered. Nothing is rewritten when no layer is kept at 16 bits."""
    from kvcal.artifact import load_artifact, write_artifact
    from kvcal.report.markdown import render_report

    if not chosen["skip_layers"]:
        return
    art = load_artifact(artifact_dir)
    meta = dict(art.metadata)
    vm = meta["vllm"] = dict(meta["vllm"])
    vm["skip_layers"] = [int(i) for i in chosen["skip_layers"]]
    vm["skip_layers_choice"] = {"method": "recommend", "choice": chosen["choice"], "max_skip": cfg.max_skip,
                                "max_bytes_per_token": cfg.max_bytes_per_token,
                                "bytes_per_token": int(chosen["bytes_per_token"]),
                                "bytes_per_token_16bit": int(bytes_per_token_16bit),
                                "sensitivity": [float(x) for x in sensitivity], "probe": dict(probe)}
    write_artifact(artifact_dir, art.tensors, meta, extra_files={"report.md": render_report(meta)}, overwrite=True)
