"""One result type and one report path for every search: the FP8 and the integer search return the same result
type, and the report is render_report of its metadata."""

import pytest
from helpers.models import TINY_LLAMA_16, save_tiny_llama

from kvcal.search.result import ERROR_DATA, SearchResult


def test_calibration_meta_order_and_error_data():
    """calibration_meta lays out method, the search's fields, selection (naming held-out data or, with no
    held-out split, the calibration data), the shared fields, then timing — hand-written expected dicts,
    compared with their key order."""
    r = SearchResult(plan=None, layers_meta=[], summary={"objective_k": "a", "objective_v": "b"}, method="m",
                     selection=f"pick, then lowest {ERROR_DATA} of {{x, y}}", timing={"search_seconds": 1.5})
    common = {"seed": 0, "heldout_samples": 2}
    got = r.calibration_meta(common, heldout=True)
    assert list(got.items()) == [("method", "m"), ("objective_k", "a"), ("objective_v", "b"),
                                 ("selection", "pick, then lowest held-out error of {x, y}"), ("seed", 0),
                                 ("heldout_samples", 2), ("search_seconds", 1.5)]
    assert (r.calibration_meta(common, heldout=False)["selection"]
            == "pick, then lowest error on the calibration data (no held-out split) of {x, y}")


def test_one_result_name():
    """The result type has one name: no alias in kvcal.search.integer, and kvcal.calibrate no longer re-exports
    the stages' names (they are imported from their own modules)."""
    import kvcal.calibrate as cal
    import kvcal.search.integer as integer

    assert not hasattr(integer, "IntSearchResult")
    assert set(cal.__all__) == {"CalibrateConfig", "calibrate", "output_dir", "checkpoint_path", "save_checkpoint",
                                "FORMATS", "GRANULARITIES", "PRESET_NAMES"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm_tokenizer):
    return save_tiny_llama(tmp_path_factory, smollm_tokenizer, "tiny-result", vocab_size=49152, **TINY_LLAMA_16)


@pytest.mark.parametrize("opts,integer", [((), False), (("--preset", "int4", "--probe-tokens", "0", "--sinks", "1"), True)])
def test_report_is_render_report_of_the_metadata(tiny, tmp_path, one_thread, opts, integer):
    """Both searches write report.md through one renderer: the file equals render_report of the artifact's
    own metadata (as load_artifact returns it), in the layout of its kind, and the calibration section
    starts with method and ends with the shared fields (timing last for the static search)."""
    from click.testing import CliRunner

    from kvcal.artifact import load_artifact
    from kvcal.cli import main
    from kvcal.report.markdown import console_summary, is_integer_artifact, render_report

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(f'{{"text": "sample {i}: the cache stores keys and values for every past token."}}\n'
                              for i in range(6)))
    out = tmp_path / "art"
    r = CliRunner().invoke(main, ["calibrate", "--corpus", str(corpus), "--model", str(tiny), "--out", str(out),
                                  "--max-seq-len", "64", "--search-tokens", "64", "--quiet", *opts])
    assert r.exit_code == 0, r.output
    meta = load_artifact(out).metadata
    assert is_integer_artifact(meta) is integer
    text = (out / "report.md").read_text()
    assert text == render_report(meta)
    assert text.startswith("# KV-cache calibration report (integer)" if integer else
                           "# KV-cache calibration report\n")
    # both layouts state the tensors quantized and what happens to the queries (the integer one did not)
    assert ("Tensors quantized: keys, values of every attention layer" if integer else
            "- **Tensors:** keys, values of every attention layer") in text
    assert "queries stay in the model's precision" in text
    keys = list(meta["calibration"])
    assert keys[0] == "method" and keys.index("selection") < keys.index("seed")
    assert keys[-1] == ("context_regime" if integer else "search_seconds")
    line = console_summary(meta)
    assert line.startswith("preset int4:") if integer else line.splitlines()[0].split()[0] == "layer"
