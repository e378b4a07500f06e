"""Integer presets and --bits on a tiny random Llama: artifacts round-trip through KVPlan; the
outlier twin (prior-art recipe) leaves logits unchanged, breaks unity FP8, not kvcal."""

from __future__ import annotations

import pytest
import torch

from kvcal.calibrate import CalibrateConfig
from kvcal.capture.run import run_capture, split_heldout
from kvcal.errors import KvcalError
from kvcal.evaluate.protocol_a import teacher_forced
from kvcal.formats.variants import Codebook
from kvcal.search.fp8 import plan_from_choices, search_scales
from kvcal.search.integer import search_int

transformers = pytest.importorskip("transformers")

L, HQ, HK, D = 2, 4, 2, 16


def _tiny(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=HQ * D, intermediate_size=96, num_hidden_layers=L,
                                   num_attention_heads=HQ, num_key_value_heads=HK, head_dim=D,
                                   max_position_embeddings=128, attn_implementation="eager")
    m = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in m.model.layers:  # livelier attention than the 0.02-std init
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    return m


def _samples(n=8, T=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (T,), generator=g) for _ in range(n)]


def _capture(model, samples, skip=1, tokens=32):
    return run_capture(model, samples, split_heldout(len(samples), 0.25, 0), num_layers=L, num_kv_heads=HK,
                       num_q_heads=HQ, head_dim=D, reservoir=4, heldout_reservoir=2, search_tokens=tokens,
                       progress=False, sink_stats_skip=skip)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: thread sync costs more than it saves
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny_capture():
    m = _tiny()
    return m, _capture(m, _samples())


@pytest.mark.parametrize("preset", ["int8", "int4", "int2", "k4v2", 3.5])
def test_presets_write_loadable_artifacts(tmp_path, tiny_capture, preset):
    """Each preset (int8, int4, int2, k4v2, --bits 3.5) gives a plan that loads back (through write/load_artifact
    where specs are uniform) with the same specs, sinks, key position, transforms and fake_quant exactly; --bits stays within budget."""
    from kvcal.artifact import load_artifact, write_artifact
    from kvcal.plan import KVPlan

    _, cap = tiny_capture
    kw = {"bits": preset} if isinstance(preset, float) else {"preset": preset}
    r = search_int(cap, max_queries=8, progress=False, budget_context=256, **kw)
    if isinstance(preset, float):
        assert r.summary["average_bits"] <= preset
    meta = {"model": {"num_layers": L, "num_kv_heads": HK, "head_dim": D}, "kv": r.plan.kv_metadata(),
            "calibration": r.summary, "layers": r.layers_meta}
    tensors = r.plan.to_tensors()
    if isinstance(preset, float):  # per-layer specs may mix static and dynamic sides
        back = KVPlan.from_artifact(tensors, meta)
    else:
        write_artifact(tmp_path / "a", tensors, meta)
        art = load_artifact(tmp_path / "a")
        back = KVPlan.from_artifact(art.tensors, art.metadata)
    assert back.sink_tokens == r.plan.sink_tokens
    assert back.key_position == r.plan.key_position
    if preset in ("int4", "int2", "k4v2"):
        assert back.key_position == "pre_rope" and back.layers[0].k.rounding is not None
    if preset == "int4":  # values keep min/max ranges (clip ratios not searched)
        assert all(torch.equal(lp.v.clip_ratio, torch.ones(HK)) for lp in r.plan.layers)
    assert back.transforms() == r.plan.transforms()
    x = torch.randn(1, HK, 40, D) * 3
    for i in range(L):
        for s in ("k", "v"):
            assert back.layers[i].side(s).spec == r.plan.layers[i].side(s).spec
            assert torch.equal(back.fake_quant(i, s, x), r.plan.fake_quant(i, s, x))


def _tampered(src, dst, edit):
    """Copy artifact ``src`` to ``dst`` with its tensors edited by ``edit(dict)``, metadata kept."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    dst.mkdir()
    with safe_open(str(src / "kv_scales.safetensors"), framework="pt") as fh:
        header, tensors = fh.metadata(), {k: fh.get_tensor(k) for k in fh.keys()}
    edit(tensors)
    save_file(tensors, str(dst / "kv_scales.safetensors"), metadata=header)
    return dst


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.pop("model.layers.1.self_attn.k_rounding"), "lacks 1 tensor.*model.layers.1.self_attn.k_rounding"),
    (lambda t: [t.pop(n) for n in [n for n in t if n.endswith(("k_rounding", "k_channel_bits", "v_levels"))]],
     "lacks 6 tensor"),
    (lambda t: t.pop("model.layers.0.self_attn.v_clip_ratio"), "model.layers.0.self_attn.v_clip_ratio"),
    (lambda t: t.__setitem__("model.layers.1.self_attn.k_clip_ratio", -t["model.layers.1.self_attn.k_clip_ratio"]),
     "k_clip_ratio must hold 1 or 2 finite values > 0"),
    (lambda t: t.__setitem__("model.layers.0.self_attn.v_levels", t["model.layers.0.self_attn.v_levels"] * float("nan")),
     "v_levels"),
    (lambda t: t.__setitem__("model.layers.0.self_attn.k_mean", torch.zeros(HK, D)), "did not write.*k_mean"),
])
def test_tampered_int_artifacts_are_refused_on_load(tmp_path, tiny_capture, edit, match):
    """An int4 artifact with a calibrated tensor deleted (rounding, widths, levels) or a negative clip ratio
    is refused by load_artifact (which every command loads through) naming the tensor; `kvcal inspect` of it
    exits 2 with one line and no traceback."""
    from click.testing import CliRunner

    from kvcal.artifact import load_artifact, write_artifact
    from kvcal.cli import main
    from kvcal.errors import ArtifactError

    _, cap = tiny_capture
    r = search_int(cap, preset="int4", max_queries=8, progress=False, budget_context=256)
    meta = {"model": {"num_layers": L, "num_kv_heads": HK, "head_dim": D}, "kv": r.plan.kv_metadata(),
            "calibration": r.summary, "layers": r.layers_meta}
    src = write_artifact(tmp_path / "a", r.plan.to_tensors(), meta)
    assert load_artifact(src).metadata["tensor_names"] == sorted(r.plan.to_tensors())
    bad = _tampered(src, tmp_path / "bad", edit)
    with pytest.raises(ArtifactError, match=match):
        load_artifact(bad)
    res = CliRunner().invoke(main, ["inspect", str(bad)])
    assert res.exit_code == 2 and "Traceback" not in res.output and "re-run calibration" in res.output


def test_config_validation_and_budget_errors(tiny_capture):
    """Bad presets/bits, FP8-ignored options, all-sink configs and bad devices are refused with KvcalError; an
    infeasible --bits names a feasible minimum (that budget allocates), and bits_precheck refuses it before capture."""
    with pytest.raises(KvcalError, match="preset"):
        CalibrateConfig(corpus="x", preset="int5")
    with pytest.raises(KvcalError, match="bits"):
        CalibrateConfig(corpus="x", bits=1.0)
    assert CalibrateConfig(corpus="x").preset == "fp8"  # default path unchanged
    with pytest.raises(KvcalError, match="raise --bits to at least") as e:
        search_int(tiny_capture[1], bits=2.0, max_queries=8, progress=False, budget_context=64)
    import re

    need = float(re.search(r"at least (\d+\.\d+)", str(e.value)).group(1))
    assert 2.0 < need < 4.0  # the advice is feasible: that budget allocates
    assert search_int(tiny_capture[1], bits=need, max_queries=8, progress=False,
                      budget_context=64).summary["average_bits"] <= need
    # the same refusal from the config alone, before any capture (`--bits 2.0` must not load the
    # model, capture, search and probe before saying so); its bound never exceeds the allocation's
    from kvcal.search.integer import bits_precheck

    with pytest.raises(KvcalError, match="raise --bits to at least") as e0:
        bits_precheck(2.0, tiny_capture[0].config, 64, None, 0)
    need0 = float(re.search(r"at least (\d+\.\d+)", str(e0.value)).group(1))
    assert 2.0 < need0 <= need
    bits_precheck(need, tiny_capture[0].config, 64, None, 0)
    # options an FP8 run would silently ignore, sinks that leave nothing to quantize, no CUDA
    with pytest.raises(KvcalError, match="--sinks, --residual-window apply to integer presets"):
        CalibrateConfig(corpus="x", sink_tokens=4, residual_window=16)
    with pytest.raises(KvcalError, match="--key-centering applies to integer presets"):
        CalibrateConfig(corpus="x", key_centering="on")
    with pytest.raises(KvcalError, match="leaves no quantized token"):
        CalibrateConfig(corpus="x", preset="int4", sink_tokens=300, max_seq_len=256)
    if not torch.cuda.is_available():
        with pytest.raises(KvcalError, match="use --device cpu"):
            CalibrateConfig(corpus="x", device="cuda")
    with pytest.raises(KvcalError, match="choose cpu, cuda or cuda:N"):
        CalibrateConfig(corpus="x", device="gpu")


def _twin(model, factor_k=512.0, factor_v=1 / 256.0):
    """Scale RoPE channel pair (3, 3 + D/2) of k_proj rows up (q_proj rows of the group down) and
    v_proj rows of KV head 1 down (o_proj columns up): scores and outputs unchanged. The factors are
    powers of two, so every scaled weight, key, query, value and product is the original one times an
    exact power of two (no new rounding): the twin's float32 logits equal the model's bit for bit."""
    import copy

    t = copy.deepcopy(model)
    g = HQ // HK
    with torch.no_grad():
        for layer in t.model.layers:
            a = layer.self_attn
            for c in (3, 3 + D // 2):
                a.k_proj.weight[0 * D + c] *= factor_k
                for hq in range(0 * g, 1 * g):
                    a.q_proj.weight[hq * D + c] /= factor_k
            a.v_proj.weight[1 * D : 2 * D] *= factor_v
            for hq in range(1 * g, 2 * g):
                a.o_proj.weight[:, hq * D : (hq + 1) * D] /= factor_v
    return t


def _unity(L_):
    from kvcal.formats.spec import TensorQuantSpec
    from kvcal.plan import KVPlan, LayerPlan, SidePlan

    spec = TensorQuantSpec("fp8_e4m3")
    return KVPlan([LayerPlan(SidePlan(spec, scale=torch.ones(1, 1, 1, 1)), SidePlan(spec, scale=torch.ones(1, 1, 1, 1)))
                   for _ in range(L_)])


def test_outlier_twin_breaks_unity_fp8_not_kvcal(tiny_capture):
    """On a function-preserving outlier twin (identical logits), unity FP8 KL exceeds 20x the plain model's
    while kvcal's searched fp8-per-head and int4 plans stay below 0.1x unity's."""
    model, _ = tiny_capture
    twin = _twin(model)
    ids = torch.stack(_samples(2, 64, seed=7))
    with torch.no_grad():
        assert torch.equal(twin(ids).logits, model(ids).logits)  # power-of-two factors: exact (see _twin)
    cap = _capture(twin, _samples(T=64), skip=0, tokens=64)  # calibrate at the evaluated context
    rows = search_scales(cap, "fp8_e4m3", True, 32, progress=False)
    kv_fp8 = plan_from_choices(rows, "fp8_e4m3", "head", HK)[0]
    cap_i = _capture(twin, _samples(T=64), tokens=64)
    kv_int4 = search_int(cap_i, preset="int4", max_queries=16, progress=False).plan
    res = teacher_forced(twin, ids, {"unity": _unity(L), "kvcal fp8 head": kv_fp8, "kvcal int4": kv_int4},
                         progress=False)
    base = teacher_forced(model, ids, {"unity": _unity(L)}, progress=False)["unity"]["kl_mean"]
    # qualitative claims with wide margins (seen: unity 260x the untouched model's unity KL; kvcal's fp8 and
    # int4 at 0.005x and 0.02x of unity): keys ×512 saturate e4m3 at scale 1, values ×1/256 fall to subnormals
    assert res["unity"]["kl_mean"] > 20 * max(base, 1e-6)  # unity FP8 breaks on the twin
    assert res["kvcal fp8 head"]["kl_mean"] < 0.1 * res["unity"]["kl_mean"]
    assert res["kvcal int4"]["kl_mean"] < 0.1 * res["unity"]["kl_mean"]


def _tokenizer_llama_and_corpus(tmp_path, tokenizer):
    """A tiny random Llama over the real tokenizer's vocabulary and a 12-paragraph text corpus."""
    torch.manual_seed(0)
    cfg_m = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=HQ * D, intermediate_size=64,
                                     num_hidden_layers=L, num_attention_heads=HQ, num_key_value_heads=HK, head_dim=D,
                                     max_position_embeddings=256, attn_implementation="eager")
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog {i} times, "
                                  "then rests under a tree near the river bank." for i in range(12)), encoding="utf-8")
    return transformers.LlamaForCausalLM(cfg_m).eval(), corpus


def test_calibrate_int_preset_end_to_end(tmp_path, smollm_tokenizer):
    """calibrate() with --preset int4 on a tiny random Llama (real tokenizer): artifact metadata
    states everything, report written, plan loads back."""
    from kvcal.artifact import load_artifact
    from kvcal.calibrate import calibrate
    from kvcal.plan import KVPlan

    model, corpus = _tokenizer_llama_and_corpus(tmp_path, smollm_tokenizer)
    cfg = CalibrateConfig(corpus=str(corpus), out=str(tmp_path / "art"), max_samples=12, max_seq_len=64,
                          preset="int4", max_queries=16, search_tokens=64)
    res = calibrate(cfg, log=lambda s: None, progress=False, model=model, tokenizer=smollm_tokenizer)
    art = load_artifact(res["out"])
    kv, cal = art.metadata["kv"], art.metadata["calibration"]
    assert kv["k"]["granularity"] == "channel_token_group" and kv["k"]["group_size"] == 128
    assert kv["v"]["granularity"] == "token" and kv["v"]["dynamic"] and kv["key_position"] == "pre_rope"
    assert kv["transforms"] == [{"k": "pre_rope", "v": "hadamard"}] * L
    assert torch.equal(art.tensors["rotary.inv_freq"], model.model.rotary_emb.inv_freq.float())
    # head_dim 16: keys 4 + 32/128 bits, values 4 + 8/16 (one log8 scale byte per token) -> 4.375, plus the
    # keys' float8 strict rounding triangle per layer and head, 8·(16·15/2)/(4096·2·16) = 0.0073 bit,
    # the open key group's float32 raw min / max, 8·(2·16·4)/(4096·2·16) = 0.0078 bit, the uint8
    # channel-width table, 8·16/(4096·2·16) = 0.001 bit, the values' float32 levels table,
    # 8·(4·16)/(4096·2·16) = 0.0039 bit and log8 base, 8·4/(4096·2·16) = 0.0002 bit, plus the 16-bit sink
    # token (≈ 0.003) and clip ratios; each further 16-bit sink token replaces 4 key bits and 4.5 value bits
    # per element by 16: (12 + 11.5) / 2 / 4096 = 0.00287 bit. A layer whose values are trellis-coded stores
    # an int8 table of 2^(6+4) = 1024 bytes instead of the 128-byte levels table: + 896·8/(4096·2·2·2·16) bit
    sk = cal["sinks"]
    n_tr = sum(1 for lm in art.metadata["layers"] if lm["v"].get("trellis"))
    extra_tr = n_tr * 896 * 8 / (4096 * L * 2 * HK * 16)
    # default --probe-tokens: the sink count is the one with the lowest held-out model KL (ties: fewer)
    assert sk["tried"] == [0, 1, 4] and sk["chosen_by"].startswith("held-out model-level KL")
    assert sk["kept"] == min((0, 1, 4), key=lambda n: (sk["heldout_model_kl"][str(n)], n))
    extra = (sk["kept"] - 1) * (12 + 11.5) / 2 / 4096
    # the accounting above sums to 4.3982 + clip ratios; the window is ± a few 1e-3 bit, below any one table
    # (≥ 0.0039 bit except the log8 base) — byte counts, not floats: the same on any CPU
    assert cal["preset"] == "int4" and 4.3972 + extra + extra_tr < cal["average_bits"] < 4.4021 + extra + extra_tr
    assert kv["v"]["scale_dtype"] == "log8"
    for lm in art.metadata["layers"]:  # each layer's values: the levels table or (where it won on held-out) a trellis
        v = lm["v"]
        if v.get("trellis"):
            assert v["trellis"] == {"entries": 1024, "nu": 6} and "levels" not in v and v["label"] == ["trellis"] * HK
            assert v["trellis_heldout"] < v["trellis_levels_heldout"]
        else:
            assert len(v["levels"]) == HK and len(v["levels"][0]) == 16
            assert v["trellis_heldout"] >= v["trellis_levels_heldout"]
    assert all(lm["k"]["rounding"] for lm in art.metadata["layers"])
    # per-channel key widths: a histogram over 1..8 bits of H·D channels holding 4·H·D bits
    for lm in art.metadata["layers"]:
        hist = lm["k"]["channel_bits"]
        assert sum(hist) == HK * 16 and sum((b + 1) * n for b, n in enumerate(hist)) == 4 * HK * 16
    report = (tmp_path / "art" / "report.md").read_text()
    assert report.startswith("# KV-cache calibration report (integer)")
    assert "int4 channel_token_group128 asym, pre-rope, query-aware rounding, per-channel bit widths" in report
    assert all(("int4 token sym, hadamard, trellis-coded (nu=6) |" if lm["v"].get("trellis") else
                "int4 token sym, hadamard, non-uniform levels |") in report for lm in art.metadata["layers"])
    # the integer report has the corpus / context section, never prints "bit budget: None", and does not
    # label the values' plain min/max ranges (no clip search in int4) as "clip"
    assert "## Calibration corpus and context regime" in report and str(corpus) in report
    assert "bit budget: none (fixed preset layout)" in report
    v_picks = [row.split(" | ")[6] for row in report.splitlines() if row.startswith("| ") and "hadamard" in row]
    assert len(v_picks) == len(art.metadata["layers"]) and all(p.startswith("min/max ranges") for p in v_picks)
    assert all(lm["v"]["param"] == [1.0] * HK for lm in art.metadata["layers"])
    plan = KVPlan.from_artifact(art.tensors, art.metadata)
    assert plan.layers[0].k.clip_ratio.shape == (HK,) and plan.sink_tokens == kv["sink_tokens"]
    assert plan.layers[0].k.transform == "pre_rope" and plan.layers[0].v.transform == "hadamard"
    assert plan.layers[0].k.channel_bits.sum(-1).tolist() == [4 * 16] * HK
    for i, lm in enumerate(art.metadata["layers"]):
        if lm["v"].get("trellis"):
            assert plan.layers[i].v.trellis.shape == (1024,) and plan.kv_config(i).value_variant.trellis_entries == 1024
        else:
            assert plan.layers[i].v.levels.shape == (HK, 16) and plan.kv_config(i).value_variant.codebook is Codebook.LEVELS


def _kl64_and_fp32_bound(model, ids, plan):
    """Float64 re-statement of Protocol A's KL on one sample ``ids [T]`` (int64) with ``plan``
    (anything with ``fake_quant``): returns ``(Σ KL, Σ|terms|, n_terms, fp32 bound, positions)``.

    ``fp32 bound``: a float32 log_softmax value ``x_i − m − log Σ exp(x_j − m)`` carries at most ~4
    rounding errors of its magnitude, so one position's KL computed in float32 from the same logits
    differs by at most Σ_i p_i·8·eps32·(|x_i − m| + log V + 1) over its two log-probabilities; the
    returned bound is that sum over positions, computed from the logits (an argument, not a fit)."""
    import math

    from kvcal.capture.hooks import attention_hook
    from kvcal.evaluate.protocol_a import plan_hook

    eps32 = torch.finfo(torch.float32).eps
    with torch.no_grad():
        lr = model(ids[None], use_cache=False).logits[0, :-1]  # [T-1, V] float32
        with attention_hook(model, plan_hook(plan)):
            lq = model(ids[None], use_cache=False).logits[0, :-1]
    a, b = torch.log_softmax(lr.double(), -1), torch.log_softmax(lq.double(), -1)
    terms = a.exp() * (a - b)  # [T-1, V] float64
    bound = 0.0
    for x in (lr, lq):
        mag = (x.double() - x.double().max(-1, keepdim=True).values).abs() + math.log(x.shape[-1]) + 1
        bound += float((a.exp() * 8 * eps32 * mag).sum())
    return float(terms.sum()), float(terms.abs().sum()), terms.numel(), bound, lr.shape[0]


def test_side_sensitivity_is_single_side_protocol_a(tiny_capture):
    """side_sensitivity(l, s) = the Protocol A mean KL of a plan that quantizes only that side.

    Checked two ways, each with a bound that holds on any CPU:
    - against a float64 re-statement of the KL written here, on forwards of the same [1, T] shape
      (the model arithmetic is shared, so every quantized code is the same); what is left is float64
      summation order, bounded by n·eps64·Σ|terms| (n = number of summed terms);
    - against ``teacher_forced`` (batch 1, the same forward shapes) whose KL is computed in float32:
      a float32 log_softmax value ``x_i − m − log Σ exp(x_j − m)`` carries at most ~4 rounding errors
      of its magnitude, so each position's KL differs by at most Σ_i p_i·8·eps32·(|x_i − m| + log V + 1)
      over the two log-probabilities; the bound is that sum, computed from the logits.
    Comparing at batch 2 (as this test once did) is not shared arithmetic: another BLAS blocking moves
    codes across rounding boundaries, by an amount no argument bounds."""
    from kvcal.evaluate.protocol_a import side_sensitivity

    model, cap = tiny_capture
    # one sink (not the automatic choice): 23 of 24 tokens quantized
    plan = search_int(cap, preset="int4", max_queries=8, progress=False, budget_context=256, sinks=1).plan
    samples = _samples(2, 24, seed=11)
    kl = side_sensitivity(model, samples, plan, progress=False)
    assert set(kl) == {(layer, s) for layer in range(L) for s in ("k", "v")}

    class One:
        def __init__(self, key):
            self.key = key

        def fake_quant(self, layer, side, x):
            return plan.fake_quant(layer, side, x) if (layer, side) == self.key else x

    eps64 = torch.finfo(torch.float64).eps
    for key, v in kl.items():
        assert v > 0
        parts = [_kl64_and_fp32_bound(model, ids, One(key)) for ids in samples]
        n_pos = sum(p[4] for p in parts)
        ref64 = sum(p[0] for p in parts) / n_pos
        assert abs(v - ref64) <= sum(p[2] for p in parts) * eps64 * sum(p[1] for p in parts) / n_pos
        tf = teacher_forced(model, torch.stack(samples), {"one": One(key)}, batch_size=1, progress=False)
        assert abs(tf["one"]["kl_mean"] - ref64) <= sum(p[3] for p in parts) / n_pos
    with pytest.raises(ValueError, match="sink_tokens"):  # too short to read a quantized token
        side_sensitivity(model, [torch.tensor([5, 6, 7])[: plan.sink_tokens + 1]], plan, progress=False)


def test_plans_kl_is_protocol_a_kl_over_samples_of_any_length(tiny_capture):
    """plans_kl = teacher_forced's kl_mean per plan, pooled over samples of different lengths by
    predicted positions; an identity plan scores 0; no usable sample raises."""
    from kvcal.evaluate.protocol_a import plans_kl
    from kvcal.plan import KVPlan

    model, cap = tiny_capture
    base = search_int(cap, preset="int4", max_queries=8, progress=False, budget_context=256, sinks=1).plan
    plans = {n: KVPlan(base.layers, sink_tokens=n) for n in (0, 1, 4)}

    class Identity:
        def fake_quant(self, layer, side, x):
            return x

    a, b = _samples(1, 24, seed=11)[0], _samples(1, 13, seed=12)[0]
    kl = plans_kl(model, [a, b, torch.tensor([7])], {**plans, "none": Identity()}, progress=False)
    assert kl["none"] == 0.0
    eps64 = torch.finfo(torch.float64).eps
    for n, p in plans.items():
        # same [1, T] forwards as plans_kl: the codes are shared; the float64 pooled KL is exact up to
        # summation order, and teacher_forced's float32 KL within the derived log_softmax bound
        pa, pb = _kl64_and_fp32_bound(model, a, p), _kl64_and_fp32_bound(model, b, p)
        ref64 = (pa[0] + pb[0]) / 35
        assert kl[n] > 0 and abs(kl[n] - ref64) <= (pa[2] + pb[2]) * eps64 * (pa[1] + pb[1]) / 35
        ra = teacher_forced(model, a[None], {"p": p}, progress=False)["p"]["kl_mean"]
        rb = teacher_forced(model, b[None], {"p": p}, progress=False)["p"]["kl_mean"]
        assert abs((23 * ra + 12 * rb) / 35 - ref64) <= (pa[3] + pb[3]) / 35
    with pytest.raises(ValueError, match="at least 2 tokens"):
        plans_kl(model, [torch.tensor([7])], plans, progress=False)


@pytest.mark.parametrize("hot", [(0, "v"), (1, "k")])
def test_probe_weights_steer_the_bit_allocation(tiny_capture, hot):
    """With a probe saying the model only notices one (layer, side), that side gets the upgrade;
    each item's errors are scaled by KL / error at the reference spec (recorded in the metadata)."""
    _, cap = tiny_capture
    seen = []

    def probe(plan):
        seen.append(plan)
        return {(layer, s): (1.0 if (layer, s) == hot else 1e-9) for layer in range(L) for s in ("k", "v")}

    r = search_int(cap, bits=6.5, probe=probe, max_queries=8, progress=False, budget_context=256)
    assert len(seen) == 1 and seen[0].num_layers == L
    # 1e-9 is below the probe's floor (1e-3 × the mean positive KL): those sides are listed
    floor = 1e-3 * (1.0 + (2 * L - 1) * 1e-9) / (2 * L)
    assert r.summary["allocation"]["probe"]["floor_nats"] == pytest.approx(floor, rel=1e-12)  # a few float64 roundings
    assert len(r.summary["allocation"]["probe"]["floored"]) == 2 * L - 1
    alloc = r.summary["allocation"]
    assert alloc["reference"] == {"k": "int4/channel_token_group128/asym/pre_rope/qround/chbits", "v": "int4/token/sym/hadamard/levels/trellis6/log8"}
    rows = {(t["layer"], t["side"]): t for t in alloc["table"]}
    bits = {k: r.plan.layers[k[0]].side(k[1]).spec.bits for k in rows}
    assert bits[hot] == max(bits.values()) == 8
    assert sum(b == 8 for b in bits.values()) == 1
    for k, t in rows.items():
        assert t["probe_kl"] == (1.0 if k == hot else 1e-9)
        ref_err = t["errors"][alloc["menu"][k[1]].index(alloc["reference"][k[1]])]
        # weight · error(reference) = KL: (KL / err) · err is two float64 roundings (≤ 2 eps64 ≪ 1e-9); an
        # unweighted or mis-weighted error is off by orders of magnitude
        assert ref_err == pytest.approx(max(t["probe_kl"], floor), rel=1e-9)
    assert r.summary["average_bits"] <= 6.5


@pytest.mark.parametrize("probe_tokens", [0, 40])
def test_calibrate_bits_runs_the_held_out_probe(tmp_path, smollm_tokenizer, probe_tokens):
    """``calibrate --bits`` probes held-out samples (not calibration ones), the last cut to fit
    ``probe_tokens``; the allocation metadata records each side's probe KL; 0 switches it off."""
    from kvcal.artifact import load_artifact
    from kvcal.calibrate import calibrate

    model, corpus = _tokenizer_llama_and_corpus(tmp_path, smollm_tokenizer)
    logs = []
    cfg = CalibrateConfig(corpus=str(corpus), out=str(tmp_path / "art"), max_samples=12, max_seq_len=64,
                          bits=6.0, probe_tokens=probe_tokens, max_queries=16, search_tokens=64)
    res = calibrate(cfg, log=logs.append, progress=False, model=model, tokenizer=smollm_tokenizer)
    alloc = load_artifact(res["out"]).metadata["calibration"]["allocation"]
    probed = [t.get("probe_kl") for t in alloc["table"]]
    if probe_tokens == 0:
        assert all(p is None for p in probed) and "reference" not in alloc
        assert not any("sensitivity probe" in m for m in logs)
    else:
        assert all(p is not None and p >= 0 for p in probed) and sum(probed) > 0
        line = next(m for m in logs if "sensitivity probe on" in m)
        held = split_heldout(12, 0.25, 0)  # 3 held-out samples of ~26 tokens: the second is cut to fit 40
        assert line.startswith("sensitivity probe on 2 held-out samples (40 tokens") and len(held) == 3
        assert alloc["probe"]["tokens"] == 40 and alloc["probe"]["source"] == "held-out"
        report = (tmp_path / "art" / "report.md").read_text()
        assert "model-level KL, measured alone at" in report and "on 2 held-out samples (40 tokens)" in report
    with pytest.raises(KvcalError, match="probe-tokens"):
        CalibrateConfig(corpus="x", bits=4.0, probe_tokens=-1)


@pytest.mark.parametrize("bad", ["nan", "inf", "zeros", "missing"])
def test_a_useless_probe_is_refused_not_used(tiny_capture, bad):
    """NaN / inf / all-zero / incomplete probe results stop the run with a clear error (a NaN used to
    make the allocator loop forever; zeros would silently send every side to 2 bits)."""
    _, cap = tiny_capture
    val = {"nan": float("nan"), "inf": float("inf"), "zeros": 0.0, "missing": 1.0}[bad]

    def probe(plan):
        out = {(layer, s): (val if (layer, s) == (0, "k") or bad == "zeros" else 1.0) for layer in range(L) for s in "kv"}
        if bad == "missing":
            del out[(1, "v")]
        return out

    with pytest.raises(KvcalError, match="no effect" if bad == "zeros" else "no finite KL"):
        search_int(cap, bits=6.5, probe=probe, max_queries=8, progress=False, budget_context=256)


def test_allocate_refuses_non_finite_errors():
    """allocate refuses a NaN error with 'finite'; hand-worked: with room for one upgrade it takes the larger
    gain (k: 2 -> 1)."""
    from fractions import Fraction

    from kvcal.search.allocate import Item, allocate

    items = [Item(0, "k", (None, None), (10, 20), (float("nan"), 1.0)), Item(0, "v", (None, None), (10, 20), (1.0, 0.5))]
    with pytest.raises(ValueError, match="finite"):
        allocate(items, Fraction(35))
    items[0] = Item(0, "k", (None, None), (10, 20), (2.0, 1.0))
    assert allocate(items, Fraction(30)) == [1, 0]  # one upgrade fits: the larger gain (k: 2 -> 1)


def test_search_int_keeps_the_sink_count_with_the_lowest_probe_kl(tiny_capture):
    """With a ``sink_probe`` the kept count is the argmin of its KLs (ties: fewer), whatever the
    attention-level sums say; every candidate is offered as a whole plan differing only in
    ``sink_tokens``; a NaN / negative / missing KL is refused with a clear error."""
    _, cap = tiny_capture
    seen = {}

    def probe_for(kls):
        def sink_probe(plans):
            seen.update(plans)
            return dict(kls)
        return sink_probe

    for kls, kept in [({0: 3.0, 1: 1.0, 4: 1.0}, 1), ({0: 0.5, 1: 1.0, 4: 2.0}, 0), ({0: 3.0, 1: 2.0, 4: 1.5}, 4)]:
        seen.clear()
        r = search_int(cap, preset="int8", max_queries=8, progress=False, sink_probe=probe_for(kls))
        sk = r.summary["sinks"]
        assert r.plan.sink_tokens == kept and sk["kept"] == kept and sk["chosen_by"].startswith("held-out model-level")
        assert sk["heldout_model_kl"] == {str(n): v for n, v in kls.items()} and set(sk["heldout_out_sum"]) == {"0", "1", "4"}
        assert sorted(seen) == [0, 1, 4] and [p.sink_tokens for p in seen.values()] == [0, 1, 4]
        assert all(a.k is b.k and a.v is b.v for a, b in zip(seen[0].layers, seen[4].layers, strict=True))
    for bad in ({0: float("nan"), 1: 1.0, 4: 1.0}, {0: 1.0, 1: -0.5, 4: 1.0}, {0: 1.0, 1: 1.0}):
        with pytest.raises(KvcalError, match="sink probe"):
            search_int(cap, preset="int8", max_queries=8, progress=False, sink_probe=probe_for(bad))
    # a given --sinks count is never probed
    seen.clear()
    r = search_int(cap, preset="int8", sinks=2, max_queries=8, progress=False, sink_probe=probe_for({0: 0.0}))
    assert r.plan.sink_tokens == 2 and not seen and "chosen_by" not in r.summary["sinks"]


@pytest.mark.parametrize("probe_tokens", [0, 40])
def test_calibrate_chooses_sinks_on_held_out_model_kl(tmp_path, smollm_tokenizer, probe_tokens):
    """``calibrate --preset int4``: with ``--probe-tokens`` the sink count comes from the model KL
    of the whole plan on the held-out probe samples (recorded, logged, in the report); with 0 from
    the summed attention-level error as before."""
    from kvcal.artifact import load_artifact
    from kvcal.calibrate import calibrate

    model, corpus = _tokenizer_llama_and_corpus(tmp_path, smollm_tokenizer)
    logs = []
    cfg = CalibrateConfig(corpus=str(corpus), out=str(tmp_path / "art"), max_samples=12, max_seq_len=64,
                          preset="int4", probe_tokens=probe_tokens, max_queries=16, search_tokens=64)
    res = calibrate(cfg, log=logs.append, progress=False, model=model, tokenizer=smollm_tokenizer)
    art = load_artifact(res["out"])
    sk = art.metadata["calibration"]["sinks"]
    report = (tmp_path / "art" / "report.md").read_text()
    assert art.metadata["kv"]["sink_tokens"] == sk["kept"]
    if probe_tokens == 0:
        assert "heldout_model_kl" not in sk and sk["chosen_by"].startswith("held-out attention-output")
        assert sk["kept"] == min((0, 1, 4), key=lambda n: (sk["heldout_out_sum"][str(n)], n))
        assert "lowest summed held-out attention-output error" in report
    else:
        kl = {int(n): v for n, v in sk["heldout_model_kl"].items()}
        assert sorted(kl) == [0, 1, 4] and all(v >= 0 for v in kl.values())
        assert sk["kept"] == min(kl, key=lambda n: (kl[n], n))
        assert sk["probe"]["tokens"] == 40 and sk["probe"]["samples"] == 2 and sk["probe"]["source"] == "held-out"
        assert any(m.startswith("sink tokens by held-out model KL") and m.endswith(f"-> {sk['kept']}") for m in logs)
        assert "the lowest model KL on 2 held-out samples (40 tokens)" in report


@pytest.mark.parametrize("name", ["int4", "int2", "k4v2"])
def test_memory_and_plan_count_what_the_preset_writes(tiny_capture, name):
    """`kvcal memory/plan --format NAME` counts exactly the bytes the calibration's own accounting reports for
    the artifact `calibrate --preset NAME` writes (int4: 4.24 bits, not a 4.5-bit static layout; k4v2 too),
    and the named layout is the preset's."""
    from types import SimpleNamespace

    from kvcal.formats.memory import memory_report
    from kvcal.search.presets import named_cache_config, preset_cache_config

    r = search_int(tiny_capture[1], preset=name, max_queries=8, progress=False, budget_context=256)
    shape = SimpleNamespace(num_hidden_layers=L, num_key_value_heads=HK, head_dim=D, num_attention_heads=HK,
                            hidden_size=HK * D, max_position_embeddings=4096)
    rep = memory_report(shape, preset_cache_config(name, sink_tokens=r.plan.sink_tokens), 256)
    # int4 values may keep their levels table (4·HK·16 bytes) where the trellis table (1024 bytes) measured
    # worse on held-out; the named layout counts the trellis in every layer (the upper bound)
    kept_levels = sum(1 for lp in r.plan.layers if lp.v.levels is not None) if name == "int4" else 0
    adjust = kept_levels * (1024 - 4 * HK * 16) * 8 / (256 * L * 2 * HK * D)
    # the same byte count through two float64 formulas (a few roundings of numbers < 10: ~1e-15); one
    # missing table or token is ≥ 1e-4 bit here
    assert rep.total * 8 / (256 * L * 2 * HK * D) == pytest.approx(r.summary["average_bits"] + adjust, abs=1e-9)
    assert named_cache_config(name) == preset_cache_config(name)
