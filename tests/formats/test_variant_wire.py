"""Typed side variants keep the wire format and the byte counts of the flat flags they replaced.

Claims checked: ``KVCacheConfig.to_dict()`` of every named layout and of configs with each variant equals a
hand-written dict in the flat-flag format (same keys, order and values), and ``from_dict`` inverts it;
``memory_report`` counts for each variant the per-layer metadata bytes of the documented formulas; a
transform written into artifact metadata is its plain string and reads back as the same
:class:`~kvcal.formats.transforms.Transform`.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from kvcal.formats.granularity import PerChannelTokenGroup, PerToken
from kvcal.formats.memory import cache_bytes, memory_report
from kvcal.formats.spec import PRESETS, KVCacheConfig, TensorQuantSpec
from kvcal.formats.transforms import RopeTable, Transform
from kvcal.formats.variants import ChannelWidths, Codebook, Rounding, SideVariant
from kvcal.plan import KVPlan, LayerPlan, SidePlan
from kvcal.search.presets import INT_PRESETS, preset_cache_config, spec_label

K4 = TensorQuantSpec("int4", PerChannelTokenGroup(32), symmetric=False)
V4 = TensorQuantSpec("int4", PerToken(), symmetric=True)
FLAGS = ("key_centering", "key_rounding", "value_rounding", "key_channel_bits", "value_channel_bits", "key_levels",
         "value_levels", "value_trellis")
OFF = dict.fromkeys(FLAGS, False) | {"value_trellis": 0}


def _wire(cfg: KVCacheConfig, **flags) -> dict:
    """The flat-flag dict (old wire format) of ``cfg``'s specs and windows with ``flags`` set, keys in the
    old order."""
    return {"k": cfg.key.to_dict(), "v": cfg.value.to_dict(), "residual_window": cfg.residual_window,
            "sink_tokens": cfg.sink_tokens, "dtype16": {torch.bfloat16: "bfloat16", torch.float16: "float16"}[cfg.dtype16],
            **OFF, **flags}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_storage_presets_write_all_flags_off(name):
    """Every storage layout of PRESETS writes the eight flags off, in the old key order, and reads back equal."""
    cfg = PRESETS[name]
    d = cfg.to_dict()
    assert list(d.items()) == list(_wire(cfg).items())
    assert KVCacheConfig.from_dict(d) == cfg


@pytest.mark.parametrize("name,flags", [
    ("int8", {}),
    ("int4", {"key_rounding": True, "key_channel_bits": True, "value_trellis": 2 ** (6 + 4)}),
    ("int2", {"key_rounding": True, "key_channel_bits": True}),
    ("k4v2", {"key_rounding": True, "key_channel_bits": True}),
])
def test_calibrate_presets_write_their_flags(name, flags):
    """The calibrate presets' layouts (preset_cache_config) write the flags they wrote as loose booleans: query-aware
    rounding and allocated widths on pre-RoPE keys, int4's 1024-entry trellis table (no levels flag), nothing on int8."""
    cfg = preset_cache_config(name)
    assert list(cfg.to_dict().items()) == list(_wire(cfg, **flags).items())
    assert KVCacheConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.key_variant == INT_PRESETS[name].k.variant and cfg.value_variant == INT_PRESETS[name].v.variant


VARIANTS = [  # (key variant, value variant, flags they write)
    (SideVariant(centering=True), SideVariant(), {"key_centering": True}),
    (SideVariant(rounding=Rounding.QUERY_AWARE), SideVariant(), {"key_rounding": True}),
    (SideVariant(), SideVariant(rounding=Rounding.QUERY_AWARE), {"value_rounding": True}),
    (SideVariant(channel_widths=ChannelWidths.ALLOCATED), SideVariant(), {"key_channel_bits": True}),
    (SideVariant(), SideVariant(channel_widths=ChannelWidths.ALLOCATED), {"value_channel_bits": True}),
    (SideVariant(Codebook.LEVELS), SideVariant(), {"key_levels": True}),
    (SideVariant(), SideVariant(Codebook.LEVELS), {"value_levels": True}),
    (SideVariant(), SideVariant(Codebook.TRELLIS, trellis_entries=256), {"value_trellis": 256}),
    (SideVariant(rounding=Rounding.QUERY_AWARE, channel_widths=ChannelWidths.ALLOCATED, centering=True),
     SideVariant(Codebook.LEVELS), {"key_centering": True, "key_rounding": True, "key_channel_bits": True,
                                    "value_levels": True}),
]


@pytest.mark.parametrize("kv,vv,flags", VARIANTS)
def test_each_variant_writes_its_flag(kv, vv, flags):
    """A config with one variant (or several) writes exactly its flags; from_dict gives the same variants back."""
    cfg = KVCacheConfig(K4, V4, residual_window=16, sink_tokens=4, key_variant=kv, value_variant=vv)
    d = cfg.to_dict()
    assert list(d.items()) == list(_wire(cfg, **flags).items())
    back = KVCacheConfig.from_dict(d)
    assert back == cfg and back.key_variant == kv and back.value_variant == vv
    assert KVCacheConfig.from_dict(json.loads(json.dumps(d))) == cfg  # through JSON (kvcal memory --json)


def test_wire_combinations_no_variant_defines_are_refused():
    """Flags for a combination no side has (levels with a trellis table), value centering and key trellis tables
    are refused with a one-line ValueError."""
    d = _wire(PRESETS["kivi4"], value_levels=True, value_trellis=256)
    with pytest.raises(ValueError, match="value_levels and value_trellis"):
        KVCacheConfig.from_dict(d)
    with pytest.raises(ValueError, match="keys only"):
        KVCacheConfig(K4, V4, value_variant=SideVariant(centering=True))
    with pytest.raises(ValueError, match="values only"):
        KVCacheConfig(K4, V4, key_variant=SideVariant(Codebook.TRELLIS, trellis_entries=256))
    with pytest.raises(ValueError, match="trellis_entries"):
        SideVariant(Codebook.TRELLIS)
    with pytest.raises(ValueError, match="does not combine"):
        SideVariant(Codebook.LEVELS, Rounding.QUERY_AWARE)
    with pytest.raises(ValueError, match="codebook must be one of"):
        SideVariant(codebook=True)


MODEL = {"num_hidden_layers": 3, "num_key_value_heads": 2, "head_dim": 64, "num_attention_heads": 6}
L, H, D, B = 3, 2, 64, 4  # layers, KV heads, head_dim, bits of K4 / V4


@pytest.mark.parametrize("kv,vv,per_layer", [
    (SideVariant(centering=True), SideVariant(), 4 * H * D),
    (SideVariant(rounding=Rounding.QUERY_AWARE), SideVariant(), H * D * (D - 1) // 2),
    (SideVariant(), SideVariant(rounding=Rounding.QUERY_AWARE), H * D * (D - 1) // 2),
    (SideVariant(channel_widths=ChannelWidths.ALLOCATED), SideVariant(), H * D),
    (SideVariant(), SideVariant(Codebook.LEVELS), 4 * H * 2**B),
    (SideVariant(), SideVariant(Codebook.TRELLIS, trellis_entries=2 ** (6 + B)), 2 ** (6 + B)),
    (SideVariant(rounding=Rounding.QUERY_AWARE, channel_widths=ChannelWidths.ALLOCATED, centering=True),
     SideVariant(Codebook.LEVELS), 4 * H * D + H * D * (D - 1) // 2 + H * D + 4 * H * 2**B),
])
def test_memory_counts_each_variant_by_its_formula(kv, vv, per_layer):
    """Per-layer metadata of a variant, as memory_report counts it: rounding H·D(D−1)/2 bytes, channel widths
    H·D, levels 4·H·2^b, trellis 2^(ν+b), centering 4·H·D; nothing else in the report changes."""
    plain = memory_report(MODEL, KVCacheConfig(K4, V4), 1000)
    cfg = KVCacheConfig(K4, V4, key_variant=kv, value_variant=vv)
    rep = memory_report(MODEL, cfg, 1000)
    assert rep.static - plain.static == L * per_layer
    assert (rep.payload, rep.params, rep.dense16) == (plain.payload, plain.params, plain.dense16)
    assert rep.total == cache_bytes(MODEL, cfg, 1000) == plain.total + L * per_layer
    assert rep.to_dict()["kv_config"] == cfg.to_dict()


def _transform_plan() -> KVPlan:
    rope = RopeTable(1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)))
    k = SidePlan(K4, clip_ratio=torch.ones(H), transform=Transform.PRE_ROPE, rope=rope)
    v = SidePlan(V4, clip_ratio=torch.ones(H), transform="hadamard")  # the string converts to the member
    return KVPlan([LayerPlan(k, v), LayerPlan(SidePlan(K4, clip_ratio=torch.ones(H)), SidePlan(V4))])


def test_transform_is_its_string_in_artifact_metadata(tmp_path):
    """A Transform goes into artifact metadata as its plain string (no "Transform." anywhere in the file's
    metadata), reads back as the same member, and str() / f-strings / spec labels give the string."""
    from kvcal.artifact import load_artifact, write_artifact

    plan = _transform_plan()
    assert plan.layers[0].v.transform is Transform.HADAMARD
    meta = {"model": {"num_layers": 2, "num_kv_heads": H, "head_dim": D}, "kv": plan.kv_metadata()}
    assert meta["kv"]["transforms"] == [{"k": "pre_rope", "v": "hadamard"}, {"k": "none", "v": "none"}]
    assert all(type(t) is str for row in meta["kv"]["transforms"] for t in row.values())
    path = write_artifact(tmp_path / "a", plan.to_tensors(), meta)
    f = next(path.glob("*.safetensors")) if path.is_dir() else path
    with safe_open(str(f), "pt") as sf:
        raw = sf.metadata()
    assert "Transform." not in json.dumps(raw)
    art = load_artifact(tmp_path / "a")
    assert art.metadata["kv"]["transforms"] == meta["kv"]["transforms"]
    back = KVPlan.from_artifact(art.tensors, art.metadata)
    assert [(lp.k.transform, lp.v.transform) for lp in back.layers] == [
        (Transform.PRE_ROPE, Transform.HADAMARD), (Transform.NONE, Transform.NONE)]
    assert all(isinstance(lp.k.transform, Transform) for lp in back.layers)
    assert (str(Transform.PRE_ROPE), f"{Transform.HADAMARD}", json.dumps(Transform.NONE)) == ("pre_rope", "hadamard",
                                                                                            '"none"')
    assert spec_label(INT_PRESETS["int4"].k).split("/")[3] == "pre_rope"
    with pytest.raises(ValueError, match="unknown transform 'rotate'"):
        SidePlan(V4, transform="rotate")
