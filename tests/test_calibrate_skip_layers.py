"""``kvcal calibrate --engine vllm --kv-cache-dtype D --skip-layers auto|0,1,...`` (issue 18, deliverable 3).

Option validation (one-line errors before the model loads), the byte budget turned into the knapsack's
bound (checked against every subset), and end to end on a tiny random Llama: the recorded layers are the
knapsack's choice on the recorded probe, and the disclosure report and ``kvcal export --target vllm`` state
them in the form vLLM parses."""

from __future__ import annotations

import itertools

import pytest

from kvcal.errors import KvcalError
from kvcal.search.skip_layers import (
    budget_skip_layers,
    check_skip_layers,
    check_skip_options,
    parse_skip_layers,
    serve_skip_arg,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run faster single-threaded


# ---- option parsing and validation (no model) ------------------------------------------------------------
@pytest.mark.parametrize("text, want", [("auto", "auto"), (" AUTO ", "auto"), ("0", (0,)), ("5, 0,3", (0, 3, 5)),
                                        (None, None)])
def test_parse_skip_layers_accepts(text, want):
    """'auto' (any case) or a comma-separated list of distinct non-negative integers, returned sorted."""
    assert parse_skip_layers(text) == want


@pytest.mark.parametrize("text, words", [("", "empty item"), ("1,,2", "empty item"), ("1,", "empty item"),
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
    counted by hand (fp8: 2·D bytes per KV head and layer, 16-bit: 4·D), fit in B — for every B from the
    all-fp8 size to the all-16-bit size, alone and with --max-skip."""
    L, H, D = 6, 2, 16
    sens = [0.3, 0.05, 0.7, 0.2, 0.65, 0.1]

    def size(s):
        return sum(H * (4 * D if i in s else 2 * D) for i in range(L))

    for B in range(size(()), size(range(L)) + 1, 32):
        for max_skip in (None, 2):
            ok = [s for r in range(L + 1) for s in itertools.combinations(range(L), r)
                  if size(s) <= B and (max_skip is None or len(s) <= max_skip)]
            want = max(ok, key=lambda s: (sum(sens[i] for i in s), -len(s)))
            got = budget_skip_layers(sens, "fp8", L, H, D, max_skip=max_skip, max_bytes_per_token=B)
            assert got == sorted(want), (B, max_skip)


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
