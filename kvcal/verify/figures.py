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
    import statistics

    n = len(served)
    d = [s - p for s, p in zip(served, predicted, strict=True)]
    diff = statistics.fmean(d)
    sd = statistics.stdev(d) if n > 1 else float("inf")
    tol = t_quantile(confidence, n - 1) * sd / math.sqrt(n) + floor
    return {"diff": diff, "tol": tol, "ok": abs(diff) <= tol}


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
    """``{"ppl", "delta_ppl", "kl_mean", "kl_p999", "top1_agree", "tokens"}`` of a run's per-token rows."""
    import torch

    nll = [x for r in run["nll"] for x in r]
    kl = torch.tensor([x for r in run["kl"] for x in r], dtype=torch.float64)
    ref_nll = [x for r in ref["nll"] for x in r]
    ppl, ref_ppl = math.exp(sum(nll) / len(nll)), math.exp(sum(ref_nll) / len(ref_nll))
    top1 = [x for r in run["top1"] for x in r]
    return {"ppl": ppl, "delta_ppl": ppl - ref_ppl, "kl_mean": float(kl.mean()),
            "kl_p999": float(torch.quantile(kl, 0.999)) if kl.numel() > 1 else float(kl.max()),
            "top1_agree": sum(top1) / len(top1), "tokens": len(nll)}
