"""Kernel dispatch: the one place that chooses between the torch reference and Triton kernels.

The torch implementation (:mod:`kvcal.formats.quant`) is the spec; Triton kernels
(:mod:`kvcal.kernels.triton_quant`, imported lazily so kvcal works without triton) reproduce it bit
for bit for the dynamic integer layouts the runtime cache writes on every token:

* int8/int4/int3/int2 (int6/int5 on the torch reference), symmetric or asymmetric, fp16/bf16/fp32 scales;
* per-token and per-token-group (``g`` a power of two dividing ``D``), with fused packing;
* per-channel-token-group (KIVI keys; ``g`` and ``D`` powers of two).

Everything else (FP8, NVFP4, static granularities, padded layouts) runs the torch reference.

Backend choice: argument ``backend`` or env ``KVCAL_KERNELS`` = ``auto`` (default: Triton for CUDA
tensors when triton is importable, else torch), ``torch``, or ``triton`` (forces Triton where
supported; on CPU this needs ``TRITON_INTERPRET=1``, which the parity tests use).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from kvcal.formats import quant as _ref
from kvcal.formats.granularity import PerChannelTokenGroup, PerToken, PerTokenGroup
from kvcal.formats.layout import _check_input, _clip_view
from kvcal.formats.quant import QuantizedTensor
from kvcal.formats.spec import LOG8, TensorQuantSpec
from kvcal.formats.variants import ChannelWidths, Codebook, QuantTables, ScaleCoding
from kvcal.kernels.widths import TRITON_WIDTHS  # payload widths the Triton kernels pack

BACKENDS = ("auto", "torch", "triton")


def triton_available() -> bool:
    """True when the ``triton`` package can be imported (it is not imported here)."""
    return importlib.util.find_spec("triton") is not None




def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def triton_supports(spec: TensorQuantSpec, shape: tuple[int, int, int, int]) -> str | None:
    """``None`` if the Triton kernels cover ``spec`` for a ``[B,H,S,D]`` input, else the reason."""
    B, H, S, D = shape
    if spec.format.kind != "int":
        return f"{spec.format.value} runs on the torch reference"
    if spec.scale_dtype == LOG8:
        return "log8 scales run on the torch reference"
    if spec.bits not in TRITON_WIDTHS:
        return f"{spec.format.value} runs on the torch reference"
    g = spec.granularity
    if B * H * S == 0:
        return "empty input"
    if isinstance(g, PerChannelTokenGroup):
        if not (_pow2(g.group_size) and _pow2(D)):
            return "channel_token_group needs power-of-two group size and head_dim"
        return None
    if isinstance(g, (PerToken, PerTokenGroup)):
        gs = spec.effective_channel_group(D) if isinstance(g, PerTokenGroup) else D
        if not _pow2(gs) or D % gs:
            return "token groups must be a power of two dividing head_dim"
        return None
    return f"static granularity {g.name} runs on the torch reference"


def resolve_backend(backend: str | None, device: torch.device, why_not: Callable[[], str | None]) -> str:
    """The one backend choice of kvcal's kernels: ``"torch"`` or ``"triton"``.

    ``backend``: ``"auto"``, ``"torch"`` or ``"triton"``; ``None`` reads env ``KVCAL_KERNELS``
    (default ``"auto"``). ``why_not()``: ``None`` when the Triton kernel covers the case, else the
    reason it does not (called only when Triton is a candidate). ``auto`` picks Triton for CUDA
    tensors when triton is importable and the case is covered; ``triton`` forces it where covered
    and runs the torch reference elsewhere. Used by :func:`quantize` / :func:`dequantize` here and
    by :func:`kvcal.kernels.attn_error.key_kl`.

    Raises ``ValueError`` for an unknown backend name, or ``"triton"`` when triton is not installed.
    """
    if not backend:
        from kvcal.options import env_choice

        backend = env_choice("KVCAL_KERNELS", BACKENDS, "auto")  # a KvcalError naming the variable
    b = backend
    if b not in BACKENDS:
        raise ValueError(f"unknown kernel backend {b!r}; choose one of {BACKENDS}")
    if b == "torch":
        return "torch"
    reason = why_not()
    if b == "auto":
        return "triton" if reason is None and device.type == "cuda" and triton_available() else "torch"
    if not triton_available():
        raise ValueError("backend 'triton' requested but triton is not installed (pip install kvcal[triton])")
    return "torch" if reason is not None else "triton"


def _resolve(backend: str | None, device: torch.device, spec, shape) -> str:
    """:func:`resolve_backend` for a quantize/dequantize call on a ``[B,H,S,D]`` tensor with ``spec``."""
    return resolve_backend(backend, device, lambda: triton_supports(spec, shape))


def quantize(
    x: torch.Tensor,
    spec: TensorQuantSpec,
    *,
    scale: torch.Tensor | None = None,
    zero_point: torch.Tensor | None = None,
    clip_ratio: torch.Tensor | float | None = None,
    global_scale: torch.Tensor | float | None = None,
    tables: QuantTables | None = None,
    backend: str | None = None,
) -> QuantizedTensor:
    """Same contract as :func:`kvcal.formats.quant.quantize`, dispatched to Triton when supported
    (dynamic int layouts without given parameters, uniform grids, float scales; a side with variant
    ``tables`` — :class:`~kvcal.formats.variants.QuantTables`: levels, trellis, rounding, widths, log8
    base — runs on the torch reference). Raises ``ValueError`` like the reference."""
    _check_input(x)
    t = QuantTables.coerce(tables)
    use = "torch"
    if scale is None and zero_point is None and global_scale is None and not t.as_kwargs():
        use = _resolve(backend, x.device, spec, tuple(x.shape))
    if use == "torch":
        return _ref.quantize(x, spec, scale=scale, zero_point=zero_point, clip_ratio=clip_ratio,
                             global_scale=global_scale, check_finite=False, tables=t)
    from kvcal.kernels.triton_quant import quantize_triton

    H = x.shape[1]
    c = _clip_view(clip_ratio, H, 4, x.device)
    c = torch.ones(H, device=x.device) if c is None else c.reshape(-1).expand(H).contiguous()
    return quantize_triton(x, spec, c)


def dequantize(qt: QuantizedTensor, dtype: torch.dtype | None = None, *, backend: str | None = None) -> torch.Tensor:
    """Same contract as :func:`kvcal.formats.quant.dequantize`, dispatched like :func:`quantize`
    (trellis-coded tensors always run on the torch reference)."""
    dtype = dtype or qt.dtype
    if (qt.codebook is not Codebook.UNIFORM or qt.channel_widths is ChannelWidths.ALLOCATED
            or qt.scale_coding is ScaleCoding.LOG8 or _resolve(backend, qt.data.device, qt.spec, qt.shape) == "torch"):
        return _ref.dequantize(qt, dtype)
    from kvcal.kernels.triton_quant import dequantize_triton

    return dequantize_triton(qt, dtype)


__all__ = ["quantize", "dequantize", "triton_supports", "triton_available", "resolve_backend", "BACKENDS"]
