"""The attention-level sensitivity of cache plans, every layer from one 16-bit forward per sample
(:func:`attention_sensitivity`; engine-agnostic: any plan with ``fake_quant`` and, where the engine quantizes
queries, ``fake_quant_query``). ``kvcal recommend`` ranks which layers to keep at 16 bits with it before measuring
candidates at the model level. Moved from the vLLM probe module (now :mod:`kvcal.engines.vllm.probe`; issue 41).
"""

from __future__ import annotations


def attention_sensitivity(model, samples, plans: dict, progress: bool = True) -> dict:
    """Per-layer attention-level sensitivity of several cache plans from **one** 16-bit forward per sample:
    ``{name: [e_l per layer]}`` with ``e_l = Σ‖Ô_l − O_l‖² / Σ‖O_l‖²`` (float64 sums over the samples' positions,
    heads and channels), ``O_l`` the layer's exact attention output and ``Ô_l`` the same attention function
    (the model's own: masking, GQA, scaling, softcapping, sliding window) run on the plan's fake-quantized
    query, keys and values of that layer alone (16-bit inputs: every other layer is exact).

    ``samples``: int64 token ids, each ``[T_i]`` (probe text, never the evaluation windows). ``plans``: name ->
    a plan with ``fake_quant(layer, side, x)`` (and ``fake_quant_query(layer, q, num_kv_heads)`` where the
    engine quantizes queries: :class:`kvcal.engines.vllm.plan.VllmKVPlan`), each quantizing every layer (no 16-bit
    layers, no boundary rule). Cost: one forward per sample plus ``len(plans)`` attention calls per layer,
    against ``1 + L`` forwards per sample and plan for :func:`layer_sensitivity` (the model-level probe) — what
    lets ``kvcal recommend`` probe its whole menu in seconds. ``e_l`` ranks layers for
    :func:`kvcal.search.skip_layers.choose_skip_layers` (which layers to keep at 16 bits); it is not a
    model-level KL, and the rows built from it are judged on their measured model-level figures. Raises
    ``ValueError`` when ``samples`` is empty."""
    import torch
    from tqdm.auto import tqdm

    from kvcal.capture.hooks import attention_hook, original_attention

    if not len(samples):
        raise ValueError("attention_sensitivity needs at least one sample")
    num: dict = {}
    den: dict = {}

    def cb(module, q, k, v, mask, kwargs):
        i = module.layer_idx
        fn = original_attention(module)
        exact = fn(module, q, k, v, mask, **kwargs)[0].double()
        den[i] = den.get(i, 0.0) + float((exact * exact).sum())
        for name, plan in plans.items():
            qq = plan.fake_quant_query(i, q, k.shape[1]) if hasattr(plan, "fake_quant_query") else q
            kk, vv = plan.fake_quant(i, "k", k), plan.fake_quant(i, "v", v)
            out = fn(module, qq.to(q.dtype), kk.to(k.dtype), vv.to(v.dtype), mask, **kwargs)[0].double()
            num.setdefault(name, {})
            num[name][i] = num[name].get(i, 0.0) + float(((out - exact) ** 2).sum())
        return None

    device = next(model.parameters()).device
    with torch.no_grad(), attention_hook(model, cb):
        for ids in tqdm(samples, desc="attention probe", disable=not progress):
            model(ids.reshape(1, -1).to(device), use_cache=False)
    layers = sorted(den)
    return {name: [num[name].get(i, 0.0) / den[i] if den[i] > 0 else 0.0 for i in layers] for name in plans}


__all__ = ["attention_sensitivity"]
