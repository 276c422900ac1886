"""Errors that a user can fix; the CLI prints them as one line and exits with code 2. No torch import."""

from torch_handle.config import PresetError
from torch_handle.rundir import RunDirError


class DataError(Exception):
    """Unusable data (missing path, empty corpus, misaligned files, undecodable bytes); ``str()`` is one line."""


class CheckpointError(Exception):
    """A checkpoint that cannot be used (incomplete, corrupt, or unsafe to unpickle); ``str()`` is one line."""


USER_ERRORS = (PresetError, RunDirError, DataError, CheckpointError)
