"""ggml's KV-cache block formats, emulated exactly in torch: what llama.cpp stores for ``--cache-type-k/-v``.

Every quantized type here stores blocks of 32 values along the last axis (a row of the cache is one KV head's
``head_dim`` values of one token) with an IEEE fp16 scale ``d`` (and, for the ``_1`` types, an fp16 minimum
``m``). Sources, llama.cpp as vendored by llama-cpp-python 0.3.36 (``vendor/llama.cpp``):

* **What the cache write calls.** The K/V write is ``ggml_set_rows`` (``src/llama-kv-cache.cpp``
  ``llama_kv_cache::cpy_k`` / ``cpy_v``); on the CPU backend ``ggml_compute_forward_set_rows_f32``
  (``ggml/src/ggml-cpu/ops.cpp``) converts each f32 row with ``from_float`` of the destination type's
  ``type_traits_cpu`` (``ggml/src/ggml-cpu/ggml-cpu.c``). For ``q4_0``, ``q4_1``, ``q5_0``, ``q5_1`` and
  ``iq4_nl`` that is ``quantize_row_<t>`` in ``ggml/src/ggml-cpu/quants.c``, which only calls the reference
  ``quantize_row_<t>_ref`` of ``ggml/src/ggml-quants.c``. For ``q8_0`` it is the architecture's
  ``quantize_row_q8_0``: on x86 with AVX/AVX2 (``ggml/src/ggml-cpu/arch/x86/quants.c``; the default of a
  ``GGML_NATIVE=OFF`` x86 build, whose ``GGML_AVX``/``GGML_AVX2`` default on) it differs from
  ``quantize_row_q8_0_ref``: multiplier ``127/amax`` instead of ``1/(amax/127)`` and
  ``_mm256_round_ps(_MM_ROUND_NEAREST)`` (ties to even) instead of ``roundf`` (ties away from zero).
  ``impl="x86_avx"`` (default) emulates the AVX path, ``impl="ref"`` the reference (a build without AVX:
  ``arch-fallback.h`` maps ``quantize_row_q8_0`` to ``quantize_row_q8_0_generic`` = ``_ref``). Other
  architectures' SIMD paths (ARM NEON, ...) are not emulated.
* **Reference quantizers** (``ggml-quants.c``): ``q4_0``/``q5_0``: ``max`` = the signed element of largest
  magnitude (first one on ties), ``d = max / -8`` (``/ -16``), ``id = 1/d``, code
  ``min(15, (int8_t)(x*id + 8.5f))`` (``31``, ``16.5f``) — truncation of an f32 sum; ``q4_1``/``q5_1``:
  ``d = (max - min) / 15`` (``/ 31``), code ``(int8_t)((x - min)*id + 0.5f)`` capped at 15 (``q5_1``:
  ``(uint8_t)(...)``, no cap, 5 low bits kept); ``q8_0``: ``d = amax / 127``, ``roundf(x / d)`` through
  ``id = 1/d``; ``q8_1`` (the query format for ``_1`` keys, never a cache type) as ``q8_0`` plus
  ``s = fp16(d * Σ codes)`` with the unrounded ``d``. Every code is computed from the f32 ``d``; the block
  stores ``fp16(d)`` (``GGML_FP32_TO_FP16``: round to nearest even, as torch's ``float16``).
* **iq4_nl** (``quantize_row_iq4_nl_ref`` → ``quantize_row_iq4_nl_impl`` with ``ntry = -1`` and no
  importance weights): codes index :data:`IQ4_NL_VALUES` (``kvalues_iq4nl``, ``ggml-common.h``), chosen by
  ``best_index_int8`` (nearest table entry, the upper one on an exact tie) of ``x / (max / -127)``;
  the stored scale is the weighted least-squares ``d = Σ w·q·x / Σ w·q²`` with ``w = x²`` (f32 sums in
  element order; ggml-base is compiled without FMA, so no contraction); with ``ntry = -1`` the scale-search
  loop ``for itry in -ntry..ntry`` runs zero times, so no other scale is tried. A block with
  ``amax < 1e-15`` (``GROUP_MAX_EPS``) stores ``d = 0`` (its codes are whatever the stack held: any code
  dequantizes to 0; code 0 here).
* **Dequantizers** (``dequantize_row_<t>``, ``ggml-quants.c``; what flash attention's ``v_to_float`` calls
  for V): ``(c - 8)*d``, ``(c - 16)*d``, ``c*d + m`` (two f32 roundings), ``q*d``, ``d*kvalues[c]``.
* **Sizes** (``type_traits`` in ``ggml/src/ggml.c``; block structs in ``ggml-common.h``): see :data:`GGML_TYPES`.

``f16`` / ``bf16`` rows are written by ``ggml_cpu_fp32_to_fp16`` / ``ggml_cpu_fp32_to_bf16`` (round to nearest
even); ``f32`` is stored as is. torch only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcal.errors import KvcalError

#: Elements per block of every quantized type here (``QK4_0 = QK4_1 = QK5_0 = QK5_1 = QK8_0 = QK4_NL = 32``).
QK = 32

#: ``kvalues_iq4nl`` (``ggml/src/ggml-common.h``): the 16 non-uniform levels of iq4_nl, in units of ``d``.
IQ4_NL_VALUES: tuple[int, ...] = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)

#: ``GROUP_MAX_EPS`` of ``ggml-quants.c``: an iq4_nl block whose absmax is below it stores ``d = 0``.
GROUP_MAX_EPS = 1e-15

IMPLS = ("x86_avx", "ref")

#: Elements per ``q8_K`` block (``QK_K``, ``ggml-common.h``): the type llama.cpp's CPU backend converts a matmul's
#: input to when the weight is a K-quant (``q2_K`` .. ``q6_K``; ``type_traits_cpu[t].vec_dot_type``).
QK_K = 256

#: weight types (lower case, as ``gguf``'s ``GGMLQuantizationType`` names them) whose matmul input is ``q8_K``
K_QUANT_WEIGHTS = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k")


@dataclass(frozen=True)
class GgmlType:
    """One ggml tensor type as the KV cache uses it.

    ``name``: ggml's name (``ggml_type_name``, what ``-ctk``/``-ctv`` take). ``blck_size``: elements per
    block; ``type_size``: bytes per block (``type_traits[t].blck_size`` / ``.type_size``, ``ggml/src/ggml.c``).
    ``vec_dot_type``: the type flash attention converts queries to before the dot products with keys of this
    type (``type_traits_cpu[t].vec_dot_type``, ``ggml/src/ggml-cpu/ggml-cpu.c``). ``quantized``:
    ``ggml_is_quantized`` (block-quantized with a scale)."""

    name: str
    blck_size: int
    type_size: int
    vec_dot_type: str
    quantized: bool

    def row_bytes(self, n: int) -> int:
        """Bytes of a row of ``n`` elements (``ggml_row_size``); ``KvcalError`` unless ``n`` is a positive
        multiple of :attr:`blck_size`."""
        if not isinstance(n, int) or n <= 0 or n % self.blck_size:
            raise KvcalError(f"a {self.name} row needs a positive multiple of {self.blck_size} elements, got {n!r}")
        return n // self.blck_size * self.type_size


#: ggml types by name: sizes from ``ggml.c`` ``type_traits`` (block structs ``block_q4_0`` = fp16 d + 16 bytes,
#: ``block_q4_1`` = d, m + 16, ``block_q5_0`` = d + 4 (qh) + 16, ``block_q5_1`` = d, m + 4 + 16,
#: ``block_q8_0`` = d + 32, ``block_q8_1`` = d, s + 32, ``block_iq4_nl`` = d + 16).
GGML_TYPES: dict[str, GgmlType] = {t.name: t for t in (
    GgmlType("f32", 1, 4, "f32", False),
    GgmlType("f16", 1, 2, "f16", False),
    GgmlType("bf16", 1, 2, "bf16", False),
    GgmlType("q8_0", QK, 34, "q8_0", True),
    GgmlType("q4_0", QK, 18, "q8_0", True),
    GgmlType("q4_1", QK, 20, "q8_1", True),
    GgmlType("iq4_nl", QK, 18, "q8_0", True),
    GgmlType("q5_0", QK, 22, "q8_0", True),
    GgmlType("q5_1", QK, 24, "q8_1", True),
    GgmlType("q8_1", QK, 36, "q8_1", True),
)}

#: ``--cache-type-k`` / ``--cache-type-v`` values llama.cpp accepts (``kv_cache_types``, ``common/arg.cpp``).
KV_CACHE_TYPES: tuple[str, ...] = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")


def ggml_type(name: str, *, cache: bool = True) -> GgmlType:
    """The :class:`GgmlType` called ``name``; ``KvcalError`` naming the accepted values for an unknown one
    (``cache``: only the KV-cache types of :data:`KV_CACHE_TYPES`, as ``common/arg.cpp`` accepts)."""
    ok = KV_CACHE_TYPES if cache else tuple(GGML_TYPES)
    if name not in ok:
        raise KvcalError(f"unknown llama.cpp cache type {name!r}; choose one of {', '.join(ok)}")
    return GGML_TYPES[name]


@dataclass(frozen=True)
class Blocks:
    """A row-quantized tensor as ggml stores it, unpacked: ``d`` float16 ``[..., nb]`` (the block scales),
    ``m`` float16 ``[..., nb]`` (block minimums of ``q4_1``/``q5_1``, else ``None``), ``codes`` int16
    ``[..., nb, 32]`` (the stored codes: unsigned 4/5-bit codes, iq4_nl table indices, signed 8-bit values
    for ``q8_0``/``q8_1``), ``s`` float16 ``[..., nb]`` (``q8_1``'s ``fp16(d · Σ codes)``, else ``None``) and
    the ``type`` name. ``nb = D / 32`` blocks per row of ``D`` elements."""

    type: str
    d: torch.Tensor
    codes: torch.Tensor
    m: torch.Tensor | None = None
    s: torch.Tensor | None = None


def _check(x: torch.Tensor, t: GgmlType) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise KvcalError(f"{t.name} quantization takes a floating-point tensor, got {type(x).__name__}"
                         f"{'' if not isinstance(x, torch.Tensor) else ' of ' + str(x.dtype)}")
    if x.dim() == 0 or x.shape[-1] == 0 or x.shape[-1] % QK:
        raise KvcalError(f"{t.name} quantizes rows in blocks of {QK}: the last dimension must be a positive "
                         f"multiple of {QK}, got shape {tuple(x.shape)}")
    x = x.float()
    if not bool(torch.isfinite(x).all()):
        raise KvcalError(f"{t.name} quantization got NaN or Inf values (ggml's block scale is undefined then)")
    return x.reshape(*x.shape[:-1], x.shape[-1] // QK, QK)


def _f16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float16)


def _inv(d: torch.Tensor) -> torch.Tensor:
    """``d ? 1.0f/d : 0.0f`` (IEEE f32 division)."""
    return torch.where(d != 0, torch.ones_like(d) / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(d))


def _signed_absmax(xb: torch.Tensor) -> torch.Tensor:
    """The signed element of largest magnitude of each block ``[..., nb, B] -> [..., nb, 1]``, the first one
    on ties (ggml's ``if (amax < fabsf(v))`` scan; ``torch.argmax`` returns the first maximum)."""
    return xb.gather(-1, xb.abs().argmax(-1, keepdim=True))


def _roundf(v: torch.Tensor) -> torch.Tensor:
    """C ``roundf``: nearest integer, halfway cases away from zero (exact for f32: ``v - trunc(v)`` is exact)."""
    r = torch.trunc(v)
    return r + torch.where((v - r).abs() >= 0.5, torch.sign(v), torch.zeros_like(v))


def _q8(xb: torch.Tensor, impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    amax = xb.abs().amax(-1, keepdim=True)
    d = amax / torch.full_like(amax, 127.0)
    if impl == "ref":  # quantize_row_q8_0_ref / _q8_1_ref
        q = _roundf(xb * _inv(d))
    else:  # arch/x86/quants.c quantize_row_q8_0 / _q8_1, AVX/AVX2 branch
        idm = torch.where(amax != 0, torch.full_like(amax, 127.0) / torch.where(amax != 0, amax, 1.0), 0.0)
        q = torch.round(xb * idm)  # _MM_ROUND_NEAREST: ties to even (torch.round)
    return d, q.clamp(-128, 127)  # _mm256_packs_*: signed saturation


def _best_index(al: torch.Tensor) -> torch.Tensor:
    """``best_index_int8(16, kvalues_iq4nl, al)`` of ``ggml-quants.c``, elementwise on f32 ``al``."""
    vals = torch.tensor(IQ4_NL_VALUES, dtype=torch.float32)
    mu = torch.searchsorted(vals, al.contiguous(), right=True).clamp(1, 15)  # binary search: val[mu-1] <= al < val[mu]
    lo, hi = vals[mu - 1], vals[mu]
    idx = torch.where(al - lo < hi - al, mu - 1, mu)
    idx = torch.where(al <= vals[0], 0, idx)
    return torch.where(al >= vals[15], 15, idx)


def quantize(x: torch.Tensor, type_name: str, impl: str = "x86_avx") -> Blocks:
    """Quantize rows of ``x`` ``[..., D]`` (any float dtype, converted to float32; ``D % 32 == 0``) to ggml
    type ``type_name`` (``q8_0``, ``q4_0``, ``q4_1``, ``q5_0``, ``q5_1``, ``iq4_nl``, or ``q8_1``), blocks of 32
    along the last axis, exactly as the CPU backend's cache write does (module docstring: ``from_float`` of
    ``type_traits_cpu``; ``impl`` picks the x86 AVX or the reference ``q8_0``/``q8_1`` path and is ignored by
    the other types, whose CPU ``from_float`` is the reference). Returns :class:`Blocks`. Raises
    ``KvcalError`` for an unknown or unquantized type, an unknown ``impl``, a last dimension that is not a
    positive multiple of 32, or NaN/Inf input."""
    t = ggml_type(type_name, cache=False)
    if not t.quantized:
        raise KvcalError(f"{type_name} is not a block-quantized type (use fake_quant for f32/f16/bf16)")
    if impl not in IMPLS:
        raise KvcalError(f"unknown ggml CPU implementation {impl!r}; choose one of {', '.join(IMPLS)}")
    xb = _check(x, t)  # [..., nb, 32] float32
    c = lambda v: v.to(torch.int16)  # noqa: E731
    if type_name in ("q8_0", "q8_1"):
        d, q = _q8(xb, impl)
        s = _f16(d[..., 0] * q.sum(-1)) if type_name == "q8_1" else None  # sum of <= 32 ints: exact in f32
        return Blocks(type_name, _f16(d[..., 0]), c(q), s=s)
    if type_name in ("q4_0", "q5_0"):
        half = 8.0 if type_name == "q4_0" else 16.0
        d = _signed_absmax(xb) / torch.full_like(xb[..., :1], -half)
        v = torch.trunc(xb * _inv(d) + (half + 0.5))  # (int8_t)(x*id + 8.5f): f32 add, truncation
        return Blocks(type_name, _f16(d[..., 0]), c(v.clamp(max=2 * half - 1)))
    if type_name in ("q4_1", "q5_1"):
        lvl = 15.0 if type_name == "q4_1" else 31.0
        mn, mx = xb.amin(-1, keepdim=True), xb.amax(-1, keepdim=True)
        d = (mx - mn) / torch.full_like(mn, lvl)
        v = torch.trunc((xb - mn) * _inv(d) + 0.5).to(torch.int64)
        v = v.clamp(max=15) if type_name == "q4_1" else v & 31  # q5_1: (uint8_t) cast, 5 low bits stored
        return Blocks(type_name, _f16(d[..., 0]), c(v), m=_f16(mn[..., 0]))
    # iq4_nl: quantize_row_iq4_nl_impl(QK4_NL, 32, ..., kvalues_iq4nl, NULL, ntry=-1)
    mx = _signed_absmax(xb)  # [..., nb, 1]
    tiny = xb.abs().amax(-1, keepdim=True) < GROUP_MAX_EPS
    d0 = mx / torch.full_like(mx, -127.0)  # max / values[0]
    al = torch.where(tiny, 0.0, _inv(d0)) * xb  # id*xb[j]
    idx = _best_index(al)
    q = torch.tensor(IQ4_NL_VALUES, dtype=torch.float32)[idx]
    w = xb * xb
    sumqx = torch.zeros_like(xb[..., 0])
    sumq2 = torch.zeros_like(xb[..., 0])
    for j in range(QK):  # f32 sums in element order, (w*q)*x and (w*q)*q as C evaluates them
        wq = w[..., j] * q[..., j]
        sumqx = sumqx + wq * xb[..., j]
        sumq2 = sumq2 + wq * q[..., j]
    d = torch.where(sumq2 > 0, sumqx / torch.where(sumq2 > 0, sumq2, 1.0), 0.0)
    d = torch.where(tiny[..., 0], 0.0, d)
    return Blocks(type_name, _f16(d), c(torch.where(tiny, 0, idx)))


def dequantize(b: Blocks) -> torch.Tensor:
    """The float32 values ``[..., D]`` ggml's ``dequantize_row_<type>`` (``ggml-quants.c``) returns for
    :class:`Blocks` ``b`` (``D = 32 · nb``). Raises ``KvcalError`` for an unknown type."""
    t = ggml_type(b.type, cache=False)
    if not t.quantized:
        raise KvcalError(f"{b.type} is not a block-quantized type")
    d = b.d.float()[..., None]  # [..., nb, 1]
    c = b.codes.float()
    if b.type in ("q8_0", "q8_1"):
        y = c * d
    elif b.type == "q4_0":
        y = (c - 8.0) * d
    elif b.type == "q5_0":
        y = (c - 16.0) * d
    elif b.type in ("q4_1", "q5_1"):
        y = c * d + b.m.float()[..., None]  # x0*d + m: two f32 roundings (torch does not fuse them)
    else:  # iq4_nl
        y = d * torch.tensor(IQ4_NL_VALUES, dtype=torch.float32)[b.codes.long()]
    return y.reshape(*y.shape[:-2], y.shape[-2] * QK)


def fake_quant_q8_K(x: torch.Tensor) -> torch.Tensor:
    """What a ``q8_K`` row holds for ``x`` ``[..., D]`` (``D % 256 == 0``), as float32 of the same shape: per block
    of 256, ``iscale = -127 / max`` (``max`` the signed element of largest magnitude), codes
    ``min(127, nearest_int(iscale · x))`` (``nearest_int``: the 1.5·2²³ trick, ties to even), ``d = 1 / iscale``
    stored as f32, value ``d · code`` (``quantize_row_q8_K_ref``, ``ggml-quants.c``, which the x86 backend's
    ``quantize_row_q8_K`` calls; the AVX2 ``ggml_quantize_mat_q8_K_4x8`` of ``arch/x86/repack.cpp`` takes the same
    magnitude ``127 / amax`` and only its sign can differ on a ± tie, which leaves ``d · code`` unchanged since
    rounding to even is odd-symmetric). A block of zeros, or one whose ``-127 / max`` overflows f32 (``amax <
    127 / FLT_MAX``), dequantizes to zeros, as ggml's does. Raises ``KvcalError`` for a last dimension
    that is not a positive multiple of 256, or NaN/Inf input."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise KvcalError("q8_K quantization takes a floating-point tensor")
    if x.dim() == 0 or x.shape[-1] == 0 or x.shape[-1] % QK_K:
        raise KvcalError(f"q8_K quantizes rows in blocks of {QK_K}: the last dimension must be a positive multiple "
                         f"of {QK_K}, got shape {tuple(x.shape)}")
    x = x.float()
    if not bool(torch.isfinite(x).all()):
        raise KvcalError("q8_K quantization got NaN or Inf values (ggml's block scale is undefined then)")
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // QK_K, QK_K)
    mx = _signed_absmax(xb)
    # a zero block, or one so small that -127/max overflows to inf: ggml's codes come out 0 (nearest_int of inf or
    # NaN keeps no low bits) and d = 1/inf = 0, so the block dequantizes to zeros
    raw = torch.full_like(mx, -127.0) / torch.where(mx != 0, mx, 1.0)
    nz = (mx != 0) & torch.isfinite(raw)
    iscale = torch.where(nz, raw, 0.0)
    q = torch.round(xb * iscale).clamp(max=127)
    d = torch.where(nz, torch.ones_like(iscale) / torch.where(nz, iscale, 1.0), 0.0)
    return (d * q).reshape(x.shape)


def fake_quant(x: torch.Tensor, type_name: str, impl: str = "x86_avx") -> torch.Tensor:
    """What a row of ggml type ``type_name`` holds for ``x`` ``[..., D]``, as float32 of the same shape:
    ``dequantize(quantize(x))`` for block types (``D % 32 == 0``), :func:`fake_quant_q8_K` for ``q8_K``
    (``D % 256 == 0``), the fp16 / bf16 rounding (to nearest even) for ``f16`` / ``bf16``, ``x`` as float32 for
    ``f32``. Raises ``KvcalError`` as :func:`quantize`."""
    if type_name == "q8_K":
        return fake_quant_q8_K(x)
    t = ggml_type(type_name, cache=False)
    if t.quantized:
        return dequantize(quantize(x, type_name, impl))
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise KvcalError(f"{type_name} rounding takes a floating-point tensor")
    x = x.float()
    if type_name == "f16":
        return x.to(torch.float16).float()
    if type_name == "bf16":
        return x.to(torch.bfloat16).float()
    return x


__all__ = ["GGML_TYPES", "IQ4_NL_VALUES", "K_QUANT_WEIGHTS", "KV_CACHE_TYPES", "QK", "QK_K", "Blocks", "GgmlType",
           "dequantize", "fake_quant", "fake_quant_q8_K", "ggml_type", "quantize"]
