"""A fake-quant plan that runs what vLLM 0.33 serves for one ``--kv-cache-dtype`` (Protocol A).

:class:`VllmKVPlan` has the interface kvcal's evaluation uses for plans (``fake_quant(layer,
side, x)``, ``num_layers``, ``sink_tokens``) plus ``fake_quant_query(layer, q, num_kv_heads)``,
which :func:`kvcal.evaluate.plan_hook` applies to the post-RoPE queries — vLLM's FP8 query
quantization with static ``q_scale`` for fp8/fp8_e4m3/nvfp4* caches. The numerics are
:mod:`kvcal.engines.vllm.dtypes`; this module only routes layers and scales (torch only).

Protocol A quantizes every key and value attention reads. That is what vLLM's decode steps see
for every dtype; for a first-chunk prefill, turboquant attends to the raw K/V instead
(:attr:`~kvcal.engines.vllm.dtypes.VllmKVDType.prefill_reads_cache`), so for turboquant these
rows measure decode-time quality, not prefill logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcal.engines.vllm.dtypes import (
    TQ_PRESETS,
    VllmDTypeError,
    boundary_skip_layers,
    check_backend_serves,
    fake_quant_query,
    fake_quant_side,
    vllm_backend,
    vllm_dtype,
)
from kvcal.formats.transforms import Transform
from kvcal.formats.variants import Rounding


@dataclass
class VllmKVPlan:
    """What attention reads under ``vllm serve --kv-cache-dtype kv_cache_dtype``.

    ``num_layers``: decoder layers. ``k_scales``/``v_scales``/``q_scales``: one static scale per
    layer — a float (per tensor) or a ``[H_kv]`` tensor (per KV head) — the dequantization
    multipliers a checkpoint gives vLLM (``None``: vLLM's 1.0 everywhere). k/v scales are read
    only by the static dtypes (fp8*: the FP8 scale; nvfp4*: the outer scale, per tensor), q
    scales only when the dtype quantizes queries. ``skip_layers``: ``--kv-cache-dtype-skip-layers``
    (kept in the model dtype: returned unchanged); vLLM's turboquant boundary layers are added
    unless ``add_boundary`` is False. ``quantize_query``: override whether queries are FP8
    (``None``: as vLLM does for the dtype on ``backend``). ``backend``: the attention backend whose
    write path is emulated (:data:`~kvcal.engines.vllm.dtypes.VLLM_BACKENDS`: ``cuda``, the GPU
    kernels, default; ``cpu``, vLLM's CPU build: truncating FP8 writes, no query quantization,
    fp8* dtypes only). Raises
    :class:`~kvcal.engines.vllm.dtypes.VllmDTypeError` (a ``ValueError``) for an unknown dtype,
    scale lists of the wrong length or a layer index out of range."""

    kv_cache_dtype: str
    num_layers: int
    k_scales: list | None = None
    v_scales: list | None = None
    q_scales: list | None = None
    skip_layers: tuple[int, ...] = ()
    add_boundary: bool = True
    quantize_query: bool | None = None
    backend: str = "cuda"
    sink_tokens: int = field(default=0, init=False)  # vLLM has no sink tokens
    residual_window: int = field(default=0, init=False)

    def __post_init__(self):
        self.spec = vllm_dtype(self.kv_cache_dtype)
        self.backend = vllm_backend(self.backend).name
        check_backend_serves(self.backend, self.kv_cache_dtype)
        L = int(self.num_layers)
        if L < 1:
            raise VllmDTypeError(f"num_layers must be >= 1, got {self.num_layers!r}")
        for name in ("k_scales", "v_scales", "q_scales"):
            s = getattr(self, name)
            if s is None:
                setattr(self, name, [1.0] * L)
            elif len(s) != L:
                raise VllmDTypeError(f"{name} has {len(s)} entries for a model with {L} layers (one per layer)")
        if not self.spec.static_scales and any(
                bool(torch.as_tensor(x, dtype=torch.float64).ne(1.0).any()) for x in (*self.k_scales, *self.v_scales)):
            raise VllmDTypeError(f"--kv-cache-dtype {self.kv_cache_dtype} ignores checkpoint k/v scales "
                                 "(computed at write time); pass none")
        bad = sorted(i for i in self.skip_layers if not 0 <= int(i) < L)
        if bad:
            raise VllmDTypeError(f"skip layer(s) {bad} out of range for a model with {L} layers")
        skip = set(int(i) for i in self.skip_layers)
        if self.add_boundary:
            skip |= set(boundary_skip_layers(self.kv_cache_dtype, L))
        self.skipped = tuple(sorted(skip))
        if self.quantize_query is None:
            self.quantize_query = vllm_backend(self.backend).quantizes_query and (
                self.spec.quantizes_query or self.kv_cache_dtype == "int4_per_token_head")

    def first_quantized_layer(self) -> int:
        """The lowest layer whose K/V (or query) this plan quantizes; ``num_layers`` when every layer is
        skipped. Layers below it compute what the unquantized model computes (probes reuse them:
        :func:`kvcal.evaluate.protocol_a.first_quantized_layer`)."""
        return next((i for i in range(self.num_layers) if i not in self.skipped), self.num_layers)

    def fake_quant(self, layer: int, side: str, x: torch.Tensor) -> torch.Tensor:
        """What attention reads of ``side`` (``"k"``/``"v"``) of ``layer`` for ``x`` [B, H_kv, S, D];
        same shape and dtype (unchanged for a skipped layer)."""
        if layer in self.skipped:
            return x
        scale = (self.k_scales if side == "k" else self.v_scales)[layer] if self.spec.static_scales else 1.0
        return fake_quant_side(self.kv_cache_dtype, side, x, scale, backend=self.backend).to(x.dtype)

    def fake_quant_query(self, layer: int, q: torch.Tensor, num_kv_heads: int | None = None) -> torch.Tensor:
        """The query attention uses in ``layer`` for ``q`` [B, H_q, S, D] (same dtype): FP8 with the
        layer's ``q_scale`` for fp8/fp8_e4m3/nvfp4* (per KV-head scales need ``num_kv_heads``), the
        dtype-rounded RHT for int4_per_token_head, unchanged otherwise or for a skipped layer."""
        if layer in self.skipped or not self.quantize_query:
            return q
        return fake_quant_query(self.kv_cache_dtype, q, q_scale=self.q_scales[layer],
                                num_kv_heads=num_kv_heads).to(q.dtype)

    def quantized_bits(self) -> list[int]:
        """Payload bits of every quantized (layer, side), as kvcal's acceptance bars read them:
        fp8* / int8 / fp8 per token-head 8, int4 per token-head and nvfp4* 4, turboquant its key
        bits (8 for k8) and value bits."""
        name, family = self.kv_cache_dtype, self.spec.family
        if family == "turboquant":
            kb, vb = TQ_PRESETS[name][:2]
        elif family == "nvfp4" or name == "int4_per_token_head":
            kb = vb = 4
        else:
            kb = vb = 8
        return [b for i in range(self.num_layers) if i not in self.skipped for b in (kb, vb)]

    @classmethod
    def from_kvcal_plan(cls, kv_cache_dtype: str, plan, **kw) -> tuple[VllmKVPlan, str]:
        """The vLLM plan for ``kv_cache_dtype`` that a checkpoint exported from kvcal ``plan`` (a
        :class:`~kvcal.plan.KVPlan`) would give vLLM: for fp8/fp8_e4m3, the plan's static e4m3
        per-tensor / per-head k/v scales when it has them (q_scale 1.0: kvcal artifacts carry
        none); vLLM's 1.0 otherwise. Returns ``(plan, note)`` with ``note`` saying which scales."""
        L = plan.num_layers
        family = vllm_dtype(kv_cache_dtype).family
        if family == "fp8":
            sides = [(lp.k, lp.v) for lp in plan.layers]
            ok = all(sp.spec.format.value == "fp8_e4m3" and sp.spec.granularity.name in ("tensor", "head")
                     and sp.scale is not None and sp.transform is Transform.NONE and not sp.centered
                     and sp.rounding_mode is Rounding.NEAREST
                     for pair in sides for sp in pair)
            if ok:
                def as_scale(t):
                    t = t.detach().float().reshape(-1)
                    return float(t[0]) if t.numel() == 1 else t

                k = [as_scale(a.scale) for a, _ in sides]
                v = [as_scale(b.scale) for _, b in sides]
                p = cls(kv_cache_dtype, L, k_scales=k, v_scales=v, **kw)
                return p, (
                    f"vllm:{kv_cache_dtype}: the artifact's k/v scales as vLLM loads them, "
                    + (("the artifact's q_scale (calibrate --engine vllm)" if kw.get("q_scales") is not None else
                        "q_scale 1.0 (vLLM's default; the artifact has none)") + ", queries FP8-quantized"
                       if p.quantize_query else "queries not quantized") + p.backend_note())
        note = (f"vllm:{kv_cache_dtype}: vLLM's defaults (static scales 1.0; no checkpoint scales)"
                if vllm_dtype(kv_cache_dtype).static_scales else
                f"vllm:{kv_cache_dtype}: scales computed at write time, as vLLM does")
        if family == "nvfp4" and kw.get("k_scales") is not None:
            note = (f"vllm:{kv_cache_dtype}: the artifact's NVFP4 outer scales (k_scale/v_scale) and q_scale "
                    "(calibrate --engine vllm --kv-cache-dtype nvfp4) as vLLM loads them, queries FP8-quantized "
                    "(SM100 FlashInfer trtllm-gen; SM80/90/120 keep them 16-bit)")
        if family == "turboquant":
            note += ("; first and last 2 layers at 16 bits (vLLM's boundary rule); vLLM's first-chunk prefill "
                     "attends to raw K/V, so these rows measure what decode steps read")
        p = cls(kv_cache_dtype, L, **kw)
        return p, note + p.backend_note()

    def backend_note(self) -> str:
        """``""`` for the default (cuda) backend; else which backend's write path this plan emulates."""
        b = vllm_backend(self.backend)
        if b.name == "cuda":
            return ""
        return (f"; backend {b.name} ({b.engine_name}): FP8 written by "
                f"{'truncation toward zero' if b.fp8_rounding == 'truncate' else 'rounding to nearest even'}"
                f"{'' if b.quantizes_query else ', no query quantization'}")

    def describe(self) -> dict:
        """JSON description: dtype, skipped layers, query quantization and scale kinds."""
        def kind(xs):
            return "per-head" if any(torch.as_tensor(x).numel() > 1 for x in xs) else (
                "1.0" if all(float(torch.as_tensor(x)) == 1.0 for x in xs) else "per-tensor")

        b = vllm_backend(self.backend)
        return {"engine": "vllm", "backend": b.name, "backend_detail": f"{b.engine_name}: FP8 written by "
                f"{'truncation' if b.fp8_rounding == 'truncate' else 'rounding to nearest even'}",
                "kv_cache_dtype": self.kv_cache_dtype, "skip_layers": list(self.skipped),
                "query_quantization": ("fp8" if self.quantize_query and self.spec.quantizes_query else
                                       "rht-16bit" if self.quantize_query else "none"),
                "k_scale": kind(self.k_scales) if self.spec.static_scales else "dynamic",
                "v_scale": kind(self.v_scales) if self.spec.static_scales else "dynamic",
                "q_scale": kind(self.q_scales) if self.spec.quantizes_query else None}


__all__ = ["VllmKVPlan"]
