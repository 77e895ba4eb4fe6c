"""Exceptions with messages a user can act on (file, row, key)."""

from typing import Optional


class OrbInputError(ValueError):
    """Bad user input: a database row, a structure, a config key or a checkpoint."""


class OutputBusy(OrbInputError):
    """An output another command is writing at the same time (:func:`orb.files.sole_writer`): the refused command
    touches nothing of it."""


class DatasetError(OrbInputError):
    """A problem with an ASE database or one of its rows."""

    def __init__(self, path: str, message: str, row: Optional[int] = None, key: Optional[str] = None,
                 unit: str = "row"):
        where = str(path)
        if row is not None:
            where += f", {unit} {row}"
        if key is not None:
            where += f", key '{key}'"
        super().__init__(f"{where}: {message}")
        self.path, self.message, self.row, self.key, self.unit = str(path), message, row, key, unit

    def __reduce__(self):  # raised in data-loading worker processes, re-raised in the trainer
        return type(self), (self.path, self.message, self.row, self.key, self.unit)


class ClusterInputError(OrbInputError):
    """Bad input that another process of a data-parallel job found (its log names it): exit status 2 on every rank."""


class StructureError(OrbInputError):
    """A structure that orb cannot turn into a graph."""


class ConfigError(OrbInputError):
    """An unknown, missing or ill-typed configuration key; ``key``: the dotted key it is about, when it names one
    that a config file may have set (the message then names that file: :mod:`orb.training.config_files`)."""

    def __init__(self, message: str, key: Optional[str] = None):
        super().__init__(message)
        self.key = key


class CheckpointError(OrbInputError):
    """A checkpoint that cannot be read or does not fit the model."""


class RunError(Exception):
    """A run that cannot go on because of a fault (not bad input): one line, exit status 1, nothing lost."""


class StartupError(RunError):
    """A fault before any work (weights that could not be fetched): the run leaves its output folder as it was."""


class ClusterError(RunError):
    """A data-parallel job that cannot go on because another of its processes stopped."""


class SaveError(RunError):
    """A checkpoint that could not be written (e.g. a full disk); the previous one is intact."""


class DivergedError(RunError):
    """Training steps whose loss or gradient is not finite, too many in a row."""


class DataWorkerError(RunError):
    """The processes preparing batches died and could not be replaced."""
