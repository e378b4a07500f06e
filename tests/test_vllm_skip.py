"""``kvcal calibrate --engine vllm --kv-cache-dtype D --skip-layers auto|0,1,...``.

Option validation (one-line errors before the model loads), the byte budget turned into the knapsack's
bound (checked against every subset), and end to end on a tiny random Llama: the recorded layers are the
knapsack's choice on the recorded probe, and the disclosure report and ``kvcal export --target vllm`` state
them in the form vLLM parses."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from kvcal.engines.vllm.skip_layers import (
    budget_skip_layers,
    check_skip_layers,
    not_applicable,
    serve_skip_arg,
    skip_count_range,
)
from kvcal.errors import KvcalError
from kvcal.search.skip_layers import check_skip_options, parse_skip_layers

CHAT = Path(__file__).resolve().parents[1] / "calibration_sets" / "chat.jsonl"

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run faster single-threaded


# ---- option parsing and validation (no model) ------------------------------------------------------------
@pytest.mark.parametrize("text, want", [("auto", "auto"), (" AUTO ", "auto"), ("0", (0,)), ("5, 0,3", (0, 3, 5)),
                                        (None, None)])
def test_parse_skip_layers_accepts(text, want):
    """'auto' (any case) or a comma-separated list of distinct non-negative integers, returned sorted."""
    assert parse_skip_layers(text) == want


@pytest.mark.parametrize("text, words", [("", "is empty"), ("1,,2", "empty item"), ("1,", "empty item"),
                                         ("a", "'a' is not a layer index"), ("-1", "'-1' is not a layer index"),
                                         ("1.5", "'1.5' is not a layer index"), ("2,2", "layer 2 is named twice"),
                                         ("0 1", "'0 1' is not a layer index")])
def test_parse_skip_layers_refuses_bad_lists(text, words):
    """Every malformed list is one line naming the item and the expected form (no silent drop)."""
    with pytest.raises(KvcalError, match=words) as e:
        parse_skip_layers(text)
    assert "\n" not in str(e.value)


def test_auto_needs_a_budget_and_a_budget_needs_auto():
    """auto alone would keep every layer at 16 bits (the knapsack's unbounded optimum): refused; a budget with
    an explicit list or without --skip-layers would be ignored: refused; bounds must be positive."""
    with pytest.raises(KvcalError, match="auto needs a budget: add --max-skip N .* or --max-bytes-per-token B"):
        check_skip_options("auto", None, None)
    with pytest.raises(KvcalError, match="--max-skip bounds the choice of --skip-layers auto"):
        check_skip_options((0, 1), 2, None)
    with pytest.raises(KvcalError, match="--max-skip and --max-bytes-per-token bound the choice"):
        check_skip_options(None, 2, 9000)
    with pytest.raises(KvcalError, match="--max-skip must be >= 0"):
        check_skip_options("auto", -1, None)
    with pytest.raises(KvcalError, match="--max-bytes-per-token must be >= 1"):
        check_skip_options("auto", None, 0)
    check_skip_options("auto", 0, None)
    check_skip_options((3,), None, None)


def test_model_checks_range_and_budget():
    """Out-of-range layers name the model's range; a byte bound below the dtype with no 16-bit layer (fp8,
    H_kv 2, D 16: 2 heads x (16 + 16) bytes x 6 layers = 384) and a --max-skip below vLLM's forced turboquant
    boundary (4 layers) are refused."""
    with pytest.raises(KvcalError, match=r"layers 6,9 out of range: the model has 6 layers \(0\.\.5\)"):
        check_skip_layers((1, 6, 9), "fp8", 6, 2, 16)
    check_skip_layers((0, 5), "fp8", 6, 2, 16)
    with pytest.raises(KvcalError, match="--max-bytes-per-token 383: --kv-cache-dtype fp8 needs 384 bytes"):
        check_skip_layers("auto", "fp8", 6, 2, 16, max_bytes_per_token=383)
    check_skip_layers("auto", "fp8", 6, 2, 16, max_bytes_per_token=384)
    with pytest.raises(KvcalError, match=r"--max-skip 3: vLLM always keeps 4 layers \[0, 1, 4, 5\]"):
        check_skip_layers("auto", "turboquant_4bit_nc", 6, 2, 16, max_skip=3)


def test_byte_budget_is_every_layer_counted():
    """budget_skip_layers under --max-bytes-per-token B equals the best subset by brute force whose pages,
    counted by hand (fp8: 2·D bytes per KV head and layer, 16-bit: 4·D), fit in B and that leaves at least one
    layer in fp8 (all six at 16 bits would store nothing in fp8) — for every B from the all-fp8 size to the
    all-16-bit size, alone and with --max-skip."""
    L, H, D = 6, 2, 16
    sens = [0.3, 0.05, 0.7, 0.2, 0.65, 0.1]

    def size(s):
        return sum(H * (4 * D if i in s else 2 * D) for i in range(L))

    for B in range(size(()), size(range(L)) + 1, 32):
        for max_skip in (None, 2):
            ok = [s for r in range(L) for s in itertools.combinations(range(L), r)
                  if size(s) <= B and (max_skip is None or len(s) <= max_skip)]
            want = max(ok, key=lambda s: (sum(sens[i] for i in s), -len(s)))
            got = budget_skip_layers(sens, "fp8", L, H, D, max_skip=max_skip, max_bytes_per_token=B)
            assert got == sorted(want), (B, max_skip)


#: vLLM 0.33's turboquant boundary by hand (TurboQuantConfig.get_boundary_skip_layers: n = min(2, L // 2), the
#: first n and last n layers), per layer count L
BOUNDARY = {1: [], 2: [0, 1], 3: [0, 2], 4: [0, 1, 2, 3], 5: [0, 1, 3, 4], 6: [0, 1, 4, 5], 8: [0, 1, 6, 7]}


def test_one_layer_at_least_stays_in_the_dtype():
    """The counts of 16-bit layers a deployment can have run from vLLM's own boundary layers to L - 1; turboquant
    on 2 or 4 layers (the boundary is every layer) has none and is not applicable, with the reason; fp8 always
    is. check_skip_layers refuses --max-skip above L - 1 (naming the flag, value, layer count and range), an
    explicit list that (with the boundary) names every layer, and a dtype with no deployment; budget_skip_layers
    leaves the least sensitive layer in the dtype even with no bound on the count and bytes enough for all."""
    for n_layers, forced in BOUNDARY.items():
        assert skip_count_range("turboquant_4bit_nc", n_layers) == (len(forced), n_layers - 1)
        assert skip_count_range("fp8", n_layers) == (0, n_layers - 1) and not_applicable("fp8", n_layers) is None
        assert (not_applicable("turboquant_4bit_nc", n_layers) is not None) == (len(forced) == n_layers)
    assert not_applicable("turboquant_3bit_nc", 2).startswith("vLLM 0.33 keeps every layer (0, 1) of this 2-layer "
                                                               "model at 16 bits for turboquant_3bit_nc on its own")
    for m in (4, 9):
        with pytest.raises(KvcalError, match=rf"^--max-skip {m}: the model has 4 layers and at least one must stay "
                                             r"in --kv-cache-dtype fp8; give --max-skip between 0 and 3$"):
            check_skip_layers("auto", "fp8", 4, 2, 16, max_skip=m)
    check_skip_layers("auto", "fp8", 4, 2, 16, max_skip=3)
    with pytest.raises(KvcalError, match=r"--max-skip 6: .* give --max-skip between 4 and 5$"):
        check_skip_layers("auto", "turboquant_4bit_nc", 6, 2, 16, max_skip=6)
    with pytest.raises(KvcalError, match=r"^--skip-layers 0,1,2,3: keeps all 4 layers of the model at 16 bits, so "
                                         r"nothing would be stored in --kv-cache-dtype fp8"):
        check_skip_layers((0, 1, 2, 3), "fp8", 4, 2, 16)
    with pytest.raises(KvcalError, match=r"^--skip-layers 2,3: keeps all 6 layers"):  # with vLLM's 0, 1, 4, 5
        check_skip_layers((2, 3), "turboquant_4bit_nc", 6, 2, 16)
    check_skip_layers((2,), "turboquant_4bit_nc", 6, 2, 16)
    with pytest.raises(KvcalError, match=r"^--kv-cache-dtype turboquant_4bit_nc: vLLM 0.33 keeps every layer"):
        check_skip_layers((1,), "turboquant_4bit_nc", 4, 2, 16)
    sens = [0.3, 0.05, 0.7, 0.2]
    assert budget_skip_layers(sens, "fp8", 4, 2, 16, max_bytes_per_token=10**6) == [0, 2, 3]  # all but the least
    with pytest.raises(ValueError, match="keeps every layer"):
        budget_skip_layers(sens, "turboquant_4bit_nc", 4, 2, 16, max_skip=3)


def test_turboquant_boundary_is_forced_in():
    """For turboquant vLLM adds the first/last 2 layers itself: the choice always contains them and
    the budget pays for them."""
    sens = [0.0, 0.0, 0.9, 0.1, 0.0, 0.0, 0.5, 0.0]
    assert budget_skip_layers(sens, "turboquant_4bit_nc", 8, 2, 16, max_skip=5) == [0, 1, 2, 6, 7]
    assert budget_skip_layers(sens, "turboquant_4bit_nc", 8, 2, 16, max_skip=4) == [0, 1, 6, 7]


def test_serve_argument_is_space_separated():
    """vLLM 0.33 parses --kv-cache-dtype-skip-layers with nargs='+' and compares items with str(index)."""
    assert serve_skip_arg([0, 7, 29]) == " --kv-cache-dtype-skip-layers 0 7 29"
    assert serve_skip_arg([]) == ""


# ---- kvcal calibrate --engine vllm --skip-layers on a tiny random Llama -----------------------------------
L4 = 4  # layers of the tiny model; fp8 pages by hand: H_kv 2 x D 16 x (K + V) = 64 bytes per layer, 16-bit 128
FP8_LAYER, B16_LAYER = 2 * 16 * 2, 2 * 16 * 2 * 2


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory, smollm_tokenizer):
    from helpers.models import TINY_LLAMA_16, save_tiny_llama

    return save_tiny_llama(tmp_path_factory, smollm_tokenizer, "tiny-llama-skip", vocab_size=49152,
                           **{**TINY_LLAMA_16, "num_hidden_layers": L4})


def _calibrate(model_dir, out, **kw):
    from kvcal.calibrate import CalibrateConfig, calibrate

    cfg = CalibrateConfig(corpus=str(CHAT), out=str(out), model=str(model_dir), max_samples=12, max_seq_len=96,
                          batch_size=2, reservoir=3, heldout_reservoir=2, max_queries=16, probe_tokens=160,
                          engine="vllm", kv_cache_dtype="fp8", **kw)
    calibrate(cfg, log=lambda s: None, progress=False)
    from kvcal.artifact import load_artifact

    return load_artifact(out)


@pytest.fixture(scope="module")
def auto_artifact(tiny4, tmp_path_factory):
    out = tmp_path_factory.mktemp("skip") / "auto"
    return out, _calibrate(tiny4, out, skip_layers="auto", max_bytes_per_token=L4 * FP8_LAYER + 2 * (B16_LAYER - FP8_LAYER))


def test_recorded_layers_are_the_knapsacks_choice(auto_artifact):
    """--max-bytes-per-token 384 on the 4-layer model (all fp8: 4 x 64 = 256 bytes, each 16-bit layer +64)
    fits two 16-bit layers: the recorded set is the best subset by brute force over the recorded per-layer
    probe KL, and its bytes are counted by hand."""
    out, art = auto_artifact
    vm = art.metadata["vllm"]
    ch = vm["skip_layers_choice"]
    sens = ch["sensitivity"]
    assert ch["method"] == "auto" and len(sens) == L4 and all(s >= 0 for s in sens) and len(set(sens)) == L4
    fits = [s for r in range(L4 + 1) for s in itertools.combinations(range(L4), r)
            if L4 * FP8_LAYER + len(s) * (B16_LAYER - FP8_LAYER) <= 384]
    best = max(fits, key=lambda s: (sum(sens[i] for i in s), -len(s)))
    assert vm["skip_layers"] == sorted(best) and len(best) == 2
    assert ch["bytes_per_token"] == 2 * FP8_LAYER + 2 * B16_LAYER and ch["bytes_per_token_16bit"] == L4 * B16_LAYER
    assert ch["max_bytes_per_token"] == 384 and ch["max_skip"] is None
    assert ch["probe"]["source"] == "held-out" and 0 < ch["probe"]["tokens"] <= 160


def test_report_and_export_state_the_layers(auto_artifact, tmp_path):
    """The disclosure report names the layers and how they were chosen; `kvcal export --target vllm`
    prints the serve line with --kv-cache-dtype-skip-layers (space-separated) and records them in its manifest."""
    from click.testing import CliRunner

    from kvcal.cli import main
    from kvcal.report.disclosure import build_report
    from kvcal.report.document import to_markdown

    out, art = auto_artifact
    skip = art.metadata["vllm"]["skip_layers"]
    rep = to_markdown(build_report(art.metadata, figures=False), figure_dir=None)
    assert f"Layers kept in the model dtype (`--kv-cache-dtype-skip-layers`): {', '.join(map(str, skip))}." in rep
    assert "chosen by `--skip-layers auto` under --max-bytes-per-token 384" in rep
    assert f"serve with `--kv-cache-dtype-skip-layers {' '.join(map(str, skip))}`" in rep
    r = CliRunner().invoke(main, ["export", "--artifact", str(out), "--target", "vllm", "--out", str(tmp_path / "e")])
    assert r.exit_code == 0, r.output
    assert f"--kv-cache-dtype fp8 --kv-cache-dtype-skip-layers {' '.join(map(str, skip))}" in r.output
    man = json.loads((tmp_path / "e" / "kvcal-export.json").read_text())
    assert man["kv_cache_dtype_skip_layers"] == skip


def test_given_layers_are_recorded_as_given(tiny4, tmp_path):
    """--skip-layers 3: recorded as given (no probe), bytes 3 x 64 + 128."""
    art = _calibrate(tiny4, tmp_path / "given", skip_layers=(3,))
    vm = art.metadata["vllm"]
    assert vm["skip_layers"] == [3] and vm["skip_layers_choice"]["method"] == "given"
    assert "sensitivity" not in vm["skip_layers_choice"]
    assert vm["skip_layers_choice"]["bytes_per_token"] == 3 * FP8_LAYER + B16_LAYER


@pytest.mark.parametrize("extra, words", [
    (["--skip-layers", "0,9"], "--skip-layers: layer 9 out of range: the model has 4 layers (0..3)"),
    (["--skip-layers", "1,,2"], "empty item"),
    (["--skip-layers", "auto"], "--skip-layers auto needs a budget"),
    (["--max-skip", "2"], "--max-skip bounds the choice of --skip-layers auto"),
    (["--skip-layers", "auto", "--max-bytes-per-token", "255"], "--max-bytes-per-token 255: --kv-cache-dtype fp8 needs 256"),
    (["--skip-layers", "auto", "--max-skip", "9"],  # was accepted: every layer at 16 bits, nothing stored in fp8
     "--max-skip 9: the model has 4 layers and at least one must stay in --kv-cache-dtype fp8; give --max-skip between "
     "0 and 3"),
    (["--skip-layers", "auto", "--max-skip", "4"], "--max-skip 4: the model has 4 layers"),
    (["--skip-layers", "3,1,0,2"], "--skip-layers 0,1,2,3: keeps all 4 layers of the model at 16 bits"),
])
def test_cli_refuses_before_the_model_loads(tiny4, tmp_path, monkeypatch, extra, words):
    """Bad --skip-layers / budget options: exit 2, one `error:` line, nothing written, no weights loaded."""
    from click.testing import CliRunner

    import kvcal.models
    from kvcal.cli import main

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(kvcal.models, "load_model", no_load)
    out = tmp_path / "o"
    r = CliRunner().invoke(main, ["calibrate", "--corpus", str(CHAT), "--model", str(tiny4), "--out", str(out),
                                  "--engine", "vllm", "--kv-cache-dtype", "fp8", "--quiet", *extra])
    assert r.exit_code == 2, r.output
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], r.output
    assert not out.exists()


def test_skip_options_need_the_engine():
    """--skip-layers without --engine vllm would be dropped silently: refused in one line."""
    from kvcal.calibrate import CalibrateConfig

    with pytest.raises(KvcalError, match="--skip-layers applies with --engine vllm"):
        CalibrateConfig(corpus="x.jsonl", skip_layers="0")


@pytest.mark.parametrize("skip, words", [
    ([0, 7], r"vllm.skip_layers names layer\(s\) \[7\] but the model has 4 layers"),
    ([0, 1, 2, 3], r"vllm.skip_layers keeps all 4 layers at 16 bits, so nothing would be stored in --kv-cache-dtype fp8"),
])
def test_artifact_naming_a_layer_past_the_model_is_refused(auto_artifact, tmp_path, skip, words):
    """An artifact whose vllm.skip_layers names layer 7 of a 4-layer model would make export print a
    --kv-cache-dtype-skip-layers that matches no layer, one naming all four layers a deployment that stores nothing
    in fp8 (the 16-bit cache under its name; a recommend run of the last release wrote such artifacts): refused on
    load, naming the field — also when the content hash was recomputed after the edit (a writer other than kvcal)."""
    from helpers.export import edited_copy

    from kvcal.artifact import load_artifact
    from kvcal.errors import ArtifactError

    out, _ = auto_artifact
    bad = edited_copy(out, tmp_path / "bad", lambda m, t: m["vllm"].__setitem__("skip_layers", skip), resign=True)
    with pytest.raises(ArtifactError, match=words):
        load_artifact(bad)
