"""Runtime: a transformers ``Cache`` that stores K/V in a plan's quantized formats (see
:mod:`kvcal.runtime.cache`)."""

from kvcal.runtime.cache import QuantizedKVCache, QuantizedKVLayer

__all__ = ["QuantizedKVCache", "QuantizedKVLayer"]
