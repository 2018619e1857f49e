"""User-facing errors.

A `KilovlaError` is a problem with what the user gave us (a file, a flag, a request), not a bug in
kilovla: the CLI prints its message as one line and exits with code 2, without a traceback.
"""

from __future__ import annotations

from pathlib import Path


class KilovlaError(Exception):
    """Bad input. The message names the file or option and the problem."""


class DatasetError(KilovlaError):
    """A dataset file is missing, corrupt or disagrees with meta/info.json.

    >>> str(DatasetError("/data/ds/meta/info.json", "missing key 'fps'"))
    "/data/ds/meta/info.json: missing key 'fps'"
    """

    def __init__(self, path: str | Path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{path}: {problem}")
