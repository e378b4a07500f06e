"""llama.cpp's KV cache (``--cache-type-k`` / ``--cache-type-v`` with flash attention), emulated exactly: the ggml
block formats (:mod:`.quants`), the Hadamard rotation of quantized caches (:mod:`.rotation`), the plan kvcal's
evaluation runs and the bytes llama.cpp allocates (:mod:`.plan`). Source: llama.cpp as vendored by
llama-cpp-python 0.3.36. torch only; imports no engine."""

from kvcal.engines.llamacpp.plan import LlamaCppKVBytes, LlamaCppKVPlan, bits_per_value, kv_bytes
from kvcal.engines.llamacpp.quants import (
           GGML_TYPES,
           IQ4_NL_VALUES,
           KV_CACHE_TYPES,
           dequantize,
           fake_quant,
           quantize,
)
from kvcal.engines.llamacpp.rotation import ggml_fwht, k_rot_size, rotation_default, v_rot_size

__all__ = ["GGML_TYPES", "IQ4_NL_VALUES", "KV_CACHE_TYPES", "LlamaCppKVBytes", "LlamaCppKVPlan", "bits_per_value",
           "dequantize", "fake_quant", "ggml_fwht", "k_rot_size", "kv_bytes", "quantize", "rotation_default",
           "v_rot_size"]
