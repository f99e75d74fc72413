"""Errors of the user's data: a file or row that cannot be read as text, said in one line."""
from __future__ import annotations

from rayshard.plans.errors import RayshardError


class DataInputError(RayshardError, ValueError):
    """An input file (or one row of it) is not usable text: names the file, the row and a fix."""

    def __init__(self, source: str, row: int | None, problem: str, fix: str):
        self.source, self.row, self.problem, self.fix = source, row, problem, fix
        where = source if row is None else f"{source}, row {row}"
        super().__init__(f"{where}: {problem}. Fix: {fix}")

    def __reduce__(self):  # raised in a Ray task, it must reach the driver whole
        return type(self), (self.source, self.row, self.problem, self.fix), self.__dict__  # a rank's marks too


class DatasetMismatch(RayshardError, ValueError):
    """A resume would read a different dataset (or tokenizer) than its checkpoint was trained on."""
