"""Make a small preference set from the SFT example's questions: ``python data/dpo_example.py --help``.

python data/dpo_example.py --out artifacts/data/dpo_example.jsonl

Each pair asks the SFT example's first question about a function or class ("What does json.dumps do?", after
its system prompt); chosen is the right answer (the first paragraph of its own docstring, as in SFT) and rejected
is the answer about another member of a different module (the next such chat in the SFT order, shifted by a
fixed stride), in TRL's conversational layout ``{"prompt": [...], "chosen": [...], "rejected": [...]}``. The
output depends only on the Python version; an unchanged file is not rewritten.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sft_example import conversations

STRIDE = 37
"""How far along the SFT order the rejected answer is taken from (then onward to the first other module)."""


def pairs() -> list[dict[str, list[dict[str, str]]]]:
    """One pair per SFT conversation, in its order."""
    chats = conversations()
    out = []
    for i, chat in enumerate(chats):
        module = _module(chat)
        j = (i + STRIDE) % len(chats)
        while _module(chats[j]) == module:
            j = (j + 1) % len(chats)
        out.append({"prompt": chat[:2], "chosen": [chat[2]], "rejected": [chats[j][2]]})
    return out


def _module(chat: list[dict[str, str]]) -> str:
    """The module the question is about ("What does json.dumps do?" -> "json")."""
    return chat[1]["content"].removeprefix("What does ").rsplit(".", 1)[0]


def write(out: Path) -> tuple[int, bool]:
    """Write the pairs as JSONL; return their count and whether the file changed."""
    text = "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in pairs())
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
        f"dpo_example: {n} preference pairs (chosen: the right docstring, rejected: another module's) -> {out}"
        + ("" if changed else " (unchanged)")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
