"""GRPO's rollout: the generation backends' tokens/s and where a GRPO step's time goes (docs/grpo.md).

    python -m bench.grpo_rollout              # make train's export (runs/default/hf: `make train` first)
    python -m bench.grpo_rollout --repeats 3  # fewer interleaved repetitions

The model is `make train`'s export; the prompts are the GRPO example's (data/grpo_example.py: the standard
library's ``def`` lines, uneven lengths), prepared with its tokenizer. Four parts:

1. Generation in this process, one thread, 8 prompts × G 4, 32 new tokens, sampling at temperature 1: one
   ``generate`` call per group (deepzero before batching), one call of the 32 rows with Transformers' own sampling
   (the bare batched call), deepzero's ``HFGenerate`` (one call, each row its own stream: what train.py runs), and
   Transformers' continuous batching (``generate_batch``). The four are interleaved ``--repeats`` times; completion
   tokens (cut at the end-of-sequence token) per second, median and range.
2. train.py on 1 rank, the same shape (micro 32 = 8 prompts × G 4, 32-token completions), 4 steps: its
   ``generation/tokens_per_s`` on the generation steps after the first, against part 1's bare batched call.
3. train.py on 3 ranks, G 8, 4 prompts per rank (micro 8 × accumulation 4), 64-token completions, 4 steps: the
   step's phase split (``timing/*``, mean of steps 2-4).
4. The planner's rows per generate call for R1-Distill-Qwen-1.5B and 7B on 3 × 24 GiB (LoRA r16, 512-token prompts,
   1,024-token completions).

Writes ``bench/results/grpo_rollout.{json,md}``. Ratios come from one machine in one run; absolute speeds only mean
something on a GPU (bench/gpu.sh runs part 1 there).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.scaling import REPO, launch, launch_env, machine, write_results

PROMPTS, G, NEW_TOKENS = 8, 4, 32


def prepare(model: Path, out: Path, seq_len: int, completion: int) -> Path:
    """The GRPO example's prompts, tokenized with ``model``'s tokenizer (data/prepare.py --format prompts)."""
    jsonl = out.with_suffix(".jsonl")
    subprocess.run([sys.executable, "data/grpo_example.py", "--out", str(jsonl)], cwd=REPO, check=True)
    cmd = [sys.executable, "data/prepare.py", "--input", str(jsonl), "--format", "prompts", "--tokenizer", str(model)]
    cmd += ["--seq-len", str(seq_len), "--max-completion-length", str(completion), "--val-fraction", "0.05"]
    subprocess.run([*cmd, "--out", str(out)], cwd=REPO, env=launch_env(), check=True, capture_output=True)
    return out


def export_prompts(model_dir: Path, data: Path) -> tuple[Any, list[torch.Tensor], tuple[int, ...], int]:
    """Part 1's model and prompts: make train's export on the CPU, the first prompts of the prepared data."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from deepzero.data import open_split

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    split = open_split(data, "train")
    return model, [split[i]["prompt_ids"] for i in range(PROMPTS)], (tok.eos_token_id,), pad


def random_prompts(preset: str) -> tuple[Any, list[torch.Tensor], tuple[int, ...], int]:
    """Part 1 on a GPU (bench/gpu.sh): ``preset``'s architecture, random init in bf16 on the card, prompts of random
    ids of uneven lengths (40 to 117 tokens); nothing is downloaded."""
    from transformers import AutoModelForCausalLM

    from deepzero.presets import PRESETS

    config = PRESETS[preset].config()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to("cuda").eval()
    gen = torch.Generator().manual_seed(1)
    lengths = [40 + 11 * i for i in range(PROMPTS)]
    prompts = [torch.randint(100, config.vocab_size, (n,), generator=gen).cuda() for n in lengths]
    eos = config.eos_token_id if isinstance(config.eos_token_id, int) else 0
    return model, prompts, (eos,), eos


def generation(
    model: Any, prompts: list[torch.Tensor], eos: tuple[int, ...], pad: int, new_tokens: int, repeats: int
) -> dict[str, Any]:
    """Part 1: the four ways, interleaved; completion tokens per second of each repetition."""
    from deepzero.rollout.generation import ContinuousBatching, GroupSeeds, HFGenerate, cut_at_eos, left_padded

    rows = [p for p in prompts for _ in range(G)]
    seeds = [s for i in range(len(prompts)) for s in GroupSeeds(0).rows(0, i, G)]

    def hf_sampling(batch: list[torch.Tensor]) -> list[list[int]]:
        ids, mask = left_padded(batch, pad)
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_p=1.0,
            top_k=0, eos_token_id=list(eos), pad_token_id=pad,
        )  # fmt: skip
        return [cut_at_eos(r[ids.shape[1] :].tolist(), eos) for r in out]

    ways = {
        "one call per group (before)": lambda: [c for p in prompts for c in hf_sampling([p] * G)],
        "one batched call, Transformers' sampling (bare)": lambda: hf_sampling(rows),
        "one batched call, rows' own streams (train.py)": lambda: HFGenerate(new_tokens, eos, pad).sample(
            model, rows, seeds
        ),
        "continuous batching (generate_batch)": lambda: ContinuousBatching(new_tokens, eos, pad).sample(
            model, rows, seeds
        ),
    }
    rates: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats):
        for name, way in ways.items():
            torch.manual_seed(0)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            completions = way()
            seconds = time.perf_counter() - start
            rates[name].append(sum(map(len, completions)) / seconds)
    return {name: {"tokens_per_s": r, "median": statistics.median(r)} for name, r in rates.items()}


def generation_table(gen: dict[str, Any]) -> list[str]:
    before = gen["one call per group (before)"]["median"]
    lines = ["| generation | completion tokens/s, median | range | / one call per group |", "|---|---|---|---|"]
    for name, r in gen.items():
        span = f"{min(r['tokens_per_s']):,.0f} – {max(r['tokens_per_s']):,.0f}"
        lines.append(f"| {name} | {r['median']:,.0f} | {span} | {r['median'] / before:.2f}× |")
    return lines


def train_run(model: Path, data: Path, out: Path, nproc: int, micro: int, accum: int, g: int, steps: int) -> list[dict]:
    """train.py GRPO (ZeRO-2 fp32, lr 0: the model stays as exported) on ``nproc`` ranks; its train records."""
    args = [
        "--deepspeed_config", "ds_configs/zero2.json", "--precision", "fp32", "--model", str(model), "--data",
        str(data), "--out", str(out), "--reward", "data/grpo_reward.py:letter_share", "--num-generations", str(g),
        "--micro-batch", str(micro), "--grad-accum", str(accum), "--max-steps", str(steps), "--log-interval", "1",
        "--eval-interval", "0", "--save-interval", "0", "--no-export", "--lr", "1e-6", "--warmup-steps", "1",
    ]  # fmt: skip
    launch("train.py", args, nproc, out.with_suffix(".log"))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("kind") == "train"]


def planner_rows() -> dict[str, int]:
    """Part 4: the most rows one generate call takes beside LoRA r16 training (zero2_bf16 + checkpointing)."""
    from dataclasses import replace

    from deepzero import plan
    from deepzero.plan import GiB, Setup, model_stats
    from deepzero.presets import PRESETS

    out = {}
    for name in ("deepseek-r1-distill-qwen-1.5b", "deepseek-r1-distill-qwen-7b"):
        stats = model_stats(PRESETS[name].config(), name)
        setup = Setup(stage=2, world_size=3, seq_len=512 + 1024, lora_rank=16, checkpointing=True, pretrained=True)
        setup = replace(setup, grpo=plan.GrpoTerms(8, 512))
        out[name] = plan.generation_rows(stats, setup, 24 * GiB, 128 * GiB, 4096)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="runs/default/hf", help="make train's export (default runs/default/hf)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repetitions of part 1")
    parser.add_argument("--results", default="bench/results", help="folder for grpo_rollout.{json,md}")
    parser.add_argument(
        "--gpu-preset",
        help="part 1 only, on CUDA: this preset's architecture at random init (bench/gpu.sh), 256 new tokens",
    )
    args = parser.parse_args()
    if args.gpu_preset:
        return gpu_generation(args)
    model = REPO / args.model
    if not (model / "config.json").is_file():
        print(f"error: {args.model}: no model. Fix: run `make train` first (or pass --model)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        short = prepare(model, work / "prompts32", 96, NEW_TOKENS)
        long = prepare(model, work / "prompts64", 128, 64)
        torch.set_num_threads(1)
        gen = generation(*export_prompts(model, short), NEW_TOKENS, args.repeats)
        one = train_run(model, short, work / "one", 1, PROMPTS * G, 1, G, 4)
        three = train_run(model, long, work / "three", 3, 8, 4, 8, 4)
    train_rate = statistics.median(r["generation/tokens_per_s"] for r in one[1:] if "generation/tokens_per_s" in r)
    bare = gen["one batched call, Transformers' sampling (bare)"]["median"]
    phases = ("generation", "scoring", "reference", "train")
    split = {p: statistics.mean(r[f"timing/{p}_s"] for r in three[1:]) for p in phases}
    rows = planner_rows()
    result = {
        "machine": machine(), "generation": gen, "train_py_1_rank_tokens_per_s": train_rate,
        "train_py_vs_bare": train_rate / bare, "phase_split_3_ranks_s": split, "planner_rows_per_call": rows,
    }  # fmt: skip
    total = sum(split.values())
    lines = [
        "# GRPO rollout (python -m bench.grpo_rollout)",
        "",
        f"make train's export, {PROMPTS} prompts × G {G}, {NEW_TOKENS} new tokens, sampling at temperature 1, one"
        f" thread, {args.repeats} interleaved repetitions, on the CPU (train.py's ranks: one thread each).",
        "",
        *generation_table(gen),
        "",
        f"train.py on 1 rank, the same shape: generation/tokens_per_s {train_rate:,.0f} = {train_rate / bare:.2f}× the "
        "bare batched call.",
        "",
        "train.py on 3 ranks (on this machine's cores), G 8, 4 prompts per rank, 64-token completions, mean of steps"
        " 2-4:",
        "",
        "| phase | seconds per step | share |",
        "|---|---|---|",
        *(f"| {p} | {s:.3f} | {s / total:.0%} |" for p, s in split.items()),
        "",
        "Planner, rows per generate call beside LoRA r16 training on 3 × 24 GiB (zero2_bf16 + checkpointing, "
        "512-token prompts, 1,024-token completions): " + ", ".join(f"{k} {v:,}" for k, v in rows.items()) + ".",
        "",
    ]
    write_results(args.results, "grpo_rollout", result, "\n".join(lines))
    return 0


def gpu_generation(args: argparse.Namespace) -> int:
    """Part 1 on a GPU: ``--gpu-preset``'s architecture at random init, 256 new tokens."""
    if not torch.cuda.is_available():
        print("bench.grpo_rollout --gpu-preset: no CUDA device; nothing measured")
        return 0
    gen = generation(*random_prompts(args.gpu_preset), 256, args.repeats)
    result = {"machine": machine(), "preset": args.gpu_preset, "generation": gen}
    lines = [
        f"# GRPO rollout on {torch.cuda.get_device_name()} (python -m bench.grpo_rollout --gpu-preset"
        f" {args.gpu_preset})",
        "",
        f"{args.gpu_preset}'s architecture at random init in bf16, {PROMPTS} prompts of 40-117 random tokens × G {G},"
        f" 256 new tokens, {args.repeats} interleaved repetitions.",
        "",
        *generation_table(gen),
        "",
    ]
    write_results(args.results, "grpo_rollout_gpu", result, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
