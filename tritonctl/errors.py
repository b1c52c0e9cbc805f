"""The error types the CLI turns into a clean message and a non-zero exit: 2 for bad input or a problem that
stopped the work, 3 for an apply that failed and was rolled back."""

from __future__ import annotations

import os
from pathlib import Path


def shown_path(path: str | Path) -> str:
    """A path as messages name it: relative to the working directory where it lies under it, absolute otherwise, so a
    file is named the same however it reached the message."""
    absolute = Path(os.path.abspath(path))  # `..` folded: a file up the tree is outside
    try:
        return str(absolute.relative_to(Path.cwd()))
    except ValueError:
        return str(absolute)


class TritonctlError(Exception):
    """A problem the user can fix: names the file and field where they are known."""

    exit_code = 2

    def __init__(self, message: str, *, file: str | Path | None = None, field: str | None = None):
        self.file = str(file) if file is not None else None
        self.field = field
        self.message = message
        super().__init__(str(self))

    def __str__(self) -> str:
        where = ": ".join(part for part in (shown_path(self.file) if self.file else None, self.field) if part)
        return f"{where}: {self.message}" if where else self.message


class RolledBack(TritonctlError):
    """An apply that failed part-way and was rolled back: what ran before keeps running."""

    exit_code = 3
