"""Make a small chat SFT set from the standard library's docstrings: ``python data/sft_example.py --help``.

python data/sft_example.py --out artifacts/data/sft_example.jsonl

Each conversation asks what a public function or class of a fixed list of modules does ("What does json.dumps
do?"); the answer is the first paragraph of its own docstring. When the signature is known a second turn asks how
to call it; every third answer opens with a short R1-style ``<think>…</think>`` block. The output depends only on
the Python version (its docstrings), never on the machine or the run; an unchanged file is not rewritten, so
``prepare`` sees it up to date.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
import warnings
from pathlib import Path

MODULES = (
    "argparse", "base64", "bisect", "calendar", "collections", "contextlib", "copy", "csv", "dataclasses",
    "difflib", "enum", "fnmatch", "functools", "glob", "gzip", "hashlib", "heapq", "html", "ipaddress",
    "itertools", "json", "math", "operator", "pathlib", "pprint", "queue", "random", "re", "secrets", "shlex",
    "shutil", "statistics", "string", "struct", "tempfile", "textwrap", "urllib.parse", "uuid", "zipfile", "zlib",
)  # fmt: skip
"""Modules whose members are the same on every platform."""
SYSTEM = "You answer questions about the Python standard library briefly and exactly."
MIN_CHARS, MAX_CHARS = 30, 600
"""First paragraphs shorter (a bare signature) or longer than this are left out."""
THINK_EVERY = 3


def first_paragraph(doc: str) -> str:
    """The docstring's first paragraph with its whitespace collapsed."""
    return " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())


def conversations() -> list[list[dict[str, str]]]:
    """Every conversation, in a fixed order: modules as listed, members by name."""
    chats = []
    for module_name in MODULES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            module = importlib.import_module(module_name)
        for name in sorted(vars(module)):
            chat = _conversation(module_name, name, getattr(module, name), len(chats))
            if chat is not None:
                chats.append(chat)
    return chats


def _conversation(module: str, name: str, obj: object, index: int) -> list[dict[str, str]] | None:
    """One conversation about ``module.name``, or None for a private, re-exported or undocumented member."""
    if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
        return None
    home = getattr(obj, "__module__", None) or ""
    if home not in (module, f"_{module}") and not home.startswith(f"{module}."):
        return None
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__  # a class's own, not inherited
    if not isinstance(doc, str) or not MIN_CHARS <= len(answer := first_paragraph(doc)) <= MAX_CHARS:
        return None
    qualified, kind = f"{module}.{name}", "class" if inspect.isclass(obj) else "function"
    if index % THINK_EVERY == 0:
        think = f"The question is about {qualified}, a {kind} of the {module} module: its docstring answers it."
        answer = f"<think>\n{think}\n</think>\n\n{answer}"
    chat = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"What does {qualified} do?"},
        {"role": "assistant", "content": answer},
    ]
    signature = _signature(obj)
    if signature is not None:
        chat += [
            {"role": "user", "content": "How do I call it?"},
            {"role": "assistant", "content": f"`{qualified}{signature}`"},
        ]
    return chat


def _signature(obj: object) -> str | None:
    """``str(inspect.signature(obj))`` unless unknown or it shows an object's address (not deterministic)."""
    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return None
    return None if " at 0x" in text else text


def write(out: Path) -> tuple[int, bool]:
    """Write the conversations as ``{"messages": [...]}`` lines; return their count and whether the file changed."""
    chats = conversations()
    text = "".join(json.dumps({"messages": chat}, ensure_ascii=False) + "\n" for chat in chats)
    if out.is_file() and out.read_text(encoding="utf-8") == text:
        return len(chats), False
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(out)
    return len(chats), True


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: write the JSONL and say what was written."""
    p = argparse.ArgumentParser(prog="python data/sft_example.py", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="artifacts/data/sft_example.jsonl", help="JSONL file to write")
    out = Path(p.parse_args(argv).out)
    n, changed = write(out)
    suffix = "" if changed else " (unchanged)"
    print(f"sft_example: {n} conversations from {len(MODULES)} modules' docstrings -> {out}{suffix}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
