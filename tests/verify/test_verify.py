"""``kvcal verify`` without an engine: the agreement interval, the checkpoint reader, the scale-free view,
and every refusal that comes before the engine starts (or from an interpreter that is not an engine)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers.models import save_tiny_llama
from safetensors.torch import save_file

from kvcal.cli import main
from kvcal.errors import KvcalError
from kvcal.verify import agreement, check_accept, cpu_fp8_support, no_scale_view, read_checkpoint

TINY = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=256, vocab_size=49152)  # head_dim 32: servable by vLLM's CPU backend
SCHEME = {"quant_method": "compressed-tensors", "format": "dense", "quantization_status": "frozen",
          "config_groups": {}, "ignore": [], "kv_cache_scheme": {"num_bits": 8, "type": "float", "symmetric": True,
                                                                 "group_size": None, "strategy": "tensor",
                                                                 "dynamic": False}}


def test_agreement_is_the_paired_t_interval():
    """d = served − predicted = [0, 1, 2]: mean 1, sd 1; t_{0.995, 2} = 9.925 (published t table), so the
    99% half-width is 9.925/√3 = 5.730; a floor adds to it."""
    a = agreement([1.0, 2.0, 3.0], [1.0, 1.0, 1.0])
    assert a["diff"] == 1.0 and abs(a["tol"] - 9.925 / math.sqrt(3)) < 1e-3 and a["ok"]
    b = agreement([1.0, 2.0, 3.0], [1.0, 1.0, 1.0], floor=0.5)
    assert abs(b["tol"] - a["tol"] - 0.5) < 1e-12
    # a bias that every window shares is not absorbed: d = [1.0, 1.01, 0.99, 1.0] → tol ≈ 5.84·0.0082/2 = 0.024
    c = agreement([2.0, 2.01, 1.99, 2.0], [1.0, 1.0, 1.0, 1.0])
    assert c["diff"] == pytest.approx(1.0) and c["tol"] < 0.03 and not c["ok"]


def test_cpu_fp8_support_reads_the_flags():
    """cpu_fp8_support reads /proc/cpuinfo's flags line: None (served) with avx512f or with amx_tile, and on an
    AVX2-only CPU a reason saying it has neither AVX-512 nor AMX."""
    assert cpu_fp8_support("flags\t: fpu sse2 avx2 avx512f avx512bw\n") is None
    assert cpu_fp8_support("flags\t: fpu amx_tile amx_bf16\n") is None
    why = cpu_fp8_support("flags\t: fpu sse2 avx avx2 fma\n")
    assert "neither AVX-512 nor AMX" in why


def test_accept_limited_to_what_verify_measures():
    """verify's --accept parses measured metrics into (metric, op, bound) clauses in order, refuses greedy_agree naming
    the metrics verify measures, and refuses a bar that can never pass (kl_mean<=-1) naming it."""
    assert check_accept("kl_mean<=1e-2,delta_ppl<=0.2") == [("kl_mean", "<=", 1e-2), ("delta_ppl", "<=", 0.2)]
    with pytest.raises(KvcalError, match=r"'greedy_agree' is not measured by verify .*verify measures ppl, delta_ppl"):
        check_accept("greedy_agree>=0.5")
    with pytest.raises(KvcalError, match="kl_mean<=-1"):
        check_accept("kl_mean<=-1")


def _checkpoint(root: Path, scales: dict | None) -> Path:
    d = root / "ckpt"
    d.mkdir()
    w = {"model.embed_tokens.weight": torch.zeros(4, 2)}
    save_file(w, str(d / "model-00001-of-00001.safetensors"))
    cfg = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
           "num_attention_heads": 2, "max_position_embeddings": 256}
    wm = dict.fromkeys(w, "model-00001-of-00001.safetensors")
    if scales is not None:
        cfg["quantization_config"] = SCHEME
        save_file({k: torch.tensor([v]) for k, v in scales.items()}, str(d / "kvcal-kv-scales.safetensors"))
        wm.update(dict.fromkeys(scales, "kvcal-kv-scales.safetensors"))
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    (d / "tokenizer.json").write_text("{}")
    return d


def test_read_checkpoint_and_its_scale_free_view(tmp_path):
    """read_checkpoint on a compressed-tensors FP8 checkpoint reads dtype fp8, 2 layers, head_dim 32 (hidden 64 / 2
    heads), each layer's k_scale and v_scale and no q_scale; no_scale_view makes a directory of the same files less the
    scale shard: config.json without quantization_config, an index listing only the weights, the weight shard a
    symlink."""
    s = {f"model.layers.{i}.self_attn.{x}_scale": 0.01 * (i + 1) + (x == "v") for i in range(2) for x in "kv"}
    ck = read_checkpoint(str(_checkpoint(tmp_path, s)))
    assert ck.kv_cache_dtype == "fp8" and ck.num_layers == 2 and ck.head_dim == 32
    assert ck.k_scales == [pytest.approx(0.01), pytest.approx(0.02)] and ck.v_scales[1] == pytest.approx(1.02)
    assert ck.q_scales == [None, None]
    view = no_scale_view(ck, tmp_path / "view")
    assert sorted(p.name for p in view.iterdir()) == ["config.json", "model-00001-of-00001.safetensors",
                                                      "model.safetensors.index.json", "tokenizer.json"]
    assert "quantization_config" not in json.loads((view / "config.json").read_text())
    assert list(json.loads((view / "model.safetensors.index.json").read_text())["weight_map"]) == [
        "model.embed_tokens.weight"]
    assert (view / "model-00001-of-00001.safetensors").is_symlink()


@pytest.mark.parametrize("bad, match", [
    ({"model.layers.0.self_attn.k_scale": 0.0}, r"k_scale must be one positive finite value"),
    ({"model.layers.1.self_attn.v_scale": float("nan")}, r"v_scale must be one positive finite value"),
])
def test_read_checkpoint_refuses_bad_scales(tmp_path, bad, match):
    """A k_scale of 0.0 or a NaN v_scale is refused by read_checkpoint with a KvcalError naming the scale and saying it
    must be one positive finite value."""
    with pytest.raises(KvcalError, match=match):
        read_checkpoint(str(_checkpoint(tmp_path, bad)))


def test_read_checkpoint_names_what_it_is_given(tmp_path):
    """read_checkpoint names what it was given instead of a checkpoint: a recommend output (deploy.json) or a kvcal
    artifact (kv_scales.safetensors), each with "export it first", a directory without config.json, and a checkpoint
    whose kv_cache_scheme is not per-tensor FP8 (strategy attn_head)."""
    rec = tmp_path / "rec"
    rec.mkdir()
    (rec / "deploy.json").write_text(json.dumps({"schema": "kvcal-recommend/1"}))
    with pytest.raises(KvcalError, match="is a kvcal recommend output, not a checkpoint; export it first"):
        read_checkpoint(str(rec))
    with pytest.raises(KvcalError, match="has no config.json"):
        read_checkpoint(str(tmp_path))
    art = tmp_path / "art"
    art.mkdir()
    (art / "kv_scales.safetensors").write_bytes(b"")
    with pytest.raises(KvcalError, match=r"is a kvcal artifact, not a checkpoint; export it first \(kvcal export "):
        read_checkpoint(str(art))
    d = _checkpoint(tmp_path, {"model.layers.0.self_attn.k_scale": 1.0})
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["kv_cache_scheme"]["strategy"] = "attn_head"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(KvcalError, match="is not a per-tensor FP8 scheme"):
        read_checkpoint(str(d))


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory, smollm_tokenizer):
    d = save_tiny_llama(tmp_path_factory, smollm_tokenizer, "verify-tiny", **TINY)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = SCHEME
    (d / "config.json").write_text(json.dumps(cfg))
    save_file({f"model.layers.{i}.self_attn.{x}_scale": torch.tensor([0.05]) for i in range(2) for x in "kv"},
              str(d / "kvcal-kv-scales.safetensors"))
    return d


def _verify(argv, **kw):
    return CliRunner().invoke(main, ["verify", *argv], **kw)


def test_cli_refusals_are_one_line(tiny_export, shared_data, monkeypatch, tmp_path):
    """kvcal verify exits 2 with its message on one line and no traceback for: no --engine-python, a path with no
    Python, --accept on an unmeasured metric or an unreachable bar, an unknown backend, --windows 1 (click's usage
    lines around it); each bad --skip-layers (out of range, every layer, not an index, auto, a repeat); and, on a
    CPU stubbed to lack AVX-512 and AMX, --backend vllm-cpu with that reason."""
    corpus = str(shared_data / "wikitext2_valid.txt")
    base = [str(tiny_export), "--corpus", corpus, "--context", "64", "--windows", "2"]
    cases = [
        (base, {}, "--engine-python is required"),
        ([*base, "--engine-python", str(tmp_path / "nope" / "python")], {}, "no executable Python there"),
        ([*base, "--engine-python", sys.executable, "--accept", "greedy_prefix>=4"], {},
         "'greedy_prefix' is not measured by verify"),
        ([*base, "--engine-python", sys.executable, "--accept", "top1_agree>=2"], {}, "top1_agree>=2"),
        ([*base, "--engine-python", sys.executable, "--backend", "tpu"], {}, "unknown vLLM backend 'tpu'"),
        ([*base, "--engine-python", sys.executable, "--windows", "1"], {}, "Invalid value for '--windows'"),
    ]
    for argv, env, want in cases:
        r = _verify(argv, env=env)
        lines = [ln for ln in r.output.splitlines() if ln.strip()]
        assert r.exit_code == 2 and want in r.output, (argv, r.output)
        assert all("Traceback" not in ln for ln in lines)
        # one message line (click's own usage errors add its "Usage:" / "Try ... --help" lines around it)
        assert len([ln for ln in lines if not ln.startswith(("Usage:", "Try '"))]) == 1, (argv, r.output)
    for skip, want in (("5", "--skip-layers 5: the model has 2 layers (0 to 1)"),
                       ("0,1", "at least one must stay in fp8"), ("a", "'a' is not a layer index"),
                       ("auto", "--skip-layers auto: verify serves the layers a deployment names"),
                       ("0,0", "layer 0 is named twice")):
        r = _verify([*base, "--engine-python", sys.executable, "--skip-layers", skip])
        assert r.exit_code == 2 and want in r.output and len(r.output.strip().splitlines()) == 1, r.output
    import kvcal.verify

    monkeypatch.setattr(kvcal.verify, "cpu_fp8_support", lambda: "this CPU has neither AVX-512 nor AMX; stub")
    r = _verify([*base, "--engine-python", sys.executable, "--backend", "vllm-cpu"])
    assert r.exit_code == 2 and "vLLM's CPU backend cannot serve --kv-cache-dtype fp8 here: this CPU has neither" \
        in r.output
    assert len(r.output.strip().splitlines()) == 1, r.output


def test_an_interpreter_without_vllm_is_refused_by_the_runner(tiny_export, shared_data):
    """kvcal's own Python has no vllm: the runner answers with its one-line refusal (exit 3), which verify
    reports as one line, exit 2."""
    r = _verify([str(tiny_export), "--corpus", str(shared_data / "wikitext2_valid.txt"), "--context", "64",
                 "--windows", "2", "--engine-python", sys.executable])
    assert r.exit_code == 2, r.output
    assert "error: engine refused: cannot import vllm in this Python" in r.output


def test_recommend_output_is_read_for_its_choice(tmp_path, tiny_export):
    """A recommend output: nothing chosen, a dtype vLLM-CPU does not serve, or no --model-dir are one-line refusals; a
    row at vLLM's default scales is served from --model-dir with the chosen dtype and 16-bit layers."""
    from kvcal.verify import from_recommend

    rec = tmp_path / "rec"
    rec.mkdir()

    def deploy(chosen, artifact=None):
        (rec / "deploy.json").write_text(json.dumps({"schema": "kvcal-recommend/1", "chosen": chosen,
                                                     "artifact": artifact}))

    deploy(None)
    with pytest.raises(KvcalError, match="chose no configuration"):
        from_recommend(rec, str(tiny_export), tmp_path)
    deploy({"dtype": "int8_per_token_head", "skip_layers": []})
    with pytest.raises(KvcalError, match="the chosen --kv-cache-dtype int8_per_token_head is not one verify serves"):
        from_recommend(rec, str(tiny_export), tmp_path)
    deploy({"dtype": "fp8", "skip_layers": [1]})
    with pytest.raises(KvcalError, match="pass --model-dir HF_DIR"):
        from_recommend(rec, None, tmp_path)
    assert from_recommend(rec, str(tiny_export), tmp_path, log=lambda s: None) == (str(tiny_export), "fp8", (1,))


def _fake_vllm(vocab: int, calls: list):
    """A stand-in for ``vllm`` (the runner's whole interface to it): each "engine" maps a prompt to logit rows that
    depend on the token ids and on ``kv_cache_dtype``; the model's ``logits_processor`` sees the sampling step's row
    first, then the prompt's rows (the order vLLM-CPU uses), and ``prompt_logprobs`` are the rows' log-softmax."""
    import types

    from torch import nn

    mod = types.ModuleType("vllm")
    mod.__version__ = "fake"

    class SamplingParams:
        def __init__(self, **kw):
            self.kw = kw

    class Lp:
        def __init__(self, x):
            self.logprob = x

    class Out:
        def __init__(self, plp):
            self.prompt_logprobs = plp

    def rows_for(ids, dtype):
        g = torch.Generator().manual_seed(1000 * len(ids) + int(sum(ids)) % 997)
        base = 3 * torch.randn(len(ids), vocab, generator=g)
        if dtype != "auto":
            base = base + 0.05 * torch.randn(len(ids), vocab, generator=torch.Generator().manual_seed(7 + ids[0]))
        return base

    class LLM:
        def __init__(self, model, kv_cache_dtype, **kw):
            self.dtype = kv_cache_dtype
            self.m = nn.Module()
            self.m.logits_processor = nn.Identity()
            calls.append(kv_cache_dtype)

        def apply_model(self, fn):
            return [fn(self.m)]

        def generate(self, prompts, sp, use_tqdm=False):
            ids = prompts[0]["prompt_token_ids"]
            r = rows_for(ids, self.dtype)
            self.m.logits_processor(r[-1:].clone())  # the sampling step
            self.m.logits_processor(r[:-1].clone())  # the prompt
            lp = torch.log_softmax(r[:-1].double(), -1)
            return [Out([None] + [{ids[i + 1]: Lp(float(lp[i, ids[i + 1]]))} for i in range(len(ids) - 1)])]

    mod.LLM, mod.SamplingParams, mod.rows_for = LLM, SamplingParams, rows_for
    return mod


def test_runner_streams_the_reference_and_keeps_the_kl_exact(tmp_path, monkeypatch):
    """The runner in kvcal's Python against a stand-in vLLM: with 5-position chunks and the reference's
    log-probabilities in a scratch file, every per-token NLL, KL and top-1 equals the same figures computed here at
    once over whole windows in float64 (KL(P_ref ‖ P) with P_ref stored in float32, as the runner keeps it). Every
    operation is row-wise, so the only difference allowed is float64 summation order within a row: 1e-12 relative
    (the rows' KL is ~1e-3, their sums over 300 terms carry ~1e-16 relative error each). The scratch file is gone
    afterwards."""
    import importlib.util

    from kvcal.verify import RUNNER

    calls: list = []
    vocab = 300
    fake = _fake_vllm(vocab, calls)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    spec = importlib.util.spec_from_file_location("kvcal_vllm_runner_under_test", RUNNER)
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    g = torch.Generator().manual_seed(0)
    windows = torch.randint(0, vocab, (3, 12), generator=g).tolist()
    req = {"windows": windows, "max_model_len": 12, "runs": [
        {"name": "16-bit", "model_dir": "x", "kv_cache_dtype": "auto"},
        {"name": "fp8", "model_dir": "x", "kv_cache_dtype": "fp8"}], "reference": "16-bit", "top_k": 5, "chunk_rows": 5}
    work = tmp_path / "work"
    work.mkdir()
    (work / "req.json").write_text(json.dumps(req))
    runner.main(str(work / "req.json"), str(work / "res.json"))
    assert sorted(p.name for p in work.iterdir()) == ["req.json", "res.json"]  # no scratch file left
    res = json.loads((work / "res.json").read_text())
    assert calls == ["auto", "fp8"]
    for wi, w in enumerate(windows):
        tgt = torch.tensor(w[1:])
        lr = torch.log_softmax(fake.rows_for(w, "auto")[:-1].double(), -1)
        lp = torch.log_softmax(fake.rows_for(w, "fp8")[:-1].double(), -1)
        lr32 = lr.float().double()
        kl = (lr32.exp() * (lr32 - lp)).sum(-1)
        got = res["runs"]["fp8"]
        assert got["kl"][wi] == pytest.approx(kl.tolist(), rel=1e-12, abs=0)
        assert got["nll"][wi] == pytest.approx((-lp.gather(-1, tgt[:, None])[:, 0]).tolist(), rel=1e-12, abs=0)
        assert got["top1"][wi] == (lr32.argmax(-1) == lp.argmax(-1)).int().tolist()
        assert res["runs"]["16-bit"]["nll"][wi] == pytest.approx((-lr.gather(-1, tgt[:, None])[:, 0]).tolist(),
                                                                rel=1e-12, abs=0)
    assert min(min(r) for r in res["runs"]["fp8"]["kl"]) > 0
    assert res["runs"]["fp8"]["align_max_abs"] < 1e-12


def test_prediction_chunks_give_the_whole_window_figures():
    """predict() in chunks of 4 positions equals the same figures computed here over whole windows (float32
    log-softmax, float64 reductions), on a tiny random model with a quantizing plan: row-wise operations, so equal
    up to float64 summation order (1e-12 relative)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvcal.engines.vllm.plan import VllmKVPlan
    from kvcal.evaluate.protocol_a import protocol_a_logits
    from kvcal.verify import predict

    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     num_key_value_heads=1, vocab_size=97, max_position_embeddings=64)).eval()
    wins = torch.randint(0, 97, (2, 11))
    plan = VllmKVPlan("fp8", 2, backend="cpu")
    got = predict(m, wins, {"p": plan}, chunk_rows=4)
    with torch.no_grad():
        for wi, w in enumerate(wins):
            tgt = w[1:]
            lr = torch.log_softmax(protocol_a_logits(m, w[None], None)[0].float(), -1).double()
            lp = torch.log_softmax(protocol_a_logits(m, w[None], plan)[0].float(), -1).double()
            kl = (lr.exp() * (lr - lp)).sum(-1)
            assert got["p"]["kl"][wi] == pytest.approx(kl.tolist(), rel=1e-12, abs=1e-18)
            assert got["p"]["nll"][wi] == pytest.approx((-lp.gather(-1, tgt[:, None])[:, 0]).tolist(), rel=1e-12)
            assert got["16-bit"]["nll"][wi] == pytest.approx((-lr.gather(-1, tgt[:, None])[:, 0]).tolist(), rel=1e-12)
            assert got["p"]["top1"][wi] == (lr.argmax(-1) == lp.argmax(-1)).int().tolist()
    assert max(max(r) for r in got["p"]["kl"]) > 0


# ---- the served gain over vLLM's default scales (issue 38) ------------------------------------------------------


def _run(kl: list[list[float]], nll: list[list[float]]) -> dict:
    return {"kl": kl, "nll": nll}


def test_served_gain_is_the_paired_t_interval_by_hand():
    """served_gain on three hand-made windows: per-window mean KL differences (-0.1, -0.2, -0.1), their mean and 99%
    Student-t interval (scipy's t quantile, 2 dof, recomputed here), the ratio to the default's mean KL with the
    interval divided by that mean, ΔPPL = PPL16 (e here: every 16-bit NLL is 1) x the per-window mean-NLL
    differences; the interval contains 0, so the verdict is inconclusive, with the windows that would decide it."""
    import statistics

    from scipy.stats import t

    from kvcal.verify.figures import served_gain, windows_to_decide

    ref = _run([[0, 0]] * 3, [[1.0, 1.0]] * 3)
    ck = _run([[0.1, 0.1], [0.2, 0.2], [0.3, 0.3]], [[1.5, 1.5], [1.0, 1.0], [1.25, 1.25]])
    df = _run([[0.2, 0.2], [0.4, 0.4], [0.3, 0.5]], [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    g = served_gain(ck, df, ref)
    d = [-0.1, -0.2, -0.1]
    m, sd = statistics.fmean(d), statistics.stdev(d)
    h = t.ppf(0.995, 2) * sd / math.sqrt(3)
    assert math.isclose(g["kl_diff"], m, rel_tol=1e-12)
    assert all(math.isclose(a, b, rel_tol=1e-12) for a, b in zip(g["kl_diff_ci"], [m - h, m + h], strict=True))
    base = (0.2 + 0.4 + 0.4) / 3
    assert math.isclose(g["kl_ratio"], 0.2 / base, rel_tol=1e-12)
    assert math.isclose(g["kl_ratio_ci"][0], 1 + (m - h) / base, rel_tol=1e-12)
    dp = [math.e * 0.5, 0.0, math.e * 0.25]
    assert math.isclose(g["dppl_diff"], statistics.fmean(dp), rel_tol=1e-12)
    assert g["verdict"] == "inconclusive" and g["windows_needed"] == windows_to_decide(m, sd, 3)
    n = g["windows_needed"]  # the least N whose interval would exclude 0 at this mean and spread
    assert t.ppf(0.995, n - 1) * sd / math.sqrt(n) < abs(m) <= t.ppf(0.995, n - 2) * sd / math.sqrt(n - 1)


@pytest.mark.parametrize("shift, verdict", [(-0.1, "PASS"), (0.1, "FAIL")])
def test_served_gain_decides_when_the_interval_excludes_zero(shift, verdict):
    """Eight windows whose KL differs from the default's by shift ± 0.01: the 99% interval (half-width below 0.02)
    excludes 0, so a lower KL passes and a higher one fails (the checkpoint serves worse than no scales); a ΔPPL
    worse beyond its interval fails even where the KL is lower."""
    from kvcal.verify.figures import gain_line, served_gain

    n = 8
    ref = _run([[0.0]] * n, [[1.0]] * n)
    df = _run([[0.5]] * n, [[1.0]] * n)
    ck = _run([[0.5 + shift + (0.01 if w % 2 else -0.01)] for w in range(n)], [[1.0]] * n)
    g = served_gain(ck, df, ref)
    assert g["verdict"] == verdict and g["windows_needed"] is None
    assert ("PASS" if shift < 0 else "FAIL") in gain_line(g)
    worse_ppl = _run(ck["kl"], [[1.1 + (0.001 if w % 2 else 0)] for w in range(n)])
    assert served_gain(worse_ppl, df, ref)["verdict"] == "FAIL"


def test_render_prints_the_gain_and_what_the_cpu_backend_gains():
    """verify's text prints the served-gain line with its interval, and on the CPU backend one sentence saying
    which gain to expect there (truncation) and which calibration searches for it."""
    from kvcal.verify import render
    from kvcal.verify.figures import served_gain

    ref = _run([[0.0]] * 4, [[1.0]] * 4)
    g = served_gain(_run([[0.1]] * 4, [[1.0]] * 4), _run([[0.2]] * 4, [[1.0]] * 4), ref)
    doc = {"engine": {"vllm_version": "0.32.0", "attention_impl": ["CPUAttentionBackendImpl"], "backend": "cpu"},
           "corpus": {"windows": 4, "context": 64, "path": "c.txt"}, "rows": [], "accept": "kl_mean<=0.1",
           "reference": {"served_16bit_ppl": 2.0, "predicted_16bit_ppl": 2.0}, "scales_applied": [],
           "confidence": 0.99, "passed": True, "served_gain": g}
    text = render(doc)
    line = next(x for x in text.splitlines() if x.startswith("served gain over vLLM's default scales"))
    assert "KL 0.500x [0.500x, 0.500x]" in line and line.endswith(": PASS")
    assert "truncation" in text and "--backend cpu" in text


def test_served_equals_predicted_that_cannot_tell_the_write_paths_apart_is_inconclusive():
    """resolve_check (issue 40, class 4): a tolerance not below the difference between the two write paths'
    predictions cannot catch a wrong write path, so it is undecided, with the least window count whose tolerance
    (t quantile at that count x the per-window spread recovered from the tolerance, + the floor) falls below it;
    a tolerance below it is decided; a floor at or above it can never decide."""
    from scipy.stats import t

    from kvcal.verify.figures import resolve_check

    sd, n, floor = 0.02, 2, 0.001
    tol = t.ppf(0.995, n - 1) * sd / math.sqrt(n) + floor  # what agreement() gives for 2 windows of spread sd
    ag = resolve_check({"diff": 0.0, "tol": tol, "ok": True}, 0.01, n, floor)
    assert not ag["decided"] and ag["resolve"] == 0.01
    k = ag["windows_needed"]
    assert t.ppf(0.995, k - 1) * sd / math.sqrt(k) + floor < 0.01 <= t.ppf(0.995, k - 2) * sd / math.sqrt(k - 1) + floor
    assert resolve_check({"diff": 0.0, "tol": 0.001, "ok": True}, 0.01, 8)["decided"]
    assert resolve_check({"diff": 0.0, "tol": 0.02, "ok": True}, 0.01, 8, floor=0.01)["windows_needed"] is None


def test_render_says_inconclusive_instead_of_pass():
    """A row whose agreement is undecided prints `inconclusive` in the served = predicted column, a note with the
    tolerances, the write-path difference and the windows that would decide, and verify's last line says
    inconclusive, not PASS."""
    from kvcal.verify import render

    srv = {"delta_ppl": 0.1, "kl_mean": 0.01}
    row = {"run": "fp8 checkpoint scales", "kv_cache_dtype": "fp8", "scales": "checkpoint", "served": srv,
           "predicted": srv, "accept": "PASS", "failed": [], "agree": True, "agreement": "inconclusive",
           "ppl_agreement": {"diff": 0.0, "tol": 11.4, "resolve": 0.4, "windows_needed": 40},
           "kl_agreement": {"diff": 0.0, "tol": 5.7e-2, "resolve": 1.4e-2, "windows_needed": 30}}
    doc = {"engine": {"vllm_version": "0.32.0", "attention_impl": ["CPUAttentionBackendImpl"], "backend": "cpu"},
           "corpus": {"windows": 2, "context": 64, "path": "c.txt"}, "rows": [row], "accept": "kl_mean<=0.1",
           "reference": {"served_16bit_ppl": 2.0, "predicted_16bit_ppl": 2.0}, "scales_applied": [],
           "confidence": 0.99, "passed": False, "verdict": "inconclusive", "served_gain": None}
    text = render(doc)
    assert "| PASS | inconclusive |" in text
    assert "about 40 windows would decide it" in text
    assert text.splitlines()[-1] == "verify: inconclusive"


#: vLLM 0.32's refusal of a max_model_len above the model's (a pydantic ValidationError of its ModelConfig)
VLLM_MAX_LEN = ("User-specified max_model_len ({n}) is greater than the derived max_model_len "
                "(max_position_embeddings=256.0 or model_max_length=None in model's config.json). To allow overriding "
                "this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. VLLM_ALLOW_LONG_MAX_MODEL_LEN must be "
                "used with extreme caution.")

FAKE_ENGINE = '''#!{python}
"""A stand-in engine Python: the real runner, with a vllm whose LLM refuses as vLLM's ModelConfig does."""
import runpy, sys, types
import pydantic


class ModelConfig(pydantic.BaseModel):
    model: str
    max_model_len: int

    @pydantic.field_validator("max_model_len")
    @classmethod
    def limit(cls, v):
        raise ValueError({msg!r}.format(n=v))


class LLM:
    def __init__(self, model, max_model_len, **kw):
        ModelConfig(model=model, max_model_len=max_model_len)


vllm = types.ModuleType("vllm")
vllm.__version__, vllm.LLM, vllm.SamplingParams = "fake", LLM, object
sys.modules["vllm"] = vllm
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def test_an_engine_configuration_error_names_the_kvcal_setting(tiny_export, shared_data, tmp_path):
    """The engine refuses its configuration with pydantic's ValidationError, whose text is an argument dump holding
    verify's temporary model path and ends in a link to pydantic's documentation: verify's one line gives the
    engine's own sentence (max_model_len 65), names the checkpoint as given (never the temporary directory, gone
    by then) and the kvcal option behind vLLM's max_model_len with its fix, and drops the engine's advice to set
    VLLM_ALLOW_LONG_MAX_MODEL_LEN."""
    py = tmp_path / "engine-python"
    py.write_text(FAKE_ENGINE.format(python=sys.executable, msg=VLLM_MAX_LEN))
    py.chmod(0o755)
    r = _verify([str(tiny_export), "--corpus", str(shared_data / "wikitext2_valid.txt"), "--context", "64",
                 "--windows", "2", "--engine-python", str(py)])
    assert r.exit_code == 2, r.output
    err = r.output.strip().splitlines()[-1]
    assert err == (f"error: engine refused: vLLM fake cannot serve {tiny_export} without its k/v scales with "
                   "--kv-cache-dtype auto: ValidationError: " + VLLM_MAX_LEN.format(n=65).split(". To allow")[0]
                   + "; vLLM's max_model_len is --context + 1 = 65 (each window and the one token it generates): "
                     "use a smaller --context"), err


def test_name_setting_cuts_the_engine_advice_and_names_the_option():
    """The sentence naming the engine argument is kept, what follows it is replaced by kvcal's sentence; a message
    naming no argument of ``settings`` (kv_cache_dtype is not kv_cache_dtype_skip_layers) is unchanged."""
    from kvcal.verify import name_setting

    msg = "engine refused: x: ValueError: " + VLLM_MAX_LEN.format(n=257)
    assert name_setting(msg, {"max_model_len": "S"}) == msg.split(". To allow")[0] + "; S"
    assert name_setting("bad max_model_len.", {"max_model_len": "S"}) == "bad max_model_len; S"
    other = "ValueError: kv_cache_dtype fp8 is not supported."
    assert name_setting(other, {"kv_cache_dtype_skip_layers": "S"}) == other


def test_a_context_the_engine_cannot_serve_is_refused_before_it_starts(tiny_export, shared_data):
    """The engine serves each window plus the one token it generates (max_model_len = --context + 1): --context 256
    on a model with max_position_embeddings 256 is refused before the engine starts, naming the largest that fits;
    --context 255 gets past that check to the engine (kvcal's own Python, which has no vllm)."""
    base = [str(tiny_export), "--corpus", str(shared_data / "wikitext2_valid.txt"), "--windows", "2",
            "--engine-python", sys.executable]
    r = _verify([*base, "--context", "256"])
    assert r.exit_code == 2 and r.output.strip() == (
        "error: --context 256: the engine serves each window and the one token it generates (257 positions), beyond "
        "the model's max_position_embeddings 256; use --context 255 or less"), r.output
    r = _verify([*base, "--context", "255"])
    assert r.exit_code == 2 and "engine refused: cannot import vllm in this Python" in r.output, r.output


def test_e5m2_on_an_e4m3_checkpoint_is_refused_before_the_engine_starts(tiny_export, shared_data, tmp_path):
    """vLLM refuses fp8_e5m2 for a checkpoint that declares a kv_cache_scheme (its attention layer, as it starts):
    verify says so in one line before starting it (no 'engine:' line, no note that it serves it "as vLLM would"),
    naming the fix; the same model without the scheme (verify's own scale-free view) gets past that check to the
    engine (kvcal's own Python, which has no vllm)."""
    base = ["--corpus", str(shared_data / "wikitext2_valid.txt"), "--context", "64", "--windows", "2",
            "--engine-python", sys.executable, "--kv-cache-dtype", "fp8_e5m2"]
    r = _verify([str(tiny_export), *base])
    assert r.exit_code == 2 and r.output.strip() == (
        f"error: --kv-cache-dtype fp8_e5m2: {tiny_export} declares an FP8 kv_cache_scheme (e4m3, the dtype its scales "
        "were calibrated for), and vLLM refuses fp8_e5m2 on a checkpoint that declares one (\"fp8_e5m2 kv-cache is not "
        "supported with fp8 checkpoints\"); verify it with --kv-cache-dtype fp8 (or without --kv-cache-dtype), or "
        "verify the model it was exported from with --kv-cache-dtype fp8_e5m2"), r.output
    plain = no_scale_view(read_checkpoint(str(tiny_export)), tmp_path / "plain")
    r = _verify([str(plain), *base])
    assert r.exit_code == 2 and "engine refused: cannot import vllm in this Python" in r.output, r.output


def test_more_windows_than_the_corpus_holds_says_what_is_served(tiny_export, shared_data, tmp_path, monkeypatch):
    """--windows 8 on a corpus holding fewer 64-token windows: verify says how many it serves, and that number is
    the number of windows it hands the engine (each of 64 tokens; stubbed engine) — never silently fewer."""
    import kvcal.verify

    text = (shared_data / "wikitext2_valid.txt").read_text()[:1200]
    corpus = tmp_path / "short.txt"
    corpus.write_text(text)
    sent = []

    def engine(python, request, workdir, timeout_s):
        sent.append(request["windows"])
        raise KvcalError("engine stub")

    monkeypatch.setattr(kvcal.verify, "run_engine", engine)
    r = _verify([str(tiny_export), "--corpus", str(corpus), "--context", "64", "--windows", "8",
                 "--engine-python", sys.executable])
    assert r.exit_code == 2 and r.output.strip().endswith("error: engine stub"), r.output
    wins = sent[0]
    assert 2 <= len(wins) < 8 and all(len(w) == 64 for w in wins)
    assert f"note: --windows 8: the corpus holds {len(wins)} windows of 64 tokens; verifying on those {len(wins)}" \
        in r.output.splitlines()
