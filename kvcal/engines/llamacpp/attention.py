"""llama.cpp's CPU flash attention where it accumulates ``P · V`` in fp16 (``VKQ16``).

``ggml_compute_forward_flash_attn_ext_f16_one_chunk`` (``ggml/src/ggml-cpu/ops.cpp``, llama-cpp-python 0.3.36)
walks one query row over the keys in cache order, skipping masked ones, with an online softmax (Rabe & Staats,
arXiv:2112.05682). When the V cache is ``f16`` its accumulator is fp16: on a new maximum
``VKQ16 = fp16(fp32(VKQ16) · ms)`` (``ggml_vec_scale_f16``), then ``VKQ16 = fp16(fma(fp32(v), vs, fp32(VKQ16)))``
(``ggml_vec_mad_f16``, SIMD FMA), with ``ms = expf(M_old - M)``, ``vs = expf(s - M)`` and the f32 sum
``S = S · ms + vs``; the output is ``fp32(VKQ16) · (1/S)``. Every step rounds the accumulator to 11 bits, which
kvcal's f32 attention does not: layer 0 of SmolLM2 ``q8_0/f16``, 512 tokens, 3.4e-3 relative output error.
llama.cpp takes this path for an ``f16`` V cache unless K is ``f16`` too and the ubatch has at least
``GGML_FA_TILE_Q`` (64) query rows (then ``ggml_compute_forward_flash_attn_ext_tiled``, f32 throughout).

Torch only: the numeric primitive :meth:`LlamaCppKVPlan.attention` runs.
"""

from __future__ import annotations

import torch


def flash_attn_f16_accumulator(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                               scale: float, softcap: float | None = None) -> torch.Tensor:
    """Attention as llama.cpp's one-chunk CPU kernel computes it with an ``f16`` V cache.

    ``q`` ``[B, H_q, S_q, D]``: the query rows as the kernel's dot products see them (already converted to the K
    type's ``vec_dot_type``); ``k`` ``[B, H_kv, S_k, D]``: the keys as cached (dequantized); ``v`` ``[B, H_kv, S_k,
    D_v]``: the values, each exactly an fp16 number (an ``f16`` cache); ``H_q`` a multiple of ``H_kv`` (query head
    ``h`` reads KV head ``h // (H_q / H_kv)``, as ``ik2 = iq2 / rk2``). ``allowed``: bool, broadcastable to ``[B,
    H_q, S_q, S_k]``, True where a query reads a key (a masked key is skipped, as ``mv == -INFINITY``).
    ``scale``: the softmax scale applied to ``q · k``; ``softcap``: ``softcap · tanh(scale · q · k / softcap)``
    when given (ggml divides ``scale`` by it first). Scores are float32 products of the given tensors (summed in
    another order than ggml's block dot products: float32 rounding level); ``v · vs`` and its sum with the
    accumulator are rounded separately in float32 where ggml fuses them (float32 level: it can move an fp16
    rounding only when the sum sits within 2^-24 relative of an fp16 tie). Keys are visited in cache order; a
    row that reads no key gives 0 (``S_inv = 0``).

    Returns float32 ``[B, H_q, S_q, D_v]``. Raises ``ValueError`` when ``H_q`` is not a multiple of ``H_kv`` or
    ``v`` holds a value fp16 cannot represent."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads are not a multiple of {Hkv} KV heads")
    v16 = v.to(torch.float16)
    if not torch.equal(v16.to(v.dtype), v):
        raise ValueError("v holds values an fp16 cache cannot: pass the cached (fp16-rounded) values")
    G = Hq // Hkv
    s = torch.matmul(q.float().reshape(B, Hkv, G * Sq, D), k.float().transpose(-1, -2))  # [B, Hkv, G*Sq, Sk]
    if softcap:
        s = softcap * torch.tanh(s * (scale / softcap))
    else:
        s = s * scale
    ok = allowed.expand(B, Hq, Sq, Sk).reshape(B, Hkv, G * Sq, Sk)
    # rows ordered (query position, group) so that the rows a key can be read by form a suffix under a causal mask
    s = s.reshape(B, Hkv, G, Sq, Sk).transpose(2, 3).reshape(B, Hkv, Sq * G, Sk)
    ok = ok.reshape(B, Hkv, G, Sq, Sk).transpose(2, 3).reshape(B, Hkv, Sq * G, Sk)
    R = Sq * G
    any_row = ok.flatten(0, 1).any(0)  # [R, Sk]
    reads = any_row.any(0)
    first = torch.where(reads, any_row.int().argmax(0), R)  # first row reading key t
    last = torch.where(reads, R - 1 - any_row.flip(0).int().argmax(0), -1)  # last row reading key t
    rows = torch.arange(R)[:, None]
    span = (rows >= first) & (rows <= last)  # [R, Sk]
    contiguous = bool((ok | ~span).all())  # every row between the first and last reader of a key reads it
    M = torch.full((B, Hkv, R), float("-inf"))
    S = torch.zeros(B, Hkv, R)
    acc = torch.zeros(B, Hkv, R, Dv, dtype=torch.float16)
    vf = v16.float()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # each step touches <= H_kv·S_q·G·D_v elements: threads cost more than they give
    try:
        _steps(s, ok, first, last, contiguous, M, S, acc, vf)
    finally:
        torch.set_num_threads(threads)
    inv = torch.where(S == 0, 0.0, 1.0 / S)
    out = acc.float() * inv[..., None]  # [B, Hkv, Sq*G, Dv] rows (position, group)
    return out.reshape(B, Hkv, Sq, G, Dv).transpose(2, 3).reshape(B, Hq, Sq, Dv)


def _steps(s, ok, first, last, contiguous, M, S, acc, vf) -> None:
    """The key loop of :func:`flash_attn_f16_accumulator`, updating ``M``, ``S`` and ``acc`` in place."""
    for t in range(s.shape[-1]):
        r0, r1 = int(first[t]), int(last[t]) + 1
        if r0 >= r1:
            continue
        st, Mr, a, Sr = s[..., r0:r1, t], M[..., r0:r1], acc[..., r0:r1, :], S[..., r0:r1]
        # s > M: M = s, ms = expf(M_old - M), vs = 1; else ms = 1, vs = expf(s - M) -- both are exp(x - max(M, s));
        # scaling by ms = 1 leaves an fp16 accumulator unchanged, so every row takes the same two steps
        Mn = torch.maximum(Mr, st)
        ms, vs = torch.exp(Mr - Mn), torch.exp(st - Mn)
        upd = ((a.float() * ms[..., None]).half().float() + vf[:, :, None, t, :] * vs[..., None]).half()
        Sn = Sr * ms + vs
        if contiguous:
            acc[..., r0:r1, :], S[..., r0:r1], M[..., r0:r1] = upd, Sn, Mn
        else:
            al = ok[..., r0:r1, t]
            acc[..., r0:r1, :] = torch.where(al[..., None], upd, a)
            S[..., r0:r1] = torch.where(al, Sn, Sr)
            M[..., r0:r1] = torch.where(al, Mn, Mr)


def allowed_keys(mask: torch.Tensor | None, s_q: int, s_k: int) -> torch.Tensor:
    """Which keys each query reads, from the mask transformers hands an attention function: ``None`` (causal, the
    last ``s_q`` of ``s_k`` positions, as ``sdpa`` reads it with ``is_causal``), a bool mask (True: read) or an
    additive float mask (0: read, the dtype's minimum or ``-inf``: masked). Returns bool ``[B|1, H|1, s_q, s_k]``.
    Raises ``ValueError`` for a float mask holding any other value (a positional bias, which this kernel does not
    model)."""
    if mask is None:
        i = torch.arange(s_q)[:, None] + (s_k - s_q)
        return (torch.arange(s_k)[None, :] <= i)[None, None]
    if mask.dtype == torch.bool:
        return mask[..., -s_k:] if mask.dim() == 4 else mask.reshape(1, 1, s_q, -1)[..., -s_k:]
    m = mask[..., -s_k:]
    masked = m <= torch.finfo(m.dtype).min / 2
    if not bool(((m == 0) | masked).all()):
        raise ValueError("attention mask carries a bias (values other than 0 and masked); not a llama.cpp mask")
    return ~masked
