"""Memory: the bytes of the page vLLM 0.33 allocates per token and KV head for a ``--kv-cache-dtype``
(:func:`head_slot_bytes`), the layers it keeps at 16 bits on its own (:func:`boundary_skip_layers`) and the
per-layer bytes per token (:func:`layer_bytes_per_token`)."""

from __future__ import annotations

import math

from kvcal.engines.vllm.dtypes.dispatch import check_head_dim
from kvcal.engines.vllm.dtypes.registry import TQ_PRESETS, VllmDTypeError, vllm_dtype


# ---- memory: the page vLLM allocates -------------------------------------------------------------
def head_slot_bytes(name: str, head_dim: int) -> int:
    """Bytes vLLM 0.33 allocates per token per KV head for K and V together in a layer with
    ``--kv-cache-dtype name`` (its page's ``state_content_size_bytes``, summed over K and V slots):

    * ``auto``/``bfloat16``/``float16``: ``2·D·2``; fp8 static: ``2·D`` (scales are layer
      parameters, not in the page);
    * ``fp8``/``int8_per_token_head``: ``2·D + 2·4`` (inline fp32 scales;
      ``TritonAttentionBackend.customize_spec``); ``int4_per_token_head``: ``2·(D/2) + 2·4``;
    * ``nvfp4*``: ``2·(D/2 + D/16)`` (``FlashInferBackend.customize_spec``,
      ``nvfp4_kv_cache_full_dim``; the outer scale is a layer parameter);
    * ``turboquant_*``: ``TurboQuantConfig.slot_size_aligned`` — key ``D`` bytes (k8) or
      ``ceil(D·b/8) + 2`` (fp16 norm), value ``ceil(D·b/8) + 4`` (fp16 scale and zero), K+V
      rounded up to even.

    Raises :class:`VllmDTypeError` for an unknown name, a non-positive head_dim or one the dtype cannot
    store (:func:`check_head_dim`)."""
    D = int(head_dim)
    if D <= 0:
        raise VllmDTypeError(f"head_dim must be positive, got {head_dim!r}")
    if name in ("auto", "bfloat16", "float16"):
        return 4 * D
    vllm_dtype(name)
    check_head_dim(name, D)
    if name in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        return 2 * D
    if name in ("fp8_per_token_head", "int8_per_token_head"):
        return 2 * D + 8
    if name == "int4_per_token_head":
        return 2 * (D // 2) + 8
    if vllm_dtype(name).family == "nvfp4":
        return 2 * (D // 2 + D // 16)
    kb, vb, _ = TQ_PRESETS[name]
    key = D if kb == 8 else math.ceil(D * kb / 8) + 2
    slot = key + math.ceil(D * vb / 8) + 4
    return slot + slot % 2


def boundary_skip_layers(name: str, num_layers: int, n: int = 2) -> list[int]:
    """Layers vLLM adds to ``--kv-cache-dtype-skip-layers`` on its own for ``name`` (dense
    models): the first and last ``min(n, L//2)`` for turboquant presets
    (``TurboQuantConfig.get_boundary_skip_layers``), none otherwise."""
    if not vllm_dtype(name).default_skip_boundary or n <= 0 or num_layers <= 0:
        return []
    n = min(n, num_layers // 2)
    return sorted(set(range(n)) | set(range(num_layers - n, num_layers)))


def layer_bytes_per_token(name: str, num_layers: int, num_kv_heads: int, head_dim: int,
                          skip_layers=(), *, add_boundary: bool = True) -> list[int]:
    """Per-layer KV bytes per token as vLLM allocates pages: ``H_kv · head_slot_bytes`` for the
    quantized layers, the 16-bit slot for skipped ones (``skip_layers`` plus, when
    ``add_boundary``, :func:`boundary_skip_layers`). Excludes vLLM's block-size alignment
    padding of skipped layers' pages (``platforms/interface.py``, ``skip_page_size_padded``).
    Raises :class:`VllmDTypeError` for a layer index outside ``[0, num_layers)``."""
    skip = set(int(i) for i in skip_layers)
    bad = sorted(i for i in skip if not 0 <= i < num_layers)
    if bad:
        raise VllmDTypeError(f"skip layer(s) {bad} out of range for a model with {num_layers} layers")
    if add_boundary:
        skip |= set(boundary_skip_layers(name, num_layers))
    q = num_kv_heads * head_slot_bytes(name, head_dim)
    d16 = num_kv_heads * head_slot_bytes("auto", head_dim)
    return [d16 if i in skip else q for i in range(num_layers)]
