"""Fused candidate evaluation for the key search: fake-quantize K → QKᵀ → softmax → KL vs exact.

For one layer and sequence, with ``q [H_q, T, D]`` (evaluated positions ``qpos [T_q]``),
``k [H_kv, T, D]`` and a key :class:`~kvcal.plan.SidePlan`, returns the attention KL
``Σ_i KL(P_i ‖ P̂_i)`` per KV head (float64 ``[H_kv]``, nats), exactly the quantity
:meth:`kvcal.search.objectives.SequenceCache.key_kl` computes on
:func:`kvcal.plan.quantize_seq` ``(plan, k, sinks)``.

* **torch** (the spec, CPU path): materializes ``k̂`` with the plan's own fake-quant and the
  ``[H_kv, G, T_q, T]`` score tensors.
* **triton**: one program per (query head, block of queries) streams key blocks once, quantizes
  them in registers (static affine per channel, or dynamic per token with a clip ratio, fp16
  parameters rounded like :func:`kvcal.formats.scales.params_from_range`), and keeps an online
  log-sum-exp for both the exact and quantized scores plus ``a = Σ e^{s−m}(s − ŝ)`` so that
  ``KL_i = a/l − (m + log l) + (m̂ + log l̂)`` — no ``T_q × T`` tensor is written.
  Rounding uses ``floor(x + ½)`` where torch rounds half to even: ties (rare in real data) may
  land one code apart, so parity is to float tolerance, not bit-exact.

Dispatch (:func:`key_kl`, the one entry point, through :func:`kvcal.kernels.resolve_backend`, the
backend choice shared with quantize/dequantize): ``backend`` argument or env ``KVCAL_KERNELS`` =
``auto`` (Triton for CUDA tensors when triton is importable and the plan is supported, else torch),
``torch``, or ``triton`` (on CPU needs ``TRITON_INTERPRET=1``; unsupported plans fall back to torch).
Supported by Triton: int keys, static per-tensor/head/channel (with zero point or symmetric), or
dynamic per-token / per-token-group with one group per head (``group_size >= D``); optional key
centering; sink tokens.
"""

from __future__ import annotations

import torch

from kvcal.formats.granularity import PerToken, PerTokenGroup
from kvcal.formats.transforms import Transform
from kvcal.formats.variants import ChannelWidths, Codebook, Rounding, ScaleCoding
from kvcal.kernels import resolve_backend
from kvcal.plan import quantize_seq


def triton_supports(plan, D: int) -> str | None:
    """``None`` when the fused kernel covers ``plan`` (a key SidePlan) for head_dim ``D``, else why not."""
    spec = plan.spec
    if plan.transform is not Transform.NONE:
        return f"{plan.transform.value} keys run on the torch reference"
    if plan.rounding_mode is Rounding.QUERY_AWARE:
        return "keys with query-aware rounding run on the torch reference"
    if plan.channel_widths is ChannelWidths.ALLOCATED:
        return "keys with per-channel bit widths run on the torch reference"
    if plan.codebook is Codebook.LEVELS:
        return "non-uniform levels run on the torch reference"
    if plan.scale_coding is ScaleCoding.LOG8:
        return "log8 scales run on the torch reference"
    if plan.codebook is Codebook.TRELLIS:
        return "trellis-coded sides run on the torch reference"
    if spec.format.kind != "int":
        return f"{spec.format.value} keys run on the torch reference"
    g = spec.granularity
    if spec.dynamic:
        if isinstance(g, PerToken) or (isinstance(g, PerTokenGroup) and spec.effective_channel_group(D) == D):
            return None
        return f"dynamic {g.name} with several groups per head runs on the torch reference"
    return None


def key_kl_torch(cache, plan, sinks: int = 0) -> torch.Tensor:
    """Reference: ``cache.key_kl(quantize_seq(plan, cache.k, sinks))`` (float64 ``[H_kv]``)."""
    return cache.key_kl(quantize_seq(plan, cache.k, sinks))


def key_kl(cache, plan, sinks: int = 0, backend: str | None = None) -> torch.Tensor:
    """Attention KL per KV head of quantizing ``cache.k`` with ``plan`` (float64 ``[H_kv]``).

    ``cache``: a :class:`~kvcal.search.objectives.SequenceCache`; ``plan``: key
    :class:`~kvcal.plan.SidePlan`; ``sinks``: first tokens kept in bfloat16. A sliding-window layer
    (``cache.window > 0``) runs on the torch reference (the Triton kernel's mask is causal only)."""
    D = cache.k.shape[-1]
    window = getattr(cache, "window", 0)

    def unsupported():  # the kernel masks causally only: a sliding-window layer's mask runs on the torch reference
        return triton_supports(plan, D) or (f"a sliding-window layer (W = {window}) runs on the torch reference"
                                            if window else None)

    if resolve_backend(backend, cache.k.device, unsupported) == "torch":
        return key_kl_torch(cache, plan, sinks)
    return key_kl_triton(cache.q, cache.k, cache.qpos, cache.scaling, plan, sinks)


# ---- Triton -----------------------------------------------------------------------------------

def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def attn_kl_kernel(
        q_ptr, k_ptr, qpos_ptr, out_ptr, scale_ptr, zp_ptr, mean_ptr, clip_ptr,
        Tq, T, D, G, scaling, sinks, qmin, qmax, zp_limit,
        MODE: tl.constexpr,  # 0 static affine per channel, 1 dynamic per token
        SYM: tl.constexpr, HAS_MEAN: tl.constexpr, F16_PARAMS: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        hq = tl.program_id(0)
        qb = tl.program_id(1)
        h = hq // G
        offs_q = qb * BLOCK_Q + tl.arange(0, BLOCK_Q)
        offs_d = tl.arange(0, BLOCK_D)
        qmask = offs_q < Tq
        dmask = offs_d < D
        pos = tl.load(qpos_ptr + offs_q, mask=qmask, other=0)
        qv = tl.load(q_ptr + hq * T * D + pos[:, None] * D + offs_d[None, :], mask=qmask[:, None] & dmask[None, :],
                     other=0.0).to(tl.float32)
        if MODE == 0:
            sc = tl.load(scale_ptr + h * D + offs_d, mask=dmask, other=1.0)
            zp = tl.load(zp_ptr + h * D + offs_d, mask=dmask, other=0.0)
        else:
            clip = tl.load(clip_ptr + h)
        if HAS_MEAN:
            mu = tl.load(mean_ptr + h * D + offs_d, mask=dmask, other=0.0)
        m = tl.full((BLOCK_Q,), -float("inf"), tl.float32)
        mh = tl.full((BLOCK_Q,), -float("inf"), tl.float32)
        l_ = tl.zeros((BLOCK_Q,), tl.float32)
        lh = tl.zeros((BLOCK_Q,), tl.float32)
        a = tl.zeros((BLOCK_Q,), tl.float32)
        max_pos = tl.max(tl.where(qmask, pos, 0), axis=0)
        for t0 in range(0, max_pos + 1, BLOCK_T):
            offs_t = t0 + tl.arange(0, BLOCK_T)
            tmask = offs_t < T
            kv = tl.load(k_ptr + h * T * D + offs_t[:, None] * D + offs_d[None, :],
                         mask=tmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
            x = kv
            if HAS_MEAN:
                x = x - mu[None, :]
            if MODE == 0:
                if SYM:
                    c = tl.minimum(tl.maximum(tl.floor(x / sc[None, :] + 0.5), qmin), qmax)
                    xh = c * sc[None, :]
                else:
                    c = tl.minimum(tl.maximum(tl.floor(x / sc[None, :] + zp[None, :] + 0.5), 0.0), qmax)
                    xh = (c - zp[None, :]) * sc[None, :]
            else:
                if SYM:
                    amax = tl.max(tl.where(dmask[None, :], tl.abs(x), 0.0), axis=1) * clip
                    s = amax / qmax
                    s = tl.where(s > 0, s, 1.0)
                    if F16_PARAMS:  # round the scale up to fp16, as params_from_range does
                        s16 = s.to(tl.float16)
                        s16b = (s16.to(tl.int16, bitcast=True) + 1).to(tl.float16, bitcast=True)
                        s = tl.where(s16.to(tl.float32) < s, s16b, s16).to(tl.float32)
                    c = tl.minimum(tl.maximum(tl.floor(x / s[:, None] + 0.5), qmin), qmax)
                    xh = c * s[:, None]
                else:
                    mn = tl.min(tl.where(dmask[None, :], x, float("inf")), axis=1)
                    mx = tl.max(tl.where(dmask[None, :], x, -float("inf")), axis=1)
                    tt = (1.0 - clip) * 0.5 * (mx - mn)
                    lo = mn + tt
                    hi = mx - tt
                    s = (hi - lo) / qmax
                    s = tl.maximum(s, tl.abs(lo) / zp_limit)
                    s = tl.where(s > 0, s, 1.0)
                    if F16_PARAMS:
                        s16 = s.to(tl.float16)
                        s16b = (s16.to(tl.int16, bitcast=True) + 1).to(tl.float16, bitcast=True)
                        s = tl.where(s16.to(tl.float32) < s, s16b, s16).to(tl.float32)
                        zp = (-lo / s).to(tl.float16).to(tl.float32)
                    else:
                        zp = -lo / s
                    c = tl.minimum(tl.maximum(tl.floor(x / s[:, None] + zp[:, None] + 0.5), 0.0), qmax)
                    xh = (c - zp[:, None]) * s[:, None]
            if HAS_MEAN:
                xh = xh + mu[None, :]
            is_sink = offs_t < sinks
            # bf16 round-to-nearest-even by bit arithmetic (the interpreter's cast truncates)
            u = kv.to(tl.int32, bitcast=True)
            u = (u + 0x7FFF + ((u >> 16) & 1)) & -65536
            xh = tl.where(is_sink[:, None], u.to(tl.float32, bitcast=True), xh)
            s_ref = tl.sum(qv[:, None, :] * kv[None, :, :], axis=2) * scaling  # [BQ, BT]
            s_hat = tl.sum(qv[:, None, :] * xh[None, :, :], axis=2) * scaling
            vis = (offs_t[None, :] <= pos[:, None]) & tmask[None, :] & qmask[:, None]
            s_ref = tl.where(vis, s_ref, -float("inf"))
            s_hat = tl.where(vis, s_hat, -float("inf"))
            m_new = tl.maximum(m, tl.max(s_ref, axis=1))
            mh_new = tl.maximum(mh, tl.max(s_hat, axis=1))
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            mh_safe = tl.where(mh_new == -float("inf"), 0.0, mh_new)
            alpha = tl.exp(m - m_safe)
            alpha_h = tl.exp(mh - mh_safe)
            e = tl.exp(s_ref - m_safe[:, None])
            eh = tl.exp(s_hat - mh_safe[:, None])
            d = tl.where(vis, s_ref - s_hat, 0.0)
            l_ = l_ * alpha + tl.sum(e, axis=1)
            lh = lh * alpha_h + tl.sum(eh, axis=1)
            a = a * alpha + tl.sum(e * d, axis=1)
            m = m_new
            mh = mh_new
        kl = a / l_ - (m + tl.log(l_)) + (mh + tl.log(lh))
        tl.store(out_ptr + hq * Tq + offs_q, kl, mask=qmask)

    return attn_kl_kernel


_KERNEL = None


def key_kl_triton(q: torch.Tensor, k: torch.Tensor, qpos: torch.Tensor, scaling: float, plan, sinks: int = 0,
                  block_q: int = 16, block_t: int = 32) -> torch.Tensor:
    """Triton path of :func:`key_kl` (float64 ``[H_kv]``). ``q [H_q, T, D]``, ``k [H_kv, T, D]``."""
    import triton

    from kvcal.formats.scales import zero_point_limit

    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _kernel()
    reason = triton_supports(plan, k.shape[-1])
    if reason is not None:
        raise ValueError(reason)
    spec = plan.spec
    Hq, T, D = q.shape
    Hk = k.shape[0]
    dev = k.device
    q32, k32 = q.float().contiguous(), k.float().contiguous()
    qpos = qpos.to(dev, torch.int32).contiguous()
    Tq = qpos.numel()
    out = torch.empty(Hq, Tq, device=dev, dtype=torch.float32)
    dummy = torch.zeros(1, device=dev, dtype=torch.float32)
    mode = 1 if spec.dynamic else 0
    if mode == 0:
        sc = plan.scale.float().to(dev).expand(1, Hk, 1, D).reshape(Hk, D).contiguous()
        zp = (plan.zero_point.float().to(dev).expand(1, Hk, 1, D).reshape(Hk, D).contiguous()
              if plan.zero_point is not None else torch.zeros(Hk, D, device=dev))
        clip = dummy
    else:
        sc = zp = dummy
        cr = plan.clip_ratio
        clip = (torch.ones(Hk) if cr is None else cr.float().reshape(-1).expand(Hk)).to(dev).contiguous()
    mean = plan.mean.float().to(dev).reshape(Hk, D).contiguous() if plan.centered else dummy
    f16 = spec.scale_dtype == torch.float16
    if mode == 1 and spec.scale_dtype not in (torch.float16, torch.float32):
        raise ValueError("fused kernel supports fp16 or fp32 dynamic scales")
    zpl = float(zero_point_limit(spec.scale_dtype)) if not spec.symmetric else 1.0
    grid = (Hq, triton.cdiv(Tq, block_q))
    _KERNEL[grid](
        q32, k32, qpos, out, sc, zp, mean, clip, Tq, T, D, Hq // Hk, float(scaling), int(sinks),
        float(spec.qmin), float(spec.qmax), zpl,
        MODE=mode, SYM=bool(spec.symmetric), HAS_MEAN=plan.centered, F16_PARAMS=f16,
        BLOCK_Q=block_q, BLOCK_T=block_t, BLOCK_D=triton.next_power_of_2(D),
    )
    return out.double().reshape(Hk, -1).sum(1).cpu()


__all__ = ["key_kl", "key_kl_torch", "key_kl_triton", "triton_supports"]
