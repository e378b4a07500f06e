"""Capacity planner: how much context / concurrency fits on one GPU, per KV-cache precision.

Accounting (all integers, bytes)::

    kv_budget = gpu_mem - weights - reserve
    weights   = params(config) x bytes(weights_dtype)       # payload only, no quantization scales
    reserve   = fraction x gpu_mem  or  a fixed size        # activations, CUDA context, allocator slack

The cache of ``B`` sequences of ``T`` tokens costs exactly
:func:`kvcal.formats.memory.cache_bytes` ``(shape, kv_config, T, B)`` (payload, scales, 16-bit
windows/sinks, per-layer metadata). The planner reports, for 16-bit and each cache precision:

* **max context per concurrency** ``B in 1, 2, 4, ..., 256``: the largest ``T`` with
  ``cache_bytes(T, B) <= kv_budget``, capped at the model's ``max_position_embeddings``
  (``fits`` keeps the uncapped number);
* **max concurrency per context** ``T in 1k, 2k, ..., 128k`` (only those ``<=`` the model
  maximum, plus the maximum itself): the largest ``B`` with ``cache_bytes(T, B) <= kv_budget``.

Parameter count (:func:`param_count`) is computed from the config for Llama-family decoders
(Llama, Mistral, Qwen2/3, SmolLM, Gemma-style): embeddings ``V·d``; per layer attention
``d·(H_q·hd) + 2·d·(H_kv·hd) + (H_q·hd)·d`` (+ biases when ``attention_bias``; Qwen2 has q/k/v
biases), gated MLP ``3·d·ffn`` (+ biases when ``mlp_bias``), two RMSNorm weights ``2·d``; a final
norm ``d``; an LM head ``V·d`` unless ``tie_word_embeddings``. Mixture-of-experts configs are
refused (pass ``params=`` explicitly).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcal.errors import KvcalError

#: Bytes per weight for ``--weights-dtype`` (payload only; int4 scales are not counted).
WEIGHT_BYTES = {"fp32": 4.0, "float32": 4.0, "bf16": 2.0, "bfloat16": 2.0, "fp16": 2.0, "float16": 2.0,
                "fp8": 1.0, "int8": 1.0, "int4": 0.5, "nvfp4": 0.5}
#: Concurrencies reported by default: 1, 2, 4, ..., 256.
DEFAULT_BATCHES = tuple(2**i for i in range(9))
#: Contexts reported by default: 1k .. 128k tokens (capped at the model maximum).
DEFAULT_CONTEXTS = tuple(1024 * 2**i for i in range(8))
DEFAULT_RESERVE = "10%"
DEFAULT_KV_CONFIGS = ("fp8", "int4", "kivi2")
BASELINE = "bf16"

_UNITS = {
    "": 1, "b": 1,
    "k": 2**10, "kib": 2**10, "kb": 10**3,
    "m": 2**20, "mib": 2**20, "mb": 10**6,
    "g": 2**30, "gib": 2**30, "gb": 10**9,
    "t": 2**40, "tib": 2**40, "tb": 10**12,
}


def parse_size(text: str | int) -> int:
    """Bytes from ``"80GiB"`` (2^30), ``"80GB"`` (10^9), ``"24G"`` (bare letter = binary, 2^30),
    ``"512MiB"``, ``"1.5TiB"`` or a plain integer of bytes. Raises :class:`KvcalError`."""
    if isinstance(text, int):
        if text < 0:
            raise KvcalError(f"size must be >= 0 bytes, got {text}")
        if text > MAX_SIZE:
            raise KvcalError(f"size {text} is more than {MAX_SIZE} bytes (2^63 - 1, 8 EiB); write the device memory")
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise KvcalError(f"cannot read size {text!r}; write e.g. 80GiB (2^30 bytes), 80GB (10^9 bytes), 24G (= GiB)")
    num = m.group(1).lstrip("0") or "0"
    if len(num) > 30:  # > 1e29 of any unit: past MAX_SIZE, and past what float/int conversions handle
        value = float("inf")
    else:
        value = int(num) * _UNITS[unit] if num.isdigit() else float(num) * _UNITS[unit]
    if value > MAX_SIZE:
        raise KvcalError(f"size {_short(text)} is more than {MAX_SIZE} bytes (2^63 - 1, 8 EiB), the largest memory "
                         "size a device reports; write the memory in bytes or with a unit, e.g. 80GiB")
    return int(value)


#: Largest size :func:`parse_size` accepts, in bytes: 2^63 - 1 (int64, how drivers and torch report memory).
MAX_SIZE = 2**63 - 1


def _short(text) -> str:
    t = str(text).strip()
    return repr(t if len(t) <= 40 else t[:37] + "...")


def parse_reserve(text: str | int, gpu_mem: int) -> tuple[int, str]:
    """``(bytes, description)`` from ``"10%"`` (of ``gpu_mem``) or a size (see :func:`parse_size`)."""
    s = str(text).strip()
    if s.endswith("%"):
        try:
            pct = float(s[:-1])
        except ValueError:
            raise KvcalError(f"cannot read --reserve {text!r}; write e.g. 10% or 4GiB") from None
        if not 0 <= pct < 100:
            raise KvcalError(f"--reserve {text!r} must be a percentage in [0, 100)")
        return int(gpu_mem * pct / 100), f"{pct:g}% of GPU memory"
    return parse_size(s), f"fixed {s}"


def _cfg_get(config):
    if isinstance(config, dict):
        get = config.get
    else:
        def get(k, d=None):
            return getattr(config, k, d)
    text = get("text_config")
    if text is not None and not isinstance(text, (int, float, str)):
        return _cfg_get(text)
    return get


def param_count(config) -> dict:
    """Parameters of a Llama-family decoder from its config (dict or config object).

    Returns ``{"embeddings", "attention", "mlp", "norms", "lm_head", "total"}`` (counts of
    parameters, ints; ``lm_head`` is 0 when tied). Raises :class:`KvcalError` for a missing field
    or a mixture-of-experts config."""
    get = _cfg_get(config)
    for moe in ("num_local_experts", "num_experts", "n_routed_experts"):
        if get(moe):
            raise KvcalError(f"the model config has {moe}={get(moe)} (mixture of experts); the planner counts "
                             "dense decoders only — pass the parameter count explicitly (--params)")

    def need(k):
        v = get(k)
        if v is None:
            raise KvcalError(f"model config lacks {k!r}; cannot count parameters (pass --params)")
        return int(v)

    V, d, L, ffn = need("vocab_size"), need("hidden_size"), need("num_hidden_layers"), need("intermediate_size")
    hq = need("num_attention_heads")
    hkv = int(get("num_key_value_heads") or hq)
    hd = int(get("head_dim") or d // hq)
    q, kv = hq * hd, hkv * hd
    attn = d * q + 2 * d * kv + q * d
    if get("attention_bias"):
        attn += q + 2 * kv + d
    elif get("model_type") == "qwen2":
        attn += q + 2 * kv
    mlp = 3 * d * ffn + ((2 * ffn + d) if get("mlp_bias") else 0)
    norms = L * 2 * d + d
    tied = get("tie_word_embeddings")
    tied = True if tied is None else bool(tied)  # transformers' PretrainedConfig default
    out = {"embeddings": V * d, "attention": L * attn, "mlp": L * mlp, "norms": norms,
           "lm_head": 0 if tied else V * d}
    out["total"] = sum(out.values())
    return out


@dataclass(frozen=True)
class PlanConfig:
    """Inputs of :func:`plan_capacity` (``kvcal plan``).

    ``gpu_mem``: bytes (or a size string); ``weights_dtype``: a key of :data:`WEIGHT_BYTES`;
    ``reserve``: ``"10%"`` of GPU memory or a size for activations and runtime overheads;
    ``kv_configs``: preset names and/or artifact directories; ``params``: override the parameter
    count computed from the config. Raises :class:`KvcalError` on bad values."""

    gpu_mem: int | str
    weights_dtype: str = "bf16"
    reserve: str | int = DEFAULT_RESERVE
    kv_configs: tuple[str, ...] = DEFAULT_KV_CONFIGS
    batches: tuple[int, ...] = DEFAULT_BATCHES
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS
    params: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "gpu_mem", parse_size(self.gpu_mem))
        if self.gpu_mem <= 0:
            raise KvcalError("--gpu-mem must be > 0")
        if self.weights_dtype not in WEIGHT_BYTES:
            raise KvcalError(f"--weights-dtype {self.weights_dtype!r}: choose one of {', '.join(WEIGHT_BYTES)}")
        if isinstance(self.kv_configs, str):
            from kvcal.options import split_list

            object.__setattr__(self, "kv_configs", split_list(self.kv_configs, "--kv-config", "cache precision",
                                                              "fp8,int4,kivi2"))
        if any(b < 1 for b in self.batches) or any(c < 1 for c in self.contexts):
            raise KvcalError("batches and contexts must be >= 1")
        if self.params is not None and self.params < 0:
            raise KvcalError("--params must be >= 0")


@dataclass
class CacheOption:
    """One cache precision in the plan: ``name``, the config (or per-layer list), a description."""

    name: str
    kv_config: object
    description: str
    source: str = "preset"
    #: an engine that sizes its own cache (``llamacpp:<types>``): ``cache_bytes(context, batch)`` -> bytes that
    #: engine allocates for ``batch`` sequences of ``context`` tokens, and its bytes per token; ``kv_config`` is None
    cache_bytes: object = None
    bytes_per_token: int | None = None


@dataclass
class CapacityPlan:
    """Result of :func:`plan_capacity`; :meth:`to_dict` is the ``--json`` output."""

    model: dict
    gpu_mem: int
    weights: dict
    reserve: dict
    kv_budget: int
    options: list[dict]
    max_context: list[dict] = field(default_factory=list)
    max_concurrency: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"schema": "kvcal-plan/1", "model": self.model, "gpu_mem_bytes": self.gpu_mem,
                "weights": self.weights, "reserve": self.reserve, "kv_budget_bytes": self.kv_budget,
                "options": self.options, "max_context": self.max_context,
                "max_concurrency": self.max_concurrency, "notes": self.notes}


def describe_side(spec) -> str:
    """``"fp8_e4m3 tensor sym"``-style one-liner of a :class:`TensorQuantSpec`."""
    if not spec.is_quantized:
        return spec.format.value
    g = spec.granularity
    gs = f"(g={g.group_size})" if getattr(g, "group_size", None) else ""
    return f"{spec.format.value} {g.name}{gs} {'sym' if spec.symmetric else 'asym'}"


def describe_config(cfg) -> str:
    if isinstance(cfg, (list, tuple)):
        kinds = sorted({f"K {describe_side(c.key)} | V {describe_side(c.value)}" for c in cfg})
        return f"per-layer ({len(kinds)} distinct): " + "; ".join(kinds)
    s = f"K {describe_side(cfg.key)} | V {describe_side(cfg.value)}"
    if cfg.residual_window or cfg.sink_tokens:
        s += f" | 16-bit window {cfg.residual_window}, sinks {cfg.sink_tokens}"
    return s


def artifact_kv_config(meta: dict, tensors: dict | None = None):
    """The cache config an artifact describes: one :class:`KVCacheConfig`, or a list with one per
    layer. With the artifact's ``tensors`` the configs come from the rebuilt plan
    (:meth:`kvcal.plan.KVPlan.kv_config`), so per-layer metadata — key-centering means, rounding
    triangles, channel-width and levels tables — is counted exactly; from the metadata
    alone (``tensors=None``) only the specs, sinks and residual window are. Raises :class:`KvcalError`."""
    from kvcal.formats.spec import KVCacheConfig

    kv = meta.get("kv")
    if not kv:
        raise KvcalError("artifact metadata has no 'kv' section")
    if tensors is not None:
        from kvcal.plan import KVPlan

        try:
            plan = KVPlan.from_artifact(tensors, meta)
        except (KeyError, ValueError) as e:
            raise KvcalError(f"artifact does not rebuild into a cache plan: {e}") from None
        return [plan.kv_config(i) for i in range(len(plan.layers))]
    try:
        common = {"residual_window": kv.get("residual_window", 0), "sink_tokens": kv.get("sink_tokens", 0)}
        if kv.get("layer_specs"):
            return [KVCacheConfig.from_dict({**ls, **common}) for ls in kv["layer_specs"]]
        return KVCacheConfig.from_dict({"k": kv["k"], "v": kv["v"], **common})
    except (KeyError, ValueError) as e:
        raise KvcalError(f"artifact kv section is not a valid cache config: {e}") from None


def resolve_option(name: str, shape) -> CacheOption:
    """A preset name, an artifact directory or ``<engine>:<types>`` of an engine that sizes its own cache
    (``llamacpp:q8_0``, ``llamacpp:q8_0,q4_0``: :func:`kvcal.engines.llamacpp.plan.kv_bytes` for ``-c B·T -np B``)
    -> :class:`CacheOption` (artifact shape checked)."""
    from pathlib import Path

    from kvcal.engines import engine, with_attr
    from kvcal.search.presets import named_cache_config

    eng_name, colon, spec = name.partition(":")
    if colon and eng_name in with_attr("kv_memory"):
        eng = engine(eng_name)
        tk, tv = eng.parse_pair(spec, what=f"--kv-config {eng_name}:")
        eng.kv_bytes(shape, tk, tv, 256)  # refuses a model the engine's sizing does not cover, before any table

        def cache_bytes(t: int, b: int, _e=eng, _k=tk, _v=tv) -> int:
            return _e.kv_bytes(shape, _k, _v, b * t, b).total if t > 0 else 0

        return CacheOption(name, None, f"{eng.DISPLAY_NAME} -ctk {tk} -ctv {tv} (blocks of 32, each with its fp16 "
                           "scale; cells padded to 256 per sequence)", source=eng_name, cache_bytes=cache_bytes,
                           bytes_per_token=eng.pair_bytes_per_token(shape, tk, tv))
    p = Path(name)
    named = named_cache_config(name)
    if named is not None:
        if p.is_dir():
            raise KvcalError(f"--kv-config {name!r} is both a preset and a directory here; write ./{name} (or its full "
                             "path) for the artifact, or run from another directory for the preset")
        return CacheOption(name, named, describe_config(named))
    if p.exists():
        from kvcal.artifact import load_artifact

        art = load_artifact(p)
        meta = art.metadata
        m = meta["model"]
        for key, want in (("num_layers", shape.num_layers), ("num_kv_heads", shape.num_kv_heads),
                          ("head_dim", shape.head_dim)):
            if int(m.get(key, -1)) != want:
                raise KvcalError(f"artifact {p} was made for a model with {key}={m.get(key)}, but --model has {want}")
        cfg = artifact_kv_config(meta, art.tensors)
        return CacheOption(p.name, cfg, describe_config(cfg), source=str(p))
    from kvcal.search.presets import CACHE_CONFIG_NAMES

    raise KvcalError(f"--kv-config {name!r} is neither a preset ({', '.join(CACHE_CONFIG_NAMES)}) nor an artifact "
                     "directory")


def _largest(fits) -> int:
    """Largest ``n >= 0`` with ``fits(n)`` for a ``fits`` true up to some ``n`` and false after (0 if none)."""
    if not fits(0):
        return 0
    lo, hi = 0, 1
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def max_context(shape, kv_config, batch: int, budget: int) -> int:
    """Largest ``T`` such that ``batch`` sequences growing to ``T`` tokens never need more than ``budget`` bytes:
    :func:`kvcal.formats.memory.peak_cache_bytes` ``<= budget`` (0 if none; exact). The peak, not the bytes at
    ``T``: a sliding-window layer with token-group keys holds up to ``g - 1`` tokens more at some positions
    than at later ones, so ``cache_bytes`` alone is not monotone in ``T``; the peak is, which the binary
    search needs."""
    from kvcal.formats.memory import peak_cache_bytes

    def fits(t: int) -> bool:
        return peak_cache_bytes(shape, kv_config, t, batch)[0] <= budget

    return 0 if budget < 0 else _largest(fits)  # the peak is non-decreasing in T


def max_batch(shape, kv_config, context: int, budget: int) -> int:
    """Largest ``B`` such that ``B`` sequences growing to ``context`` tokens fit ``budget`` bytes (0 if none;
    exact): the peak bytes on the way (:func:`kvcal.formats.memory.peak_cache_bytes`) are
    ``B x per-sequence + per-layer metadata``, with the peak at the same position for every ``B``."""
    from kvcal.formats.memory import peak_cache_bytes

    one, two = peak_cache_bytes(shape, kv_config, context, 1)[0], peak_cache_bytes(shape, kv_config, context, 2)[0]
    per_seq, static = two - one, 2 * one - two
    if one > budget:
        return 0
    assert per_seq > 0, "context must be >= 1"
    return int((budget - static) // per_seq)


def load_config(model: str):
    """A model's config for planning: a ``config.json`` path is read as a dict by the checked reader
    (:func:`kvcal.export.checkpoint_json.read_config`: a JSON object whose size fields are positive
    integers); anything else goes through :func:`kvcal.models.load_model_config` (no weights loaded).
    Raises :class:`KvcalError` naming the file and field."""
    from pathlib import Path

    p = Path(model).expanduser()
    if p.suffix == ".json":
        from kvcal.export.checkpoint_json import read_config

        return read_config(p)
    from kvcal.models import gguf_config_fields, load_model_config

    return gguf_config_fields(model) or load_model_config(model)


def plan_capacity(model_config, cfg: PlanConfig, model_id: str = "model") -> CapacityPlan:
    """The capacity table for ``model_config`` (HF config dict/object) under ``cfg``.

    Raises :class:`KvcalError` when weights + reserve leave no room for a cache, or on a bad
    ``--kv-config``."""
    from kvcal.formats.memory import bytes_per_token_exact, model_shape
    from kvcal.formats.spec import PRESETS

    try:
        shape = model_shape(model_config)
    except ValueError as e:
        raise KvcalError(str(e)) from None
    params = param_count(model_config) if cfg.params is None else {"total": int(cfg.params), "given": True}
    wbytes = int(params["total"] * WEIGHT_BYTES[cfg.weights_dtype])
    reserve, reserve_desc = parse_reserve(cfg.reserve, cfg.gpu_mem)
    budget = cfg.gpu_mem - wbytes - reserve
    if budget <= 0:
        raise KvcalError(f"no room for a KV cache: GPU {cfg.gpu_mem} B - weights {wbytes} B - reserve {reserve} B "
                         f"= {budget} B; use a larger --gpu-mem, a smaller --reserve or --weights-dtype")
    names = [BASELINE] + [n for n in cfg.kv_configs if n != BASELINE]
    opts = [resolve_option(n, shape) for n in names]
    # results are keyed by name: an artifact whose directory name repeats a preset or another artifact is
    # labelled by the path given (reviewer: two columns silently showed one artifact's numbers)
    counts = {}
    for o in opts:
        counts[o.name] = counts.get(o.name, 0) + 1
    opts = [o if counts[o.name] == 1 or o.source == "preset" else
            CacheOption(str(n), o.kv_config, o.description, source=o.source) for o, n in zip(opts, names, strict=True)]
    seen = set()
    for o, n in zip(opts, names, strict=True):
        if o.name in seen:
            raise KvcalError(f"--kv-config lists {n!r} twice; give each option once")
        seen.add(o.name)
    opts[0].description = "16-bit baseline: " + opts[0].description
    b16 = bytes_per_token_exact(shape, PRESETS[BASELINE])
    mmax = shape.max_position_embeddings
    options = []
    for o in opts:
        bpt = o.bytes_per_token if o.cache_bytes is not None else bytes_per_token_exact(shape, o.kv_config)
        options.append({"name": o.name, "source": o.source, "description": o.description,
                        "bytes_per_token": float(bpt), "vs_16bit": float(b16 / bpt)})
    contexts = sorted({c for c in cfg.contexts if mmax is None or c <= mmax} | ({mmax} if mmax else set()))
    max_ctx, max_conc = [], []
    for b in cfg.batches:
        row = {"batch": b}
        for o in opts:
            fits = (max_context(shape, o.kv_config, b, budget) if o.cache_bytes is None else
                    _largest(lambda t, o=o, b=b: o.cache_bytes(t, b) <= budget))
            row[o.name] = {"max_context": min(fits, mmax) if mmax else fits, "fits": fits,
                           "capped": bool(mmax and fits > mmax)}
        max_ctx.append(row)
    for c in contexts:
        row = {"context": c}
        for o in opts:
            row[o.name] = (max_batch(shape, o.kv_config, c, budget) if o.cache_bytes is None else
                           _largest(lambda b, o=o, c=c: b == 0 or o.cache_bytes(c, b) <= budget))
        max_conc.append(row)
    notes = [
        f"weights: {params['total']:,} parameters x {WEIGHT_BYTES[cfg.weights_dtype]:g} bytes "
        f"({cfg.weights_dtype}) = {wbytes:,} bytes; weight precision is independent of the KV-cache precision",
        f"reserve for activations, CUDA context and allocator slack: {reserve_desc} = {reserve:,} bytes "
        "(an assumption, not measured; change with --reserve)",
        "cache bytes are exact (kvcal.formats.memory.cache_bytes: payload, scales/zero points, 16-bit "
        "windows/sinks, per-layer metadata); engines round to their page/block size, which can cost up to "
        "one block per sequence",
    ]
    for o in opts:
        if o.cache_bytes is not None:
            notes.append(f"{o.name}: the bytes {o.description.split(' -ctk')[0]} allocates for B sequences of T "
                         f"tokens (-c B*T -np B, one stream per sequence), cells padded to 256 per sequence (exact)")
    if shape.layer_windows:
        sl = shape.sliding_layers
        notes.append(f"{len(sl)} of {shape.num_layers} layers are sliding-window layers (W = {max(shape.layer_windows)}): "
                     "each holds at most W - 1 tokens (as transformers' cache; whole token groups more for KIVI-style "
                     "keys, so such a cache peaks before it ends: every figure is the peak on the way), counted so "
                     "at every context; vLLM reserves W - 1 + in-flight tokens for them "
                     "(kvcal memory --format vllm:<dtype>)")
    if mmax:
        notes.append(f"max context is capped at the model's max_position_embeddings ({mmax}); 'fits' keeps "
                     "the uncapped number of tokens the memory would hold")
    return CapacityPlan(
        model={"id": model_id, "num_layers": shape.num_layers, "num_kv_heads": shape.num_kv_heads,
               "head_dim": shape.head_dim, "max_position_embeddings": mmax, "params": params},
        gpu_mem=cfg.gpu_mem, weights={"dtype": cfg.weights_dtype, "bytes_per_param": WEIGHT_BYTES[cfg.weights_dtype],
                                      "params": params["total"], "bytes": wbytes},
        reserve={"spec": str(cfg.reserve), "description": reserve_desc, "bytes": reserve},
        kv_budget=budget, options=options, max_context=max_ctx, max_concurrency=max_conc, notes=notes,
    )


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    w = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    fmt = "  ".join("{:>" + str(n) + "}" for n in w)
    return [fmt.format(*header), fmt.format(*("-" * n for n in w)), *(fmt.format(*map(str, r)) for r in rows)]


def render_plan(plan: CapacityPlan) -> str:
    """Plain-text tables of a :class:`CapacityPlan` (what ``kvcal plan`` prints)."""
    m = plan.model
    names = [o["name"] for o in plan.options]
    lines = [
        f"model: {m['id']} ({m['num_layers']} layers, {m['num_kv_heads']} KV heads, head_dim {m['head_dim']}, "
        f"max context {m['max_position_embeddings']})",
        f"GPU memory:         {plan.gpu_mem:>16,} B  ({_gib(plan.gpu_mem)})",
        f"- weights:          {plan.weights['bytes']:>16,} B  ({_gib(plan.weights['bytes'])}; "
        f"{plan.weights['params']:,} params x {plan.weights['bytes_per_param']:g} B, {plan.weights['dtype']})",
        f"- reserve:          {plan.reserve['bytes']:>16,} B  ({_gib(plan.reserve['bytes'])}; activations/overheads, "
        f"{plan.reserve['description']})",
        f"= KV-cache budget:  {plan.kv_budget:>16,} B  ({_gib(plan.kv_budget)})",
        "",
        "cache precisions:",
    ]
    w = max([10] + [len(o["name"]) for o in plan.options])
    for o in plan.options:
        lines.append(f"  {o['name']:<{w}} {o['bytes_per_token']:>10g} B/token  ({o['vs_16bit']:.2f}x vs 16-bit)  "
                     f"{o['description']}")
    lines += ["", "max context per sequence at each concurrency (N*(M): capped at the model max N; memory would fit M):"]
    rows = []
    for r in plan.max_context:
        rows.append([r["batch"]] + [f"{r[n]['max_context']:,}*({r[n]['fits']:,})" if r[n]["capped"]
                                    else f"{r[n]['max_context']:,}" for n in names])
    lines += _table(["concurrency", *names], rows)
    lines += ["", "max concurrency at each context:"]
    rows = [[f"{r['context']:,}"] + [f"{r[n]:,}" for n in names] for r in plan.max_concurrency]
    lines += _table(["context", *names], rows)
    lines += ["", *(f"note: {n}" for n in plan.notes)]
    return "\n".join(lines)


__all__ = ["load_config", "PlanConfig", "CapacityPlan", "plan_capacity", "render_plan", "param_count", "parse_size",
           "parse_reserve", "max_context", "max_batch", "artifact_kv_config", "WEIGHT_BYTES"]
