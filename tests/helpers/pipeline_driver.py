"""Train the tiny DeepSeek-V3 preset with DeepSpeed pipeline parallelism and report what tests/test_pipeline.py checks.

Launched with the real launcher on the CPU accelerator (gloo)::

    DS_ACCELERATOR=cpu deepspeed --num_gpus=3 tests/helpers/pipeline_driver.py --data DIR --out DIR --steps 6 [--resume]

A fresh run (seed 0) first computes, on rank 0 with the plain HF model, the reference loss of a fixed batch (the first
micro-batch of the val split) in fp32 and in the engine's dtype, then the pipeline engine's loss on the same batch.
Every run trains ``--steps`` optimizer steps from where ``<out>/checkpoints`` left off (with ``--resume``), saves a
checkpoint, exports a Hugging Face folder to ``<out>/hf`` (logits checked on the first val row) and writes ``<out>/report.json`` on rank 0.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from deepzero import checkpoint, dsconfig, modeling
from deepzero.data import GlobalBatchSampler, PackedDataset, load_meta, make_eval_loader, make_train_loader
from deepzero.distributed import exit_process, init_distributed
from deepzero.pipeline import (
    PipelineSettings,
    build_pipeline_engine,
    eval_step,
    export_pipeline_hf,
    gather_hf_state_dict,
    pipeline_batches,
    train_step,
)
from deepzero.presets import get_preset


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True, help="optimizer steps to run in this launch")
    p.add_argument("--max-steps", type=int, default=12, help="schedule length (same for split and whole runs)")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--config", default="ds_configs/pipeline.json")
    p.add_argument("--ds", nargs="*", default=[], help="dotted overrides, e.g. bf16.enabled=false")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--no-export", action="store_true")
    p.add_argument("--local_rank", type=int, default=0, help="set by the deepspeed launcher")
    return p.parse_args(argv)


def reference_losses(model: torch.nn.Module, batch: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, float]:
    """Loss of the plain HF model on ``batch`` in fp32 and in ``dtype`` (what the engine casts to)."""
    out = {}
    with torch.no_grad():
        for name, d in (("fp32", torch.float32), ("engine_dtype", dtype)):
            m = model if d == torch.float32 else copy.deepcopy(model).to(d)
            out[name] = m(**batch).loss.item()
    return out


def weight_digest(engine: Any, name_map: dict[str, str]) -> dict[str, float] | None:
    """Per-tensor fp64 sums of the full HF state dict on rank 0 (cheap equality check between runs)."""
    sd = gather_hf_state_dict(engine, name_map)
    return None if sd is None else {k: v.double().sum().item() for k, v in sorted(sd.items())}


def main() -> None:
    args = parse()
    rank, world = init_distributed()
    raw = dsconfig.load_json(args.config)
    dsconfig.apply_overrides(raw, args.ds, args.config)
    settings = PipelineSettings.from_ds(raw, args.config)
    hints = dsconfig.TrainingHints(max_steps=args.max_steps, lr=args.lr, warmup_steps=args.warmup_steps)
    cfg = dsconfig.resolve(args.config, dp_size=settings.dp_size(world), hints=hints, overrides=args.ds)
    settings.check_accum(cfg.batch.accum)
    meta = load_meta(args.data)
    tokenizer = modeling.load_tokenizer(meta.get("tokenizer") or str(args.data / "tokenizer"))
    train_data = PackedDataset(args.data, "train")
    val_data = PackedDataset(args.data, "val")
    fixed = next(iter(make_eval_loader(val_data, cfg.batch.micro, 0, 1)))
    probe = next(iter(make_eval_loader(val_data, 1, 0, 1)))  # a different shape than training, like the trainer's

    torch.manual_seed(0)
    config = get_preset("tiny-deepseek-v3").config(vocab_size=len(tokenizer))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision, torch.float32)
    report: dict[str, Any] = {"precision": cfg.precision, "world": world, "batch": vars(cfg.batch)}
    if rank == 0 and not args.resume:
        report["reference_loss"] = reference_losses(model, fixed, dtype)

    engine, name_map = build_pipeline_engine(
        model, cfg.ds, settings.stages, settings.partition, settings.activation_checkpoint_interval
    )
    report["parts"] = [int(p) for p in engine.module.parts]
    ckpt_dir = args.out / "checkpoints"
    state = checkpoint.load(engine, ckpt_dir) if args.resume else checkpoint.TrainState()
    report["start_step"] = state.step
    if not args.resume:
        report["pipeline_loss"] = eval_step(engine, pipeline_batches([fixed]), num_micro_batches=1)

    dp_id, dp_size = engine.grid.data_parallel_id, engine.grid.data_parallel_size
    sampler = GlobalBatchSampler(len(train_data), cfg.batch.micro, cfg.batch.accum, dp_id, dp_size, 0, state.step)
    batches = pipeline_batches(make_train_loader(train_data, sampler))
    losses, start = {}, time.perf_counter()
    for _ in range(args.steps):
        loss = float(train_step(engine, batches))
        state.step += 1
        state.samples_seen += cfg.batch.global_batch
        state.tokens_seen += cfg.batch.global_batch * train_data.seq_len
        losses[state.step] = loss
    report["seconds_per_step"] = (time.perf_counter() - start) / max(1, args.steps)
    report["losses"] = losses
    report["lr"] = float(engine.get_lr()[0])
    norm = engine.get_global_grad_norm()
    report["grad_norm"] = None if norm is None else float(norm)
    report["end_step"] = state.step
    report["global_steps"] = int(engine.global_steps)
    checkpoint.save(engine, ckpt_dir, state, keep_last=2)
    report["weights"] = weight_digest(engine, name_map)
    report["pipeline_loss_after"] = eval_step(engine, pipeline_batches([fixed]), num_micro_batches=1)
    if not args.no_export:
        export = export_pipeline_hf(engine, name_map, model, tokenizer, args.out / "hf", probe)
        if export is not None:
            report["export"] = {**vars(export), "ok": export.ok}
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.json").write_text(json.dumps(report, indent=2))
    dist.barrier()


if __name__ == "__main__":
    main()
    exit_process(0)
