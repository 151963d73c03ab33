"""The training recipe: setup → fit → export. Config flows one way: TrainArgs + resolved DeepSpeed JSON."""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from tqdm.auto import tqdm

from deepzero import checkpoint, dsconfig, modeling
from deepzero.args import TrainArgs, parse_args
from deepzero.data import GlobalBatchSampler, PackedDataset, check_enough_rows, load_meta, make_eval_loader
from deepzero.errors import UserError
from deepzero.export import export_hf
from deepzero.flops import count_params, flops_per_token, peak_tflops
from deepzero.metrics import MetricsSink, peak_memory_gb, redact
from deepzero.presets import PRESETS


@dataclass
class Run:
    """Everything built by setup(): the engine, the data, and the numbers the loop reports."""

    args: TrainArgs
    cfg: dsconfig.ResolvedConfig
    engine: Any
    tokenizer: Any
    train_data: PackedDataset
    val_data: PackedDataset | None
    state: checkpoint.TrainState
    sink: MetricsSink
    lr_source: str
    seq_len: int
    flops_per_token: float
    peak_tflops: float | None
    rank: int = 0
    world: int = 1
    device: str = "cpu"
    history: list[dict[str, Any]] = field(default_factory=list)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.batch.global_batch * self.seq_len


def main(argv: list[str] | None = None) -> int:
    """Entry point of train.py: one clear line and exit code 2 for bad input, never a deep stack trace."""
    try:
        args = parse_args(argv)
        run = setup(args)
        fit(run)
        finish(run)
        return 0
    except UserError as err:
        if os.environ.get("RANK", "0") == "0" or dist.is_initialized():
            prefix = f"[rank {dist.get_rank()}] " if dist.is_initialized() and dist.get_rank() else ""
            print(f"{prefix}error: {err}", file=sys.stderr, flush=True)
        return 2


def init_distributed() -> tuple[int, int]:
    """Join the process group the launcher (deepspeed, torchrun, srun) described; a plain `python` run is rank 0 of 1."""
    for key, default in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, default)
    os.environ.setdefault("MASTER_PORT", "29500")
    get_accelerator().set_device(int(os.environ["LOCAL_RANK"]))
    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))  # CPU ranks share the cores
    deepspeed.init_distributed(dist_init_required=True, verbose=False)
    return dist.get_rank(), dist.get_world_size()


def setup(args: TrainArgs) -> Run:
    """Validate everything cheap first (preset, data, model config), then build the engine."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    meta = load_meta(args.data)
    source = modeling.resolve_model(args.model)
    config = modeling.load_config(source, args.trust_remote_code)
    preset = PRESETS.get(args.model)
    from_preset = preset is not None and preset.hub_id is None and args.lr is None
    hints = dsconfig.TrainingHints(
        max_steps=args.max_steps,
        lr=preset.pretrain_lr if from_preset else args.lr,
        warmup_steps=preset.pretrain_warmup_steps if from_preset and args.warmup_steps is None else args.warmup_steps,
        micro_batch=args.micro_batch,
        grad_accum=args.grad_accum,
        hidden_size=config.hidden_size,
    )
    cfg = dsconfig.resolve(args.deepspeed_config, dp_size=world, hints=hints, overrides=args.ds)
    lr_source = (
        f"model preset {args.model} (random init, from scratch)"
        if from_preset
        else ("--lr" if args.lr is not None else args.deepspeed_config)
    )
    seq_len = int(meta["seq_len"])
    if seq_len > config.max_position_embeddings:
        raise UserError(
            f"{args.data}/meta.json",
            f"seq_len {seq_len} exceeds the model's max_position_embeddings {config.max_position_embeddings}",
            f"re-run data/prepare.py with --seq-len {config.max_position_embeddings} or less",
        )
    train_data = PackedDataset(args.data, "train")
    check_enough_rows(len(train_data), cfg.batch.global_batch, "train")
    val_data = PackedDataset(args.data, "val") if meta["n_rows"].get("val") else None
    tokenizer = modeling.load_tokenizer(args.tokenizer or meta.get("tokenizer") or args.model, args.trust_remote_code)

    rank, world = init_distributed()
    device = get_accelerator().current_device_name()
    keep_alive = modeling.zero3_context(cfg.ds) if cfg.zero_stage == 3 else None
    torch.manual_seed(args.seed)
    model = modeling.build_model(
        source,
        config,
        vocab_size=len(tokenizer) if source.random_init else None,
        attn_implementation=args.attn_implementation,
        trust_remote_code=args.trust_remote_code,
    )
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=cfg.ds)
    engine._deepzero_keep_alive = keep_alive  # HfDeepSpeedConfig must live as long as the engine

    state = checkpoint.TrainState()
    if args.resume:
        state = checkpoint.load(engine, args.checkpoint_dir)
    run_config = {"args": vars(args), "deepspeed": cfg.ds, "env": redact(_launch_env())}
    sink = MetricsSink(args.out_dir, args.report_to, run_config, enabled=rank == 0)
    run = Run(
        args=args,
        cfg=cfg,
        engine=engine,
        tokenizer=tokenizer,
        train_data=train_data,
        val_data=val_data,
        state=state,
        sink=sink,
        lr_source=lr_source,
        seq_len=seq_len,
        flops_per_token=flops_per_token(engine.module, seq_len),
        peak_tflops=peak_tflops(args.peak_tflops),
        rank=rank,
        world=world,
        device=device,
    )
    if run.is_main:
        _write_run_config(run, run_config)
        _print_header(run, source.spec)
    return run


def micro_batches(run: Run) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's micro-batches, starting where the checkpoint left off."""
    b = run.cfg.batch
    sampler = GlobalBatchSampler(
        len(run.train_data), b.micro, b.accum, run.rank, run.world, run.args.seed, start_step=run.state.step
    )
    loader = torch.utils.data.DataLoader(
        run.train_data, batch_sampler=sampler, num_workers=1, pin_memory=run.device.startswith("cuda")
    )
    for batch in loader:
        yield {k: v.to(run.device, non_blocking=True) for k, v in batch.items()}


def fit(run: Run) -> None:
    """The loop: accumulate micro-batches, step, and sync with the host only at log/eval/save points."""
    args, engine, batch = run.args, run.engine, run.cfg.batch
    batches = micro_batches(run)
    bar = tqdm(
        total=args.max_steps, initial=run.state.step, disable=None if run.is_main else True, desc="train", unit="step"
    )
    loss_sum = torch.zeros((), device=run.device)
    window_start, window_steps = time.perf_counter(), 0
    while run.state.step < args.max_steps:
        for _ in range(batch.accum):
            loss = engine(**next(batches)).loss
            engine.backward(loss)
            engine.step()
            loss_sum += loss.detach().float()
        run.state.step += 1
        run.state.samples_seen += batch.global_batch
        run.state.tokens_seen += run.tokens_per_step
        window_steps += 1
        bar.update(1)
        step = run.state.step
        if step % args.log_interval == 0 or step == args.max_steps:
            elapsed = time.perf_counter() - window_start
            record = train_record(run, loss_sum / (window_steps * batch.accum), window_steps, elapsed)
            bar.set_postfix(
                loss=f"{record['loss']:.3f}", lr=f"{record['lr']:.2e}", tok_s=f"{record['tokens_per_s']:.0f}"
            )
            log(run, record, bar)
            loss_sum.zero_()
            window_start, window_steps = time.perf_counter(), 0
        if run.val_data is not None and args.eval_interval and step % args.eval_interval == 0:
            log(run, evaluate(run), bar)
        if args.save_interval and step % args.save_interval == 0:
            checkpoint.save(engine, args.checkpoint_dir, run.state, args.keep_last)
    bar.close()


def train_record(run: Run, mean_loss: torch.Tensor, steps: int, elapsed: float) -> dict[str, Any]:
    """One logging point: global mean loss, lr, loss scale, grad norm, throughput, MFU, peak memory."""
    engine = run.engine
    loss = _all_reduce_mean(mean_loss)
    tokens_per_s = steps * run.tokens_per_step / max(elapsed, 1e-9)
    mem_gb, mem_kind = peak_memory_gb()
    record: dict[str, Any] = {
        "kind": "train",
        "step": run.state.step,
        "loss": loss,
        "lr": float(engine.get_lr()[0]),
        "grad_norm": _float_or_none(engine.get_global_grad_norm()),
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": tokens_per_s / run.world,
        "step_time_s": elapsed / steps,
        "tokens_seen": run.state.tokens_seen,
        f"peak_{mem_kind}_mem_gb": _all_reduce_max(mem_gb),
        "skipped_steps": int(getattr(engine, "skipped_steps", 0)),
    }
    if run.cfg.precision == "fp16":
        record["loss_scale"] = float(getattr(engine.optimizer, "loss_scale", getattr(engine.optimizer, "cur_scale", 0)))
    if run.peak_tflops:
        record["mfu"] = run.flops_per_token * tokens_per_s / (run.peak_tflops * 1e12 * run.world)
    return record


@torch.no_grad()
def evaluate(run: Run) -> dict[str, Any]:
    """Mean loss and perplexity over ``eval_batches`` micro-batches per rank of the val split."""
    engine = run.engine
    engine.eval()
    total = torch.zeros(2, device=run.device)
    micro = run.cfg.batch.micro
    per_round = micro * run.world  # equal batch counts on every rank: ZeRO-3 forwards are collective
    rows = min(run.args.eval_batches * per_round, len(run.val_data) // per_round * per_round)
    loader = make_eval_loader(run.val_data, micro, run.rank, run.world, max_rows=rows)
    for batch in loader:
        batch = {k: v.to(run.device) for k, v in batch.items()}
        total[0] += engine(**batch).loss.float()
        total[1] += 1
    engine.train()
    if dist.is_initialized():
        dist.all_reduce(total)
    loss = (total[0] / total[1].clamp(min=1)).item()
    return {"kind": "eval", "step": run.state.step, "val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}


def finish(run: Run) -> None:
    """Final checkpoint, final eval, HF export with a logit check, and a one-screen summary."""
    args = run.args
    if not args.save_interval or run.state.step % args.save_interval:
        checkpoint.save(run.engine, args.checkpoint_dir, run.state, args.keep_last)
    if run.val_data is not None and args.eval_interval and run.state.step % args.eval_interval:
        log(run, evaluate(run), None)
    if args.export:
        probe_loader = make_eval_loader(run.val_data or run.train_data, 1, 0, 1, 1)
        probe = {k: v.to(run.device) for k, v in next(iter(probe_loader)).items()}
        report = export_hf(run.engine, run.tokenizer, args.out_dir / "hf", probe)
        if report is not None:
            log(run, {"kind": "export", "step": run.state.step, **vars(report), "ok": report.ok}, None)
            if not report.ok:
                raise RuntimeError(f"exported weights differ from the engine: max |Δlogit| {report.max_abs_logit_diff}")
    if run.is_main:
        _print_summary(run)
    run.sink.close()


def log(run: Run, record: dict[str, Any], bar: tqdm | None) -> None:
    run.history.append(record)
    if not run.is_main:
        return
    run.sink.log(record)
    text = "  ".join(_fmt(k, v) for k, v in record.items() if k != "kind")
    (bar.write if bar is not None else print)(f"[{record['kind']}] {text}")


def _fmt(key: str, value: Any) -> str:
    if isinstance(value, float):
        return f"{key}={value:.4g}"
    return f"{key}={value}"


def _all_reduce_mean(t: torch.Tensor) -> float:
    t = t.detach().clone().float()
    if dist.is_initialized():
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t.item()


def _all_reduce_max(x: float) -> float:
    t = torch.tensor(x)
    if dist.is_initialized() and dist.get_backend() == "gloo":
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    elif dist.is_initialized():
        t = t.to(get_accelerator().current_device_name())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _float_or_none(x: Any) -> float | None:
    if x is None:
        return None
    return float(x.item() if torch.is_tensor(x) else x)


def _launch_env() -> dict[str, str]:
    keep = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "DS_ACCELERATOR")
    return {k: v for k, v in os.environ.items() if k in keep or k.startswith(("NCCL_", "WANDB_", "HF_"))}


def _write_run_config(run: Run, run_config: dict[str, Any]) -> None:
    import json

    run.args.out_dir.mkdir(parents=True, exist_ok=True)
    (run.args.out_dir / "run_config.json").write_text(json.dumps(run_config, indent=2, default=str))


def _print_header(run: Run, model_name: str) -> None:
    counts = count_params(run.engine.module)
    cfg = run.cfg
    lines = [
        f"model: {model_name}  params {counts.total / 1e6:,.2f}M (active {counts.active / 1e6:,.2f}M)",
        f"deepspeed: {cfg.path}  ZeRO-{cfg.zero_stage}  {cfg.precision}"
        + (f"  offload {'+'.join(cfg.offload)}" if cfg.offload else "")
        + f"  world {run.world} on {run.device.split(':')[0]} ({dist.get_backend()})",
        cfg.batch.describe(run.seq_len),
        f"lr: peak {cfg.ds['optimizer']['params']['lr']:g} from {run.lr_source}; scheduler {cfg.ds.get('scheduler', {}).get('type', 'none')}"
        f" {_sched_brief(cfg.ds)}",
        f"data: {run.args.data}  {len(run.train_data):,} train rows × {run.seq_len} tokens"
        + (f", {len(run.val_data):,} val rows" if run.val_data is not None else ""),
        f"FLOPs/token {run.flops_per_token:.3g}; MFU "
        + (
            f"against {run.peak_tflops} TFLOP/s per device"
            if run.peak_tflops
            else "not reported (no known peak: pass --peak-tflops)"
        ),
    ]
    if run.state.step:
        lines.append(f"resumed from step {run.state.step} ({run.state.tokens_seen:,} tokens seen)")
    print("\n".join(lines), flush=True)


def _sched_brief(ds: dict[str, Any]) -> str:
    params = ds.get("scheduler", {}).get("params", {})
    return f"(warmup {params['warmup_num_steps']} steps)" if "warmup_num_steps" in params else ""


def _print_summary(run: Run) -> None:
    train = [r for r in run.history if r["kind"] == "train"]
    evals = [r for r in run.history if r["kind"] == "eval"]
    parts = [f"done: {run.state.step} steps, {run.state.tokens_seen:,} tokens"]
    if train:
        parts.append(f"loss {train[0]['loss']:.3f} (step {train[0]['step']}) → {train[-1]['loss']:.3f}")
    if evals:
        parts.append(f"val ppl {evals[-1]['val_ppl']:.2f}")
    parts.append(f"metrics: {run.sink.path}")
    print("; ".join(parts), flush=True)


if __name__ == "__main__":
    sys.exit(main())
