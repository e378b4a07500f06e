"""Command-line interface: thin click commands over the Python API (heavy imports are lazy).

Every command turns :class:`kvcal.errors.KvcalError` into a one-line ``error: ...`` message and
exit status 2 (1 for ``evaluate`` acceptance failures), never a traceback.
"""

from __future__ import annotations

import functools
import sys

import click

from kvcal import __version__
from kvcal.errors import KvcalError


def user_errors(fn):
    """Decorator: print KvcalError / KeyboardInterrupt as one line and exit non-zero."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KvcalError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("interrupted: nothing was written", err=True)
            sys.exit(130)

    return wrapper


@click.group()
@click.version_option(__version__, prog_name="kvcal")
def main():
    """kvcal: attention-aware KV-cache quantization calibration."""


# ---- commands are registered below, one block each -------------------------------------------
