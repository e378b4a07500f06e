"""Messages for bad CLI / corpus input name the thing the user wrote (tester's reproducers)."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from kvcal.cli import main


def _int_list_options():
    return [(name, p) for name, cmd in main.commands.items() for p in cmd.params
            if isinstance(p, click.Option) and hasattr(p.callback, "kvcal_int_list")]


@pytest.mark.parametrize("value", ["128,,64", "1024,", ",1024"])
def test_integer_list_with_an_empty_item_is_refused(value):
    """Tester: `--context 128,,64` was read as 128,64 (the empty item silently dropped)."""
    opts = _int_list_options()
    assert any(p.name == "contexts" for _, p in opts)
    for name, p in opts:
        with pytest.raises(click.BadParameter, match="empty item"):
            p.callback(None, p, value)
        assert p.callback(None, p, "64") == (64,)  # a plain value still parses
    r = CliRunner().invoke(main, ["evaluate", "--artifact", "x", "--corpus", "y", "--context", value])
    assert r.exit_code == 2 and "empty item" in r.output and "Traceback" not in r.output
