"""A GGUF file read from its header alone (:func:`gguf_header`): the tensor check before transformers builds
the model (:func:`check_gguf_tensors`) and the config fields that size a KV cache (:func:`gguf_config_fields`),
in milliseconds instead of transformers' full conversion."""

from __future__ import annotations

import re
from pathlib import Path

from kvcal.errors import ModelLoadError
from kvcal.models.source import gguf_cache_dir, resolve_model
from kvcal.weights import format_ranges

_GGUF_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def gguf_header(path: Path, with_types: bool = False) -> tuple:
    """Scalar metadata and tensor names of a GGUF file (v2/v3), read from its header only.

    Returns ``(fields, tensor_names)``, or ``(fields, tensor_names, tensor_types)`` with ``with_types`` (each
    tensor's ``ggml_type`` id, int): ``fields`` maps each key to its value for scalar and string
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
            names, types = [], []
            for _ in range(n_tensors):
                names.append(string())
                n_dims = take("<I")
                pos += 8 * n_dims  # dims (u64 each)
                types.append(take("<I"))  # ggml_type
                pos += 8  # offset (u64)
            return (fields, names, types) if with_types else (fields, names)
    except ModelLoadError:
        raise
    except (OSError, ValueError, struct.error) as e:
        raise fail(f"{type(e).__name__}: {e}") from None


def gguf_architecture(path: Path) -> str | None:
    """``general.architecture`` of the GGUF at ``path`` (``"llama"``, ``"gemma3"``; ``None`` when the header has
    none), from its header (:func:`gguf_header`). Raises :class:`ModelLoadError` for a file that is not a
    readable GGUF."""
    return gguf_header(Path(path))[0].get("general.architecture")


def gguf_tensor_types(path: Path) -> dict[str, str]:
    """Tensor name -> ggml type name, lower case (``"q4_1"``, ``"q6_k"``, ``"f32"``; the names of ``gguf``'s
    ``GGMLQuantizationType``, ``type<id>`` for an id it does not know) of every tensor of the GGUF at ``path``, from
    its header (:func:`gguf_header`): what ``gguf.GGUFReader(path).tensors`` reports, without decoding the
    vocabulary. Raises :class:`ModelLoadError` for a file that is not a readable GGUF."""
    from gguf import GGMLQuantizationType

    _, names, types = gguf_header(Path(path), with_types=True)
    known = {t.value: t.name.lower() for t in GGMLQuantizationType}
    return {n: known.get(t, f"type{t}") for n, t in zip(names, types, strict=True)}


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
