"""The options of ``kvcal verify`` (:class:`VerifyConfig`) and its ``--accept`` bar (:func:`check_accept`, over
:data:`VERIFY_METRICS`)."""

from __future__ import annotations

from dataclasses import dataclass

from kvcal.errors import KvcalError

#: metrics ``verify --accept`` can judge (it measures no greedy agreement)
VERIFY_METRICS = ("ppl", "delta_ppl", "kl_mean", "kl_p999", "top1_agree")


@dataclass(frozen=True)
class VerifyConfig:
    """Options of ``kvcal verify``. ``checkpoint``: an exported checkpoint directory (``kvcal export
    --target vllm --model-dir``); ``engine_python``: the engine's interpreter; ``contexts``/``windows``
    as ``kvcal evaluate``; ``kv_cache_dtype``: ``None`` = the checkpoint's (``fp8``); ``backend``:
    ``None`` = the one the engine reports; ``accept``: bar on the served figures (``None``: the 8-bit
    bar of :data:`kvcal.evaluate.accept.DEFAULT_ACCEPT`)."""

    checkpoint: str
    corpus: str
    engine_python: str
    context: int = 1024
    windows: int = 8
    kv_cache_dtype: str | None = None
    backend: str | None = None
    accept: str | None = None
    timeout_s: int = 1800
    skip_layers: tuple[int, ...] | str | None = ()  # --kv-cache-dtype-skip-layers served (and predicted) in the model
    # dtype; a string (--skip-layers, e.g. "0,29") is parsed into the tuple
    model_dir: str | None = None  # a recommend output: the HF checkpoint its export line merges into / it serves
    text_field: str | None = None
    messages_field: str | None = None
    split: str | None = None

    def __post_init__(self):
        if self.skip_layers is None or isinstance(self.skip_layers, str):
            from kvcal.search.skip_layers import parse_skip_layers

            skip = parse_skip_layers(self.skip_layers) or ()
            if skip == "auto":
                raise KvcalError("--skip-layers auto: verify serves the layers a deployment names; give their indices "
                                 "(e.g. 0,29), as `kvcal calibrate --skip-layers auto` or recommend recorded them")
            object.__setattr__(self, "skip_layers", tuple(skip))  # frozen dataclass
        if self.context < 2:
            raise KvcalError("--context must be at least 2")
        if self.windows < 2:
            raise KvcalError("--windows must be at least 2 (the served-vs-predicted interval needs two windows)")
        if self.accept is not None:
            check_accept(self.accept)


def check_accept(spec: str) -> list:
    """``--accept`` of verify: :func:`kvcal.options.parse_bar` with :data:`VERIFY_METRICS` (a metric verify does
    not measure, or a bar that can never pass or always passes, is refused)."""
    from kvcal.options import parse_bar

    return parse_bar(spec, VERIFY_METRICS, "verify",
                     why_not={"greedy_agree": "verify serves prompts teacher-forced (no greedy decoding)",
                              "greedy_prefix": "verify serves prompts teacher-forced (no greedy decoding)"})
