"""Memory planner: will a model train under ZeRO 1/2/3 on these cards? Reads only the config (meta device).

``python -m deepzero.plan --model deepseek-coder-1.3b --gpus 3 --gpu-mem 24 --cpu-mem 128 --seq-len 2048``
prints per-card GPU memory (parameters, gradients, optimizer, activations, logits, buffers) and host RAM for
every ZeRO stage / offload / checkpointing / LoRA combination, marks what fits, and recommends a ds_configs
preset with the largest micro-batch that fits. Formulas and sources: docs/memory.md.

This module is that command line (its first docstring line is ``--help``'s description); the planner itself is
the package's other modules (``deepzero.plan``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from deepzero.errors import UserError
from deepzero.modeling import planning_config
from deepzero.plan.arch import model_stats
from deepzero.plan.evaluation import DTYPES, render_evaluation
from deepzero.plan.setup import GrpoTerms, SaverTerms
from deepzero.plan.tables import LORA_RANK, fit_table, render, render_grpo, render_longest
from deepzero.presets import PRESETS

PAIR_ROWS = 2
"""Sequences per preference pair (chosen and rejected), as train.py's PreferenceDataset reads them."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepzero.plan", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="preset name, local folder with config.json, or hub id")
    parser.add_argument("--fit-table", action="store_true", help="README table: the recommendation for every preset")
    parser.add_argument("--gpus", type=int, default=3, help="data-parallel ranks (cards)")
    parser.add_argument("--gpu-mem", type=float, default=24.0, help="GiB per card (an RTX 4090 has 24)")
    parser.add_argument("--cpu-mem", type=float, default=128.0, help="host RAM in GiB, whole machine")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=1,
        help="micro-batch the table is computed for (--preference: pairs; --grpo: completions, as train.py counts)",
    )
    parser.add_argument("--lora-rank", type=int, default=LORA_RANK, help="rank for the LoRA rows")
    parser.add_argument("--tiled-loss", choices=("on", "off"), default="on", help="as train.py: the LM loss in tiles")
    parser.add_argument(
        "--activation-offload", action="store_true", help="as train.py: checkpointed hidden states in host memory"
    )
    parser.add_argument("--tiled-mlp", choices=("on", "off"), default="off", help="as train.py: MLPs in sequence tiles")
    parser.add_argument(
        "--max-seq-len", action="store_true", help="the longest sequence of every preset and saver choice (micro 1)"
    )
    parser.add_argument(
        "--preference",
        action="store_true",
        help="preference pairs (DPO): --micro-batch pairs = 2 sequences each, log-probs tiled like the LM loss,"
        " no reference model (its log-probs precomputed, or LoRA's adapters off)",
    )
    parser.add_argument(
        "--grpo",
        action="store_true",
        help="GRPO: the longest completion each preset generates and trains, full and LoRA (KV cache of"
        " --num-generations × (--prompt-len + completion) tokens while generating)",
    )
    parser.add_argument("--num-generations", type=int, default=8, help="--grpo: completions per prompt (G)")
    parser.add_argument("--prompt-len", type=int, default=512, help="--grpo, --evaluate: the longest prompt, in tokens")
    parser.add_argument(
        "--generation-batch-size",
        type=int,
        default=None,
        help="--grpo: completion rows generated together in the longest-completion search (default: one group, G)",
    )
    parser.add_argument(
        "--completion-len",
        type=int,
        default=1024,
        help="--grpo, --evaluate: the completion length at which to plan the most rows one generate call takes"
        " (default 1024)",
    )
    parser.add_argument(
        "--evaluate",
        action="store_true",
        help="evaluation / sampling (evaluate.py, sample.py; no training): a whole copy of the model per card or its"
        " layers split over the cards, in 16 bits or NF4, and the most rows one generate call takes at --prompt-len"
        " + --completion-len tokens",
    )
    parser.add_argument(
        "--samples", type=int, default=None, help="--evaluate: samples per prompt (k), for prompts per call"
    )
    parser.add_argument("--max-rows", type=int, default=512, help="--evaluate: the most rows per generate call to plan")
    parser.add_argument(
        "--dtype", choices=tuple(DTYPES), default="bf16", help="--evaluate: the weights' dtype (NF4's compute dtype)"
    )
    args = parser.parse_args(argv)
    if args.preference and args.max_seq_len:
        print(
            "error: --max-seq-len: plans one sequence per micro-batch and sequence parallelism, which preference"
            " pairs do not use. Fix: drop --preference, or plan one length with --preference --seq-len N",
            file=sys.stderr,
        )
        return 2
    counts = [("--gpus", args.gpus), ("--seq-len", args.seq_len), ("--micro-batch", args.micro_batch)]
    counts += [("--num-generations", args.num_generations), ("--prompt-len", args.prompt_len)]
    counts += [("--generation-batch-size", args.generation_batch_size or 1), ("--completion-len", args.completion_len)]
    counts += [("--samples", 1 if args.samples is None else args.samples), ("--max-rows", args.max_rows)]
    for flag, value in counts:
        if value < 1:
            print(f"error: {flag} {value}: must be at least 1. Fix: pass a positive number", file=sys.stderr)
            return 2
    modes = (("--fit-table", args.fit_table), ("--grpo", args.grpo), ("--max-seq-len", args.max_seq_len))
    other = [flag for flag, on in (*modes, ("--preference", args.preference)) if on]
    if args.evaluate and other:
        print(f"error: --evaluate with {other[0]}: plans generation only. Fix: drop one of them", file=sys.stderr)
        return 2
    if args.fit_table:
        print(fit_table(args.gpus, args.gpu_mem, args.cpu_mem, args.seq_len, args.lora_rank))
        return 0
    if args.model is None:
        print("error: --model: missing. Fix: pass --model NAME (or --fit-table)", file=sys.stderr)
        return 2
    try:
        name, config = planning_config(args.model)
        stats = model_stats(config, name)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.evaluate:
        lengths = (args.prompt_len, args.completion_len)
        print(render_evaluation(stats, args.gpus, args.gpu_mem, *lengths, args.max_rows, args.dtype, args.samples))
        return 0
    pretrained = not (args.model in PRESETS and PRESETS[args.model].hub_id is None)
    if args.grpo:
        grpo = GrpoTerms(args.num_generations, args.prompt_len, rows=args.generation_batch_size)
        kw = {"completion": args.completion_len, "micro_batch": args.micro_batch}
        print(render_grpo(stats, args.gpus, args.gpu_mem, args.cpu_mem, grpo, args.lora_rank, **kw))
        return 0
    if args.max_seq_len:
        kw = {"pretrained": pretrained, "tiled_loss": args.tiled_loss == "on"}
        print(render_longest(stats, args.gpus, args.gpu_mem, args.cpu_mem, args.lora_rank, **kw))
        return 0
    savers = SaverTerms.choose(stats.arch, args.tiled_loss == "on", args.activation_offload, args.tiled_mlp == "on")
    rows = args.micro_batch * (PAIR_ROWS if args.preference else 1)
    print(
        render(
            stats,
            args.gpus,
            args.gpu_mem,
            args.cpu_mem,
            args.seq_len,
            micro_batch=rows,
            lora_rank=args.lora_rank,
            pretrained=pretrained,
            savers=savers,
            pair_rows=PAIR_ROWS if args.preference else 1,
        )
    )
    if args.preference:
        print(
            f"Preference pairs: micro-batch {args.micro_batch} pair{'s' * (args.micro_batch != 1)} = {rows}"
            " sequences (chosen and rejected), so"
            f" every micro-batch and 'max mb' above counts sequences: pairs = sequences / {PAIR_ROWS}. The log-probs"
            " are tiled over the LM head like the LM loss (--tiled-loss). No reference model is on the cards: its"
            " log-probs are"
            " precomputed in one pass before training (one eval forward at a time), or it is the same model with"
            " its LoRA adapters off (a no-grad forward)."
        )
    return 0
