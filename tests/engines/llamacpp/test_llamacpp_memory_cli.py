"""``kvcal memory --format llamacpp:<types>`` and ``kvcal plan --kv-config llamacpp:<types>``: the bytes llama.cpp
allocates for the embedded SmolLM2-135M (30 layers, 3 KV heads x head_dim 64), worked by hand from ggml's block
sizes (q8_0: 34 B per 32 values, q4_0: 18 B, f16: 2 B per value) and llama.cpp's cell padding (256)."""

from __future__ import annotations

import json

import pytest
from helpers.cli import run_cli

# one cell (token) of one layer and side: 3 x 64 = 192 values -> q8_0 6 blocks x 34 B = 204 B, q4_0 6 x 18 = 108 B
ROW = {"q8_0": 204, "q4_0": 108, "f16": 384}
L = 30


@pytest.mark.parametrize("ctx,mib", [(4096, "47.81"), (32768, "382.50")])
def test_memory_q8_0_equals_what_llamacpp_prints(ctx, mib):
    """At 4k and 32k: 30 x 204 B x 2 sides x cells; the printed line with llama.cpp's "%7.2f MiB"
    (50,135,040 B / 2^20 = 47.8125 -> "47.81"; 401,080,320 B = 382.5 MiB exactly)."""
    doc = json.loads(run_cli(["memory", "--format", "llamacpp:q8_0", "--context", str(ctx), "--json"]))
    assert doc["total"] == 2 * L * ROW["q8_0"] * ctx
    assert doc["bytes_per_token"] == 2 * L * ROW["q8_0"] == 12240
    assert doc["cells"] == ctx and doc["streams"] == 1
    assert f"size = {mib:>7} MiB ({ctx:6d} cells,  30 layers,  1/1 seqs)" in doc["log_line"]
    text = run_cli(["memory", "--format", "llamacpp:q8_0", "--context", str(ctx)])
    assert doc["log_line"] in text
    assert ("past the model's 8192 trained positions" in text) == (ctx > 8192)


def test_memory_mixed_pair_and_sequences():
    """K q8_0, V q4_0 (the order of -ctk/-ctv), 4 sequences at -c 4096: PAD(4096/4, 256) = 1024 cells in each of
    4 streams."""
    doc = json.loads(run_cli(["memory", "--format", "llamacpp:q8_0,q4_0", "--context", "4096", "--batch", "4",
                              "--json"]))
    assert (doc["type_k"], doc["type_v"], doc["cells"], doc["streams"]) == ("q8_0", "q4_0", 1024, 4)
    assert (doc["k_bytes"], doc["v_bytes"]) == (L * ROW["q8_0"] * 4096, L * ROW["q4_0"] * 4096)
    # -np explicit: llama-server without it runs 4 slots in one unified cache (tools/server/server.cpp)
    assert doc["setting"] == "-fa on -ctk q8_0 -ctv q4_0 -c 4096 -np 4"


@pytest.mark.parametrize("args,words", [
    (["--format", "llamacpp:q3_k"], "unknown llama.cpp cache type 'q3_k'"),
    (["--format", "llamacpp:q8_0,q4_0,f16"], "give one cache type (K and V) or two"),
    (["--format", "llamacpp:q8_0", "--skip-layers", "0"], "--skip-layers: not with --format llamacpp:q8_0"),
    (["--format", "llamacpp:q8_0", "--residual-window", "16"], "--residual-window: not with"),
])
def test_memory_bad_input(args, words):
    """One line naming the option, exit 2, no traceback."""
    out = run_cli(["memory", *args], code=2)
    assert words in out and len(out.strip().splitlines()) == 1


def test_plan_sizes_llamacpp_as_it_allocates():
    """``kvcal plan``: max context at concurrency 1 under the budget is the largest multiple of 256 cells whose
    bytes fit (cells are padded to 256), max concurrency at 4096 the largest B with B x 4096 cells fitting."""
    doc = json.loads(run_cli(["plan", "--gpu-mem", "1GiB", "--kv-config", "llamacpp:q8_0,llamacpp:q4_0", "--json"]))
    budget = doc["kv_budget_bytes"]
    for name, row in (("llamacpp:q8_0", ROW["q8_0"]), ("llamacpp:q4_0", ROW["q4_0"])):
        per_cell = 2 * L * row
        opt = next(o for o in doc["options"] if o["name"] == name)
        assert opt["bytes_per_token"] == per_cell
        fits = next(r for r in doc["max_context"] if r["batch"] == 1)[name]["fits"]
        assert fits == budget // per_cell // 256 * 256
        conc = next(r for r in doc["max_concurrency"] if r["context"] == 4096)[name]
        assert conc == budget // (per_cell * 4096)
    out = run_cli(["plan", "--gpu-mem", "1GiB", "--kv-config", "llamacpp:q9_0"], code=2)
    assert "--kv-config llamacpp:q9_0: unknown llama.cpp cache type" in out
