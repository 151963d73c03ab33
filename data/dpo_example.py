"""Make a small preference set from the SFT example's questions: ``python data/dpo_example.py --help``.

python data/dpo_example.py --out artifacts/data/dpo_example.jsonl

The SFT example's modules are split in two, alternately in its order: questions are asked only about members of
the first half ("What does json.dumps do?", after its system prompt), and their rejected answers come only from the
second half. Chosen is the right answer (the first paragraph of its own docstring, as in SFT); rejected is the SFT
answer about a member of a second-half module, taken at a fixed stride. So no answer is chosen in one pair and
rejected in another. If the two roles were mixed, a model that does not yet read the question would be pushed both
ways on every answer, and on held-out pairs it would be pushed the wrong way: the first version of this example did
that and measured a val reward accuracy of 0.11. Pairs are in TRL's conversational layout
``{"prompt": [...], "chosen": [...], "rejected": [...]}``. The output depends only on the Python version; an
unchanged file is not rewritten.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sft_example import conversations

STRIDE = 37
"""How far along the second half's answers each pair's rejected answer is taken from."""


def pairs() -> list[dict[str, list[dict[str, str]]]]:
    """One pair per SFT conversation about a first-half module, in the SFT order."""
    chats = conversations()
    modules = list(dict.fromkeys(_module(chat) for chat in chats))
    asked = set(modules[::2])
    questions = [chat for chat in chats if _module(chat) in asked]
    others = [chat for chat in chats if _module(chat) not in asked]
    return [
        {"prompt": chat[:2], "chosen": [chat[2]], "rejected": [others[(i * STRIDE) % len(others)][2]]}
        for i, chat in enumerate(questions)
    ]


def _module(chat: list[dict[str, str]]) -> str:
    """The module the question is about ("What does json.dumps do?" -> "json")."""
    return chat[1]["content"].removeprefix("What does ").rsplit(".", 1)[0]


def write(out: Path) -> tuple[int, bool]:
    """Write the pairs as JSONL; return their count and whether the file changed."""
    return write_jsonl(pairs(), out)


def write_jsonl(records: Iterable[dict], out: Path) -> tuple[int, bool]:
    """Write ``records`` as JSONL atomically, leaving an identical file untouched (reruns are no-ops); return their
    count and whether the file changed. The GRPO example writes its prompts with it too."""
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if out.is_file() and out.read_text(encoding="utf-8") == text:
        return text.count("\n"), False
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(out)
    return text.count("\n"), True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python data/dpo_example.py", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="artifacts/data/dpo_example.jsonl", help="JSONL file to write")
    out = Path(p.parse_args(argv).out)
    n, changed = write(out)
    print(
        f"dpo_example: {n} preference pairs (chosen: the right docstring; rejected: a member of a module never asked about) -> {out}"
        + ("" if changed else " (unchanged)")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
