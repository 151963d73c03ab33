"""evaluate.py's and sample.py's flags (``JobArgs``), parsed and checked once; every problem is one line."""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from deepzero.args import _help, generation_kwargs, recipe_argv
from deepzero.errors import UserError
from deepzero.rollout.generation import PROTOCOLS

R1_MAX_LENGTH = 32768
"""DeepSeek-R1's maximum generation length on its benchmarks (lighteval's ``generation_size`` for them)."""

CPU_PROMPTS_PER_CALL = 8
"""Prompts a CPU rank generates together unless --prompts-per-call says otherwise."""


@dataclass
class JobArgs:
    """evaluate.py's and sample.py's flags (sample.py adds ``--keep`` and ``--per-prompt``)."""

    model: str = field(metadata={"help": "A pretrained folder (save_pretrained) or hub id."})
    out: str = field(metadata={"help": "evaluate: a folder; sample: the chat JSONL file to write."})
    config: str | None = field(
        default=None,
        **_help(
            "A recipe: a YAML or JSON mapping of these flags (recipes/*-evaluate-*.yaml; keys as the flags, - or _);"
            " flags given on the command line override it, unknown keys are refused (as train.py's --config)."
        ),
    )
    data: str | None = field(
        default=None,
        **_help(
            "A folder from data/prepare.py --format prompts; with --benchmark its records in the Hub layout (a"
            " .jsonl/.parquet copy or hf:NAME), default the benchmark's Hub id."
        ),
    )
    benchmark: str | None = field(
        default=None,
        **_help(
            "aime24, aime25, math500, gpqa_diamond, humaneval or lcb: lighteval's prompt, gold and scoring (no --reward); completions"
            f" up to {R1_MAX_LENGTH} tokens unless --max-completion-length (docs/evaluate.md)."
        ),
    )
    reward: list[str] = field(
        default_factory=list, **_help("Reward NAME[:WEIGHT] or file.py:function, repeatable (as train.py's).")
    )
    reward_timeout: float = field(default=600.0, **_help("Seconds a reward call may take (0: no limit)."))
    sandbox: Literal["bwrap", "rlimits"] = field(
        default="bwrap", **_help("Code rewards: bwrap (namespaces) or rlimits (weaker: docs/code.md).")
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
        if self.benchmark is not None:
            from deepzero.rollout.benchmarks import benchmark

            bench = benchmark(self.benchmark)
            if self.reward:
                raise UserError(
                    f"--benchmark {self.benchmark}",
                    "scores as lighteval does: --reward does not apply",
                    "drop --reward",
                )
            self.data = self.data or bench.hub
            self.max_completion_length = self.max_completion_length or R1_MAX_LENGTH
        elif not self.data:
            raise UserError("--data", "is required without --benchmark", "pass a --format prompts folder")
        elif not self.reward:
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
        if not (math.isfinite(self.reward_timeout) and self.reward_timeout >= 0):
            raise UserError(
                "--reward-timeout", f"must be 0 (no limit) or more seconds, got {self.reward_timeout}", "pass e.g. 600"
            )
        if self.per_prompt < 1:
            raise UserError("--per-prompt", f"must be 1 or more, got {self.per_prompt}", "pass e.g. 2")
        generation_kwargs(self.generation_kwargs)

    def settings(self) -> dict[str, Any]:
        """What makes the samples and their verdicts what they are: a resumed job must have the same (with the
        resolved dtype and, in 16 bits, the batch layout: ``Job``)."""
        keys = ("model", "data", "benchmark", "split", "limit", "reward", "correct", "protocol", "samples")
        keys += ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "generation_kwargs")
        keys += ("max_completion_length", "seed", "tokenizer", "sandbox")
        return {k: v for k, v in asdict(self).items() if k in keys}


def parse_job_args(argv: list[str] | None, program: str) -> JobArgs:
    """The command line as :class:`JobArgs`; every problem is one line naming the flag."""
    from transformers import HfArgumentParser

    argv = list(sys.argv[1:] if argv is None else argv)
    argv = [*recipe_argv(argv, JobArgs, program), *argv]  # the recipe's values first: the command line's win
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
