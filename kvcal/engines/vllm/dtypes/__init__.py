"""Exact torch emulations of vLLM 0.33's ``--kv-cache-dtype`` formats (torch only).

Each dtype is re-stated from vLLM 0.33.0's Python/Triton source (read from the released wheel,
``pip download vllm==0.33.0 --no-deps``); paths below are inside that wheel's ``vllm/`` package,
except ``csrc/...`` (vLLM's CUDA source, compiled into the wheel's ``_C_stable_libtorch.abi3.so``).
Every function works on post-RoPE keys / values shaped ``[B, H_kv, S, D]`` (vLLM quantizes at the
cache write, after RoPE: ``Attention.forward`` → ``do_kv_cache_update``) and on queries shaped
``[B, H_q, S, D]``. Fake-quant functions return float32 tensors of the input's shape (vLLM's
kernels dequantize in fp32); cast as needed.

=========================  ==================================================================
``--kv-cache-dtype``       what is stored per (token, KV head), as vLLM 0.33 writes it
=========================  ==================================================================
``fp8`` / ``fp8_e4m3``      e4m3fn ``sat(x / k_scale)``, static fp32 scale per tensor or per KV
                            head (checkpoint); queries FP8-quantized with static ``q_scale``
``fp8_e5m2``                as fp8 with e5m2 (max 57344); no query quantization (vLLM asserts
                            query quantization only for fp8/fp8_e4m3/nvfp4*)
``fp8_per_token_head``      e4m3fn codes + fp32 scale ``max(amax/448, 1e-6)`` per token & head
``int8_per_token_head``     int8 codes (round half away from zero, clamp [-128, 127]) + fp32
                            scale ``max(amax/127, 1e-6)``
``int4_per_token_head``     randomized Hadamard transform (RHT), then asymmetric 4-bit codes
                            with the 4-bit zero point hidden in the fp32 scale's low mantissa
``nvfp4`` / ``nvfp4_4over6``  E2M1 in 16-channel blocks with e4m3 block scales computed at write
                            time, times the static outer scale ``k_scale`` / ``v_scale``;
                            4over6 keeps per block the lower-error of the max/6 and max/4 scales
``turboquant_*``            keys: Hadamard-rotated unit vector → Lloyd-Max codes + fp16 norm
                            (or raw e4m3 for k8); values: 3/4-bit min/max codes + fp16 scale/zero
=========================  ==================================================================

Details a CPU cannot settle (kernel arithmetic on a GPU) are named once, in the constants of
:mod:`~kvcal.engines.vllm.dtypes.choices`, each with the alternative it excludes. Everything else is IEEE float32 arithmetic in the order
the kernels write it; torch on CPU rounds each float32 op correctly, which is what the tests'
float64 re-statements (rounding to float32 after each op) reproduce.

Modules: :mod:`~kvcal.engines.vllm.dtypes.registry` (the dtypes and backends, :class:`VllmDTypeError`),
:mod:`~kvcal.engines.vllm.dtypes.common` (format constants, shared helpers), :mod:`~kvcal.engines.vllm.dtypes.fp8`
(static FP8 and the FP8 query), :mod:`~kvcal.engines.vllm.dtypes.cpu` (the CPU backend's truncating FP8 write),
:mod:`~kvcal.engines.vllm.dtypes.per_token_head` (fp8/int8/int4 per token-head),
:mod:`~kvcal.engines.vllm.dtypes.nvfp4`, :mod:`~kvcal.engines.vllm.dtypes.turboquant`,
:mod:`~kvcal.engines.vllm.dtypes.dispatch` (one entry point per dtype) and
:mod:`~kvcal.engines.vllm.dtypes.pages` (the page bytes vLLM allocates); the GPU-only choices are in
:mod:`~kvcal.engines.vllm.dtypes.choices` (the emulations read them from there when they run, so setting one there
takes effect).
"""

from __future__ import annotations

from kvcal.engines.vllm.dtypes.common import E2M1_MAX, FP8_E4M3_MAX, FP8_E5M2_MAX, NVFP4_BLOCK
from kvcal.engines.vllm.dtypes.cpu import fp8_e4m3_truncate, fp8_e5m2_truncate
from kvcal.engines.vllm.dtypes.dispatch import (
    check_head_dim,
    fake_quant_kv,
    fake_quant_query,
    fake_quant_side,
)
from kvcal.engines.vllm.dtypes.fp8 import fp8_static_fake_quant, fp8_static_quantize, query_fp8_fake_quant
from kvcal.engines.vllm.dtypes.nvfp4 import _ffma as _ffma  # tests check the FFMA emulation directly
from kvcal.engines.vllm.dtypes.nvfp4 import e2m1_round, nvfp4_dequantize, nvfp4_fake_quant, nvfp4_quantize
from kvcal.engines.vllm.dtypes.pages import boundary_skip_layers, head_slot_bytes, layer_bytes_per_token
from kvcal.engines.vllm.dtypes.per_token_head import (
    int4_per_token_head_dequantize,
    int4_per_token_head_fake_quant,
    int4_per_token_head_quantize,
    int4_query_fake_quant,
    per_token_head_fake_quant,
    per_token_head_quantize,
    rht,
    rht_signs,
)
from kvcal.engines.vllm.dtypes.registry import (
    BACKEND_ALIASES,
    TQ_PRESETS,
    VLLM_BACKENDS,
    VLLM_DTYPE_ALIASES,
    VLLM_DTYPE_FAMILIES,
    VLLM_DTYPES,
    VLLM_VERSION,
    VllmBackend,
    VllmDTypeError,
    VllmKVDType,
    check_backend_serves,
    check_dtypes_served,
    same_vllm_dtype,
    vllm_backend,
    vllm_dtype,
)
from kvcal.engines.vllm.dtypes.turboquant import (
    lloyd_max_centroids,
    turboquant_fake_quant,
    turboquant_key_dequantize,
    turboquant_key_quantize,
    turboquant_value_dequantize,
    turboquant_value_quantize,
)

__all__ = [
    "VLLM_VERSION", "VLLM_DTYPES", "VllmKVDType", "VllmDTypeError", "vllm_dtype", "TQ_PRESETS",
    "fp8_static_quantize", "fp8_static_fake_quant", "query_fp8_fake_quant",
    "per_token_head_quantize", "per_token_head_fake_quant",
    "rht_signs", "rht", "int4_per_token_head_quantize", "int4_per_token_head_dequantize",
    "int4_per_token_head_fake_quant", "int4_query_fake_quant",
    "e2m1_round", "nvfp4_quantize", "nvfp4_dequantize", "nvfp4_fake_quant",
    "lloyd_max_centroids", "turboquant_key_quantize", "turboquant_key_dequantize",
    "turboquant_value_quantize", "turboquant_value_dequantize", "turboquant_fake_quant",
    "fake_quant_kv", "fake_quant_side", "fake_quant_query", "check_head_dim", "head_slot_bytes", "boundary_skip_layers", "layer_bytes_per_token",
    "FP8_E4M3_MAX", "FP8_E5M2_MAX", "E2M1_MAX", "NVFP4_BLOCK", "VllmBackend", "VLLM_BACKENDS", "BACKEND_ALIASES",
    "vllm_backend", "check_backend_serves", "check_dtypes_served", "fp8_e4m3_truncate", "fp8_e5m2_truncate",
    "VLLM_DTYPE_FAMILIES", "VLLM_DTYPE_ALIASES", "same_vllm_dtype",
]
