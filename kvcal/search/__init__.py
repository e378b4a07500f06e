"""Attention-aware objectives and the scale search (torch only)."""
