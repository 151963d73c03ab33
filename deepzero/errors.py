"""The one exception type users see: a single line naming the problem and the fix."""

from __future__ import annotations

import os
import re
import sys

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def one_line(text: str) -> str:
    """``text`` with control characters (a newline in a key, a path, a library's message) written as escapes."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def first_line(err: Exception) -> str:
    """The first line of a library's exception message (at most 200 characters), or its type when it has none."""
    return str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__


class UserError(Exception):
    """Bad input from the user (a file, a flag, a preset). Printed as one line, exit code 2."""

    def __init__(self, where: str, problem: str, fix: str) -> None:
        self.where, self.problem, self.fix = one_line(where), one_line(problem), one_line(fix)
        super().__init__(f"{self.where}: {self.problem}. Fix: {self.fix}")


class RaisedElsewhere(UserError):
    """Another rank's :class:`UserError`, by its line (ranks gather the first one and every rank raises it)."""

    def __init__(self, line: str) -> None:
        Exception.__init__(self, line)

    def __str__(self) -> str:
        return str(self.args[0])


def warn(message: str) -> None:
    """One warning line on stderr, from rank 0 only (the launcher starts every rank with the same input)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"warning: {message}", file=sys.stderr, flush=True)
