"""The details of vLLM 0.33's cache writes that only a GPU run can settle, one constant each (torch only).

Each names the arithmetic kvcal emulates and the alternative it excludes. The emulations of
:mod:`kvcal.engines.vllm.dtypes` read them from this module when they run, so setting one here (e.g.
``monkeypatch.setattr(kvcal.engines.vllm.dtypes.choices, "TRITON_FP_FUSION", True)``) takes effect on the next call.
They lived in the package ``__init__`` until the package was moved under ``kvcal/engines/vllm/`` (issue 41): the
emulation modules read them from the package, which imported the modules — an import circle.
"""

from __future__ import annotations

import torch

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


__all__ = ["KV_FP8_STORE_OP", "QUERY_FP8_OP", "FP8_CAST_SATURATES", "INT4_RHT_WORK_DTYPE", "NVFP4_RCP", "TRITON_FP_FUSION"]
