"""kvcal: attention-aware KV-cache quantization calibration.

Layering (imports only go downward; the map is :mod:`kvcal._layers`, checked by tests/test_layering.py):
    formats ← plan ← capture/search/kernels ← artifact/runtime/evaluate ← export/report/api ← cli

Convention everywhere: ``scale`` is the dequantization multiplier, ``x ≈ q * scale``
(or ``(q - zero_point) * scale``); FP8 e4m3 per-tensor scale = clip_amax / 448.
"""

__version__ = "0.1.0"
