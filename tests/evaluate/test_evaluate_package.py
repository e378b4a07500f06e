"""kvcal.evaluate as a package by stage: the old import surface still resolves, and there is one windowing path."""

from __future__ import annotations

import importlib

import pytest
import torch

#: every public name the single-module ``kvcal/evaluate.py`` defined (commit 9a5e849), with the stage
#: module that defines it now
OLD_NAMES = {
    "protocol_a": ["plan_hook", "side_only", "side_sensitivity", "plans_kl", "teacher_forced"],
    "decode": ["decode_eval"],
    "baselines": ["fp8_plan", "artifact_amax", "capture_amax", "baseline_plans", "describe_plan",
                  "per_layer_errors"],
    "accept": ["METRICS", "DEFAULT_ACCEPT", "parse_accept", "plan_bits", "default_accept", "judge"],
    "document": ["SCHEMA", "render_table", "to_json"],
    "windows": ["text_windows", "corpus_stream", "cut_windows"],
    "run": ["EvalConfig", "evaluate"],
}


@pytest.mark.parametrize("stage", sorted(OLD_NAMES))
def test_old_names_import_from_the_package(stage):
    """``from kvcal.evaluate import X`` still works for every old name, and gives the very object the
    stage module defines (a re-export, not a copy)."""
    pkg = importlib.import_module("kvcal.evaluate")
    mod = importlib.import_module(f"kvcal.evaluate.{stage}")
    for name in OLD_NAMES[stage]:
        assert getattr(pkg, name) is getattr(mod, name), name
        assert name in pkg.__all__


def test_cut_windows_by_hand():
    """Consecutive, non-overlapping windows after ``skip`` windows; never a partial window."""
    from kvcal.evaluate.windows import cut_windows

    ids = torch.arange(10)
    assert cut_windows(ids, 3, 5, skip=1).tolist() == [[3, 4, 5], [6, 7, 8]]
    assert cut_windows(ids, 3, 1).tolist() == [[0, 1, 2]]
    assert cut_windows(ids, 4, 9, skip=2).shape == (0, 4)  # tokens 8, 9 make no window of 4
    assert cut_windows(ids, 20, 3).shape == (0, 20)


def test_text_windows_are_the_windows_evaluate_cuts_from_a_txt(tmp_path, smollm_tokenizer):
    """``text_windows`` (benchmarks) and ``corpus_stream`` + ``cut_windows`` (``kvcal evaluate``,
    ``recommend``) on the same text give the same token ids: one tokenization, one windowing path."""
    from kvcal.evaluate.windows import corpus_stream, cut_windows, text_windows

    text = "\n".join(f" = Section {i} =\n The café served {i * 7} crêpes, naïvely priced at €{i}.\n"
                     for i in range(40))
    path = tmp_path / "c.txt"
    path.write_text(text, encoding="utf-8")
    ids, info = corpus_stream(str(path), smollm_tokenizer)
    assert info["kind"] == "txt" and info["tokens"] == ids.numel() and ids.dtype == torch.int64
    for window, n, skip in ((16, 3, 0), (16, 3, 2), (32, 100, 1)):
        a = text_windows(smollm_tokenizer, text, window, n, skip)
        b = cut_windows(ids, window, n, skip)
        assert a.shape[0] > 0 and torch.equal(a, b)
