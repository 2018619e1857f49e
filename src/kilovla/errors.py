"""User-facing errors.

A `KilovlaError` is a problem with what the user gave us (a file, a flag, a request), not a bug in
kilovla: the CLI prints its message as one line and exits with code 2, without a traceback. A
subclass with another `exit_code` is a run that failed for a reason outside kilovla's control (a peer
rank that died): one line too, exit code 1.
"""

from __future__ import annotations

from pathlib import Path


class KilovlaError(Exception):
    """Bad input. The message names the file or option and the problem."""

    exit_code = 2


class DatasetError(KilovlaError):
    """A dataset file is missing, corrupt or disagrees with meta/info.json.

    >>> str(DatasetError("/data/ds/meta/info.json", "missing key 'fps'"))
    "/data/ds/meta/info.json: missing key 'fps'"
    """

    def __init__(self, path: str | Path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{path}: {problem}")
