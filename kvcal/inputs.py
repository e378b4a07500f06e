"""The inputs a command reads, resolved and checked once before anything heavy loads: the corpus
(:class:`CorpusInput`) and the model (:class:`ModelInputs`), together a :class:`Preflight`.

:func:`check_corpus_input` checks a corpus's source, format and fields (:func:`kvcal.corpus.check_corpus`: no
tokenizer, no model) and imports no torch: :mod:`kvcal.api` runs it first for ``calibrate``, ``evaluate``,
``recommend`` and ``verify``, so the CLI reports a bad corpus before torch is imported, and hands the result on.
:func:`preflight` takes that result (or a path, checked there) and resolves the model once
(:func:`resolve_model_inputs`: :func:`kvcal.models.resolve_model`, its config, shape, maximum positions and
vocabulary size, no weights); the command reads every later answer from the object instead of reading the
config again, and hands it down (the tokenizer gets its vocabulary size, the corpus stream skips its check).
Each error is the one-line :class:`~kvcal.errors.KvcalError` the check it comes from raises. :mod:`kvcal.models`
(torch) is imported only when a model is resolved.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: the corpus field options every command takes (``--text-field``, ``--messages-field``, ``--split``)
CORPUS_OPTIONS = ("text_field", "messages_field", "split")


@dataclass(frozen=True)
class CorpusInput:
    """A corpus checked once: its path, field options and what :func:`kvcal.corpus.check_corpus` found
    (``checked``: ``{"source", "split", "records", "formats"}``)."""

    path: str
    text_field: str | None = None
    messages_field: str | None = None
    split: str | None = None
    checked: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def options(self) -> dict:
        """The field options, as :func:`kvcal.corpus.load_corpus` and ``corpus_stream`` take them."""
        return {"text_field": self.text_field, "messages_field": self.messages_field, "split": self.split}


def check_corpus_input(path, *, text_field: str | None = None, messages_field: str | None = None,
                       split: str | None = None) -> CorpusInput:
    """Check the corpus at ``path`` with these field options (:func:`kvcal.corpus.check_corpus`; imports no
    torch). Raises :class:`~kvcal.errors.CorpusError` in one line naming the file, line and fix."""
    from kvcal.corpus import check_corpus

    return CorpusInput(str(path), text_field, messages_field, split,
                       check_corpus(path, text_field=text_field, messages_field=messages_field, split=split))


def corpus_input(path, given: CorpusInput | None = None, **options) -> CorpusInput:
    """``given`` when it is ``path`` already checked with ``options`` (the api's preflight, handed on), else
    ``path`` checked now (:func:`check_corpus_input`)."""
    opts = {k: options.get(k) for k in CORPUS_OPTIONS}
    if given is not None and given.path == str(path) and given.options == opts:
        return given
    return check_corpus_input(path, **opts)


@dataclass(frozen=True)
class ModelInputs:
    """A model resolved once, no weights loaded. ``model``: the ``--model`` value (``None``: the default);
    ``source``: its :class:`kvcal.models.ModelSource` (an already-loaded model's ``kvcal_source``, else
    ``None``); ``config``: its transformers config, or the config fields of an unconverted GGUF's header
    (:func:`kvcal.models.gguf_config_fields`, a dict) where the command needs no more, or a checkpoint's
    ``config.json`` dict; ``shape``: :func:`kvcal.formats.memory.model_shape` of it (``None`` when the config
    cannot size a KV cache: the command's own check says why); ``max_positions``: its
    ``max_position_embeddings`` (``None``: not recorded); ``vocab_size``: the rows of its token embedding
    (``None``: unknown), which the tokenizer is given so that it does not read the config again."""

    model: str | None
    source: object
    config: object
    shape: object
    max_positions: int | None
    vocab_size: int | None

    @property
    def text_config(self):
        """The text part of :attr:`config` (a multimodal config's ``text_config``), what the checks read."""
        return _text_config(self.config)


def _text_config(config):
    if isinstance(config, dict):
        return config.get("text_config") or config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _positive_int(v) -> int | None:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def resolve_model_inputs(model: str | None, *, loaded=None, full: bool = True, config: dict | None = None) -> ModelInputs:
    """Resolve ``model`` once (:func:`kvcal.models.resolve_model`) and read its config once
    (:func:`kvcal.models.load_model_config`). ``full=False``: a GGUF not yet converted is read from its header
    (:func:`kvcal.models.gguf_config_fields`, milliseconds instead of transformers' conversion) when the command
    needs no more than the shape and maximum positions. ``loaded``: an already-loaded model (its config is
    used; nothing is read). ``config``: a ``config.json`` dict the caller has read (a checkpoint's; nothing is
    resolved). A model directory without tokenizer files (:func:`kvcal.models.check_tokenizer_files`) is refused
    here. Raises :class:`~kvcal.errors.ModelLoadError` in one line."""
    from kvcal.formats.memory import model_shape

    if config is not None:
        src, vocab = None, _positive_int(_text_config(config).get("vocab_size"))
    elif loaded is not None:
        src, config = getattr(loaded, "kvcal_source", None), loaded.config
        vocab = _positive_int(getattr(_text_config(config), "vocab_size", None))
    else:
        from kvcal.models import (
            check_tokenizer_files,
            gguf_config_fields,
            load_model_config,
            model_vocab_size,
            resolve_model,
        )

        src = resolve_model(model)
        check_tokenizer_files(src)  # file names only: a directory without a tokenizer, before anything loads
        config = (None if full else gguf_config_fields(src)) or load_model_config(src)
        vocab = model_vocab_size(src, None if isinstance(config, dict) else config)
    text = _text_config(config)
    mp = text.get("max_position_embeddings") if isinstance(text, dict) else getattr(text, "max_position_embeddings", None)
    try:
        shape = model_shape(text)
    except (ValueError, TypeError):
        shape = None
    return ModelInputs(model, src, config, shape, _positive_int(mp), vocab)


@dataclass(frozen=True)
class Preflight:
    """What a command resolved before anything heavy loads: its model (:class:`ModelInputs`), its corpus
    and, for ``recommend --eval-corpus``, the evaluation corpus (:class:`CorpusInput`)."""

    model: ModelInputs
    corpus: CorpusInput
    eval_corpus: CorpusInput | None = None


def preflight(model: str | None, corpus: str | CorpusInput, *, loaded=None, full: bool = True,
              config: dict | None = None, eval_corpus: str | CorpusInput | None = None,
              **corpus_options) -> Preflight:
    """Every input of a command resolved once: ``corpus`` and ``eval_corpus`` (paths, checked here with
    ``corpus_options``, or the :class:`CorpusInput` :func:`check_corpus_input` returned earlier, not checked
    again), then the model (:func:`resolve_model_inputs` with ``loaded`` / ``full`` / ``config``). Raises
    :class:`~kvcal.errors.KvcalError` (one line) for the first input that is wrong, in that order."""
    c = corpus if isinstance(corpus, CorpusInput) else check_corpus_input(corpus, **corpus_options)
    e = eval_corpus
    if e is not None and not isinstance(e, CorpusInput):
        e = check_corpus_input(e, **c.options)
    return Preflight(resolve_model_inputs(model, loaded=loaded, full=full, config=config), c, e)
