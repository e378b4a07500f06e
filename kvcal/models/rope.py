"""The rotary embedding a model's keys are rotated with, as :class:`~kvcal.formats.transforms.RopeTable`
(:func:`rope_table`, one per layer :func:`rope_tables`), for pre-RoPE key quantization."""

from __future__ import annotations

import torch

from kvcal.models.config import head_dim_of


def rope_table(model):
    """The model's rotary embedding as a :class:`~kvcal.formats.transforms.RopeTable` (for
    pre-RoPE key quantization).

    Finds the decoder's rotary module (a submodule with an ``inv_freq`` buffer). Raises
    ``ValueError`` naming the reason when the model has none, several different ones, a partial
    rotary dimension (``2·len(inv_freq) != head_dim``, e.g. GPT-NeoX ``rotary_pct``) or a
    sequence-length-dependent rope type (``dynamic``, ``longrope``) whose angles a fixed table
    cannot reproduce."""
    from kvcal.formats.transforms import RopeTable

    mods = [m for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)]
    per_type = sorted({n[: -len("_inv_freq")] for m in model.modules() for n, _ in m.named_buffers(recurse=False)
                       if n.endswith("_inv_freq") and not n.endswith("original_inv_freq")})
    if not mods and per_type:  # e.g. Gemma 3: RoPE base 10k on sliding layers, 1M on global ones
        raise ValueError(f"{type(model).__name__} rotates keys with one rotary embedding per layer type "
                         f"({', '.join(per_type)}); pre-RoPE keys support one")
    if not mods:
        raise ValueError(f"{type(model).__name__} has no rotary embedding (inv_freq); pre-RoPE keys need RoPE")
    f0 = mods[0].inv_freq
    if any(m.inv_freq.shape != f0.shape or not torch.equal(m.inv_freq, f0) for m in mods[1:]):
        raise ValueError("the model has several different rotary embeddings; pre-RoPE keys support one")
    rt = getattr(mods[0], "rope_type", "default")
    if rt in ("dynamic", "longrope"):
        raise ValueError(f"rope_type {rt!r} changes its angles with the sequence length; use post-RoPE keys")
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    D = head_dim_of(cfg)
    if 2 * f0.numel() != D:
        raise ValueError(f"partial rotary embedding ({2 * f0.numel()} of head_dim {D} channels); "
                         "pre-RoPE keys support full rotary only")
    return RopeTable(f0.detach().float().cpu().clone(), float(getattr(mods[0], "attention_scaling", 1.0)))


def rope_tables(model) -> list:
    """The RoPE table each decoder layer's keys are rotated with, as a list of
    :class:`~kvcal.formats.transforms.RopeTable` (one per layer, ``num_hidden_layers`` long; layers of one type
    share one object). A model with one rotary embedding gives :func:`rope_table` for every layer; a model with
    one per layer type (Gemma 3: ``{type}_inv_freq`` / ``{type}_attention_scaling`` on ``Gemma3RotaryEmbedding``,
    base 10k on ``sliding_attention`` layers and 1M on ``full_attention`` ones, chosen per layer by the config's
    ``layer_types``) gives each layer its type's table. Raises ``ValueError`` as :func:`rope_table` does (no
    rotary embedding, partial rotary, a sequence-length-dependent rope type) naming the layer type."""
    from kvcal.formats.transforms import RopeTable

    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    n = int(cfg.num_hidden_layers)
    owners = [m for m in model.modules() if any(b.endswith("_inv_freq") and not b.endswith("original_inv_freq")
                                                for b, _ in m.named_buffers(recurse=False))]
    if not owners or any(isinstance(getattr(m, "inv_freq", None), torch.Tensor) for m in model.modules()):
        return [rope_table(model)] * n
    if len(owners) > 1:
        raise ValueError("the model has several per-layer-type rotary embeddings; pre-RoPE keys support one")
    rm, types = owners[0], list(getattr(cfg, "layer_types", None) or [])
    if len(types) != n:
        raise ValueError(f"{type(model).__name__} has one rotary embedding per layer type but its config lists "
                         f"{len(types)} layer_types for {n} layers")
    D = head_dim_of(cfg)
    tables = {}
    for t in sorted(set(types)):
        f = getattr(rm, f"{t}_inv_freq", None)
        if not isinstance(f, torch.Tensor):
            raise ValueError(f"{type(model).__name__} has no rotary embedding for {t} layers; pre-RoPE keys need RoPE")
        rt = (getattr(rm, "rope_type", None) or {}).get(t, "default") if isinstance(getattr(rm, "rope_type", None),
                                                                                  dict) else "default"
        if rt in ("dynamic", "longrope"):
            raise ValueError(f"{t} layers' rope_type {rt!r} changes its angles with the sequence length; use "
                             "post-RoPE keys")
        if 2 * f.numel() != D:
            raise ValueError(f"partial rotary embedding on {t} layers ({2 * f.numel()} of head_dim {D} channels); "
                             "pre-RoPE keys support full rotary only")
        tables[t] = RopeTable(f.detach().float().cpu().clone(), float(getattr(rm, f"{t}_attention_scaling", 1.0)))
    return [tables[t] for t in types]
