"""16-bit layer budgets on a model with sliding-window layers (a tiny random Gemma 3: W = 8, layers sliding,
sliding, full, sliding, 1 KV head x 32, max context 8192): a sliding layer's vLLM pages stop at its window plus
the in-flight tokens, so at long context keeping it at 16 bits costs a fraction of a global layer. Bytes per
token are averaged over the model's maximum context, by hand here from vLLM 0.33's SlidingWindowSpec bound."""

from __future__ import annotations

import json
import math
from fractions import Fraction

import pytest
from click.testing import CliRunner
from helpers.models import save_tiny_gemma3

from kvcal.cli import main

TEXT = "calibration_sets/text.jsonl"
CTX = 8192
#: vLLM 0.33 sliding layer at 8192 tokens: ceil(min(W - 1 + 2048, 8192) / 16) + 1 blocks of 16 tokens
SLIDING_SHARE = Fraction((math.ceil((8 - 1 + 2048) / 16) + 1) * 16, CTX)
SHARES = [SLIDING_SHARE, SLIDING_SHARE, Fraction(1), SLIDING_SHARE]
FP8_SLOT, BF16_SLOT = 2 * 1 * 32 * 1, 2 * 1 * 32 * 2  # K and V, 1 head x 32, bytes per token per layer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def gemma_long(tmp_path_factory, smollm_tokenizer):
    return save_tiny_gemma3(tmp_path_factory, smollm_tokenizer, "tiny-gemma3-long", max_position_embeddings=CTX)


def by_hand(skip, slot):
    return math.ceil(sum((BF16_SLOT if i in skip else slot) * w for i, w in enumerate(SHARES)))


def test_shares_and_costs_by_hand(gemma_long):
    """On the tiny Gemma 3 at its 8192-token maximum context, computed by hand from vLLM 0.33's SlidingWindowSpec bound:
    each layer's share of the tokens paged (sliding 130 blocks of 16 / 8192, global 1); fp8 bytes per token with no skip
    layers and with layers 0 and 2 at bf16 (the share-weighted sum, rounded up); without a context the unweighted 4 × 64
    slot bytes; and the 16-bit extra per skipped layer ceil(64 × share) = [17, 17, 64, 17]."""
    from kvcal.engines.vllm.memory import vllm_bytes_per_token, vllm_token_shares
    from kvcal.engines.vllm.skip_layers import skip_costs
    from kvcal.models import load_model_config

    cfg = load_model_config(str(gemma_long))
    assert list(vllm_token_shares(cfg)) == SHARES  # default: the model's maximum context
    assert vllm_bytes_per_token(cfg, "fp8", (), context=CTX) == by_hand((), FP8_SLOT)
    assert vllm_bytes_per_token(cfg, "fp8", (0, 2), context=CTX) == by_hand((0, 2), FP8_SLOT)
    assert vllm_bytes_per_token(cfg, "fp8") == 4 * FP8_SLOT  # no context: the per-token page slots, unweighted
    assert skip_costs("fp8", 4, 1, 32, vllm_token_shares(cfg)) == [math.ceil(64 * w) for w in SHARES] == [17, 17, 64, 17]


def test_skip_layers_auto_budget_keeps_sliding_layers_at_16_bits(gemma_long, tmp_path):
    """--max-bytes-per-token = the fp8 cache + 3 sliding layers' 16-bit extra (3 x 17 bytes averaged over 8192
    tokens): every sliding layer fits and the global one (64 extra) does not, whatever the probe measured (a
    knapsack maximising summed KL > 0 under the bound takes all three), and the recorded bytes per token are the
    hand-computed average at the model's maximum context."""
    from kvcal.artifact import load_artifact

    budget = by_hand((), FP8_SLOT) + 3 * 17
    out = tmp_path / "fp8"
    r = CliRunner().invoke(main, ["calibrate", "--model", str(gemma_long), "--corpus", TEXT, "--max-samples", "8",
                                  "--max-seq-len", "32", "--engine", "vllm", "--kv-cache-dtype", "fp8", "--skip-layers",
                                  "auto", "--max-bytes-per-token", str(budget), "--out", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    ch = load_artifact(out).metadata["vllm"]["skip_layers_choice"]
    assert load_artifact(out).metadata["vllm"]["skip_layers"] == [0, 1, 3]
    assert ch["bytes_per_token"] == by_hand((0, 1, 3), FP8_SLOT) <= budget
    assert ch["bytes_per_token_16bit"] == by_hand((0, 1, 2, 3), FP8_SLOT) and ch["bytes_per_token_context"] == CTX


def test_recommend_rows_average_over_the_max_context(gemma_long, tmp_path):
    """Every recommend row's bytes/token is the hand-computed average at 8192 tokens for its 16-bit layers, and
    deploy.json / deploy.md say over which context."""
    out = tmp_path / "rec"
    r = CliRunner().invoke(main, ["recommend", "--engine", "vllm", "--quiet", "--model", str(gemma_long), "--corpus",
                                  TEXT, "--context", "32", "--windows", "2", "--probe-tokens", "64", "--dtypes",
                                  "int4_per_token_head", "--max-skip", "2", "--accept", "kl_mean<=1", "--out", str(out)])
    assert r.exit_code in (0, 1), r.output
    doc = json.loads((out / "deploy.json").read_text())
    assert doc["bytes_per_token_context"] == CTX
    slot = 32 + 8  # int4_per_token_head, K and V of one head (as tests/recommend/test_recommend.py: D + 8 bytes)
    for c in doc["candidates"]:
        assert c["bytes_per_token"] == by_hand(set(c["skip_layers"]), slot), c
    assert doc["bytes_per_token_16bit"] == by_hand({0, 1, 2, 3}, slot)
    assert "averaged over 8192 tokens" in (out / "deploy.md").read_text()
