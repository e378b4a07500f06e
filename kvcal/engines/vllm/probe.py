"""The per-layer sensitivity probe for vLLM's 16-bit layers, and the scales it reads from an artifact.

Used by ``kvcal recommend`` (every dtype of its menu) and by ``kvcal calibrate --engine vllm --skip-layers
auto`` (:mod:`kvcal.engines.vllm.skip`): one probe, one scale reader per calibrated dtype (fp8, nvfp4). The
attention-level probe recommend runs first is engine-agnostic: :func:`kvcal.evaluate.attention_probe.attention_sensitivity`.
"""

from __future__ import annotations


def layer_sensitivity(model, samples, kv_cache_dtype: str, num_layers: int, progress: bool = True,
                      **scales) -> list[float]:
    """``s_l`` for every layer: model-level mean ``KL(P_16bit ‖ P_l)`` (nats, float64) over the
    predicted positions of ``samples`` (int64 ``[T_i]`` each) when only layer ``l`` goes through vLLM's
    ``kv_cache_dtype`` (K, V, and the query where vLLM quantizes it) — :func:`kvcal.evaluate.plans_kl`
    on :func:`kvcal.engines.vllm.skip_layers.probe_plans`. Cost: ``1 + L`` forward passes per sample."""
    from kvcal.engines.vllm.skip_layers import probe_plans
    from kvcal.evaluate.protocol_a import plans_kl

    kl = plans_kl(model, samples, probe_plans(kv_cache_dtype, num_layers, **scales), progress=progress)
    return [float(kl[i]) for i in range(num_layers)]


def vllm_fp8_scales(tensors: dict, metadata: dict, num_layers: int) -> dict:
    """``{"k_scales", "v_scales", "q_scales", "backend"}`` (one float or ``[H_kv]`` tensor per layer, as
    :class:`~kvcal.engines.vllm.plan.VllmKVPlan` takes them) of a ``kvcal calibrate --engine vllm --kv-cache-dtype
    fp8`` artifact's ``tensors``/``metadata``: k/v as vLLM loads them, q from ``...self_attn.q_scale``
    (1.0 where absent), the backend it was calibrated for (``vllm.backend``; ``cuda`` before it was recorded). Used by recommend's probe and by calibrate's ``--skip-layers auto``."""
    from kvcal.engines.vllm.plan import VllmKVPlan
    from kvcal.engines.vllm.section import vllm_section
    from kvcal.plan import KVPlan

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
    FP8 ``q_scale``, as :class:`~kvcal.engines.vllm.plan.VllmKVPlan` takes them. Raises ``KeyError`` naming the
    first missing tensor."""
    from kvcal.engines.vllm.search_nvfp4 import outer_tensor_name

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
    from kvcal.engines.vllm.dtypes import VLLM_DTYPES

    spec = VLLM_DTYPES.get(kv_cache_dtype)
    family = spec.family if spec is not None else None
    if family == "nvfp4":
        return vllm_nvfp4_scales(tensors, num_layers)
    if family == "fp8":
        return vllm_fp8_scales(tensors, metadata, num_layers)
    raise ValueError(f"--kv-cache-dtype {kv_cache_dtype} has no calibrated scales")
