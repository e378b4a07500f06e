"""The artifact's ``vllm`` metadata section (what ``kvcal calibrate --engine vllm`` records): its typed read view
:class:`VllmSection` / :func:`vllm_section` and its schema :func:`check_section`.

The section is written as a JSON dict (:func:`kvcal.engines.vllm.search_fp8.vllm_metadata`,
:func:`kvcal.engines.vllm.search_nvfp4.vllm_metadata`, the ``skip_layers`` updates of :mod:`kvcal.engines.vllm.skip`
and :func:`kvcal.recommend.artifacts.record_skip_layers`); the floors read it through
:func:`kvcal.artifact.sections.engine_section`, which finds this view by the section's name. Moved from
:mod:`kvcal.artifact.sections` and :mod:`kvcal.artifact.schema` (issue 41).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvcal.artifact.schema import NUM_LIST, STR, check_fields, is_int, is_num
from kvcal.engines.vllm.dtypes.registry import VLLM_DTYPES, VllmKVDType, same_vllm_dtype
from kvcal.errors import ArtifactError


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
        """vLLM's registry entry for :attr:`kv_cache_dtype` (:func:`kvcal.engines.vllm.dtypes.vllm_dtype`;
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
        aliases equal: ``fp8`` = ``fp8_e4m3``, :func:`~kvcal.engines.vllm.dtypes.same_vllm_dtype`), else ``()``."""
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


#: The fields of the section (calibrate --engine vllm, :func:`kvcal.engines.vllm.search_fp8.vllm_metadata`) that inspect
#: and report print: ``{key: ((predicate, what it must be), required)}``.
SCHEMA = {
    "engine": ((lambda v: v == "vllm", '"vllm"'), True), "kv_cache_dtype": (STR, True),
    "skip_layers": ((lambda v: isinstance(v, list) and all(is_int(x) and x >= 0 for x in v),
                     "a list of layer indices"), False),
    "query_quantization": (STR, False),
    "q_scale": ((lambda v: isinstance(v, list) and all(isinstance(r, list) and all(is_num(x) for x in r) for r in v),
                 "a list (one per layer) of lists of finite numbers"), False),
    "k_outer_scale": (NUM_LIST, False), "v_outer_scale": (NUM_LIST, False),  # nvfp4 (kvcal.engines.vllm.search_nvfp4)
}


def check_section(f: Path, meta: dict) -> None:
    """The ``vllm`` section of artifact metadata ``meta`` (file ``f``): its fields as stored (:data:`SCHEMA`), then,
    read through :func:`vllm_section`, ``skip_layers`` inside the model (``model.num_layers``) and leaving at least
    one layer in the dtype. Run by :func:`kvcal.artifact.schema.validate_metadata_schema`. Raises
    :class:`~kvcal.errors.ArtifactError` naming the field."""
    n = meta["model"]["num_layers"]
    check_fields(f, "vllm", meta["vllm"], SCHEMA)
    sec = vllm_section(meta)
    bad = [x for x in sec.skip_layers if x >= n]
    if bad:  # export would print a --kv-cache-dtype-skip-layers naming no layer of the model
        raise ArtifactError(f"{f}: metadata field vllm.skip_layers names layer(s) {bad} but the model has {n} "
                            "layers (model.num_layers); fix the field or re-run calibration")
    if n and len(set(sec.skip_layers)) >= n:  # every layer at 16 bits: nothing in the dtype
        raise ArtifactError(f"{f}: metadata field vllm.skip_layers keeps all {n} layers at 16 bits, so nothing would "
                            f"be stored in --kv-cache-dtype {sec.kv_cache_dtype} (the 16-bit cache "
                            "under its name); leave at least one layer out or re-run calibration")


__all__ = ["VllmSection", "vllm_section", "SCHEMA", "check_section"]
