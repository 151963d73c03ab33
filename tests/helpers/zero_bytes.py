"""Count the bytes a DeepSpeed ZeRO engine really holds per rank after one training step.

Launched by tests/test_plan.py with the real launcher (on the CPU accelerator)::

    DS_ACCELERATOR=cpu deepspeed --num_gpus=3 tests/helpers/zero_bytes.py --stage 2 --out bytes.json

Builds the ``tiny-deepseek-v3`` preset, runs one bf16 AdamW step under ZeRO-2 or ZeRO-3 and writes, for every
rank, the bytes of the low-precision parameters, the gradient partition (measured after backward, before the
step) and the optimizer state (fp32 master partition + Adam moments). Tensors are counted by unique storage,
so views into DeepSpeed's flat buffers are not counted twice.

With ``--qlora-base FOLDER --qlora-data DIR`` the same launch then builds train.py's own QLoRA engine (``setup``:
the folder's model in 4 bits, LoRA r8 on the attention, the stage's bf16 preset), runs one step of it and adds
every rank's parameter bytes (partitions, persistent copies, NF4 codes and their ``QuantState``) as ``qlora``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from deepzero.distributed import exit_process, init_distributed
from deepzero.presets import get_preset

SEQ_LEN = 32


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one flat buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _flat(items: Iterable[Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for item in items:
        if isinstance(item, torch.Tensor):
            out.append(item)
        elif isinstance(item, (list, tuple)):
            out += _flat(item)
        elif isinstance(item, dict):
            out += _flat(item.values())
    return out


def grad_bytes(engine: Any, stage: int) -> int:
    """Gradient partition this rank holds between backward and step."""
    opt = engine.optimizer
    if stage == 3:
        return storage_bytes([opt.grad_partitions_flat_buffer])
    return storage_bytes(_flat(list(opt.averaged_gradients.values())))


def param_bytes(engine: Any, stage: int) -> tuple[int, int]:
    """Low-precision parameter bytes: (total held, of which full copies of ZeRO-3 persistent params)."""
    opt = engine.optimizer
    if stage == 3:
        flat = storage_bytes(opt.fp16_partitioned_groups_flat)
        persistent = [p for p in engine.module.parameters() if getattr(p, "ds_persist", False)]
        full = storage_bytes(p.data for p in persistent)
        return flat + full, full
    return storage_bytes(opt.bit16_groups_flat), 0


def optimizer_bytes(engine: Any, stage: int) -> dict[str, int]:
    """fp32 master partition and Adam moments."""
    opt = engine.optimizer
    master = opt.fp32_partitioned_groups_flat if stage == 3 else opt.single_partition_of_fp32_groups
    states = list(opt.optimizer.state.values())
    return {
        "master": storage_bytes(master),
        "exp_avg": storage_bytes(s.get("exp_avg") for s in states),
        "exp_avg_sq": storage_bytes(s.get("exp_avg_sq") for s in states),
    }


QLORA_PRESETS = {2: "ds_configs/zero2_bf16.json", 3: "ds_configs/zero3.json"}


def qlora_argv(stage: int, base: str, data: str, out: str) -> list[str]:
    """train.py's flags for the measured QLoRA engine (the test plans the same flags)."""
    return [
        "--deepspeed_config", QLORA_PRESETS[stage], "--model", base, "--data", data, "--out", out,
        "--lora", "r=8,targets=attn", "--load-in-4bit", "--precision", "bf16", "--micro-batch", "1",
        "--grad-accum", "1", "--ds", "train_batch_size=auto",
    ]  # fmt: skip


def held_param_bytes(module: torch.nn.Module) -> dict[str, int]:
    """What a rank holds of ``module``'s parameters: ZeRO-3 partitions (and the whole of persistent ones) or the
    tensors themselves, and each 4-bit weight's ``QuantState`` (its absmax constants and code tables)."""
    tensors: dict[str, list[torch.Tensor]] = {"params": [], "quant_state": []}
    for param in module.parameters():
        part = getattr(param, "ds_tensor", None)
        tensors["params"] += [param.data] if part is None or getattr(param, "ds_persist", False) else []
        tensors["params"] += [part] if part is not None else []
        state = getattr(param, "quant_state", None)
        if state is not None:
            parts = [state.absmax, state.code, state.offset]
            parts += [state.state2.absmax, state.state2.code] if state.state2 is not None else []
            tensors["quant_state"] += parts
    return {what: storage_bytes(ts) for what, ts in tensors.items()}


def qlora_bytes(stage: int, base: str, data: str, out: str) -> dict[str, int]:
    """One train_step of train.py's QLoRA engine, then the parameter bytes this rank holds."""
    import contextlib

    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from deepzero.args import parse_args
    from deepzero.run import setup
    from deepzero.trainer import micro_batches

    unset_hf_deepspeed_config()
    run = setup(parse_args(qlora_argv(stage, base, data, out)))
    with contextlib.closing(micro_batches(run)) as batches:
        run.engine.train_step(batches)
    run.sink.close()
    return held_param_bytes(run.engine.engine.module)


def ds_config(stage: int) -> dict[str, Any]:
    return {
        "train_batch_size": 3,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True},
        },  # as the presets
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1_000_000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, choices=(2, 3), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--qlora-base", help="a 16-bit model folder: also measure train.py's QLoRA engine")
    parser.add_argument("--qlora-data", help="train.py's --data for the QLoRA engine")
    parser.add_argument("--local_rank", type=int, default=0, help="set by the deepspeed launcher")
    args = parser.parse_args()

    init_distributed()
    torch.manual_seed(0)
    config = get_preset("tiny-deepseek-v3").config()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(args.stage))

    ids = torch.randint(0, config.vocab_size, (1, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    loss = engine(input_ids=ids.to(engine.device), labels=ids.to(engine.device)).loss
    engine.backward(loss)
    grads = grad_bytes(engine, args.stage)
    engine.step()

    params, persistent = param_bytes(engine, args.stage)
    row = {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "stage": args.stage,
        "params": params,
        "persistent_params": persistent,
        "grads": grads,
        **optimizer_bytes(engine, args.stage),
        "loss": loss.item(),
    }
    if args.qlora_base:
        row["qlora"] = qlora_bytes(args.stage, args.qlora_base, args.qlora_data, str(args.out.parent / "qlora"))
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        args.out.write_text(json.dumps({"ds_config": ds_config(args.stage), "ranks": rows}, indent=2))
        print(f"zero_bytes: wrote {args.out}")


if __name__ == "__main__":
    main()
    exit_process(0)
