"""What every kvcal command shares: the ``kvcal`` click group (:func:`main`), the error and signal
handling (:func:`user_errors`), and the integer and corpus option types."""

from __future__ import annotations

import functools
import sys

import click

from kvcal import __version__
from kvcal.errors import KvcalError, Terminated, interruption


def quiet_libraries() -> None:
    """``--quiet``: also silence transformers' own progress bars (GGUF de-quantization, weight loading)."""
    import os

    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass


#: signals that end a run like Ctrl-C: temporary outputs removed, one line said, exit 128 + the signal number
TERMINATING_SIGNALS = ("SIGTERM", "SIGHUP")


def _terminate(signum, frame):
    """Signal handler: raise :class:`kvcal.errors.Terminated` (a KeyboardInterrupt) where the main thread runs,
    after ignoring further such signals so that a second one cannot cut the cleanup short."""
    import signal

    for name in TERMINATING_SIGNALS:
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    raise Terminated(signum)


def terminating_signals_raise():
    """Install :func:`_terminate` for SIGTERM and SIGHUP (main thread only; signals a platform lacks are skipped);
    returns the previous handlers for :func:`restore_signals`."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return {}
    prev = {}
    for name in TERMINATING_SIGNALS:
        sig = getattr(signal, name, None)
        if sig is not None and signal.getsignal(sig) is not signal.SIG_IGN:  # nohup's SIGHUP stays ignored
            prev[sig] = signal.signal(sig, _terminate)
    return prev


def restore_signals(prev) -> None:
    import signal

    for sig, handler in prev.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def user_errors(fn):
    """Decorator: print KvcalError / KeyboardInterrupt (Ctrl-C, and SIGTERM / SIGHUP, which the command turns into
    :class:`kvcal.errors.Terminated` while it runs) as one line and exit non-zero."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        prev = terminating_signals_raise()
        try:
            from kvcal.options import check_environment

            check_environment()  # kvcal's own variables (KVCAL_KERNELS, KVCAL_CACHE), before any work
            return fn(*args, **kwargs)
        except KvcalError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        except KeyboardInterrupt as e:
            what, status = interruption(e)
            click.echo(f"{what}: nothing was written (temporary output removed)", err=True)
            sys.exit(status)
        finally:
            restore_signals(prev)

    wrapper.kvcal_user_errors = True  # tests check that every command carries it
    return wrapper


#: Largest token count, length or size accepted by an integer option: 2**31 - 1, the int32 index range of
#: torch kernels and tokenizer position ids. Larger values (and values below each option's minimum) are
#: refused by click before any work (exit 2); no option reaches torch or Python limits.
MAX_INT = 2**31 - 1
#: ``--seed`` range: numpy's seed range, which torch.manual_seed and random.Random also accept.
SEED = click.IntRange(0, 2**32 - 1)


def count(lo: int, hi: int = MAX_INT) -> click.IntRange:
    """An integer option in ``[lo, hi]`` (tokens, samples, ranks, ...)."""
    return click.IntRange(lo, hi)


def corpus_options(fn):
    """``--text-field`` / ``--messages-field`` / ``--split``: how every command that takes ``--corpus`` reads it
    (see :mod:`kvcal.corpus`)."""
    fn = click.option("--split", default=None,
                      help="Split of a dataset corpus with several (save_to_disk DatasetDict, hub dataset) "
                           "[default: train, or the only one].")(fn)
    fn = click.option("--messages-field", default=None,
                      help="Field/column holding the conversation when it is not called messages.")(fn)
    fn = click.option("--text-field", default=None,
                      help="Field/column holding raw text when it is not called text (JSONL and datasets).")(fn)
    return fn


CORPUS_HELP = ("Calibration corpus: .jsonl(.gz), .txt, .parquet, .arrow, .csv, .json, a save_to_disk directory "
               "or a hub dataset id already in the local cache (owner/name[:config]; nothing downloads).")


@click.group()
@click.version_option(__version__, prog_name="kvcal")
def main():
    """kvcal: attention-aware KV-cache quantization calibration."""
