"""Loading a model's tokenizer and weights offline (:func:`load_tokenizer`, :func:`load_model`), the check
that a checkpoint holds exactly the model's weights (:func:`check_loading_info`), and writing a model as a plain
Hugging Face checkpoint (:func:`save_hf_checkpoint`)."""

from __future__ import annotations

import contextlib
import functools
import os
import re
from pathlib import Path

import torch

from kvcal.errors import ModelLoadError
from kvcal.models.config import model_vocab_size
from kvcal.models.gguf import check_gguf_tensors
from kvcal.models.source import ModelSource, _cached_conversion, resolve_model
from kvcal.weights import ATTENTION_SCALE, format_ranges

#: :func:`load_tokenizer`'s default ``vocab_size``: read it from the model's config
FROM_CONFIG = object()


def load_tokenizer(model: str | ModelSource | None, vocab_size=FROM_CONFIG):
    """Load the tokenizer of ``model`` (a ``--model`` string, or the :class:`ModelSource` a preflight resolved)
    offline (a GGUF's from its conversion cache, :func:`gguf_cache_dir`: the same files ``save_pretrained``
    writes). Raises :class:`ModelLoadError` (:func:`check_tokenizer_files`, or transformers cannot load it).

    The tokenizer carries ``kvcal_vocab_size``, the model's :func:`model_vocab_size` (``None`` if unknown):
    :func:`kvcal.corpus.load_corpus` and :func:`kvcal.evaluate.windows.corpus_stream` refuse token ids at
    or above it (a tokenizer that is not the model's) before any model loads. ``vocab_size``: that number when
    the caller has read it already (:class:`kvcal.inputs.ModelInputs`), so the config is not read again."""
    tok = _load_tokenizer(model)
    tok.kvcal_vocab_size = model_vocab_size(model) if vocab_size is FROM_CONFIG else vocab_size
    return tok


#: the files of which an HF model directory must hold at least one for transformers to build its tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def check_tokenizer_files(src: ModelSource) -> None:
    """Refuse, in one :class:`ModelLoadError` line, an HF model directory holding none of
    :data:`TOKENIZER_FILES` (a GGUF carries its tokenizer; a hub snapshot is a directory like any other).
    Reads file names only: :func:`kvcal.inputs.preflight` runs it before any tokenizer or weight loads."""
    p = Path(src.path)
    if p.is_dir() and not src.gguf_file and not any((p / n).exists() for n in TOKENIZER_FILES):
        raise ModelLoadError(f"{p} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); copy the model's "
                             "tokenizer.json and tokenizer_config.json into it (the tokenizer must be the one the "
                             "server uses)")


def _load_tokenizer(model: str | ModelSource | None):
    from transformers import AutoTokenizer

    src = resolve_model(model)
    p = Path(src.path)
    check_tokenizer_files(src)
    try:
        return _cached_conversion(src, "tokenizer_config.json", AutoTokenizer.from_pretrained,
                                  lambda: AutoTokenizer.from_pretrained(src.path, **src.load_kwargs))
    except Exception as e:
        msg = " ".join(str(e).split())
        raise ModelLoadError(f"cannot load the tokenizer of {src.model_id}: {msg[:300]}; check that {p} holds the "
                             "model's tokenizer files (tokenizer.json, tokenizer_config.json)") from None


@contextlib.contextmanager
def gguf_bar_follows_transformers():
    """Within this block, transformers' GGUF de-quantization bar ("Converting and de-quantizing GGUF tensors...",
    ``transformers/modeling_gguf_pytorch_utils.py``, a bare ``tqdm.auto.tqdm`` that ignores
    ``transformers.utils.logging.disable_progress_bar()``) shows only while transformers' progress bars are enabled:
    ``--quiet`` silences it with the others. Restores the module's ``tqdm`` on exit."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers and gguf are dependencies
        yield
        return
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is None or hf_logging.is_progress_bar_enabled():
        yield
        return
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def load_model(
    model: str | ModelSource | None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    device_map: str | None = None,
):
    """Load a causal LM for capture/evaluation in eval mode (``sdpa`` attention). ``model``: a ``--model``
    string or the :class:`ModelSource` a preflight resolved.

    ``device_map="auto"`` uses accelerate's big-model loading (layers spread across devices).
    GGUF weights are dequantized to ``dtype``. Raises :class:`ModelLoadError` when the model cannot
    be loaded, when a GGUF lacks the tensors of some blocks (:func:`check_gguf_tensors`, before any
    model is built), or when the checkpoint lacks weights the model has or holds weights it has not
    (transformers' loading report, :func:`check_loading_info`): transformers would initialize the
    missing ones at random and calibrate on them.
    """
    from transformers import AutoModelForCausalLM

    src = resolve_model(model)
    if src.gguf_file:
        check_gguf_tensors(Path(src.path) / src.gguf_file)  # before transformers builds a full-size model
    kw = dict(src.load_kwargs)
    if device_map:
        kw["device_map"] = device_map
    try:
        with gguf_bar_follows_transformers():
            m, info = AutoModelForCausalLM.from_pretrained(src.path, dtype=dtype, attn_implementation="sdpa",
                                                           output_loading_info=True, **kw)
    except Exception as e:
        raise ModelLoadError(f"cannot load model {src.model_id}: {type(e).__name__}: {e}") from None
    check_loading_info(info, src.model_id)
    if not device_map:
        m = m.to(device)
    m.eval()
    m.kvcal_source = src
    return m


def _name_list(names: list[str], kind: str) -> str:
    """``"18 missing weights (layers 2-3; first: a, b, c)"``: what a load report names in one line."""
    layers = sorted({int(m.group(1)) for n in names if (m := re.search(r"\.layers\.(\d+)\.", n))})
    where = f"layers {format_ranges(layers)}; " if layers else ""
    return f"{len(names)} {kind} weight(s) ({where}first: {', '.join(names[:3])})"


def check_loading_info(info: dict, model_id: str) -> None:
    """Refuse a checkpoint that does not hold exactly the model's weights, from transformers' own
    loading report (``from_pretrained(..., output_loading_info=True)``: ``missing_keys``,
    ``unexpected_keys``, ``mismatched_keys``). Weights transformers ties (``lm_head`` to the input
    embedding under ``tie_word_embeddings``) are not reported missing by transformers; attention
    activation scales (:data:`kvcal.weights.ATTENTION_SCALE`) are not counted as unexpected. Raises
    :class:`ModelLoadError` in one line naming the layers and the first names."""
    missing = sorted(info.get("missing_keys") or [])
    unexpected = sorted(k for k in info.get("unexpected_keys") or [] if not ATTENTION_SCALE.search(k))
    mismatched = sorted(str(k[0] if isinstance(k, (tuple, list)) else k) for k in info.get("mismatched_keys") or [])
    parts = [_name_list(x, kind) for x, kind in ((missing, "missing"), (unexpected, "unexpected"),
                                                 (mismatched, "shape-mismatched")) if x]
    if parts:
        raise ModelLoadError(f"checkpoint of {model_id} does not match its config: {'; '.join(parts)} — transformers "
                             "would initialize missing weights at random and calibrate on them; use the complete "
                             "checkpoint (every shard listed in model.safetensors.index.json) for this config")


def save_hf_checkpoint(model: str | None, out_dir: str | os.PathLike) -> Path:
    """Write ``model`` (a ``--model`` value: the embedded GGUF by default) as a plain Hugging Face checkpoint
    directory ``out_dir`` (float32 ``model.safetensors``, ``config.json`` without the GGUF
    ``quantization_config``, tokenizer files): what ``kvcal export --model-dir`` merges scales into and what
    an engine without a GGUF loader (vLLM's CPU build) serves. Follows ``shared/docs/verified-facts.md``
    (a GGUF-loaded model cannot ``save_pretrained`` directly: rebuild the class from its config and load the
    state dict). About 540 MB for the embedded model. Raises :class:`ModelLoadError`."""
    from transformers import AutoModelForCausalLM

    m = load_model(model)
    cfg = m.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    plain.load_state_dict(m.state_dict())
    out = Path(out_dir)
    plain.save_pretrained(out)
    load_tokenizer(model).save_pretrained(out)
    return out
