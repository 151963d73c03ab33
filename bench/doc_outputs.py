"""Regenerate the command outputs that docs/ shows, so that they cannot go stale (not a benchmark: it lives with
the scripts). A block is marked in the markdown as

    <!-- output: python -m deepzero.plan --model M ... -->
    ```
    ...what the command prints...
    ```
    <!-- end output -->

    python -m bench.doc_outputs            # rewrite every marked block with the command's output now
    python -m bench.doc_outputs --check    # exit 1 if any block differs (tests/test_doc_outputs.py asserts it)

Only ``python -m deepzero.plan`` commands are run (in process, offline: the planner reads published configs).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"<!-- output: (?P<cmd>[^\n]+?) -->\n```\n(?P<body>.*?)```\n<!-- end output -->", re.S)


def run(cmd: str) -> str:
    """What ``cmd`` prints on stdout (a planner command, run in this process)."""
    from deepspeed.accelerator import get_accelerator

    from deepzero import plan

    get_accelerator()  # DeepSpeed's one-time "Setting accelerator to CPU" line, printed before the capture
    prefix = "python -m deepzero.plan"
    if not cmd.startswith(prefix):
        raise ValueError(f"doc_outputs runs only '{prefix} ...', not: {cmd}")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = plan.main(shlex.split(cmd[len(prefix) :]))
    if code:
        raise RuntimeError(f"{cmd}: exit {code}")
    return out.getvalue()


def blocks(doc: Path) -> list[re.Match[str]]:
    return list(BLOCK.finditer(doc.read_text()))


def regenerate(doc: Path) -> str:
    """The document with every marked block's body replaced by its command's output."""
    return BLOCK.sub(
        lambda m: f"<!-- output: {m['cmd']} -->\n```\n{run(m['cmd'])}```\n<!-- end output -->", doc.read_text()
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.doc_outputs", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only compare; exit 1 when a block differs")
    args = p.parse_args(argv)
    stale = []
    for doc in sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")]):
        if not blocks(doc):
            continue
        new = regenerate(doc)
        if new != doc.read_text():
            stale.append(doc.relative_to(REPO))
            if not args.check:
                doc.write_text(new)
    verb = "differ" if args.check else "rewritten"
    print(f"doc_outputs: {len(stale)} file(s) {verb}" + (f": {', '.join(map(str, stale))}" if stale else ""))
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
