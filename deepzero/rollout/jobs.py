"""The evaluation and rejection-sampling jobs (``evaluate.py``, ``sample.py``): k samples of every prompt of a
``--format prompts`` folder, scored by the ``--reward`` functions, one JSON line per prompt.

Each rank takes every ``world``-th prompt not yet done and generates its rows with GRPO's sampler (all of a
call's rows batched, each row its own stream seeded by ``(seed, prompt index, sample)``: the same samples on any
world size, in any batch, after a resume). After each call the ranks' lines go to rank 0, which appends them to
``samples.jsonl``; ``--resume`` skips the prompts already there. At the end rank 0 writes ``summary.json``
(``deepzero.rollout.scores``), and ``sample.py`` the chat SFT JSONL of the kept completions.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from deepzero import modeling
from deepzero.args import _help, generation_kwargs
from deepzero.checkpoint import write_atomic
from deepzero.distributed import init_distributed, on_cuda
from deepzero.errors import RaisedElsewhere, UserError, first_line
from deepzero.plan.arch import model_stats
from deepzero.rollout.generation import EVAL_GENERATION, PROTOCOLS, GroupSeeds, HFGenerate, eos_ids
from deepzero.rollout.rewards import RewardContext, RewardSet, parse_rewards
from deepzero.rollout.scores import Condition, summarise

CPU_PROMPTS_PER_CALL = 8
MOST_ROWS = 512
"""The most rows the planner gives one generate call."""


@dataclass
class JobArgs:
    """evaluate.py's and sample.py's flags (sample.py adds ``--keep`` and ``--per-prompt``)."""

    model: str = field(metadata={"help": "A pretrained folder (save_pretrained) or hub id."})
    data: str = field(metadata={"help": "A folder from data/prepare.py --format prompts."})
    out: str = field(metadata={"help": "evaluate: a folder; sample: the chat JSONL file to write."})
    reward: list[str] = field(
        default_factory=list, **_help("Reward NAME[:WEIGHT] or file.py:function, repeatable (as train.py's).")
    )
    samples: int | None = field(default=None, **_help("Samples per prompt (k). Default 8, 1 for --protocol greedy."))
    protocol: Literal["r1", "greedy"] = field(
        default="r1", **_help("r1: temperature 0.6, top-p 0.95 (DeepSeek-R1's pass@1); greedy: temperature 0.")
    )
    temperature: float | None = field(default=None, **_help("Overrides the protocol's; 0 is greedy."))
    top_p: float | None = field(default=None, **_help("Overrides the protocol's."))
    top_k: int = field(default=0, **_help("Sample among the k most likely tokens (0: off)."))
    min_p: float | None = field(default=None, **_help("Min-p sampling threshold (off by default)."))
    repetition_penalty: float = field(default=1.0, **_help("1.0: none."))
    generation_kwargs: str | None = field(default=None, **_help("More generate() keywords, a JSON object."))
    max_completion_length: int | None = field(default=None, **_help("Default: the data's (meta.json)."))
    split: Literal["val", "train"] = field(default="val", **_help("Which split's prompts."))
    limit: int | None = field(default=None, **_help("Only the first N prompts of the split."))
    pass_k: list[int] = field(default_factory=list, **_help("The k's of pass@k. Default: 1, 2, 4, ... and --samples."))
    correct: str | None = field(
        default=None, **_help("When a sample is correct, NAME OP NUMBER. Default: the first reward >= 1.")
    )
    seed: int = field(default=0, **_help("Sampling seed: a prompt's samples depend on it and the prompt's index."))
    prompts_per_call: int | None = field(
        default=None, **_help(f"Prompts a rank generates together (k rows each). Default {CPU_PROMPTS_PER_CALL}.")
    )
    layout: Literal["auto", "data-parallel", "placement", "placement-4bit", "data-parallel-4bit"] = field(
        default="auto",
        **_help(
            "auto: the planner's choice on CUDA (python -m deepzero.plan --evaluate), a whole copy per rank on the"
            " CPU; data-parallel: a whole copy per rank; placement: one copy's layers over every card (one process);"
            " the -4bit ones load the base in NF4."
        ),
    )
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = field(
        default="auto", **_help("Weights' dtype: auto is bf16 on CUDA, fp32 on the CPU.")
    )
    tokenizer: str | None = field(default=None, **_help("Default: the one the data was prepared with."))
    allow_tokenizer_change: bool = field(default=False, **_help("Data prepared with another tokenizer is refused."))
    trust_remote_code: bool = field(default=False, **_help("Run the model repo's own code."))
    resume: bool = field(default=False, **_help("Continue a stopped job: the prompts already written are skipped."))
    keep: str = field(default="reward>=1", **_help("sample.py: which samples to keep, NAME OP NUMBER."))
    per_prompt: int = field(default=1, **_help("sample.py: at most this many kept completions per prompt."))
    local_rank: int = field(default=-1, **_help("Set by the deepspeed launcher."))

    def check(self) -> None:
        """Fill the protocol's values; one line for a bad combination."""
        protocol = PROTOCOLS[self.protocol]
        self.temperature = protocol["temperature"] if self.temperature is None else self.temperature
        self.top_p = protocol.get("top_p", 1.0) if self.top_p is None else self.top_p
        self.samples = (1 if self.temperature == 0 else 8) if self.samples is None else self.samples
        if not self.reward:
            raise UserError("--reward", "no reward given: samples cannot be judged", "pass e.g. --reward accuracy")
        if self.samples < 1:
            raise UserError("--samples", f"must be 1 or more, got {self.samples}", "pass e.g. 8")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise UserError("--temperature", f"must be 0 (greedy) or more, got {self.temperature}", "pass e.g. 0.6")
        if self.temperature == 0 and self.samples > 1:
            raise UserError(
                "--temperature 0", f"greedy decoding gives {self.samples} identical samples", "pass --samples 1"
            )
        if not 0 < self.top_p <= 1:
            raise UserError("--top-p", f"must be in (0, 1], got {self.top_p}", "pass e.g. 0.95")
        powers = [2**i for i in range(self.samples.bit_length())]
        self.pass_k = self.pass_k or sorted({*powers, self.samples})
        if bad := [k for k in self.pass_k if not 1 <= k <= self.samples]:
            raise UserError("--pass-k", f"{bad[0]} is not in 1..{self.samples} (--samples)", "pass k's up to --samples")
        for name, value in (("--prompts-per-call", self.prompts_per_call), ("--limit", self.limit)):
            if value is not None and value < 1:
                raise UserError(name, f"must be 1 or more, got {value}", "pass a positive number")
        if self.per_prompt < 1:
            raise UserError("--per-prompt", f"must be 1 or more, got {self.per_prompt}", "pass e.g. 2")
        generation_kwargs(self.generation_kwargs)

    def settings(self) -> dict[str, Any]:
        """What makes the samples what they are: a resumed job must have the same."""
        keys = ("model", "data", "split", "limit", "reward", "samples", "temperature", "top_p", "top_k", "min_p")
        keys += ("repetition_penalty", "generation_kwargs", "max_completion_length", "seed")
        return {k: v for k, v in asdict(self).items() if k in keys}


def parse_job_args(argv: list[str] | None, program: str) -> JobArgs:
    """The command line as :class:`JobArgs`; every problem is one line naming the flag."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser(JobArgs, prog=program)

    def error(message: str) -> None:
        raise UserError(program, message, f"see python {program} --help")

    parser.error = error
    for action in parser._actions:
        if action.dest in ("reward", "pass_k"):
            action.__class__ = argparse._ExtendAction
    args, rest = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if rest:
        raise UserError(program, f"unknown argument {' '.join(rest)}", f"see python {program} --help")
    args.check()
    return args


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
        self.correct = Condition.parse(args.correct or f"{self.rewards.names[0]}>=1", self.rewards.names, "--correct")
        self.keep = Condition.parse(args.keep, self.rewards.names, "--keep") if kind == "sample" else None
        count = min(len(self.data), args.limit or len(self.data))
        if count == 0:
            raise UserError(args.data, f"has no {args.split} prompts", "prepare with --val-fraction, or pass --split")
        done, error = set(), None
        if self.rank == 0:  # one rank reads and writes the job's files; the others learn what it found
            try:
                done = self.files.start(args.settings(), args.resume)
            except UserError as err:
                error = str(err)
        done, error = _from_rank0((done, error))
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
        self.tokenizer, self.model = load_model(args, self.data.meta, self.layout.name, rows or 1)
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
            everyone = [(lines, error)]
            if self.world > 1:
                everyone = [None] * self.world
                dist.all_gather_object(everyone, (lines, error))
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
        records = [self.data.record(i) for i in indices for _ in range(k)]
        rendered = [self.data.prompt_text(i) for i in indices for _ in range(k)]
        raw = [self.data.prompt(i) for i in indices for _ in range(k)]
        context = RewardContext()
        total, per_name = self.rewards.score(
            rendered, texts, completions, records, [i for i in indices for _ in range(k)], raw, context
        )
        answers = (context.extra.get("answer_parsed") or [None] * len(texts))[: len(texts)]
        out = []
        for n, index in enumerate(indices):
            rows_ = range(n * k, (n + 1) * k)
            scores = {name: [_number(v[r]) for r in rows_] for name, v in per_name.items()}
            rewards = [_number(total[r]) for r in rows_]
            each = [{"reward": rewards[j]} | {name: s[j] for name, s in scores.items()} for j in range(k)]
            out.append(
                {
                    "index": index,
                    "prompt": raw[n * k],
                    "completions": [texts[r] for r in rows_],
                    "rewards": rewards,
                    "scores": scores,
                    "answers": [None if answers[r] is None else str(answers[r]) for r in rows_],
                    "correct": [None if e[self.correct.name] is None else self.correct(e) for e in each],
                    "lengths": [len(completions[r]) for r in rows_],
                    "truncated": [self.sampler_cut(completions[r]) for r in rows_],
                }
            )
        return out

    def sampler_cut(self, completion: list[int]) -> bool:
        """Cut at the length limit: it does not end in an end-of-sequence token."""
        return not completion or completion[-1] not in self.sampler.eos_ids

    def run_figures(self) -> dict[str, Any]:
        """This invocation's layout and speed over every rank (a collective): completion tokens per second (all
        ranks' tokens over the slowest rank's generating time) and, on CUDA, the fullest card's peak against the
        planner's."""
        sums = torch.tensor([float(self.generated), self.generation_s], dtype=torch.float64)
        peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if on_cuda() else 0.0], dtype=torch.float64)
        if self.world > 1:
            tokens, seconds = sums.clone(), sums.clone()
            dist.all_reduce(tokens)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            sums = torch.stack([tokens[0], seconds[1]])
        figures = {"layout": self.layout.name, "why": self.layout.reason, "ranks": self.world}
        figures |= {"prompts_per_call": self.per_call, "rows_per_call": self.layout.rows}
        figures["generation_tokens_per_s"] = sums[0].item() / sums[1].item() if sums[1] > 0 else None
        if on_cuda():
            figures["peak_gpu_mem_gib"] = peak.item()
            planned = self.layout.planned_bytes
            figures["planned_gpu_mem_gib"] = planned / 2**30 if planned is not None else None
        return figures

    def finish(self, figures: dict[str, Any]) -> dict[str, Any]:
        """Rank 0: summary.json from every line (and sample.py's chat JSONL), with this invocation's ``figures``
        under ``run``; returns the summary."""
        lines = sorted(self.files.lines(), key=lambda x: x["index"])
        summary = summarise(lines, self.args.pass_k) | {"correct": str(self.correct), **self.args.settings()}
        summary["run"] = figures
        if self.keep is not None:
            summary |= write_chat(lines, self.keep, self.args.per_prompt, self.files.chat)
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


def write_chat(lines: list[dict[str, Any]], keep: Condition, per_prompt: int, path: Path | None) -> dict[str, Any]:
    """The kept completions as chat SFT records (the prompt's messages, then the completion as the assistant turn),
    identical completions once, up to ``per_prompt`` a prompt; returns the acceptance figures (overall, and how many
    prompts had 0, 1, ... passing samples)."""
    assert path is not None
    written, passed, duplicates, none = 0, 0, 0, 0
    records = []
    passing: Counter[int] = Counter()  # prompts by their number of passing samples
    for line in lines:
        seen: set[str] = set()
        kept = 0
        each = [
            {"reward": r} | {name: s[j] for name, s in line["scores"].items()} for j, r in enumerate(line["rewards"])
        ]
        passing[sum(keep(scores) for scores in each)] += 1
        for j, text in enumerate(line["completions"]):
            if not keep(each[j]):
                continue
            passed += 1
            if text in seen:
                duplicates += 1
                continue
            seen.add(text)
            if kept < per_prompt:
                records.append({"messages": [*_messages(line["prompt"]), {"role": "assistant", "content": text}]})
                kept += 1
        written += kept
        none += kept == 0
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    total = sum(len(line["completions"]) for line in lines)
    return {
        "keep": str(keep),
        "written": written,
        "acceptance_rate": passed / total if total else None,
        "duplicates_dropped": duplicates,
        "prompts_with_none_kept": none,
        "prompts_by_passing_samples": {str(k): passing[k] for k in sorted(passing)},
        "chat_file": str(path),
    }


def _messages(prompt: Any) -> list[dict[str, str]]:
    return list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]


@dataclass(frozen=True)
class Layout:
    """How the job holds the model (``JobArgs.layout``'s choices but auto), and why."""

    name: str
    rows: int | None
    """The planner's rows per generate call on a card (None: the CPU's default, or a flag's layout)."""
    reason: str
    planned_bytes: int | None = None
    """The planner's fullest card, as ``torch.cuda.max_memory_allocated`` counts it."""


def choose_layout(args: JobArgs, prompt_len: int, completion_len: int) -> Layout:
    """The flag's layout, else on CUDA the planner's for the visible cards (``deepzero.plan.evaluation``), else a
    whole copy per CPU rank."""
    if args.layout != "auto":
        return Layout(args.layout, None, "--layout")
    if not on_cuda():
        return Layout("data-parallel", None, "CPU ranks: a whole copy each")
    from deepzero.plan.evaluation import DOES_NOT_FIT, plan_evaluation

    cards = torch.cuda.device_count()
    gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    plan = plan_evaluation(args.model, cards, gib, prompt_len, completion_len, most_rows=MOST_ROWS)
    if plan.mode == DOES_NOT_FIT:
        raise UserError(f"--model {args.model}", plan.reason, "use more or larger cards, or a shorter completion")
    return Layout(plan.mode, plan.rows_per_call, plan.reason, plan.allocated_bytes)


def load_model(args: JobArgs, meta: dict[str, Any], layout: str, rows: int) -> tuple[Any, torch.nn.Module]:
    """The tokenizer (the data's, checked against the model's own) and the pretrained model in eval mode: a copy on
    this rank's device, or its layers over every card (``deepzero.placement``, each layer's reserve its KV cache of
    ``rows`` rows; on the CPU three "cpu" cards), the base in NF4 for the -4bit layouts (accelerate's map, each
    card's budget less its KV cache and working set)."""
    from deepzero.run import check_data_tokenizer, plan_tokenizer

    source = modeling.resolve_model(args.model)
    if source.random_init:
        raise UserError(f"--model {args.model}", "is a random-init preset: nothing to evaluate", "pass a trained model")
    tokenizer = plan_tokenizer(args, meta)
    check_data_tokenizer(args, meta, source)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(args.dtype)
    dtype = dtype or (torch.bfloat16 if on_cuda() else torch.float32)
    config = modeling.load_config(source, args.trust_remote_code)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if on_cuda() else torch.device("cpu")
    quant = None
    if layout.endswith("4bit"):
        from deepzero.adapters.quant import FourBit

        compute = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
        quant = FourBit(compute, "uint8").bnb_config()
    if layout == "placement-4bit":  # accelerate's map, each card's budget less its share of the KV cache
        model = modeling.build_model(
            source, config, dtype=dtype, trust_remote_code=args.trust_remote_code, quantization_config=quant,
            device_map="auto", max_memory=_weights_budget(args, meta, config, rows),
        )  # fmt: skip
        return tokenizer, model.eval()
    model = modeling.build_model(
        source, config, dtype=dtype, trust_remote_code=args.trust_remote_code, quantization_config=quant,
        device_map={"": device} if quant is not None else None,
    )  # fmt: skip
    if layout == "placement":
        from deepzero.placement import apply_placement, plan_placement
        from deepzero.plan.generation import kv_layer_bytes

        cards = list(range(torch.cuda.device_count())) if on_cuda() else ["cpu"] * 3
        tokens = meta["max_prompt_len"] + (args.max_completion_length or meta["max_completion_length"])
        reserve = kv_layer_bytes(model_stats(config, args.model), rows, tokens, dtype.itemsize)
        apply_placement(model, plan_placement(config, cards, dtype=dtype, reserve_per_layer_bytes=reserve))
        return tokenizer, model.eval()
    return tokenizer, (model if quant is not None else model.to(device)).eval()


def _weights_budget(args: JobArgs, meta: dict[str, Any], config: Any, rows: int) -> dict[int, int]:
    """Per card: its memory less the planner's KV cache, working set and logits of ``rows`` rows there, and 1 GiB
    of CUDA context."""
    from deepzero.plan.evaluation import card_bytes

    cards = torch.cuda.device_count()
    total = torch.cuda.get_device_properties(0).total_memory
    completion = args.max_completion_length or meta["max_completion_length"]
    held = card_bytes(model_stats(config, args.model), cards, rows, meta["max_prompt_len"], completion, four_bit=True)
    return {k: total - (c.kv_cache + c.working + c.logits) - 2**30 for k, c in enumerate(held)}


def _from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _number(x: torch.Tensor) -> float | None:
    value = float(x)
    return None if math.isnan(value) else value


def _progress(todo: int, count: int, rank: int) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=count, initial=count - todo, unit="prompt", disable=rank != 0 or not sys.stderr.isatty(), file=sys.stderr
    )


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
