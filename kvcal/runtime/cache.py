"""``QuantizedKVCache``: a transformers ``Cache`` that stores K/V as a :class:`~kvcal.plan.KVPlan` says.

Use::

    cache = QuantizedKVCache.from_artifact("artifacts/smollm2-135m-fp8", model)
    out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=64)

What one layer's side (K or V, spec ``s``, ``H`` KV heads, head_dim ``D``, batch ``B``) holds
------------------------------------------------------------------------------------------------
Token order of a sequence is ``[sinks | quantized | window]``:

* **sinks**: the first ``n_sink = plan.sink_tokens`` tokens, ``dtype16 [B,H,n_sink,D]`` (bf16);
* **quantized**: a :class:`~kvcal.formats.quant.QuantizedTensor` laid out in preallocated buffers —
  payload ``[B,H,S_pad,row_bytes]`` (real ``float8_e4m3fn`` / ``int8`` / packed ``uint8`` codes),
  dynamic scales (and zero points) ``granularity.scale_shape(B,H,n_q,D)`` at ``s.scale_dtype``;
  static scales / zero points ``[1,H,1,D]``-style and dynamic ``clip_ratio float32 [H]`` once per
  layer; NVFP4 adds a ``float32 [1]`` global scale;
* **window**: the most recent tokens, ``dtype16 [B,H,residual_window,D]``.

Write policy (each entry is quantized when it is written; the *window* delays that):

* tokens after the sinks enter the window; when it would hold more than ``residual_window``
  tokens the oldest leave it and are quantized (from their 16-bit values). Per-token and static
  granularities evict token by token.
* per-channel-token-group sides (KIVI keys, group ``g``) with ``residual_window >= g`` evict whole
  groups: when the window overflows, the oldest ``g·k`` tokens are quantized together (KIVI
  style), so the window holds between ``residual_window - g + 1`` and ``residual_window`` tokens
  and a group is never quantized before it is full;
* with ``residual_window < g`` such a side has nowhere to hold an incomplete group in 16 bits, so
  the open group is quantized in place. It keeps its **raw** min / max (``float32 [B,H,2,D]`` per
  sequence, in the allocation contract), so its parameters are always those Protocol A computes
  from the same tokens (clip ratio applied once); when a new token widens that range, the members
  are re-quantized from their dequantized values under the new parameters — one extra rounding
  per widening, no compounding (before this, the range was re-derived from dequantized, already
  clipped members and shrank again at every token). Prefill of a whole sequence is exact.

Reads dequantize everything (``update`` returns ``[B,H,t,D]`` in the model's dtype), so the
attention of the step that writes tokens already sees them quantized — a prefill through this
cache with ``residual_window = 0`` is Protocol A (``KVPlan.fake_quant``) bit for bit.

Unquantized sides (``fp16``/``bf16`` spec) hold one ``[B,H,t,D]`` 16-bit buffer (no window or
sinks), as the contract says.

Transforms (:mod:`kvcal.formats.transforms`): a ``hadamard`` side rotates tokens by ``H/√D`` as
they are quantized and rotates back when it dequantizes; a ``pre_rope`` key side un-rotates each
token at its position before quantizing and re-applies RoPE after dequantizing. Sinks and the
residual window stay as attention reads them. Both cost no bytes (the Hadamard matrix and the
RoPE angles are recomputed). A side with query-aware rounding keeps the strict upper triangle of its
unit-diagonal rounding matrix in float8 e4m3 ``[H, D(D-1)/2]`` (per-layer metadata, in the accounting); one with
per-channel bit widths keeps them as ``uint8 [H, D]`` and packs each row with
:func:`kvcal.formats.packing.pack_channels`. ``pre_rope`` needs every token's position to equal its cache slot
(transformers passes ``position_ids`` to ``update``; a left-padded batch is refused with a
``ValueError`` rather than rotated at the wrong angle).

Allocation (the contract of :mod:`kvcal.formats.memory`, byte for byte)
-------------------------------------------------------------------------
``max_cache_len=T`` preallocates every buffer for ``T`` tokens at the first ``update`` (server
style), so ``allocated_bytes() == cache_bytes(model, plan configs, T, B)``. Without it the
buffers grow to exactly the contract's sizes for the current length ``t``, so
``allocated_bytes() == cache_bytes(..., context=t, batch=B)`` after every update. Before the first
update only per-layer metadata is held (``cache_bytes(context=0)``), including the key-centering
mean ``k_mean float32 [1,H,1,D]`` of layers whose plan has one (``KVCacheConfig.key_centering``).

Left padding: pad positions are cached like any token and masked by attention. Sinks are the
first cache slots of each row, so with left padding the pads, not the prompt's first tokens, would be
the sinks: a plan with ``sink_tokens > 0`` refuses (``ValueError``) a write into the sink slots whose
``position_ids`` differ from the slots (batch prompts of equal length, or use ``sink_tokens = 0``).
"""

from __future__ import annotations

import torch

from kvcal.errors import ArtifactError
from kvcal.formats.transforms import Transform
from kvcal.plan import KVPlan

try:  # transformers is a runtime dependency of this layer (style: runtime adds transformers)
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError as e:  # pragma: no cover
    raise ImportError("kvcal.runtime needs transformers") from e
from kvcal.runtime.side import SideStorage


class QuantizedKVLayer(CacheLayerMixin):
    """One decoder layer's quantized K/V storage (a transformers ``CacheLayerMixin``).

    ``sliding_window`` ``W > 0``: a sliding-window layer (transformers' ``DynamicSlidingWindowLayer``
    contract): each update returns the ``min(seen, W - 1)`` previous tokens plus the new ones (the model's
    sliding mask, sized by :meth:`get_mask_sizes`, hides the rest), then drops what no later query reads
    (:meth:`SideStorage.drop_before`), so it holds at most ``W - 1`` tokens (plus whole token groups / a 16-bit
    window of token-group sides, :func:`kvcal.formats.memory.sliding_held`). Kept tokens are never
    re-quantized: it reads the values a full-attention cache of the same plan would hold there. It is
    sized by what it holds, never preallocated to ``max_cache_len``."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, plan: KVPlan, layer_idx: int, num_kv_heads: int, head_dim: int,
                 max_cache_len: int | None = None, sliding_window: int = 0):
        super().__init__()
        lp = plan.layers[layer_idx]
        self.layer_idx = layer_idx
        self.sliding_window = int(sliding_window)
        self.is_sliding = self.sliding_window > 0
        self.max_cache_len = None if self.is_sliding else max_cache_len
        self.capacity = max_cache_len
        self.k = SideStorage(lp.k, num_kv_heads, head_dim, plan.sink_tokens, plan.residual_window)
        self.v = SideStorage(lp.v, num_kv_heads, head_dim, plan.sink_tokens, plan.residual_window)
        self.cumulative_length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        if H != self.k.H or D != self.k.D:
            raise ValueError(f"layer {self.layer_idx}: key states have {H} heads x head_dim {D}, the plan "
                             f"was built for {self.k.H} x {self.k.D}")
        self.device = key_states.device
        for side, x in ((self.k, key_states), (self.v, value_states)):
            side.init(B, x.device, x.dtype)
            if self.max_cache_len is not None:
                side.reserve(self.max_cache_len)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write ``[B,H,s,D]`` new keys/values; return all cached keys/values dequantized ``[B,H,t,D]``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if Transform.PRE_ROPE in (self.k.transform, self.v.transform):
            self._check_positions(key_states, kwargs)
        if self.cumulative_length < max(self.k.sinks, self.v.sinks):
            self._check_sink_positions(key_states, kwargs)
        s = key_states.shape[-2]
        t = self.cumulative_length + s
        if self.capacity is not None and t > self.capacity:
            raise ValueError(f"QuantizedKVCache is full: {t} tokens > max_cache_len {self.capacity}")
        if self.is_sliding:
            W = self.sliding_window
            n = min(self.cumulative_length, W - 1) + s  # what this step's queries may read (get_mask_sizes)
            for side, x in ((self.k, key_states), (self.v, value_states)):
                side.reserve_more(s)
                side.append(x)
            k, v = self.k.read()[:, :, -n:], self.v.read()[:, :, -n:]
            for side in (self.k, self.v):
                side.drop_before(max(0, t - (W - 1)))
            self.cumulative_length = t
            return k, v
        for side, x in ((self.k, key_states), (self.v, value_states)):
            side.reserve(t)
            side.append(x)
        self.cumulative_length = t
        return self.k.read(), self.v.read()

    @staticmethod
    def _position_ids(kwargs: dict) -> torch.Tensor | None:
        """The ``position_ids`` transformers passes to ``update`` (``[B, s]`` or ``[s]``), or ``None``."""
        inner = kwargs.get("kwargs")
        pos = inner.get("position_ids") if isinstance(inner, dict) else None
        return kwargs.get("position_ids") if pos is None else pos

    def _check_sink_positions(self, x: torch.Tensor, kwargs: dict) -> None:
        """Attention sinks are the first cache slots of every row: refuse a write into those slots whose
        position ids differ from the slots (a left-padded batch, where the pads would be kept in 16 bits
        and the prompt's first tokens quantized). Without position ids nothing can be checked."""
        pos = self._position_ids(kwargs)
        if pos is None:
            return
        s = x.shape[-2]
        n = min(s, max(self.k.sinks, self.v.sinks) - self.cumulative_length)
        want = torch.arange(self.cumulative_length, self.cumulative_length + n, device=pos.device)
        if pos.shape[-1] != s or not bool((pos.reshape(-1, s)[:, :n] == want).all()):
            raise ValueError(f"layer {self.layer_idx}: attention sinks are the first {max(self.k.sinks, self.v.sinks)} "
                             "cache slots of every row, but this batch's position ids differ from the slots "
                             "(left padding?): the pads, not the prompt's first tokens, would be kept in 16 bits. "
                             "Batch prompts of equal length or use a plan with sink_tokens=0.")

    def _check_positions(self, x: torch.Tensor, kwargs: dict) -> None:
        """Pre-RoPE sides rotate by the cache slot: refuse position ids that differ from it."""
        pos = self._position_ids(kwargs)
        s = x.shape[-2]
        if pos is None:
            raise ValueError(f"layer {self.layer_idx}: a pre-RoPE key cache needs the position_ids of new tokens "
                             "(transformers passes them to Cache.update); none were given")
        want = torch.arange(self.cumulative_length, self.cumulative_length + s, device=pos.device)
        if pos.shape[-1] != s or not bool((pos.reshape(-1, s) == want).all()):
            raise ValueError(f"layer {self.layer_idx}: pre-RoPE keys need positions equal to cache slots "
                             f"{self.cumulative_length}..{self.cumulative_length + s - 1}; got other position ids "
                             "(left padding?). Batch prompts of equal length or use a post-RoPE plan.")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.is_sliding:  # as transformers' DynamicSlidingWindowLayer: W - 1 past tokens at most
            W = self.sliding_window
            return min(self.cumulative_length, W - 1) + query_length, max(self.cumulative_length - W + 1, 0)
        return self.cumulative_length + query_length, 0

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        if self.is_sliding:
            return self.sliding_window
        return -1 if self.max_cache_len is None else self.max_cache_len

    def reset(self) -> None:
        for side in (self.k, self.v):
            if side.B:
                side.init(side.B, side.device, side.dtype)
                if self.max_cache_len is not None:
                    side.reserve(self.max_cache_len)
            side.n_sink = side.n_win = side.n_q = side.sinks_written = 0
            side.q_origin = side.sinks
            if side.global_scale is not None:
                side.global_scale.zero_()
        self.cumulative_length = 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("QuantizedKVCache cannot be cropped (quantized groups are not reversible)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for side in (self.k, self.v):
            side.map_batch(lambda t: t.index_select(0, indices.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        for side in (self.k, self.v):
            side.map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def offload(self):  # buffers stay where they are
        return None

    def prefetch(self):
        return None

    def nbytes(self) -> int:
        return self.k.nbytes() + self.v.nbytes()


class QuantizedKVCache(Cache):
    """A transformers ``Cache`` storing every layer's K/V as ``plan`` says (module docstring).

    ``plan``: :class:`~kvcal.plan.KVPlan` (post-RoPE keys, or pre-RoPE / Hadamard sides with
    their transform, see the module docstring). ``model_config``: the model's
    transformers config (or its text config). ``max_cache_len``: preallocate this many tokens per
    sequence at the first update (``None``: grow exactly); sliding-window layers (the config's
    ``layer_types`` / ``sliding_window``, e.g. Gemma 3) are :class:`QuantizedKVLayer` with their window, hold
    at most about ``W - 1`` tokens and are never preallocated. Raises ``ValueError`` if the plan's layer count /
    scale shapes do not fit the config or the config has layer types other than full / sliding attention.
    """

    def __init__(self, plan: KVPlan, model_config, max_cache_len: int | None = None):
        from kvcal.formats.memory import model_shape

        cfg = model_config.get_text_config(decoder=True) if hasattr(model_config, "get_text_config") else model_config
        shp = model_shape(cfg)
        if plan.num_layers != shp.num_layers:
            raise ValueError(f"plan has {plan.num_layers} layers, the model {shp.num_layers}")
        if plan.key_position not in ("post_rope", "pre_rope"):
            raise ValueError(f"unknown key_position {plan.key_position!r}")
        if plan.key_position == "pre_rope" and plan.rope_table() is None:
            raise ValueError("plan says keys are pre-RoPE but no key side has a RoPE table")
        if max_cache_len is not None and (not isinstance(max_cache_len, int) or max_cache_len < 1):
            raise ValueError(f"max_cache_len must be a positive integer or None, got {max_cache_len!r}")
        self.plan, self.shape, self.max_cache_len = plan, shp, max_cache_len
        layers = [QuantizedKVLayer(plan, i, shp.num_kv_heads, shp.head_dim, max_cache_len, shp.window(i))
                  for i in range(shp.num_layers)]
        super().__init__(layers=layers)

    @classmethod
    def from_artifact(cls, path_or_artifact, model, max_cache_len: int | None = None) -> QuantizedKVCache:
        """Build the cache for ``model`` from a kvcal artifact directory / file or a loaded
        :class:`~kvcal.artifact.Artifact`. Loading is strict: raises :class:`ArtifactError` naming
        the field (num_layers, num_kv_heads, head_dim, config_sha256) when the artifact was made
        for another model, or naming the missing/ill-shaped tensor."""
        from kvcal.artifact import Artifact, check_model_match, load_artifact
        from kvcal.models import model_metadata

        art = path_or_artifact if isinstance(path_or_artifact, Artifact) else load_artifact(path_or_artifact)
        mm = model_metadata(model.config, getattr(model, "kvcal_source", None), architecture=type(model).__name__)
        check_model_match(art.metadata, mm)
        try:
            plan = KVPlan.from_artifact(art.tensors, art.metadata)
            return cls(plan, model.config, max_cache_len)
        except (ValueError, KeyError, RuntimeError) as e:
            raise ArtifactError(f"{art.path}: cannot build the runtime cache: {e}") from None

    def kv_configs(self) -> list:
        """One :class:`~kvcal.formats.spec.KVCacheConfig` per layer (for the memory accounting)."""
        return [self.plan.kv_config(i) for i in range(self.plan.num_layers)]

    @property
    def batch_size(self) -> int:
        b = self.layers[0].k.B
        return b if b else -1

    def allocated_bytes(self) -> int:
        """Bytes of every tensor the cache holds (``nbytes`` sum over layers and sides)."""
        return sum(layer.nbytes() for layer in self.layers)

    def expected_bytes(self) -> int:
        """:func:`kvcal.formats.memory.cache_bytes` for this cache's capacity and batch (the
        current length when growing; ``max_cache_len`` when preallocated)."""
        from kvcal.formats.memory import cache_bytes, memory_report

        t = self.get_seq_length()
        ctx = self.max_cache_len if (self.max_cache_len is not None and self.layers[0].is_initialized) else t
        if self.shape.layer_windows:  # sliding layers are sized by what they hold after t tokens
            return memory_report(self.shape, self.kv_configs(), ctx, max(self.layers[0].k.B, 1),
                                 sliding_context=t).total
        return cache_bytes(self.shape, self.kv_configs(), ctx, max(self.layers[0].k.B, 1))


__all__ = ["QuantizedKVCache", "QuantizedKVLayer"]
