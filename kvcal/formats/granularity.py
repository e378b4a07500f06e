"""Granularity types: which elements of a K/V tensor share one quantization scale.

K/V tensors are laid out as the cache stores them: ``[B, H_kv, S, D]`` (batch, KV heads,
tokens, head_dim). Each type maps that tensor to the shape of its scale tensor. Source for the
set of granularities: torchao ``quantization/granularity.py``; KIVI (Liu et al. 2024) for the
per-channel-over-token-groups key layout.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Granularity:
    """Base class. ``name`` is the string used in configs, artifacts and the CLI."""

    name = "base"
    static = True  # parameters come from calibration (True) or are computed at write time (False)

    def scale_shape(self, B: int, H: int, S: int, D: int) -> tuple[int, ...]:
        raise NotImplementedError

    def reduce_dims(self) -> tuple[int, ...]:
        """Dims of ``[B,H,S,D]`` reduced when computing a range (only for non-grouped types)."""
        raise NotImplementedError


@dataclass(frozen=True)
class PerTensor(Granularity):
    """One scale for the whole layer's K (or V): ``[B,H,S,D] -> scale [1,1,1,1]``."""

    name = "tensor"

    def scale_shape(self, B, H, S, D):
        return (1, 1, 1, 1)

    def reduce_dims(self):
        return (0, 1, 2, 3)


@dataclass(frozen=True)
class PerHead(Granularity):
    """One scale per KV head: ``[B,H,S,D] -> scale [1,H,1,1]`` (compressed-tensors ``attn_head``)."""

    name = "head"

    def scale_shape(self, B, H, S, D):
        return (1, H, 1, 1)

    def reduce_dims(self):
        return (0, 2, 3)


@dataclass(frozen=True)
class PerChannel(Granularity):
    """One static scale per KV head and channel (keys): ``[B,H,S,D] -> scale [1,H,1,D]``."""

    name = "channel"

    def scale_shape(self, B, H, S, D):
        return (1, H, 1, D)

    def reduce_dims(self):
        return (0, 2)


@dataclass(frozen=True)
class PerToken(Granularity):
    """Dynamic, one scale per token and head: ``[B,H,S,D] -> scale [B,H,S,1]``."""

    name = "token"
    static = False

    def scale_shape(self, B, H, S, D):
        return (B, H, S, 1)

    def reduce_dims(self):
        return (3,)


@dataclass(frozen=True)
class PerTokenGroup(Granularity):
    """Dynamic, per token, groups of ``group_size`` channels: ``[B,H,S,D] -> scale [B,H,S,D/g]``.

    KIVI's value layout. ``D`` is padded up to a multiple of ``group_size`` if needed.
    """

    group_size: int = 32
    name = "token_group"
    static = False

    def __post_init__(self):
        if self.group_size <= 0:
            raise ValueError(f"group_size must be positive, got {self.group_size}")

    def scale_shape(self, B, H, S, D):
        return (B, H, S, -(-D // self.group_size))


@dataclass(frozen=True)
class PerChannelTokenGroup(Granularity):
    """Dynamic, per channel, groups of ``group_size`` consecutive tokens (KIVI keys):
    ``[B,H,S,D] -> scale [B,H,ceil(S/g),D]``."""

    group_size: int = 32
    name = "channel_token_group"
    static = False

    def __post_init__(self):
        if self.group_size <= 0:
            raise ValueError(f"group_size must be positive, got {self.group_size}")

    def scale_shape(self, B, H, S, D):
        return (B, H, -(-S // self.group_size), D)


def granularity_from_name(name: str, group_size: int | None = None) -> Granularity:
    """Parse a granularity name (``tensor``, ``head``, ``channel``, ``token``, ``token_group``,
    ``channel_token_group``). Raises ``ValueError`` naming the valid choices."""
    simple = {"tensor": PerTensor, "head": PerHead, "channel": PerChannel, "token": PerToken}
    if name in simple:
        return simple[name]()
    if name == "token_group":
        return PerTokenGroup(32 if group_size is None else group_size)
    if name == "channel_token_group":
        return PerChannelTokenGroup(32 if group_size is None else group_size)
    raise ValueError(
        f"unknown granularity {name!r}; choose one of tensor, head, channel, token, token_group, "
        "channel_token_group"
    )
