"""Numeric formats, granularities, packing and memory accounting (torch only, no transformers).

Modules: :mod:`~kvcal.formats.granularity` (which elements share a scale), :mod:`~kvcal.formats.fp8`
(FP8 casts), :mod:`~kvcal.formats.spec` (``TensorQuantSpec``, ``KVCacheConfig``, presets),
:mod:`~kvcal.formats.quant` (``quantize`` / ``dequantize`` / ``fake_quant``, the torch spec),
:mod:`~kvcal.formats.packing` (bit layouts), :mod:`~kvcal.formats.memory` (exact cache bytes and the
runtime allocation contract). Triton accelerators live behind :mod:`kvcal.kernels`.
"""

from kvcal.formats.granularity import (
    Granularity,
    PerChannel,
    PerChannelTokenGroup,
    PerHead,
    PerTensor,
    PerToken,
    PerTokenGroup,
    granularity_from_name,
)
from kvcal.formats.memory import ModelShape, bytes_per_token, cache_bytes, memory_report, model_shape
from kvcal.formats.quant import QuantizedTensor, dequantize, fake_quant, quantize
from kvcal.formats.scales import params_from_range
from kvcal.formats.spec import PRESETS, KVCacheConfig, QFormat, TensorQuantSpec, preset

__all__ = [
    "Granularity", "PerTensor", "PerHead", "PerChannel", "PerToken", "PerTokenGroup", "PerChannelTokenGroup",
    "granularity_from_name", "QFormat", "TensorQuantSpec", "KVCacheConfig", "PRESETS", "preset",
    "QuantizedTensor", "quantize", "dequantize", "fake_quant", "params_from_range",
    "ModelShape", "model_shape", "bytes_per_token", "cache_bytes", "memory_report",
]
