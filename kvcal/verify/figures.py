"""kvcal's side of the comparison: the per-token figures of its emulation (:func:`predict`), a run's summary
(:func:`summarize`), and the served-vs-predicted tolerance (:func:`agreement`, a paired t-interval at
:data:`CONFIDENCE`)."""

from __future__ import annotations

import math

#: two-sided confidence of the served-vs-predicted interval
CONFIDENCE = 0.99


def t_quantile(confidence: float, dof: int) -> float:
    """Two-sided Student-t quantile ``t_{(1+confidence)/2, dof}`` (scipy)."""
    from scipy.stats import t

    return float(t.ppf((1 + confidence) / 2, dof))


def agreement(served: list[float], predicted: list[float], floor: float = 0.0,
              confidence: float = CONFIDENCE) -> dict:
    """Served vs predicted per window → ``{"diff", "tol", "ok"}``.

    ``served``/``predicted``: one figure per evaluation window (the same windows, the same tokens), so
    their differences ``d_w`` are paired. The windows are independent samples of the corpus, so the
    mean difference has the t-interval ``t_{(1+c)/2, N−1} · sd(d_w) / √N``; ``floor`` adds what the
    two implementations disagree by without quantization (their 16-bit runs). ``ok``: ``|mean d| ≤ tol``.
    A missing emulation detail (a rounding mode, a flush) biases every window the same way, which this
    interval does not absorb; arithmetic-order noise averages out."""
    diff, h, _ = _mean_half_width([s - p for s, p in zip(served, predicted, strict=True)], confidence)
    tol = h + floor
    return {"diff": diff, "tol": tol, "ok": abs(diff) <= tol}


def _mean_half_width(d: list[float], confidence: float) -> tuple[float, float, float]:
    """``(mean, t_{(1+c)/2, N−1} · sd / √N, sd)`` of paired per-window differences ``d`` (``sd`` infinite for one
    window): the one t-interval :func:`agreement` and :func:`paired_interval` share."""
    import statistics

    n = len(d)
    sd = statistics.stdev(d) if n > 1 else float("inf")
    return statistics.fmean(d), t_quantile(confidence, n - 1) * sd / math.sqrt(n), sd


def paired_interval(d: list[float], confidence: float = CONFIDENCE) -> tuple[float, float, float, float]:
    """Mean, the two-sided ``confidence`` Student-t interval ``mean ± t_{(1+c)/2, N−1} · sd / √N`` of paired
    per-window differences ``d`` (``N >= 2``; windows are independent samples of the corpus), and the sample
    standard deviation: ``(mean, lo, hi, sd)``."""
    m, h, sd = _mean_half_width(d, confidence)
    if len(d) < 2:
        h = float("inf")
    return m, m - h, m + h, sd


def windows_to_decide(mean: float, sd: float, n: int, confidence: float = CONFIDENCE, cap: int = 10_000) -> int | None:
    """How many windows would put 0 outside the interval of :func:`paired_interval` if the mean difference and
    its spread stayed as observed: the least ``N`` with ``t_{(1+c)/2, N−1} · sd / √N < |mean|`` (searched from
    ``n``); ``None`` when no ``N <= cap`` would (a mean of 0, or a difference far below its spread)."""
    if mean == 0 or not math.isfinite(sd):
        return None
    if sd == 0:
        return n
    return _least_windows(abs(mean), sd, max(n, 2), 0.0, confidence, cap)


def _least_windows(target: float, sd: float, start: int, floor: float, confidence: float,
                   cap: int = 10_000) -> int | None:
    """The least ``N >= start`` with ``t_{(1+c)/2, N−1} · sd / √N + floor < target`` (searched one by one up to 64,
    then in steps of ~10%), or ``None`` when no ``N <= cap`` reaches it."""
    k = start
    while k <= cap:
        if t_quantile(confidence, k - 1) * sd / math.sqrt(k) + floor < target:
            return k
        k = k + 1 if k < 64 else int(k * 1.1) + 1
    return None


def served_gain(ckpt: dict, default: dict, ref: dict, confidence: float = CONFIDENCE) -> dict:
    """The served gain of a checkpoint's scales over the engine's default scales (1.0), from the same engine run.

    ``ckpt`` / ``default`` / ``ref``: the served runs (``{"nll": [[per token] per window], "kl": ...}``) of the dtype
    with the checkpoint's scales, of the same dtype at 1.0, and of the 16-bit cache, on the same windows. Per
    window ``w``: ``d_KL(w)`` = mean KL(ckpt) − mean KL(default) (both against the 16-bit run, nats per token) and
    ``d_PPL(w) = PPL16 · (mean NLL(ckpt) − mean NLL(default))`` (first order, as :func:`agreement`'s ΔPPL). Each gets
    a paired t-interval (:func:`paired_interval`); the KL ratio is ``mean KL(ckpt) / mean KL(default)`` with the
    interval of ``d_KL`` divided by ``mean KL(default)`` (the default's mean taken as fixed: the interval of the
    ratio conditional on it). Verdict: ``FAIL`` when the checkpoint serves worse beyond the interval (the lower
    bound of ``d_KL`` or of ``d_PPL`` above 0); ``PASS`` when its KL is lower beyond the interval (upper bound of
    ``d_KL`` below 0) and ΔPPL not worse beyond its interval; else ``inconclusive``, with ``windows_needed``
    (:func:`windows_to_decide` on ``d_KL``). Returns ``{"kl_ratio", "kl_ratio_ci", "kl_diff", "kl_diff_ci",
    "dppl_diff", "dppl_diff_ci", "confidence", "windows", "verdict", "windows_needed"}``."""
    kc, kd = _window_means(ckpt["kl"]), _window_means(default["kl"])
    nll16 = [x for r in ref["nll"] for x in r]
    ppl16 = math.exp(sum(nll16) / len(nll16))
    dk = [a - b for a, b in zip(kc, kd, strict=True)]
    dp = [ppl16 * (a - b) for a, b in zip(_window_means(ckpt["nll"]), _window_means(default["nll"]), strict=True)]
    mk, lk, hk, sdk = paired_interval(dk, confidence)
    mp, lp, hp, _ = paired_interval(dp, confidence)
    base = sum(kd) / len(kd)
    ratio = (sum(kc) / len(kc)) / base if base > 0 else float("nan")
    ratio_ci = [1 + lk / base, 1 + hk / base] if base > 0 else [float("nan")] * 2
    if lk > 0 or lp > 0:
        verdict = "FAIL"
    elif hk < 0 and lp <= 0:
        verdict = "PASS"
    else:
        verdict = "inconclusive"
    need = windows_to_decide(mk, sdk, len(dk), confidence) if verdict == "inconclusive" else None
    return {"kl_ratio": ratio, "kl_ratio_ci": ratio_ci, "kl_diff": mk, "kl_diff_ci": [lk, hk], "dppl_diff": mp,
            "dppl_diff_ci": [lp, hp], "confidence": confidence, "windows": len(dk), "verdict": verdict,
            "windows_needed": need}


def gain_line(g: dict, backend: str | None = None) -> str:
    """The line ``kvcal verify`` prints for :func:`served_gain`'s figures (and, for the CPU backend, what gain to
    expect there)."""
    lo, hi = g["kl_ratio_ci"]
    pl, ph = g["dppl_diff_ci"]
    c = int(round(g["confidence"] * 100))
    v = g["verdict"]
    if v == "inconclusive":
        v += (f" ({g['windows_needed']} windows would decide it at this difference)" if g["windows_needed"] else
              " (no difference the windows can resolve)")
    line = (f"served gain over vLLM's default scales (1.0): KL {g['kl_ratio']:.3f}x [{lo:.3f}x, {hi:.3f}x], "
            f"ΔPPL {g['dppl_diff']:+.4f} [{pl:+.4f}, {ph:+.4f}] ({c}% paired t over {g['windows']} windows): {v}")
    if backend == "cpu":
        line += ("\nnote: vLLM's CPU build writes FP8 by truncation toward zero: scales searched for the GPU's rounding "
                 "write gain little or nothing there (truncation's error dominates whatever the scale); "
                 "`kvcal calibrate --engine vllm --kv-cache-dtype fp8 --backend cpu` searches for that write")
    return line


def resolve_check(ag: dict, resolve: float, n: int, floor: float = 0.0, confidence: float = CONFIDENCE) -> dict:
    """Whether an :func:`agreement` can tell what it exists to tell: served = predicted must separate kvcal's
    emulation of the engine's write path from the other write path (rounding vs truncation), whose predictions
    differ by ``resolve`` (the same figure, same windows). Adds to ``ag`` (and returns it) ``resolve``,
    ``decided`` (``tol < resolve``: a wrong write path would fall outside the tolerance) and ``windows_needed``
    (when undecided: the least ``N`` with ``t_{(1+c)/2, N−1} · sd / √N + floor < resolve`` for the observed
    per-window spread ``sd`` — recovered from ``tol`` — or ``None`` when no ``N`` up to 10,000 would, e.g. when the
    floor alone reaches ``resolve``)."""
    ag["resolve"] = resolve
    ag["decided"] = ag["tol"] < resolve
    ag["windows_needed"] = None
    if not ag["decided"] and n > 1 and resolve > floor:
        sd = (ag["tol"] - floor) * math.sqrt(n) / t_quantile(confidence, n - 1)
        ag["windows_needed"] = _least_windows(resolve, sd, n + 1, floor, confidence)
    return ag


def _window_means(rows: list[list[float]]) -> list[float]:
    return [sum(r) / len(r) for r in rows]


def predict(model, windows, plans: dict, chunk_rows: int = 256) -> dict:
    """kvcal's per-window figures for ``plans`` (name → VllmKVPlan) against ``model``'s 16-bit run, on
    ``windows`` int64 ``[N, T]``: name → ``{"nll": [[T−1 per window]], "kl": ..., "top1": ...}`` and
    ``"16-bit"`` (KL 0). NLL and KL in nats from float32 logits, reduced in float64.

    Memory: the 16-bit run's float32 log-probabilities of one window and one run's logits (``[T−1, V]``
    float32 each: 1.07 GB apiece for Gemma 3's 262,144-token vocabulary at 1,024 tokens), and ``chunk_rows``
    positions at a time in float64 for the KL; every operation is row-wise, so the figures do not depend on
    the chunking."""
    import torch

    from kvcal.evaluate.protocol_a import kl_terms, protocol_a_logits

    out = {name: {"nll": [], "kl": [], "top1": []} for name in ["16-bit", *plans]}
    with torch.no_grad():
        for w in windows:
            ids = w[None]
            tgt = ids[0, 1:]
            n = tgt.shape[0]
            parts = [(a, min(a + chunk_rows, n)) for a in range(0, n, chunk_rows)]
            logits = protocol_a_logits(model, ids, None)[0]
            lr32 = torch.empty(logits.shape, dtype=torch.float32)
            for a, b in parts:
                lr32[a:b] = torch.log_softmax(logits[a:b].float(), -1)
            del logits
            out["16-bit"]["nll"].append((-lr32.gather(-1, tgt[:, None]).double())[:, 0].tolist())
            out["16-bit"]["kl"].append([0.0] * n)
            out["16-bit"]["top1"].append([1] * n)
            for name, plan in plans.items():
                logits = protocol_a_logits(model, ids, plan)[0]
                nll, kl, top1 = [], [], []
                for a, b in parts:
                    lr = lr32[a:b].double()
                    lp = torch.log_softmax(logits[a:b].float(), -1).double()
                    nll += (-lp.gather(-1, tgt[a:b, None]))[:, 0].tolist()
                    kl += kl_terms(lr, lp).sum(-1).tolist()
                    top1 += (lr.argmax(-1) == lp.argmax(-1)).int().tolist()
                del logits
                out[name]["nll"].append(nll)
                out[name]["kl"].append(kl)
                out[name]["top1"].append(top1)
    return out


def summarize(run: dict, ref: dict) -> dict:
    """``{"ppl", "delta_ppl", "kl_mean", "kl_p999", "top1_agree", "tokens", "per_window"}`` of a run's per-token rows
    (``per_window``: the per-window means :func:`kvcal.evaluate.bounds.judge_bounded` bounds)."""
    import torch

    nll = [x for r in run["nll"] for x in r]
    kl = torch.tensor([x for r in run["kl"] for x in r], dtype=torch.float64)
    ref_nll = [x for r in ref["nll"] for x in r]
    ppl, ref_ppl = math.exp(sum(nll) / len(nll)), math.exp(sum(ref_nll) / len(ref_nll))
    top1 = [x for r in run["top1"] for x in r]
    return {"ppl": ppl, "delta_ppl": ppl - ref_ppl, "kl_mean": float(kl.mean()),
            "kl_p999": float(torch.quantile(kl, 0.999)) if kl.numel() > 1 else float(kl.max()),
            "top1_agree": sum(top1) / len(top1), "tokens": len(nll),
            "per_window": {"nll": _window_means(run["nll"]), "ref_nll": _window_means(ref["nll"]),
                           "kl_mean": _window_means(run["kl"]), "top1_agree": _window_means(run["top1"])}}
