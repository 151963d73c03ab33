"""Make a long-sequence chat SFT set from the standard library's source: ``python data/sft_long_example.py --help``.

python data/sft_long_example.py --out artifacts/data/sft_long_example.jsonl

Each conversation asks what a module of a fixed list does; the assistant answers the way an R1-distilled model
does, with a long ``<think>…</think>`` trace first — here the module's own source, read function by function
("Reading json.decoder: …") — and then the module docstring's first paragraph as the answer. The traces run to
several thousand tokens (4k–30k with DeepSeek's tokenizer), the lengths R1-distill fine-tunes see. The output
depends only on the Python version, never on the machine; an unchanged file is not rewritten.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sft_example import first_paragraph

MODULES = (
    "argparse", "base64", "bisect", "calendar", "csv", "dataclasses", "difflib", "fnmatch", "functools",
    "getopt", "gettext", "glob", "gzip", "heapq", "ipaddress", "json/decoder", "json/encoder", "netrc",
    "operator", "optparse", "pprint", "queue", "quopri", "random", "reprlib", "sched", "secrets", "shlex",
    "statistics", "string", "tabnanny", "textwrap", "tokenize", "uuid", "zipapp",
)  # fmt: skip
"""Pure-Python modules present on every platform (``json/decoder`` is ``json/decoder.py``)."""
SYSTEM = "You are a careful Python expert. Think through the source before you answer."
MAX_CHARS = 60_000
"""A module's trace is cut here (about 15k DeepSeek tokens), at a function boundary."""


def trace(name: str, source: str) -> str:
    """The reasoning trace: the module read top to bottom, one paragraph per top-level function or class."""
    tree = ast.parse(source)
    parts = [f"Let me read {name} before I answer."]
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef):
            continue
        kind = "class" if isinstance(node, ast.ClassDef) else "function"
        segment = ast.get_source_segment(source, node) or ""
        part = f"Reading {name}.{node.name}, a {kind}:\n```python\n{segment}\n```"
        if sum(map(len, parts)) + len(part) > MAX_CHARS:
            break
        parts.append(part)
    parts.append(f"That is what {name} holds; its docstring sums it up.")
    return "\n\n".join(parts)


def conversations() -> list[list[dict[str, str]]]:
    """One conversation per module, in the listed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chats = []
    for module in MODULES:
        path = stdlib / f"{module}.py"
        source = path.read_text(encoding="utf-8")
        name = module.replace("/", ".")
        doc = ast.get_docstring(ast.parse(source)) or f"The {name} module."
        answer = first_paragraph(inspect.cleandoc(doc))
        chats.append(
            [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"What does the {name} module do?"},
                {"role": "assistant", "content": f"<think>\n{trace(name, source)}\n</think>\n\n{answer}"},
            ]
        )
    return chats


def write(out: Path) -> tuple[int, int, bool]:
    """Write the conversations as ``{"messages": [...]}`` lines; return their count, characters, and whether the
    file changed."""
    chats = conversations()
    text = "".join(json.dumps({"messages": chat}, ensure_ascii=False) + "\n" for chat in chats)
    if out.is_file() and out.read_text(encoding="utf-8") == text:
        return len(chats), len(text), False
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(out)
    return len(chats), len(text), True


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: write the JSONL and say what was written."""
    p = argparse.ArgumentParser(prog="python data/sft_long_example.py", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="artifacts/data/sft_long_example.jsonl", help="JSONL file to write")
    out = Path(p.parse_args(argv).out)
    n, chars, changed = write(out)
    suffix = "" if changed else " (unchanged)"
    print(f"sft_long_example: {n} conversations, {chars / 1e6:.2f} M characters of <think> traces -> {out}{suffix}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
