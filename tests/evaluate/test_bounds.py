"""Acceptance on confidence bounds over windows (kvcal.evaluate.bounds), against hand-worked Student-t figures
(t-table constants, 3 decimals) and a float64 recomputation of the per-window figures."""

import math

import pytest
import torch

from kvcal.evaluate.bounds import INCONCLUSIVE, judge_bounded, mean_bounds, metric_bounds, windows_to_decide
from kvcal.evaluate.protocol_a import TokenMetrics

# one-sided 95% Student-t quantiles from a printed t-table (3 decimals): dof -> t_{0.95, dof}
T95 = {1: 6.314, 2: 2.920, 3: 2.353, 7: 1.895}
TABLE_ROUNDING = 5e-4  # the table's last decimal


def test_mean_bounds_hand_worked():
    xs = [1.0, 2.0, 3.0, 4.0]
    sd = math.sqrt(5 / 3)  # sample sd of 1..4
    m, lo, hi, s = mean_bounds(xs)
    assert m == 2.5 and s == pytest.approx(sd, rel=1e-12)
    half = T95[3] * sd / 2
    assert abs(hi - (2.5 + half)) <= TABLE_ROUNDING * sd / 2 + 1e-12
    assert abs(lo - (2.5 - half)) <= TABLE_ROUNDING * sd / 2 + 1e-12
    # one window: no spread estimate, so no finite bound
    assert mean_bounds([0.3])[1:3] == (-math.inf, math.inf)


def test_delta_ppl_bound_is_paired_and_mapped_through_exp():
    """ΔPPL's bound: the paired NLL differences d = (0.1, 0.2, 0.3) nats bound D; ΔPPL = PPL16 (e^D − 1)."""
    row = {"delta_ppl": math.exp(2.2) - math.exp(2.0),
           "per_window": {"nll": [2.1, 2.2, 2.3], "ref_nll": [2.0, 2.0, 2.0]}}
    b = metric_bounds(row, "delta_ppl")
    d_up = 0.2 + T95[2] * 0.1 / math.sqrt(3)
    want = math.exp(2.0) * math.expm1(d_up)
    # the t-table's rounding moves d_up by at most 5e-4 * 0.1/sqrt3; ΔPPL's slope there is e^(2 + d_up)
    assert abs(b["upper"] - want) <= math.exp(2.0 + d_up) * TABLE_ROUNDING * 0.1 / math.sqrt(3) * 1.01
    # a difficult window (NLL +3 nats for both runs) leaves the differences, so the bound of D, unchanged: only
    # PPL16 (the reference of the same windows) scales it — the comparison is paired
    hard = {"delta_ppl": 0.0, "per_window": {"nll": [2.1, 5.2, 2.3], "ref_nll": [2.0, 5.0, 2.0]}}
    ppl16 = math.exp((2.0 + 5.0 + 2.0) / 3)
    assert metric_bounds(hard, "delta_ppl")["upper"] == pytest.approx(b["upper"] / math.exp(2.0) * ppl16, rel=1e-9)


def test_judge_pass_fail_inconclusive():
    crit = [("kl_mean", "<=", 1e-2)]
    tight = {"kl_mean": 5e-3, "per_window": {"kl_mean": [4.9e-3, 5.0e-3, 5.1e-3, 5.0e-3]}}
    assert judge_bounded(tight, crit)["status"] == "PASS"
    high = {"kl_mean": 2e-2, "per_window": {"kl_mean": [1.9e-2, 2.0e-2, 2.1e-2, 2.0e-2]}}
    j = judge_bounded(high, crit)
    assert j["status"] == "FAIL" and j["windows_needed"] is None
    # the case: an estimate of 9.0e-3 under a 1e-2 bar, with a spread that puts the bound above it
    near = {"kl_mean": 9.0e-3, "per_window": {"kl_mean": [6e-3, 12e-3, 7e-3, 11e-3]}}
    j = judge_bounded(near, crit)
    assert j["status"] == INCONCLUSIVE
    assert j["bounds"]["kl_mean"]["bound"] > 1e-2 > j["bounds"]["kl_mean"]["lower"]
    # windows_needed: the least N > 4 whose t_{0.95,N-1} sd / sqrt N is below the gap 1e-3 (definition, checked)
    n = j["windows_needed"]
    sd = mean_bounds(near["per_window"]["kl_mean"])[3]
    from scipy.stats import t

    assert t.ppf(0.95, n - 1) * sd / math.sqrt(n) < 1e-3 <= t.ppf(0.95, n - 2) * sd / math.sqrt(n - 1)
    assert windows_to_decide(1e-3, sd, 4) == n
    # >= clauses mirror: top-1 agreement judged on its lower bound
    agree = {"top1_agree": 0.97, "per_window": {"top1_agree": [0.96, 0.97, 0.98, 0.97]}}
    assert judge_bounded(agree, [("top1_agree", ">=", 0.9)])["status"] == "PASS"
    assert judge_bounded(agree, [("top1_agree", ">=", 0.99)])["status"] == "FAIL"
    # one window never passes on its bound
    one = {"kl_mean": 1e-9, "per_window": {"kl_mean": [1e-9]}}
    assert judge_bounded(one, crit)["status"] == INCONCLUSIVE
    # a failing clause wins over an undecided one
    both = {**near, "delta_ppl": 1.0, "per_window": {**near["per_window"], "nll": [3.0, 3.1, 3.0, 3.1],
                                                     "ref_nll": [2.0, 2.1, 2.0, 2.1]}}
    assert judge_bounded(both, crit + [("delta_ppl", "<=", 0.1)])["status"] == "FAIL"


def test_token_metrics_per_window_matches_float64():
    """Per-window NLL/KL/top-1 of TokenMetrics against a float64 recomputation; the mean of equal-length windows'
    means is the token mean (so the bound is about the figure the row prints)."""
    g = torch.Generator().manual_seed(0)
    B, n, V = 3, 5, 11
    ref = torch.log_softmax(torch.randn(B, n, V, generator=g), -1)
    q = torch.log_softmax(ref + 0.3 * torch.randn(B, n, V, generator=g), -1)
    tg = torch.randint(0, V, (B, n), generator=g)
    tm = TokenMetrics()
    tm.add(ref[:2], q[:2], tg[:2])
    tm.add(ref[2:], q[2:], tg[2:])  # next batch: window 2
    w = tm.window_figures()
    r64, q64 = ref.double(), q.double()
    kl = (r64.exp() * (r64 - q64)).sum(-1)  # [B, n]
    nll = -q64.gather(-1, tg[..., None])[..., 0]
    # float32 KL terms summed in float32 over V = 11 terms: relative error < 11 * 2^-24 per position, x |terms|
    tol = 11 * 2 ** -24 * float((r64.exp() * (r64 - q64).abs()).sum(-1).max()) + 1e-12
    for b in range(B):
        assert abs(w["kl_mean"][b] - float(kl[b].mean())) <= tol
        assert w["nll"][b] == pytest.approx(float(nll[b].mean()), abs=n * 2 ** -23 * float(nll.abs().max()))
        assert w["top1_agree"][b] == float((q[b].argmax(-1) == ref[b].argmax(-1)).double().mean())
    res = tm.result(1.0)
    assert res["kl_mean"] == pytest.approx(sum(w["kl_mean"]) / B, abs=tol)
    # decode-style adds: one position at a time, the batch's windows named explicitly
    dm = TokenMetrics()
    for j in range(n):
        dm.add(ref[:, j : j + 1], q[:, j : j + 1], tg[:, j : j + 1], window0=0)
    assert dm.window_figures()["top1_agree"] == w["top1_agree"]
