"""Predicted vs measured peak GPU memory (torch.cuda.max_memory_allocated) for a few model sizes.

    python bench/gpu_memory.py                 # all cases, one GPU, prints a markdown table
    python bench/gpu_memory.py --json out.json # also write the rows

Runs one process on one card (world size 1): each case builds a preset (fewer layers so it fits a 24 GB card),
wraps it in DeepSpeed ZeRO-2 or ZeRO-3 with bf16 AdamW, runs one warm-up step (optimizer states exist afterwards)
and measures the peak of a second step. The planner's ``Estimate.allocated`` for the same setup is the prediction;
``other`` (CUDA context, NCCL, fragmentation) is outside max_memory_allocated and is not compared. Paste the
table into docs/memory.md. Without CUDA it prints a message and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from deepzero import plan
from deepzero.presets import get_preset


@dataclass(frozen=True)
class Case:
    preset: str
    layers: int
    stage: int
    checkpointing: bool
    micro_batch: int
    seq_len: int
    overrides: tuple[tuple[str, Any], ...] = ()

    @property
    def name(self) -> str:
        extra = "".join(f", {k}={v}" for k, v in self.overrides)
        ckpt = ", ckpt" if self.checkpointing else ""
        return (
            f"{self.preset} ({self.layers} layers{extra}) ZeRO-{self.stage}{ckpt} mb {self.micro_batch}×{self.seq_len}"
        )


CASES = (
    Case("deepseek-coder-1.3b", 4, 2, False, 1, 1024),
    Case("deepseek-coder-1.3b", 4, 2, False, 4, 1024),
    Case("deepseek-coder-1.3b", 4, 2, True, 4, 1024),
    Case("deepseek-coder-1.3b", 4, 3, False, 2, 1024),
    Case("deepseek-r1-distill-qwen-1.5b", 4, 2, False, 2, 1024),
    Case("deepseek-v2-lite", 2, 2, False, 2, 1024, (("n_routed_experts", 16),)),
    Case("deepseek-v2-lite", 2, 3, True, 2, 1024, (("n_routed_experts", 16),)),
)

ZERO = {"reduce_bucket_size": 50_000_000, "overlap_comm": False, "contiguous_gradients": True}
ZERO3 = {"stage3_prefetch_bucket_size": 20_000_000, "stage3_param_persistence_threshold": 10_000}


def ds_config(case: Case) -> dict[str, Any]:
    zero = {"stage": case.stage, **ZERO, **(ZERO3 if case.stage == 3 else {})}
    return {
        "train_micro_batch_size_per_gpu": case.micro_batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": case.micro_batch,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0}},
        "zero_optimization": zero,
        "steps_per_print": 1_000_000,
    }


def train_step(engine: Any, ids: torch.Tensor) -> None:
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()


def resident_states(e: plan.Estimate) -> int:
    """Bytes still allocated between steps: ZeRO-2 frees its gradients after the step, ZeRO-3 keeps its flat
    gradient partition and its reduce bucket."""
    if e.setup.stage == 3:
        return e.params + e.optimizer + e.grads + e.setup.bytes_per_value * e.setup.zero.reduce_bucket_size
    return e.params + e.optimizer


def measure(case: Case) -> dict[str, Any]:
    """One case: predicted bytes from the planner, measured peak of the second training step."""
    import deepspeed
    from transformers import AutoModelForCausalLM

    config = get_preset(case.preset).config(num_hidden_layers=case.layers, **dict(case.overrides))
    ds = ds_config(case)
    stats = plan.model_stats(config, case.preset)
    setup = plan.setup_from_ds_config(
        ds, world_size=1, seq_len=case.seq_len, hidden_size=config.hidden_size, checkpointing=case.checkpointing
    )
    predicted = plan.estimate(stats, setup)

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    if case.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    ids = torch.randint(0, config.vocab_size, (case.micro_batch, case.seq_len), device=engine.device)

    train_step(engine, ids)  # creates the optimizer states
    torch.cuda.synchronize()
    states = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    train_step(engine, ids)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    engine.destroy()
    del engine, model
    gc.collect()
    torch.cuda.empty_cache()
    gib = plan.GiB
    return {
        "case": case.name,
        "predicted_states_gib": resident_states(predicted) / gib,
        "measured_states_gib": states / gib,
        "predicted_peak_gib": predicted.allocated / gib,
        "measured_peak_gib": peak / gib,
        "error_pct": 100 * (predicted.allocated - peak) / peak,
    }


def markdown(rows: list[dict[str, Any]], device: str) -> str:
    head = (
        f"Measured on {device}, one card, bf16, AdamW, sdpa attention.\n\n"
        "| case | states pred. GiB | states meas. GiB | peak pred. GiB | peak meas. GiB | peak error |\n"
        "|---|---:|---:|---:|---:|---:|\n"
    )
    body = "".join(
        f"| {r['case']} | {r['predicted_states_gib']:.2f} | {r['measured_states_gib']:.2f} | "
        f"{r['predicted_peak_gib']:.2f} | {r['measured_peak_gib']:.2f} | {r['error_pct']:+.0f}% |\n"
        for r in rows
    )
    return head + body


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--only", type=int, nargs="*", help="case indexes to run (default: all)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gpu_memory.py: no CUDA device here, nothing measured (docs/memory.md keeps 'not yet measured').")
        return 0
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("LOCAL_RANK", "0")
    cases = [CASES[i] for i in args.only] if args.only else list(CASES)
    rows = []
    for case in cases:
        print(f"running {case.name} ...", flush=True)
        rows.append(measure(case))
    table = markdown(rows, torch.cuda.get_device_name(0))
    print(table)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
