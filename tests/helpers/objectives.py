"""Float32 rounding bounds of the attention objectives, computed independently of kvcal."""

from __future__ import annotations

import math

import torch


def fp32_bounds(q, k, v, kh, vh, scaling, window=0):
    """First-order worst-case bounds ``[5, H_kv]`` (float64) on how far :class:`SequenceCache`'s float32
    results can be from :func:`_brute`'s float64 ones, whatever the summation order (Higham's γ_n = n·u
    per n-term sum, u = eps32; first-order terms, with 2x slack on the whole):

    - scores: a D-term dot and one scaling product, |δs_j| ≤ (D+1)·u·A_j with A_j = scaling·Σ|q_d k_jd|;
      Δ = the row's largest score error (keys and quantized keys);
    - log-probabilities ``s_j − lse``: |δa_j| ≤ 2Δ + 4u·(|s_j − max| + log n + 1) (the log_softmax argument
      of test_optimizer_presets._kl64_and_fp32_bound) =: e_j; probabilities: |δp_j| ≤ p_j·(e_j + (n+4)·u);
    - KL row Σ p_j(a_j − b_j): Σ |δp_j||a_j − b_j| + p_j(e_j + ê_j) + (n+2)·u·Σ p_j|a_j − b_j|;
    - centered row Σ(d_j − m)², d = ŝ − s: |δd_j| ≤ δs_j + δŝ_j + u|d_j|, |δm| ≤ max δd + n·u·mean|d|;
    - outputs Σ_j w_j x_j (w = p, p̂ − p; x = v, v̂ − v), then ‖·‖²: Σ_j |δw_j||x_j| + (n+1)·u·Σ|w_j||x_j| per
      element, 2|o|·δo + δo² + (D+1)·u·o² for the square; the per-head float32 total adds (#terms)·u·Σ.
    What this catches is in the test using it."""
    u = torch.finfo(torch.float32).eps
    Hq, T, D = q.shape
    Hk = k.shape[0]
    G = Hq // Hk
    b = torch.zeros(5, Hk, dtype=torch.float64)
    tot = torch.zeros(5, Hk, dtype=torch.float64)  # Σ|terms| for the final float32 per-head sums
    cnt = 0
    for hq in range(Hq):
        h = hq // G
        for i in range(T):
            lo = max(0, i - window + 1) if window else 0  # a sliding window W reads keys i-W+1..i
            n = i + 1 - lo
            cnt += n
            qd = q[hq, i].double()
            kk, kkh = k[h, lo : i + 1].double(), kh[h, lo : i + 1].double()
            s, sh = kk @ qd * scaling, kkh @ qd * scaling
            A, Ah = (kk * qd).abs().sum(-1) * scaling, (kkh * qd).abs().sum(-1) * scaling
            ds, dsh = (D + 1) * u * A, (D + 1) * u * Ah
            big = float(torch.maximum(ds, dsh).max())
            lse, lseh = torch.logsumexp(s, 0), torch.logsumexp(sh, 0)
            a, bh = s - lse, sh - lseh
            p, ph = a.exp(), bh.exp()
            e = 2 * big + 4 * u * ((s - s.max()).abs() + math.log(n) + 1)
            eh = 2 * big + 4 * u * ((sh - sh.max()).abs() + math.log(n) + 1)
            dp, dph = p * (e + (n + 4) * u) * 1.01, ph * (eh + (n + 4) * u) * 1.01
            t = (p * (a - bh)).abs()
            b[0, h] += (dp * (a - bh).abs() + p * (e + eh)).sum() + (n + 2) * u * t.sum()
            tot[0, h] += t.sum()
            d = sh - s
            dd = ds + dsh + u * d.abs()
            dm = dd.max() + n * u * d.abs().mean()
            c = d - d.mean()
            b[1, h] += (2 * c.abs() * (dd + dm) + (dd + dm) ** 2).sum() + (n + 2) * u * (c * c).sum()
            tot[1, h] += (c * c).sum()
            vv, dv = v[h, lo : i + 1].double(), (vh[h, lo : i + 1] - v[h, lo : i + 1]).double()
            for idx, w, dw, x in ((2, ph - p, dp + dph + u * (ph - p).abs(), vv), (3, p, dp, dv), (4, p, dp, vv)):
                o = w @ x
                do = dw @ x.abs() + (n + 1) * u * (w.abs() @ x.abs())
                b[idx, h] += (2 * o.abs() * do + do * do).sum() + (D + 1) * u * (o * o).sum()
                tot[idx, h] += (o * o).sum()
    return 2 * (b + cnt * D * u * tot)
