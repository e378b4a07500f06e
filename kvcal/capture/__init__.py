"""Capture of post-RoPE queries, keys and values at every attention layer, and streaming statistics."""

from kvcal.capture.hooks import attention_hook, capture_kv  # noqa: F401
