"""vLLM's CPU backend write path (``--backend cpu``): FP8 written by truncation toward zero.

Each claim is checked against an independent float64 statement of the format: the e4m3fn / e5m2 value
grids enumerated from their definitions, and the truncating write is "the largest grid magnitude not
above |x| (after clamping to the format's max), with x's sign" (``csrc/cpu/cpu_attn_fp8.hpp``).
"""

from __future__ import annotations

import pytest
import torch

from kvcal.engines.vllm import dtypes as V
from kvcal.engines.vllm.plan import VllmKVPlan


def _grid(exp_bits: int, man_bits: int, bias: int, drop_top: bool) -> torch.Tensor:
    """Every non-negative finite value of a float8 format, float64, sorted (e4m3fn: the top code 0x7F is NaN)."""
    vals = set()
    for e in range(2 ** exp_bits - (0 if drop_top else 1)):
        for m in range(2 ** man_bits):
            if drop_top and e == 2 ** exp_bits - 1 and m == 2 ** man_bits - 1:
                continue  # e4m3fn 0x7F: NaN
            vals.add(m / 2 ** man_bits * 2.0 ** (1 - bias) if e == 0 else (1 + m / 2 ** man_bits) * 2.0 ** (e - bias))
    return torch.tensor(sorted(vals), dtype=torch.float64)


E4M3 = _grid(4, 3, 7, drop_top=True)  # max 448
E5M2 = _grid(5, 2, 15, drop_top=False)  # exponent 31 is inf/NaN: excluded by range(2^5 - 1); max 57344


def _truncate_ref(x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    a = x.double().abs().clamp(max=float(grid[-1]))
    return grid[torch.searchsorted(grid, a, right=True) - 1] * torch.sign(x.double())


def _wide(n: int, spread: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * spread)).float()


def test_grids_are_the_published_formats():
    """The enumerated float64 grids are the published OCP FP8 formats: e4m3fn has 127 non-negative finite values, max
    448, smallest subnormal 2^-9; e5m2 has 124, max 57344, smallest subnormal 2^-16 (so the references below rest on the
    right grids)."""
    assert (E4M3.numel(), float(E4M3[-1]), float(E4M3[1])) == (127, 448.0, 2.0 ** -9)
    assert (E5M2.numel(), float(E5M2[-1]), float(E5M2[1])) == (124, 57344.0, 2.0 ** -16)


@pytest.mark.parametrize("x, want", [
    (1.0, 1.0), (1.124, 1.0),  # round-to-nearest would give 1.125
    (1.2, 1.125), (-1.2, -1.125), (447.9, 416.0), (500.0, 448.0), (-1e9, -448.0),
    (3 * 2.0 ** -10, 2.0 ** -9),  # subnormal: 1.5 steps of 2^-9 truncate to 1 step
    (2.0 ** -10, 0.0), (0.0, 0.0), (-0.0, 0.0),
    (float("nan"), 448.0), (float("inf"), 448.0), (float("-inf"), -448.0),  # the clamp tests !(y < 448)
])
def test_e4m3_truncation_hand_worked(x, want):
    """fp8_e4m3_truncate writes float8_e4m3fn truncated toward zero, worked by hand: 1.124 → 1.0 (rounding to nearest
    gives 1.125), ±1.2 → ±1.125, 447.9 → 416, subnormal 3·2^-10 → 2^-9 and 2^-10 → 0; magnitudes past 448 and ±inf
    saturate to ±448, NaN to 448, zero stays zero."""
    got = V.fp8_e4m3_truncate(torch.tensor([x], dtype=torch.float32))
    assert got.dtype == torch.float8_e4m3fn and float(got.float()[0]) == want


def test_e4m3_truncation_matches_float64_grid_and_never_writes_nan():
    """On 200,000 float32 values spread over many binades (normal × exp(3·normal)) the e4m3 truncating write equals the
    float64 reference exactly (the largest grid magnitude not above min(|x|, 448), with x's sign), and no code is
    e4m3fn's NaN (low seven bits 0x7F)."""
    x = _wide(200_000, 3.0, 0)
    got = V.fp8_e4m3_truncate(x)
    assert torch.equal(got.float().double(), _truncate_ref(x, E4M3))
    assert not bool((got.view(torch.uint8) & 0x7F == 0x7F).any())


def test_e5m2_truncation_matches_float64_grid():
    """The e5m2 truncating write is float8_e5m2 and equals the float64 grid reference exactly on 200,000 values spread
    wider (normal × exp(6·normal)), clamped to 57344; the subnormal 3·2^-17 truncates to 2^-16."""
    x = _wide(200_000, 6.0, 1)
    got = V.fp8_e5m2_truncate(x)
    assert got.dtype == torch.float8_e5m2
    assert torch.equal(got.float().double(), _truncate_ref(x, E5M2))
    assert float(V.fp8_e5m2_truncate(torch.tensor([3 * 2.0 ** -17])).float()[0]) == 2.0 ** -16


def test_cpu_write_divides_by_the_scale_through_its_float32_reciprocal():
    """``x · float32(1/scale)``, then truncation: the write of a [B,H,S,D] tensor at scale 0.003 equals the
    float64 statement (reciprocal rounded to float32, product rounded to float32, grid truncation)."""
    x = _wide(4 * 64, 2.0, 2).view(1, 4, 1, 64) * 0.05
    got = V.fp8_static_fake_quant(x, 0.003, backend="cpu")
    s32 = torch.tensor(0.003, dtype=torch.float32)
    # k_inv = 1.0f / k_scale, correctly rounded; a float64 quotient rounded to float32 is the same number (double
    # rounding is innocuous for division when 53 >= 2·24 + 2, Figueroa 1995)
    inv = (1.0 / s32.double()).float()
    assert float(inv) == float(torch.ones(()) / s32)
    y = (x * inv).float()
    # dequantize: code · scale in float32 (a 4-bit by 24-bit significand product, rounded once to float32)
    assert torch.equal(got, (_truncate_ref(y, E4M3) * s32.double()).float())
    rne = V.fp8_static_fake_quant(x, 0.003)  # the GPU write rounds to nearest: never farther than truncation
    assert bool(((rne - x).abs() <= (got - x).abs()).all()) and not torch.equal(rne, got)


def test_truncation_relative_error_does_not_depend_on_a_power_of_two_scale():
    """Truncation toward zero keeps the top 3 mantissa bits: in e4m3's normal range the relative error
    |x − t(x)| / |x| is below 2^-3 and is the same at scale s and s·2^k (the stored exponent shifts,
    the mantissa bits kept are the same), so no scale choice inside the normal range changes it."""
    x = _wide(50_000, 0.5, 3).view(1, 1, -1, 1) * 0.1
    a = V.fp8_static_fake_quant(x, 0.01, backend="cpu")
    b = V.fp8_static_fake_quant(x, 0.01 * 2.0 ** -3, backend="cpu")
    normal = ((x.abs() / 0.01 >= 2.0 ** -6) & (x.abs() / 0.01 <= 448 * 2.0 ** -3))
    assert bool(normal.float().mean() > 0.9)
    rel_a = ((x - a).abs() / x.abs())[normal]
    rel_b = ((x - b).abs() / x.abs())[normal]
    assert torch.equal(rel_a, rel_b) and float(rel_a.max()) < 2.0 ** -3


def test_cpu_backend_serves_fp8_only_and_quantizes_no_query():
    """Backend cpu leaves the query unquantized (fake_quant_query returns it bit-equal); a VllmKVPlan for "vllm-cpu"
    reads as backend cpu with quantize_query False and describes query_quantization "none"; nvfp4, int8_per_token_head
    and turboquant_k8v4 are refused naming the dtypes cpu serves (auto, fp8, fp8_e4m3, fp8_e5m2), as are an unknown
    backend 'tpu' and a head_dim that is not a multiple of 32 (48)."""
    q = _wide(2 * 9 * 5 * 64, 1.0, 4).view(2, 9, 5, 64)
    assert torch.equal(V.fake_quant_query("fp8", q, q_scale=0.5, backend="cpu"), q)
    plan = VllmKVPlan("fp8", 4, k_scales=[0.01] * 4, v_scales=[0.02] * 4, backend="vllm-cpu")
    assert plan.backend == "cpu" and plan.quantize_query is False
    assert plan.describe()["backend"] == "cpu" and plan.describe()["query_quantization"] == "none"
    for name in ("nvfp4", "int8_per_token_head", "turboquant_k8v4"):
        with pytest.raises(V.VllmDTypeError, match="serves --kv-cache-dtype auto, fp8, fp8_e4m3, fp8_e5m2"):
            VllmKVPlan(name, 4, backend="cpu")
    with pytest.raises(V.VllmDTypeError, match="unknown vLLM backend 'tpu'"):
        VllmKVPlan("fp8", 4, backend="tpu")
    with pytest.raises(V.VllmDTypeError, match="head_dim a multiple of 32"):
        V.check_backend_serves("cpu", "fp8", head_dim=48)
