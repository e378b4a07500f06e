"""The checkpoint as vLLM reads it (:class:`Checkpoint`, :func:`read_checkpoint`), its scale-free view
(:func:`no_scale_view`), and a ``kvcal recommend`` output turned into the checkpoint to verify
(:func:`from_recommend`)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from kvcal.errors import KvcalError

_SCALE_RE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(k|v|q)_scale$")
_FP8_SCHEMES = {(8, "float"): "fp8"}


@dataclass
class Checkpoint:
    """What vLLM reads of a checkpoint: ``kv_cache_dtype`` from ``kv_cache_scheme`` (``None``: no
    scheme), per-layer scales (``None`` entries: absent), the model shape, the files."""

    path: Path
    config: dict
    kv_cache_dtype: str | None
    k_scales: list
    v_scales: list
    q_scales: list
    scale_files: dict = field(default_factory=dict)  # file name -> scale tensor names in it

    @property
    def num_layers(self) -> int:
        return int(self.text_config.get("num_hidden_layers") or 0)

    @property
    def text_config(self) -> dict:
        return self.config.get("text_config") or self.config

    @property
    def head_dim(self) -> int | None:
        c = self.text_config
        hd = c.get("head_dim") or (c.get("hidden_size", 0) // max(int(c.get("num_attention_heads") or 1), 1))
        return int(hd) if hd else None


def from_recommend(path: Path, model_dir: str | None, work: Path, log=print) -> tuple[str, str, tuple[int, ...]]:
    """A ``kvcal recommend`` output ``path`` → ``(checkpoint dir, kv_cache_dtype, skip layers)`` to verify: the chosen
    row's artifact exported into ``work`` with its export line's options (``--target vllm``) and
    ``model_dir``, or, for a row at vLLM's default scales, ``model_dir`` itself. Raises :class:`KvcalError` when
    nothing was chosen, the chosen dtype is not a static FP8 one, or ``model_dir`` is missing."""
    try:
        d = json.loads((path / "deploy.json").read_text())
    except (OSError, ValueError) as e:
        raise KvcalError(f"{path / 'deploy.json'}: cannot read ({e})") from None
    c = d.get("chosen") if isinstance(d, dict) else None
    if not isinstance(c, dict):
        raise KvcalError(f"{path}: kvcal recommend chose no configuration (nothing passed its bar); nothing to verify")
    dtype, skip = c.get("dtype"), tuple(int(i) for i in c.get("skip_layers") or ())
    if dtype not in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        raise KvcalError(f"{path}: the chosen --kv-cache-dtype {dtype} is not one verify serves (fp8, fp8_e4m3, "
                         "fp8_e5m2: vLLM's CPU build serves no other)")
    if model_dir is None:
        raise KvcalError(f"{path} is a kvcal recommend output: pass --model-dir HF_DIR, the Hugging Face checkpoint "
                         "its export line merges the scales into (or serves, at vLLM's default scales)")
    if not d.get("artifact"):
        log(f"recommend chose {dtype} at vLLM's default scales: serving {model_dir} without scales")
        return model_dir, dtype, skip
    from kvcal.export import export

    out = work / "recommend-export"
    export(str(path / d["artifact"]), "vllm", str(out), model_dir=model_dir)
    log(f"recommend chose {dtype} with calibrated scales: exported {path / d['artifact']} into a temporary checkpoint")
    return str(out), dtype, skip


def read_checkpoint(path: str) -> Checkpoint:
    """Read ``path`` as vLLM's loader would (see module doc). Raises :class:`KvcalError` for a missing
    directory or config, a ``kvcal recommend`` output (pointing at its export line), a KV scheme kvcal
    does not verify, or scales that are not positive finite scalars."""
    from safetensors import safe_open

    p = Path(path)
    if (p / "deploy.json").is_file() and not (p / "config.json").is_file():
        line = ""
        try:
            d = json.loads((p / "deploy.json").read_text())
            line = (d.get("choice") or {}).get("export") or d.get("export") or ""
        except (OSError, ValueError, AttributeError):
            pass
        raise KvcalError(f"{p} is a kvcal recommend output, not a checkpoint; export it first"
                         + (f" ({line})" if isinstance(line, str) and line else
                            " (kvcal export --artifact <its artifact> --target vllm --model-dir HF_DIR --out OUT)")
                         + ", then verify OUT; or give kvcal verify the recommend output with --model-dir HF_DIR")
    if not p.is_dir():
        raise KvcalError(f"checkpoint {p} is not a directory; pass the output of kvcal export --target vllm --model-dir")
    if (p / "kv_scales.safetensors").is_file() and not (p / "config.json").is_file():
        raise KvcalError(f"{p} is a kvcal artifact, not a checkpoint; export it first (kvcal export --artifact {p} "
                         "--target vllm --model-dir HF_DIR --out OUT), then verify OUT")
    try:
        config = json.loads((p / "config.json").read_text())
    except OSError:
        raise KvcalError(f"checkpoint {p} has no config.json; pass a Hugging Face checkpoint directory "
                         "(kvcal export --target vllm --model-dir HF_DIR --out OUT)") from None
    except ValueError as e:
        raise KvcalError(f"{p / 'config.json'}: invalid JSON ({e})") from None
    scheme = (config.get("quantization_config") or {}).get("kv_cache_scheme")
    dtype = None
    if scheme:
        key = (scheme.get("num_bits"), scheme.get("type"))
        if key not in _FP8_SCHEMES or scheme.get("strategy") != "tensor":
            raise KvcalError(f"{p / 'config.json'}: kv_cache_scheme {scheme} is not a per-tensor FP8 scheme; "
                             "kvcal verify checks per-tensor FP8 checkpoints (vLLM's CPU backend serves no other)")
        dtype = _FP8_SCHEMES[key]
    L = int((config.get("text_config") or config).get("num_hidden_layers") or 0)
    scales = {s: [None] * L for s in "kvq"}
    files: dict[str, list[str]] = {}
    for f in sorted(p.glob("*.safetensors")):
        try:
            with safe_open(str(f), "pt") as st:
                for name in st.keys():
                    m = _SCALE_RE.match(name)
                    if m and int(m.group(1)) < L:
                        t = st.get_tensor(name).double().reshape(-1)
                        if t.numel() != 1 or not bool(t.isfinite().all()) or float(t[0]) <= 0:
                            raise KvcalError(f"{f}: {name} must be one positive finite value, got {t.tolist()[:4]}")
                        scales[m.group(2)][int(m.group(1))] = float(t[0])
                        files.setdefault(f.name, []).append(name)
        except KvcalError:
            raise
        except Exception as e:
            raise KvcalError(f"{f}: cannot read as safetensors ({type(e).__name__}: {e})") from None
    return Checkpoint(p, config, dtype, scales["k"], scales["v"], scales["q"], files)


def no_scale_view(ck: Checkpoint, out: Path) -> Path:
    """A directory ``out`` that serves ``ck``'s weights without its KV scales: every file linked
    except ``config.json`` (written without ``quantization_config``), scale-only safetensors files
    (left out) and ``model.safetensors.index.json`` (rewritten without the scale entries). Returns ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    scale_names = {n for names in ck.scale_files.values() for n in names}
    for f in ck.path.iterdir():
        if f.name in ("config.json", "model.safetensors.index.json") or not f.is_file():
            continue
        if f.name in ck.scale_files and _only_scales(f, set(ck.scale_files[f.name])):
            continue
        os.symlink(f.resolve(), out / f.name)
    cfg = {k: v for k, v in ck.config.items() if k != "quantization_config"}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    idx = ck.path / "model.safetensors.index.json"
    if idx.is_file():
        d = json.loads(idx.read_text())
        d["weight_map"] = {k: v for k, v in d.get("weight_map", {}).items() if k not in scale_names
                           and (out / v).exists()}
        (out / idx.name).write_text(json.dumps(d, indent=2))
    return out


def _only_scales(f: Path, names: set) -> bool:
    from safetensors import safe_open

    with safe_open(str(f), "pt") as st:
        return set(st.keys()) <= names
