"""The evaluation and rejection-sampling jobs (``evaluate.py``, ``sample.py``): k samples of every prompt of a
``--format prompts`` folder, scored by the ``--reward`` functions, one JSON line per prompt.

Each rank takes every ``world``-th prompt not yet done and generates its rows with GRPO's sampler (all of a
call's rows batched, each row its own stream seeded by ``(seed, prompt index, sample)``: the same samples on any
world size, in any batch, after a resume). After each call the ranks' lines go to rank 0, which appends them to
``samples.jsonl``; ``--resume`` skips the prompts already there. At the end rank 0 writes ``summary.json``
(``deepzero.rollout.scores``), and ``sample.py`` the chat SFT JSONL of the kept completions.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from deepzero.args import generation_kwargs
from deepzero.checkpoint import write_atomic
from deepzero.distributed import every_ranks_object, init_distributed, on_cuda, rank0_decides
from deepzero.errors import RaisedElsewhere, UserError, first_line
from deepzero.rollout.generation import EVAL_GENERATION, GroupSeeds, HFGenerate, eos_ids, truncated
from deepzero.rollout.job_args import CPU_PROMPTS_PER_CALL, JobArgs, parse_job_args
from deepzero.rollout.layout import choose_layout, load_model
from deepzero.rollout.rewards import RewardContext, RewardSet, parse_rewards
from deepzero.rollout.scores import Condition, per_sample, summarise


@dataclass(frozen=True)
class JobFiles:
    """Where a job writes: the per-prompt lines, the settings, the summary (and sample.py's chat JSONL)."""

    samples: Path
    settings: Path
    summary: Path
    chat: Path | None = None

    @classmethod
    def of(cls, out: str, kind: str) -> JobFiles:
        if kind == "evaluate":
            folder = Path(out)
            return cls(folder / "samples.jsonl", folder / "job.json", folder / "summary.json")
        chat = Path(out)
        stem = chat.with_suffix("")
        return cls(Path(f"{stem}.samples.jsonl"), Path(f"{stem}.job.json"), Path(f"{stem}.summary.json"), chat)

    def start(self, settings: dict[str, Any], resume: bool) -> set[int]:
        """The prompt indices already done (``resume``); a new job refuses to overwrite one, a resumed one must have
        the same settings. A line cut short by a kill is dropped."""
        if not self.samples.exists():
            self.samples.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.settings, json.dumps(settings, indent=2))
            self.samples.touch()
            return set()
        if not resume:
            raise UserError(
                str(self.samples), "exists: a job was run here", "pass --resume to continue it, or another --out"
            )
        saved = json.loads(self.settings.read_text()) if self.settings.is_file() else {}
        for key, value in settings.items():
            if saved.get(key) != value:
                raise UserError(
                    f"--resume ({self.settings})",
                    f"{key} was {saved.get(key)!r}, now {value!r}: the samples would differ",
                    f"pass the same {key}, or another --out",
                )
        return {line["index"] for line in self.lines()}

    def lines(self) -> Iterator[dict[str, Any]]:
        """The per-prompt lines written so far (a torn last line, from a kill mid-write, is cut off the file)."""
        good = 0
        with self.samples.open("rb") as fh:
            for raw in fh:
                try:
                    line = json.loads(raw)
                except json.JSONDecodeError:
                    break
                good += len(raw)
                yield line
        if good < self.samples.stat().st_size:
            os.truncate(self.samples, good)

    def append(self, lines: list[dict[str, Any]]) -> None:
        with self.samples.open("a") as fh:
            fh.writelines(json.dumps(line) + "\n" for line in lines)
            fh.flush()
            os.fsync(fh.fileno())


class Job:
    """One evaluation or sampling job on this rank (see the module docstring)."""

    def __init__(self, args: JobArgs, kind: Literal["evaluate", "sample"]) -> None:
        from deepzero.data.prompts import PromptDataset

        self.args, self.kind = args, kind
        self.rank, self.world = init_distributed() if dist.is_available() else (0, 1)
        self.files = JobFiles.of(args.out, kind)
        self.data = PromptDataset(args.data, args.split)
        self.completion_len = args.max_completion_length or self.data.max_completion_length
        self.rewards: RewardSet = parse_rewards(args.reward, self.completion_len)
        self.rewards.check_fields(self.data.meta.get("record_fields", []), args.data)
        names = self.rewards.names
        self.correct = (
            Condition.parse(args.correct, names, "--correct")
            if args.correct
            else Condition.first_reward_at_least_one(names)
        )
        self.keep = Condition.parse(args.keep, self.rewards.names, "--keep") if kind == "sample" else None
        count = min(len(self.data), args.limit or len(self.data))
        if count == 0:
            raise UserError(args.data, f"has no {args.split} prompts", "prepare with --val-fraction, or pass --split")

        def start() -> tuple[set[int], str | None]:  # one rank reads and writes the job's files
            try:
                return self.files.start(args.settings(), args.resume), None
            except UserError as err:
                return set(), str(err)

        done, error = rank0_decides(start)
        if error:
            raise RaisedElsewhere(error)
        self.todo = [i for i in range(count) if i not in done]
        self.count = count
        self.layout = choose_layout(args, self.data.max_prompt_len, self.completion_len)
        rows = self.layout.rows
        if self.layout.name.startswith("placement") and self.world > 1:
            raise UserError(
                f"--layout {self.layout.name}",
                f"one copy of the model spans every card ({self.layout.reason}), so one process drives them",
                f"run python {kind}.py with the same flags, without the deepspeed launcher",
            )
        self.tokenizer, self.model = load_model(
            args, self.data.meta, self.layout.name, rows or 1, self.data.max_prompt_len + self.completion_len
        )
        self.sampler = HFGenerate(
            self.completion_len, eos_ids(self.tokenizer, self.model), self.data.pad_id, args.temperature or 1.0,
            args.top_p, rows, args.top_k, args.min_p, args.repetition_penalty, generation_kwargs(args.generation_kwargs),
        )  # fmt: skip
        self.seeds = GroupSeeds(args.seed)
        self.generated, self.generation_s = 0, 0.0
        """This invocation's completion tokens and seconds generating them, on this rank."""
        # a call's prompts: the planner's rows // k on a card (its rows per generate call cap the sampler either way)
        self.per_call = args.prompts_per_call or (max(1, rows // args.samples) if rows else CPU_PROMPTS_PER_CALL)

    def run(self) -> dict[str, Any]:
        """Generate, score and write every prompt still to do; then the summary (rank 0's; others get {})."""
        mine = self.todo[self.rank :: self.world]
        calls = -(-math.ceil(len(self.todo) / self.world) // self.per_call)
        bar = _progress(len(self.todo), self.count, self.rank)
        for c in range(calls):
            part = mine[c * self.per_call : (c + 1) * self.per_call]
            lines, error = [], None
            try:
                lines = self.lines_of(part)
            except UserError as err:
                error = str(err)
            everyone = every_ranks_object((lines, error))
            if first := next((e for _, e in everyone if e), None):
                raise RaisedElsewhere(first)
            if self.rank == 0:
                self.files.append(sorted((x for ls, _ in everyone for x in ls), key=lambda x: x["index"]))
                bar.update(sum(len(ls) for ls, _ in everyone))
        bar.close()
        figures = self.run_figures()
        summary = self.finish(figures) if self.rank == 0 else {}
        if self.world > 1:
            dist.barrier()
        return summary

    def lines_of(self, indices: list[int]) -> list[dict[str, Any]]:
        """The lines of ``indices``: k samples each, their rewards, answers and lengths."""
        if not indices:
            return []
        k, device = self.args.samples, self.model.get_input_embeddings().weight.device
        rows = [self.data[i]["prompt_ids"].to(device) for i in indices for _ in range(k)]
        greedy = self.args.temperature == 0
        seeds = None if greedy else [s for i in indices for s in self.seeds.rows(EVAL_GENERATION, i, k)]
        start = time.perf_counter()
        try:
            completions = self.sampler.sample(self.model, rows, seeds)
        except Exception as err:  # bitsandbytes' kernels refuse some shapes and devices, each in its own way
            if not self.layout.name.endswith("4bit"):
                raise
            raise UserError(
                f"--layout {self.layout.name}",
                f"bitsandbytes could not generate with this model's 4-bit weights ({first_line(err)})",
                "use --layout data-parallel or placement (16-bit weights)",
            ) from None
        self.generation_s += time.perf_counter() - start  # generate returns the tokens: the device is done
        self.generated += sum(map(len, completions))
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        context = RewardContext()
        each = [i for i in indices for _ in range(k)]
        total, per_name = self.rewards.score_rows(self.data, each, texts, completions, context)
        answers = context.answers(len(texts))
        out = []
        for n, index in enumerate(indices):
            rows_ = range(n * k, (n + 1) * k)
            scores = {name: [_number(v[r]) for r in rows_] for name, v in per_name.items()}
            rewards = [_number(total[r]) for r in rows_]
            out.append(
                {
                    "index": index,
                    "prompt": self.data.prompt(index),
                    "completions": [texts[r] for r in rows_],
                    "rewards": rewards,
                    "scores": scores,
                    "answers": [answers[r] for r in rows_],
                    "correct": [self.correct.verdict(sample) for sample in per_sample(rewards, scores)],
                    "lengths": [len(completions[r]) for r in rows_],
                    "truncated": [truncated(completions[r], self.sampler.eos_ids) for r in rows_],
                }
            )
        return out

    def run_figures(self) -> dict[str, Any]:
        """This invocation's layout and speed over every rank (a collective): completion tokens per second (all
        ranks' tokens over the slowest rank's generating time) and, on CUDA, the fullest card's peak against the
        planner's."""
        tokens = torch.tensor(float(self.generated), dtype=torch.float64)
        seconds = torch.tensor(self.generation_s, dtype=torch.float64)
        peak = torch.tensor(torch.cuda.max_memory_allocated() / 2**30 if on_cuda() else 0.0, dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(tokens)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        figures = {"layout": self.layout.name, "why": self.layout.reason, "ranks": self.world}
        figures |= {"prompts_per_call": self.per_call, "rows_per_call": self.layout.rows}
        figures["generation_tokens_per_s"] = tokens.item() / seconds.item() if seconds > 0 else None
        if on_cuda():
            figures["peak_gpu_mem_gib"] = peak.item()
            planned = self.layout.planned_bytes
            figures["planned_gpu_mem_gib"] = planned / 2**30 if planned is not None else None
        return figures

    def finish(self, figures: dict[str, Any]) -> dict[str, Any]:
        """Rank 0: summary.json from every line (and sample.py's chat JSONL), with this invocation's ``figures``
        under ``run``; returns the summary. The lines are streamed from the file (in index order: each call appends
        a contiguous run of the prompts still to do, sorted), never held together."""
        summary = summarise(self.files.lines(), self.args.pass_k)
        summary |= {"correct": str(self.correct), **self.args.settings(), "run": figures}
        if self.keep is not None:
            summary |= write_chat(self.files.lines(), self.keep, self.args.per_prompt, self.files.chat)
        write_atomic(self.files.summary, json.dumps(summary, indent=2))
        return summary

    def describe(self) -> str:
        a = self.args
        sampling = "greedy" if a.temperature == 0 else f"T {a.temperature:g} top-p {a.top_p:g}"
        return (
            f"{self.kind}: {a.model} on {a.data} ({a.split}, {self.count} prompts, {len(self.todo)} to do),"
            f" {a.samples} sample(s) each, {sampling}, up to {self.completion_len} tokens; {self.layout.name} on"
            f" {self.world} rank(s) ({self.layout.reason}), {self.per_call} prompts per call; correct: {self.correct}"
            + (f"; keep {self.keep}, {a.per_prompt} per prompt" if self.keep is not None else "")
        )


def write_chat(lines: Iterable[dict[str, Any]], keep: Condition, per_prompt: int, path: Path | None) -> dict[str, Any]:
    """The kept completions as chat SFT records (the prompt's messages, then the completion as the assistant turn),
    identical completions once, up to ``per_prompt`` a prompt, written as the lines stream in; returns the
    acceptance figures (overall, and how many prompts had 0, 1, ... passing samples)."""
    assert path is not None
    counts: Counter[str] = Counter()  # written, passed, duplicates, prompts with none kept, samples
    passing: Counter[int] = Counter()  # prompts by their number of passing samples

    def records() -> Iterator[str]:
        for line in lines:
            seen: set[str] = set()
            kept = 0
            each = per_sample(line["rewards"], line["scores"])
            passing[sum(keep(scores) for scores in each)] += 1
            counts["samples"] += len(line["completions"])
            for j, text in enumerate(line["completions"]):
                if not keep(each[j]):
                    continue
                counts["passed"] += 1
                if text in seen:
                    counts["duplicates"] += 1
                    continue
                seen.add(text)
                if kept < per_prompt:
                    messages = [*_messages(line["prompt"]), {"role": "assistant", "content": text}]
                    yield json.dumps({"messages": messages}, ensure_ascii=False) + "\n"
                    kept += 1
            counts["written"] += kept
            counts["none"] += kept == 0

    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, records())
    return {
        "keep": str(keep),
        "written": counts["written"],
        "acceptance_rate": counts["passed"] / counts["samples"] if counts["samples"] else None,
        "duplicates_dropped": counts["duplicates"],
        "prompts_with_none_kept": counts["none"],
        "prompts_by_passing_samples": {str(k): passing[k] for k in sorted(passing)},
        "chat_file": str(path),
    }


def _messages(prompt: Any) -> list[dict[str, str]]:
    return list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]


def _number(x: torch.Tensor) -> float | None:
    value = float(x)
    return None if math.isnan(value) else value


def _progress(todo: int, count: int, rank: int) -> Any:
    from deepzero import progress

    return progress.bar(count, show=rank == 0, initial=count - todo, unit="prompt")


def main(argv: list[str] | None, kind: Literal["evaluate", "sample"]) -> int:
    """evaluate.py's and sample.py's entry point: one line and exit code 2 for bad input."""
    from deepzero import quiet
    from deepzero.distributed import report_user_error

    quiet.install()
    try:
        job = Job(parse_job_args(argv, f"{kind}.py"), kind)
        if job.rank == 0:
            print(job.describe(), flush=True)
        summary = job.run()
        if job.rank == 0:
            speed = summary["run"]["generation_tokens_per_s"]
            shown = [f"{k} {_shown(v)}" for k, v in summary.items() if _headline(k)]
            print(" | ".join([*shown, f"generated {_shown(speed)} tokens/s"]), flush=True)
            print(f"wrote {job.files.summary}" + (f" and {job.files.chat}" if job.files.chat else ""), flush=True)
    except UserError as err:
        return report_user_error(err)
    return 0


def _headline(key: str) -> bool:
    return key.startswith(("pass@", "cons@")) or key in (
        "mean_reward", "mean_length", "truncated_share", "written", "acceptance_rate", "prompts",
    )  # fmt: skip


def _shown(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
