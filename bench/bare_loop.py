"""Reference loop: the shortest correct ``deepspeed.initialize`` loop over train.py's model, data, config and batch.

    deepspeed --num_gpus=3 --module bench.bare_loop --deepspeed_config ds_configs/zero2.json \\
        --data artifacts/data/stdlib --out /tmp/bare --max-steps 25 --log-interval 5

No logging, no metrics, no checkpointing, no progress bar: only the data loader, forward, backward and step, with
train.py's loss: each step's micro-batches are drawn first and their target tokens all-reduced (one scalar, on the
device), and each micro-batch's summed cross-entropy is divided by that global count × accumulation × ranks through
Transformers' ``num_items_in_batch`` (the token-weighted mean that train.py and HF Trainer also compute). It records
the host time at the end of every optimizer step, in memory, and writes them at the end to ``<out>/metrics.jsonl``
as ``{"kind": "train", "step": s, "time": t}`` lines every ``--log-interval`` steps, the same shape as train.py's
records, so bench/compare_loops.py measures both the same way. Also home of :func:`build`, which the HF Trainer loop
shares so that all loops train exactly the same model on the same data.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from deepzero import dsconfig, modeling
from deepzero.data import IGNORE_INDEX, GlobalBatchSampler, PackedDataset, load_meta
from deepzero.distributed import exit_process, release_shm_buffers


@dataclass
class LoopArgs:
    """The flags every reference loop shares with train.py (same names, same meaning)."""

    deepspeed_config: str = field(default="ds_configs/zero2.json", metadata={"help": "DeepSpeed JSON preset."})
    model: str = field(default="tiny-deepseek-v3", metadata={"help": "A random-init preset name."})
    data: str = field(default="artifacts/data/stdlib", metadata={"help": "Folder written by data/prepare.py."})
    out: str = field(default="/tmp/bench-loop", metadata={"help": "Where metrics.jsonl goes."})
    max_steps: int = field(default=25, metadata={"help": "Optimizer steps."})
    log_interval: int = field(default=5, metadata={"help": "Steps per timing record."})
    lr: float = field(default=2e-3, metadata={"help": "Optimizer (and scheduler peak) lr."})
    warmup_steps: int = field(default=30, metadata={"help": "Scheduler warmup_num_steps."})
    micro_batch: int | None = field(default=None, metadata={"help": "Override train_micro_batch_size_per_gpu."})
    grad_accum: int | None = field(default=None, metadata={"help": "Override gradient_accumulation_steps."})
    seed: int = field(default=0, metadata={"help": "Seed for weights init and data order."})
    attn_implementation: str = field(default="sdpa", metadata={"help": "eager | sdpa | flash_attention_2"})
    local_rank: int = field(default=-1, metadata={"help": "Set by the deepspeed launcher."})


@dataclass
class Built:
    """What every loop starts from: resolved DeepSpeed config, model (not yet wrapped), training rows."""

    cfg: dsconfig.ResolvedConfig
    model: torch.nn.Module
    train_data: PackedDataset
    seq_len: int


def parse_args(argv: list[str] | None = None) -> LoopArgs:
    """Parse the shared flags (unknown flags are an error)."""
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(LoopArgs).parse_args_into_dataclasses(args=argv)
    return args


def resolve_config(args: LoopArgs, world: int) -> dsconfig.ResolvedConfig:
    """The ds_config resolved for ``world`` ranks by the same code as train.py (comments dropped, "auto" filled)."""
    config = modeling.load_config(modeling.resolve_model(args.model))
    hints = dsconfig.TrainingHints(
        max_steps=args.max_steps,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        micro_batch=args.micro_batch,
        grad_accum=args.grad_accum,
        hidden_size=config.hidden_size,
    )
    return dsconfig.resolve(args.deepspeed_config, dp_size=world, hints=hints)


def build(args: LoopArgs, cfg: dsconfig.ResolvedConfig) -> Built:
    """The model and training rows exactly as train.py builds them (seeded, fp32, vocab from the data's tokenizer)."""
    meta = load_meta(args.data)
    source = modeling.resolve_model(args.model)
    config = modeling.load_config(source)
    tokenizer = modeling.load_tokenizer(meta.get("tokenizer") or args.model)
    torch.manual_seed(args.seed)
    model = modeling.build_model(
        source,
        config,
        vocab_size=len(tokenizer),
        dtype=cfg.precision_choice.torch_dtype,
        attn_implementation=args.attn_implementation,
    )
    model.config.use_cache = False
    return Built(cfg, model, PackedDataset(args.data, "train"), int(meta["seq_len"]))


def train_loader(
    built: Built, seed: int, rank: int, world: int, pin_memory: bool, collate_fn: Any = None
) -> torch.utils.data.DataLoader:
    """This rank's micro-batches as train.py reads them: its ``GlobalBatchSampler`` order, one worker (every loop
    reads the same rows in the same order; ``collate_fn`` None: torch's default)."""
    b = built.cfg.batch
    sampler = GlobalBatchSampler(len(built.train_data), b.micro, b.accum, rank, world, seed)
    return torch.utils.data.DataLoader(
        built.train_data, batch_sampler=sampler, num_workers=1, pin_memory=pin_memory, collate_fn=collate_fn
    )


def write_step_times(out: Path, step_ends: list[float], log_interval: int, extra: dict[str, Any]) -> None:
    """Step-end host times as train.py-shaped records, every ``log_interval`` steps (rank 0 calls this)."""
    out.mkdir(parents=True, exist_ok=True)
    with (out / "metrics.jsonl").open("w") as f:
        for step, t in enumerate(step_ends, start=1):
            if step % log_interval == 0 or step == len(step_ends):
                f.write(json.dumps({"kind": "train", "step": step, "time": t, **extra}) + "\n")


def main(argv: list[str] | None = None) -> None:
    """Initialize DeepSpeed, run ``max_steps`` optimizer steps with no host syncs, write the step times."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    args = parse_args(argv)
    get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(verbose=False)
    release_shm_buffers()  # before the clock starts: DeepSpeed's /dev/shm buffers, unlinked, go at exit
    rank, world = dist.get_rank(), dist.get_world_size()
    device = get_accelerator().current_device_name()
    built = build(args, resolve_config(args, world))
    b = built.cfg.batch
    params = [p for p in built.model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=built.model, model_parameters=params, config=built.cfg.ds)
    batches = iter(train_loader(built, args.seed, rank, world, pin_memory=device.startswith("cuda")))
    step_ends: list[float] = []
    for _ in range(args.max_steps):
        micro = [{k: v.to(device, non_blocking=True) for k, v in next(batches).items()} for _ in range(b.accum)]
        targets = sum((m["labels"] != IGNORE_INDEX).sum() for m in micro).float()
        dist.all_reduce(targets)  # the global batch's target count: the loss is the mean over all its tokens
        normalizer = targets.clamp(min=1) / (b.accum * world)
        for batch in micro:
            loss = engine(**batch, num_items_in_batch=normalizer, use_cache=False).loss
            engine.backward(loss)
            engine.step()
        step_ends.append(time.time())
    final_loss = float(loss.detach().float().item())  # the only host sync of the run
    if rank == 0:
        write_step_times(Path(args.out), step_ends, args.log_interval, {"loop": "bare"})
        print(f"bare loop: {args.max_steps} steps, {b.describe(built.seq_len)}, last micro-batch loss {final_loss:.3f}")


if __name__ == "__main__":
    main()
    exit_process(0)
