"""The Walsh-Hadamard rotation llama.cpp applies around a quantized KV cache, emulated exactly (torch only).

What the source says (llama.cpp vendored by llama-cpp-python 0.3.36):

* **When.** ``llama_kv_cache::llama_kv_cache`` (``src/llama-kv-cache.cpp``) sets ``attn_rot_k`` when the K
  cache type is quantized (``ggml_is_quantized``: not ``f32``/``f16``/``bf16``), every cached layer has the same
  K head size (``n_embd_head_k_all > 0``) and it is a multiple of 64; ``attn_rot_v`` likewise for V. Both are on
  by default; the environment variable ``LLAMA_ATTN_ROT_DISABLE`` (a non-zero integer) turns both off.
* **Which matrix.** ``ggml_gen_hadamard``: the orthonormal Sylvester-ordered Walsh-Hadamard matrix of size
  ``n`` (entries ``±1/sqrtf(n)``, symmetric, its own inverse). K uses ``n`` = the largest power of two
  ``>= 64`` that divides the head size (``build_input_k_rot``: 64 for ``D = 64``, 128 for 128, 64 for 192);
  V always uses ``n = 64`` (``build_input_v_rot``).
* **Where.** ``llm_graph_context::build_attn`` (``src/llama-graph.cpp``): with ``attn_rot_k``, the post-RoPE
  query and key of every head are multiplied by the K matrix, chunk by chunk of ``n`` along the head
  dimension (``llama_mul_mat_hadamard``, ``src/llama-impl.h``), before the key is written; with
  ``attn_rot_v`` the value is rotated before it is written and the attention output (per head) is rotated
  by the same V matrix afterwards, which undoes it. Scores ``(Hq)·(Hk) = q·k`` are unchanged up to the
  cache's rounding: the rotation only changes what the quantizer sees.
* **How it is computed on CPU.** ``ggml_mul_mat`` carries ``GGML_HINT_SRC0_IS_HADAMARD``, so
  ``ggml_compute_forward_mul_mat`` (``ggml/src/ggml-cpu/ggml-cpu.c``) calls ``ggml_compute_forward_fwht``
  (``ggml/src/ggml-cpu/ops.cpp``) instead of a matrix product: each row is first multiplied by
  ``1.0f/sqrtf((float)n)``, then radix-2 butterflies ``(u, v) -> (u + v, u - v)`` run with strides
  ``1, 2, 4, ..., n/2`` in f32 (the SIMD stages compute ``u - v`` as ``fma(v, -1, u)``, the same single
  rounding). :func:`ggml_fwht` does exactly these operations, so it is bit-exact to the CPU backend.

kvcal's own Hadamard (``kvcal.formats.transforms.walsh_hadamard``) scales after the butterflies; for ``n = 64``
(scale 1/8, exact) the results agree, for other ``n`` they may differ in the last bit, hence this module.
"""

from __future__ import annotations

import math
import os

import torch

from kvcal.errors import KvcalError
from kvcal.formats.transforms import walsh_hadamard

#: The environment variable that disables the rotation (``src/llama-kv-cache.cpp``).
DISABLE_ENV = "LLAMA_ATTN_ROT_DISABLE"

#: The V rotation size (``llama_kv_cache::build_input_v_rot``).
V_ROT = 64


def k_rot_size(head_dim: int) -> int:
    """Rotation size for keys of ``head_dim`` (``build_input_k_rot``: the largest power of two >= 64 dividing
    it); 0 when ``head_dim % 64 != 0`` (no rotation). ``KvcalError`` for a non-positive ``head_dim``."""
    if not isinstance(head_dim, int) or head_dim <= 0:
        raise KvcalError(f"head_dim must be a positive integer, got {head_dim!r}")
    if head_dim % 64:
        return 0
    n = 64
    while head_dim % (2 * n) == 0:
        n *= 2
    return n


def v_rot_size(head_dim: int) -> int:
    """Rotation size for values of ``head_dim``: 64 when ``head_dim % 64 == 0`` (``attn_rot_v``), else 0."""
    if not isinstance(head_dim, int) or head_dim <= 0:
        raise KvcalError(f"head_dim must be a positive integer, got {head_dim!r}")
    return V_ROT if head_dim % 64 == 0 else 0


def rotation_default() -> bool:
    """Whether llama.cpp rotates quantized caches in this environment: ``True`` unless ``LLAMA_ATTN_ROT_DISABLE``
    is set to a non-zero integer (C ``atoi``: leading integer, else 0)."""
    raw = os.environ.get(DISABLE_ENV)
    if raw is None:
        return True
    s = raw.strip()
    sign = -1 if s[:1] == "-" else 1
    s = s[1:] if s[:1] in "+-" else s
    digits = ""
    for ch in s:
        if not ch.isdigit():
            break
        digits += ch
    return (sign * int(digits) if digits else 0) == 0


def ggml_fwht(x: torch.Tensor, n: int) -> torch.Tensor:
    """``ggml_compute_forward_fwht`` on float32 ``x`` ``[..., D]`` (``D % n == 0``): each chunk of ``n``
    consecutive elements of the last axis becomes ``H_n · chunk`` with ``H_n`` the orthonormal Sylvester
    Walsh-Hadamard matrix, computed as ggml does (scale by ``1.0f/sqrtf(n)`` first, then butterflies of stride
    1, 2, ..., n/2, all in f32). Returns float32, same shape. Its own inverse up to f32 rounding. Raises
    ``KvcalError`` for ``n`` not a power of two >= 2, a last dimension not a multiple of ``n``, or a
    non-float input."""
    if not isinstance(n, int) or n < 2 or n & (n - 1):
        raise KvcalError(f"the Hadamard size must be a power of two >= 2, got {n!r}")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise KvcalError("the Hadamard rotation takes a floating-point tensor")
    if x.dim() == 0 or x.shape[-1] % n:
        raise KvcalError(f"the last dimension ({tuple(x.shape)}) must be a multiple of the rotation size {n}")
    scale = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(math.sqrt(n), dtype=torch.float32)  # 1.0f/sqrtf(n)
    # kvcal's one Hadamard: the same f32 butterflies (stride 1, 2, ..., n/2), after ggml's scaling
    return walsh_hadamard(x.float().reshape(-1, n) * scale).reshape(x.shape)


__all__ = ["DISABLE_ENV", "V_ROT", "ggml_fwht", "k_rot_size", "rotation_default", "v_rot_size"]
