"""One entry point per dtype: what attention reads back for keys and values (:func:`fake_quant_kv`, one side
:func:`fake_quant_side`) and uses for queries (:func:`fake_quant_query`) under a ``--kv-cache-dtype``, and the
head_dim each dtype can store (:func:`check_head_dim`)."""

from __future__ import annotations

import torch

from kvcal.engines.vllm.dtypes.common import FP8_E4M3_MAX, NVFP4_BLOCK, _cast_fp8, _check_4d, _f32
from kvcal.engines.vllm.dtypes.fp8 import fp8_static_fake_quant, query_fp8_fake_quant
from kvcal.engines.vllm.dtypes.nvfp4 import nvfp4_fake_quant
from kvcal.engines.vllm.dtypes.per_token_head import (
    int4_per_token_head_fake_quant,
    int4_query_fake_quant,
    per_token_head_fake_quant,
)
from kvcal.engines.vllm.dtypes.registry import (
    TQ_PRESETS,
    VLLM_DTYPE_FAMILIES,
    VllmBackend,
    VllmDTypeError,
    check_backend_serves,
    vllm_backend,
    vllm_dtype,
)
from kvcal.engines.vllm.dtypes.turboquant import (
    turboquant_fake_quant,
    turboquant_key_dequantize,
    turboquant_key_quantize,
    turboquant_value_dequantize,
    turboquant_value_quantize,
)


# ---- one entry point per dtype ------------------------------------------------------------------
def fake_quant_kv(name: str, k: torch.Tensor, v: torch.Tensor, *, k_scale=1.0, v_scale=1.0,
                  backend: str | VllmBackend = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """What attention reads back for keys ``k`` and values ``v`` [B, H_kv, S, D] under vLLM
    ``--kv-cache-dtype name`` (fp32 ``(k̂, v̂)``). ``k_scale``/``v_scale``: checkpoint scales for
    the static dtypes (fp8*: per tensor or ``[H_kv]``; nvfp4*: the outer scale, a scalar);
    vLLM's default 1.0 when absent; ignored (must be left at 1.0) for the dynamic dtypes, which
    never read checkpoint scales. ``backend``: :data:`VLLM_BACKENDS` (``cpu`` serves fp8* only, by
    truncation). Raises :class:`VllmDTypeError`."""
    spec = vllm_dtype(name)
    check_backend_serves(backend, name)
    if not spec.static_scales and (_f32(k_scale).reshape(-1).ne(1.0).any() or _f32(v_scale).reshape(-1).ne(1.0).any()):
        raise VllmDTypeError(f"--kv-cache-dtype {name} computes its scales at write time and ignores checkpoint "
                             "k_scale/v_scale; leave them at 1.0")
    if name in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        e5 = name == "fp8_e5m2"
        return (fp8_static_fake_quant(k, k_scale, e5m2=e5, backend=backend),
                fp8_static_fake_quant(v, v_scale, e5m2=e5, backend=backend))
    if name in ("fp8_per_token_head", "int8_per_token_head"):
        kind = name.split("_")[0]
        return per_token_head_fake_quant(k, kind), per_token_head_fake_quant(v, kind)
    if name == "int4_per_token_head":
        return int4_per_token_head_fake_quant(k), int4_per_token_head_fake_quant(v)
    if spec.family == "nvfp4":
        f = name == "nvfp4_4over6"
        return nvfp4_fake_quant(k, k_scale, four_over_six=f), nvfp4_fake_quant(v, v_scale, four_over_six=f)
    return turboquant_fake_quant(name, k, v)


def fake_quant_side(name: str, side: str, x: torch.Tensor, scale=1.0, backend: str | VllmBackend = "cuda"
                    ) -> torch.Tensor:
    """:func:`fake_quant_kv` for one side only (``side`` ``"k"`` or ``"v"``; every vLLM dtype
    quantizes K and V independently): fp32 [B,H,S,D]. ``scale``: that side's static scale;
    ``backend`` as there."""
    if side not in ("k", "v"):
        raise VllmDTypeError(f"side must be 'k' or 'v', got {side!r}")
    spec = vllm_dtype(name)
    check_backend_serves(backend, name)
    if not spec.static_scales and bool(_f32(scale).reshape(-1).ne(1.0).any()):
        raise VllmDTypeError(f"--kv-cache-dtype {name} computes its scales at write time and ignores checkpoint "
                             "k_scale/v_scale; leave them at 1.0")
    if name in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        return fp8_static_fake_quant(x, scale, e5m2=name == "fp8_e5m2", backend=backend)
    if name in ("fp8_per_token_head", "int8_per_token_head"):
        return per_token_head_fake_quant(x, name.split("_")[0])
    if name == "int4_per_token_head":
        return int4_per_token_head_fake_quant(x)
    if spec.family == "nvfp4":
        return nvfp4_fake_quant(x, scale, four_over_six=name == "nvfp4_4over6")
    kb, vb, nc = TQ_PRESETS[name]
    _check_4d(x, "x")
    if side == "v":
        return turboquant_value_dequantize(*turboquant_value_quantize(x, vb))
    if kb == 8:
        return _cast_fp8(x.to(torch.float32), FP8_E4M3_MAX, torch.float8_e4m3fn).to(torch.float32)
    return turboquant_key_dequantize(*turboquant_key_quantize(x, kb), kb, nc)


def fake_quant_query(name: str, q: torch.Tensor, *, q_scale=1.0, num_kv_heads: int | None = None,
                     backend: str | VllmBackend = "cuda") -> torch.Tensor:
    """What attention uses for queries ``q`` [B, H_q, S, D] under ``--kv-cache-dtype name`` on a
    backend that accepts quantized queries: FP8 with ``q_scale`` for fp8/fp8_e4m3/nvfp4*
    (:func:`query_fp8_fake_quant`), the dtype-rounded RHT for int4_per_token_head
    (:func:`int4_query_fake_quant`), else ``q`` itself (as fp32). On a backend without query
    quantization (``cpu``: ``CPUAttentionBackendImpl`` reads the model-dtype query) ``q`` as fp32."""
    spec = vllm_dtype(name)
    if not vllm_backend(backend).quantizes_query:
        return q.to(torch.float32)
    if spec.quantizes_query:
        return query_fp8_fake_quant(q, q_scale, num_kv_heads)
    if name == "int4_per_token_head":
        return int4_query_fake_quant(q)
    return q.to(torch.float32)


def check_head_dim(name: str, head_dim: int) -> None:
    """Refuse a ``head_dim`` the dtype ``name`` cannot store, as vLLM 0.33 would: nvfp4* packs blocks of
    :data:`NVFP4_BLOCK` (16) channels (a multiple of 16); turboquant_* rotates by a Hadamard matrix (a power of
    two). The emulation would otherwise fail mid-run (:func:`nvfp4_quantize`, :func:`~kvcal.engines.vllm.dtypes.turboquant._rotate`) or the page
    bytes come out wrong (:func:`head_slot_bytes`). Raises :class:`VllmDTypeError` naming the dtype and head_dim."""
    D = int(head_dim)
    if VLLM_DTYPE_FAMILIES.get(name) == "nvfp4" and D % NVFP4_BLOCK:
        raise VllmDTypeError(f"{name} needs head_dim a multiple of {NVFP4_BLOCK} (NVFP4 blocks), this model's is {D}")
    if name.startswith("turboquant_") and (D < 1 or D & (D - 1)):
        raise VllmDTypeError(f"{name} needs a power-of-two head_dim (its Hadamard rotation), this model's is {D}")
