"""Make the math example's data: cold-start chats and GRPO prompts with answers, as R1's recipe orders them.

python data/math_example.py --sft artifacts/data/math_sft.jsonl --prompts artifacts/data/math_prompts.jsonl

Every sum ``a + b`` with ``a, b`` in 0..19 (400 questions). The cold-start chats answer a seeded half of them in the
format the reward reads, ``a + b = $\\boxed{c}$`` (math-verify parses the boxed answer); the prompts hold every
question as a chat message with its ``answer`` (TRL's accuracy_reward takes it as the solution), so GRPO trains on
the half the model has seen answered and the half it has not. The output depends on nothing but this file; an
unchanged file is not rewritten.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

RANGE = 20
SEED = 0


def questions() -> list[tuple[str, int]]:
    return [(f"What is {a} + {b}?", a + b) for a in range(RANGE) for b in range(RANGE)]


def chats() -> list[dict]:
    """The cold start: a seeded half of the questions, answered in the boxed format."""
    picked = random.Random(SEED).sample(questions(), len(questions()) // 2)
    return [
        {
            "messages": [
                {"role": "user", "content": q},
                {"role": "assistant", "content": f"{q[8:-1]} = $\\boxed{{{c}}}$"},
            ]
        }
        for q, c in picked
    ]


def prompts() -> list[dict]:
    """Every question, as one user message, with its answer for the reward."""
    return [{"prompt": [{"role": "user", "content": q}], "answer": str(c)} for q, c in questions()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python data/math_example.py", description=__doc__.split("\n")[0])
    p.add_argument("--sft", default="artifacts/data/math_sft.jsonl", help="cold-start chats (JSONL) to write")
    p.add_argument("--prompts", default="artifacts/data/math_prompts.jsonl", help="GRPO prompts (JSONL) to write")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from dpo_example import write_jsonl

    for records, out, what in ((chats(), args.sft, "cold-start chats"), (prompts(), args.prompts, "prompts")):
        n, changed = write_jsonl(records, Path(out))
        print(f"math_example: {n} {what} -> {out}" + ("" if changed else " (unchanged)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
