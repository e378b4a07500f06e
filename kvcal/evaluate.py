"""Model-level evaluation of a KV quantization plan (Protocol A: teacher-forced, fake-quant).

Protocol A (``shared/docs/prior-art.md``, "Evaluation conventions"): one forward pass per window
with **every** key and value that attention reads quantized-dequantized by the plan (through the
same attention hook as capture), compared with the unquantized model on the same window:

* perplexity ``exp(mean NLL)`` over the ``T - 1`` predicted tokens of each window (nats);
* ``KL(P_16bit ‖ P_quant)`` of the next-token distribution at every predicted position: mean and
  99.9th percentile (nats);
* top-1 agreement: fraction of positions whose argmax token is the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kvcal.capture.hooks import attention_hook


def text_windows(tokenizer, text: str, window: int, n_windows: int, skip_windows: int = 0) -> torch.Tensor:
    """Tokenize ``text`` at once (no BOS added) and cut consecutive ``window``-token windows.

    Returns int64 ``[n, window]`` with ``n <= n_windows`` (fewer if the text is short), starting
    after ``skip_windows`` windows (so calibration and evaluation windows can be kept apart).
    Matches the protocol of the baselines in ``shared/docs/prior-art.md``.
    """
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    start = skip_windows * window
    n = min(n_windows, max(0, (len(ids) - start) // window))
    return ids[start : start + n * window].view(n, window)


def plan_hook(plan) -> Callable:
    """Attention-hook callback that fake-quantizes K and V of every layer with ``plan``
    (a :class:`~kvcal.plan.KVPlan`)."""

    def cb(module, q, k, v, mask, kwargs):
        i = module.layer_idx
        return plan.fake_quant(i, "k", k), plan.fake_quant(i, "v", v)

    return cb


def side_only(plan, side: str):
    """A view of ``plan`` that quantizes only ``side`` (``"k"`` or ``"v"``), for K-only/V-only splits."""

    class _One:
        def fake_quant(self, layer, s, x):
            return plan.fake_quant(layer, s, x) if s == side else x

    return _One()


class _Acc:
    def __init__(self):
        self.nll, self.n, self.top1 = 0.0, 0, 0
        self.kl: list[torch.Tensor] = []

    def add(self, logp_ref: torch.Tensor, logp: torch.Tensor, targets: torch.Tensor):
        self.nll += float(-logp.gather(-1, targets[..., None]).sum())
        self.n += targets.numel()
        self.top1 += int((logp.argmax(-1) == logp_ref.argmax(-1)).sum())
        kl = (logp_ref.exp() * (logp_ref - logp)).sum(-1)  # [B, T-1]
        self.kl.append(kl.flatten().double())

    def result(self, ref_ppl: float | None) -> dict:
        ppl = math.exp(self.nll / max(self.n, 1))
        kl = torch.cat(self.kl) if self.kl else torch.zeros(1, dtype=torch.float64)
        out = {"ppl": ppl, "tokens": self.n, "kl_mean": float(kl.mean()),
               "kl_p999": float(torch.quantile(kl, 0.999)) if kl.numel() > 1 else float(kl.max()),
               "top1_agree": self.top1 / max(self.n, 1)}
        if ref_ppl is not None:
            out["delta_ppl"] = ppl - ref_ppl
        return out


def teacher_forced(
    model,
    windows: torch.Tensor,
    plans: dict[str, object],
    batch_size: int = 1,
    progress: bool = True,
) -> dict[str, dict]:
    """Protocol A for several plans on the same windows, in one run.

    ``windows``: int64 ``[N, T]``. ``plans``: name -> :class:`~kvcal.plan.KVPlan` (or anything
    with ``fake_quant(layer, side, x)``), ``None`` meaning the unquantized model. Returns name ->
    ``{"ppl", "delta_ppl", "kl_mean", "kl_p999", "top1_agree", "tokens"}`` and ``"16-bit"`` for the
    reference (KL 0). Units: nats; ``tokens`` = predicted positions ``N · (T − 1)``.
    """
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    accs = {name: _Acc() for name in plans}
    ref = _Acc()
    steps = [(i, name) for i in range(0, len(windows), batch_size) for name in [None, *plans]]
    bar = tqdm(total=len(steps), desc="evaluate", disable=not progress)
    with torch.no_grad():
        for i in range(0, len(windows), batch_size):
            ids = windows[i : i + batch_size].to(device)
            targets = ids[:, 1:].cpu()
            logp_ref = torch.log_softmax(model(ids, use_cache=False).logits[:, :-1].float().cpu(), -1)
            ref.add(logp_ref, logp_ref, targets)
            bar.update()
            for name, plan in plans.items():
                if plan is None:
                    logp = logp_ref
                else:
                    with attention_hook(model, plan_hook(plan)):
                        logits = model(ids, use_cache=False).logits
                    logp = torch.log_softmax(logits[:, :-1].float().cpu(), -1)
                accs[name].add(logp_ref, logp, targets)
                bar.update()
    bar.close()
    ref_res = ref.result(None)
    out = {"16-bit": {**ref_res, "delta_ppl": 0.0}}
    for name, acc in accs.items():
        out[name] = acc.result(ref_res["ppl"])
    return out
