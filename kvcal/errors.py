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
