"""What kvcal reads of a model's config without loading its weights: the config itself
(:func:`load_model_config`), its maximum positions and vocabulary size, the checks of ``--device`` and of a
context against the maximum, and the artifact's ``"model"`` section (:func:`model_metadata`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from kvcal.errors import ModelLoadError
from kvcal.models.gguf import gguf_header
from kvcal.models.source import ModelSource, _cached_conversion, resolve_model
from kvcal.weights import config_hash


def check_device(device: str) -> None:
    """Refuse a ``--device`` this torch build cannot use, before any work: ``cpu``, ``cuda`` or
    ``cuda:N`` with CUDA available and ``N`` below the visible device count. Raises
    :class:`~kvcal.errors.KvcalError` naming the option and the fix."""
    from kvcal.errors import KvcalError

    d = str(device)
    if d == "cpu":
        return
    idx = d.partition(":")[2]
    if not (d == "cuda" or (d.startswith("cuda:") and idx.isdigit())):
        raise KvcalError(f"--device {d!r}: choose cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        build = "has no CUDA support" if torch.version.cuda is None else "sees no CUDA device"
        raise KvcalError(f"--device {d}: this torch build ({torch.__version__}) {build}; use --device cpu")
    if idx and int(idx) >= torch.cuda.device_count():
        raise KvcalError(f"--device {d}: only {torch.cuda.device_count()} CUDA device(s) are visible "
                         f"(cuda:0..cuda:{torch.cuda.device_count() - 1})")


def check_max_positions(tokens: int, max_positions: int | None, option: str, where: str = "") -> None:
    """Refuse ``option`` (e.g. ``--context``, ``--max-seq-len``) asking for ``tokens`` positions when
    the model has ``max_positions`` (``max_position_embeddings``; ``None``/0: not recorded, nothing
    checked). ``where``: where the maximum was read (e.g. ``" (artifact metadata)"``). The one check
    every command uses: positions past the trained range give K/V (and quality figures) a served model
    never produces. Raises :class:`~kvcal.errors.KvcalError` naming both numbers."""
    from kvcal.errors import KvcalError

    if max_positions and int(tokens) > int(max_positions):
        raise KvcalError(f"{option} {tokens} exceeds the model's max_position_embeddings {max_positions}{where}: the "
                         f"model never serves positions past it; pass {option} <= {max_positions}")


def load_model_config(model: str | ModelSource | None):
    """Load the transformers config of ``model`` (a ``--model`` value or its resolved :class:`ModelSource`; no
    weights; a GGUF's from its conversion cache, :func:`gguf_cache_dir`). Raises :class:`ModelLoadError`."""
    from transformers import AutoConfig

    src = resolve_model(model)
    try:
        return _cached_conversion(src, "config.json", AutoConfig.from_pretrained,
                                  lambda: AutoConfig.from_pretrained(src.path, **src.load_kwargs))
    except Exception as e:
        raise ModelLoadError(f"cannot read the config of {src.model_id}: {e}") from None


def max_positions(model: str | None) -> int | None:
    """``max_position_embeddings`` of ``model`` (text config) without loading weights; ``None`` when
    the config does not record it. A GGUF is read from its header (``{arch}.context_length``, which
    transformers maps to ``max_position_embeddings``) in milliseconds instead of transformers' full
    GGUF parse. Raises :class:`ModelLoadError`."""
    src = resolve_model(model)
    if src.gguf_file:
        fields, _ = gguf_header(Path(src.path) / src.gguf_file)
        v = fields.get(f"{fields.get('general.architecture')}.context_length")
        return int(v) if v else None
    cfg = load_model_config(model)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    v = getattr(cfg, "max_position_embeddings", None)
    return int(v) if v else None


def model_vocab_size(model: str | ModelSource | None, config=None) -> int | None:
    """Rows of ``model``'s token embedding (its text config's ``vocab_size``) without loading weights;
    ``None`` when the config does not record it. A GGUF is read from its header (``{arch}.vocab_size``).
    Token ids at or above it index past the embedding. ``config``: the model's config when the caller has
    already loaded it (:func:`load_model_config`; not read again). Raises :class:`ModelLoadError`."""
    src = resolve_model(model)
    if src.gguf_file:
        fields, _ = gguf_header(Path(src.path) / src.gguf_file)
        v = fields.get(f"{fields.get('general.architecture')}.vocab_size")
    else:
        cfg = config if config is not None else load_model_config(src)
        v = getattr(cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg, "vocab_size", None)
    return int(v) if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def weight_precision(src: ModelSource, dtype: torch.dtype) -> str:
    """Human-readable weight precision, kept apart from the KV precision in every report."""
    dt = str(dtype).replace("torch.", "")
    if src.gguf_file:
        name = src.gguf_file
        qtype = None
        for part in name.split("."):
            if part.upper().startswith(("Q", "F16", "BF16", "F32", "IQ")) and any(c.isdigit() for c in part):
                qtype = part.upper()
        return f"GGUF {qtype or 'quantized'} weights, dequantized to {dt} for computation"
    return f"{dt} weights (as loaded from the checkpoint)"


def head_dim_of(config) -> int:
    hd = getattr(config, "head_dim", None)
    if hd:
        return int(hd)
    return int(config.hidden_size // config.num_attention_heads)


def model_metadata(
    config, src: ModelSource | None = None, dtype: torch.dtype = torch.float32, architecture: str | None = None
) -> dict:
    """The artifact's ``"model"`` section for a transformers config.

    Keys: id, config_sha256 (see :func:`kvcal.weights.config_hash`), architecture, model_type,
    num_layers, num_attention_heads, num_kv_heads, head_dim, max_position_embeddings,
    weight_precision, and for a model with sliding-window layers ``layer_windows`` (per layer its window
    ``W``, 0 for full attention: what memory figures computed from the artifact alone count).
    """
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(cfg, "num_attention_heads", None) or not getattr(cfg, "num_hidden_layers", None):
        raise ModelLoadError(
            f"{getattr(cfg, 'model_type', type(cfg).__name__)} has no attention layers and therefore no KV cache "
            "to calibrate (e.g. a state-space model); kvcal calibrates transformer decoders"
        )
    n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    archs = [architecture] if architecture else (getattr(config, "architectures", None) or [type(config).__name__])
    from kvcal.formats.memory import model_shape

    windows = model_shape(cfg).layer_windows  # None without sliding-window layers: the section is unchanged
    return {
        "id": src.model_id if src else getattr(config, "_name_or_path", "unknown"),
        "config_sha256": config_hash(cfg.to_dict()),  # the normalized view export hashes from config.json
        "architecture": archs[0],
        "model_type": cfg.model_type,
        "num_layers": int(cfg.num_hidden_layers),
        "num_attention_heads": int(cfg.num_attention_heads),
        "num_kv_heads": int(n_kv),
        "head_dim": head_dim_of(cfg),
        "max_position_embeddings": int(getattr(cfg, "max_position_embeddings", 0) or 0),
        "weight_precision": weight_precision(src, dtype) if src else str(dtype),
        **({"layer_windows": list(windows)} if windows else {}),
    }


def read_json(path: str | os.PathLike) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)
