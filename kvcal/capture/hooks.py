"""One generic hook for every attention layer, through transformers' attention-function interface.

transformers (>= 4.48) calls ``attention_interface(module, query, key, value, attention_mask,
scaling=..., **kw)`` with the **post-RoPE** query ``[B, H_q, S, D]`` and the key/value exactly as
the cache stores them ``[B, H_kv, S_kv, D]`` (before GQA repetition), with ``module.layer_idx``.
kvcal registers one function under :data:`HOOK_NAME` that hands these tensors to the active
callback and then delegates to the model's original implementation (sdpa / eager / flash), so
outputs are bit-identical. The same hook serves capture (callback returns ``None``) and
fake-quantized evaluation (callback returns replacement ``(key, value)``).

Architecture differences (attention scaling, softcapping) are read from the module; the masking
function of the original implementation is registered under the hook's name too.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

import torch

HOOK_NAME = "kvcal_hook"

# stack of (callback, original implementation name); the top one is active
_ACTIVE: list[tuple[Callable, str]] = []
_REGISTERED = False


def _original_fn(module, impl: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if impl in ("eager", None):
        mod = sys.modules[type(module).__module__]
        fn = getattr(mod, "eager_attention_forward", None)
        if fn is None:
            raise RuntimeError(f"{type(module).__name__} has no eager_attention_forward to delegate to")
        return fn
    return ALL_ATTENTION_FUNCTIONS[impl]


class AttentionOutput:
    """What a callback returns to replace the attention computation itself (an engine whose kernel rounds
    differently from the model's attention, e.g. llama.cpp's fp16 ``P · V`` accumulator): ``output`` ``[B, S_q,
    H_q, D_v]`` in the model's dtype, as an attention function returns it."""

    __slots__ = ("output",)

    def __init__(self, output: torch.Tensor):
        self.output = output


def _hook_fn(module, query, key, value, attention_mask, **kwargs):
    if not _ACTIVE:
        raise RuntimeError("kvcal attention hook called outside of an attention_hook() context")
    callback, impl = _ACTIVE[-1]
    out = callback(module, query, key, value, attention_mask, kwargs)
    if isinstance(out, AttentionOutput):
        return out.output, None
    if out is not None and len(out) == 3:  # (query, key, value): e.g. an engine's query quantization
        query, key, value = out
    elif out is not None:
        key, value = out
    return _original_fn(module, impl)(module, query, key, value, attention_mask, **kwargs)


def original_attention(module) -> Callable:
    """The model's own attention function (sdpa / eager / flash) that the active hook delegates to, for a
    callback that runs attention itself on replaced tensors (same masking, GQA, scaling, softcapping as the
    model). Call it as ``fn(module, query, key, value, attention_mask, **kwargs)`` with the callback's
    arguments; it returns ``(output [B, S, H_q, D], weights or None)``. Raises ``RuntimeError`` outside an
    :func:`attention_hook` context."""
    if not _ACTIVE:
        raise RuntimeError("original_attention called outside of an attention_hook() context")
    return _original_fn(module, _ACTIVE[-1][1])


def _register(impl: str) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(HOOK_NAME, _hook_fn)
    mask_fn = ALL_MASK_ATTENTION_FUNCTIONS[impl] if impl in ALL_MASK_ATTENTION_FUNCTIONS else None
    if mask_fn is not None:
        AttentionMaskInterface.register(HOOK_NAME, mask_fn)


def _configs(model) -> list:
    seen, out = set(), []
    for m in model.modules():
        c = getattr(m, "config", None)
        if c is not None and id(c) not in seen and hasattr(c, "_attn_implementation"):
            seen.add(id(c))
            out.append(c)
    return out


@contextlib.contextmanager
def attention_hook(model, callback: Callable) -> Iterator[None]:
    """Run ``callback(module, query, key, value, attention_mask, kwargs)`` at every attention call.

    ``query`` ``[B, H_q, S_q, D]`` post-RoPE; ``key``/``value`` ``[B, H_kv, S_kv, D]`` as cached
    (post-RoPE keys). ``module.layer_idx`` names the layer. Return ``None`` to leave K/V
    unchanged, a ``(key, value)`` pair to replace what attention reads, a ``(query, key,
    value)`` triple to replace the query too, or an :class:`AttentionOutput` to replace the attention output. The model's attention
    implementation is restored on exit, also on error. Raises ``RuntimeError`` if the model does
    not use transformers' attention-function interface.
    """
    configs = _configs(model)
    if not configs:
        raise RuntimeError(f"{type(model).__name__} has no config with an attention implementation")
    originals = [(c, c._attn_implementation) for c in configs]
    impl = originals[0][1] or "eager"
    _register(impl)
    _ACTIVE.append((callback, impl))
    try:
        for c, _ in originals:
            c._attn_implementation_internal = HOOK_NAME
        yield
    finally:
        for c, orig in originals:
            c._attn_implementation_internal = orig
        _ACTIVE.pop()


def attention_layers(model) -> list[torch.nn.Module]:
    """Modules that own a KV cache slot (they have an integer ``layer_idx``), in layer order."""
    mods = [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int) and hasattr(m, "config")]
    mods = [m for m in mods if any(n in type(m).__name__.lower() for n in ("attention", "attn"))]
    return sorted(mods, key=lambda m: m.layer_idx)


def attention_scaling(module, head_dim: int) -> float:
    """Softmax scaling the module uses (``module.scaling`` where present, else ``D ** -0.5``)."""
    s = getattr(module, "scaling", None)
    return float(s) if s is not None else head_dim**-0.5


def attention_window(module) -> int:
    """Sliding window ``W`` the attention module reads (transformers' ``module.sliding_window``, set on
    Gemma 3's / Mistral's sliding layers: the current token and ``W - 1`` before it), 0 for full attention.
    Raises ``ValueError`` for a window that is not an integer >= 2."""
    w = getattr(module, "sliding_window", None)
    if w is None or w == 0:
        return 0
    if isinstance(w, bool) or not isinstance(w, int) or w < 2:
        raise ValueError(f"{type(module).__name__}.sliding_window = {w!r}: expected None or an integer >= 2")
    return w


@contextlib.contextmanager
def capture_kv(model, on_layer: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, object], None]):
    """Capture context: calls ``on_layer(layer_idx, q, k, v, module)`` for each attention call.

    ``q`` ``[B, H_q, S, D]``, ``k``/``v`` ``[B, H_kv, S, D]`` (post-RoPE, detached, the model's
    dtype). Refuses NaN/Inf activations with a ``FloatingPointError`` naming the layer.
    """

    def cb(module, q, k, v, mask, kwargs):
        idx = module.layer_idx
        for name, t in (("query", q), ("key", k), ("value", v)):
            if not torch.isfinite(t).all():
                raise FloatingPointError(
                    f"non-finite {name} activations (NaN/Inf) in attention layer {idx} "
                    f"({type(module).__name__}); check the model's dtype and weights"
                )
        on_layer(idx, q.detach(), k.detach(), v.detach(), module)
        return None

    with attention_hook(model, cb):
        yield
