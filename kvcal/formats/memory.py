"""Exact KV-cache memory accounting, in bytes — the allocation contract of the runtime cache.

Allocation contract (what ``kvcal.runtime``'s cache must allocate, byte for byte)
--------------------------------------------------------------------------------
For a cache with capacity ``T`` tokens (``context``) and batch ``B``, for every layer and each
side (K, V) with spec ``s`` (:class:`~kvcal.formats.spec.TensorQuantSpec`), ``H`` = KV heads,
``D`` = head_dim:

1. **Unquantized side** (``fp16``/``bf16``): one buffer ``[B, H, T, D]`` of 2-byte elements.
   Nothing else (window and sinks do not apply).
2. **Quantized side**: split the ``T`` positions into

   * ``n_sink = min(sink_tokens, T)`` first tokens: buffer ``[B, H, n_sink, D]`` in ``dtype16``;
   * ``n_win = min(residual_window, T - n_sink)`` most recent tokens: buffer
     ``[B, H, n_win, D]`` in ``dtype16``;
   * ``n_q = T - n_sink - n_win`` quantized tokens (token groups start right after the sinks):

     - payload ``[B, H, S_pad, row_bytes]`` (1-byte elements: ``uint8``/``int8``/fp8 dtype),
       where ``S_pad, D_pad = s.padded_dims(n_q, D)`` (tokens rounded up to whole token groups:
       a partially filled group is allocated whole) and ``row_bytes = s.row_bytes(D)``
       (``D_pad`` values packed: 8-bit 1/byte, 4-bit 2/byte, 2-bit 4/byte, 3-bit 8 per 3 bytes,
       5-bit 8 per 5 bytes, 6-bit 4 per 3 bytes);
     - dynamic granularities: ``scale`` of shape ``s.granularity.scale_shape(B, H, n_q, D)`` at
       ``s.scale_dtype`` (per-token ``[B,H,n_q,1]``, per-token-group ``[B,H,n_q,ceil(D/g)]``
       — a channel group larger than ``D`` acts as ``D``, no padding —,
       per-channel-token-group ``[B,H,ceil(n_q/g),D]``), plus a ``zero_point`` of the same shape
       and dtype when asymmetric; NVFP4: block scales ``float8_e4m3fn [B,H,n_q,ceil(D/16)]``;
     - per-channel-token groups with ``residual_window < g`` and ``n_q > 0`` (tokens leave the
       window one by one, so the last group fills up while it is read): the open group's raw
       min / max ``float32 [B,H,2,D]``, from which its parameters are recomputed as it grows.

   * per-layer metadata, independent of ``B`` and ``T``:

     - static granularities: ``scale`` of shape ``scale_shape(1, H, 1, D)`` (per-tensor
       ``[1,1,1,1]``, per-head ``[1,H,1,1]``, per-channel ``[1,H,1,D]``) at ``s.scale_dtype``,
       plus a ``zero_point`` of the same shape/dtype when asymmetric;
     - dynamic granularities: the calibrated ``clip_ratio`` ``float32 [H]`` (log8 scales: and their
       base, ``float32 [H]``);
     - NVFP4 additionally: the global scale ``float32 [1]``;
     - by the side's :class:`~kvcal.formats.variants.SideVariant` (``KVCacheConfig.key_variant`` /
       ``value_variant``): with ``centering`` (keys), the per-channel key mean ``float32 [1,H,1,D]``;
       with query-aware ``rounding``, the strict upper triangle of the unit-diagonal rounding matrix,
       ``float8_e4m3fn [H, D(D-1)/2]``; with ``allocated`` channel widths, the widths table
       ``uint8 [H, D]``; with a ``levels`` codebook, the table ``float32 [H, 2^b]``; with a
       ``trellis`` codebook (values), the table, ``int8 [trellis_entries]``.

:func:`cache_bytes` is the sum of all of these over layers; it equals the ``nbytes`` of the
:class:`~kvcal.formats.quant.QuantizedTensor` that :func:`~kvcal.formats.quant.quantize` returns
for the ``n_q`` quantized tokens, plus the 16-bit buffers and the per-layer metadata.
:func:`bytes_per_token` is the marginal cost of one more quantized token of one sequence, summed
over layers and sides: payload plus per-token parameters, with per-channel-token-group parameters
amortized over their ``g`` tokens (so it can be fractional); it excludes 16-bit windows and
per-layer metadata, which :func:`cache_bytes` adds.

Example (SmolLM2-135M: 30 layers, 3 KV heads, D = 64): 16-bit = 2 sides x 30 x 3 x 64 x 2 bytes =
23040 bytes/token; fp8 per-tensor = 11520 bytes/token + 2 x 30 x 4 bytes of static scales.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction

from kvcal.formats.granularity import PerChannelTokenGroup, PerToken, PerTokenGroup
from kvcal.formats.spec import DEFAULTS, LOG8, KVCacheConfig, QFormat, TensorQuantSpec
from kvcal.formats.variants import ChannelWidths, Codebook, Rounding, SideVariant


@dataclass(frozen=True)
class ModelShape:
    """The architecture numbers that size a KV cache.

    ``num_layers`` (decoder layers with a KV cache), ``num_kv_heads`` (H_kv), ``head_dim`` (D),
    ``max_position_embeddings`` (default context; ``None`` if unknown). Raises ``ValueError`` for
    non-positive sizes."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int | None = None
    layer_windows: tuple[int, ...] | None = None

    def __post_init__(self):
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"ModelShape.{name} must be a positive integer, got {v!r}")
        lw = self.layer_windows
        if lw is not None:
            if len(lw) != self.num_layers or any(not isinstance(w, int) or w < 0 or w == 1 for w in lw):
                raise ValueError(f"ModelShape.layer_windows must hold one window per layer (0: full attention, "
                                 f">= 2: sliding window of that many tokens), got {lw!r}")
            if not any(lw):
                object.__setattr__(self, "layer_windows", None)

    def window(self, layer: int) -> int:
        """Sliding window ``W`` of ``layer`` (its query reads the last ``W`` tokens, itself included; the
        cache keeps ``W - 1`` between steps), or 0 for a full-attention layer."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def sliding_layers(self) -> list[int]:
        """Indices of the sliding-window layers (empty for an all-full-attention model)."""
        return [i for i, w in enumerate(self.layer_windows or ()) if w]


def model_shape(config) -> ModelShape:
    """A :class:`ModelShape` from a ``ModelShape``, an HF ``config.json`` dict, or a config object
    (e.g. ``transformers.PretrainedConfig``; duck-typed, transformers is not imported).

    Reads ``num_hidden_layers``, ``num_key_value_heads`` (default ``num_attention_heads``),
    ``head_dim`` (default ``hidden_size // num_attention_heads``), ``max_position_embeddings``;
    uses ``text_config`` when present. Raises ``ValueError`` naming a missing field."""
    if isinstance(config, ModelShape):
        return config
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    text = get("text_config")
    if text is not None:
        return model_shape(text)

    def need(k):
        v = get(k)
        if v is None:
            raise ValueError(f"model config lacks {k!r}; cannot size the KV cache")
        return int(v)

    n_heads = get("num_attention_heads")
    kv = get("num_key_value_heads") or n_heads
    hd = get("head_dim")
    if not hd:
        hd = need("hidden_size") // need("num_attention_heads")
    if kv is None:
        raise ValueError("model config lacks 'num_key_value_heads' and 'num_attention_heads'")
    mpe = get("max_position_embeddings")
    n_layers = need("num_hidden_layers")
    return ModelShape(n_layers, int(kv), int(hd), None if mpe is None else int(mpe),
                      _layer_windows(get("layer_types"), get("sliding_window"), n_layers))


def _layer_windows(layer_types, sliding_window, n_layers: int) -> tuple[int, ...] | None:
    """Per-layer windows from a config's ``layer_types`` (transformers' per-layer attention kinds, e.g.
    Gemma 3: five ``sliding_attention`` then one ``full_attention``) and ``sliding_window``. ``None`` when
    the config has no ``layer_types`` or none is sliding (every layer reads every token). Raises
    ``ValueError`` for a kind kvcal does not size (e.g. ``chunked_attention``) or a sliding layer without a
    window."""
    if not layer_types:
        return None
    if len(layer_types) != n_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {n_layers} layers")
    unknown = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
    if unknown:
        raise ValueError(f"layer_types {unknown}: kvcal sizes full_attention and sliding_attention layers only")
    if "sliding_attention" not in layer_types:
        return None
    if not isinstance(sliding_window, int) or sliding_window < 2:
        raise ValueError(f"sliding_attention layers need sliding_window >= 2, got {sliding_window!r}")
    return tuple(sliding_window if t == "sliding_attention" else 0 for t in layer_types)




def _sb(spec: TensorQuantSpec) -> int:
    return spec.scale_dtype.itemsize


def _n_params(spec: TensorQuantSpec) -> int:
    """Scale tensors per group: 1, or 2 with a zero point."""
    return 2 if spec.has_zero_point else 1


def side_bytes_per_token(spec: TensorQuantSpec, H: int, D: int) -> Fraction:
    """Marginal bytes of one quantized token of one sequence for one layer's side (exact)."""
    if not spec.is_quantized:
        return Fraction(H * D * 2)
    g = spec.granularity
    payload = spec.row_bytes(D)
    if spec.format is QFormat.NVFP4:
        params = Fraction(-(-D // DEFAULTS["nvfp4_block"]))  # 1-byte fp8 block scales
    elif isinstance(g, PerToken):
        params = Fraction(_n_params(spec) * _sb(spec))
    elif isinstance(g, PerTokenGroup):
        params = Fraction(_n_params(spec) * _sb(spec) * -(-D // g.group_size))
    elif isinstance(g, PerChannelTokenGroup):
        params = Fraction(_n_params(spec) * _sb(spec) * D, g.group_size)
    else:  # static: per-layer metadata only
        params = Fraction(0)
    return H * (payload + params)


def levels_bytes(spec, H: int) -> int:
    """Bytes of one side's non-uniform levels table, ``float32 [H, 2^b]``
    (:func:`kvcal.formats.quant.check_levels`)."""
    return 4 * H * 2**spec.bits


def side_extra_bytes(spec: TensorQuantSpec, H: int, D: int, variant: SideVariant) -> int:
    """Per-layer metadata bytes a side's variant adds beyond its spec's own (0 for an unquantized
    side): key-centering mean ``float32 [1,H,1,D]``, query-aware rounding triangle
    (:func:`rounding_bytes`), allocated widths ``uint8 [H, D]``, a levels codebook
    (:func:`levels_bytes`) or a trellis codebook's ``trellis_entries`` int8 entries."""
    if not spec.is_quantized:
        return 0
    n = H * D * 4 if variant.centering else 0
    if variant.rounding is Rounding.QUERY_AWARE:
        n += rounding_bytes(H, D)
    if variant.channel_widths is ChannelWidths.ALLOCATED:
        n += H * D
    match variant.codebook:
        case Codebook.LEVELS:
            n += levels_bytes(spec, H)
        case Codebook.TRELLIS:
            n += variant.trellis_entries
    return n


def rounding_bytes(H: int, D: int) -> int:
    """Bytes of one side's query-aware rounding matrix as the runtime keeps it: the strict upper
    triangle of the unit-diagonal ``Ũ`` in float8 e4m3 (:func:`kvcal.formats.quant.unit_rounding`),
    ``H · D(D−1)/2``."""
    return H * (D * (D - 1) // 2)


def side_static_bytes(spec: TensorQuantSpec, H: int, D: int) -> int:
    """Per-layer metadata bytes of one side (independent of batch and context)."""
    if not spec.is_quantized:
        return 0
    g = spec.granularity
    n = 0
    if g.static:
        shape = g.scale_shape(1, H, 1, D)
        numel = 1
        for d in shape:
            numel *= d
        n += _n_params(spec) * numel * _sb(spec)
    else:
        n += H * DEFAULTS["clip_ratio_dtype"].itemsize
        if spec.scale_dtype == LOG8:
            n += H * 4  # float32 log8 scale base per KV head
    if spec.format is QFormat.NVFP4:
        n += DEFAULTS["global_scale_dtype"].itemsize
    return n


def sliding_held(spec: TensorQuantSpec, context: int, window: int, residual_window: int = 0,
                 sink_tokens: int = 0) -> tuple[int, int, int, int]:
    """What one side of a sliding-window layer (window ``W``) holds after ``context`` tokens were written:
    ``(sinks, quantized, window16, quantized_ever)`` token counts (an unquantized side: ``(0, 0, n, 0)``).

    The layer writes tokens as a full-attention layer would (sinks, then the residual window, whose
    overflow is quantized: token by token, or whole groups of ``g`` for per-channel-token-group sides with
    ``residual_window >= g``), then drops every token its next query cannot read: those before absolute
    position ``a = max(0, context - (W - 1))`` (transformers keeps ``W - 1`` tokens between steps). Sinks go
    first; quantized tokens leave in whole token groups only (a group's parameters come from all its members,
    so a group stays until its last member leaves: up to ``g - 1`` tokens more than ``W - 1``); 16-bit
    window tokens leave only once no quantized token precedes them, and never on token-group sides (their
    group is not formed yet). Dropping never changes a kept token's stored value, so the layer reads what a
    full-attention cache of the same plan would hold for the positions the model's sliding mask lets it see.
    Raises ``ValueError`` for ``W < 2`` or a negative context."""
    if window < 2 or context < 0:
        raise ValueError(f"sliding window must be >= 2 and context >= 0, got {window} and {context}")
    a = max(0, context - (window - 1))
    if not spec.is_quantized:
        return 0, 0, context - a, 0
    tg = spec.token_group
    ns = min(sink_tokens, context)
    m = context - ns
    if tg and residual_window >= tg:
        nq = 0 if m <= residual_window else -(-(m - residual_window) // tg) * tg
    else:
        nq = max(0, m - residual_window)
    nw = m - nq
    ds = min(ns, a)
    dq = min(max(a - ns, 0), nq)
    if tg:
        dq -= dq % tg
    dw = min(max(a - ns - nq, 0), nw) if (not tg and dq == nq) else 0
    return ns - ds, nq - dq, nw - dw, nq


def side_cache_bytes(
    spec: TensorQuantSpec, H: int, D: int, context: int, batch: int, residual_window: int = 0,
    sink_tokens: int = 0, dtype16_bytes: int = 2, sliding_window: int = 0,
) -> dict:
    """Bytes one layer's side allocates (see the module contract), as a dict with keys
    ``payload``, ``params`` (per-token/group scales and zero points), ``dense16`` (sink + window
    buffers, or the whole buffer of an unquantized side), ``static`` (per-layer metadata).
    ``sliding_window`` ``W > 0``: a sliding-window layer, sized by what it holds after ``context`` tokens
    (:func:`sliding_held`: at most ``W - 1`` tokens, more only by whole token groups or a 16-bit
    residual window on token-group sides), whatever the context."""
    T, B = context, batch
    if sliding_window:
        n_sink, n_q, n_win, ever = sliding_held(spec, T, sliding_window, residual_window, sink_tokens)
        if not spec.is_quantized:
            return {"payload": 0, "params": 0, "dense16": B * H * n_win * D * 2, "static": 0}
    else:
        if not spec.is_quantized:
            return {"payload": 0, "params": 0, "dense16": B * H * T * D * 2, "static": 0}
        n_sink = min(sink_tokens, T)
        n_win = min(residual_window, T - n_sink)
        n_q = ever = T - n_sink - n_win
    s_pad, _ = spec.padded_dims(n_q, D)
    payload = B * H * s_pad * spec.row_bytes(D)
    g = spec.granularity
    params = 0
    if not g.static:
        numel = 1
        for d in g.scale_shape(B, H, n_q, D):
            numel *= d
        if spec.format is QFormat.NVFP4:
            params = numel  # fp8 block scales, 1 byte
        else:
            params = _n_params(spec) * numel * _sb(spec)
    if isinstance(g, PerChannelTokenGroup) and residual_window < g.group_size and ever > 0:
        params += B * H * 2 * D * 4  # raw min / max of the open token group, float32 [B,H,2,D]
    dense = B * H * (n_sink + n_win) * D * dtype16_bytes
    return {"payload": payload, "params": params, "dense16": dense, "static": side_static_bytes(spec, H, D)}


def _layer_configs(shape: ModelShape, kv_config) -> list[KVCacheConfig]:
    if isinstance(kv_config, KVCacheConfig):
        return [kv_config] * shape.num_layers
    if isinstance(kv_config, Sequence) and all(isinstance(c, KVCacheConfig) for c in kv_config):
        if len(kv_config) != shape.num_layers:
            raise ValueError(f"got {len(kv_config)} per-layer configs for a model with {shape.num_layers} layers")
        return list(kv_config)
    raise ValueError(f"kv_config must be a KVCacheConfig or one per layer, got {type(kv_config).__name__}")


def bytes_per_token(model_config, kv_config: KVCacheConfig | Sequence[KVCacheConfig]) -> float:
    """Marginal cache bytes of one more quantized token of one sequence (all layers, K and V).

    ``model_config``: anything :func:`model_shape` accepts. ``kv_config``: one
    :class:`KVCacheConfig` for every layer, or a list with one per layer. Per-channel-token-group
    scales are amortized over their group (the result may be fractional). Excludes windows/sinks
    and per-layer metadata (see :func:`cache_bytes`). Raises ``ValueError`` on bad inputs."""
    return float(bytes_per_token_exact(model_config, kv_config))


def bytes_per_token_exact(model_config, kv_config) -> Fraction:
    """:func:`bytes_per_token` as an exact ``Fraction``."""
    shp = model_shape(model_config)
    H, D = shp.num_kv_heads, shp.head_dim
    total = Fraction(0)
    for c in _layer_configs(shp, kv_config):
        total += side_bytes_per_token(c.key, H, D) + side_bytes_per_token(c.value, H, D)
    return total


@dataclass(frozen=True)
class MemoryReport:
    """Breakdown of :func:`cache_bytes` (all in bytes; ints except ``bytes_per_token``)."""

    model: ModelShape
    context: int
    batch: int
    bytes_per_token: float
    payload: int
    params: int
    dense16: int
    static: int
    total: int
    config: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "model": {
                "num_layers": self.model.num_layers, "num_kv_heads": self.model.num_kv_heads,
                "head_dim": self.model.head_dim, "max_position_embeddings": self.model.max_position_embeddings,
                "sliding_layers": self.model.sliding_layers,
                "sliding_window": max(self.model.layer_windows) if self.model.layer_windows else None,
            },
            "context": self.context, "batch": self.batch, "bytes_per_token": self.bytes_per_token,
            "bytes": {"payload": self.payload, "scales_and_zero_points": self.params,
                      "dense16_window_and_sinks": self.dense16, "per_layer_metadata": self.static,
                      "total": self.total},
            "kv_config": self.config,
        }


def memory_report(model_config, kv_config, context: int, batch: int = 1, *,
                  sliding_context: int | None = None) -> MemoryReport:
    """Full breakdown of the cache allocation for ``batch`` sequences of capacity ``context``
    tokens. Sliding-window layers (``ModelShape.layer_windows``, from the config's ``layer_types``) count what
    they hold after ``sliding_context`` tokens (default ``context``; :func:`sliding_held`): at most ``W - 1``
    tokens each, so at long context the full-attention layers dominate. Raises ``ValueError`` for a negative
    context or a batch < 1."""
    if not isinstance(context, int) or context < 0:
        raise ValueError(f"context must be an integer >= 0, got {context!r}")
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
    shp = model_shape(model_config)
    H, D = shp.num_kv_heads, shp.head_dim
    acc = {"payload": 0, "params": 0, "dense16": 0, "static": 0}
    cfgs = _layer_configs(shp, kv_config)
    sctx = context if sliding_context is None else sliding_context
    for i, c in enumerate(cfgs):
        w = shp.window(i)
        for spec in (c.key, c.value):
            part = side_cache_bytes(spec, H, D, sctx if w else context, batch, c.residual_window, c.sink_tokens,
                                    c.dtype16.itemsize, sliding_window=w)
            for k in acc:
                acc[k] += part[k]
        acc["static"] += (side_extra_bytes(c.key, H, D, c.key_variant)
                          + side_extra_bytes(c.value, H, D, c.value_variant))
    conf = cfgs[0].to_dict() if all(c == cfgs[0] for c in cfgs) else {"per_layer": [c.to_dict() for c in cfgs]}
    return MemoryReport(shp, context, batch, float(bytes_per_token_exact(shp, cfgs)), acc["payload"],
                        acc["params"], acc["dense16"], acc["static"], sum(acc.values()), conf)


def cache_bytes(model_config, kv_config, context: int, batch: int = 1) -> int:
    """Exact bytes the runtime cache allocates for ``batch`` sequences of ``context`` tokens
    (the module's allocation contract): payload, scales/zero points, 16-bit sinks and residual
    window, and per-layer metadata. Raises ``ValueError`` on bad inputs."""
    return memory_report(model_config, kv_config, context, batch).total


def peak_cache_bytes(model_config, kv_config, context: int, batch: int = 1) -> tuple[int, int]:
    """``(bytes, at)``: the most the runtime cache allocates for ``batch`` sequences on their way to ``context``
    tokens, ``max(cache_bytes(t) for t <= context)``, and the first ``t`` where it does — what a sequence
    that grows to ``context`` needs, the quantity to plan capacity with. Equal to ``cache_bytes(context)``
    where the cache only grows; it differs on sliding-window layers with token-group sides (KIVI-style
    keys): such a layer holds its ``W - 1`` tokens plus the unfinished part of its oldest group, up to
    ``g - 1`` tokens more, so its bytes rise and fall with period ``g`` (:func:`sliding_held`).

    Exact without scanning every ``t``: past ``t0 = max(W + sinks + residual_window) + p`` (``p`` the lcm of
    the sliding token-group sizes) each sliding side's held counts depend on ``t mod g`` only and every other
    term is non-decreasing in ``t``, so the maximum over ``t <= context`` is reached in the last ``p``
    positions; below ``t0`` every position is evaluated (``t0 + p`` evaluations at most). Raises ``ValueError`` as :func:`cache_bytes`."""
    import math

    shp = model_shape(model_config)
    if not isinstance(context, int) or context < 0:
        raise ValueError(f"context must be an integer >= 0, got {context!r}")
    cfgs = _layer_configs(shp, kv_config)
    period, t0 = 1, 0
    for i, c in enumerate(cfgs):
        w = shp.window(i)
        for spec in (c.key, c.value) if w else ():
            if spec.is_quantized and spec.token_group:
                period = math.lcm(period, spec.token_group)
                t0 = max(t0, w + c.sink_tokens + c.residual_window)
    if period == 1:
        return cache_bytes(shp, cfgs, context, batch), context
    t0 += period
    groups: dict = {}  # layers that hold alike: (config, window) -> count
    for i, c in enumerate(cfgs):
        groups[(c, shp.window(i))] = groups.get((c, shp.window(i)), 0) + 1
    key = (shp.num_kv_heads, shp.head_dim, tuple(groups.items()))
    static = cache_bytes(shp, cfgs, 0, batch) - _held_bytes(key, 0, batch)
    best, at = _scan_peak(key, batch, 0, min(context + 1, t0))  # the same for every context >= t0
    b, t = _scan_peak(key, batch, max(t0, context - period + 1), context + 1)
    if b > best:
        best, at = b, t
    return static + best, at


def _held_bytes(key: tuple, t: int, batch: int) -> int:
    """Context-dependent bytes (payload, params, 16-bit buffers) of every layer after ``t`` tokens; ``key`` is
    ``(H, D, ((config, window), layer count), ...)``."""
    H, D, groups = key
    return sum(n * _side_bytes_cached(spec, H, D, t, batch, c.residual_window, c.sink_tokens, c.dtype16.itemsize, w)
               for (c, w), n in groups for spec in (c.key, c.value))


@functools.lru_cache(maxsize=256)
def _scan_peak(key: tuple, batch: int, start: int, stop: int) -> tuple[int, int]:
    """``(max, first argmax)`` over ``t`` in ``[start, stop)`` of :func:`_held_bytes` (``(-1, 0)`` if empty)."""
    best, at = -1, 0
    for t in range(start, stop):
        b = _held_bytes(key, t, batch)
        if b > best:
            best, at = b, t
    return best, at


@functools.lru_cache(maxsize=1 << 14)
def _side_bytes_cached(spec, H, D, t, batch, residual_window, sink_tokens, dtype16_bytes, window) -> int:
    part = side_cache_bytes(spec, H, D, t, batch, residual_window, sink_tokens, dtype16_bytes, sliding_window=window)
    return part["payload"] + part["params"] + part["dense16"]


__all__ = [
    "ModelShape", "model_shape", "bytes_per_token", "bytes_per_token_exact", "cache_bytes",
    "memory_report", "MemoryReport", "peak_cache_bytes", "side_bytes_per_token", "side_cache_bytes", "sliding_held", "side_static_bytes", "rounding_bytes", "levels_bytes",
    "side_extra_bytes",
]
