"""What attention reads under ``llama-server -fa on -ctk TYPE_K -ctv TYPE_V`` (CPU backend), as a kvcal plan, and
the bytes llama.cpp allocates for that cache. torch only.

:class:`LlamaCppKVPlan` has the interface kvcal's Protocol A evaluation uses for a plan
(:func:`kvcal.evaluate.protocol_a.plan_hook`: ``fake_quant(layer, side, x)``, ``fake_quant_query(layer, q,
num_kv_heads)``, ``num_layers``, ``sink_tokens``, ``first_quantized_layer()``; plus ``quantized_bits()`` and
``describe()`` as :class:`~kvcal.vllm_plan.VllmKVPlan`). Sources (llama.cpp vendored by llama-cpp-python 0.3.36):

* **Cache write.** K and V rows (one KV head × ``head_dim`` of one token) are rotated when the type is
  quantized (:mod:`.rotation`) and converted by ``from_float`` of the cache type (:mod:`.quants`).
* **How flash attention reads the cache on CPU** (``ggml_compute_forward_flash_attn_ext_f16_one_chunk``,
  ``ggml/src/ggml-cpu/ops.cpp``): each query row is first converted with ``from_float`` of the K type's
  ``vec_dot_type`` — ``q8_0`` for ``q8_0``/``q4_0``/``q5_0``/``iq4_nl`` keys, ``q8_1`` for ``q4_1``/``q5_1``
  keys (same AVX path as the ``q8_0`` write), ``f16``/``bf16`` for ``f16``/``bf16`` keys — and the score is
  ``kq_vec_dot`` (integer dot products per block times ``d_k·d_q``; ``_1`` keys add ``m_k · s_q``) times the
  softmax scale, in f32; softmax is the online f32 form; quantized V rows are dequantized to f32
  (``v_to_float`` = ``dequantize_row_<t>``) and accumulated in f32. When K and V are both ``f16`` (or
  ``f32``) and a ubatch has at least ``GGML_FA_TILE_Q = 64`` query rows, ``ggml_compute_forward_flash_attn_ext_f16``
  takes the tiled path instead (``..._ext_tiled``: keys widened to f32, the query kept f32).
* **Head order.** llama.cpp holds each query/key head in its GGUF's order: interleaved for a llama GGUF, whose
  converter permutes the q/k projections for llama.cpp's consecutive-pair RoPE (:func:`kq_interleaved`), so the
  plan quantizes each head in that order (``kq_interleaved``). Checked on layer 0 against llama.cpp's own tensors
  (``layer_runner.py``; ``tests/engines/llamacpp/test_llamacpp_layer.py``).
* **Without flash attention** a quantized V cache is refused (``llama_init_from_model``, ``src/llama-context.cpp``:
  "quantized V cache requires flash_attn to be enabled"), so this plan always models ``-fa on``.

This plan returns every tensor in the model's original basis: a rotated side comes back as
``H · dequant(quant(H · x))`` and the query as ``H · dequant(q8(H · q))`` — ``H`` symmetric and its own inverse,
so ``q̃ · k̃ = dequant(q8(Hq)) · dequant(quant(Hk))`` and ``P · ṽ = H · (P · dequant(quant(Hv)))`` are what the
engine computes, and a K-only or V-only view (:func:`kvcal.evaluate.protocol_a.side_only`) stays correct.

**fp16 accumulator.** With an ``f16`` V cache and a quantized or ``bf16`` K cache (or in decode steps) the engine
accumulates ``P · V`` in **fp16** (``VKQ16``, ``ggml_vec_mad_f16``); the plan computes that attention itself
(:meth:`LlamaCppKVPlan.attention`, :mod:`.attention`), where the model's f32 attention would be 3.4e-3 relative
off at layer 0 (SmolLM2 ``q8_0/f16``, 512 tokens, about half of what its ``q8_0`` keys move the output by).

**Not emulated** (all at float32 rounding level, except the first): the fp16 rounding of ``q8_1``'s block sum
``s = fp16(d·Σq)`` that multiplies ``m_k`` of ``q4_1``/``q5_1`` keys (kvcal uses ``fp16(d)·Σq``; relative
difference <= 2^-10 of that term; 5e-4 relative output error on Gemma 3 ``q4_1/q5_1``); the order of f32 sums (SIMD dot products, online softmax, the Hadamard back-rotation
done on K/V instead of on the attention output); ARM / other SIMD quantizers.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import torch

from kvcal.engines.llamacpp.quants import GGML_TYPES, K_QUANT_WEIGHTS, QK, QK_K, fake_quant, ggml_type
from kvcal.engines.llamacpp.rotation import ggml_fwht, k_rot_size, rotation_default, v_rot_size
from kvcal.errors import KvcalError

#: Payload bits of one element of each cache type (metadata excluded), as kvcal's acceptance bars read them.
PAYLOAD_BITS = {"q8_0": 8, "q4_0": 4, "q4_1": 4, "iq4_nl": 4, "q5_0": 5, "q5_1": 5}

#: ``GGML_FA_TILE_Q`` (``ggml/src/ggml-cpu/common.h``): query rows from which f16/f16 flash attention is tiled.
FA_TILE_Q = 64


def bits_per_value(type_name: str) -> float:
    """Stored bits per cached element of ``type_name``, metadata included: ``8 · type_size / blck_size``
    (``q8_0`` 8.5, ``q4_0``/``iq4_nl`` 4.5, ``q4_1`` 5, ``q5_0`` 5.5, ``q5_1`` 6, ``f16``/``bf16`` 16, ``f32`` 32).
    ``KvcalError`` for an unknown type."""
    t = ggml_type(type_name)
    return 8.0 * t.type_size / t.blck_size


@dataclass
class LlamaCppKVPlan:
    """Fake-quant plan for llama.cpp's ``-ctk type_k -ctv type_v`` with flash attention on (CPU backend).

    ``type_k``/``type_v``: cache types (:data:`~kvcal.engines.llamacpp.quants.KV_CACHE_TYPES`). ``num_layers``:
    decoder layers. ``rotation``: whether the quantized sides are Hadamard-rotated (``None``: llama.cpp's
    default in this environment, on unless ``LLAMA_ATTN_ROT_DISABLE`` is set, :func:`.rotation_default`).
    ``impl``: the CPU quantizer path for ``q8_0``/``q8_1`` (``"x86_avx"`` default, ``"ref"``; :mod:`.quants`).
    ``quantize_query``: convert queries to the K type's ``vec_dot_type`` as flash attention does (default
    True). ``prefill``: the emulated queries come in ubatches of at least 64 rows (teacher-forced windows,
    prompt processing): with ``f16``/``f16`` (or ``f32``/``f32``) caches the tiled kernel keeps queries in f32;
    ``False``: decode steps, where they are rounded to fp16. ``kq_interleaved``: llama.cpp holds each query and
    key head in the interleaved order of its GGUF (:func:`kq_interleaved`; element ``j`` of a head is the model's
    element ``(j % 2) · D/2 + j // 2``): the plan permutes a head into that order before the rotation and the
    block quantizer, and back after, so each block of 32 holds the elements llama.cpp's block holds.
    ``emulate_f16_accumulator``: where llama.cpp accumulates ``P · V`` in fp16 (:meth:`own_attention`), compute
    attention that way (:meth:`attention`; default True; False: the model's f32 attention). Raises
    ``KvcalError`` for an unknown type, an unknown ``impl`` or ``num_layers < 1``."""

    type_k: str
    type_v: str
    num_layers: int
    rotation: bool | None = None
    impl: str = "x86_avx"
    quantize_query: bool = True
    prefill: bool = True
    kq_interleaved: bool = False
    emulate_f16_accumulator: bool = True
    sink_tokens: int = field(default=0, init=False)  # llama.cpp has no sink tokens
    residual_window: int = field(default=0, init=False)

    def __post_init__(self):
        self.k_type, self.v_type = ggml_type(self.type_k), ggml_type(self.type_v)
        if self.impl not in ("x86_avx", "ref"):
            raise KvcalError(f"unknown ggml CPU implementation {self.impl!r}; choose x86_avx or ref")
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise KvcalError(f"num_layers must be an integer >= 1, got {self.num_layers!r}")
        if self.rotation is None:
            self.rotation = rotation_default()
        self.rotation = bool(self.rotation)

    # -- what attention reads ---------------------------------------------------------------------------------

    def _rot(self, side: str, D: int) -> int:
        t = self.k_type if side == "k" else self.v_type
        if not (self.rotation and t.quantized):
            return 0
        return k_rot_size(D) if side == "k" else v_rot_size(D)

    def _check_dim(self, t, D: int, what: str) -> None:
        check_head_dim(t.name, D, what)

    def first_quantized_layer(self) -> int:
        """``num_layers`` when nothing is changed (``f32`` K and V), else 0 (every layer is cached alike)."""
        return self.num_layers if self.type_k == self.type_v == "f32" else 0

    def fake_quant(self, layer: int, side: str, x: torch.Tensor) -> torch.Tensor:
        """What attention reads of ``side`` (``"k"``/``"v"``) of ``layer`` for ``x`` ``[B, H_kv, S, D]``, in the
        model's basis (rotated sides rotated back, module docstring); same shape and dtype. Raises
        ``KvcalError`` for a bad side or layer, or a quantized type whose block does not divide ``D``."""
        if side not in ("k", "v"):
            raise KvcalError(f"side must be 'k' or 'v', got {side!r}")
        if not 0 <= int(layer) < self.num_layers:
            raise KvcalError(f"layer {layer} out of range for a plan of {self.num_layers} layers")
        t = self.k_type if side == "k" else self.v_type
        D = x.shape[-1]
        self._check_dim(t, D, side.upper())
        return self._through(x, t.name, self._rot(side, D), side == "k")

    def _through(self, x: torch.Tensor, type_name: str, n: int, is_kq: bool) -> torch.Tensor:
        """``x`` ``[..., D]`` as the engine holds it in ``type_name``, back in the model's basis and dtype: put into
        llama.cpp's head order (a query/key of a ``kq_interleaved`` plan, when blocks make the order matter),
        rotated by the size-``n`` Hadamard (``n = 0``: none), converted, rotated and ordered back."""
        perm = is_kq and self.kq_interleaved and ggml_type(type_name, cache=False).quantized
        y = _to_gguf_order(x.float()) if perm else x.float()
        if n:
            y = ggml_fwht(y, n)
        y = fake_quant(y, type_name, self.impl)
        if n:
            y = ggml_fwht(y, n)
        return (_from_gguf_order(y) if perm else y).to(x.dtype)

    def query_type(self) -> str:
        """The type a query row is converted to before its dot products with the keys: the K type's
        ``vec_dot_type`` (``q8_0``, ``q8_1``, ``f16``, ``bf16``), ``f32`` when queries stay f32 (``f32`` keys,
        the tiled f16/f16 prefill path, or ``quantize_query=False``)."""
        if not self.quantize_query or self.type_k == "f32":
            return "f32"
        if self.type_k == "f16" and self.prefill and self.type_v == "f16":
            return "f32"  # ggml_compute_forward_flash_attn_ext_tiled: Q stays f32
        return self.k_type.vec_dot_type

    def fake_quant_query(self, layer: int, q: torch.Tensor, num_kv_heads: int | None = None) -> torch.Tensor:
        """The query ``layer``'s flash attention uses for ``q`` ``[B, H_q, S, D]`` (post-RoPE), in the model's
        basis: rotated with the K rotation when K is rotated, converted to :meth:`query_type`, rotated back;
        same shape and dtype. ``num_kv_heads`` is unused (interface of
        :func:`kvcal.evaluate.protocol_a.plan_hook`)."""
        if not 0 <= int(layer) < self.num_layers:
            raise KvcalError(f"layer {layer} out of range for a plan of {self.num_layers} layers")
        qt = self.query_type()
        if qt == "f32":
            return q
        return self._through(q, qt, self._rot("k", q.shape[-1]), True)

    def own_attention(self) -> bool:
        """Whether llama.cpp accumulates ``P · V`` in fp16 for this plan (``VKQ16``: an ``f16`` V cache read by the
        one-chunk kernel, i.e. unless K is ``f16`` too in a prefill ubatch, which the tiled kernel runs in f32), and
        the plan emulates it (``emulate_f16_accumulator``): then :meth:`attention` replaces the model's attention."""
        return bool(self.emulate_f16_accumulator and self._engine_accumulates_in_f16())

    def _engine_accumulates_in_f16(self) -> bool:
        return self.type_v == "f16" and not (self.type_k == "f16" and self.prefill)

    def attention(self, module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, kwargs: dict) -> torch.Tensor:
        """Attention as llama.cpp's CPU kernel computes it with an fp16 accumulator
        (:func:`~kvcal.engines.llamacpp.attention.flash_attn_f16_accumulator`), from what it reads: ``q``
        ``[B, H_q, S_q, D]`` (:meth:`fake_quant_query`), ``k``/``v`` ``[B, H_kv, S_k, D]`` (:meth:`fake_quant`),
        the model's ``mask`` (:func:`~kvcal.engines.llamacpp.attention.allowed_keys`) and ``kwargs`` (``scaling``,
        ``softcap``) of transformers' attention-function call on ``module``. Returns ``[B, S_q, H_q, D]`` in
        ``q``'s dtype. Raises ``ValueError`` for a mask carrying a positional bias."""
        from kvcal.engines.llamacpp.attention import allowed_keys, flash_attn_f16_accumulator

        scale = kwargs.get("scaling")
        if scale is None:
            scale = getattr(module, "scaling", None) or q.shape[-1] ** -0.5
        allowed = allowed_keys(mask, q.shape[2], k.shape[2])
        out = flash_attn_f16_accumulator(q, k, v, allowed, float(scale), kwargs.get("softcap"))
        return out.transpose(1, 2).to(q.dtype)

    def quantized_bits(self) -> list[int]:
        """Payload bits of every block-quantized (layer, side): 8 (``q8_0``), 5 (``q5_*``), 4 (``q4_*``,
        ``iq4_nl``); ``f16``/``bf16``/``f32`` sides are not listed."""
        return [PAYLOAD_BITS[t] for _ in range(self.num_layers) for t in (self.type_k, self.type_v)
                if t in PAYLOAD_BITS]

    def serve_args(self) -> str:
        """The ``llama-server`` arguments this plan models: ``-fa on -ctk TYPE_K -ctv TYPE_V``."""
        return f"-fa on -ctk {self.type_k} -ctv {self.type_v}"

    def describe(self) -> dict:
        """JSON description: engine, types, rotation, query type, implementation and what is not emulated."""
        return {"engine": "llamacpp", "type_k": self.type_k, "type_v": self.type_v, "flash_attn": True,
                "rotation": self.rotation, "query_type": self.query_type(), "impl": self.impl,
                "kq_interleaved": self.kq_interleaved,
                "bits_per_value": {"k": bits_per_value(self.type_k), "v": bits_per_value(self.type_v)},
                "f16_accumulator": self.own_attention(),
                "not_emulated": ("fp16 P·V accumulation (f16 V with a non-f16 K, or decode steps)"
                                 if self._engine_accumulates_in_f16() and not self.own_attention() else None)}


#: GGUF architectures whose query/key weights llama.cpp's converter permutes for its interleaved ("normal") RoPE
#: and transformers' GGUF loader permutes back (``LlamaTensorProcessor._reverse_permute_weights``,
#: ``transformers/modeling_gguf_pytorch_utils.py``, the only processor that does; ``permute`` in llama.cpp's
#: ``conversion/llama.py``, ``LLAMA_ROPE_TYPE_NORM`` for ``LLM_ARCH_LLAMA`` in ``src/llama-model.cpp``). Every other
#: architecture transformers loads from a GGUF keeps the GGUF's order in the model kvcal runs.
KQ_INTERLEAVED_ARCHS = ("llama",)

#: transformers ``model_type`` -> whether llama.cpp's converter (llama-cpp-python 0.3.36's ``conversion/``) stores its
#: query/key heads permuted, i.e. in another order than the checkpoint: ``LlamaModel`` with ``undo_permute``
#: (``conversion/llama.py``: ``LlamaForCausalLM``, ``MistralForCausalLM``, ``MixtralForCausalLM``,
#: ``SmolLM3ForCausalLM``) and ``OlmoModel`` (``conversion/olmo.py``) permute; ``Olmo2Model``, and the converters of
#: ``gemma.py``, ``qwen.py``, ``phi.py`` (``Phi3ForCausalLM``), ``stablelm.py``, ``starcoder.py``, ``falcon.py``,
#: ``gptneox.py`` copy q/k as they are (rotate-half RoPE in both). A ``model_type`` not listed is refused
#: (:func:`kq_interleaved`), never guessed.
CONVERTED_KQ_INTERLEAVED = {
    "llama": True, "mistral": True, "mixtral": True, "smollm3": True, "olmo": True,
    "olmo2": False, "olmo3": False, "gemma": False, "gemma2": False, "gemma3": False, "gemma3_text": False,
    "qwen2": False, "qwen3": False, "qwen2_moe": False, "qwen3_moe": False, "phi3": False, "stablelm": False,
    "starcoder2": False, "falcon": False, "gpt_neox": False,
}


def kq_interleaved(architecture: str | None = None, model_type: str | None = None) -> bool:
    """Whether llama.cpp holds a query/key head in another order than the transformers model kvcal runs: for a GGUF
    of ``architecture`` (``general.architecture``; kvcal loads it through transformers), True for
    :data:`KQ_INTERLEAVED_ARCHS`; for a transformers checkpoint of ``model_type`` (served after llama.cpp's
    converter), :data:`CONVERTED_KQ_INTERLEAVED`; neither given: False. In such a GGUF the converter stored head
    element ``h · D/2 + i`` of the original model at ``2i + h`` (``h`` in {0, 1}), so llama.cpp's blocks of 32 hold
    both RoPE halves of 16 rotary pairs, not 32 elements of one half.

    Raises ``KvcalError`` for a ``model_type`` whose conversion kvcal has not read (the blocks would be guessed):
    pass the .gguf llama.cpp serves instead, whose header decides."""
    if architecture is None and model_type is not None:
        if model_type not in CONVERTED_KQ_INTERLEAVED:
            raise KvcalError(
                f"model_type {model_type!r}: kvcal does not know whether llama.cpp's converter reorders its "
                "query/key heads (which elements share a block of 32); pass the .gguf that llama.cpp serves as "
                "--model (its general.architecture decides)")
        return CONVERTED_KQ_INTERLEAVED[model_type]
    return architecture in KQ_INTERLEAVED_ARCHS


def _gguf_perm(D: int, device) -> torch.Tensor:
    j = torch.arange(D, device=device)
    return (j % 2) * (D // 2) + j // 2  # GGUF element j <- model element (j % 2)·D/2 + j // 2


def _to_gguf_order(x: torch.Tensor) -> torch.Tensor:
    """Heads ``[..., D]`` in the model's (rotate-half) order -> llama.cpp's interleaved order (:func:`kq_interleaved`)."""
    return x.index_select(-1, _gguf_perm(x.shape[-1], x.device))


def _from_gguf_order(y: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_to_gguf_order`."""
    return y.index_select(-1, torch.argsort(_gguf_perm(y.shape[-1], y.device)))


# -- memory ----------------------------------------------------------------------------------------------------


def _pad(x: int, n: int) -> int:
    return (x + n - 1) // n * n  # GGML_PAD


@dataclass(frozen=True)
class LlamaCppKVBytes:
    """The KV cache llama.cpp allocates: ``k_bytes``/``v_bytes`` (sums of ``ggml_nbytes`` of every layer's K/V
    tensor, ``llama_kv_cache::size_k_bytes``/``size_v_bytes``), ``kv_size`` (cells per stream, the printed
    "cells"), ``n_layers``, ``n_seq_max`` and ``n_stream`` (1 for a unified cache, else ``n_seq_max``),
    ``type_k``/``type_v``. ``swa``: for a model with sliding-window and full-attention layers (llama.cpp's iSWA
    cache, ``src/llama-kv-cache-iswa.cpp``), this object is the full-attention ("non-SWA") cache and ``swa`` the
    sliding-window layers' cache, a second ``llama_kv_cache`` with its own cells and log line; else ``None``."""

    k_bytes: int
    v_bytes: int
    kv_size: int
    n_layers: int
    n_seq_max: int
    n_stream: int
    type_k: str
    type_v: str
    swa: LlamaCppKVBytes | None = None

    @property
    def total(self) -> int:
        """Bytes of every cache: ``k_bytes + v_bytes``, plus the sliding-window cache's when there is one."""
        return self.k_bytes + self.v_bytes + (self.swa.total if self.swa else 0)

    @property
    def k_total(self) -> int:
        """K bytes of every cache (``k_bytes`` plus the sliding-window cache's)."""
        return self.k_bytes + (self.swa.k_bytes if self.swa else 0)

    @property
    def v_total(self) -> int:
        """V bytes of every cache (``v_bytes`` plus the sliding-window cache's)."""
        return self.v_bytes + (self.swa.v_bytes if self.swa else 0)

    def log_lines(self) -> list[str]:
        """Every ``llama_kv_cache: size = ...`` line llama.cpp logs for this allocation, in its order (the
        full-attention cache first, then the sliding-window one)."""
        return [self.log_line()] + (self.swa.log_lines() if self.swa else [])

    def log_line(self) -> str:
        """The line ``llama_kv_cache::llama_kv_cache`` logs for this cache (not its ``swa`` one), with its C formatting
        (``"%7.2f MiB"`` of ``(float)bytes / (1024.0f*1024.0f)``: the byte count rounded to float32 first)."""
        def mib(b: int) -> float:
            return struct.unpack("f", struct.pack("f", float(b)))[0] / 1048576.0  # (float)size_t; / 2^20 exact

        return (f"llama_kv_cache: size = {mib(self.k_bytes + self.v_bytes):7.2f} MiB ({self.kv_size:6d} cells, {self.n_layers:3d} "
                f"layers, {self.n_seq_max:2d}/{self.n_stream} seqs), K ({self.type_k}): {mib(self.k_bytes):7.2f} "
                f"MiB, V ({self.type_v}): {mib(self.v_bytes):7.2f} MiB")


def kv_bytes(config, type_k: str, type_v: str, n_ctx: int, n_seq: int = 1, *, unified: bool = False,
             n_ubatch: int = 512, swa_full: bool = False) -> LlamaCppKVBytes:
    """Bytes of the KV cache llama.cpp 0.3.36's vendored build allocates for a model of ``config`` (a
    :class:`~kvcal.formats.memory.ModelShape`, an HF config dict or object) at context ``n_ctx`` (``-c``)
    with ``n_seq`` parallel sequences (``-np``), ``unified`` (``--kv-unified``).

    Rules (``llama_context::llama_context``, ``src/llama-context.cpp``): ``n_ctx`` is padded to a multiple of
    256; a unified cache has ``n_ctx`` cells in one stream; otherwise ``n_ctx_seq = PAD(n_ctx / n_seq, 256)``
    cells in each of ``n_seq`` streams. Per layer (``llama_kv_cache::llama_kv_cache``, ``src/llama-kv-cache.cpp``)
    K is a ``type_k`` tensor ``[n_embd_k_gqa, kv_size, n_stream]`` and V likewise (with flash attention V is
    not transposed; the size is the same), ``n_embd_k_gqa = H_kv · head_dim``; its bytes are
    ``n_embd_k_gqa / blck_size · type_size · kv_size · n_stream``. (The backend buffer pads each tensor to
    32 bytes, which these sizes already are, so the "KV buffer size" line shows the same total.)

    A model with sliding-window and full-attention layers (Gemma 2/3) gets llama.cpp's iSWA cache
    (``llama_kv_cache_iswa``, ``src/llama-kv-cache-iswa.cpp``): the full-attention layers in a cache of the size
    above, the sliding-window layers (window ``n_swa``) in a second one of
    ``PAD(min(size, n_swa · (unified ? n_seq : 1) + n_ubatch), 256)`` cells — or the full size with
    ``swa_full`` (``--swa-full``; llama-server's default is off, ``n_ubatch`` 512; llama-cpp-python leaves
    ``llama_context_default_params``' ``swa_full = true``). Raises ``KvcalError`` for an unknown type, a
    non-positive ``n_ctx``/``n_seq``/``n_ubatch``, a head size the type's block does not divide, or a model whose
    every layer slides or whose sliding layers have different windows (not sized here)."""
    from kvcal.formats.memory import model_shape

    tk, tv = ggml_type(type_k), ggml_type(type_v)
    for name, v in (("n_ctx", n_ctx), ("n_seq", n_seq), ("n_ubatch", n_ubatch)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise KvcalError(f"{name} must be a positive integer, got {v!r}")
    try:
        shape = model_shape(config)
    except ValueError as e:
        raise KvcalError(str(e)) from None
    swa_layers = shape.sliding_layers
    windows = {shape.layer_windows[i] for i in swa_layers}
    if swa_layers and (len(swa_layers) == shape.num_layers or len(windows) > 1):
        raise KvcalError("kvcal sizes llama.cpp's iSWA cache for models with full-attention layers and one sliding "
                         f"window; this model has {len(swa_layers)} of {shape.num_layers} layers sliding, windows "
                         f"{sorted(windows)}")
    n_ctx_pad = _pad(n_ctx, 256)
    if unified:
        kv_size, n_stream = n_ctx_pad, 1
    else:
        kv_size, n_stream = _pad(n_ctx_pad // n_seq, 256), n_seq
    check_head_dim(type_k, shape.head_dim, "K")
    check_head_dim(type_v, shape.head_dim, "V")
    n_embd = shape.num_kv_heads * shape.head_dim
    k_row, v_row = tk.row_bytes(n_embd), tv.row_bytes(n_embd)

    def cache(n_layers: int, size: int, swa=None) -> LlamaCppKVBytes:
        return LlamaCppKVBytes(n_layers * k_row * size * n_stream, n_layers * v_row * size * n_stream, size,
                               n_layers, n_seq, n_stream, type_k, type_v, swa)

    if not swa_layers:
        return cache(shape.num_layers, kv_size)
    n_swa = windows.pop()
    size_swa = kv_size if swa_full else _pad(min(kv_size, n_swa * (n_seq if unified else 1) + n_ubatch), 256)
    return cache(shape.num_layers - len(swa_layers), kv_size, cache(len(swa_layers), size_swa))


def check_head_dim(type_name: str, head_dim: int, side: str) -> None:
    """Refuse (``KvcalError``) a cache type whose block does not divide ``head_dim``: llama.cpp quantizes each
    head's row in blocks of 32 and refuses such a context (``llama_init_from_model``, ``src/llama-context.cpp``:
    ``n_embd_head_k % blck_size``). ``side``: ``"K"`` or ``"V"``, named in the message."""
    t = ggml_type(type_name)
    if t.quantized and head_dim % t.blck_size:
        raise KvcalError(f"{side} cache type {t.name} with block size {t.blck_size} does not divide "
                         f"head_dim={head_dim} (llama.cpp refuses this context)")


def parse_pair(spec: str, what: str = "--format llamacpp:") -> tuple[str, str]:
    """``(type_k, type_v)`` of a cache spec: ``"q8_0"`` (both sides, as ``-ctk q8_0 -ctv q8_0``) or
    ``"q8_0,q4_0"`` (K then V, the order of ``-ctk``/``-ctv``). Raises ``KvcalError`` naming ``what`` and the
    accepted types for anything else."""
    parts = [p.strip() for p in str(spec).split(",")]
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or not all(parts):
        raise KvcalError(f"{what}{spec}: give one cache type (K and V) or two, K then V (e.g. q8_0 or q8_0,q4_0)")
    for t in parts:
        try:
            ggml_type(t)
        except KvcalError as e:
            raise KvcalError(f"{what}{spec}: {e}") from None
    return parts[0], parts[1]


def pair_bytes_per_token(config, type_k: str, type_v: str) -> int:
    """KV bytes one token takes in every layer of ``config``'s model (K and V, all KV heads) with this pair: the
    row bytes of :func:`kv_bytes` (``n_embd_k_gqa / blck_size · type_size`` per layer and side), i.e. its total
    per cell. Every layer counts, sliding-window ones included (llama.cpp's iSWA cache holds fewer cells there,
    which :func:`kv_bytes` refuses to size). Raises ``KvcalError`` for an unknown type or a head_dim a
    quantized type's block of 32 does not divide."""
    from kvcal.formats.memory import model_shape

    shape = model_shape(config)
    n_embd = shape.num_kv_heads * shape.head_dim
    check_head_dim(type_k, shape.head_dim, "K")
    check_head_dim(type_v, shape.head_dim, "V")
    return shape.num_layers * (ggml_type(type_k).row_bytes(n_embd) + ggml_type(type_v).row_bytes(n_embd))


def pair_plan(type_k: str, type_v: str, num_layers: int, head_dim: int | None = None, *,
              architecture: str | None = None, model_type: str | None = None) -> LlamaCppKVPlan:
    """The plan of ``-fa on -ctk type_k -ctv type_v`` (:class:`LlamaCppKVPlan`, llama.cpp's defaults: rotation as
    the environment says, x86 AVX quantizers, queries converted) for a GGUF of ``architecture``
    (``general.architecture``) or a transformers checkpoint of ``model_type`` (they set ``kq_interleaved``,
    :func:`kq_interleaved`); ``head_dim`` given: refused (``KvcalError``) when a quantized type's block of 32 does
    not divide it, as llama.cpp refuses that context."""
    plan = LlamaCppKVPlan(type_k, type_v, num_layers,
                          kq_interleaved=kq_interleaved(architecture, model_type))
    if head_dim is not None:
        plan._check_dim(plan.k_type, head_dim, "K")
        plan._check_dim(plan.v_type, head_dim, "V")
    return plan


def kv_memory(config, spec: str, context: int, batch: int = 1) -> dict:
    """``kvcal memory --format llamacpp:<spec>``: what llama.cpp allocates for ``-c context -np batch`` (one stream
    per sequence, llama.cpp's default without ``--kv-unified``; ``-np`` must be given: llama-server without it
    runs 4 slots in one unified cache, ``tools/server/server.cpp``) with the pair :func:`parse_pair` reads from
    ``spec``: ``{"engine", "version", "type_k", "type_v", "setting" (the llama-server arguments), "bytes_per_token"
    (:func:`pair_bytes_per_token`), "context", "batch", "cells" (per stream, after llama.cpp's padding to 256),
    "streams", "k_bytes", "v_bytes", "total" (bytes, every cache), "log_line" (the ``llama_kv_cache: size = ...``
    line it prints; two, newline-separated, for an iSWA cache), "swa_cells" (the sliding-window cache's cells per
    stream, or ``None``)}``. Raises ``KvcalError`` as :func:`kv_bytes`."""
    type_k, type_v = parse_pair(spec)
    b = kv_bytes(config, type_k, type_v, context, batch)
    return {"engine": "llama.cpp", "version": "llama-cpp-python 0.3.36", "type_k": type_k, "type_v": type_v,
            "setting": f"-fa on -ctk {type_k} -ctv {type_v} -c {context} -np {batch}", "bytes_per_token": pair_bytes_per_token(config, type_k,
                                                                                                     type_v),
            "context": context, "batch": batch, "cells": b.kv_size, "streams": b.n_stream, "k_bytes": b.k_total,
            "v_bytes": b.v_total, "total": b.total, "log_line": "\n".join(b.log_lines()),
            "swa_cells": b.swa.kv_size if b.swa else None}


# -- the weights' matmuls (what differs from kvcal's dequantized float32 model even with an unquantized cache) ---

#: GGUF tensor kind of a llama-architecture block (``blk.{i}.<kind>.weight``) -> the transformers module under
#: ``model.layers.{i}`` that runs its matmul (``gguf-py``'s tensor map for ``llama``)
GGUF_LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}


def gguf_matmul_inputs(tensor_types: dict[str, str]) -> dict[str, str]:
    """What llama.cpp's CPU backend converts the *input* of each weight matmul of a GGUF model to, from its
    ``tensor_types`` (tensor name -> lower-case ggml type name, as :func:`kvcal.models.gguf.gguf_tensor_types`
    reads them from the file's header):
    transformers module name (``model.layers.3.mlp.up_proj``, ``lm_head``) -> the ``vec_dot_type`` of the
    weight's ggml type (``ggml_compute_forward_mul_mat``, ``ggml/src/ggml-cpu/ggml-cpu.c``: ``src1`` rows are
    converted with ``from_float`` of ``type_traits_cpu[src0->type].vec_dot_type`` before the dot products):
    ``q8_1`` for Q4_1/Q5_1 weights, ``q8_0`` for Q4_0/Q5_0/Q8_0/IQ4_NL, ``q8_K`` for the K-quants Q2_K..Q6_K,
    ``f16``/``bf16`` for F16/BF16, ``f32`` (nothing) for F32; other types map to ``None`` (not emulated). A
    quantized ``blk.*`` weight outside :data:`GGUF_LINEARS` (MoE experts, shared experts, ...) appears as
    ``"gguf:<tensor name>" -> None`` so that :class:`MatmulInputs` reports it as not emulated. The output matmul is
    ``output.weight``, or ``token_embd.weight`` when the embeddings are tied."""
    vec = {n: t.vec_dot_type for n, t in GGML_TYPES.items() if n != "q8_1"}
    vec.update({k: "q8_K" for k in K_QUANT_WEIGHTS})
    out: dict[str, str] = {}
    for name, ty in tensor_types.items():
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in GGUF_LINEARS and parts[3] == "weight":
            out[f"model.layers.{parts[1]}.{GGUF_LINEARS[parts[2]]}"] = vec.get(ty)
        elif parts[0] == "blk" and parts[-1] == "weight" and ty not in ("f32", "f16", "bf16"):
            out[f"gguf:{name}"] = None  # a quantized weight kvcal maps to no module (MoE experts, ...): not emulated
    head = tensor_types.get("output.weight", tensor_types.get("token_embd.weight"))
    if head is not None:
        out["lm_head"] = vec.get(head)
    return out


_GELU_TABLE: list[torch.Tensor] = []

#: transformers activation classes computing the tanh-approximated GELU, which llama.cpp's CPU backend runs through
#: its fp16 table (``activations.py``: ``gelu_pytorch_tanh``, ``gelu_new``, ``gelu_fast``)
GELU_TANH_MODULES = ("GELUTanh", "NewGELUActivation", "FastGELUActivation")


def gelu_f16_table() -> torch.Tensor:
    """``ggml_table_gelu_f16`` (``ggml_cpu_init``, ``ggml/src/ggml-cpu/ggml-cpu.c``): float16 ``[65536]``, entry
    ``i`` = ``fp16(ggml_gelu_f32(fp32(fp16 bits i)))`` with ``ggml_gelu_f32(x) = 0.5·x·(1 + tanh(√(2/π)·x·(1 +
    0.044715·x·x)))`` in f32 (``vec.h``; torch's ``tanh`` may differ from C ``tanhf`` by an f32 ulp, which moves
    an entry only when it falls on an fp16 rounding boundary). Built once."""
    if not _GELU_TABLE:
        x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
        c, a = torch.tensor(0.79788456080286535587989211986876, dtype=torch.float32), torch.tensor(0.044715)
        y = torch.tensor(0.5) * x * (torch.tensor(1.0) + torch.tanh(c * x * (torch.tensor(1.0) + a * x * x)))
        _GELU_TABLE.append(y.to(torch.float16))
    return _GELU_TABLE[0]


def gelu_f16(x: torch.Tensor) -> torch.Tensor:
    """GELU (tanh approximation) as llama.cpp's CPU backend computes it (``ggml_vec_gelu_f32`` /
    ``ggml_vec_geglu_f32``, ``vec.h``, built with ``GGML_GELU_FP16``): ``0`` for ``x <= -10``, ``x`` for ``x >= 10``,
    else the :func:`gelu_f16_table` entry of ``fp16(x)`` as float32. ``x`` any float tensor; float32 out."""
    x = x.float()
    t = gelu_f16_table()[x.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF].float()
    return torch.where(x <= -10.0, torch.zeros_like(x), torch.where(x >= 10.0, x, t))


class MatmulInputs:
    """Context manager: ``model`` runs the arithmetic llama.cpp's CPU backend runs where it differs from kvcal's
    float32 model even with an unquantized cache. (1) Weight matmuls take their input as the backend converts
    it (:func:`gguf_matmul_inputs`: a forward pre-hook on each ``nn.Linear`` named there rounds its input through
    ``fake_quant`` of that type, blocks of 32 (256 for ``q8_K``) along the input features, x86 AVX path); with
    these hooks the weights' products are llama.cpp's up to the order of f32 sums (and the fp16 rounding of
    ``q8_1``'s block sum). (2) GELU-tanh activations (transformers' ``GELUTanh``: Gemma's ``gelu_pytorch_tanh``)
    (:data:`GELU_TANH_MODULES`) go through ggml's fp16 table (:func:`gelu_f16`, a forward hook). Nothing else changes (norms, RoPE,
    attention). ``emulated``: the matmul module names hooked -> input type; ``left``: the names found in the GGUF
    but not hooked (a type kvcal does not emulate, or no such module) and every ``nn.Linear`` of the model the
    map does not name; ``activations``: the GELU modules hooked."""

    def __init__(self, model, inputs: dict[str, str | None]):
        self.model, self.inputs = model, dict(inputs)
        self.emulated: dict[str, str] = {}
        self.left: list[str] = []
        self.activations: list[str] = []
        self._handles = []

    def __enter__(self):
        mods = dict(self.model.named_modules())
        for name, ty in self.inputs.items():
            m = mods.get(name)
            if m is None or ty is None or not isinstance(m, torch.nn.Linear) or m.in_features % (
                    QK_K if ty == "q8_K" else QK):
                self.left.append(name)
                continue
            if ty == "f32":
                continue

            def hook(mod, args, ty=ty):
                return (fake_quant(args[0].float(), ty).to(args[0].dtype), *args[1:])

            self._handles.append(m.register_forward_pre_hook(hook))
            self.emulated[name] = ty
        # a Linear of the model the GGUF map does not name runs unrounded here: not emulated either
        self.left += [n for n, m in mods.items() if isinstance(m, torch.nn.Linear) and n not in self.inputs]
        for name, m in mods.items():
            if type(m).__name__ in GELU_TANH_MODULES:
                self._handles.append(m.register_forward_hook(lambda mod, args, out: gelu_f16(args[0]).to(out.dtype)))
                self.activations.append(name)
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        return False


__all__ = ["FA_TILE_Q", "check_head_dim", "GGUF_LINEARS", "MatmulInputs", "gelu_f16", "gelu_f16_table", "gguf_matmul_inputs", "kv_memory", "pair_plan", "parse_pair", "pair_bytes_per_token", "GGML_TYPES", "PAYLOAD_BITS", "LlamaCppKVBytes", "LlamaCppKVPlan", "bits_per_value", "kv_bytes"]
