"""Host memory of a 16-bit LoRA run's export through train.py: streamed from the base's files against the engine's
whole model merged in memory (docs/qlora.md).

    python -m bench.lora_export_memory                 # a 208 MB bf16 Llama in 32 MB shards, 2 steps, 3 runs a way
    python -m bench.lora_export_memory --reps 1        # one run a way

The base is a Llama (hidden 1024, intermediate 2816, 8 layers, vocab 512, random init) saved in bf16 by
``save_pretrained`` in 32 MB shards; the data bench/qlora_loss.py's (six standard-library packages, a BPE of 512 ids
trained on them, 64-token rows). Each way is train.py in a fresh process, 1 process under ZeRO-2 on the CPU, LoRA r8
on the attention projections, bf16, micro 2, 2 steps, through ``bench.measured_export``, which records the export's
peak resident memory above the level before it (sampled every 5 ms):

- ``streamed``: the exporter train.py chooses for a base with files, the merge from the files shard by shard and its
  logit round trip (two whole models, bases up to 4 GiB only); the ``[export]`` record's ``peak_host_bytes`` is the
  merge alone;
- ``in memory``: ``exporters.files_vocab`` forced to answer None, so the run merges the engine's whole model (the
  way every 16-bit LoRA export went before, and one without files still goes).

Resident memory includes the mapped files' pages and what the allocator keeps, so one run's peak varies by tens of MB
on a busy machine: each way runs ``--reps`` times, alternating, and the median is reported with the range.
Writes ``bench/results/lora_export_memory.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.measured_export import EXPORTERS
from bench.qlora_loss import prepare
from bench.scaling import REPO, launch_env, machine, write_results

SHARD = "32MB"
ARCH = dict(
    hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16,
    vocab_size=512, max_position_embeddings=256,
)  # fmt: skip
TRAIN = [
    *("--deepspeed_config", "ds_configs/zero2.json", "--ds", "train_batch_size=auto", "--max-steps", "2"),
    *("--lora", "r=8", "--precision", "bf16", "--eval-interval", "0", "--save-interval", "0"),
    *("--log-interval", "1", "--micro-batch", "2"),
]


def make_base(folder: Path) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**ARCH)).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size=SHARD)
    return folder


def run(way: str, base: Path, data: Path, out: Path) -> dict[str, Any]:
    """train.py in a fresh process exporting ``way``: the export's peak, and the ``[export]`` record."""
    peak = out.with_suffix(".peak.json")
    cmd = [sys.executable, "-m", "bench.measured_export", way, str(peak), *TRAIN]
    cmd += ["--model", str(base), "--data", str(data), "--out", str(out)]
    log = out.with_suffix(".log")
    with log.open("w") as f:
        done = subprocess.run(cmd, cwd=REPO, env=launch_env(), stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"{way}: train.py failed ({done.returncode}):\n{log.read_text()[-4000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    export = next(r for r in records if r["kind"] == "export")
    assert export["ok"], export
    return {**json.loads(peak.read_text()), "export": export}


def peaks(result: dict[str, Any]) -> dict[str, list[int]]:
    """The three rows' peaks, one per run: the streamed merge alone, the streamed export, the in-memory one."""
    streamed, in_memory = result["ways"]["streamed"], result["ways"]["in memory"]
    return {
        "streamed from the files: the merge (the `[export]` record's `peak_host_bytes`)":
            [r["export"]["peak_host_bytes"] for r in streamed],
        "streamed, with its round trip (two whole models, bases up to 4 GiB only)":
            [r["peak_host_bytes"] for r in streamed],
        "the engine's whole model merged in memory (before; now only without files)":
            [r["peak_host_bytes"] for r in in_memory],
    }  # fmt: skip


def markdown(result: dict[str, Any]) -> str:
    mb, base = 1e6, result["base_bytes"]
    text = (
        "# 16-bit LoRA export host memory (python -m bench.lora_export_memory)\n\n"
        f"train.py, 1 process, ZeRO-2 on the CPU, 2 steps; base: a bf16 Llama of {base / mb:.0f} MB in"
        f" {result['shards']} shards of {SHARD} (largest {result['largest_shard_bytes'] / mb:.0f} MB); LoRA r8 on the"
        f" attention projections. Peak resident memory above the level before the export, median of"
        f" {result['reps']} runs a way (range):\n\n"
        "| 16-bit LoRA export | peak host memory | / base | range |\n|---|---|---|---|\n"
    )
    for name, runs in peaks(result).items():
        median = statistics.median(runs)
        text += (
            f"| {name} | {median / mb:.0f} MB | {median / base:.2f} | {min(runs) / mb:.0f}-{max(runs) / mb:.0f} MB |\n"
        )
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lora_export_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="runs of each way (alternating); the median is reported")
    parser.add_argument("--results", default="bench/results", help="folder for lora_export_memory.{json,md}")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        base, data = make_base(Path(tmp) / "base"), prepare(Path(tmp) / "data")
        shards = len(list(base.glob("*.safetensors")))
        ways: dict[str, list[dict[str, Any]]] = {way: [] for way in EXPORTERS}
        for rep in range(args.reps):
            for way in EXPORTERS:
                ways[way].append(run(way, base, data, Path(tmp) / f"{way.replace(' ', '_')}_{rep}"))
    export = ways["streamed"][0]["export"]
    result = {
        "arch": ARCH, "shard": SHARD, "shards": shards, "train_args": TRAIN, "reps": args.reps, "machine": machine(),
        "base_bytes": export["base_bytes"], "largest_shard_bytes": export["largest_shard_bytes"], "ways": ways,
    }  # fmt: skip
    result["median_peak_host_bytes"] = {name: statistics.median(runs) for name, runs in peaks(result).items()}
    write_results(args.results, "lora_export_memory", result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
