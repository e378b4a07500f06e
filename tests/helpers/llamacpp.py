"""Independent numpy re-statements of llama.cpp's C arithmetic for the tests of ``kvcal.engines.llamacpp``:
the byte layouts of ggml's block structs (``ggml/src/ggml-common.h``), the x86 AVX ``quantize_row_q8_0`` and the
scalar ``quantize_row_iq4_nl_impl`` (``ntry = -1``), written from the C source line by line with numpy float32
scalars (C's ``float`` arithmetic, no FMA), and a Sylvester Hadamard matrix in float64. They share no code with
the package."""

from __future__ import annotations

import numpy as np

F32 = np.float32
KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def sylvester(n: int) -> np.ndarray:
    """The orthonormal Sylvester Walsh-Hadamard matrix of size ``n`` (float64): ``[[1,1],[1,-1]]`` Kronecker
    powers over ``sqrt(n)`` — ``ggml_gen_hadamard``'s recursion ``H[i+s][j] = H[i][j+s] = H[i][j]``,
    ``H[i+s][j+s] = -H[i][j]``."""
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def q8_0_avx_block(x: np.ndarray) -> tuple[np.float16, np.ndarray]:
    """``quantize_row_q8_0``, AVX/AVX2 branch (``ggml/src/ggml-cpu/arch/x86/quants.c``), one block of 32 f32:
    ``d = maxScalar / 127.f``; ``id = maxScalar != 0 ? 127.f / maxScalar : 0``; ``_mm256_round_ps(v*id,
    _MM_ROUND_NEAREST)`` (ties to even: ``np.rint``); ``packs`` saturation to int8."""
    x = x.astype(F32)
    amax = F32(np.max(np.abs(x)))
    d = F32(amax / F32(127))
    idm = F32(F32(127) / amax) if amax != 0 else F32(0)
    q = np.clip(np.rint((x * idm).astype(F32)), -128, 127).astype(np.int8)
    return np.float16(d), q


def iq4_nl_block(x: np.ndarray) -> tuple[np.float16, np.ndarray]:
    """``quantize_row_iq4_nl_ref`` of one block (``quantize_row_iq4_nl_impl(32, 32, ..., NULL, ntry=-1)``,
    ``ggml/src/ggml-quants.c``), statement by statement in numpy float32 scalars. Returns ``(fp16 d, codes)``."""
    x = [F32(v) for v in x]
    weight = [F32(v * v) for v in x]
    amax, mx = F32(0), F32(0)
    for v in x:
        ax = F32(abs(v))
        if ax > amax:
            amax, mx = ax, v
    if amax < F32(1e-15):
        return np.float16(0), np.zeros(32, dtype=np.int64)
    d = F32(mx / F32(KVALUES[0]))
    idv = F32(F32(1) / d)
    sumqx, sumq2 = F32(0), F32(0)
    L = []
    for j in range(32):
        al = F32(idv * x[j])
        lo = best_index_int8(al)
        L.append(lo)
        q = F32(KVALUES[lo])
        w = weight[j]
        sumqx = F32(sumqx + F32(F32(w * q) * x[j]))
        sumq2 = F32(sumq2 + F32(F32(w * q) * q))
    d = F32(sumqx / sumq2) if sumq2 > 0 else F32(0)
    # for (itry = -ntry; itry <= ntry; ...) with ntry = -1: no iteration
    return np.float16(d), np.array(L)


def best_index_int8(x: np.float32) -> int:
    """``best_index_int8(16, kvalues_iq4nl, x)``: binary search, then the nearer neighbour (the upper on a tie)."""
    val = KVALUES
    if x <= val[0]:
        return 0
    if x >= val[15]:
        return 15
    ml, mu = 0, 15
    while mu - ml > 1:
        mav = (ml + mu) // 2
        if x < val[mav]:
            mu = mav
        else:
            ml = mav
    return mu - 1 if F32(x - F32(val[mu - 1])) < F32(F32(val[mu]) - x) else mu


def pack(blocks) -> np.ndarray:
    """The bytes of ggml's block structs (``ggml-common.h``) for a ``kvcal`` :class:`Blocks` of rows
    ``[N, nb]``: ``uint8 [N * nb, type_size]`` — ``d`` (fp16, little-endian), ``m`` (``_1`` types), ``qh``
    (``_5`` types: bit ``j`` = 5th bit of element ``j``, uint32 little-endian), ``qs`` (4-bit types: byte ``j`` =
    element ``j`` | element ``j + 16`` << 4; ``q8_0``: int8 codes)."""
    d = blocks.d.reshape(-1).numpy().astype("<f2").view(np.uint8).reshape(-1, 2)
    c = blocks.codes.reshape(-1, 32).numpy().astype(np.int64)
    parts = [d]
    if blocks.m is not None:
        parts.append(blocks.m.reshape(-1).numpy().astype("<f2").view(np.uint8).reshape(-1, 2))
    if blocks.type == "q8_0":
        parts.append(c.astype(np.int8).view(np.uint8))
        return np.concatenate(parts, axis=1)
    if blocks.type in ("q5_0", "q5_1"):
        qh = ((c >> 4) & 1) << np.arange(32)
        parts.append(qh.sum(1).astype("<u4").view(np.uint8).reshape(-1, 4))
    lo, hi = c[:, :16] & 15, c[:, 16:] & 15
    parts.append((lo | (hi << 4)).astype(np.uint8))
    return np.concatenate(parts, axis=1)
