"""A character-level tokenizer stub (one id per character) for evaluation tests without a real tokenizer."""

from __future__ import annotations

import torch


class CharTok:
    """Minimal tokenizer stand-in: one id per character (ids 1..127)."""

    def __call__(self, text, add_special_tokens=False, return_tensors="pt"):
        class R:
            input_ids = torch.tensor([[ord(c) % 127 + 1 for c in text]])

        return R()
