"""Every error a user can fix, in one leaf module (it imports nothing from the project).

The CLI prints any of :data:`USER_ERRORS` as one line (``error: ...``) and exits with code 2; ``str()`` of each
is that line. Plugins raise :class:`InvalidValue` from a config's ``check()`` or a ``check_preset`` hook and
:class:`DataError` from a dataset factory or its pre-flight check.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["PresetError", "PresetErrors", "InvalidValue", "RunDirError", "DataError", "CheckpointError",
           "USER_ERRORS"]


class PresetError(Exception):
    """A preset problem; ``str(err)`` is one line: ``FILE[:LINE]: TABLE.KEY: WHAT (valid: ...)``.

    ``file``, ``line`` and ``key`` may be filled in after the error is raised (the loader knows which layer of
    ``extends``/``--set`` gave the offending value; the validation walk does not).
    """

    def __init__(self, message: str, *, file: str | Path | None = None, key: str | None = None,
                 line: int | None = None):
        self.message, self.file, self.key, self.line = message, file, key, line
        super().__init__(str(self))

    def __str__(self) -> str:
        where = ""
        if self.file is not None:
            where = f"{self.file}:{self.line}: " if self.line else f"{self.file}: "
        key = f"{self.key}: " if self.key else ""
        return f"{where}{key}{self.message}"


class PresetErrors(PresetError):
    """Every problem of a preset at once (two or more :class:`PresetError`), in the order to fix them (structure
    first: :mod:`torch_handle.config.problems`); ``str(err)`` is one line per problem. ``file``, ``key``, ``line``
    and ``message`` are those of the first, so code that reads one problem still reads the first."""

    def __init__(self, problems: list[PresetError]):
        self.problems = list(problems)
        first = self.problems[0]
        super().__init__(first.message, file=first.file, key=first.key, line=first.line)

    def __str__(self) -> str:
        return "\n".join(str(p) for p in self.problems)


class InvalidValue(ValueError):
    """Raised by a section's ``check()`` (or a plugin's ``check_preset``) for a value that is out of range.

    ``key`` is the offending field: ``"n_heads"`` within the table being checked, or ``"table.key"`` for
    another table (``"launch.nproc_per_node"``).
    """

    def __init__(self, key: str, message: str):
        self.key, self.message = key, message
        super().__init__(f"{key}: {message}")


class RunDirError(Exception):
    """An unusable run or output directory; ``str()`` is one line."""


class DataError(Exception):
    """Unusable data (missing path, empty corpus, misaligned files, undecodable bytes); ``str()`` is one line."""


class CheckpointError(Exception):
    """A checkpoint that cannot be used (incomplete, corrupt, or unsafe to unpickle); ``str()`` is one line."""


USER_ERRORS = (PresetError, RunDirError, DataError, CheckpointError)
"""What the CLI reports as ``error: <one line>`` with exit code 2 (``InvalidValue`` becomes a PresetError;
:class:`PresetErrors`: one such line per problem)."""
