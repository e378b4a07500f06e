"""Command-line interface: thin click commands over the Python API (heavy imports are lazy).

Every command turns :class:`kvcal.errors.KvcalError` into a one-line ``error: ...`` message and
exit status 2 (1 for ``evaluate`` acceptance failures), never a traceback.

The ``kvcal`` group and what the commands share are in :mod:`kvcal.cli.common`; each command group
has a module: :mod:`kvcal.cli.calibration` (``calibrate``), :mod:`kvcal.cli.artifacts` (``export``,
``inspect``, ``report``), :mod:`kvcal.cli.capacity` (``memory``, ``plan``) and :mod:`kvcal.cli.quality`
(``evaluate``, ``recommend``, ``verify``). Importing this package registers every command on :func:`main`
(the ``kvcal`` console entry point, ``kvcal.cli:main``).
"""

from __future__ import annotations

from kvcal.cli import artifacts, calibration, capacity, quality  # noqa: F401  (each registers its commands)
from kvcal.cli.common import main

__all__ = ["main"]
