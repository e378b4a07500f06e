"""kvcal: attention-aware KV-cache quantization calibration.

Layering (imports only go downward):
    formats/, search/objectives, kernels/   torch only (numeric primitives)
    capture/, models.py, runtime/           + transformers
    artifact.py, export/                    + safetensors
    cli.py, report/                         + click, matplotlib

Convention everywhere: ``scale`` is the dequantization multiplier, ``x ≈ q * scale``
(or ``(q - zero_point) * scale``); FP8 e4m3 per-tensor scale = clip_amax / 448.
"""

__version__ = "0.1.0"
