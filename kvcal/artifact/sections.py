"""Typed read views of artifact metadata sections: :func:`engine_section` (the section ``kvcal calibrate --engine
NAME`` writes under the engine's name, read through that engine's own view) and :func:`set_figures` (the held-out
figures the search recorded for one scale set).

The metadata stays a JSON dict on disk and in :attr:`~kvcal.artifact.io.Artifact.metadata`: writers build dicts (an
engine's calibration, e.g. :func:`kvcal.engines.vllm.search_fp8.vllm_metadata`; the ``skip_layers`` updates of
:mod:`kvcal.engines.vllm.skip` and :func:`kvcal.recommend.artifacts.record_skip_layers`); readers take the view, so
a field's default and the dtype rules live in one place, the engine's package (``read_section`` of its facade:
:class:`kvcal.engines.vllm.section.VllmSection`). The view does not validate:
:func:`~kvcal.artifact.schema.validate_metadata_schema` (run by ``load_artifact``) has the engine check the section
first and name a malformed field."""

from __future__ import annotations

from kvcal.engines import engine, with_attr


def engine_sections(meta: dict) -> list:
    """``[(engine name, its view of the section)]`` for every engine that reads a metadata section and whose section
    ``meta`` holds (a non-empty object under the engine's name), in :func:`kvcal.engines.names` order."""
    if not isinstance(meta, dict):
        return []
    out = []
    for name in with_attr("read_section"):
        view = engine(name).read_section(meta)
        if view is not None:
            out.append((name, view))
    return out


def engine_section(meta: dict):
    """The view of the engine section of artifact metadata ``meta`` (the first of :func:`engine_sections`: kvcal
    calibrates for one engine at a time), ``None`` when it has none (absent, null, empty or not an object). Reads
    what is there without checking it; artifacts loaded with :func:`~kvcal.artifact.io.load_artifact` have had the
    section validated."""
    secs = engine_sections(meta)
    return secs[0][1] if secs else None


def set_figures(meta: dict, which: str) -> dict | None:
    """Mean over layers of the held-out errors the search recorded for one scale set (``"searched"``: the
    artifact's scales, ``layers[i].{k,v}.heldout.chosen``; ``"clip_free"``: ``layers[i].{k,v}.clip_free.heldout``):
    ``{"k": mean attention KL per query (nats), "v": mean relative attention-output error, "layers": n}``, or
    ``None`` when some layer does not record it (an artifact of an older kvcal, or an integer artifact)."""
    out = {"k": 0.0, "v": 0.0}
    layers = [e for e in meta.get("layers") or [] if isinstance(e, dict)]
    if not layers:
        return None
    for e in layers:
        for sd in ("k", "v"):
            rec = e.get(sd) or {}
            x = ((rec.get("heldout") or {}).get("chosen") if which == "searched" and isinstance(rec.get("heldout"), dict)
                 else (rec.get("clip_free") or {}).get("heldout") if which == "clip_free" else None)
            if not isinstance(x, (int, float)):
                return None
            out[sd] += float(x) / len(layers)
    return {**out, "layers": len(layers)}


__all__ = ["engine_section", "engine_sections", "set_figures"]
