"""q_scale calibration and the key search with vLLM's FP8 queries; artifact, export,
inspect and disclosure of the q scales. Tiny tensors and a tiny random Llama (seconds each)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers.models import TINY_LLAMA_16, safetensors_dir, save_tiny_llama

from kvcal.engines.vllm import search_fp8 as V
from kvcal.errors import KvcalError
from kvcal.formats.fp8 import get_fp8_format
from kvcal.search.objectives import SequenceCache
from kvcal.search.static_scales import candidate_scales

REPO = Path(__file__).resolve().parents[2]
CHAT = REPO / "calibration_sets" / "chat.jsonl"
EPS32 = 2.0 ** -24  # float32 unit roundoff
E4M3 = get_fp8_format("fp8_e4m3")


# ---- float64 re-statement of what vLLM's attention scores (independent of kvcal.search) ---------------
def _codes(x: torch.Tensor, s: torch.Tensor, reciprocal: bool) -> torch.Tensor:
    """e4m3fn codes of x [H, T, D] with a per-head scale s [H] (saturating, round to nearest even: torch's
    float32 -> float8 cast after clamping; queries x·(1/s) as QuantFP8.forward_native, keys x/s)."""
    s32 = s.float().view(-1, 1, 1)
    y = x.float() * (1.0 / s32) if reciprocal else x.float() / s32
    return y.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).double()


def _kl64(q, k, scaling, qs=None, ks=None, qpos=None):
    """Σ_queries KL(P ‖ P̂) per KV head in float64: P exact softmax(q·kᵀ·scaling) causal; P̂ from FP8 codes
    with both scales folded into the softmax scale (FlashInfer bmm1_scale = sm_scale·q_scale·k_scale).
    qs/ks: per KV head [H_kv] or None (unquantized). Also returns the per-query bound terms."""
    Hq, T, D = q.shape
    Hkv = k.shape[0]
    G = Hq // Hkv
    qpos = torch.arange(T) if qpos is None else qpos
    qq = _codes(q, qs.repeat_interleave(G), True) if qs is not None else q.double()
    kk = _codes(k, ks, False) if ks is not None else k.double()
    f = torch.full((Hkv,), float(scaling), dtype=torch.float64)
    if qs is not None:
        f = f * qs.double()
    if ks is not None:
        f = f * ks.double()
    mask = torch.arange(T)[None, :] > qpos[:, None]
    out = torch.zeros(Hkv, dtype=torch.float64)
    absmax_score = torch.zeros(Hkv, dtype=torch.float64)
    for h in range(Hkv):
        for g in range(G):
            j = h * G + g
            s_ref = (q[j, qpos].double() @ k[h].double().T * scaling).masked_fill(mask, -math.inf)
            s_hat = (qq[j, qpos] @ kk[h].T * f[h]).masked_fill(mask, -math.inf)
            lp, lph = torch.log_softmax(s_ref, -1), torch.log_softmax(s_hat, -1)
            p = lp.exp()
            out[h] += (p * (lp - lph).masked_fill(mask, 0.0)).sum()
            absmax_score[h] = max(absmax_score[h], float((q[j, qpos].double().abs() @ k[h].double().abs().T).max()
                                                         * scaling), float((qq[j, qpos].abs() @ kk[h].abs().T).max() * f[h]))
    return out, absmax_score


def _bound(absmax_score, n_queries, T, D):
    """float32 error bound of kvcal's per-head Σ KL (u = 2^-24). Each score is a D-term float32 dot product
    and 2 multiplications: |Δs| <= (D+2)·u·S, S = max Σ|terms| (reference and quantized scores alike), and
    KL(P‖P̂) moves by at most 2·max|Δs| per query (|∂KL/∂s_j| = |p̂_j − p_j|, Σ <= 2) for each side. float32
    log_softmax(x) = x − m − log Σ exp(x − m) errs per log-probability by at most u·(2S + log T + 1) + (T+2)·u
    (subtraction, log, the sum's relative error), weighted by P (Σ P = 1), for both log-probabilities."""
    ds = (D + 2) * EPS32 * absmax_score
    lp = EPS32 * (2 * absmax_score + math.log(T) + 1) + (T + 2) * EPS32
    return n_queries * (2 * 2 * ds + 2 * lp) + 1e-12


def _case(seed, Hq=4, Hkv=2, T=24, D=8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(Hq, T, D, generator=g) * torch.linspace(0.5, 1500.0, D)  # past e4m3's 448 at q_scale 1.0
    k = torch.randn(Hkv, T, D, generator=g) * torch.linspace(0.2, 0.0004, D)
    v = torch.randn(Hkv, T, D, generator=g)
    return q, k, v


def test_joint_kl_matches_float64_restatement():
    """joint_key_kl with FP8 queries and/or keys (per-KV-head scales, unity, or one side exact) equals the
    float64 re-statement _kl64 within the derived float32 bound _bound."""
    q, k, v = _case(0)
    c = SequenceCache(q, k, v, 0.35, None)
    for qs, ks in ((torch.tensor([0.013, 0.02]), torch.tensor([0.009, 0.011])), (torch.ones(2), torch.ones(2)),
                   (None, torch.tensor([0.004, 0.03])), (torch.tensor([0.5, 0.05]), None)):
        got = V.joint_key_kl(c, V.query_codes(q, qs) if qs is not None else None, qs,
                             V.key_codes(k, ks) if ks is not None else None, ks)
        ref, amx = _kl64(q, k, 0.35, qs, ks)
        tol = _bound(amx, 2 * 24, 24, 8)
        assert torch.all((got - ref).abs() <= tol), (got, ref, tol)
        assert bool((ref > 0).all())  # the case quantizes something visible


def test_query_codes_are_the_emulation_codes():
    """query_codes recovers exactly the e4m3 codes of vllm_dtypes.query_fp8_fake_quant (codes · scale)."""
    q, _, _ = _case(1)
    qs = torch.tensor([0.011, 0.3])
    ref = _codes(q, qs.repeat_interleave(2), True).float()
    assert torch.equal(V.query_codes(q, qs), ref)


@pytest.mark.parametrize("per_head", [False, True])
def test_query_scale_search_is_the_float64_argmin(per_head):
    """choose_query_scale (per tensor and per KV head) picks a float64 minimizer of the summed KL over the
    candidate scales, up to both candidates' float32 bounds, and beats the unity scale."""
    seqs = [_case(s) for s in (2, 3)]
    caches = [SequenceCache(q, k, v, 0.35, None) for q, k, v in seqs]
    qa = V.group_absmax(torch.stack([q.abs().amax(dim=(1, 2)) for q, _, _ in seqs]).amax(0), 2)
    ch = V.choose_query_scale(caches, [], qa, None, per_head)
    amax = qa.double() if per_head else qa.double().max().expand(2)
    labels, cands = candidate_scales(amax, E4M3, "k")
    tot = torch.zeros(len(labels), 2, dtype=torch.float64)
    tol = torch.zeros(len(labels), 2, dtype=torch.float64)
    for i in range(len(labels)):
        for q, k, _ in seqs:
            r, amx = _kl64(q, k, 0.35, cands[i].float(), None)
            tot[i] += r
            tol[i] += _bound(amx, 2 * 24, 24, 8)
    # FP8 is scale-free between powers of two, so candidates can tie exactly (headroom 2 and 4 = absmax x 2^n):
    # the choice must be a float64 minimizer up to both candidates' float32 bounds
    chosen = [labels.index(lab) for lab in ch.label]
    if per_head:
        for h in range(2):
            j = int(tot[:, h].argmin())
            assert float(tot[chosen[h], h] - tot[j, h]) <= float(tol[chosen[h], h] + tol[j, h])
            assert float(tot[1, h] - tot[chosen[h], h]) > float(tol[1, h] + tol[chosen[h], h])  # unity loses
        assert torch.equal(ch.scale, cands.gather(0, torch.tensor(chosen)[None])[0].float())
    else:
        tot1, tol1 = tot.sum(1), tol.sum(1)
        j = int(tot1.argmin())
        assert float(tot1[chosen[0]] - tot1[j]) <= float(tol1[chosen[0]] + tol1[j])
        assert float(tot1[1] - tot1[chosen[0]]) > float(tol1[1] + tol1[chosen[0]])  # unity loses
        assert float(ch.scale) == float(cands[chosen[0], 0].float())
    assert ch.label != ["unity"] * len(ch.label)  # these queries (|q| << 448) want a calibrated scale


def _constructed():
    """Channels 0-3: large queries (5..15), small keys (0.02..0.08). Channels 4-7: queries 1e-4..4e-4 (FP8 at
    q_scale 1.0 rounds them to 0: below half the smallest subnormal 2^-9), keys 500..2000. With exact queries
    channels 4-7 carry half the scores; with vLLM's queries at q_scale 1.0 they carry none, so the key scale
    should serve channels 0-3 instead."""
    g = torch.Generator().manual_seed(0)
    T, D = 16, 8

    def mag(lo, hi, shape):
        m = lo + (hi - lo) * torch.rand(shape, generator=g)
        return m * torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)

    q = torch.cat([mag(5, 15, (1, T, 4)), mag(1e-4, 4e-4, (1, T, 4))], -1)
    k = torch.cat([mag(0.02, 0.08, (1, T, 4)), mag(500, 2000, (1, T, 4))], -1)
    return q, k, torch.randn(1, T, D, generator=g)


def test_key_search_changes_its_choice_when_queries_are_fp8():
    """On a constructed case the key-scale choice is the float64 argmin both with exact and with FP8
    queries (q_scale 1), the two choices differ, and the query-blind one has a larger float64 KL under FP8 queries."""
    q, k, v = _constructed()
    assert float(_codes(q, torch.ones(1), True)[..., 4:].abs().max()) == 0.0  # the premise
    c = SequenceCache(q, k, v, 1.0, None)
    amax = k.abs().amax(dim=(1, 2))
    exact = V.choose_key_scale([c], [], amax, None, False)
    fp8q = V.choose_key_scale([c], [], amax, torch.ones(1), False)
    labels, cands = candidate_scales(amax.double(), E4M3, "k")
    for qs, ch in ((None, exact), (torch.ones(1), fp8q)):
        kl = [_kl64(q, k, 1.0, qs, cands[i].float()) for i in range(len(labels))]
        tot = torch.stack([r for r, _ in kl]).sum(1)
        tol = torch.tensor([float(_bound(a, 16, 16, 8).sum()) for _, a in kl], dtype=torch.float64)
        srt = tot.sort()
        assert float(srt.values[1] - srt.values[0]) > float(tol[srt.indices[0]] + tol[srt.indices[1]])
        assert ch.label == [labels[int(srt.indices[0])]]
    assert exact.label != fp8q.label
    # the query-blind choice is measurably worse for what vLLM serves
    r_exact, a1 = _kl64(q, k, 1.0, torch.ones(1), exact.scale)
    r_fp8, a2 = _kl64(q, k, 1.0, torch.ones(1), fp8q.scale)
    assert float(r_exact.sum() - r_fp8.sum()) > float(_bound(a1, 16, 16, 8).sum() + _bound(a2, 16, 16, 8).sum())


@pytest.mark.parametrize("kw,msg", [
    (dict(engine="vllm"), "--engine vllm needs --kv-cache-dtype"),
    (dict(kv_cache_dtype="fp8"), "applies with --engine vllm"),
    (dict(engine="sglang", kv_cache_dtype="fp8"), "--engine 'sglang'"),
    (dict(engine="vllm", kv_cache_dtype="fp9"), "unknown or unemulated vLLM --kv-cache-dtype"),
    (dict(engine="vllm", kv_cache_dtype="int4_per_token_head"), "kvcal evaluate --vllm-dtype int4_per_token_head"),
    (dict(engine="vllm", kv_cache_dtype="fp8", preset="int4"), "--preset conflicts"),
    (dict(engine="vllm", kv_cache_dtype="fp8", format="fp8_e5m2"), "--format conflicts"),
])
def test_engine_options_are_checked_in_one_line(kw, msg):
    """CalibrateConfig refuses each bad --engine/--kv-cache-dtype combination (missing dtype, no engine,
    sglang, fp9, int4_per_token_head, --preset/--format beside it) with a one-line KvcalError."""
    from kvcal.calibrate import CalibrateConfig

    with pytest.raises(KvcalError, match=msg) as e:
        CalibrateConfig(corpus="x.jsonl", **kw)
    assert "\n" not in str(e.value)


# ---- end to end on a tiny random Llama -----------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm_tokenizer):
    return save_tiny_llama(tmp_path_factory, smollm_tokenizer, "tiny-llama-vllm", vocab_size=49152, **TINY_LLAMA_16)


@pytest.fixture(scope="module", params=["tensor", "head"])
def vllm_artifact(request, tiny_dir, tmp_path_factory):
    from kvcal.calibrate import CalibrateConfig, calibrate

    out = tmp_path_factory.mktemp("art") / request.param
    cfg = CalibrateConfig(corpus=str(CHAT), out=str(out), model=str(tiny_dir), max_samples=12, max_seq_len=96,
                          batch_size=2, reservoir=3, heldout_reservoir=2, max_queries=16, granularity=request.param,
                          engine="vllm", kv_cache_dtype="fp8")
    calibrate(cfg, log=lambda s: None, progress=False)
    return out, request.param


def test_artifact_records_q_scale(vllm_artifact):
    """The vllm fp8 artifact holds a float32 q_scale per layer ([1] or [H_kv, 1, 1]) equal to the metadata,
    each one of the candidate scales on the recorded query absmax, and the vllm section names engine and dtype."""
    from kvcal.artifact import load_artifact

    out, gran = vllm_artifact
    art = load_artifact(out)
    meta = art.metadata
    for i in range(2):
        t = art.tensors[f"model.layers.{i}.self_attn.q_scale"]
        assert t.dtype == torch.float32 and tuple(t.shape) == ((1,) if gran == "tensor" else (2, 1, 1))
        assert t.reshape(-1).tolist() == pytest.approx(meta["vllm"]["q_scale"][i], rel=0, abs=0)
        assert meta["layers"][i]["q"]["scale"] == meta["vllm"]["q_scale"][i]
        # the chosen scale is one of the candidates on the recorded query absmax
        amax = torch.tensor(meta["layers"][i]["q"]["amax"], dtype=torch.float64)
        _, cands = candidate_scales(amax, E4M3, "k")
        for h, x in enumerate(t.reshape(-1).tolist()):  # per head: each head's own candidate
            assert x in cands[:, h].float().tolist()
    assert meta["vllm"]["engine"] == "vllm" and meta["vllm"]["kv_cache_dtype"] == "fp8"
    assert meta["vllm"]["skip_layers"] == []
    assert "per " + ("tensor" if gran == "tensor" else "KV-head group") in meta["vllm"]["query_quantization"]


def test_artifact_validator_refuses_bad_q_scale(vllm_artifact, tmp_path):
    """An artifact whose q_scale tensor has shape [3] is refused by load_artifact with an ArtifactError
    naming the shape."""
    from helpers.export import edited_copy

    from kvcal.artifact import load_artifact
    from kvcal.errors import ArtifactError

    out, _ = vllm_artifact
    bad = edited_copy(out, tmp_path / "bad",
                      lambda m, t: t.__setitem__("model.layers.0.self_attn.q_scale", torch.ones(3)))
    with pytest.raises(ArtifactError, match="q_scale has shape \\[3\\]"):
        load_artifact(bad)


def test_export_vllm_writes_q_scale_and_inspect_shows_it(vllm_artifact, tiny_dir, tmp_path):
    """vllm export writes q_scale (per tensor, or per query head whose group max is the artifact's) with the
    matching kv_cache_scheme strategy; inspect shows the same Q scales for the export and the artifact."""

    from kvcal.artifact import load_artifact
    from kvcal.export import export
    from kvcal.inspect import inspect_path, render

    out, gran = vllm_artifact
    art = load_artifact(out)
    res = export(out, "vllm", tmp_path / "ckpt", model_dir=tiny_dir)
    d = Path(res.out) if hasattr(res, "out") else tmp_path / "ckpt"
    tensors = safetensors_dir(d)
    cfg = json.loads((d / "config.json").read_text())
    scheme = cfg["quantization_config"]["kv_cache_scheme"]
    assert scheme["strategy"] == ("tensor" if gran == "tensor" else "attn_head")
    for i in range(2):
        q = tensors[f"model.layers.{i}.self_attn.q_scale"]  # vLLM default rule: .q_scale -> .attn.q_scale
        a = art.tensors[f"model.layers.{i}.self_attn.q_scale"].reshape(-1)
        if gran == "tensor":
            assert tuple(q.shape) == (1,) and torch.equal(q, a)
        else:  # [num_heads, 1, 1]; vLLM's attn_head loader takes the max of each group of 2 query heads
            assert tuple(q.shape) == (4, 1, 1)
            assert torch.equal(q.reshape(-1).view(2, 2).amax(1), a)
    ins = inspect_path(d)
    assert [r["q"] for r in ins.layers] == [tensors[f"model.layers.{i}.self_attn.q_scale"].reshape(-1).tolist()
                                            for i in range(2)]
    txt = render(ins)
    assert "Q scale" in txt
    ins_a = inspect_path(out)
    assert [r["q"] for r in ins_a.layers] == [art.tensors[f"model.layers.{i}.self_attn.q_scale"].reshape(-1).tolist()
                                              for i in range(2)]
    assert "Q scale" in render(ins_a) and "--kv-cache-dtype fp8" in render(ins_a)


def test_disclosure_report_states_engine_and_q_scale(vllm_artifact):
    """The disclosure report states the engine, dtype, no skipped layers, the static fp8 query scale and
    its max, and drops the 'queries stay unquantized' sentence."""
    from kvcal.artifact import load_artifact
    from kvcal.report.disclosure import build_report
    from kvcal.report.document import to_markdown

    out, gran = vllm_artifact
    art = load_artifact(out)
    md = to_markdown(build_report(art.metadata, figures=False), figure_dir=None)
    assert "Engine: **vllm** 0.33.0 with `--kv-cache-dtype fp8`" in md
    assert "none (every layer quantized)" in md
    assert "Query quantization: **fp8_e4m3 static q_scale" in md
    qs = [x for r in art.metadata["vllm"]["q_scale"] for x in r]
    assert f"max {max(qs):.4g}" in md
    assert "Queries and all other activations stay" not in md


def test_evaluate_vllm_row_uses_the_artifacts_q_scale(vllm_artifact, tiny_dir, tmp_path):
    """`kvcal evaluate --vllm-dtype fp8` on a vllm artifact records in its JSON notes that the vLLM row uses
    the artifact's q_scale (the note only; the figure is not recomputed here)."""
    from click.testing import CliRunner

    from kvcal.cli import main

    out, gran = vllm_artifact
    if gran == "head":
        pytest.skip("one granularity is enough for the routing")
    j = tmp_path / "ev.json"
    r = CliRunner().invoke(main, ["evaluate", "--artifact", str(out), "--corpus", str(CHAT), "--model", str(tiny_dir),
                                  "--context", "48", "--windows", "1", "--mode", "teacher_forced", "--no-baselines", "--vllm-dtype", "fp8",
                                  "--json", str(j), "--quiet"])
    assert r.exit_code in (0, 1), r.output
    ev = json.loads(j.read_text())
    assert any("the artifact's q_scale (calibrate --engine vllm)" in n for n in ev["notes"])
