"""Shared start of the vLLM scale benchmarks (``bench_vllm_fp8.py``, ``bench_vllm_nvfp4.py``).

The embedded SmolLM2-135M (fp32), evaluation windows at the start of ``../shared/data/wikitext2_valid.txt``,
calibration windows after them (or a kvcal corpus), and kvcal's capture with ``kvcal calibrate``'s
defaults (:class:`kvcal.calibrate.CalibrateConfig`). Imported by the benchmark scripts, which run with
``benchmarks/`` on ``sys.path`` (``python benchmarks/bench_*.py``).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "wikitext2_valid.txt"


def window_parser(doc: str, calib: int) -> argparse.ArgumentParser:
    """Argument parser with the window options every vLLM benchmark takes: ``--calib`` (default ``calib``)
    windows of ``--seq-len`` tokens, ``--eval`` held-out windows of ``--eval-len`` tokens. ``doc``: the
    script's docstring (its ``--help`` text)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calib", type=int, default=calib, help="calibration windows")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--eval", type=int, default=4, help="held-out evaluation windows")
    ap.add_argument("--eval-len", type=int, default=512)
    return ap


@dataclass
class Setup:
    """What the benchmarks share: tokenizer, model, the evaluation windows ``ev`` (int64 ``[eval, eval_len]``),
    the calibration samples ``cal`` (1-D int64 token tensors), ``kvcal calibrate``'s default options ``cfg``,
    the held-out sample indices ``held``, the capture ``cap`` (:class:`kvcal.capture.run.CaptureResult`) and
    the number of decoder layers ``num_layers``."""

    tok: object
    model: object
    ev: object
    cal: list
    cfg: object
    held: object
    cap: object
    num_layers: int


def load_and_capture(a: argparse.Namespace, calib_corpus: str | None = None) -> Setup:
    """Load the embedded model, cut the windows ``a`` (from :func:`window_parser`) asks for and capture.

    Evaluation: the first ``a.eval`` windows of ``a.eval_len`` tokens of :data:`DATA`. Calibration: ``a.calib``
    windows of ``a.seq_len`` tokens starting after the evaluation tokens (disjoint), or, with ``calib_corpus``,
    up to ``a.calib`` samples of at most ``a.seq_len`` tokens of that kvcal corpus (seed 0). Capture: the
    held-out split, reservoirs and search length of :class:`kvcal.calibrate.CalibrateConfig`'s defaults.
    Raises what :func:`kvcal.corpus.load_corpus` raises for a bad corpus."""
    from kvcal.calibrate import CalibrateConfig
    from kvcal.capture.run import run_capture, split_heldout
    from kvcal.evaluate.windows import text_windows
    from kvcal.models import load_model, load_tokenizer

    tok, model = load_tokenizer(None), load_model(None)
    text = DATA.read_text(encoding="utf-8")
    ev = text_windows(tok, text, a.eval_len, a.eval)
    skip = -(-a.eval * a.eval_len // a.seq_len)  # calibration windows start after the evaluation tokens
    if calib_corpus:
        from kvcal.corpus import load_corpus

        cal = load_corpus(calib_corpus, tok, max_seq_len=a.seq_len, max_samples=a.calib, seed=0).samples
    else:
        cal = list(text_windows(tok, text, a.seq_len, a.calib, skip_windows=skip))
    c = model.config
    L, Hkv, Hq = c.num_hidden_layers, c.num_key_value_heads, c.num_attention_heads
    d = CalibrateConfig(corpus="-")
    held = split_heldout(len(cal), d.heldout_fraction, d.seed)
    cap = run_capture(model, cal, held, num_layers=L, num_kv_heads=Hkv, num_q_heads=Hq,
                      head_dim=c.hidden_size // Hq, batch_size=d.batch_size, reservoir=d.reservoir,
                      heldout_reservoir=d.heldout_reservoir, search_tokens=d.search_tokens, progress=False)
    return Setup(tok, model, ev, cal, d, held, cap, L)
