"""The typed read view of an artifact's ``vllm`` metadata section:
:class:`kvcal.engines.vllm.section.VllmSection` from :func:`kvcal.engines.vllm.section.vllm_section` (what the floors
get from :func:`kvcal.artifact.engine_section`), checked against hand-written metadata for an fp8 and an nvfp4 section
and an artifact without one, and the registry rules it answers with (dtype family, fp8 = fp8_e4m3)."""

from __future__ import annotations

import copy
import dataclasses

import pytest

import kvcal.artifact
from kvcal.engines.vllm.dtypes import VLLM_DTYPE_FAMILIES, VLLM_DTYPES, same_vllm_dtype, vllm_dtype
from kvcal.engines.vllm.section import VllmSection, vllm_section

FP8_META = {
    "schema_version": 1, "model": {"num_layers": 3, "num_kv_heads": 2, "head_dim": 64}, "kv": {},
    "vllm": {
        "engine": "vllm", "vllm_version": "0.33.0", "kv_cache_dtype": "fp8_e4m3", "skip_layers": [0, 2],
        "backend": "cpu", "fp8_write": "truncate", "query_quantization": "none (backend cpu reads the model-dtype query)",
        "q_scale": [[0.5], [0.25, 0.75], [1.0]],
        "heldout_kl_query_only": [0.1, 0.2, 0.3], "heldout_kl_kv_only": [0.01, 0.02, 0.03],
        "heldout_kl_joint": [0.11, 0.22, 0.33],
        "skip_layers_choice": {"method": "given", "max_skip": None, "bytes_per_token": 100},
    },
}
NVFP4_META = {
    "schema_version": 1, "model": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64}, "kv": {},
    "vllm": {
        "engine": "vllm", "vllm_version": "0.33.0", "kv_cache_dtype": "nvfp4", "skip_layers": [],
        "query_quantization": "fp8_e4m3 static q_scale per tensor on SM100 (FlashInfer trtllm-gen)",
        "q_scale": [[0.5], [0.6]], "k_outer_scale": [0.01, 0.02], "v_outer_scale": [0.03, 0.04],
    },
}


def test_fp8_section():
    """vllm_section reads every field of a hand-written fp8_e4m3 section as given: engine, dtype and version, backend
    cpu with the truncating write, the query quantization text, skip layers and how they were chosen, q_scale per layer
    as tuples, no outer scales, the three held-out KL lists, dtype family fp8; skip_layers_for returns the skip layers
    for fp8 and fp8_e4m3 (one vLLM dtype) and () for fp8_e5m2 and nvfp4; the metadata dict is left unchanged and the
    section is frozen."""
    meta = copy.deepcopy(FP8_META)
    sec = vllm_section(meta)
    assert isinstance(sec, VllmSection)
    assert (sec.engine, sec.kv_cache_dtype, sec.vllm_version) == ("vllm", "fp8_e4m3", "0.33.0")
    assert (sec.backend, sec.fp8_write) == ("cpu", "truncate")
    assert sec.query_quantization == "none (backend cpu reads the model-dtype query)"
    assert sec.skip_layers == (0, 2)
    assert sec.skip_layers_choice == {"method": "given", "max_skip": None, "bytes_per_token": 100}
    assert sec.q_scale == ((0.5,), (0.25, 0.75), (1.0,))
    assert sec.k_outer_scale == () and sec.v_outer_scale == () and sec.outer_scale("k") == ()
    assert sec.heldout_kl_query_only == (0.1, 0.2, 0.3)
    assert sec.heldout_kl_kv_only == (0.01, 0.02, 0.03)
    assert sec.heldout_kl_joint == (0.11, 0.22, 0.33)
    assert sec.dtype is vllm_dtype("fp8_e4m3") and sec.dtype.family == "fp8"
    assert sec.fp8_dtype == "fp8_e4m3" and sec.nvfp4_dtype is None
    # fp8 and fp8_e4m3 are one vLLM dtype: the skip layers serve either spelling, no other dtype
    assert sec.skip_layers_for("fp8") == (0, 2) == sec.skip_layers_for("fp8_e4m3")
    assert sec.skip_layers_for("fp8_e5m2") == () and sec.skip_layers_for("nvfp4") == ()
    assert meta == FP8_META  # a read view: the dict is not touched
    with pytest.raises(dataclasses.FrozenInstanceError):
        sec.kv_cache_dtype = "nvfp4"


def test_nvfp4_section_and_defaults():
    """An nvfp4 section reads its outer scales per side and its q_scale, family nvfp4 (nvfp4_dtype set, fp8_dtype None);
    absent optional fields take kvcal's defaults (backend cuda, fp8_write "round to nearest even", no skip-layer choice,
    no held-out KL); nvfp4_4over6 is its own dtype (its skip layers do not serve nvfp4, the same family), and a dtype
    name the registry does not emulate reads with dtype, fp8_dtype and nvfp4_dtype all None."""
    sec = vllm_section(copy.deepcopy(NVFP4_META))
    assert sec.kv_cache_dtype == "nvfp4" and sec.dtype.family == "nvfp4"
    assert sec.nvfp4_dtype == "nvfp4" and sec.fp8_dtype is None
    assert sec.k_outer_scale == (0.01, 0.02) and sec.outer_scale("v") == (0.03, 0.04)
    assert sec.q_scale == ((0.5,), (0.6,))
    assert sec.skip_layers == () and sec.skip_layers_for("nvfp4") == ()
    # absent optional fields read with the defaults kvcal has always used
    assert sec.backend == "cuda" and sec.fp8_write == "round to nearest even"
    assert sec.skip_layers_choice is None and sec.heldout_kl_joint == ()
    m = copy.deepcopy(NVFP4_META)
    m["vllm"]["kv_cache_dtype"] = "nvfp4_4over6"
    m["vllm"]["skip_layers"] = [1]
    sec = vllm_section(m)
    assert sec.nvfp4_dtype == "nvfp4_4over6" and sec.skip_layers_for("nvfp4_4over6") == (1,)
    assert sec.skip_layers_for("nvfp4") == ()  # same family, not the same dtype
    m["vllm"]["kv_cache_dtype"] = "octave_4bit"  # a name the registry does not emulate
    sec = vllm_section(m)
    assert sec.dtype is None and sec.fp8_dtype is None and sec.nvfp4_dtype is None


def test_sectionless_artifact():
    """Metadata without a ``vllm`` section, or with ``"vllm": null``, reads as no section (None)."""
    meta = {k: v for k, v in FP8_META.items() if k != "vllm"}
    assert vllm_section(meta) is None
    assert vllm_section({**meta, "vllm": None}) is None


def test_registry_rules_match_the_old_string_tests():
    """For every dtype name the registry knows, family ``nvfp4`` is ``startswith("nvfp4")``, family ``fp8`` is
    ``in ("fp8", "fp8_e4m3")`` and same_vllm_dtype equates exactly fp8 and fp8_e4m3 besides equal names."""
    assert set(VLLM_DTYPE_FAMILIES) == set(VLLM_DTYPES)
    for name, spec in VLLM_DTYPES.items():
        assert (spec.family == "nvfp4") == name.startswith("nvfp4")
        assert (spec.family == "fp8") == (name in ("fp8", "fp8_e4m3"))
        assert (spec.family == "turboquant") == name.startswith("turboquant_")
        for other in VLLM_DTYPES:
            fp8 = ("fp8", "fp8_e4m3")
            assert same_vllm_dtype(name, other) == (name == other or (name in fp8 and other in fp8))


def test_reached_through_kvcal_artifact():
    """kvcal.artifact.engine_section (public: in its ``__all__``) finds the view by the section's name through the
    registry: the engine's own VllmSection (one type, defined in the vLLM package, the facade's ``read_section``),
    ``None`` without a section; engine_sections names the engine."""
    from kvcal.artifact.sections import engine_sections
    from kvcal.engines import engine

    assert "engine_section" in kvcal.artifact.__all__
    sec = kvcal.artifact.engine_section(copy.deepcopy(FP8_META))
    assert type(sec) is VllmSection and sec == vllm_section(copy.deepcopy(FP8_META))
    assert VllmSection.__module__ == "kvcal.engines.vllm.section" and engine("vllm").read_section is vllm_section
    assert [n for n, _ in engine_sections(copy.deepcopy(NVFP4_META))] == ["vllm"]
    assert kvcal.artifact.engine_section({**FP8_META, "vllm": None}) is None
