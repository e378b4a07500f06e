"""Does the *installed* transformers + compressed-tensors pair apply a checkpoint's KV-cache scales?

A checkpoint exported with ``--target vllm`` carries ``quantization_config.kv_cache_scheme`` and
``{attention}.{k,v}_scale`` tensors. ``AutoModelForCausalLM.from_pretrained`` hands that config to
compressed-tensors (transformers ``quantizers/quantizer_compressed_tensors.py`` calls
``apply_quantization_config``), which attaches ``k_scale`` / ``v_scale`` parameters to every
attention module it accepts and registers a forward pre-hook that swaps the attention's cache
argument for a fake-quantizing wrapper (compressed-tensors ``modeling/kvcache.py``). It accepts a
module when ``quantization/lifecycle/initialize.py: is_cached_attention_module`` holds: the class
name contains "attention", it has a ``k_proj``/``v_proj``/``qkv_proj``/``kv_b_proj`` child, and
its ``forward`` takes ``past_key_value`` or ``past_key_values``.

transformers 5.24 renamed that argument to ``cache``; compressed-tensors 0.20.1 still looks for the
old names, so the same checkpoint then loads **without error, with its scales reported as
unexpected keys and no KV quantization at all** (measured: ``tests/export/test_real_loader.py``). Families
whose attention has none of those projection names (GPT-NeoX's ``query_key_value``) are never
quantized there, whatever the version.

:func:`check_transformers_kv` finds this out from the installed code itself, not from version
strings: it builds the model on the ``meta`` device (no memory, no weights), runs compressed-tensors'
own ``apply_quantization_config`` with the checkpoint's config, and checks that (a) scale parameters
were attached and (b) the keyword compressed-tensors' pre-hook writes (``_kv_cache_attention_hook``,
run on the meta module) is a parameter of the attention's ``forward`` — a keyword it does not take
would land in ``**kwargs`` and be ignored.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

#: Who applies kvcal's exported KV scales when this transformers pair does not (one line, for messages).
WHAT_WORKS = ("what applies them: vLLM, SGLang (per-tensor; by family, see kvcal inspect), TensorRT-LLM "
              "(--target modelopt), kvcal's runtime cache (kvcal evaluate, kvcal.runtime.QuantizedKVCache)")
#: appended when a transformers release with the old argument name would apply them
OLDER_TRANSFORMERS = " or a transformers whose attention forward takes past_key_values (5.23.0 checked)"


@dataclass(frozen=True)
class TransformersKvCheck:
    """What the installed transformers + compressed-tensors do with a checkpoint's KV scheme.

    ``applies``: scales are attached and the fake-quant hook reaches the attention's cache argument.
    ``silent``: when not ``applies``, whether loading still succeeds (True: the silent drop; False:
    loading raises, e.g. compressed-tensors not installed). ``versions``: ``"transformers X +
    compressed-tensors Y"``. ``attention``: attention class name; ``forward_params``: its forward's
    parameter names; ``param_template``: where scales load, e.g. ``model.layers.{i}.self_attn.{side}_scale``
    (``None`` when nothing is attached); ``reason``: why not applied (empty when it is).
    """

    applies: bool
    silent: bool
    versions: str
    attention: str | None = None
    forward_params: tuple[str, ...] = ()
    param_template: str | None = None
    reason: str = ""
    attention_paths: tuple[str, ...] = field(default=())
    version_fixable: bool = True  # False when no transformers version would apply them (no k/v projection)

    def warning(self) -> str | None:
        """One line for ``kvcal export`` / ``kvcal inspect`` when the scales would be dropped silently."""
        if self.applies or not self.silent:
            return None
        return (f"{self.versions} (installed here) would silently ignore this checkpoint's KV scales: {self.reason}, "
                f"so AutoModelForCausalLM.from_pretrained loads it with no KV quantization; {WHAT_WORKS}"
                + (OLDER_TRANSFORMERS if self.version_fixable else ""))


#: Child names compressed-tensors 0.20 requires of a KV-cache attention module
#: (``initialize.py: _KV_CACHE_PROJECTION_NAMES``); used only to word the reason, never to decide.
_KV_PROJECTIONS = ("k_proj", "v_proj", "qkv_proj", "kv_b_proj")


def _versions() -> str:
    import transformers

    try:
        import compressed_tensors

        ct = getattr(compressed_tensors, "__version__", None)
        if ct is None:
            from importlib.metadata import version

            ct = version("compressed-tensors")
    except ImportError:
        ct = "not installed"
    return f"transformers {transformers.__version__} + compressed-tensors {ct}"


def _layer_count_keys(cfg: dict, n: int) -> dict:
    """``cfg`` with ``num_hidden_layers`` cut to ``min(n, 2)`` and per-layer lists cut to match."""
    keep = min(n, 2)
    out = dict(cfg)
    out["num_hidden_layers"] = keep
    for k, v in cfg.items():
        if isinstance(v, list) and len(v) == n and n > keep:
            out[k] = v[:keep]
    return out


def _meta_model(config: dict):
    """The model of ``config`` (config.json dict) built on the ``meta`` device with at most 2 layers,
    or ``None`` when transformers cannot build it (unknown architecture, custom code)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    d = {k: v for k, v in config.items() if k != "quantization_config"}
    mt = d.get("model_type")
    if mt not in CONFIG_MAPPING:
        return None
    arch = (d.get("architectures") or [None])[0]
    cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
    n = int(d.get("num_hidden_layers") or 0)
    for attempt in (_layer_count_keys(d, n) if n else d, d):
        try:
            cfg = CONFIG_MAPPING[mt].from_dict(attempt)
            with torch.device("meta"):
                return cls._from_config(cfg) if cls is not None else AutoModelForCausalLM.from_config(cfg)
        except Exception:  # noqa: BLE001 - any failure to build means "cannot tell", handled by the caller
            continue
    return None


def _template(path: str) -> str:
    import re

    return re.sub(r"\.(\d+)\.", ".{i}.", path, count=1) + ".{side}_scale"


def check_transformers_kv(config: dict) -> TransformersKvCheck | None:
    """Check whether the installed transformers + compressed-tensors apply the KV scales of a
    checkpoint whose parsed ``config.json`` is ``config``.

    Returns ``None`` when there is nothing to apply (no compressed-tensors ``kv_cache_scheme``) or
    the model cannot be built from ``config`` on the meta device (so nothing can be said). Costs one
    meta-device model of at most 2 layers (no weights; well under a second for small configs).
    Never raises for a bad config: an unusable one gives ``None``.
    """
    qc = config.get("quantization_config") or {}
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors" or not qc.get("kv_cache_scheme"):
        return None
    versions = _versions()
    try:
        from compressed_tensors.modeling import kvcache
        from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    except ImportError:
        return TransformersKvCheck(False, False, versions,
                                   reason="compressed-tensors is not installed: transformers refuses the checkpoint")
    model = _meta_model(config)
    if model is None:
        return None
    try:
        ct_config = QuantizationConfig.model_validate(qc)
    except Exception as e:  # noqa: BLE001 - pydantic's ValidationError; the loader would refuse it too
        return TransformersKvCheck(False, False, versions,
                                   reason=f"compressed-tensors refuses the quantization_config ({str(e).splitlines()[0]})")
    try:
        apply_quantization_config(model, ct_config, show_progress=False)
    except Exception as e:  # noqa: BLE001 - the real loader would raise the same error: not silent
        return TransformersKvCheck(False, False, versions, reason=f"compressed-tensors fails on this model ({e})")
    attn_types = [m for m in model.modules() if "attention" in type(m).__name__.lower()]
    first = attn_types[0] if attn_types else None
    name = type(first).__name__ if first is not None else None
    params = tuple(p for p in inspect.signature(first.forward).parameters if p != "self") if first is not None else ()
    hooked = [(n, m) for n, m in model.named_modules() if hasattr(m, kvcache.KV_CACHE_ATTR)]
    if not hooked:
        if name is None:
            why = "the model has no attention module compressed-tensors recognises"
        elif not any(hasattr(first, p) for p in _KV_PROJECTIONS):
            why = (f"{name} has no {'/'.join(_KV_PROJECTIONS)} child, which compressed-tensors requires of a KV-cache "
                   "attention module")
        else:
            why = (f"{name}.forward takes ({', '.join(params)}), not the past_key_value(s) argument "
                   "compressed-tensors hooks")
        fixable = first is not None and any(hasattr(first, p) for p in _KV_PROJECTIONS)
        return TransformersKvCheck(False, True, versions, name, params, None, why, version_fixable=fixable)
    path, mod = hooked[0]
    fwd = tuple(p for p in inspect.signature(mod.forward).parameters if p != "self")
    _, kwargs = kvcache._kv_cache_attention_hook(mod, (), {})
    swapped = [k for k in kwargs if k not in fwd]
    template = _template(path)
    if swapped:
        return TransformersKvCheck(
            False, True, versions, type(mod).__name__, fwd, template,
            f"its hook passes the quantizing cache as {swapped[0]!r}, which {type(mod).__name__}.forward "
            f"({', '.join(fwd)}) does not take", tuple(n for n, _ in hooked))
    return TransformersKvCheck(True, True, versions, type(mod).__name__, fwd, template, "",
                               tuple(n for n, _ in hooked))
