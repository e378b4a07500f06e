"""The per-layer sensitivity probe for vLLM's 16-bit layers, and the scales it reads from an artifact.

Used by ``kvcal recommend`` (every dtype of its menu) and by ``kvcal calibrate --engine vllm --skip-layers
auto`` (:mod:`kvcal.vllm_skip`): one probe, one scale reader per calibrated dtype (fp8, nvfp4).
"""

from __future__ import annotations


def layer_sensitivity(model, samples, kv_cache_dtype: str, num_layers: int, progress: bool = True,
                      **scales) -> list[float]:
    """``s_l`` for every layer: model-level mean ``KL(P_16bit ‖ P_l)`` (nats, float64) over the
    predicted positions of ``samples`` (int64 ``[T_i]`` each) when only layer ``l`` goes through vLLM's
    ``kv_cache_dtype`` (K, V, and the query where vLLM quantizes it) — :func:`kvcal.evaluate.plans_kl`
    on :func:`kvcal.search.skip_layers.probe_plans`. Cost: ``1 + L`` forward passes per sample."""
    from kvcal.evaluate.protocol_a import plans_kl
    from kvcal.search.skip_layers import probe_plans

    kl = plans_kl(model, samples, probe_plans(kv_cache_dtype, num_layers, **scales), progress=progress)
    return [float(kl[i]) for i in range(num_layers)]


def attention_sensitivity(model, samples, plans: dict, progress: bool = True) -> dict:
    """Per-layer attention-level sensitivity of several cache plans from **one** 16-bit forward per sample:
    ``{name: [e_l per layer]}`` with ``e_l = Σ‖Ô_l − O_l‖² / Σ‖O_l‖²`` (float64 sums over the samples' positions,
    heads and channels), ``O_l`` the layer's exact attention output and ``Ô_l`` the same attention function
    (the model's own: masking, GQA, scaling, softcapping, sliding window) run on the plan's fake-quantized
    query, keys and values of that layer alone (16-bit inputs: every other layer is exact).

    ``samples``: int64 token ids, each ``[T_i]`` (probe text, never the evaluation windows). ``plans``: name ->
    a plan with ``fake_quant(layer, side, x)`` (and ``fake_quant_query(layer, q, num_kv_heads)`` where the
    engine quantizes queries: :class:`~kvcal.vllm_plan.VllmKVPlan`), each quantizing every layer (no 16-bit
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


def vllm_fp8_scales(tensors: dict, metadata: dict, num_layers: int) -> dict:
    """``{"k_scales", "v_scales", "q_scales", "backend"}`` (one float or ``[H_kv]`` tensor per layer, as
    :class:`~kvcal.vllm_plan.VllmKVPlan` takes them) of a ``kvcal calibrate --engine vllm --kv-cache-dtype
    fp8`` artifact's ``tensors``/``metadata``: k/v as vLLM loads them, q from ``...self_attn.q_scale``
    (1.0 where absent), the backend it was calibrated for (``vllm.backend``; ``cuda`` before it was recorded). Used by recommend's probe and by calibrate's ``--skip-layers auto``."""
    from kvcal.artifact.sections import vllm_section
    from kvcal.plan import KVPlan
    from kvcal.vllm_plan import VllmKVPlan

    vp, _ = VllmKVPlan.from_kvcal_plan("fp8", KVPlan.from_artifact(tensors, metadata))
    q = []
    for i in range(num_layers):
        t = tensors.get(f"model.layers.{i}.self_attn.q_scale")
        t = t.float().reshape(-1) if t is not None else None
        q.append(1.0 if t is None else float(t[0]) if t.numel() == 1 else t)
    sec = vllm_section(metadata)
    return {"k_scales": vp.k_scales, "v_scales": vp.v_scales, "q_scales": q, "backend": sec.backend if sec else "cuda"}


def vllm_nvfp4_scales(tensors: dict, num_layers: int) -> dict:
    """``{"k_scales", "v_scales", "q_scales"}`` (one float per layer) of a ``kvcal calibrate --engine vllm
    --kv-cache-dtype nvfp4`` artifact's ``tensors``: the NVFP4 outer scales
    (``model.layers.{i}.self_attn.{k,v}_outer_scale``, exported as vLLM's ``k_scale``/``v_scale``) and the
    FP8 ``q_scale``, as :class:`~kvcal.vllm_plan.VllmKVPlan` takes them. Raises ``KeyError`` naming the
    first missing tensor."""
    from kvcal.search.vllm_nvfp4 import outer_tensor_name

    def one(name):
        if name not in tensors:
            raise KeyError(f"the artifact has no tensor {name}")
        return float(tensors[name].float().reshape(-1)[0])

    return {"k_scales": [one(outer_tensor_name(i, "k")) for i in range(num_layers)],
            "v_scales": [one(outer_tensor_name(i, "v")) for i in range(num_layers)],
            "q_scales": [one(f"model.layers.{i}.self_attn.q_scale") for i in range(num_layers)]}


def vllm_scales(kv_cache_dtype: str, tensors: dict, metadata: dict, num_layers: int) -> dict:
    """The calibrated static scales of a ``kvcal calibrate --engine vllm`` artifact for the probe:
    :func:`vllm_nvfp4_scales` for ``nvfp4*``, :func:`vllm_fp8_scales` for ``fp8``/``fp8_e4m3``. Raises
    ``ValueError`` for a dtype with no calibrated scales."""
    from kvcal.formats.vllm_dtypes import VLLM_DTYPES

    spec = VLLM_DTYPES.get(kv_cache_dtype)
    family = spec.family if spec is not None else None
    if family == "nvfp4":
        return vllm_nvfp4_scales(tensors, num_layers)
    if family == "fp8":
        return vllm_fp8_scales(tensors, metadata, num_layers)
    raise ValueError(f"--kv-cache-dtype {kv_cache_dtype} has no calibrated scales")
