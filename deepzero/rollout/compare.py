"""Evaluations side by side: ``python -m deepzero.rollout.compare runs/eval/before runs/eval/after`` prints one
column per evaluate.py folder (its summary.json) and a row per figure (pass@k, cons@k, mean reward, lengths)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from deepzero.errors import UserError

SHOWN = ("prompts", "samples_per_prompt", "prompts_unscored", "samples_unscored", "mean_reward", "mean_length")
SHOWN += ("max_length", "truncated_share")
FIGURES = ("pass@", "avg@", "cons@", "maj@")


def table(folders: Sequence[Path]) -> str:
    """A markdown table of the folders' summaries: pass@k, avg@n, cons@n and maj@n rows first (± their standard
    errors), then ``SHOWN``."""
    summaries = []
    for folder in folders:
        path = folder / "summary.json"
        if not path.is_file():
            raise UserError(str(path), "does not exist", f"run evaluate.py --out {folder} first")
        summaries.append(json.loads(path.read_text()))
    keys = [k for k in summaries[0] if k.startswith(FIGURES) and not k.endswith("_stderr")] + list(SHOWN)
    rows = ["| | " + " | ".join(f.name for f in folders) + " |", "|---" * (len(folders) + 1) + "|"]
    for key in keys:
        cells = [_cell(s.get(key)) + _error(s.get(f"{key}_stderr")) for s in summaries]
        rows.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _error(value: object) -> str:
    return f" ± {value:.3f}" if isinstance(value, float) else ""


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return "-" if value is None else str(value)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("folders", nargs="+", type=Path, help="evaluate.py --out folders")
    args = parser.parse_args(argv)
    try:
        print(table(args.folders))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
