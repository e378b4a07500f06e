"""Numeric formats, granularities, packing and memory accounting (torch only, no transformers)."""
