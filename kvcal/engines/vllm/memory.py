"""The pages vLLM 0.33 allocates for a model's KV cache: bytes per token and for ``batch`` sequences of ``context``
tokens, sliding-window layers included (no torch).

Each layer's page content per token is :func:`kvcal.engines.vllm.dtypes.layer_bytes_per_token` (payload plus inline
scales, e4m3 block scales or fp16 norms, by ``--kv-cache-dtype``); this module adds what vLLM's allocator does with
it: the token slots a layer reserves (whole blocks; a sliding-window layer its window plus the in-flight tokens),
the share of a sequence a sliding layer holds, and the padding of hybrid models to whole page groups. The model's
shape comes from :func:`kvcal.formats.memory.model_shape`. Moved from :mod:`kvcal.formats.memory` (issue 41).
"""

from __future__ import annotations

from kvcal.formats.memory import model_shape


def vllm_token_shares(model_config, context: int | None = None) -> tuple | None:
    """Per layer, the share of a ``context``-token sequence vLLM 0.33 holds pages for
    (:func:`vllm_layer_tokens` / ``context``, as exact :class:`fractions.Fraction`): 1 for full attention;
    for a sliding-window layer its window plus the in-flight tokens (at most the context, +1 block) over the
    context (Gemma 3 270M at 32,768 tokens: 2,576 / 32,768 ≈ 0.079). ``None`` for a model without
    sliding-window layers, whose bytes per token do not depend on the context. ``context`` defaults to the
    model's ``max_position_embeddings``. Raises ``ValueError`` for a context < 1 or none known."""
    from fractions import Fraction

    shp = model_shape(model_config)
    if not shp.sliding_layers:
        return None
    ctx = context if context is not None else shp.max_position_embeddings
    if not isinstance(ctx, int) or ctx < 1:
        raise ValueError(f"context must be an integer >= 1 (sliding-window layers hold a share of it), got {ctx!r}")
    return tuple(Fraction(vllm_layer_tokens(shp.window(i), ctx), ctx) if shp.window(i) else Fraction(1)
                 for i in range(shp.num_layers))


def vllm_bytes_per_token(model_config, kv_cache_dtype: str, skip_layers=(), *, add_boundary: bool = True,
                         context: int | None = None) -> int:
    """KV bytes per token (all layers, K and V) that vLLM 0.33 allocates for
    ``--kv-cache-dtype kv_cache_dtype`` (:mod:`kvcal.engines.vllm.dtypes`): each layer's page content
    per token — payload plus inline per-token scales (``*_per_token_head``), e4m3 block scales
    (``nvfp4*``) or fp16 norms/scales/zeros (``turboquant_*``) — with ``skip_layers`` (and, when
    ``add_boundary``, the first/last 2 layers vLLM always skips for turboquant) at 16 bits. Static
    scales (fp8 ``k_scale``/``v_scale``/``q_scale``, nvfp4 outer scales) are layer parameters, not
    cache pages, and are not counted; nor is vLLM's page padding of skipped layers. Raises
    ``ValueError`` for an unknown dtype or a layer index out of range.

    SmolLM2-135M (30 layers, 3 KV heads, D = 64): fp8 11520, int8/fp8_per_token_head 12240,
    int4_per_token_head 6480, nvfp4 6480, turboquant_3bit_nc 7284 (4 boundary layers at 16 bits).

    ``context`` (a model with sliding-window layers only; ignored otherwise): bytes per token *averaged over a
    sequence of that many tokens*, each layer's slot weighted by the share vLLM holds
    (:func:`vllm_token_shares`), rounded up — what a ``--max-bytes-per-token`` budget compares on such a
    model, where a sliding layer's pages stop growing at its window."""
    import math

    from kvcal.engines.vllm.dtypes import layer_bytes_per_token

    shp = model_shape(model_config)
    per_layer = layer_bytes_per_token(kv_cache_dtype, shp.num_layers, shp.num_kv_heads, shp.head_dim, skip_layers,
                                      add_boundary=add_boundary)
    shares = vllm_token_shares(model_config, context) if context is not None else None
    if shares is None:
        return sum(per_layer)
    return math.ceil(sum(b * w for b, w in zip(per_layer, shares, strict=True)))


#: vLLM 0.33 ``SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS``: the in-flight tokens a sliding-window layer's
#: pages are reserved for beyond its window (``VllmConfig.max_in_flight_tokens`` = this x 1 concurrent batch)
VLLM_MAX_NUM_BATCHED_TOKENS = 2048


def vllm_layer_tokens(window: int, context: int, *, block_size: int = 16,
                      max_num_batched_tokens: int = VLLM_MAX_NUM_BATCHED_TOKENS) -> int:
    """Token slots (whole blocks) vLLM 0.33 reserves for one sequence of ``context`` tokens in one layer.

    Full attention (``window == 0``): ``ceil(context / block_size)`` blocks (``FullAttentionSpec``).
    Sliding window ``W`` (``SlidingWindowSpec.max_admission_blocks_per_request``, which sizes the pool and gates
    admission): ``ceil(min(W - 1 + max_in_flight_tokens, context) / block_size) + 1`` blocks — the last
    ``W - 1`` computed tokens plus the tokens scheduled but not yet settled (blocks below the window are freed
    on the processed-token basis, ``SlidingWindowManager.remove_skipped_blocks``), +1 because the window need
    not start on a block boundary. ``max_in_flight_tokens`` is ``max_num_batched_tokens`` for one concurrent
    batch (2048 by default; ``vllm serve`` may set another per usage context: pass what the server uses)."""
    if window:
        return (-(-min(window - 1 + max_num_batched_tokens, context) // block_size) + 1) * block_size
    return -(-context // block_size) * block_size


def vllm_cache_bytes(model_config, kv_cache_dtype: str, context: int, batch: int = 1, *, block_size: int = 16,
                     skip_layers=(), add_boundary: bool = True,
                     max_num_batched_tokens: int = VLLM_MAX_NUM_BATCHED_TOKENS) -> int:
    """Bytes of the pages vLLM holds for ``batch`` sequences of ``context`` tokens: per layer, the token slots
    of :func:`vllm_layer_tokens` (full attention: ``ceil(context / block_size)`` whole blocks; sliding-window
    layers: their window plus the in-flight tokens, at most the context, +1 block) at that layer's bytes per
    token (:func:`vllm_bytes_per_token`'s per-layer terms). A hybrid model whose layers all have the same page
    size is grouped as vLLM's ``_get_kv_cache_groups_uniform_page_size`` does: each attention type's layers
    are padded to a multiple of the group size (the smallest layer count of a type, or the largest when it is
    under 1.5x the smallest), and padding layers take pages like their type's (Gemma 3 270M: 15 sliding = 5
    groups of 3, 3 full = 1 group, no padding). Raises ``ValueError`` for a negative context, a batch < 1 or a
    block size < 1."""
    from kvcal.engines.vllm.dtypes import layer_bytes_per_token

    if not isinstance(context, int) or context < 0:
        raise ValueError(f"context must be an integer >= 0, got {context!r}")
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    shp = model_shape(model_config)
    per_layer = layer_bytes_per_token(kv_cache_dtype, shp.num_layers, shp.num_kv_heads, shp.head_dim, skip_layers,
                                      add_boundary=add_boundary)
    windows = [shp.window(i) for i in range(shp.num_layers)]
    total = sum(b * vllm_layer_tokens(w, context, block_size=block_size, max_num_batched_tokens=max_num_batched_tokens)
                for b, w in zip(per_layer, windows, strict=True))
    types = sorted(set(windows))
    if len(types) > 1 and len(set(per_layer)) == 1:  # vLLM's padding of each type to whole groups
        counts = {w: windows.count(w) for w in types}
        lo, hi = min(counts.values()), max(counts.values())
        gs = hi if hi < lo * 1.5 else lo
        for w, n in counts.items():
            pad = -(-n // gs) * gs - n
            total += pad * per_layer[0] * vllm_layer_tokens(w, context, block_size=block_size,
                                                             max_num_batched_tokens=max_num_batched_tokens)
    return batch * total


__all__ = ["vllm_bytes_per_token", "vllm_token_shares", "vllm_cache_bytes", "vllm_layer_tokens",
           "VLLM_MAX_NUM_BATCHED_TOKENS"]
