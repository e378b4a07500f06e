"""What ``kvcal recommend`` checks before the model loads: options and corpus files (:func:`check_options`), the
menu against the model's head_dim (:func:`check_head_dims`) and layers (:func:`applicable_dtypes`), the byte
bound (:func:`check_budget`, averaged over :func:`budget_context`) and ``--max-skip``
(:func:`effective_max_skip`)."""

from __future__ import annotations

from kvcal.recommend.config import (
    DEFAULT_ENGINE,
    DEFAULT_MAX_SKIP,
    DEFAULT_MENU,
    RECOMMEND_METRICS,
    RecommendConfig,
)


def check_options(cfg: RecommendConfig, corpus=None) -> tuple:
    """Every check that needs no model: engine, dtypes, acceptance spec, bounds, output directory,
    corpus files (format and fields, no tokenizer; ``corpus``: ``cfg.corpus`` already checked by the api's
    preflight, :class:`kvcal.inputs.CorpusInput`, not checked again). Returns the checked ``(corpus, eval
    corpus or None)`` (:class:`kvcal.inputs.CorpusInput`). Raises :class:`~kvcal.errors.KvcalError`."""
    from kvcal.engines import engine, with_attr
    from kvcal.errors import KvcalError

    known = with_attr("Plan")  # the engines whose cache kvcal emulates
    if cfg.engine not in known:
        raise KvcalError(f"--engine {cfg.engine!r}: kvcal recommend knows {'/'.join(known)} only; use --engine "
                         f"{known[0]}")
    eng = engine(cfg.engine)
    try:
        eng.backend(cfg.backend)
    except eng.DTypeError as e:
        raise KvcalError(f"--backend: {e}") from None
    if not cfg.dtypes:
        raise KvcalError("--dtypes is empty; name at least one vLLM --kv-cache-dtype (e.g. fp8,turboquant_4bit_nc)")
    try:
        eng.check_dtypes_served(cfg.backend, cfg.dtypes)
    except eng.DTypeError as e:
        raise KvcalError(f"--dtypes: {e}") from None
    if {"fp8", "fp8_e4m3"} <= set(cfg.dtypes):  # one dtype under two names: its outputs would mix them
        raise KvcalError("--dtypes names fp8 and fp8_e4m3, one vLLM dtype under two names (vllm/config/cache.py: "
                         "fp8 = fp8_e4m3); keep one spelling")
    if cfg.max_skip is not None and cfg.max_skip < 0:
        raise KvcalError(f"--max-skip must be >= 0, got {cfg.max_skip}")
    return check_common(cfg, corpus)


def check_common(cfg: RecommendConfig, corpus=None) -> tuple:
    """The checks every engine's recommend makes before a model loads: ``--accept`` (only the metrics a row carries,
    a bar that can both pass and fail), ``--max-bytes-per-token``, ``--windows``/``--max-windows``, the output
    directory and the corpus files (``corpus``: ``cfg.corpus`` already checked, not checked again). Returns the
    checked ``(corpus, eval corpus or None)``. Raises :class:`~kvcal.errors.KvcalError` naming the option."""
    from kvcal.artifact import check_output_dir
    from kvcal.errors import KvcalError
    from kvcal.inputs import check_corpus_input, corpus_input
    from kvcal.options import parse_bar

    if cfg.accept is not None:
        parse_bar(cfg.accept, RECOMMEND_METRICS, "kvcal recommend", why_not=dict.fromkeys(
            ("greedy_agree", "greedy_prefix"), "it generates no text: every candidate is judged teacher-forced"))
    if cfg.max_bytes_per_token is not None and cfg.max_bytes_per_token < 1:
        raise KvcalError(f"--max-bytes-per-token must be >= 1, got {cfg.max_bytes_per_token}")
    if cfg.windows < 1 or cfg.max_windows < cfg.windows:
        raise KvcalError(f"--max-windows {cfg.max_windows} is below --windows {cfg.windows}: a row gets --windows "
                         "windows first and at most --max-windows; give --max-windows >= --windows")
    check_output_dir(cfg.out, cfg.overwrite, inputs={"--corpus": cfg.corpus, "--eval-corpus": cfg.eval_corpus},
                     kind="recommendation")
    opts = {"text_field": cfg.text_field, "messages_field": cfg.messages_field, "split": cfg.split}
    checked = corpus_input(cfg.corpus, corpus, **opts)
    return checked, None if cfg.eval_corpus is None else check_corpus_input(cfg.eval_corpus, **opts)


def check_head_dims(cfg: RecommendConfig, model_config) -> tuple[tuple[str, ...], list[str]]:
    """The menu dtypes the model's head_dim can hold (nvfp4: a multiple of 16; turboquant: a power of two;
    the engine's ``check_head_dim``, :func:`kvcal.engines.vllm.dtypes.check_head_dim`), checked before the model loads. An explicit ``--dtypes``
    naming one it cannot hold is refused, naming the ``--dtypes`` without it; the default menu (no
    ``--dtypes``) drops them, and the returned notes (one per dropped dtype) say so. Returns
    ``(dtypes, notes)``. Raises :class:`~kvcal.errors.KvcalError`."""
    from kvcal.engines import engine
    from kvcal.errors import KvcalError
    from kvcal.formats.memory import model_shape

    eng = engine(cfg.engine)
    D = model_shape(model_config).head_dim
    bad = []
    for d in dict.fromkeys(cfg.dtypes):
        try:
            eng.check_head_dim(d, D)
        except eng.DTypeError as e:
            bad.append((d, e))
    keep = tuple(d for d in dict.fromkeys(cfg.dtypes) if d not in dict(bad))
    if bad and (tuple(cfg.dtypes) != DEFAULT_MENU or not keep):
        raise KvcalError(f"--dtypes {', '.join(d for d, _ in bad)}: {bad[0][1]}; "
                         + (f"pass --dtypes {','.join(keep)}" if keep else "choose another --dtypes"))
    return (tuple(cfg.dtypes) if not bad else keep), [f"{d} left out of the default menu: {e}" for d, e in bad]


def budget_context(model_config) -> int | None:
    """The context (tokens) bytes per token are averaged over on a model with sliding-window layers: its
    ``max_position_embeddings`` (a sliding layer's pages stop growing at its window, so its share of a
    token's bytes shrinks with the context: :func:`kvcal.engines.vllm.memory.vllm_token_shares`). ``None`` for a
    model without sliding-window layers, whose bytes per token are the same at every context."""
    from kvcal.formats.memory import model_shape

    shp = model_shape(model_config)
    return shp.max_position_embeddings if shp.sliding_layers else None


def check_budget(cfg: RecommendConfig, model_config) -> None:
    """Refuse a ``--max-bytes-per-token`` below every dtype of the menu at its fewest 16-bit layers
    (before the model loads). Raises :class:`~kvcal.errors.KvcalError`."""
    from kvcal.engines import engine
    from kvcal.errors import KvcalError

    if cfg.max_bytes_per_token is None:
        return
    ctx = budget_context(model_config)
    least = {d: engine(cfg.engine).bytes_per_token(model_config, d, context=ctx) for d in cfg.dtypes}
    d0 = min(least, key=least.get)
    if least[d0] > cfg.max_bytes_per_token:
        raise KvcalError(f"--max-bytes-per-token {cfg.max_bytes_per_token}: the cheapest dtype of the menu ({d0}) "
                         f"needs {least[d0]} bytes per token on this model; raise the bound or add a smaller dtype")


def effective_max_skip(max_skip: int | None, num_layers: int) -> tuple[int, str | None]:
    """``--max-skip`` on a ``num_layers``-layer model: a given value must lie in ``[0, num_layers - 1]`` (every
    layer at 16 bits would store nothing in the dtype); ``None`` is :data:`DEFAULT_MAX_SKIP` capped at
    ``num_layers - 1``. Returns ``(max_skip, note)``, the note (or ``None``) saying when the default was capped.
    Raises :class:`~kvcal.errors.KvcalError` naming the value, the layer count and the range."""
    from kvcal.errors import KvcalError

    hi = num_layers - 1
    if max_skip is None:
        if DEFAULT_MAX_SKIP <= hi:
            return DEFAULT_MAX_SKIP, None
        return hi, (f"--max-skip not given: at most {hi} of the model's {num_layers} layers at 16 bits (the default "
                    f"{DEFAULT_MAX_SKIP} capped at layers - 1, so that every candidate stores a layer in its dtype)")
    if not 0 <= max_skip <= hi:
        raise KvcalError(f"--max-skip {max_skip}: the model has {num_layers} layers and every candidate keeps at least "
                         f"one in its dtype; give --max-skip between 0 and {hi}")
    return max_skip, None


def applicable_dtypes(dtypes, num_layers: int, engine: str = DEFAULT_ENGINE) -> dict[str, str]:
    """``{dtype: reason}`` for the menu dtypes with no deployment on a ``num_layers``-layer model (``engine``'s
    ``not_applicable``, :func:`kvcal.engines.vllm.skip_layers.not_applicable`: vLLM's own turboquant boundary layers
    cover every layer of a 2- or 4-layer model); their rows are reported :data:`NOT_APPLICABLE`, not evaluated.
    Raises :class:`~kvcal.errors.KvcalError` (before the model loads) when that leaves nothing to evaluate."""
    from kvcal.engines import engine as engine_of
    from kvcal.errors import KvcalError

    not_applicable = engine_of(engine).not_applicable
    na = {d: r for d in dict.fromkeys(dtypes) if (r := not_applicable(d, num_layers))}
    if na and len(na) == len(dict.fromkeys(dtypes)):
        raise KvcalError(f"--dtypes {','.join(na)}: {next(iter(na.values()))}; add a dtype that stores this model's "
                         "layers (e.g. --dtypes fp8)")
    return na
