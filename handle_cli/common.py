"""What every ``handle`` command shares: exit codes and the one-line error exit. Click and the standard library
only, so any command module may import it without importing another command module."""

from __future__ import annotations

import sys
from typing import NoReturn

import click

EXIT_FINISHED = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
"""Bad input: a one-line error, nothing started and nothing in an existing run directory changed."""
EXIT_STOPPED = 130


def fail(message: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    """Print ``error: LINE`` on stderr for each line of ``message`` (one problem a line: a preset's problems are
    reported all at once) and exit with ``code`` (no traceback)."""
    for line in message.splitlines() or [""]:
        click.echo(f"error: {line}", err=True)
    sys.exit(code)
