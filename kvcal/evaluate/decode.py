"""Decode mode: what a server does — prefill through the runtime cache, then one token at a time.

Each window ``[T]`` is split into a prefill of ``P = T - nd`` tokens (``nd = min(decode_tokens,
T - 1)``, at least 1) written through :class:`kvcal.runtime.QuantizedKVCache` in one call, then the
remaining tokens are fed **one at a time** through the same cache (teacher-forced inputs); the
``nd`` next-token distributions (positions ``P-1 .. T-2``) are compared with the unquantized model
(fp32 ``DynamicCache``) on the same positions, with the Protocol A figures of
:class:`kvcal.evaluate.protocol_a.TokenMetrics` (nats). Greedy agreement: from the prefill state,
both generate ``greedy_tokens`` tokens greedily; ``greedy_agree`` is the fraction of sequences whose
tokens are all identical, ``greedy_prefix`` the mean identical-prefix length over
``greedy_tokens``. Windows are decoded ``batch`` at a time (one cache of batch B).
"""

from __future__ import annotations

import torch

from kvcal.evaluate.protocol_a import TokenMetrics


def _greedy(model, cache, first: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy continuation ``[B, n]`` starting with ``first [B]`` (already chosen) through ``cache``."""
    toks = [first]
    for _ in range(n - 1):
        logits = model(toks[-1][:, None], cache=cache, use_cache=True).logits[:, -1]
        toks.append(logits.argmax(-1))
    return torch.stack(toks, 1).cpu()


def decode_eval(
    model,
    windows: torch.Tensor,
    plans: dict[str, object],
    batch: int = 1,
    decode_tokens: int = 128,
    greedy_tokens: int = 32,
    progress: bool = True,
    measure: list | None = None,
) -> dict[str, dict]:
    """Decode-mode figures for several plans (module docstring), plus ``"16-bit"`` (the unquantized
    model through ``DynamicCache``).

    ``windows`` int64 ``[N, T]``; ``plans`` name -> :class:`~kvcal.plan.KVPlan`; ``batch`` windows
    share one cache. Returns name -> ``{"ppl", "delta_ppl", "kl_mean", "kl_p999", "top1_agree",
    "greedy_agree", "greedy_prefix", "tokens"}`` (``tokens`` = ``N · nd``, ``nd = min(decode_tokens, T - 1)``). ``measure``: a
    list receiving ``{"method", "cache_tokens", "allocated_bytes", "expected_bytes"}`` per plan
    (last chunk) — the runtime's measured allocation. Raises ``ValueError`` if ``T < 2``.
    """
    import copy

    from tqdm.auto import tqdm
    from transformers import DynamicCache

    from kvcal.runtime import QuantizedKVCache

    N, T = windows.shape
    if T < 2:
        raise ValueError("decode mode needs windows of at least 2 tokens")
    nd = max(1, min(decode_tokens, T - 1))
    P = T - nd
    G = max(0, min(greedy_tokens, 4096))
    device = next(model.parameters()).device
    ref, accs = TokenMetrics(), {name: TokenMetrics() for name in plans}
    g_same = {name: [] for name in plans}
    g_prefix = {name: [] for name in plans}
    bar = tqdm(total=len(range(0, N, batch)) * (1 + len(plans)), desc=f"decode T={T} B={batch}", disable=not progress)
    with torch.no_grad():
        for i in range(0, N, batch):
            ids = windows[i : i + batch].to(device)
            targets = ids[:, P:].cpu()  # [b, nd]
            rc = DynamicCache(config=model.config)
            out = model(ids[:, :P], cache=rc, use_cache=True)
            first_logits = out.logits[:, -1:].float()
            gen_ref = _greedy(model, copy.deepcopy(rc), first_logits[:, -1].argmax(-1), G) if G else None
            if nd > 1:
                rest = model(ids[:, P : T - 1], cache=rc, use_cache=True).logits.float()
                ref_logits = torch.cat([first_logits, rest], 1)
            else:
                ref_logits = first_logits
            logp_ref = torch.log_softmax(ref_logits.cpu(), -1)  # [b, nd, V]
            ref.add(logp_ref, logp_ref, targets)
            del rc, out
            bar.update()
            for name, plan in plans.items():
                cache = QuantizedKVCache(plan, model.config)
                logits = model(ids[:, :P], cache=cache, use_cache=True).logits[:, -1].float()
                if G:
                    gen = _greedy(model, copy.deepcopy(cache), logits.argmax(-1), G)
                    same = gen == gen_ref
                    g_same[name].extend(same.all(1).tolist())
                    pref = torch.where(same.all(1), torch.full((same.shape[0],), G),
                                       (~same).int().argmax(1))
                    g_prefix[name].extend((pref.float() / G).tolist())
                acc = accs[name]
                acc.add(logp_ref[:, :1], torch.log_softmax(logits.cpu(), -1)[:, None], targets[:, :1], window0=i)
                for j, t in enumerate(range(P, T - 1), start=1):
                    lg = model(ids[:, t : t + 1], cache=cache, use_cache=True).logits[:, -1].float()
                    acc.add(logp_ref[:, j : j + 1], torch.log_softmax(lg.cpu(), -1)[:, None], targets[:, j : j + 1],
                            window0=i)
                if measure is not None and i + batch >= N:
                    measure.append({"method": name, "cache_tokens": cache.get_seq_length(),
                                    "batch": int(ids.shape[0]), "allocated_bytes": cache.allocated_bytes(),
                                    "expected_bytes": cache.expected_bytes()})
                del cache
                bar.update()
    bar.close()
    ref_res = ref.result(None)
    res = {"16-bit": {**ref_res, "delta_ppl": 0.0, "greedy_agree": 1.0 if G else None,
                      "greedy_prefix": 1.0 if G else None}}
    for name, acc in accs.items():
        r = acc.result(ref_res["ppl"], ref)
        r["greedy_agree"] = sum(g_same[name]) / len(g_same[name]) if G else None
        r["greedy_prefix"] = sum(g_prefix[name]) / len(g_prefix[name]) if G else None
        if G:  # one sequence per window: 1.0/0.0 all identical, and the identical-prefix fraction
            r["per_window"].update(greedy_agree=[float(x) for x in g_same[name]], greedy_prefix=list(g_prefix[name]))
        res[name] = r
    return res
