"""NVFP4 outer scales (and q_scale) for vLLM ``--kv-cache-dtype nvfp4`` — the search's
objective against an independent float64 re-statement and a hand-worked example, the held-out guard, the
option checks, and the artifact / export / inspect path on a tiny random Llama (seconds each)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers.models import TINY_LLAMA_16, safetensors_dir, save_tiny_llama

from kvcal.engines.vllm import search_nvfp4 as N
from kvcal.engines.vllm.search_fp8 import joint_key_kl
from kvcal.errors import KvcalError
from kvcal.search.objectives import SequenceCache

REPO = Path(__file__).resolve().parents[2]
CHAT = REPO / "calibration_sets" / "chat.jsonl"
EPS32 = 2.0 ** -24  # float32 unit roundoff


# ---- float64 re-statement of vLLM's NVFP4 write (ref_nvfp4_quant), independent of kvcal.formats ---------
def _e4m3_grid() -> torch.Tensor:
    """Every finite non-negative float8_e4m3fn value, from its bit fields: exponent e (bias 7), mantissa m;
    e = 0 subnormal m/8 * 2^-6; e = 15, m = 7 is NaN (excluded); max 448."""
    vals = [(m / 8) * 2.0 ** -6 for m in range(8)]
    vals += [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8) if not (e == 15 and m == 7)]
    return torch.tensor(vals, dtype=torch.float64)


def _round_to_grid(y: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Nearest grid value to |y| (grid ascending, non-negative), ties to the even index (= even code, since the
    grid lists the codes in order), sign restored; |y| beyond the grid saturates at its max."""
    a = y.abs().clamp(max=float(grid[-1]))
    d = (a[..., None] - grid).abs()
    best = d.min(-1, keepdim=True).values
    cand = (d == best)
    idx = torch.where(cand.sum(-1) > 1, (cand * torch.arange(grid.numel())).argmax(-1)
                      - ((cand * torch.arange(grid.numel())).argmax(-1) % 2), d.argmin(-1))
    return grid[idx] * torch.sign(y)


E4M3 = _e4m3_grid()
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32).to(torch.float64)


def _nvfp4_codes64(x: torch.Tensor, outer: float) -> torch.Tensor:
    """vLLM's ``ref_nvfp4_quant`` (nvfp4_emulation_utils.py) with ``global_scale = 1/outer``, each float32 op
    rounded to float32 in float64: ``s = g * (vmax * (1/6))``, clamp ±448, e4m3; ``out = 1/(s8 * (1/g))``
    (0 -> 1/1e8), ``e2m1(clamp(x * out, ±6))``. Returns ``e2m1 * s8`` per element, float64, x's shape."""
    H, T, D = x.shape
    xb = _f32(x.double()).reshape(H, T, D // 16, 16)
    g = _f32(1.0 / _f32(torch.tensor(outer, dtype=torch.float64)))
    vmax = xb.abs().amax(-1, keepdim=True)
    s = _f32(g * _f32(vmax * _f32(torch.tensor(1.0 / 6.0))))
    s8 = _round_to_grid(s.clamp(-448, 448), E4M3)
    denom = _f32(s8 * _f32(1.0 / g))
    out = _f32(1.0 / _f32(denom + (denom == 0).double() * 1e8))
    e = _round_to_grid(_f32(xb * out).clamp(-6, 6), E2M1)
    return (e * s8).reshape(H, T, D)


def _kl64(q, k, k_codes, fold, scaling, qpos):
    """Σ_queries KL(P ‖ P̂) per KV head, float64: P the exact causal softmax(q·kᵀ·scaling) of the float32
    inputs, P̂ = softmax((q · k_codes) · fold) (vLLM folds sm_scale·k_scale into bmm1_scale). Also returns
    S, the largest Σ|q_d k_d|·scale of any reference or quantized score (for the float32 bound)."""
    Hq, T, D = q.shape
    Hkv = k.shape[0]
    G = Hq // Hkv
    mask = torch.arange(T)[None, :] > qpos[:, None]
    out = torch.zeros(Hkv, dtype=torch.float64)
    S = 0.0
    for h in range(Hkv):
        for g in range(G):
            qq = q[h * G + g, qpos].double()
            s_ref = (qq @ k[h].double().T * scaling).masked_fill(mask, -math.inf)
            s_hat = (qq @ k_codes[h].T * fold).masked_fill(mask, -math.inf)
            lp, lph = torch.log_softmax(s_ref, -1), torch.log_softmax(s_hat, -1)
            out[h] += (lp.exp() * (lp - lph).masked_fill(mask, 0.0)).sum()
            S = max(S, float((qq.abs() @ k[h].double().abs().T).max() * scaling),
                    float((qq.abs() @ k_codes[h].abs().T).max() * fold))
    return out, S


def _bound(S, n_queries, T, D):
    """float32 error bound of kvcal's per-head Σ KL (u = 2^-24), the argument of test_vllm_fp8_search:
    each score is a D-term float32 dot product and <= 2 multiplications, |Δs| <= (D+2)·u·S; KL moves by at
    most 2·max|Δs| per query for each of the two score sets; float32 log_softmax errs per log-probability
    by at most u·(2S + log T + 1) + (T+2)·u, weighted by P (Σ P = 1), for both log-probabilities."""
    ds = (D + 2) * EPS32 * S
    lp = EPS32 * (2 * S + math.log(T) + 1) + (T + 2) * EPS32
    return n_queries * (2 * 2 * ds + 2 * lp) + 1e-12


def _cache(seed, Hq=4, Hkv=2, T=40, D=32, kscale=None, vscale=0.05):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(Hq, T, D, generator=g) * 2.0
    k = torch.randn(Hkv, T, D, generator=g) * (torch.linspace(0.01, 6.0, D) if kscale is None else kscale)
    k[:, 3, :16] = 0.0  # an all-zero block: block scale 0 (the zero guard)
    k[:, 5, 16:] *= 1e-3  # tiny blocks: subnormal e4m3 block scales at outer 1.0
    v = torch.randn(Hkv, T, D, generator=g) * vscale
    return SequenceCache(q, k, v, D ** -0.5, 16)


# ---- the objective --------------------------------------------------------------------------------------
@pytest.mark.parametrize("outer", [1.0, 6.0 / 2688, 6.0 / 2688 * 2 ** (-3 / 8), 6.0 / 2688 * 2 ** (5 / 8), 1e-4])
def test_key_codes_equal_float64_restatement(outer):
    """Claim: the NVFP4 key codes the search scores (e2m1 x e4m3 block scale, outer scale left to the softmax
    scale) equal, bit for bit, a float64 re-statement of vLLM's ref_nvfp4_quant with global_scale = 1/outer
    (zero block, subnormal block scales at outer 1.0, saturated block scales at outer 1e-4), and codes x outer
    is kvcal's nvfp4 fake-quant exactly (the product of a 2-bit and a 4-bit significand is exact in float32)."""
    c = _cache(0)
    got = N.key_codes(c.k, outer)
    want = _nvfp4_codes64(c.k, outer)
    assert torch.equal(got.double(), want)
    from kvcal.engines.vllm.dtypes import nvfp4_fake_quant

    assert torch.equal(got * torch.tensor(outer, dtype=torch.float32), nvfp4_fake_quant(c.k[None], outer)[0])
    if outer == 1e-4:  # 6 * 448 * 1e-4 = 0.2688: larger values clip there
        assert float(got.abs().max()) * 1e-4 <= 0.2688 * (1 + 1e-6) < float(c.k.abs().max())


@pytest.mark.parametrize("outer", [1.0, 0.0022, 3e-4])
def test_key_kl_matches_float64_restatement(outer):
    """Claim: the key objective (Σ attention KL per KV head, nats, vLLM's NVFP4 keys at this outer scale,
    exact queries) equals the float64 KL of the float64 re-statement within the float32 bound derived in
    _bound — at three outer scales whose KLs differ by more than that bound."""
    c = _cache(1)
    got = joint_key_kl(c, None, None, N.key_codes(c.k, outer), torch.full((2,), outer))
    codes = _nvfp4_codes64(c.k, outer)
    fold = float(torch.tensor(c.scaling, dtype=torch.float32) * torch.tensor(outer, dtype=torch.float32))
    want, S = _kl64(c.q, c.k, codes, fold, c.scaling, c.qpos)
    bound = _bound(S, c.qpos.numel() * 2, c.k.shape[1], c.k.shape[2])
    assert (got - want).abs().max() <= bound, (got, want, bound)
    assert float(want.sum()) > 0


def test_hand_worked_subnormal_block_scale():
    """Claim (worked by hand): one head, D = 16, keys k0 = [0.01, 0, ...], k1 = 0, query q = [400, 0, ...],
    scaling 1/4. At outer 1.0 the block scale 0.01/6 = 0.00167 rounds to e4m3's smallest subnormal 2^-9
    (0.00195; nearest, 0.853 of a step), 0.01 x 512 = 5.12 rounds to E2M1 6, so vLLM stores k0 = 6 x 2^-9 =
    0.01171875: the last query's scores go from (1, 0) to (1.171875, 0) and its KL is
    p0 (a - â) + log(1 + e^â) - log(1 + e^a) with a = 1, â = 1.171875, p0 = e/(1+e) = 0.73106:
    -0.12565 + log(4.22808) - log(3.71828) = -0.12565 + 1.44173 - 1.31326 = 0.00282 nats; the first
    query sees k0 alone (KL 0). At the amax rule 0.01/2688 the block scale is 448 and k0 is kept to float32
    rounding, so the KL is below its float32 bound — and the search picks a scale other than unity."""
    D = 16
    q = torch.zeros(1, 2, D)
    q[0, :, 0] = 400.0
    k = torch.zeros(1, 2, D)
    k[0, 0, 0] = 0.01
    v = torch.randn(1, 2, D)
    c = SequenceCache(q, k, v, 0.25, None)
    codes = N.key_codes(c.k, 1.0)
    assert float(codes[0, 0, 0]) == 6 * 2.0 ** -9 and float(codes.abs().sum()) == 6 * 2.0 ** -9
    a, ah = 1.0, 1.171875
    p0 = math.e / (1 + math.e)
    want = p0 * (a - ah) + math.log(1 + math.exp(ah)) - math.log(1 + math.exp(a))
    got = float(joint_key_kl(c, None, None, codes, torch.ones(1)).sum())
    assert abs(want - 0.00282) < 1e-5  # the hand figure above, rounded to 5 decimals (≤ 5e-6)
    assert abs(got - want) <= _bound(1.171875, 2, 2, D)
    o = 0.01 / 2688
    kl_amax = float(joint_key_kl(c, None, None, N.key_codes(c.k, o), torch.full((1,), o)).sum())
    assert kl_amax <= _bound(1.0 * (1 + 1e-6), 2, 2, D) < want
    ch = N.choose_outer_scale([c], [], 0.01, "k")
    assert ch.label != ["unity"] and ch.heldout["chosen"] < ch.heldout["unity"]


def test_candidates():
    """Claim: the candidates are amax/2688 (row 0), 1.0 (row 1) and amax/2688 x 2^(j/8), j = -4..7 without 0,
    each a float32 value repeated over the heads; amax 0 gives the amax rule 1.0."""
    labels, rows = N.outer_candidates(2688.0 * 3, 2)
    assert labels[:2] == ["absmax", "unity"] and rows.shape == (13, 2) and rows.dtype == torch.float32
    want = torch.tensor([3.0, 1.0] + [3.0 * 2 ** (j / 8) for j in (-4, -3, -2, -1, 1, 2, 3, 4, 5, 6, 7)],
                        dtype=torch.float64).float()
    assert torch.equal(rows[:, 0], want) and torch.equal(rows[:, 1], want)
    assert float(N.outer_candidates(0.0, 1)[1][0, 0]) == 1.0


def test_guard_never_worse_on_heldout_and_figures_recompute():
    """Claim: per side (q, k, v) the chosen scale's held-out error is <= the amax rule's and unity's, and the
    recorded held-out figures are the objective re-evaluated at the chosen / amax / unity scales (keys: joint
    KL per query with the step-1 FP8 queries; values: Σ‖P(V̂−V)‖²/Σ‖PV‖²)."""
    cal = [_cache(s) for s in (2, 3, 4)]
    held = [_cache(s) for s in (7, 8)]
    qa = torch.stack([c.q.abs().amax((1, 2)) for c in cal]).amax(0)
    ka = torch.stack([c.k.abs().amax((1, 2)) for c in cal]).amax(0)
    va = torch.stack([c.v.abs().amax((1, 2)) for c in cal]).amax(0)
    ch = N.choose_layer(cal, held, qa, ka, va)
    for s in "qkv":
        h = getattr(ch, s).heldout
        assert h["chosen"] <= h["absmax"] and h["chosen"] <= h["unity"], (s, h)
    from kvcal.engines.vllm.dtypes import nvfp4_fake_quant

    vo = float(ch.v.scale[0])
    num = sum(float(c.value_error(nvfp4_fake_quant(c.v[None], vo)[0])[0].sum()) for c in held)
    den = sum(float(c.out_sq.sum()) for c in held)
    # the same float32 per-sequence errors, summed in float64 (≤ a few eps64 apart in another order); another
    # scale's figure differs at the 1e-3 level
    assert ch.v.heldout["chosen"] == pytest.approx(num / den, rel=1e-12)
    unity = sum(float(c.value_error(nvfp4_fake_quant(c.v[None], 1.0)[0])[0].sum()) for c in held) / den
    assert ch.v.heldout["unity"] == pytest.approx(unity, rel=1e-12)
    assert ch.v.clip_ratio[0] == pytest.approx(vo * 2688 / float(va.max()), rel=1e-6)  # float32 vs float64: ≤ 3 eps32


@pytest.mark.parametrize("kw,msg", [
    (dict(engine="vllm", kv_cache_dtype="int4_per_token_head"), "kvcal evaluate --vllm-dtype int4_per_token_head"),
    (dict(engine="vllm", kv_cache_dtype="nvfp4", granularity="head"), "--granularity head conflicts"),
    (dict(engine="vllm", kv_cache_dtype="nvfp4", format="fp8_e4m3"), "--format conflicts"),
    (dict(engine="vllm", kv_cache_dtype="nvfp4", preset="fp8"), "--preset conflicts"),
])
def test_engine_options_nvfp4(kw, msg):
    """Claim: --kv-cache-dtype nvfp4 is accepted with --engine vllm and refuses, in one line, what it cannot
    honour (per-head scales — vLLM loads per-tensor outer scales only —, an explicit --format/--preset); other
    uncalibrated dtypes still point to kvcal evaluate."""
    from kvcal.calibrate import CalibrateConfig

    CalibrateConfig(corpus="x.jsonl", engine="vllm", kv_cache_dtype="nvfp4")
    with pytest.raises(KvcalError, match=msg) as e:
        CalibrateConfig(corpus="x.jsonl", **kw)
    assert "\n" not in str(e.value)


# ---- end to end on a tiny random Llama (head_dim 16: one NVFP4 block per head) ---------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm_tokenizer):
    return save_tiny_llama(tmp_path_factory, smollm_tokenizer, "tiny-llama-nvfp4", vocab_size=49152, **TINY_LLAMA_16)


@pytest.fixture(scope="module")
def nvfp4_artifact(tiny_dir, tmp_path_factory):
    from kvcal.calibrate import CalibrateConfig, calibrate

    out = tmp_path_factory.mktemp("art") / "nvfp4"
    cfg = CalibrateConfig(corpus=str(CHAT), out=str(out), model=str(tiny_dir), max_samples=12, max_seq_len=96,
                          batch_size=2, reservoir=3, heldout_reservoir=2, max_queries=16,
                          engine="vllm", kv_cache_dtype="nvfp4")
    calibrate(cfg, log=lambda s: None, progress=False)
    return out


def _names(i):
    return {f"model.layers.{i}.self_attn.{s}" for s in ("k_outer_scale", "v_outer_scale", "q_scale")}


def test_artifact_records_outer_scales(nvfp4_artifact):
    """Claim: calibrate --engine vllm --kv-cache-dtype nvfp4 writes, per layer, exactly k_outer_scale,
    v_outer_scale and q_scale (float32 [1]) — no FP8 k/v scale tensors — equal to the metadata's records, with
    NVFP4 cache specs in the kv section, an nvfp4 vllm section, each outer scale one of its candidates on the
    recorded amax, and held-out figures no worse than the amax rule's or unity's."""
    from kvcal.artifact import load_artifact

    art = load_artifact(nvfp4_artifact)
    meta = art.metadata
    assert set(art.tensors) == _names(0) | _names(1)
    assert meta["kv"]["k"]["format"] == meta["kv"]["v"]["format"] == "nvfp4"
    vm = meta["vllm"]
    assert vm["kv_cache_dtype"] == "nvfp4" and vm["skip_layers"] == [] and "SM100" in vm["query_quantization"]
    for i in range(2):
        for s in "kv":
            t = art.tensors[f"model.layers.{i}.self_attn.{s}_outer_scale"]
            assert t.dtype == torch.float32 and tuple(t.shape) == (1,)
            assert t.tolist() == meta["layers"][i][s]["scale"] == [vm[f"{s}_outer_scale"][i]]
            _, cands = N.outer_candidates(meta["layers"][i][s]["amax"][0], 1)
            assert float(t) in cands[:, 0].tolist()
            h = meta["layers"][i][s]["heldout"]
            assert h["chosen"] <= min(h["absmax"], h["unity"])
        q = art.tensors[f"model.layers.{i}.self_attn.q_scale"]
        assert tuple(q.shape) == (1,) and q.tolist() == vm["q_scale"][i] == meta["layers"][i]["q"]["scale"]


def test_validator_accepts_outer_scales_only_where_nvfp4(nvfp4_artifact):
    """Claim: load_artifact's tensor check accepts {k,v}_outer_scale only when the metadata says vllm nvfp4,
    requires them for every layer there, and refuses a wrong shape or an implausible value (one line each)."""
    import copy

    from kvcal.artifact import load_artifact, validate_tensors
    from kvcal.errors import ArtifactError

    art = load_artifact(nvfp4_artifact)
    f = Path("kv_scales.safetensors")
    validate_tensors(f, art.metadata, art.tensors)
    meta = copy.deepcopy(art.metadata)
    meta["vllm"]["kv_cache_dtype"] = "fp8"
    with pytest.raises(ArtifactError, match="NVFP4 outer scale, but the metadata says vllm.kv_cache_dtype 'fp8'"):
        validate_tensors(f, meta, art.tensors)
    meta.pop("vllm")
    with pytest.raises(ArtifactError, match="no vllm nvfp4 calibration"):
        validate_tensors(f, meta, art.tensors)
    cases = [({"model.layers.1.self_attn.v_outer_scale": None}, "1 NVFP4 outer scale\\(s\\) are missing"),
             ({"model.layers.0.self_attn.k_outer_scale": torch.ones(2)}, "expected \\[1\\]"),
             ({"model.layers.0.self_attn.k_outer_scale": torch.full((1,), 1e6)}, "implausible")]
    for change, msg in cases:
        t = dict(art.tensors)
        for k, v in change.items():
            if v is None:
                t.pop(k)
            else:
                t[k] = v
        with pytest.raises(ArtifactError, match=msg) as e:
            validate_tensors(f, art.metadata, t)
        assert "\n" not in str(e.value)


def test_export_vllm_writes_outer_scales_as_k_v_scale(nvfp4_artifact, tiny_dir, tmp_path):
    """Claim (golden names, from vLLM 0.33's source): export --target vllm writes each layer's outer scales as
    model.layers.{i}.self_attn.k_scale / v_scale and q_scale (float32 [1], the artifact's values bit for bit;
    vLLM maps {attn}.k_scale to the Attention layer's k_scale), declares the FP8 compressed-tensors
    kv_cache_scheme (num_bits 8, float, tensor, symmetric, static — the only scheme its KV method accepts) and
    serves with --kv-cache-dtype nvfp4; the other targets refuse the artifact."""
    from safetensors.torch import load_file

    from kvcal.artifact import load_artifact
    from kvcal.export import export
    from kvcal.export.base import ExportError
    from kvcal.export.checkpoint import SCALES_SHARD

    art = load_artifact(nvfp4_artifact)
    scheme = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": "tensor",
              "dynamic": False}
    res = export(nvfp4_artifact, "vllm", tmp_path / "std")
    t = load_file(str(tmp_path / "std" / SCALES_SHARD))
    assert set(t) == {f"model.layers.{i}.self_attn.{s}_scale" for i in range(2) for s in "kvq"}
    for i in range(2):
        for s in "kv":
            got = t[f"model.layers.{i}.self_attn.{s}_scale"]
            assert got.dtype == torch.float32 and torch.equal(got, art.tensors[f"model.layers.{i}.self_attn.{s}_outer_scale"])
        assert torch.equal(t[f"model.layers.{i}.self_attn.q_scale"], art.tensors[f"model.layers.{i}.self_attn.q_scale"])
    qc = json.loads((tmp_path / "std" / "quantization_config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"] == scheme
    assert res.serve == f"vllm serve {tmp_path / 'std'} --kv-cache-dtype nvfp4"
    assert any("serve with --kv-cache-dtype nvfp4" in w for w in res.warnings)
    res2 = export(nvfp4_artifact, "vllm", tmp_path / "ckpt", model_dir=tiny_dir)
    merged = safetensors_dir(tmp_path / "ckpt")
    assert torch.equal(merged["model.layers.1.self_attn.v_scale"], art.tensors["model.layers.1.self_attn.v_outer_scale"])
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"]["kv_cache_scheme"] == scheme
    assert "--kv-cache-dtype nvfp4" in res2.serve
    for target in ("sglang-json", "trtllm-legacy", "modelopt", "quantization-param-path"):
        with pytest.raises(ExportError, match="vLLM NVFP4 outer scales.*use --target vllm"):
            export(nvfp4_artifact, target, tmp_path / target)


def test_inspect_shows_outer_scales(nvfp4_artifact):
    """Claim: kvcal inspect lists each layer's NVFP4 outer scales in the K/V columns and the q_scale, says they
    are outer scales, and simulates vLLM loading them as k_scale/v_scale."""
    from kvcal.artifact import load_artifact
    from kvcal.inspect import inspect_path, render

    art = load_artifact(nvfp4_artifact)
    ins = inspect_path(nvfp4_artifact)
    for i, r in enumerate(ins.layers):
        for s in "kv":
            assert r[s] == art.tensors[f"model.layers.{i}.self_attn.{s}_outer_scale"].tolist()
        assert r["q"] == art.tensors[f"model.layers.{i}.self_attn.q_scale"].tolist()
    txt = render(ins)
    assert "NVFP4 outer scales" in txt and "Q scale" in txt and "--kv-cache-dtype nvfp4" in txt
    assert set(ins.engines) == {"vLLM"}


def test_evaluate_vllm_nvfp4_row_uses_the_outer_scales(nvfp4_artifact, tiny_dir, tmp_path):
    """Claim: kvcal evaluate --vllm-dtype nvfp4 on this artifact runs the vllm:nvfp4 row with its outer scales and
    q_scale (the note says so) instead of vLLM's 1.0 defaults."""
    from click.testing import CliRunner

    from kvcal.cli import main

    j = tmp_path / "ev.json"
    r = CliRunner().invoke(main, ["evaluate", "--artifact", str(nvfp4_artifact), "--corpus", str(CHAT), "--model",
                                  str(tiny_dir), "--context", "48", "--windows", "1", "--mode", "teacher_forced",
                                  "--no-baselines", "--vllm-dtype", "nvfp4", "--json", str(j), "--quiet"])
    assert r.exit_code in (0, 1), r.output
    ev = json.loads(j.read_text())
    assert any("the artifact's NVFP4 outer scales" in n for n in ev["notes"])


def test_given_skip_layers_are_recorded_for_nvfp4(tiny_dir, tmp_path):
    """Claim: calibrate --engine vllm --kv-cache-dtype nvfp4 --skip-layers 1 records layer 1 as 16-bit in the
    vllm section (not silently dropped) and export prints it in the vllm serve line."""
    from kvcal.artifact import load_artifact
    from kvcal.calibrate import CalibrateConfig, calibrate
    from kvcal.export import export

    out = tmp_path / "a"
    calibrate(CalibrateConfig(corpus=str(CHAT), out=str(out), model=str(tiny_dir), max_samples=6, max_seq_len=64,
                              batch_size=2, reservoir=2, heldout_reservoir=1, max_queries=8, engine="vllm",
                              kv_cache_dtype="nvfp4", skip_layers="1"), log=lambda s: None, progress=False)
    assert load_artifact(out).metadata["vllm"]["skip_layers"] == [1]
    res = export(out, "vllm", tmp_path / "x")
    assert res.serve.endswith("--kv-cache-dtype nvfp4 --kv-cache-dtype-skip-layers 1")


def test_auto_skip_layers_probe_the_calibrated_outer_scales(tiny_dir, tmp_path, monkeypatch):
    """Claim: calibrate --engine vllm --kv-cache-dtype nvfp4 --skip-layers auto --max-skip 1 probes each layer
    with the outer scales and q_scale it just calibrated (the values passed to the probe equal the artifact's
    k/v_outer_scale and q_scale tensors, not vLLM's default 1.0), and keeps the layer with the largest recorded
    probe KL at 16 bits (uniform layer costs: the knapsack with one slot is the argmax)."""
    import kvcal.engines.vllm.probe as vp
    from kvcal.artifact import load_artifact
    from kvcal.calibrate import CalibrateConfig, calibrate

    seen = {}
    real = vp.layer_sensitivity

    def spy(model, samples, dtype, num_layers, progress=True, **scales):
        seen.update(dtype=dtype, **scales)
        return real(model, samples, dtype, num_layers, progress=progress, **scales)

    monkeypatch.setattr(vp, "layer_sensitivity", spy)
    out = tmp_path / "auto"
    calibrate(CalibrateConfig(corpus=str(CHAT), out=str(out), model=str(tiny_dir), max_samples=8, max_seq_len=64,
                              batch_size=2, reservoir=2, heldout_reservoir=2, max_queries=8, probe_tokens=96,
                              engine="vllm", kv_cache_dtype="nvfp4", skip_layers="auto", max_skip=1),
              log=lambda s: None, progress=False)
    art = load_artifact(out)
    L = art.metadata["model"]["num_layers"]
    t = art.tensors
    assert seen["dtype"] == "nvfp4"
    for key, name in (("k_scales", "k_outer_scale"), ("v_scales", "v_outer_scale"), ("q_scales", "q_scale")):
        assert seen[key] == [float(t[f"model.layers.{i}.self_attn.{name}"][0]) for i in range(L)], key
    assert any(x != 1.0 for x in seen["k_scales"] + seen["v_scales"])
    vm = art.metadata["vllm"]
    sens = vm["skip_layers_choice"]["sensitivity"]
    assert len(sens) == L and vm["skip_layers_choice"]["method"] == "auto"
    assert vm["skip_layers"] == [max(range(L), key=lambda i: sens[i])]
