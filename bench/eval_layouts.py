"""evaluate.py's samples on other batch layouts: how many completions change in bf16 (and in fp32, the control).

    python -m bench.eval_layouts                   # about 5 minutes on 2 CPU cores
    python -m bench.eval_layouts --work /tmp/el    # keep the data, model and runs there (a temp dir otherwise)

evaluate.py draws each row's tokens from its own stream, seeded by (seed, prompt index, sample), so a prompt's
samples do not depend on the rows beside it, up to the arithmetic: in fp32 the logits come out the same on any batch
shape, in bf16 a batched matmul may round differently with the batch's rows (and a prompt's left padding), and a
token whose uniform falls near a boundary of the CDF flips, and the rest of its completion with it.

Here: 24 sums of 2 to 4 numbers worded three ways (prompts of different lengths, so the left padding varies; prepared
with data/prepare.py --format prompts, a BPE trained on 200 more), a random Qwen2 (hidden 256, 4 layers by default),
R1's sampling (temperature 0.6, top-p 0.95), 8 samples a prompt of up to 32 tokens, scored by a file reward (right
when the first digit is even, as tests/test_evaluate.py's: a random model's pass@1 is not 0). evaluate.py runs,
as a subprocess, in --dtype bf16 and in --dtype fp32, on five layouts:

    (a) 1 rank, 8 prompts per call      (the CPU default; the reference)
    (b) 1 rank, 24 prompts per call     (all the prompts in one call)
    (c) 3 ranks, 2 prompts per call     (deepspeed --num_gpus=3, the CPU accelerator, gloo)
    (d) 1 rank, 1 prompt per call       (every call the same k rows of one prompt: no padding)
    (e) 3 ranks, 1 prompt per call

and each layout's samples.jsonl is compared with (a)'s of the same dtype, completion by completion; (e) with (d)
too, and bf16 (a) with fp32 (a). Wall times include the start (Python, and the launcher's for 3 ranks, on 2 cores
oversubscribed); generating seconds are evaluate.py's own (its completion tokens over its tokens/s: the slowest
rank's time in generate): only their ratios on one machine mean something. Every process runs 1 thread (OMP_NUM_THREADS=1),
so the thread count is the same on every layout.

Writes ``bench/results/eval_layouts.{json,md}``, with the CPU's model and its bf16/fp16 flags.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.scaling import DEEPSPEED, REPO, launch_env, machine, write_results
from deepzero.distributed import free_port
from deepzero.precision import cpu_flags, cpu_model

LAYOUTS = [
    ("a", 1, 8, "1 rank, 8 prompts/call"),
    ("b", 1, 24, "1 rank, 24 prompts/call"),
    ("c", 3, 2, "3 ranks, 2 prompts/call"),
    ("d", 1, 1, "1 rank, 1 prompt/call"),
    ("e", 3, 1, "3 ranks, 1 prompt/call"),
]
"""(name, ranks, prompts per call, description); (a) is the reference."""
DTYPES = ("bf16", "fp32")
WARM_UP = "import deepspeed, transformers, deepzero.rollout.jobs"
"""Imported once before the timed runs, so the first one does not pay for a cold file cache."""
FLAGS = ("avx512_bf16", "amx_bf16", "avx512_fp16")

REWARD_FILE = """
def first_even(prompts, completions, completion_ids, log_extra=None, **kw):
    # a random model's completions: right (1.0) when their first digit is even; that digit is the answer they vote on
    first = [next((ch for ch in c if ch.isdigit()), None) for c in completions]
    if log_extra is not None:
        log_extra("answer_parsed", [d or "[unparseable]" for d in first])
    return [float(d is not None and int(d) % 2 == 0) for d in first]
"""


def prompt_rows(count: int, seed: int) -> list[dict[str, str]]:
    """``count`` sums worded three ways, 2 to 4 numbers of 1 to 3 digits: prompts of uneven lengths."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        numbers = [rng.randrange(10 ** rng.randint(1, 3)) for _ in range(rng.randint(2, 4))]
        if i % 3 == 0:
            prompt = "+".join(map(str, numbers)) + "="
        elif i % 3 == 1:
            prompt = f"What is {' plus '.join(map(str, numbers))}? Answer:"
        else:
            prompt = f"Add the numbers {', '.join(map(str, numbers))} together, then write only the total:"
        rows.append({"prompt": prompt, "answer": str(sum(numbers))})
    return rows


def build(work: Path, prompts: int, hidden: int, layers: int, completion: int, init_std: float) -> dict[str, Any]:
    """The prompts (``--val-input``: the val split is exactly them), the reward file and the random model."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    def jsonl(path: Path, rows: list[dict[str, str]]) -> Path:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path

    evaluated = jsonl(work / "prompts.jsonl", prompt_rows(prompts, seed=0))
    more = jsonl(work / "tokenizer_text.jsonl", prompt_rows(200, seed=1))  # the BPE's training text
    (work / "reward.py").write_text(REWARD_FILE)
    data = work / "data"
    cmd = [sys.executable, "data/prepare.py", "--input", str(more), "--val-input", str(evaluated)]
    cmd += ["--format", "prompts", "--tokenizer", "train", "--vocab-size", "400", "--seq-len", str(completion + 32)]
    cmd += ["--max-completion-length", str(completion), "--out", str(data)]
    proc = subprocess.run(cmd, cwd=REPO, env=launch_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"data/prepare.py exited {proc.returncode}: {error_line(proc.stdout + proc.stderr)}")
    meta = json.loads((data / "meta.json").read_text())
    if meta["n_rows"]["val"] != prompts:
        raise RuntimeError(f"{data}: {meta['n_rows']['val']} val prompts, not {prompts}")
    tok = AutoTokenizer.from_pretrained(data / "tokenizer")
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=2 * (completion + 32), tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, initializer_range=init_std,
    )  # fmt: skip
    torch.manual_seed(0)
    model = work / "model"
    Qwen2ForCausalLM(config).save_pretrained(model)
    tok.save_pretrained(model)
    lengths = [len(tok(r["prompt"])["input_ids"]) for r in prompt_rows(prompts, seed=0)]
    return {
        "data": data, "model": model, "reward": work / "reward.py", "vocab": len(tok),
        "prompt_tokens": {"min": min(lengths), "max": max(lengths)},
        "params": sum(p.numel() for p in Qwen2ForCausalLM(config).parameters()),
    }  # fmt: skip


def error_line(text: str) -> str:
    """The line that says what went wrong: the last ``error:`` line, else the last line (a traceback's)."""
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    errors = [x for x in lines if "error:" in x.lower() or "Error" in x.split(":")[0]]
    return (errors or lines or ["(no output)"])[-1]


def run_logged(cmd: list[str], log: Path, timeout: float) -> tuple[int, float]:
    """``cmd`` from the repo root in its own session, output to ``log``; (exit code, wall seconds). On timeout the
    whole session (the launcher and its ranks) is killed and the code is -9."""
    start = time.perf_counter()
    with log.open("w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        popen = dict(cwd=REPO, env=launch_env(), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        with subprocess.Popen(cmd, **popen) as proc:
            try:
                code = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                code = -9
    return code, time.perf_counter() - start


def evaluate(built: dict[str, Any], out: Path, ranks: int, per_call: int, dtype: str, args: argparse.Namespace):
    """One evaluate.py run (``ranks`` > 1: the deepspeed launcher; a failed launch is tried once more); its wall
    seconds and summary."""
    flags = ["--model", str(built["model"]), "--data", str(built["data"]), "--out", str(out)]
    flags += ["--reward", f"{built['reward']}:first_even", "--dtype", dtype, "--samples", str(args.samples)]
    flags += ["--max-completion-length", str(args.completion), "--prompts-per-call", str(per_call)]
    flags += ["--seed", str(args.seed)]
    for attempt in range(2 if ranks > 1 else 1):
        shutil.rmtree(out, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        if ranks > 1:
            cmd = [str(DEEPSPEED), f"--num_gpus={ranks}", f"--master_port={free_port()}", "evaluate.py", *flags]
        else:
            cmd = [sys.executable, "evaluate.py", *flags]
        log = out.with_suffix(f".{attempt}.log")
        code, wall = run_logged(cmd, log, args.timeout)
        if code == 0 and (out / "summary.json").is_file():
            return wall, json.loads((out / "summary.json").read_text())
        print(f"  {out.name}: exit {code} after {wall:.0f} s: {error_line(log.read_text())} (log {log})", flush=True)
    raise RuntimeError(f"{out.name}: evaluate.py failed: {error_line(log.read_text())} (log {log})")


def generated_tokens(out: Path) -> int:
    return sum(sum(line["lengths"]) for line in map(json.loads, (out / "samples.jsonl").open()))


def completions(out: Path) -> dict[int, list[str]]:
    return {line["index"]: line["completions"] for line in map(json.loads, (out / "samples.jsonl").open())}


def compare(ref: dict[int, list[str]], other: dict[int, list[str]]) -> dict[str, Any]:
    """Completions of ``other`` that differ from ``ref``'s (same prompt, same sample), and the prompts with any."""
    if ref.keys() != other.keys():
        raise RuntimeError(f"prompt indices differ: {sorted(ref.keys() ^ other.keys())[:5]}")
    differ = {i: sum(a != b for a, b in zip(ref[i], other[i], strict=True)) for i in ref}
    total = sum(len(ref[i]) for i in ref)
    return {
        "differing": sum(differ.values()), "total": total, "share": sum(differ.values()) / total,
        "prompts_differing": sum(n > 0 for n in differ.values()), "prompts": len(ref),
    }  # fmt: skip


def markdown(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = [
        f"evaluate.py on {s['prompts']} prompts × {s['samples']} samples, up to {s['completion']} tokens, a random"
        f" Qwen2 (hidden {s['hidden']}, {s['layers']} layers, {result['model']['params'] / 1e6:.1f} M parameters,"
        f" init std {s['init_std']:g}; mean completion {result['runs'][0]['mean_length']:.1f} tokens),"
        f" T 0.6 top-p 0.95; CPU {result['cpu']['model']}"
        f" ({', '.join(f for f in FLAGS if result['cpu']['flags'][f]) or 'no native bf16/fp16 flags'}).",
        "",
        "| dtype | layout | differing completions vs (a) | share | prompts with a change | pass@1 | wall s |"
        " wall / (a) | generating s | generating / (a) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in result["runs"]:
        c = run["vs_a"]
        ref = next(r for r in result["runs"] if r["dtype"] == run["dtype"] and r["layout"] == "a")
        lines.append(
            f"| {run['dtype']} | ({run['layout']}) {run['description']} | {c['differing']} / {c['total']} |"
            f" {c['share']:.1%} | {c['prompts_differing']} / {c['prompts']} | {run['pass@1']:.3f} |"
            f" {run['wall_s']:.1f} | {run['wall_s'] / ref['wall_s']:.2f}× | {run['generation_s']:.2f} |"
            f" {run['generation_s'] / ref['generation_s']:.2f}× |"
        )
    lines += ["", "| comparison | differing completions | share | prompts with a change |", "|---|---|---|---|"]
    for name, c in result["comparisons"].items():
        lines.append(
            f"| {name} | {c['differing']} / {c['total']} | {c['share']:.1%} | {c['prompts_differing']} / {c['prompts']} |"
        )
    return "\n".join(lines) + "\n"


def git_state() -> dict[str, Any]:
    """The commit measured, and the files under deepzero/ that differed from it (a working tree being edited)."""

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.rstrip()

    return {
        "commit": git("rev-parse", "HEAD"),
        "dirty": [x for x in git("status", "--short", "deepzero", "evaluate.py").split("\n") if x],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, help="folder for the data, model and runs (default: a temp dir, removed)")
    p.add_argument("--prompts", type=int, default=24, help="prompts evaluated")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt (k)")
    p.add_argument("--completion", type=int, default=32, help="--max-completion-length")
    p.add_argument("--hidden", type=int, default=256, help="the random Qwen2's hidden size (a multiple of 128)")
    p.add_argument("--layers", type=int, default=4, help="its layers")
    p.add_argument(
        "--init-std", type=float, default=0.02, help="its weights' init std (Qwen2's 0.02: next-token distributions"
        " near uniform; larger: more peaked)"
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="evaluate.py's --seed")
    p.add_argument("--timeout", type=float, default=300, help="seconds one evaluate.py run may take")
    p.add_argument("--results", default="bench/results", help="where eval_layouts.{json,md} go")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    temp = None if args.work else tempfile.TemporaryDirectory(prefix="eval_layouts_")
    work = args.work or Path(temp.name)
    work.mkdir(parents=True, exist_ok=True)
    try:
        built = build(work, args.prompts, args.hidden, args.layers, args.completion, args.init_std)
        print(f"model {built['params'] / 1e6:.1f} M parameters, vocab {built['vocab']}; runs under {work}", flush=True)
        warm = subprocess.run([sys.executable, "-c", WARM_UP], cwd=REPO, env=launch_env(), capture_output=True)
        if warm.returncode != 0:
            raise RuntimeError(f"importing evaluate.py's modules failed: {error_line(warm.stderr.decode())}")
        runs, samples = [], {}
        for dtype in DTYPES:
            for name, ranks, per_call, description in LAYOUTS:
                out = work / "runs" / f"{dtype}-{name}"
                wall, summary = evaluate(built, out, ranks, per_call, dtype, args)
                samples[dtype, name] = completions(out)
                figures = summary["run"]
                runs.append(
                    {
                        "dtype": dtype, "layout": name, "description": description, "ranks": figures["ranks"],
                        "prompts_per_call": figures["prompts_per_call"], "rows_per_call": per_call * args.samples,
                        "wall_s": wall, "generation_tokens_per_s": figures["generation_tokens_per_s"],
                        "generation_s": generated_tokens(out) / figures["generation_tokens_per_s"],
                        "pass@1": summary["pass@1"], "mean_length": summary.get("mean_length"),
                        "vs_a": compare(samples[dtype, "a"], samples[dtype, name]),
                    }
                )  # fmt: skip
                c = runs[-1]["vs_a"]
                print(f"  {dtype} ({name}) {description}: {wall:.1f} s, {c['differing']}/{c['total']} differ from (a)")
        comparisons = {f"{d} (e) vs (d)": compare(samples[d, "d"], samples[d, "e"]) for d in DTYPES}
        comparisons["bf16 (a) vs fp32 (a)"] = compare(samples["fp32", "a"], samples["bf16", "a"])
    finally:
        if temp is not None:
            temp.cleanup()
    flags = cpu_flags()
    result = {
        "machine": machine(),
        "cpu": {
            "model": cpu_model(), "flags": {f: f in flags for f in FLAGS},
            "mkldnn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        },
        "git": git_state(),
        "settings": {
            "prompts": args.prompts, "samples": args.samples, "completion": args.completion, "hidden": args.hidden,
            "layers": args.layers, "init_std": args.init_std, "seed": args.seed, "sampling": "r1: temperature 0.6, top-p 0.95",
            "threads_per_process": 1,
        },
        "model": {k: built[k] for k in ("params", "vocab", "prompt_tokens")},
        "runs": runs,
        "comparisons": comparisons,
    }  # fmt: skip
    write_results(args.results, "eval_layouts", result, markdown(result))
    return result


if __name__ == "__main__":
    main()
