"""MoE load balancing on a deliberately skewed router, through train.py: imbalance and loss for off / bias / aux.

    python -m bench.moe_balance                       # 300 steps per mode on the CPU, one process each
    python -m bench.moe_balance --steps 60 --modes off,bias

The model is tiny-deepseek-v3 (3 MoE layers × 8 experts, top-2) written with ``save_pretrained`` after two edits
that make every token prefer experts 0 and 1: the token embeddings share one direction ``u`` (the residual stream
of every token points along it) and the routers' rows 0 and 1 are ``SKEW · u``. Each mode trains it from the same
seed on the same rows; the log window's ``expert_load_imbalance`` (max / mean tokens per expert, averaged over the
MoE layers) and the loss come from metrics.jsonl. Also measured: the step time of each mode (the cost of the
hooks, the balance loss and the bias update's all-reduce) from the same runs.

Writes ``bench/results/moe_balance.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
SKEW = 0.15
"""Added to router rows 0 and 1 along the shared direction ``u``."""
SHARED = 0.5
"""Norm of ``u`` added to every token embedding (a random embedding's norm is about 0.23)."""
ROUTER_STD = 0.1
"""Router rows' random init (the preset's 0.02 makes every token's choice almost the same)."""
MODES: dict[str, list[str]] = {
    "off": ["--moe-balance", "off"],
    "bias": ["--moe-balance", "bias", "--moe-bias-rate", "0.02"],
    "aux": ["--moe-balance", "aux", "--moe-aux-alpha", "0.1"],
}
"""γ and α larger than DeepSeek's pre-training values (0.001, 0.0001), so that a short run shows the effect."""


def write_skewed_model(folder: Path, vocab_size: int, skew: float = SKEW, seed: int = 0) -> Path:
    """A tiny DeepSeek-V3 whose routers send (nearly) every token to experts 0 and 1, saved with save_pretrained."""
    from transformers import AutoModelForCausalLM

    from deepzero.moe_balance import find_routers
    from deepzero.presets import PRESETS

    torch.manual_seed(seed)
    config = PRESETS["tiny-deepseek-v3"].config(vocab_size=vocab_size)
    model = AutoModelForCausalLM.from_config(config)
    u = torch.nn.functional.normalize(torch.randn(config.hidden_size), dim=0)
    with torch.no_grad():
        model.get_input_embeddings().weight.add_(SHARED * u)
        for router in find_routers(model):
            router.weight.normal_(0.0, ROUTER_STD)  # token-dependent choices among the experts...
            router.weight[:2] += skew * u  # ...tilted toward experts 0 and 1 for every token
    model.save_pretrained(folder)
    return folder


def prepare_data(out: Path) -> Path:
    """Standard-library source with a BPE tokenizer of 512 tokens trained on it, packed into 64-token rows."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    inputs = [str(stdlib / name) for name in ("json", "email", "http", "logging")]
    cmd = [sys.executable, "data/prepare.py", "--input", *inputs, "--seq-len", "64", "--out", str(out)]
    cmd += ["--tokenizer", "train", "--vocab-size", "512", "--val-fraction", "0.1"]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True, env=cpu_env())
    return out


def cpu_env() -> dict[str, str]:
    return {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def train_args(
    model: Path, data: Path, out: Path, steps: int, log_interval: int, *extra: str, micro: int = 4
) -> list[str]:
    """train.py flags of every mode: fp32 ZeRO-2, one process, micro 4 × accumulation 2, a constant lr after the
    warm-up (a resume to more steps keeps the curve), no eval/save/export
    (flags given in ``extra`` come last and win)."""
    return [
        "--model", str(model), "--data", str(data), "--out", str(out), "--deepspeed_config", "ds_configs/zero2.json",
        "--ds", "fp16.enabled=false", "--max-steps", str(steps), "--log-interval", str(log_interval),
        "--micro-batch", str(micro), "--grad-accum", "2", "--lr", "5e-4", "--warmup-steps", "5", "--seed", "1",
        "--lr-schedule", "constant", "--eval-interval", "0", "--save-interval", "0", "--no-export", *extra,
    ]  # fmt: skip


def curve(out: Path) -> list[dict[str, Any]]:
    """step, loss, imbalance, dead experts, balance loss and step time of each train record."""
    keys = ("step", "loss", "expert_load_imbalance", "dead_experts", "balance_loss", "step_time_s")
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: r.get(k) for k in keys} for r in map(json.loads, lines) if r["kind"] == "train"]


def run_mode(mode: str, model: Path, data: Path, out: Path, steps: int, log_interval: int) -> list[dict[str, Any]]:
    cmd = [sys.executable, "train.py", *train_args(model, data, out, steps, log_interval, *MODES[mode])]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=cpu_env())
    if proc.returncode:
        raise RuntimeError(f"{mode}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return curve(out)


def summarize(points: list[dict[str, Any]]) -> dict[str, Any]:
    """First and last window, first step under 1.5, mean loss of the last quarter, median step time."""
    under = next((p["step"] for p in points if p["expert_load_imbalance"] < 1.5), None)
    tail = points[-max(1, len(points) // 4) :]
    return {
        "imbalance_first": points[0]["expert_load_imbalance"],
        "imbalance_last": points[-1]["expert_load_imbalance"],
        "first_step_under_1.5": under,
        "loss_last_quarter": statistics.mean(p["loss"] for p in tail),
        "step_time_s_median": statistics.median(p["step_time_s"] for p in points[1:] or points),
    }


def measure_cost(rounds: int = 15, accum: int = 2) -> dict[str, Any]:
    """In one process, on the same weights: median time of an optimizer step's forward/backward (``accum``
    micro-batches of 4 × 64 tokens) plus the bias update, with and without a Balancer (bias + sequence-wise loss),
    rounds interleaved so that the machine's load hits both alike."""
    from transformers import AutoModelForCausalLM

    from deepzero.moe_balance import BalanceChoice, Balancer
    from deepzero.presets import PRESETS

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(PRESETS["tiny-deepseek-v3"].config(vocab_size=512)).train()
    ids = torch.randint(0, 512, (4, 64))
    choice = BalanceChoice("both", "deepseek_v3", 0.001, 0.0001)
    times: dict[str, list[float]] = {"without": [], "with": []}
    for _ in range(rounds):
        for name in times:
            balancer = Balancer(model, choice, lambda: 1.0 / accum, "cpu") if name == "with" else None
            start = time.perf_counter()
            for _ in range(accum):
                (model(input_ids=ids, labels=ids).loss / accum).backward()
            if balancer is not None:
                balancer.after_step()
                balancer.remove()
            times[name].append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {"step_s_median": medians, "overhead": medians["with"] / medians["without"] - 1, "rounds": rounds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "moe_balance.json"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = prepare_data(work / "data")
        from deepzero.data import load_meta
        from deepzero.modeling import load_tokenizer

        vocab = len(load_tokenizer(load_meta(data)["tokenizer"], False))
        model = write_skewed_model(work / "skewed", vocab)
        results: dict[str, Any] = {}
        for mode in args.modes.split(","):
            points = run_mode(mode, model, data, work / mode, args.steps, args.log_interval)
            results[mode] = {"flags": MODES[mode], "summary": summarize(points), "curve": points}
            print(mode, json.dumps(results[mode]["summary"]), flush=True)
    cost = measure_cost()
    print("cost", json.dumps(cost), flush=True)
    report = {
        "what": "tiny-deepseek-v3 with routers skewed toward experts 0 and 1, trained from it through train.py",
        "command": f"python -m bench.moe_balance --steps {args.steps} --log-interval {args.log_interval}",
        "skew": SKEW,
        "machine": {"cpu": os.cpu_count(), "torch": torch.__version__},
        "modes": results,
        "cost": cost,
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
