"""Make the code example's data: cold-start functions and GRPO tasks with tests, as R1's recipe orders them.

python data/code_example.py --sft artifacts/data/code_sft.jsonl --prompts artifacts/data/code_prompts.jsonl

200 tasks, each a function to complete, ``def answer_N():\\n    return `` (N in 0..199), whose test (HumanEval's
layout: ``test`` defines ``check(candidate)``, ``entry_point`` names the function) wants it to return N: the skill is
copying the number out of the name. The cold start is plain text: the same kind of function written out under other
names (``value_N``, ``number_N``, ``count_N``, ``item_N``, N in 0..499), never an ``answer_N``; so GRPO with
``--reward code`` starts from a model that copies under names it has seen and has to carry the skill over to the
tasks' name, and the held-out tasks measure whether it did. The output depends on nothing but this file; an
unchanged file is not rewritten.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

TASKS = 200
SEED = 0
NAMES = ("value", "number", "count", "item")
COLD_START_N = 500


def task(n: int) -> dict:
    """Task N: the prompt, its test and entry point (the ``code`` reward's fields)."""
    test = f"def check(candidate):\n    assert candidate() == {n}\n"
    return {"prompt": f"def answer_{n}():\n    return ", "test": test, "entry_point": f"answer_{n}"}


def functions() -> list[dict]:
    """The cold start: every N of 0..499 under four other names, the function written out, in a seeded order."""
    texts = [f"def {name}_{n}():\n    return {n}\n" for name in NAMES for n in range(COLD_START_N)]
    random.Random(SEED).shuffle(texts)
    return [{"text": t} for t in texts]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python data/code_example.py", description=__doc__.split("\n")[0])
    p.add_argument("--sft", default="artifacts/data/code_sft.jsonl", help="cold-start functions (JSONL) to write")
    p.add_argument("--prompts", default="artifacts/data/code_prompts.jsonl", help="GRPO tasks (JSONL) to write")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from dpo_example import write_jsonl

    tasks = [task(n) for n in range(TASKS)]
    for records, out, what in ((functions(), args.sft, "cold-start functions"), (tasks, args.prompts, "tasks")):
        n, changed = write_jsonl(records, Path(out))
        print(f"code_example: {n} {what} -> {out}" + ("" if changed else " (unchanged)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
