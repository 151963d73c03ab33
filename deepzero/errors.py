"""The one exception type users see: a single line naming the problem and the fix."""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user (a file, a flag, a preset). Printed as one line, exit code 2."""

    def __init__(self, where: str, problem: str, fix: str) -> None:
        self.where, self.problem, self.fix = where, problem, fix
        super().__init__(f"{where}: {problem}. Fix: {fix}")
