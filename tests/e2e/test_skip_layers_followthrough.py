"""The 16-bit layers of a vLLM deployment follow the artifact through every later command.

A user's path: ``kvcal calibrate --engine vllm --kv-cache-dtype nvfp4 --skip-layers ...`` or ``kvcal
recommend`` → ``report.md`` → ``kvcal export --target vllm`` → ``kvcal inspect`` / ``kvcal report`` /
``kvcal evaluate --vllm-dtype``. Each of these must state (or measure with) the layers vLLM keeps in the
model dtype; before these tests, recommend's kept artifact lost them (its export printed a serve line
without ``--kv-cache-dtype-skip-layers``), calibrate's report.md never named them, the disclosure's memory
section and evaluate's ``vllm:<dtype>`` row counted every layer quantized. Also two recommend inputs:
``--dtypes ""`` (was: the default menu, silently) and an ``--eval-corpus`` too short for one window (was:
an error blaming ``--corpus``). Tiny random Llama (4 layers, 2 KV heads x head_dim 16)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvcal.cli import main

CHAT = Path(__file__).resolve().parents[2] / "calibration_sets" / "chat.jsonl"
L, H, D = 4, 2, 16
# vLLM pages per token and layer, by hand: NVFP4 K and V = H x (D/2 bytes of e2m1 + D/16 e4m3 block scales);
# 16-bit K and V = H x D x 2 bytes
NV_LAYER, B16_LAYER = 2 * H * (D // 2 + D // 16), 2 * H * D * 2  # 36, 128
NVFP4_CAL = {"batch_size": 2, "reservoir": 3, "heldout_reservoir": 2, "max_queries": 16}

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run faster single-threaded


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm_tokenizer):
    from helpers.models import TINY_LLAMA_16, save_tiny_llama

    return save_tiny_llama(tmp_path_factory, smollm_tokenizer, "tiny-llama-followthrough", vocab_size=49152,
                           **{**TINY_LLAMA_16, "num_hidden_layers": L})


@pytest.fixture(scope="module")
def tiny_small_kv(tiny, tmp_path_factory):
    """``tiny`` with keys and values 2^-7 times as large and the same function (helpers.models.shrink_kv): calibrated
    scales beat vLLM's default 1.0 by orders of magnitude, so the tests that need a calibrated row chosen hold on
    any machine (on ``tiny`` itself the two are near ties that the CPU's rounding decides)."""
    from helpers.models import shrink_kv

    return shrink_kv(tiny, tmp_path_factory.mktemp("small-kv") / "model")


@pytest.fixture(scope="module")
def given(tiny, tmp_path_factory):
    """``kvcal calibrate --engine vllm --kv-cache-dtype nvfp4 --skip-layers 1`` (no probe)."""
    from kvcal.artifact import load_artifact
    from kvcal.calibrate import CalibrateConfig, calibrate

    out = tmp_path_factory.mktemp("given") / "art"
    calibrate(CalibrateConfig(corpus=str(CHAT), out=str(out), model=str(tiny), max_samples=12, max_seq_len=96,
                              engine="vllm", kv_cache_dtype="nvfp4", skip_layers=(1,), **NVFP4_CAL),
              log=lambda s: None, progress=False)
    return out, load_artifact(out)


def test_calibrate_report_md_states_the_16bit_layers_and_the_outer_scales(given):
    """report.md names layer 1 as kept in the model dtype with vLLM's bytes per token by hand
    (3 x 36 + 128 = 236 of 4 x 128 = 512), does not claim every layer is quantized, and says the NVFP4 block
    scales are dynamic under the static calibrated outer scale (16-element groups)."""
    out, _ = given
    text = (out / "report.md").read_text()
    nb = (L - 1) * NV_LAYER + B16_LAYER
    assert nb == 236
    assert ("- **Layers vLLM keeps in the model dtype (`--kv-cache-dtype-skip-layers`):** 1 (their scales are written "
            f"but vLLM does not use them); given with `--skip-layers`; {nb} KV bytes per token as vLLM allocates pages "
            f"({L * B16_LAYER} at 16 bits).") in text
    assert "of every attention layer but the 16-bit layers below" in text
    assert ("nvfp4, token_group (16) granularity, symmetric, dynamic float8_e4m3fn block scales under a static "
            "per-layer outer scale from calibration (the k_scale column)") in text


def test_disclosure_report_counts_vllm_bytes_with_the_16bit_layers(given):
    """kvcal report's memory section states vLLM's bytes per token with layer 1 at 16 bits (236) beside its
    every-layer figures, and the quantized-tensors paragraph excludes layer 1."""
    from kvcal.report.disclosure import build_report
    from kvcal.report.document import to_markdown

    _, art = given
    rep = to_markdown(build_report(art.metadata, figures=False), figure_dir=None)
    assert ("**Served by vLLM with layers 1 in the model dtype** (`--kv-cache-dtype-skip-layers`): 236 bytes per "
            "token as vLLM allocates pages (512 at 16 bits); the figures in this section count every layer "
            "quantized.") in rep
    assert "of every attention layer but layers 1, which vLLM keeps in the model dtype" in rep


def test_evaluate_vllm_row_serves_the_artifacts_16bit_layers(given, tiny, tmp_path):
    """kvcal evaluate --vllm-dtype nvfp4 on the artifact: the vllm:nvfp4 row keeps layer 1 in the model dtype
    (236 bytes per token by hand) and its KL equals Protocol A of the same VllmKVPlan built independently
    from the artifact's outer scales and q_scale with skip_layers=(1,) (exact: same arithmetic); the fp8 row
    (another dtype) quantizes every layer."""
    import torch

    from kvcal.engines.vllm.plan import VllmKVPlan
    from kvcal.evaluate.protocol_a import teacher_forced
    from kvcal.evaluate.windows import corpus_stream, cut_windows
    from kvcal.models import load_model, load_tokenizer

    out, art = given
    js = tmp_path / "eval.json"
    r = CliRunner().invoke(main, ["evaluate", "--artifact", str(out), "--model", str(tiny), "--corpus", str(CHAT),
                                  "--context", "64", "--windows", "1", "--mode", "teacher_forced", "--no-baselines",
                                  "--vllm-dtype", "nvfp4,fp8", "--accept", "kl_mean<=1", "--json", str(js), "--quiet"])
    # One window has no spread to bound: the verdict is INCONCLUSIVE (exit 1), never a PASS on a point estimate.
    assert r.exit_code == 1 and "artifact: INCONCLUSIVE" in r.output, r.output
    doc = json.loads(js.read_text())
    assert doc["methods"]["vllm:nvfp4"]["skip_layers"] == [1] and doc["methods"]["vllm:fp8"]["skip_layers"] == []
    assert doc["memory"]["bytes_per_token"]["vllm:nvfp4"] == 236
    assert doc["memory"]["bytes_per_token"]["vllm:fp8"] == L * B16_LAYER // 2
    t = art.tensors
    plan = VllmKVPlan("nvfp4", L, skip_layers=(1,),
                      k_scales=[float(t[f"model.layers.{i}.self_attn.k_outer_scale"].reshape(-1)[0]) for i in range(L)],
                      v_scales=[float(t[f"model.layers.{i}.self_attn.v_outer_scale"].reshape(-1)[0]) for i in range(L)],
                      q_scales=[float(t[f"model.layers.{i}.self_attn.q_scale"].reshape(-1)[0]) for i in range(L)])
    tok = load_tokenizer(str(tiny))
    ids, _ = corpus_stream(str(CHAT), tok)
    torch.manual_seed(0)
    ref = teacher_forced(load_model(str(tiny)), cut_windows(ids, 64, 1), {"x": plan}, progress=False)["x"]
    row = next(x for x in doc["results"] if x["method"] == "vllm:nvfp4")
    assert row["kl_mean"] == ref["kl_mean"]


def test_recommend_records_its_16bit_layers_in_the_artifact_its_export_line_reads(tiny_small_kv, tmp_path):
    """Choosing nvfp4 with 16-bit layers (bar: kl_mean at most the lowest KL of a first run that nothing passed,
    so the candidate with that KL, which keeps layers at 16 bits, is the one chosen; max-skip 3, one layer at
    least stays in nvfp4), recommend's kept artifact records the chosen layers; running its export line gives the same serve line
    as deploy.md and a manifest naming them; inspect of the artifact and of the checkpoint states them; the
    artifact's tensors are the calibration's, unchanged. --out holds a space: the printed lines are shell-quoted
    and the export line runs as printed (shlex.split, the way a shell reads it)."""
    from kvcal.artifact import load_artifact
    from kvcal.inspect import inspect_path
    from kvcal.recommend import RecommendConfig, recommend

    def run(out, accept):  # every row measured on the same 2 windows (a bound needs two), no screening
        return recommend(RecommendConfig(corpus=str(CHAT), out=str(out), model=str(tiny_small_kv), dtypes=("nvfp4",),
                                         max_skip=L - 1, context=64, windows=2, max_windows=2, measure_all=True,
                                         probe_tokens=64, accept=accept,
                                         fp8_samples=8, fp8_seq_len=64, nvfp4_kwargs=NVFP4_CAL),
                         log=lambda s: None, progress=False)

    first = run(tmp_path / "first", "kl_mean<=0")  # KL 0 needs every layer at 16 bits: no candidate has it
    assert first["chosen"] is None and all(len(c["skip_layers"]) < L for c in first["candidates"])
    measured = [c for c in first["candidates"] if c["deployable"] and "kl_mean" in c]
    best = min(measured, key=lambda c: c["bounds"]["kl_mean"]["upper"])
    least = best["bounds"]["kl_mean"]["upper"]
    assert all(c is best or c["bounds"]["kl_mean"]["upper"] > least for c in measured)  # the premise: no tie
    out = tmp_path / "my rec"
    # same windows, same arithmetic: the same per-window KLs and bounds; the row with the least bound passes
    doc = run(out, f"kl_mean<={least!r}")
    skip = doc["chosen"]["skip_layers"]
    n = len(skip)
    assert doc["chosen"]["dtype"] == "nvfp4" and doc["chosen"]["kl_mean"] == best["kl_mean"] and 1 <= n < L
    assert skip == best["skip_layers"]
    assert doc["chosen"]["scales"] == "calibrated"  # the least KL is a calibrated row's (small K/V)
    spaced, listed = " ".join(map(str, skip)), ", ".join(map(str, skip))
    assert doc["commands"]["serve"].endswith(f"--kv-cache-dtype nvfp4 --kv-cache-dtype-skip-layers {spaced}")
    art = load_artifact(out / "artifact-nvfp4")
    vm = art.metadata["vllm"]
    assert vm["skip_layers"] == skip and vm["skip_layers_choice"]["method"] == "recommend"
    assert vm["skip_layers_choice"]["bytes_per_token"] == (L - n) * NV_LAYER + n * B16_LAYER
    assert f"--kv-cache-dtype-skip-layers`):** {listed}" in (out / "artifact-nvfp4" / "report.md").read_text()
    # the tensors are the calibration's: a fresh calibration with the same options gives equal tensors
    from kvcal.calibrate import CalibrateConfig, calibrate

    calibrate(CalibrateConfig(corpus=str(CHAT), out=str(tmp_path / "again"), model=str(tiny_small_kv), max_samples=8,
                              max_seq_len=64, engine="vllm", kv_cache_dtype="nvfp4", **NVFP4_CAL),
              log=lambda s: None, progress=False)
    again = load_artifact(tmp_path / "again").tensors
    assert sorted(again) == sorted(art.tensors) and all(torch_equal(again[k], art.tensors[k]) for k in again)
    ck = out / "checkpoint"
    assert doc["commands"]["serve"] == f"vllm serve '{ck}' --kv-cache-dtype nvfp4 --kv-cache-dtype-skip-layers {spaced}"
    a = shlex.split(doc["commands"]["export"])
    assert a[:2] == ["kvcal", "export"] and len(a) == 10
    o = dict(zip(a[2::2], a[3::2], strict=True))
    assert o == {"--artifact": str(out / "artifact-nvfp4"), "--target": "vllm", "--model-dir": str(tiny_small_kv),
                 "--out": str(ck)}
    r = CliRunner().invoke(main, a[1:])
    assert r.exit_code == 0, r.output
    assert f"serve: {doc['commands']['serve']}\n" in r.output
    man = json.loads((Path(o["--out"]) / "kvcal-export.json").read_text())
    assert man["kv_cache_dtype_skip_layers"] == skip and man["kv_cache_dtype"] == "nvfp4"
    assert any(f"skipped layers {skip}" in n for n in inspect_path(out / "artifact-nvfp4").notes)
    assert any(n.startswith(f"serve with --kv-cache-dtype nvfp4 --kv-cache-dtype-skip-layers {spaced}")
               for n in inspect_path(o["--out"]).notes)


def test_recommend_deploys_vllm_default_scales_when_they_measure_better(tiny, tmp_path, monkeypatch):
    """fp8 and nvfp4 (the calibrated dtypes) are also evaluated at vLLM's default scales, every static scale 1.0:
    one "vLLM default (1.0)" row per calibrated row, same 16-bit layers, same bytes per token (vLLM's pages by hand:
    fp8 K+V 2·H·D = 64 per layer, nvfp4 36, 16-bit 128), KL equal to Protocol A of a VllmKVPlan built with no scales
    (exact: same arithmetic). With the bar set at the KL of the cheapest default-scale row that beats its calibrated
    twin and every cheaper row (from a first run on the same windows), that row is chosen: deploy.json/deploy.md say
    it runs at vLLM's default scales, no export line, the vllm serve line on the model itself, no calibrated
    artifact in OUT or named by the document. Before the fix only the calibrated rows existed. The calibrated scales
    are made clearly worse here (x 2^8, a monkeypatch of the scale reader; the artifact itself is not touched):
    on this random model the two variants are near ties that the CPU's rounding decides."""
    from helpers.recommend import recommend_bar

    import kvcal.recommend as R
    from kvcal.engines.vllm.plan import VllmKVPlan
    from kvcal.engines.vllm.skip_layers import serve_skip_arg
    from kvcal.evaluate.protocol_a import teacher_forced
    from kvcal.evaluate.windows import corpus_stream, cut_windows
    from kvcal.models import load_model, load_tokenizer
    from kvcal.recommend import RecommendConfig, recommend

    real = R._artifact_scales

    def worse(*a, **k):  # the calibrated scales x 2^8: K/V codes shrink into e4m3's subnormals, clearly worse than 1.0
        return {n: ([v * 256.0 for v in vals] if n.endswith("_scales") else vals) for n, vals in real(*a, **k).items()}

    monkeypatch.setattr(R, "_artifact_scales", worse)

    def run(out, accept):
        return recommend(RecommendConfig(corpus=str(CHAT), out=str(out), model=str(tiny), dtypes=("fp8", "nvfp4"),
                                         max_skip=1, context=64, windows=2, max_windows=2, measure_all=True,
                                         probe_tokens=64, accept=accept,
                                         fp8_samples=8, fp8_seq_len=64, fp8_kwargs=NVFP4_CAL, nvfp4_kwargs=NVFP4_CAL),
                         log=lambda s: None, progress=False)

    first = run(tmp_path / "first", "kl_mean<=0")  # every row evaluated, none passes
    rows = first["candidates"]
    per_layer = {"fp8": 2 * H * D, "nvfp4": NV_LAYER}
    plans = {}
    for d in ("fp8", "nvfp4"):
        cal = [c for c in rows if c["dtype"] == d and c["scales"] == "calibrated"]
        dft = [c for c in rows if c["dtype"] == d and c["scales"] == "vLLM default (1.0)"]
        assert len(cal) == 2 and [c["skip_layers"] for c in dft] == [c["skip_layers"] for c in cal]
        for a, b in zip(cal, dft, strict=True):
            n = len(a["skip_layers"])
            assert a["bytes_per_token"] == b["bytes_per_token"] == (L - n) * per_layer[d] + n * B16_LAYER
            plans[(d, tuple(b["skip_layers"]))] = VllmKVPlan(d, L, skip_layers=tuple(b["skip_layers"]))
    tok = load_tokenizer(str(tiny))
    ids, _ = corpus_stream(str(CHAT), tok)
    model = load_model(str(tiny))
    wins = cut_windows(ids, 64, 2, skip=1)
    assert len(wins) == 2
    # recommend measures window by window (one forward each): compare each window's KL with a 1-window run
    refs = [teacher_forced(model, wins[w : w + 1], plans, progress=False) for w in range(2)]
    for (d, skip) in plans:
        row = next(c for c in rows if c["dtype"] == d and c["scales"] == "vLLM default (1.0)"
                   and tuple(c["skip_layers"]) == skip)
        assert row["per_window"]["kl_mean"] == [refs[w][(d, skip)]["kl_mean"] for w in range(2)]

    bar, want = recommend_bar(first, "vLLM default (1.0)")
    out = tmp_path / "rec"
    doc = run(out, bar)
    ch = doc["chosen"]
    assert {k: ch[k] for k in ("dtype", "scales", "skip_layers", "kl_mean")} == \
        {k: want[k] for k in ("dtype", "scales", "skip_layers", "kl_mean")}
    d = ch["dtype"]
    twin = next(c for c in doc["candidates"] if c["dtype"] == d and c["scales"] == "calibrated"
                and c["skip_layers"] == ch["skip_layers"])
    # its calibrated twin (same bytes) does not pass the bar on its bound: the bar is below that bound
    assert twin["status"] != "PASS" and twin["bounds"]["kl_mean"]["upper"] > ch["bounds"]["kl_mean"]["upper"]
    serve = f"vllm serve {tiny} --kv-cache-dtype {d}{serve_skip_arg(ch['skip_layers'])}"
    assert doc["commands"] == {"export": None, "serve": serve}
    assert doc["artifact"] is None and sorted(p.name for p in out.iterdir()) == ["deploy.json", "deploy.md"]
    assert any(n.startswith(f"{d} is chosen at vLLM's default scales (1.0), not with the scales calibrated") and
               "a checkpoint without k_scale/v_scale/q_scale runs at 1.0" in n for n in doc["notes"])
    md = (out / "deploy.md").read_text()
    assert f"Chosen: `--kv-cache-dtype {d}` at vLLM's default scales (1.0: a checkpoint without k/v/q scales" in md
    assert serve in md and "kvcal export --artifact" not in md and "| dtype | scales | 16-bit layers |" in md
    chosen_line = next(ln for ln in md.splitlines() if ln.endswith("← chosen |"))
    assert chosen_line.startswith(f"| {d} | vLLM default (1.0) | ")
    assert json.loads((out / "deploy.json").read_text())["chosen"]["scales"] == "vLLM default (1.0)"


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


def test_recommend_refuses_empty_dtypes(tiny, tmp_path, no_model):
    """--dtypes "" (or only commas) is refused in one line before the model loads; it used to run the default
    menu of nine dtypes without a word."""
    for arg in ("", " , "):
        r = CliRunner().invoke(main, ["recommend", "--engine", "vllm", "--corpus", str(CHAT), "--model", str(tiny),
                                      "--out", str(tmp_path / "rec"), "--dtypes", arg, "--quiet"])
        assert r.exit_code == 2, r.output
        assert r.output.strip() == ("error: --dtypes is empty; name at least one vLLM --kv-cache-dtype "
                                    "(e.g. fp8,turboquant_4bit_nc)")
    assert no_model == [] and not (tmp_path / "rec").exists()


def test_recommend_names_the_short_eval_corpus(tiny, tmp_path, no_model):
    """An --eval-corpus shorter than one --context window is named in the error with its token count (the
    --corpus has plenty); before the fix the error blamed --corpus. Before the model loads; no --out."""
    short = tmp_path / "short.jsonl"
    short.write_text('{"text": "too short"}\n')
    r = CliRunner().invoke(main, ["recommend", "--engine", "vllm", "--corpus", str(CHAT), "--model", str(tiny),
                                  "--eval-corpus", str(short), "--out", str(tmp_path / "rec"), "--context", "64",
                                  "--probe-tokens", "64", "--dtypes", "fp8", "--quiet"])
    assert r.exit_code == 2, r.output
    line = r.output.strip()
    assert line.startswith(f"error: --eval-corpus {short} has ") and "one evaluation window of 64 tokens" in line
    assert "\n" not in line and no_model == [] and not (tmp_path / "rec").exists()


@pytest.mark.parametrize("opts, fix", [
    (["--engine", "vllm", "--kv-cache-dtype", "nvfp4", "--skip-layers", "auto", "--max-skip", "1"],
     "give longer samples, or name the layers (--skip-layers 0,1,...)"),
    (["--preset", "int8"], "give longer samples, give --sinks N, or use --probe-tokens 0"),
])
def test_probe_on_samples_under_3_tokens_names_the_real_fix(tiny, tmp_path, opts, fix):
    """Every sample 2 tokens long: the probe (--skip-layers auto, or the integer sink choice) has nothing to run
    on although --probe-tokens is 1024; the error says the samples are too short (it said "raise --probe-tokens",
    which cannot help). Exit 2, one line, nothing written."""
    from kvcal.models import load_tokenizer

    corpus = tmp_path / "two.jsonl"
    corpus.write_text('{"text": "Hi there"}\n' * 10)
    assert len(load_tokenizer(str(tiny))("Hi there")["input_ids"]) == 2
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["calibrate", "--model", str(tiny), "--corpus", str(corpus), "--out", str(out),
                                  "--quiet", *opts])
    assert r.exit_code == 2, r.output
    err = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert err == [f"error: {'--skip-layers auto: ' if '--skip-layers' in opts else ''}every held-out sample is "
                   f"shorter than 3 tokens (a probe needs a sink, a quantized token and a predicted one); {fix}"], r.output
    assert "Traceback" not in r.output and not out.exists()


def test_recommend_refuses_an_out_inside_the_model_directory(tiny, no_model):
    """--out inside the model directory: the export line recommend would print (--model-dir MODEL --out
    OUT/checkpoint) is one kvcal export refuses (overlap), so recommend refuses it first, in one line, before the
    model loads; it used to run to the end and print that line."""
    out = tiny / "rec"
    r = CliRunner().invoke(main, ["recommend", "--engine", "vllm", "--corpus", str(CHAT), "--model", str(tiny),
                                  "--out", str(out), "--dtypes", "nvfp4", "--context", "64", "--probe-tokens", "64",
                                  "--quiet"])
    assert r.exit_code == 2, r.output
    assert r.output.strip() == (f"error: --out {out} overlaps the model directory {tiny}: the kvcal export line it "
                                f"would print (--model-dir {tiny} --out {out / 'checkpoint'}) is refused; choose an "
                                "--out outside the model directory")
    assert no_model == [] and not out.exists()


# ---- no candidate stores nothing in its dtype; --max-skip in range; one dtype spelling --------
REC = ["recommend", "--engine", "vllm", "--quiet", "--corpus", str(CHAT), "--context", "64", "--windows", "1",
       "--probe-tokens", "64"]


def test_recommend_never_offers_every_layer_at_16_bits(tiny, tmp_path):
    """On the 4-layer model with a bar every evaluated row passes (kl_mean<=1) and no --max-skip: no candidate keeps
    all 4 layers at 16 bits (that stores nothing in the dtype: the 16-bit cache, 512 bytes/token, under the dtype's
    name) — int4_per_token_head is offered at 0..3 16-bit layers (vLLM's first-2/last-2 rule is every layer here,
    so it is not listed), --max-skip defaults to 3 with a note; turboquant_4bit_nc, whose boundary layers vLLM adds
    on its own (min(2, 4 // 2) = 2 first and last: all four), is one NOT-APPLICABLE row with the reason, not probed,
    not evaluated, never chosen. Before the fix both dtypes had a PASS row at 0,1,2,3 (KL 0)."""
    out = tmp_path / "rec"
    r = CliRunner().invoke(main, [*REC, "--model", str(tiny), "--out", str(out), "--accept", "kl_mean<=1",
                                  "--dtypes", "int4_per_token_head,turboquant_4bit_nc", "--windows", "2",
                                  "--max-windows", "2", "--measure-all"])
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "deploy.json").read_text())
    md = (out / "deploy.md").read_text()
    assert doc["max_skip"] == L - 1
    assert ("--max-skip not given: at most 3 of the model's 4 layers at 16 bits (the default 6 capped at layers - 1, "
            "so that every candidate stores a layer in its dtype)") in doc["notes"]
    int4 = [c for c in doc["candidates"] if c["dtype"] == "int4_per_token_head"]
    assert sorted(len(c["skip_layers"]) for c in int4) == [0, 1, 2, 3] and all(c["choice"] == "auto" for c in int4)
    for c in int4:  # vLLM's pages by hand: 16-bit slot 4·D per KV head, int4_per_token_head D + 8
        n = len(c["skip_layers"])
        assert c["bytes_per_token"] == H * (n * 4 * D + (L - n) * (D + 8)) and c["status"] == "PASS"
    tq = [c for c in doc["candidates"] if c["dtype"] == "turboquant_4bit_nc"]
    reason = ("vLLM 0.33 keeps every layer (0, 1, 2, 3) of this 4-layer model at 16 bits for turboquant_4bit_nc on "
              "its own (first and last min(2, L//2) layers, TurboQuantConfig.get_boundary_skip_layers): nothing would "
              "be stored in it")
    assert len(tq) == 1 and tq[0]["status"] == "NOT-APPLICABLE" and tq[0]["failed"] == [reason]
    assert tq[0]["skip_layers"] == [0, 1, 2, 3] and not tq[0]["deployable"] and "kl_mean" not in tq[0]
    assert list(doc["sensitivity"]) == ["int4_per_token_head"]  # not probed
    assert f"turboquant_4bit_nc not applicable on this model: {reason}" in doc["notes"]
    assert not any(n.startswith("auto-free rows") for n in doc["notes"])  # there is none to explain
    assert ("| turboquant_4bit_nc | write time | 0,1,2,3 | rule (not deployable) | 512 | 1.000 | - | - | - | "
            "NOT-APPLICABLE |") in md
    ch = doc["chosen"]
    assert ch["dtype"] == "int4_per_token_head" and len(ch["skip_layers"]) < L
    assert all(len(c["skip_layers"]) < L for c in doc["candidates"] if c["status"] != "NOT-APPLICABLE")


@pytest.mark.parametrize("extra, line", [
    (["--max-skip", "9", "--dtypes", "fp8"], "error: --max-skip 9: the model has 4 layers and every candidate keeps "
                                             "at least one in its dtype; give --max-skip between 0 and 3"),
    (["--max-skip", "4", "--dtypes", "fp8"], "error: --max-skip 4: the model has 4 layers and every candidate keeps "
                                             "at least one in its dtype; give --max-skip between 0 and 3"),
    (["--dtypes", "turboquant_4bit_nc"],
     "error: --dtypes turboquant_4bit_nc: vLLM 0.33 keeps every layer (0, 1, 2, 3) of this 4-layer model at 16 bits "
     "for turboquant_4bit_nc on its own (first and last min(2, L//2) layers, TurboQuantConfig.get_boundary_skip_layers)"
     ": nothing would be stored in it; add a dtype that stores this model's layers (e.g. --dtypes fp8)"),
    (["--dtypes", "fp8,fp8_e4m3"], "error: --dtypes names fp8 and fp8_e4m3, one vLLM dtype under two names "
                                   "(vllm/config/cache.py: fp8 = fp8_e4m3); keep one spelling"),
])
def test_recommend_refuses_before_the_model_loads(tiny, tmp_path, no_model, extra, line):
    """A --max-skip above the 4-layer model's 3 (every layer at 16 bits stores nothing in the dtype; --max-skip 9 was
    accepted), a menu whose only dtype vLLM keeps at 16 bits on every layer of this model, and fp8 named twice (its
    outputs would mix the spellings): exit 2, that one line, before the model loads, no --out."""
    out = tmp_path / "rec"
    r = CliRunner().invoke(main, [*REC, "--model", str(tiny), "--out", str(out), *extra])
    assert r.exit_code == 2, r.output
    assert r.output.strip() == line and no_model == [] and not out.exists()


def test_negative_max_skip_is_refused_by_both_commands(tiny, tmp_path, no_model):
    """--max-skip -1: click's range check on the command line (exit 2, naming the option, the value and the range),
    the one-line KvcalError from the Python API; nothing written, no model loaded."""
    from kvcal.calibrate import CalibrateConfig
    from kvcal.errors import KvcalError
    from kvcal.recommend import RecommendConfig, recommend

    for cmd in (REC, ["calibrate", "--corpus", str(CHAT), "--engine", "vllm", "--kv-cache-dtype", "fp8",
                      "--skip-layers", "auto", "--quiet"]):
        r = CliRunner().invoke(main, [*cmd, "--model", str(tiny), "--out", str(tmp_path / "o"), "--max-skip", "-1"])
        assert r.exit_code == 2 and "Invalid value for '--max-skip': -1 is not in the range 0<=x" in r.output, r.output
    with pytest.raises(KvcalError, match=r"^--max-skip must be >= 0, got -1$"):
        recommend(RecommendConfig(corpus=str(CHAT), out=str(tmp_path / "o"), model=str(tiny), max_skip=-1))
    with pytest.raises(KvcalError, match=r"^--max-skip must be >= 0, got -1$"):
        CalibrateConfig(corpus=str(CHAT), engine="vllm", kv_cache_dtype="fp8", skip_layers="auto", max_skip=-1)
    assert no_model == [] and not (tmp_path / "o").exists()


def test_fp8_e4m3_is_spelled_one_way_in_every_output(tiny_small_kv, tmp_path):
    """recommend --dtypes fp8_e4m3 (chosen): deploy.md, deploy.json (serve line, notes), the kept artifact
    (vllm.kv_cache_dtype and report.md) and the output of the printed kvcal export line (its serve line and
    manifest) name the dtype fp8_e4m3 and nothing else. Before the fix the artifact was calibrated as fp8, so its
    report, the notes and the export line said fp8 while deploy.md said fp8_e4m3 (vLLM takes both: one run, one
    spelling). The bar (from a first run on the same windows) makes a calibrated row the cheapest PASS, so that
    the artifact is kept; the model's small keys and values make the calibrated rows win on any machine."""
    import re

    from helpers.recommend import recommend_bar

    from kvcal.artifact import load_artifact
    from kvcal.recommend import RecommendConfig, recommend

    def rec(out, accept):
        return recommend(RecommendConfig(corpus=str(CHAT), out=str(out), model=str(tiny_small_kv), dtypes=("fp8_e4m3",),
                                         max_skip=L - 1, context=64, windows=2, max_windows=2, measure_all=True,
                                         probe_tokens=64, accept=accept,
                                         fp8_samples=8, fp8_seq_len=64, fp8_kwargs=NVFP4_CAL),
                         log=lambda s: None, progress=False)

    bar, want = recommend_bar(rec(tmp_path / "first", "kl_mean<=0"), "calibrated")
    out = tmp_path / "rec"
    doc = rec(out, bar)
    assert doc["chosen"]["dtype"] == "fp8_e4m3" and doc["calibrated"]["fp8_e4m3"] == "artifact"
    assert doc["chosen"]["scales"] == "calibrated" and doc["chosen"]["kl_mean"] == want["kl_mean"]
    art = load_artifact(out / "artifact")
    assert art.metadata["vllm"]["kv_cache_dtype"] == "fp8_e4m3"
    r = CliRunner().invoke(main, shlex.split(doc["commands"]["export"])[1:])
    assert r.exit_code == 0, r.output
    assert f"serve: {doc['commands']['serve']}\n" in r.output
    assert json.loads((out / "checkpoint" / "kvcal-export.json").read_text())["kv_cache_dtype"] == "fp8_e4m3"
    texts = {"deploy.md": (out / "deploy.md").read_text(), "deploy.json": (out / "deploy.json").read_text(),
             "report.md": (out / "artifact" / "report.md").read_text(), "export": r.output}
    for name, text in texts.items():
        named = re.findall(r"--kv-cache-dtype[ =`]+([A-Za-z0-9_]+)", text)
        assert named and set(named) == {"fp8_e4m3"}, (name, named)
