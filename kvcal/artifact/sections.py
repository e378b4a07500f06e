"""Typed read views of artifact metadata sections: :class:`VllmSection` (the ``vllm`` section that
``kvcal calibrate --engine vllm`` writes) and its constructor :func:`vllm_section`.

The metadata stays a JSON dict on disk and in :attr:`~kvcal.artifact.io.Artifact.metadata` (writers build
dicts: :func:`kvcal.search.vllm_fp8.vllm_metadata`, :func:`kvcal.search.vllm_nvfp4.vllm_metadata`, the
``skip_layers`` updates of :mod:`kvcal.vllm_skip` and :func:`kvcal.recommend.artifacts.record_skip_layers`);
readers take the view, so a field's default and the dtype rules live in one place. The view does not
validate: :func:`~kvcal.artifact.schema.validate_metadata_schema` (run by ``load_artifact``) checks the
section first and names a malformed field."""

from __future__ import annotations

from dataclasses import dataclass

from kvcal.formats.vllm_dtypes.registry import VLLM_DTYPES, VllmKVDType, same_vllm_dtype


def _floats(v) -> tuple:
    return tuple(v) if isinstance(v, (list, tuple)) else ()


@dataclass(frozen=True)
class VllmSection:
    """The artifact's ``vllm`` section, read-only. Absent optional fields take the defaults kvcal has
    always read them with.

    ``engine``: ``"vllm"``. ``kv_cache_dtype``: the ``--kv-cache-dtype`` calibrated for, as spelled
    (``fp8`` or ``fp8_e4m3``, ``nvfp4``, ...). ``vllm_version`` (``""`` when absent). ``backend``: the
    backend whose write path was calibrated (``"cuda"`` when absent: written before it was recorded).
    ``fp8_write``: ``"round to nearest even"`` or ``"truncate"``. ``query_quantization``: how vLLM
    quantizes the queries (``None`` when absent). ``skip_layers``: the layers vLLM keeps in the model
    dtype (``--kv-cache-dtype-skip-layers``; ``()`` for none). ``skip_layers_choice``: how they were
    chosen (the stored object, ``None`` when absent or not an object). ``q_scale``: per layer, the FP8
    query scales (one, or one per KV-head group). ``k_outer_scale``/``v_outer_scale``: per layer, the NVFP4
    outer scales (``()`` for fp8). ``heldout_kl_query_only``/``heldout_kl_kv_only``/``heldout_kl_joint``:
    per layer, the search's held-out attention KL (nats)."""

    engine: str
    kv_cache_dtype: str
    vllm_version: str = ""
    backend: str = "cuda"
    fp8_write: str = "round to nearest even"
    query_quantization: str | None = None
    skip_layers: tuple[int, ...] = ()
    skip_layers_choice: dict | None = None
    q_scale: tuple[tuple[float, ...], ...] = ()
    k_outer_scale: tuple[float, ...] = ()
    v_outer_scale: tuple[float, ...] = ()
    heldout_kl_query_only: tuple[float, ...] = ()
    heldout_kl_kv_only: tuple[float, ...] = ()
    heldout_kl_joint: tuple[float, ...] = ()

    @property
    def dtype(self) -> VllmKVDType | None:
        """vLLM's registry entry for :attr:`kv_cache_dtype` (:func:`kvcal.formats.vllm_dtypes.vllm_dtype`;
        ask its ``family``, ``static_scales``, ...), ``None`` for a name kvcal does not emulate."""
        return VLLM_DTYPES.get(self.kv_cache_dtype) if isinstance(self.kv_cache_dtype, str) else None

    @property
    def fp8_dtype(self) -> str | None:
        """:attr:`kv_cache_dtype` when the artifact holds static FP8 scales for vLLM (dtype family ``fp8``:
        ``kvcal calibrate --engine vllm --kv-cache-dtype fp8|fp8_e4m3``, under the spelling calibrated
        with; vLLM takes both), else ``None``."""
        d = self.dtype
        return self.kv_cache_dtype if d is not None and d.family == "fp8" else None

    @property
    def nvfp4_dtype(self) -> str | None:
        """:attr:`kv_cache_dtype` when the artifact holds vLLM NVFP4 outer scales (dtype family ``nvfp4``:
        ``kvcal calibrate --engine vllm --kv-cache-dtype nvfp4``, tensors
        ``model.layers.{i}.self_attn.{k,v}_outer_scale``), else ``None``."""
        d = self.dtype
        return self.kv_cache_dtype if d is not None and d.family == "nvfp4" else None

    def outer_scale(self, side: str) -> tuple[float, ...]:
        """``k_outer_scale`` (``side`` ``"k"``) or ``v_outer_scale`` (``"v"``)."""
        return {"k": self.k_outer_scale, "v": self.v_outer_scale}[side]

    def skip_layers_for(self, kv_cache_dtype: str) -> tuple[int, ...]:
        """:attr:`skip_layers` when ``kv_cache_dtype`` is the dtype the artifact was calibrated for (vLLM's
        aliases equal: ``fp8`` = ``fp8_e4m3``, :func:`~kvcal.formats.vllm_dtypes.same_vllm_dtype`), else ``()``."""
        return self.skip_layers if same_vllm_dtype(self.kv_cache_dtype, kv_cache_dtype) else ()


def vllm_section(meta: dict) -> VllmSection | None:
    """The :class:`VllmSection` of artifact metadata ``meta``, ``None`` when it has no ``vllm`` section
    (absent, null, empty or not an object). Reads what is there without checking it; artifacts loaded with
    :func:`~kvcal.artifact.io.load_artifact` have had the section validated."""
    vm = meta.get("vllm") if isinstance(meta, dict) else None
    if not isinstance(vm, dict) or not vm:
        return None
    qs = vm.get("q_scale")
    choice = vm.get("skip_layers_choice")
    return VllmSection(
        engine=vm.get("engine"), kv_cache_dtype=vm.get("kv_cache_dtype"),
        vllm_version=vm.get("vllm_version", ""), backend=vm.get("backend", "cuda"),
        fp8_write=vm.get("fp8_write", "round to nearest even"), query_quantization=vm.get("query_quantization"),
        skip_layers=tuple(int(i) for i in vm.get("skip_layers") or ()),
        skip_layers_choice=choice if isinstance(choice, dict) else None,
        q_scale=tuple(tuple(r) if isinstance(r, (list, tuple)) else (r,) for r in qs) if isinstance(qs, list) else (),
        k_outer_scale=_floats(vm.get("k_outer_scale")), v_outer_scale=_floats(vm.get("v_outer_scale")),
        heldout_kl_query_only=_floats(vm.get("heldout_kl_query_only")),
        heldout_kl_kv_only=_floats(vm.get("heldout_kl_kv_only")),
        heldout_kl_joint=_floats(vm.get("heldout_kl_joint")),
    )


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


__all__ = ["VllmSection", "vllm_section", "set_figures"]
