"""User-facing errors.

Every error a user can cause by bad input (a corpus line, an artifact file, a CLI option) is a
:class:`KvcalError` whose message names the file / line / field and says how to fix it. The CLI
prints ``error: <message>`` on one line and exits with status 2; it never shows a traceback for
these. Internal invariants use ``assert``.
"""

from __future__ import annotations


class KvcalError(Exception):
    """Bad input or an unusable environment, with a message meant for the user."""


class CorpusError(KvcalError):
    """A calibration/evaluation corpus that cannot be read (message carries ``file:line``)."""


class ArtifactError(KvcalError):
    """A kvcal artifact that is missing, corrupted, or does not match the model."""


class ModelLoadError(KvcalError):
    """A model that cannot be found or loaded offline."""


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP (``timeout``, ``kill``, ``docker stop``, Kubernetes, a closed terminal), raised in the main
    thread by the handler :func:`kvcal.cli.common.user_errors` installs. A :class:`KeyboardInterrupt`, so every cleanup
    that runs on Ctrl-C (temporary outputs removed, checkpoints kept) runs on it too."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def signame(self) -> str:
        import signal

        try:
            return signal.Signals(self.signum).name
        except ValueError:
            return f"signal {self.signum}"


def interruption(e: BaseException) -> tuple[str, int]:
    """How the CLI reports an interrupted run: ``("interrupted", 130)`` for Ctrl-C, ``("terminated by SIGTERM",
    143)`` / ``("terminated by SIGHUP", 129)`` for :class:`Terminated` (exit status 128 + the signal number, as a
    shell reports a process killed by it)."""
    if isinstance(e, Terminated):
        return f"terminated by {e.signame}", 128 + e.signum
    return "interrupted", 130
