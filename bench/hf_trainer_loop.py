"""Reference loop: ``transformers.Trainer`` with its DeepSpeed integration, on train.py's model, data and config.

    deepspeed --num_gpus=3 --module bench.hf_trainer_loop --deepspeed_config ds_configs/zero2.json \\
        --data artifacts/data/stdlib --out /tmp/hf --max-steps 25 --log-interval 5

The ds_config is resolved by deepzero.dsconfig first (comments dropped, batch keys and every "auto" filled), and the
``TrainingArguments`` are set to the same values, because HF's own "auto" resolution (``fill_match``) raises on any
mismatch between the two. The Trainer reads the rows train.py and the bare loop read, in their order (a data loader
over train.py's ``GlobalBatchSampler``, one worker, given to the Trainer as a plain DataLoader: accelerate's
``DataLoaderShard`` wrapper, which a user's Trainer has, is left out, which if anything favours HF Trainer): on an
MoE model other rows route other tokens to other experts, so a different order would be different work. It keeps its own
defaults otherwise (its collator and loop; its NaN filter; its token averaging across ranks,
``average_tokens_across_devices``: each step's target count gathered from every rank, the same all-reduce train.py
and the bare loop do): this is the loop a user of HF Trainer gets. Like the bare loop it runs no MoE balancing and
computes the model's own (untiled) loss, so bench/compare_loops.py runs train.py with both off against it. A
callback records the host time at every ``on_step_begin`` and ``on_step_end``; rank 0 writes train.py-shaped
``{"kind": "train", "step", "time"}`` records to ``<out>/metrics.jsonl`` every ``--log-interval`` steps.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from bench.bare_loop import LoopArgs, build, parse_args, resolve_config, train_loader, write_step_times
from deepzero.distributed import exit_process, release_shm_buffers


def training_arguments(args: LoopArgs, ds: dict[str, Any], micro: int, accum: int) -> Any:
    """TrainingArguments that agree with the resolved ds_config on every key HF cross-checks."""
    from transformers import TrainingArguments

    opt = ds["optimizer"]["params"]
    sched = ds.get("scheduler", {}).get("params", {})
    betas = opt.get("betas", [0.9, 0.999])
    return TrainingArguments(
        output_dir=args.out,
        deepspeed=copy.deepcopy(ds),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accum,
        max_steps=args.max_steps,
        learning_rate=opt["lr"],
        adam_beta1=betas[0],
        adam_beta2=betas[1],
        adam_epsilon=opt.get("eps", 1e-8),
        weight_decay=opt.get("weight_decay", 0.0),
        max_grad_norm=ds.get("gradient_clipping", 0.0),
        warmup_steps=int(sched.get("warmup_num_steps", 0)),
        fp16=bool(ds.get("fp16", {}).get("enabled")),
        bf16=bool(ds.get("bf16", {}).get("enabled")),
        logging_steps=args.log_interval,
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        dataloader_num_workers=1,
        dataloader_pin_memory=torch.cuda.is_available(),
        remove_unused_columns=False,  # keep shift_labels: same loss as train.py
        seed=args.seed,
    )


def allow_deepspeed_on_cpu() -> None:
    """On a CPU-only machine, let Accelerate run DeepSpeed over gloo as train.py does (GPU machines: no change).

    Accelerate maps "no accelerator" to "no distributed training" unless ``use_cpu=True``, and ``use_cpu=True``
    switches DeepSpeed off; DeepSpeed itself runs on the CPU fine (``DS_ACCELERATOR=cpu``). Reporting gloo/multi-CPU
    from ``_prepare_backend`` is the one missing piece; the rest of Accelerate's DeepSpeed path is unchanged.
    """
    if torch.cuda.is_available():
        return
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    original = PartialState._prepare_backend

    def prepare_backend(self: Any, cpu: bool = False, sagemaker_dp: bool = False, backend: str | None = None) -> Any:
        if int(os.environ.get("LOCAL_RANK", "-1")) != -1 and not cpu:
            return "gloo", DistributedType.MULTI_CPU
        return original(self, cpu, sagemaker_dp, backend)

    PartialState._prepare_backend = prepare_backend


def main(argv: list[str] | None = None) -> None:
    """Build the same model and data, train ``max_steps`` steps with HF Trainer, write the step times."""
    from transformers import Trainer, TrainerCallback

    class StepClock(TrainerCallback):
        """Host time at the start and end of every optimizer step (no device sync)."""

        def __init__(self) -> None:
            self.begins: list[float] = []
            self.ends: list[float] = []

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.begins.append(time.time())

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.ends.append(time.time())

    args = parse_args(argv)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    cfg = resolve_config(args, world)
    allow_deepspeed_on_cpu()
    # TrainingArguments first: for ZeRO-3 its HfDeepSpeedConfig must exist before the model is built.
    training_args = training_arguments(args, cfg.ds, cfg.batch.micro, cfg.batch.accum)
    built = build(args, cfg)

    class SameRowsTrainer(Trainer):
        """HF Trainer reading train.py's rows in train.py's order (each rank its share of every global batch)."""

        def get_train_dataloader(self) -> DataLoader:
            pin = self.args.dataloader_pin_memory
            return train_loader(built, args.seed, rank, world, pin_memory=pin, collate_fn=self.data_collator)

    clock = StepClock()
    trainer = SameRowsTrainer(model=built.model, args=training_args, train_dataset=built.train_data, callbacks=[clock])
    trainer.train()
    release_shm_buffers()  # the group HF started made DeepSpeed's /dev/shm buffers; unlinked, they go at exit
    if rank == 0:
        in_step = [e - b for b, e in zip(clock.begins, clock.ends, strict=True)][args.log_interval :]
        extra = {"loop": "hf_trainer", "in_step_median_s": statistics.median(in_step) if in_step else None}
        write_step_times(Path(args.out), clock.ends, args.log_interval, extra)
        b = built.cfg.batch
        print(f"hf trainer loop: {len(clock.ends)} steps, {b.describe(built.seq_len)}; {json.dumps(extra)}")


if __name__ == "__main__":
    main()
    exit_process(0)
