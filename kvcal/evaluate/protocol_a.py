"""Protocol A: teacher-forced evaluation with every key and value that attention reads fake-quantized.

Protocol A (``shared/docs/prior-art.md``, "Evaluation conventions"): one forward pass per window
with **every** key and value that attention reads quantized-dequantized by the plan (through the
same attention hook as capture, :func:`kvcal.capture.attention_hook`), compared with the
unquantized model on the same window. For a window ``[T]`` the predicted positions are the first
``T - 1`` (position ``t`` predicts token ``t + 1``); every figure is over those positions:

* perplexity ``exp(mean NLL)`` (nats);
* ``KL(P_16bit ‖ P_quant) = Σ_v p_ref(v)·(log p_ref(v) − log p_quant(v))`` of the next-token
  distribution at every predicted position: mean and 99.9th percentile (nats);
* top-1 agreement: fraction of positions whose argmax token is the same.

One forward path (:func:`protocol_a_logits`) and one KL formula (:func:`kl_terms`) serve all
entry points. They differ in precision and reduction because their consumers do:

* :func:`teacher_forced` (``kvcal evaluate``/``recommend`` rows): log-softmax of float32 logits on
  the CPU, KL per position (float32, then float64 for the mean and the percentile),
  :class:`TokenMetrics`;
* :func:`plans_kl` / :func:`side_sensitivity` (the probes ``kvcal calibrate`` chooses sinks and bit
  widths with): log-softmax of float64 logits, summed over positions and vocabulary in float64
  (one number per plan; no per-position tensor is kept).

A plan is a :class:`~kvcal.plan.KVPlan`, a :class:`~kvcal.engines.vllm.plan.VllmKVPlan`, or anything with
``fake_quant(layer, side, x)`` (``side`` ``"k"``/``"v"``, ``x`` ``[B, H_kv, S, D]``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import contextmanager, nullcontext

import torch

from kvcal.capture.hooks import AttentionOutput, attention_hook


def plan_hook(plan) -> Callable:
    """Attention-hook callback that fake-quantizes K and V of every layer with ``plan``
    (a :class:`~kvcal.plan.KVPlan`), and the post-RoPE query too when the plan has
    ``fake_quant_query(layer, q, num_kv_heads)`` (:class:`~kvcal.engines.vllm.plan.VllmKVPlan`: vLLM's
    FP8 query quantization). A plan whose ``own_attention()`` is True computes the attention itself with
    ``attention(module, q, k, v, mask, kwargs)`` on those tensors (llama.cpp's fp16 ``P · V`` accumulator)."""

    own = getattr(plan, "attention", None) if getattr(plan, "own_attention", lambda: False)() else None

    def cb(module, q, k, v, mask, kwargs):
        i = module.layer_idx
        if hasattr(plan, "fake_quant_query"):
            q, k, v = plan.fake_quant_query(i, q, k.shape[1]), plan.fake_quant(i, "k", k), plan.fake_quant(i, "v", v)
            return AttentionOutput(own(module, q, k, v, mask, kwargs)) if own is not None else (q, k, v)
        return plan.fake_quant(i, "k", k), plan.fake_quant(i, "v", v)

    return cb


def side_only(plan, side: str, layer: int | None = None):
    """A view of ``plan`` that quantizes only ``side`` (``"k"`` or ``"v"``) — of every layer, for
    K-only/V-only splits, or of one ``layer`` (single-side sensitivity probes)."""

    class _One:
        def fake_quant(self, i, s, x):
            return plan.fake_quant(i, s, x) if s == side and layer in (None, i) else x

        def first_quantized_layer(self) -> int:
            return 0 if layer is None else int(layer)

    return _One()


def first_quantized_layer(plan) -> int:
    """The lowest layer index whose attention ``plan`` changes (K, V or query), from the plan's own
    ``first_quantized_layer()`` when it has one (:class:`~kvcal.engines.vllm.plan.VllmKVPlan`, :func:`side_only`
    views); ``0`` otherwise (any layer may be quantized). Every layer below it computes exactly what the
    unquantized model computes."""
    f = getattr(plan, "first_quantized_layer", None)
    return int(f()) if callable(f) else 0


def decoder_layers(model) -> list | None:
    """The model's decoder layers in order (the modules whose ``self_attn.layer_idx`` is ``0..L-1``), or
    ``None`` when they cannot be identified that way (then no prefix is reused)."""
    found = {}
    for m in model.modules():
        idx = getattr(getattr(m, "self_attn", None), "layer_idx", None)
        if isinstance(idx, int) and idx not in found:
            found[idx] = m
    if not found or sorted(found) != list(range(len(found))):
        return None
    return [found[i] for i in range(len(found))]


def _clone(out):
    """A copy of a decoder layer's output (a tensor, or a tuple of them), so later layers cannot alter it."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, tuple):
        return tuple(_clone(o) for o in out)
    return out


class _PrefixReuse:
    """Records each decoder layer's output during the unquantized pass and, for a plan whose first
    quantized layer is ``f``, makes layers ``0..f-1`` return those outputs instead of recomputing them
    (they are the same: nothing below ``f`` is quantized), so that pass costs ``L - f`` layers."""

    def __init__(self, layers: list):
        self.layers, self.out = layers, {}

    @contextmanager
    def record(self):
        handles = [layer.register_forward_hook(lambda m, a, o, i=i: self.out.__setitem__(i, _clone(o)))
                   for i, layer in enumerate(self.layers)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    @contextmanager
    def replay(self, first: int):
        n = min(first, len(self.layers))
        for i in range(n):
            self.layers[i].forward = lambda *a, _o=self.out[i], **k: _clone(_o)
        try:
            yield
        finally:
            for i in range(n):
                self.layers[i].__dict__.pop("forward", None)


def protocol_a_logits(model, ids: torch.Tensor, plan) -> torch.Tensor:
    """Next-token logits ``[B, T - 1, V]`` of ``ids`` int64 ``[B, T]`` (on the model's device) under
    Protocol A: every key and value attention reads fake-quantized by ``plan`` (``None``: the
    unquantized model). Model dtype and device; no KV cache. Call under ``torch.no_grad()``."""
    if plan is None:
        return model(ids, use_cache=False).logits[:, :-1]
    with attention_hook(model, plan_hook(plan)):
        return model(ids, use_cache=False).logits[:, :-1]


def kl_terms(logp_ref: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """Terms ``p_ref · (log p_ref − log p)`` of ``KL(P_ref ‖ P)`` (nats), same shape and dtype as the
    inputs ``[..., V]`` (log-probabilities over the vocabulary); sum over the last axis for the KL
    of each position. Non-negative after the sum, up to rounding."""
    return logp_ref.exp() * (logp_ref - logp)


class TokenMetrics:
    """Running Protocol A figures of one method over predicted positions (add, then :meth:`result`).

    :meth:`add` takes log-probabilities ``[B, n, V]`` float32 of the reference and of the method and
    the target token ids int64 ``[B, n]``; it accumulates the NLL of the targets (float64 sum), the
    argmax agreements and the per-position KL (float32, kept as float64 for the percentile), in total
    and per evaluation window (row ``b`` of the batch is window ``window0 + b``; ``window0`` defaults to the
    next window after those already added, so one call per batch of whole windows needs none)."""

    def __init__(self):
        self.nll, self.n, self.top1 = 0.0, 0, 0
        self.kl: list[torch.Tensor] = []
        self._next = 0
        self._win: dict[int, list] = {}  # window -> [nll sum, positions, top1 count, KL sum]

    def add(self, logp_ref: torch.Tensor, logp: torch.Tensor, targets: torch.Tensor, window0: int | None = None):
        nll = -logp.gather(-1, targets[..., None])[..., 0].double()  # [B, n]
        agree = logp.argmax(-1) == logp_ref.argmax(-1)
        kl = kl_terms(logp_ref, logp).sum(-1)  # [B, n]
        self.nll += float(nll.sum())
        self.n += targets.numel()
        self.top1 += int(agree.sum())
        self.kl.append(kl.flatten().double())
        w0 = self._next if window0 is None else int(window0)
        for b in range(targets.shape[0]):
            acc = self._win.setdefault(w0 + b, [0.0, 0, 0, 0.0])
            acc[0] += float(nll[b].sum())
            acc[1] += targets.shape[-1]
            acc[2] += int(agree[b].sum())
            acc[3] += float(kl[b].double().sum())
        self._next = max(self._next, w0 + targets.shape[0])

    def window_figures(self) -> dict:
        """Per evaluation window, in window order: ``{"nll": mean NLL per position (nats), "kl_mean": mean KL
        per position (nats), "top1_agree": fraction}`` — lists of one float per window, the samples of
        :mod:`kvcal.evaluate.bounds`."""
        ws = [self._win[k] for k in sorted(self._win)]
        return {"nll": [w[0] / w[1] for w in ws], "kl_mean": [w[3] / w[1] for w in ws],
                "top1_agree": [w[2] / w[1] for w in ws]}

    def result(self, ref_ppl: float | None, ref: TokenMetrics | None = None) -> dict:
        """``{"ppl", "tokens", "kl_mean", "kl_p999", "top1_agree", "per_window"}`` and ``"delta_ppl"`` (``ppl −
        ref_ppl``) when ``ref_ppl`` is given. ``kl_p999``: ``torch.quantile(kl, 0.999)`` (linear
        interpolation) over the positions; the max when there is one. ``per_window``: :meth:`window_figures`,
        with ``ref_nll`` (the reference's per-window NLL, same windows) when ``ref`` is given."""
        ppl = math.exp(self.nll / max(self.n, 1))
        kl = torch.cat(self.kl) if self.kl else torch.zeros(1, dtype=torch.float64)
        out = {"ppl": ppl, "tokens": self.n, "kl_mean": float(kl.mean()),
               "kl_p999": float(torch.quantile(kl, 0.999)) if kl.numel() > 1 else float(kl.max()),
               "top1_agree": self.top1 / max(self.n, 1), "per_window": self.window_figures()}
        if ref is not None:
            out["per_window"]["ref_nll"] = ref.window_figures()["nll"]
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
    accs = {name: TokenMetrics() for name in plans}
    ref = TokenMetrics()
    steps = [(i, name) for i in range(0, len(windows), batch_size) for name in [None, *plans]]
    bar = tqdm(total=len(steps), desc="evaluate", disable=not progress)
    with torch.no_grad():
        for i in range(0, len(windows), batch_size):
            ids = windows[i : i + batch_size].to(device)
            targets = ids[:, 1:].cpu()
            logp_ref = torch.log_softmax(protocol_a_logits(model, ids, None).float().cpu(), -1)
            ref.add(logp_ref, logp_ref, targets)
            bar.update()
            for name, plan in plans.items():
                if plan is None:
                    logp = logp_ref
                else:
                    logp = torch.log_softmax(protocol_a_logits(model, ids, plan).float().cpu(), -1)
                accs[name].add(logp_ref, logp, targets)
                bar.update()
    bar.close()
    ref_res = ref.result(None)
    out = {"16-bit": {**ref_res, "delta_ppl": 0.0}}
    for name, acc in accs.items():
        out[name] = acc.result(ref_res["ppl"], ref)
    return out


def side_sensitivity(model, samples: list[torch.Tensor], plan, progress: bool = True,
                     reuse_prefix: bool = True) -> dict[tuple[int, str], float]:
    """Model-level KL when only one layer's side is quantized, for every (layer, side) of ``plan``.

    ``samples``: int64 token ids, each ``[T_i]`` (held-out text; never the evaluation windows).
    ``plan``: a :class:`~kvcal.plan.KVPlan` (its ``sink_tokens`` apply). For each layer ``l`` and
    side ``s`` in ``"k"``, ``"v"`` the model runs teacher-forced with only that side of that layer
    fake-quantized (Protocol A), and the result is the mean over all predicted positions of
    ``KL(P_16bit ‖ P_quant)`` in nats (float64), keyed ``(l, s)``. Samples shorter than
    ``plan.sink_tokens + 2`` are skipped (no predicted position reads a quantized token there);
    ``ValueError`` when none is left. Cost: ``1 + 2·L`` forward passes per sample; memory: one
    ``[T, vocab]`` float64 pair. Used as per-layer weights of a bit allocation (HAWQ-style
    sensitivity, as KVTuner measures it; how well the single-side KLs add up: ``docs/design.md``,
    "Bit allocation").
    """
    keys = [(layer, side) for layer in range(plan.num_layers) for side in ("k", "v")]
    return _mean_kl(model, samples, {key: side_only(plan, key[1], key[0]) for key in keys}, plan.sink_tokens + 2,
                    "sensitivity probe", progress,
                    f"side_sensitivity needs a sample of at least sink_tokens + 2 = {plan.sink_tokens + 2} tokens",
                    reuse_prefix)


def plans_kl(model, samples: list[torch.Tensor], plans: dict, progress: bool = True, reuse_prefix: bool = True) -> dict:
    """Model-level mean ``KL(P_16bit ‖ P_plan)`` in nats over every predicted position of
    ``samples``, for each plan of ``plans`` (any keys; values :class:`~kvcal.plan.KVPlan` or
    anything with ``fake_quant(layer, side, x)``), under Protocol A (every key and value attention
    reads is fake-quantized, sinks as the plan keeps them) — the ``kl_mean`` of
    :func:`teacher_forced` (computed in float64 here), for samples of different lengths.

    ``samples``: int64 token ids, each ``[T_i]`` (held-out text; never the evaluation windows);
    samples shorter than 2 tokens are skipped and ``ValueError`` is raised when none is left.
    Every plan is scored on the same positions, so the results compare directly. Cost:
    ``1 + len(plans)`` forward passes per sample. Used by ``kvcal calibrate`` to choose the sink
    count on held-out samples."""
    return _mean_kl(model, samples, plans, 2, "plan probe", progress, "plans_kl needs a sample of at least 2 tokens",
                    reuse_prefix)


def plans_kl_nll(model, samples: list[torch.Tensor], plans: dict, progress: bool = True,
                 reuse_prefix: bool = True) -> tuple[dict, dict]:
    """:func:`plans_kl` and, from the same forward passes, the mean NLL of the next token (nats per
    predicted position, float64) under each plan and under the unquantized model (key ``"16-bit"``).

    Returns ``(kl, nll)``: ``kl[name]`` as :func:`plans_kl`; ``nll[name]`` and ``nll["16-bit"]``, so
    ``nll[name] − nll["16-bit"]`` is the plan's ΔNLL and ``exp`` of the difference its perplexity
    ratio. Same samples, cost and errors as :func:`plans_kl`."""
    nll: dict = {}
    kl = _mean_kl(model, samples, plans, 2, "plan probe", progress, "plans_kl_nll needs a sample of at least 2 tokens",
                  reuse_prefix, nll_out=nll)
    return kl, nll


def _mean_kl(model, samples: list[torch.Tensor], plans: dict, min_len: int, desc: str, progress: bool,
             too_short: str, reuse_prefix: bool = True, nll_out: dict | None = None) -> dict:
    """Mean ``KL(P_16bit ‖ P_plan)`` (nats, float64) over every predicted position of the samples of
    at least ``min_len`` tokens, for each plan (Protocol A); ``ValueError(too_short)`` when none is.
    Each sample's KL is one float64 sum over positions and vocabulary (:func:`kl_terms`).
    ``nll_out``: when given, filled with each plan's (and ``"16-bit"``'s) mean next-token NLL
    (nats, float64) over the same positions.

    ``reuse_prefix``: a plan whose first quantized layer is ``f`` (:func:`first_quantized_layer`) reuses
    the unquantized pass's outputs of layers ``0..f-1`` (:func:`decoder_layers`) instead of recomputing
    them — the same tensors the full pass would compute, so the result is unchanged; the per-layer probes
    (one plan per layer) then cost about half the layer computations."""
    from tqdm.auto import tqdm

    kl_sum = dict.fromkeys(plans, 0.0)
    nll_sum = dict.fromkeys([*plans, "16-bit"], 0.0)
    n = 0
    device = next(model.parameters()).device
    first = {name: first_quantized_layer(plan) for name, plan in plans.items()}
    layers = decoder_layers(model) if reuse_prefix and any(f > 0 for f in first.values()) else None
    bar = tqdm(total=len(samples) * len(plans), desc=desc, disable=not progress)
    with torch.no_grad():
        for ids in samples:
            ids = ids.reshape(1, -1).to(device)
            if ids.shape[1] < min_len:
                bar.update(len(plans))
                continue
            reuse = _PrefixReuse(layers) if layers else None
            with reuse.record() if reuse else nullcontext():
                logp_ref = torch.log_softmax(protocol_a_logits(model, ids, None).double(), -1)
            n += ids.shape[1] - 1
            targets = ids[0, 1:, None].to(logp_ref.device)
            if nll_out is not None:
                nll_sum["16-bit"] -= float(logp_ref[0].gather(-1, targets).sum())
            for name, plan in plans.items():
                with reuse.replay(first[name]) if reuse else nullcontext():
                    logp = torch.log_softmax(protocol_a_logits(model, ids, plan).double(), -1)
                kl_sum[name] += float(kl_terms(logp_ref, logp).sum())  # float64: >= 0 up to rounding
                if nll_out is not None:
                    nll_sum[name] -= float(logp[0].gather(-1, targets).sum())
                bar.update()
    bar.close()
    if n == 0:
        raise ValueError(too_short)
    if nll_out is not None:
        nll_out.update({k: v / n for k, v in nll_sum.items()})
    return {k: v / n for k, v in kl_sum.items()}
