"""Train LoRA adapters on the tiny DeepSeek-V3 preset under ZeRO-2 or ZeRO-3 and report what tests/test_lora.py checks.

Launched with the real launcher on the CPU accelerator (gloo)::

    DS_ACCELERATOR=cpu deepspeed --num_gpus=3 tests/helpers/lora_driver.py --data DIR --out DIR \\
        --ds-config ds_configs/zero3.json --lora r=8,alpha=16,targets=attn,mlp --steps 8

It builds the model the way the trainer does (HfDeepSpeedConfig first under ZeRO-3, so zero.Init partitions it at
construction), applies LoRA, then ``deepspeed.initialize`` with the trainable parameters only. It snapshots the
consolidated 16-bit weights before and after training, exports the merged model with ``export_lora_hf`` to
``<out>/hf``, saves the engine's logits on the probe row to ``<out>/engine_logits.pt`` and writes
``<out>/report.json`` on rank 0.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist

from deepzero import dsconfig, modeling
from deepzero.data import GlobalBatchSampler, PackedDataset, load_meta, make_eval_loader, make_train_loader
from deepzero.distributed import exit_process, init_distributed
from deepzero.export import consolidated_state_dict
from deepzero.lora import LoraSpec, apply_lora, export_lora_hf, is_adapter_param, param_counts

MODEL = "tiny-deepseek-v3"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ds-config", default="ds_configs/zero2.json")
    p.add_argument("--ds", nargs="*", default=[], help="dotted overrides, e.g. bf16.enabled=false")
    p.add_argument("--lora", required=True, help="LoRA spec, e.g. r=8,alpha=16,targets=attn")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--local_rank", type=int, default=0, help="set by the deepspeed launcher")
    return p.parse_args(argv)


def snapshot(engine: Any) -> dict[str, torch.Tensor] | None:
    """The full 16-bit state dict on rank 0 (a collective under ZeRO-3), cloned to the CPU."""
    sd = consolidated_state_dict(engine)
    return None if sd is None else {k: v.detach().cpu().clone() for k, v in sd.items()}


@torch.no_grad()
def fixed_loss(engine: Any, batch: dict[str, torch.Tensor]) -> float:
    """Loss on held-out rows, in eval mode (every rank runs it: ZeRO-3 gathers parameters in forward)."""
    engine.eval()
    loss = engine(**batch).loss.float().item()
    engine.train()
    return loss


def compare(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Which tensors training moved: adapter ones should, base ones must be bit-identical."""
    changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
    return {
        "keys": len(before),
        "adapter_keys": sum(1 for k in before if is_adapter_param(k)),
        "changed_base": [k for k in changed if not is_adapter_param(k)],
        "changed_adapter": sum(1 for k in changed if is_adapter_param(k)),
        "changed_lora_B": sum(1 for k in changed if ".lora_B." in k),
        "lora_B_keys": sum(1 for k in before if ".lora_B." in k),
        "lora_B_all_zero_before": all(not before[k].any() for k in before if ".lora_B." in k),
    }


def main() -> None:
    args = parse()
    rank, world = init_distributed()
    tokenizer = modeling.load_tokenizer(load_meta(args.data).get("tokenizer") or str(args.data / "tokenizer"))
    source = modeling.resolve_model(MODEL)
    config = modeling.load_config(source)
    hints = dsconfig.TrainingHints(
        max_steps=args.steps,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        micro_batch=args.micro_batch,
        grad_accum=args.grad_accum,
        hidden_size=config.hidden_size,
    )
    cfg = dsconfig.resolve(args.ds_config, dp_size=world, hints=hints, overrides=args.ds)
    spec = LoraSpec.parse(args.lora)

    keep_alive = modeling.zero3_context(cfg.ds) if cfg.zero_stage == 3 else None
    torch.manual_seed(0)
    model = modeling.build_model(source, config, vocab_size=len(tokenizer))
    model.config.use_cache = False
    partitioned = any(hasattr(p, "ds_id") for p in model.parameters())
    model = apply_lora(model, spec)
    trainable, total = param_counts(model)
    trainable_names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=cfg.ds)

    train_data, val_data = PackedDataset(args.data, "train"), PackedDataset(args.data, "val")
    probe = next(iter(make_eval_loader(val_data, 1, 0, 1)))
    fixed = next(iter(make_eval_loader(val_data, 8, 0, 1)))  # the same held-out rows on every rank
    fixed_before = fixed_loss(engine, fixed)
    before = snapshot(engine)

    b = cfg.batch
    sampler = GlobalBatchSampler(len(train_data), b.micro, b.accum, rank, world, seed=0)
    batches = iter(make_train_loader(train_data, sampler))
    losses: dict[int, float] = {}
    lrs: dict[int, float] = {}
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        step_loss = torch.zeros(())
        for _ in range(b.accum):
            loss = engine(**next(batches)).loss
            engine.backward(loss)
            engine.step()
            step_loss += loss.detach().float()
        dist.all_reduce(step_loss)
        losses[step] = step_loss.item() / (b.accum * world)
        lrs[step] = float(engine.get_lr()[0])
    seconds_per_step = (time.perf_counter() - start) / args.steps

    after = snapshot(engine)
    fixed_after = fixed_loss(engine, fixed)
    engine.eval()
    with torch.no_grad():
        engine_logits = engine(input_ids=probe["input_ids"]).logits.float().cpu()
    engine.train()
    export = export_lora_hf(engine, tokenizer, args.out / "hf", probe)

    if rank == 0:
        report = {
            "world": world,
            "zero_stage": cfg.zero_stage,
            "precision": cfg.precision,
            "partitioned_at_build": partitioned,
            "spec": spec.describe(),
            "summary": vars(model._deepzero_lora),
            "trainable": trainable,
            "total": total,
            "trainable_names": trainable_names,
            "optimizer_params": sum(int(getattr(p, "ds_numel", p.numel())) for p in params),
            "losses": losses,
            "lrs": lrs,
            "seconds_per_step": seconds_per_step,
            "fixed_loss": {"before": fixed_before, "after": fixed_after},
            "weights": compare(before, after),
            "export": {**vars(export), "ok": export.ok},
        }
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save({"input_ids": probe["input_ids"], "logits": engine_logits}, args.out / "engine_logits.pt")
        (args.out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    dist.barrier()
    del keep_alive


if __name__ == "__main__":
    main()
    exit_process(0)
