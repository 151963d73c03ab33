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
from deepzero.rollout.benchmarks import Benchmark, benchmark, benchmark_rewards, prepare_benchmark
from deepzero.rollout.generation import EVAL_GENERATION, GroupSeeds, HFGenerate, eos_ids, truncated
from deepzero.rollout.job_args import CPU_PROMPTS_PER_CALL, JobArgs, parse_job_args
from deepzero.rollout.judge import Judge
from deepzero.rollout.layout import choose_layout, job_precision, load_model
from deepzero.rollout.rewards import RewardSet, parse_rewards
from deepzero.rollout.scores import Condition, headline, per_sample, scored_nothing, shown, summarise


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
            if saved.get(key) == value:
                continue
            was = saved.get(key)
            if key == "batch_layout" and isinstance(was, dict):
                ranks = f"on {was['ranks']} rank(s) " if "ranks" in was else ""
                fix = f"run {ranks}with --prompts-per-call {was['prompts_per_call']}, or another --out"
                why = "in 16 bits a sample depends on the rows batched with it"
            else:
                fix, why = f"pass the same --{key.replace('_', '-')}, or another --out", "the samples would differ"
            raise UserError(f"--resume ({self.settings})", f"{key} was {was!r}, now {value!r}: {why}", fix)
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
        bench = benchmark(args.benchmark) if args.benchmark else None
        split = "val" if bench else args.split
        self.data = PromptDataset(self.benchmark_data(bench) if bench else args.data, split)
        self.completion_len = args.max_completion_length or self.data.max_completion_length
        if bench is not None:
            self.rewards: RewardSet = benchmark_rewards(bench, args.sandbox, args.reward_timeout)
        else:
            self.rewards = parse_rewards(
                args.reward, self.completion_len, sandbox=args.sandbox, timeout_s=args.reward_timeout
            )
            self.rewards.check_fields(self.data.meta.get("record_fields", []), args.data)
        self.judge = Judge.of(self.rewards, args.correct, bench.voter() if bench else None)
        self.correct = self.judge.correct
        self.keep = Condition.parse(args.keep, self.rewards.names, "--keep") if kind == "sample" else None
        count = min(len(self.data), args.limit or len(self.data))
        if count == 0:
            raise UserError(args.data, f"has no {split} prompts", "prepare with --val-fraction, or pass --split")
        self.layout = choose_layout(args, self.data.max_prompt_len, self.completion_len)
        rows = self.layout.rows
        if self.layout.name.startswith("placement") and self.world > 1:
            raise UserError(
                f"--layout {self.layout.name}",
                f"one copy of the model spans every card ({self.layout.reason}), so one process drives them",
                f"run python {kind}.py with the same flags, without the deepspeed launcher",
            )
        # a call's prompts: the planner's rows // k on a card (its rows per generate call cap the sampler either way)
        self.per_call = args.prompts_per_call or (max(1, rows // args.samples) if rows else CPU_PROMPTS_PER_CALL)
        self.precision = job_precision(args)

        def start() -> tuple[set[int], str | None]:  # one rank reads and writes the job's files
            try:
                return self.files.start(self.settings(), args.resume), None
            except UserError as err:
                return set(), str(err)

        done, error = rank0_decides(start)
        if error:
            raise RaisedElsewhere(error)
        self.todo = [i for i in range(count) if i not in done]
        self.count = count
        self.tokenizer, self.model = load_model(
            args, self.data.meta, self.layout.name, rows or 1, self.data.max_prompt_len + self.completion_len
        )
        self.prompt_room = self.room_for_prompts()
        self.sampler = HFGenerate(
            self.completion_len, eos_ids(self.tokenizer, self.model), self.data.pad_id, args.temperature or 1.0,
            args.top_p, rows, args.top_k, args.min_p, args.repetition_penalty, generation_kwargs(args.generation_kwargs),
        )  # fmt: skip
        self.seeds = GroupSeeds(args.seed)
        self.generated, self.generation_s = 0, 0.0
        """This invocation's completion tokens and seconds generating them, on this rank."""

    def settings(self) -> dict[str, Any]:
        """The flags that make the samples and verdicts (``JobArgs.settings``), the weights' dtype (and NF4), and in
        16 bits the batch layout: there a sample depends on the rows batched with it (docs/evaluate.md)."""
        weights = self.precision + ("+nf4" if self.layout.name.endswith("4bit") else "")
        layout = None
        if self.precision != "fp32":  # one prompt a call batches the same rows on any number of ranks
            layout = {"layout": self.layout.name, "rows_per_call": self.layout.rows, "prompts_per_call": self.per_call}
            layout |= {"ranks": self.world} if self.per_call > 1 else {}
        return self.args.settings() | {"dtype": weights, "batch_layout": layout}

    def benchmark_data(self, bench: Benchmark) -> Path:
        """``--benchmark``'s records as lighteval's prompts in a prompts folder beside the job's files (rank 0
        prepares it, the others wait; kept on --resume)."""
        a = self.args
        folder = self.files.settings.with_name(self.files.settings.name.replace("job.json", "benchmark"))

        def build() -> str | None:
            try:
                prepare_benchmark(bench, a.data, a.tokenizer or a.model, a.max_completion_length, folder)
            except UserError as err:
                return str(err)
            return None

        if error := rank0_decides(build):
            raise RaisedElsewhere(error)
        return folder / "data"

    def room_for_prompts(self) -> int | None:
        """The most prompt tokens the model's context leaves beside the completion (None: no stated context): a
        longer prompt is cut from the left, as lighteval does, and counted."""
        context = getattr(self.model.config, "max_position_embeddings", None)
        if context is None:
            return None
        if self.completion_len >= context:
            raise UserError(
                f"--max-completion-length {self.completion_len}",
                f"leaves no room for a prompt in the model's {context}-token context",
                f"pass a smaller --max-completion-length (at most {context - 1})",
            )
        return context - self.completion_len

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
        a = self.args
        if error := rank0_decides(lambda: str(e) if (e := scored_nothing(summary, a.benchmark, a.reward)) else None):
            raise RaisedElsewhere(error)
        return summary

    def lines_of(self, indices: list[int]) -> list[dict[str, Any]]:
        """The lines of ``indices``: k samples each, their rewards, answers and lengths."""
        if not indices:
            return []
        k, device = self.args.samples, self.model.get_input_embeddings().weight.device
        prompts = {i: self.data[i]["prompt_ids"] for i in indices}
        cut = {i: max(0, len(p) - self.prompt_room) if self.prompt_room else 0 for i, p in prompts.items()}
        rows = [prompts[i][cut[i] :].to(device) for i in indices for _ in range(k)]
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
        at_limit = [truncated(c, self.sampler.eos_ids) for c in completions]
        lines = self.judge.lines(self.data, indices, k, texts, completions, at_limit)
        return [line | {"prompt_cut": cut[line["index"]]} if cut[line["index"]] else line for line in lines]

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
        summary |= {**self.settings(), "correct": str(self.correct), "run": figures}
        if self.args.benchmark and benchmark(self.args.benchmark).scoring in ("math", "letters"):
            from deepzero.rollout.lighteval_verdicts import verdicts_by

            summary["verdicts"] = verdicts_by()
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
    only those that ended (a completion cut at the length limit passing ``keep`` is dropped and counted), identical
    completions once, up to ``per_prompt`` a prompt, written as the lines stream in; returns the acceptance figures
    (overall, and how many prompts had 0, 1, ... passing samples)."""
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
                if line["truncated"][j]:  # cut at the length limit: it would teach stopping mid-thought
                    counts["cut"] += 1
                    continue
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
        "cut_dropped": counts["cut"],
        "duplicates_dropped": counts["duplicates"],
        "prompts_with_none_kept": counts["none"],
        "prompts_by_passing_samples": {str(k): passing[k] for k in sorted(passing)},
        "chat_file": str(path),
    }


def _messages(prompt: Any) -> list[dict[str, str]]:
    return list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]


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
            print(f"{headline(summary)} | generated {shown(speed)} tokens/s", flush=True)
            print(f"wrote {job.files.summary}" + (f" and {job.files.chat}" if job.files.chat else ""), flush=True)
    except UserError as err:
        return report_user_error(err)
    return 0
