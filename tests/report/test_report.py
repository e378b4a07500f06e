"""Disclosure report: content from synthetic artifact metadata + evaluation JSON (no model)."""

from __future__ import annotations

import base64
import json
import re

import pytest
from click.testing import CliRunner
from helpers.report import make_artifact, make_eval, make_meta, make_tensors

from kvcal.artifact import load_artifact
from kvcal.report import data as D
from kvcal.report.disclosure import build_report, write_report
from kvcal.report.document import to_html, to_markdown

FIGS = {"kv_ranges", "clip_vs_absmax", "layer_errors", "quality_vs_context", "memory"}


@pytest.fixture(scope="module")
def full_report():
    meta = make_meta(per_head=True, channel_absmax=True)
    return build_report(meta, make_eval(), make_tensors(meta), artifact_path="artifacts/tiny-fp8")


def test_report_states_the_disclosure_items(full_report):
    """The disclosure Markdown of a synthetic per-head FP8 artifact and evaluation states each required item
    with hand-worked figures: quantized tensors and their formats, the weight precision apart, both corpora
    (window percentiles by nearest rank), regimes, bytes per token (128 vs 256) and cache bytes, the quality
    table with baselines and PASS/FAIL, runtime vs accounting, device; all five figures drawn."""
    md = to_markdown(full_report)
    # which tensors, format and granularity of each
    assert "**Quantized tensors: K and V**" in md
    assert "| K (keys) | yes | fp8_e4m3 | 8 | head | symmetric | static (calibrated) | float32 |" in md
    assert "| V (values) | yes | fp8_e4m3 | 8 | head |" in md
    # weight precision stated separately and labelled as such
    assert "## Model weights (separate from the KV cache)" in md
    assert "**Weight precision: GGUF Q4_1 weights, dequantized to float32 for computation.**" in md
    # corpora side by side, with the relation spelled out
    # evaluation lengths come from its windows: 8 x 1024 + 2 x 4096 -> p50 1024, p90 4096 (nearest rank)
    assert "| length p50 | 280 | 1,024 |" in md and "| length p90 | 480 | 4,096 |" in md
    assert "| samples / windows | 64 | 10 |" in md and "| evaluation windows | – | 8 × 1024 tok, 2 × 4096 tok |" in md
    assert "Different corpora: calibration `chat` vs evaluation `wiki`" in md
    assert "Evaluation contexts reach 4096 tokens while calibration samples were capped at 512" in md
    # regimes
    assert "Evaluated contexts: 1024, 4096 tokens; batches (concurrent sequences): 1" in md
    # memory: 16-bit = 2 sides x 4 layers x 2 heads x 8 x 2 B = 256; fp8 = 128 (+ 64 B of per-head scales)
    assert "**128 bytes per token** (all layers, K+V) vs 256 at 16 bits: **2.00× smaller**" in md
    assert "| 1,024 | 1 | 131,136 | 128.06 KiB | 256.00 KiB | 2.00× |" in md
    # quality with baselines and PASS/FAIL
    assert "**Verdict for `artifact`: PASS**" in md
    assert re.search(r"\| fp8-absmax \| teacher_forced \| 1,024 \| 1 \| 16\.0600 \| \+0\.0600 .*\*\*FAIL\*\*", md)
    assert re.search(r"\| \*\*artifact\*\* \| decode \| 4,096 \| 1 \| .*\*\*PASS\*\* \| kl_mean<=2e-3", md)
    assert "| 16-bit | teacher_forced | 1,024 | 1 | 16.0000 | +0.0000 | 0.000e+00 | 0.000e+00 | 1.0000 | 1.000 | 4,000 | REFERENCE |" in md
    assert "| **artifact** | artifact | K fp8_e4m3 head, V fp8_e4m3 head | 8 | kl_mean<=2e-3, delta_ppl<=0.05 |" in md
    assert "| fp8-absmax | baseline |" in md
    assert "| artifact | 1,024 | 1 | 1,024 | 131,136 | 131,136 | yes |" in md  # runtime vs accounting
    assert "| fp8-absmax | 128 | 2.00× smaller |" in md
    assert "Device: cpu; throughput: not measured (CPU run: memory and quality only)." in md
    assert "CPU run: memory and quality only" in md
    assert "the evaluation ran the model with weights" not in md
    assert set(full_report.figures) == FIGS
    assert "Not drawn" not in md


def test_figures_are_pngs_and_html_is_self_contained(full_report):
    """Every figure is a PNG over 5 kB; the HTML report embeds all five as base64 data URIs (no figures/
    links, no script), shows FAIL and the weights section; inline Markdown embeds all five too."""
    for f in full_report.figures.values():
        assert f.png.startswith(b"\x89PNG\r\n\x1a\n") and len(f.png) > 5000
    html = to_html(full_report)
    srcs = re.findall(r'src="data:image/png;base64,([^"]+)"', html)
    assert len(srcs) == len(FIGS)
    assert base64.b64decode(srcs[0]).startswith(b"\x89PNG")
    assert 'src="figures/' not in html and "<strong>FAIL</strong>" in html
    assert "<h2>Model weights (separate from the KV cache)</h2>" in html
    assert "<script" not in html
    md_inline = to_markdown(full_report, figure_dir=None)
    assert md_inline.count("](data:image/png;base64,") == len(FIGS)


def test_ranges_and_outliers():
    """layer_ranges finds the hand-placed outlier channel 5 of head 1 in every layer from per-channel absmax,
    none in V, the clip of 0.8 x absmax per head, layer 3 as the per-tensor outlier, and a channel outlier
    placed in layer 2's artifact tensor."""
    r = D.layer_ranges(make_meta(per_head=True, channel_absmax=True))
    assert r["k"]["outlier_level"] == "channel" and r["k"]["outliers"] == [(i, 1, 5) for i in range(4)]
    assert r["v"]["outliers"] == []
    assert r["k"]["clip"][0] == pytest.approx([0.8 * 10, 0.8 * 11])
    per_tensor = D.layer_ranges(make_meta())
    assert per_tensor["k"]["outlier_level"] == "layer" and per_tensor["k"]["outliers"] == [(3, 0, None)]
    assert per_tensor["k"]["channel_absmax"] is None
    # per-channel ranges may come from artifact tensors instead of metadata
    import torch

    t = {f"model.layers.{i}.self_attn.k_channel_absmax": torch.ones(2, 8) for i in range(4)}
    t["model.layers.2.self_attn.k_channel_absmax"][0, 3] = 9.0
    assert D.layer_ranges(make_meta(), t)["k"]["outliers"] == [(2, 0, 3)]


def test_report_without_evaluation_says_so():
    """A report without an evaluation JSON says no evaluation was given and quality is not established, gives
    no verdict, and still states the fp8_e4m3 tensor format."""
    md = to_markdown(build_report(make_meta(), figures=False))
    assert "No evaluation JSON given" in md and "not evaluated" in md
    assert "quality at serving contexts/concurrency is **not** established" in md
    assert "Verdict" not in md and "fp8_e4m3 tensor" in md


def test_failing_artifact_is_reported_as_failure():
    """An evaluation whose decode ctx 4096 row fails makes the verdict FAIL naming that row and criterion, the
    acceptance line FAIL and the HTML row red, and a weight precision differing from calibration's is
    noted."""
    ev = make_eval()
    for r in ev["results"]:
        if r["method"] == "artifact" and r["mode"] == "decode" and r["context"] == 4096:
            r.update(status="FAIL", kl_mean=9e-3, failed=["kl_mean<=2e-3"])
    ev["description"]["weight_precision"] = "bfloat16 weights"
    rep = build_report(make_meta(), ev, figures=False)
    md = to_markdown(rep)
    assert "**Verdict for `artifact`: FAIL** — failed at decode ctx 4096 batch 1 (kl_mean<=2e-3)." in md
    assert "**Note:** the evaluation ran the model with weights `bfloat16 weights`, calibration with" in md
    assert "Acceptance: **FAIL** for `artifact`." in md
    assert 'style="background:#fde8e8"' in to_html(rep)


def test_window_percentiles():
    """Window percentiles by nearest rank of 8 x 1024 + 2 x 4096 are p50 1024 and p90/p99/max 4096
    (hand-worked), a single window gives its length throughout, and the tested method is read from results,
    artifact or methods roles."""
    assert D._window_percentiles({"1024": 8, "4096": 2}) == {"p50": 1024, "p90": 4096, "p99": 4096, "max": 4096}
    assert D._window_percentiles({"512": 1}) == {"p50": 512, "p90": 512, "p99": 512, "max": 512}
    assert D.tested_method({"results": [{"method": "artifact"}]}) == "artifact"
    assert D.tested_method({"artifact": {"method": "mine"}}) == "mine"
    assert D.tested_method({"methods": {"x": {"role": "baseline"}, "y": {"role": "artifact"}}}) == "y"


def test_k_only_and_same_corpus():
    """A K-only artifact is reported as K only with V unquantized in 16 bits, an evaluation on the calibration
    file as the same file, and the hand-worked 1.33x saving (256 vs 64 + 128 bytes)."""
    meta = make_meta()
    meta["kv"]["quantized_tensors"] = ["k"]
    meta["kv"]["v"] = {"format": "bf16", "granularity": "tensor", "symmetric": True, "dynamic": False, "bits": 16}
    ev = make_eval(corpus={**meta["corpus"], "p50": 280, "p90": 480, "p99": 512, "max": 512})
    md = to_markdown(build_report(meta, ev, figures=False))
    assert "**Quantized tensors: K only (V in 16 bits)**" in md
    assert "| V (values) | no (16-bit) | bf16 | 16 | – |" in md
    assert "**the same file** as the calibration corpus" in md
    assert "vs 256 at 16 bits: **1.33× smaller**" in md  # 16-bit 256 -> K 64 + V 128 = 192


@pytest.mark.parametrize("ev", [
    {"results": [{"method": "x"}]},
    {"schema": "kvcal-eval/1", "results": [], "per_layer": {}, "memory": None},
    {"results": [{"method": "a", "mode": "decode", "context": 512, "ppl": 3.0, "status": "PASS",
                  "criteria": "kl_mean<=1e-3"}], "regimes": [{"context": 512}], "per_layer": {"a": {}}},
])
def test_tolerates_missing_optional_keys(ev):
    """Partial evaluation JSON and metadata (missing optional keys, empty objects) still render a report
    starting with its title, and the quality and per-layer plots accept the partial inputs."""
    for meta in (make_meta(), {"model": {"id": "m"}, "kv": {}}, {}):
        md = to_markdown(build_report(meta, ev, figures=False))
        assert md.startswith("# KV-cache disclosure report")
    from kvcal.report import plots as P  # every figure function copes with the partial inputs

    P.plot_quality_vs_context({m: D.quality_series(ev, m) for m in ("delta_ppl", "kl_mean")})
    P.plot_layer_errors(D.heldout_errors({}), D.per_layer_eval(ev))


def test_write_report_and_cli(tmp_path):
    """write_report writes report.md and figures into the artifact (quality plot listed as not drawn without
    evaluation); kvcal report --eval --out writes 5 figures and an HTML with 5 embedded PNGs; invalid JSON, a
    foreign schema, missing fields and a missing artifact exit 2 with their message, no traceback, nothing
    written."""
    from kvcal.cli import main

    art = make_artifact(tmp_path / "art")
    res = write_report(art)  # default: into the artifact directory, no evaluation
    assert res["markdown"] == str(art / "report.md") and (art / "figures" / "kv_ranges.png").exists()
    assert "Not drawn (inputs absent): quality_vs_context." in (art / "report.md").read_text()
    ev = tmp_path / "eval.json"
    ev.write_text(json.dumps(make_eval()))
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["report", "--artifact", str(art), "--eval", str(ev), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "5 figures" in r.output
    md = (out / "report.md").read_text()
    assert "![memory](figures/memory.png)" in md and (out / "figures" / "memory.png").exists()
    assert (out / "report.html").read_text().count("data:image/png;base64,") == 5
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    r = CliRunner().invoke(main, ["report", "--artifact", str(art), "--eval", str(bad)])
    assert r.exit_code == 2 and "is not valid JSON" in r.output
    bad.write_text(json.dumps({"schema": "other/1", "results": []}))
    r = CliRunner().invoke(main, ["report", "--artifact", str(art), "--eval", str(bad)])
    assert r.exit_code == 2 and "not a kvcal evaluation" in r.output
    for obj, msg in (({}, "not a kvcal evaluation"), ({"a": 1, "results": []}, "schema None"),
                     ({"schema": "kvcal-eval/1", "results": [{"method": "x"}]}, "results[0] lacks mode, context"),
                     ([1, 2], "not a kvcal evaluation")):
        bad.write_text(json.dumps(obj))
        r = CliRunner().invoke(main, ["report", "--artifact", str(art), "--eval", str(bad), "--out", str(tmp_path / "o2")])
        assert r.exit_code == 2 and msg in r.output and "Traceback" not in r.output, (obj, r.output)
    assert not (tmp_path / "o2").exists()
    r = CliRunner().invoke(main, ["report", "--artifact", str(tmp_path / "missing")])
    assert r.exit_code == 2 and r.output.startswith("error: no artifact at")


def test_report_refuses_an_evaluation_of_another_artifact(tmp_path):
    """`kvcal report` refuses an evaluation of another artifact (exit 2, naming it, nothing written): the
    evaluation's recorded sha256 (or, for files without one, its kv section) must match --artifact's."""
    import hashlib

    from kvcal.cli import main

    art = make_artifact(tmp_path / "art")
    other = make_artifact(tmp_path / "other", per_head=True)
    ev = make_eval()
    ev["artifact"] = {**ev["artifact"], "path": str(other),
                      "sha256": hashlib.sha256((other / "kv_scales.safetensors").read_bytes()).hexdigest()}
    f = tmp_path / "ev.json"
    f.write_text(json.dumps(ev))
    r = CliRunner().invoke(main, ["report", "--artifact", str(art), "--eval", str(f), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and f"was run on artifact {other}" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "o").exists()
    r = CliRunner().invoke(main, ["report", "--artifact", str(other), "--eval", str(f), "--out", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    # an evaluation written before the sha256 was recorded: its kv section must match
    del ev["artifact"]["sha256"]
    ev["artifact"]["kv"] = load_artifact(other).metadata["kv"]
    f.write_text(json.dumps(ev))
    r = CliRunner().invoke(main, ["report", "--artifact", str(art), "--eval", str(f), "--out", str(tmp_path / "o3")])
    assert r.exit_code == 2 and "cache format (kv section) differs" in r.output


def test_calibration_report_still_renders():
    """The calibration report Markdown still names the weight precision, and the per-layer table has a header
    line and one row for each of the fixture's 4 layers."""
    from kvcal.report.markdown import layer_table, render_calibration_report

    meta = make_meta(per_head=True)
    assert "Weight precision" in render_calibration_report(meta)
    assert len(layer_table(meta).splitlines()) == 5


def test_artifact_without_calibration_records():
    """An artifact written without calibration metadata (e.g. by another tool) still gets a report."""
    meta = {k: v for k, v in make_meta().items() if k not in ("corpus", "calibration", "layers")}
    md = to_markdown(build_report(meta, make_eval(), figures=False))
    assert "relation to the evaluation corpus cannot be stated" in md
    assert "holds no per-layer calibration records" in md
    assert "Calibrated on: not recorded." in md and "**Verdict for `artifact`: PASS**" in md


def test_integer_artifact_report():
    """An int4 artifact (per-channel static K, token-group dynamic V, 4 sinks) is reported with its formats,
    scale dtypes, sinks and average bits, per-layer chosen vs min/max held-out errors from the metadata, V
    clip ratios, and the range plot listed as not drawn while clip and layer-error plots are."""
    from helpers.report import make_int_meta, make_int_tensors

    meta, tensors = make_int_meta(), make_int_tensors()
    rep = build_report(meta, make_eval(), tensors)
    md = to_markdown(rep)
    assert "| K (keys) | yes | int4 | 4 | channel | asymmetric | static (calibrated) | float32 |" in md
    assert "| V (values) | yes | int4 | 4 | token_group (group 32) | asymmetric | dynamic (per write) | float16 |" in md
    assert "4 sink tokens" in md and "**4.3125** (" not in md and "**4.3125**, preset `int4`." in md
    # per-layer table from the integer records: chosen held-out error (plain min/max in parentheses)
    assert "| 0 | int4 channel | z1.5 | 2.000e-03 (5.000e-03) | int4 token_group(g=32) | clip0.9 | 3.000e-03 (4.000e-03) |" in md
    he = D.heldout_errors(meta)
    assert he["k"] == {"chosen": [2e-3, 4e-3, 6e-3, 8e-3], "min/max": [5e-3, 1e-2, 1.5e-2, 2e-2]}
    r = D.layer_ranges(meta, tensors)
    assert set(r) == {"v"} and r["v"]["clip_ratio"][0] == pytest.approx([0.9, 0.85]) and r["v"]["clip"] is None
    # no absmax in integer metadata: the range plot is skipped, the relative clip plot is drawn
    assert "kv_ranges" not in rep.figures and {"clip_vs_absmax", "layer_errors"} <= set(rep.figures)
    assert "Not drawn (inputs absent): kv_ranges." in md


def test_integer_report_states_transforms_and_rounding():
    """The report states pre-rope keys, K and V transforms, query-aware rounding, per-channel bit widths,
    non-uniform V levels and log8 V scales with the number of layers each applies to, and a plain int4 report
    mentions none of them."""
    from helpers.report import make_int_meta, make_int_tensors

    meta, tensors = make_int_meta(), make_int_tensors()
    L = len(meta["layers"])
    meta["kv"]["transforms"] = [{"k": "pre_rope", "v": "hadamard"}] * L
    meta["kv"]["key_position"] = "pre_rope"
    for lm in meta["layers"][:2]:
        lm["k"]["rounding"] = True
    meta["layers"][1]["k"]["channel_bits"] = [2, 10, 20, 110, 40, 10, 0, 0]  # histogram over 1..8 bits
    for lm in meta["layers"][:3]:
        lm["v"]["levels"] = [[-1.0 + 2 * i / 15 for i in range(16)]]
    meta["kv"]["v"] = dict(meta["kv"]["v"], scale_dtype="log8")
    md = to_markdown(build_report(meta, make_eval(), tensors))
    assert "Keys are quantized **pre-rope**" in md
    assert "Keys are quantized after a transform: pre-rope" in md
    assert "Values are quantized after a transform: hadamard" in md
    assert f"query-aware rounding (OPTQ-style error feedback weighted by calibration queries) in 2 of {L} layers" in md
    assert f"per-channel bit widths (1–8 bits, each head's row keeping the format's size; chosen from calibration " \
           f"queries × key ranges) in 1 of {L} layers" in md
    assert f"Values use non-uniform levels (a per-layer table of 2^bits levels fitted on the calibration values; codes " \
           f"index it) in 3 of {L} layers" in md
    assert "per-token scales are stored as log8: one byte per token and head" in md
    plain = to_markdown(build_report(make_int_meta(), make_eval(), tensors))
    assert "after a transform" not in plain and "query-aware rounding" not in plain and "bit widths" not in plain
    assert "non-uniform levels" not in plain and "log8" not in plain


def test_calibration_report_states_vllm_query_quantization():
    """report.md of an artifact calibrated for vLLM (a ``vllm`` metadata section) says the queries are quantized
    as that engine serves them, with the recorded query_quantization; without the section it says the queries
    stay in the model's precision (before: it said so for vLLM fp8 artifacts too, whose q_scale vLLM applies)."""
    from kvcal.report.markdown import render_calibration_report

    meta = make_meta()
    assert "queries stay in the model's precision." in render_calibration_report(meta)
    meta["vllm"] = {"vllm_version": "0.33.0", "kv_cache_dtype": "fp8",
                    "query_quantization": "fp8_e4m3 static q_scale per tensor"}
    text = render_calibration_report(meta)
    assert "queries stay in the model's precision" not in text
    assert "--kv-cache-dtype fp8: fp8_e4m3 static q_scale per tensor (q_scale calibrated with the keys)" in text
