"""The training recipe: setup → fit → export. Config flows one way: TrainArgs + resolved DeepSpeed JSON."""

from __future__ import annotations

import contextlib
import errno
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from tqdm.auto import tqdm

from deepzero import checkpoint, dsconfig, modeling, report, universal
from deepzero.args import TrainArgs, parse_args
from deepzero.data import (
    GlobalBatchSampler,
    PackedDataset,
    check_enough_rows,
    load_meta,
    make_eval_loader,
    make_train_loader,
)
from deepzero.distributed import exit_process, init_distributed
from deepzero.errors import UserError
from deepzero.export import export_hf
from deepzero.flops import flops_per_token, peak_tflops, routed_experts
from deepzero.layer_split import LayerSplitEngine, parse_devices, place_model
from deepzero.lora import LoraSpec, apply_lora, export_lora_hf, is_lora
from deepzero.metrics import MetricsSink, redact
from deepzero.op_builds import check_op_builds
from deepzero.pipeline import (
    PipelineSettings,
    build_pipeline_engine,
    eval_step,
    export_pipeline_hf,
    pipeline_batches,
    train_step,
)
from deepzero.plan import check_fit
from deepzero.preemption import StopRequest
from deepzero.presets import PRESETS


@dataclass
class Run:
    """Everything built by setup(): the engine, the data, and the numbers the loop reports."""

    args: TrainArgs
    cfg: dsconfig.ResolvedConfig
    engine: Any
    model: torch.nn.Module
    """The full HF model (under a pipeline, the engine's module holds only this rank's stages)."""
    pipe: PipelineSettings | None
    name_map: dict[str, str] | None
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
    dp_rank: int = 0
    dp_size: int = 1
    device: str = "cpu"
    history: list[dict[str, Any]] = field(default_factory=list)
    last_saved_step: int = -1
    """Step of the checkpoint this run last wrote or resumed from (the final save is skipped when it is current)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.batch.global_batch * self.seq_len


ERROR_EXIT_GRACE_S = 5.0


def main(argv: list[str] | None = None) -> int:
    """Entry point of train.py: one clear line and exit code 2 for bad input, never a deep stack trace."""
    run = None
    try:
        args = parse_args(argv)
        run = setup(args)
        fit(run)
        finish(run)
    except Preempted as stop:
        if dist.is_initialized() and dist.get_rank() == 0:
            print(f"preempted: {stop}", flush=True)
    except UserError as err:
        if os.environ.get("RANK", "0") == "0" or dist.is_initialized():
            prefix = f"[rank {dist.get_rank()}] " if dist.is_initialized() and dist.get_rank() else ""
            print(f"{prefix}error: {err}", file=sys.stderr, flush=True)
        if os.environ.get("RANK", "0") != "0":
            # The launcher kills every rank once one exits non-zero: wait, so that rank 0 reaching the same error a
            # moment later still prints its line instead of being killed before it does (rank 0 exiting first ends
            # the job at once).
            time.sleep(ERROR_EXIT_GRACE_S)
        return 2
    finally:  # on every way out: the entry point ends without interpreter shutdown (exit_process)
        if run is not None:
            run.sink.close()
    return 0


@dataclass(frozen=True)
class RunPlan:
    """Every decision that needs no weights and no process group: made first, so bad input fails in seconds."""

    source: modeling.ModelSource
    config: Any
    cfg: dsconfig.ResolvedConfig
    pipe: PipelineSettings | None
    lr_source: str
    seq_len: int
    train_data: PackedDataset
    val_data: PackedDataset | None
    tokenizer: Any
    lora: LoraSpec | None = None


def plan_run(args: TrainArgs, world: int) -> RunPlan:
    """Resolve the preset against the real world size, check data and model against each other."""
    check_writable(args.out_dir)
    check_op_builds()
    meta = load_meta(args.data)
    source = modeling.resolve_model(args.model)
    config = modeling.load_config(source, args.trust_remote_code)
    preset = PRESETS.get(args.model)
    from_scratch = preset is not None and preset.hub_id is None and args.lr is None
    hints = dsconfig.TrainingHints(
        max_steps=args.max_steps,
        lr=preset.pretrain_lr if from_scratch else args.lr,
        warmup_steps=preset.pretrain_warmup_steps if from_scratch and args.warmup_steps is None else args.warmup_steps,
        micro_batch=args.micro_batch,
        grad_accum=args.grad_accum,
        hidden_size=config.hidden_size,
    )
    if args.experts_impl is not None and not routed_experts(config):
        raise UserError(
            f"--experts-impl {args.experts_impl}",
            f"--model {args.model} is a dense model (no routed experts)",
            "drop --experts-impl",
        )
    pipe = pipeline_settings(args)
    lora = LoraSpec.parse(args.lora) if args.lora is not None else None
    if lora is not None and (pipe is not None or args.device_map):
        raise UserError("--lora", "LoRA runs on the ZeRO engine only", "use a ZeRO preset without --device-map")
    if args.device_map and world > 1:
        raise UserError(
            "--device-map",
            f"layer split runs in one process, not {world}",
            "run `python train.py --device-map balanced`",
        )
    dp_size = pipe.dp_size(world) if pipe else world
    cfg = dsconfig.resolve(args.deepspeed_config, dp_size, hints, args.ds, precision=args.precision)
    if cfg.precision_choice.changed:
        _warn(f"{cfg.precision_choice.describe()}. Fix: pass --precision to choose another")
    if pipe:
        pipe.check_accum(cfg.batch.accum)
    lr_source = (
        f"model preset {args.model} (random init, from scratch)"
        if from_scratch
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
    if val_data is not None and args.eval_interval and len(val_data) < cfg.batch.micro * dp_size:
        _warn(
            f"{args.data}: val split has {len(val_data)} rows, fewer than one eval round (micro {cfg.batch.micro}"
            f" × data-parallel {dp_size}); evaluation is off. Fix: prepare with a larger --val-fraction"
        )
        val_data = None
    tokenizer = modeling.load_tokenizer(args.tokenizer or meta.get("tokenizer") or args.model, args.trust_remote_code)
    if warning := check_fit(config, cfg.ds, world, None, seq_len, gradient_checkpointing=args.gradient_checkpointing):
        _warn(warning)
    return RunPlan(source, config, cfg, pipe, lr_source, seq_len, train_data, val_data, tokenizer, lora)


def check_writable(out_dir: Path) -> None:
    """Fail before any work when the run folder cannot be written (a file in the way, no permission, read-only).

    Creates nothing: an existing folder is probed with a temporary file, a new one by its nearest existing parent.
    """
    try:
        if out_dir.is_dir():
            with tempfile.TemporaryFile(dir=out_dir):
                return
        parent = out_dir.absolute()
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(parent))
        if not os.access(parent, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(parent))
    except OSError as err:
        raise UserError(
            f"--out {out_dir}",
            f"cannot write the run folder ({err.strerror})",
            "pass a folder you can write to with --out",
        ) from None


def pipeline_settings(args: TrainArgs) -> PipelineSettings | None:
    """The "pipeline" section of the preset (after --ds overrides), or None for ZeRO data parallel."""
    raw = dsconfig.load_json(args.deepspeed_config)
    dsconfig.apply_overrides(raw, list(args.ds), args.deepspeed_config)
    return PipelineSettings.from_ds(raw, args.deepspeed_config) if "pipeline" in raw else None


def build_engine(args: TrainArgs, plan: RunPlan) -> tuple[Any, torch.nn.Module, dict[str, str] | None]:
    """Instantiate the model (partitioned at load under ZeRO-3) and wrap it in a DeepSpeed engine."""
    keep_alive = modeling.zero3_context(plan.cfg.ds) if plan.cfg.zero_stage == 3 else None
    torch.manual_seed(args.seed)
    model = modeling.build_model(
        plan.source,
        plan.config,
        vocab_size=len(plan.tokenizer),
        dtype=plan.cfg.precision_choice.torch_dtype,
        attn_implementation=args.attn_implementation,
        experts_implementation=args.experts_impl,
        trust_remote_code=args.trust_remote_code,
    )
    model.config.use_cache = False
    if args.device_map:
        devices = parse_devices(args.device_map_devices)
        placement = place_model(model, devices, plan.seq_len, plan.cfg.batch.micro)
        return LayerSplitEngine(model, placement, plan.cfg.ds), model, None
    if plan.pipe:
        engine, name_map = build_pipeline_engine(
            model, plan.cfg.ds, plan.pipe.stages, plan.pipe.partition, plan.pipe.activation_checkpoint_interval
        )
        return engine, model, name_map
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if plan.lora is not None:  # after the build (ZeRO-3: already partitioned), before initialize
        model = apply_lora(model, plan.lora)
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=plan.cfg.ds)
    engine._deepzero_keep_alive = keep_alive  # HfDeepSpeedConfig must live as long as the engine
    return engine, model, None


def setup(args: TrainArgs) -> Run:
    """Validate everything cheap first (preset, data, model config), then join the group and build the engine."""
    plan = plan_run(args, int(os.environ.get("WORLD_SIZE", "1")))
    if args.resume:  # the first resume after `python -m deepzero.universal` loads the universal checkpoint
        universal.configure_resume(plan.cfg.ds, args.checkpoint_dir)
    rank, world = init_distributed()
    engine, model, name_map = build_engine(args, plan)
    state = checkpoint.load(engine, args.checkpoint_dir) if args.resume else checkpoint.TrainState()
    run_config = {
        "args": vars(args),
        "deepspeed": plan.cfg.ds,
        "precision": plan.cfg.precision_choice.to_json(),
        "env": redact(report.launch_env()),
    }
    grid = getattr(engine, "grid", None)
    run = Run(
        args=args,
        cfg=plan.cfg,
        engine=engine,
        model=model,
        pipe=plan.pipe,
        name_map=name_map,
        tokenizer=plan.tokenizer,
        train_data=plan.train_data,
        val_data=plan.val_data,
        state=state,
        sink=MetricsSink(args.out_dir, args.report_to, run_config, enabled=rank == 0),
        lr_source=plan.lr_source,
        seq_len=plan.seq_len,
        flops_per_token=flops_per_token(model, plan.seq_len),
        peak_tflops=peak_tflops(args.peak_tflops),
        rank=rank,
        world=world,
        dp_rank=grid.data_parallel_id if plan.pipe else rank,
        dp_size=grid.data_parallel_size if plan.pipe else world,
        device=str(engine.first_device) if args.device_map else get_accelerator().current_device_name(),
    )
    if args.resume:
        run.last_saved_step = state.step
    if run.is_main:
        report.write_run_config(run, run_config)
        report.print_header(run, plan.source.spec)
    return run


def _warn(message: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"warning: {message}", file=sys.stderr, flush=True)


def micro_batches(run: Run) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's micro-batches, starting at the first sample the checkpoint had not seen (any world size)."""
    b = run.cfg.batch
    start = universal.data_start_step(run.state.samples_seen, b.global_batch)
    sampler = GlobalBatchSampler(
        len(run.train_data), b.micro, b.accum, run.dp_rank, run.dp_size, run.args.seed, start_step=start
    )
    loader = make_train_loader(run.train_data, sampler, num_workers=1, pin_memory=run.device.startswith("cuda"))
    for batch in loader:  # closing this generator (fit) frees the loader's iterator, which stops its worker
        yield {k: v.to(run.device, non_blocking=True) for k, v in batch.items()}


def fit(run: Run) -> None:
    """Train to ``max_steps``. The data worker is stopped on every way out: the pipeline engine keeps a reference
    to its data iterator, and a worker left to the interpreter's exit (which only sends it SIGTERM) would hang it."""
    with contextlib.closing(micro_batches(run)) as source:
        train_loop(run, pipeline_batches(source) if run.pipe else source)


def train_loop(run: Run, batches: Iterator[Any]) -> None:
    """The loop: accumulate micro-batches, step, and wait for the device only at log/eval/save points."""
    args, batch = run.args, run.cfg.batch
    stop = StopRequest()
    bar = tqdm(total=args.max_steps, initial=run.state.step, disable=None if run.is_main else True, unit="step")
    loss_sum = torch.zeros((), device=run.device)
    bad_streak = torch.zeros((), dtype=torch.int64, device=run.device)  # consecutive steps with non-finite loss
    sync = getattr(run.engine, "synchronize", get_accelerator().synchronize)  # a layer split waits for all cards
    window = Window(sync)
    while run.state.step < args.max_steps:
        step_loss = optimizer_step(run, batches)
        bad_streak = (bad_streak + 1) * (~torch.isfinite(step_loss))
        loss_sum += step_loss
        run.state.step += 1
        run.state.samples_seen += batch.global_batch
        run.state.tokens_seen += run.tokens_per_step
        window.steps += 1
        bar.update(1)
        step = run.state.step
        if step % args.log_interval == 0 or step == args.max_steps:
            elapsed = window.elapsed()
            record = report.train_record(run, loss_sum / (window.steps * batch.accum), window.steps, elapsed)
            bar.set_postfix(
                loss=f"{record['loss']:.3f}", lr=f"{record['lr']:.2e}", tok_s=f"{record['tokens_per_s']:.0f}"
            )
            report.log(run, record, bar)
            check_finite(run, bad_streak)
            loss_sum.zero_()
            window = Window(sync)
        if run.val_data is not None and args.eval_interval and step % args.eval_interval == 0:
            with window.paused():
                report.log(run, evaluate(run), bar)
        if args.save_interval and step % args.save_interval == 0 and check_finite(run, bad_streak):
            with window.paused():
                save_if_finite(run)
        if stop.agreed():
            bar.close()
            if save_if_finite(run):
                raise Preempted(f"{stop.signal_name} at step {step}: checkpoint saved; continue with --resume")
            raise Preempted(f"{stop.signal_name} at step {step}: weights not finite, not saved; {_latest(run)}")
    bar.close()
    stop.restore()


class Window:
    """Wall time of the training steps since the last log point, with evaluation and checkpoint time left out.

    The device is synchronised only where a window is read or paused (log/eval/save points), so the time is
    that of finished work and the steps in between queue up without a host wait.
    """

    def __init__(self, synchronize: Callable[[], Any]) -> None:
        self.synchronize = synchronize
        synchronize()
        self.start, self.steps = time.perf_counter(), 0

    def elapsed(self) -> float:
        self.synchronize()
        return time.perf_counter() - self.start

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Leave the time of the enclosed work out of this window."""
        self.synchronize()
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.start += time.perf_counter() - begin


def optimizer_step(run: Run, batches: Iterator[Any]) -> torch.Tensor:
    """One optimizer step over ``accum`` micro-batches; the sum of their losses, left on the device."""
    engine, accum = run.engine, run.cfg.batch.accum
    if run.pipe:  # DeepSpeed runs the whole 1F1B schedule and returns the mean micro-batch loss
        return train_step(engine, batches).float().to(run.device) * accum
    step_loss = torch.zeros((), device=run.device)
    for _ in range(accum):
        loss = engine(**next(batches)).loss
        engine.backward(loss)
        engine.step()
        step_loss += loss.detach().float().to(step_loss.device)  # under --device-map the loss is on the last card
    return step_loss


class Preempted(Exception):
    """A signal asked the job to stop; a checkpoint was saved. Exit code 0: the scheduler may requeue it."""


def check_finite(run: Run, bad_streak: torch.Tensor) -> bool:
    """True when the last step's loss was finite; stop the run after ``max_nonfinite_steps`` bad steps in a row."""
    streak = int(report.all_reduce_max(float(bad_streak.item())))
    if streak >= run.args.max_nonfinite_steps:
        raise UserError(
            f"step {run.state.step}",
            f"loss was NaN/inf for {streak} steps in a row; stopped without saving ({_latest(run)})",
            "lower --lr or raise --warmup-steps, try bf16 (ds_configs/zero2_bf16.json), check the data; then --resume",
        )
    if streak and run.is_main:
        print(f"warning: step {run.state.step}: loss not finite for {streak} step(s); not saving a checkpoint now")
    return streak == 0


def _latest(run: Run) -> str:
    return f"latest checkpoint: {checkpoint.latest_tag(run.args.checkpoint_dir) or 'none'}"


@torch.no_grad()
def weights_finite(run: Run) -> bool:
    """True when every rank's parameters (under ZeRO-3: its partitions) hold no NaN/inf.

    A finite loss at step s was computed before update s, so only the weights say whether that update broke them.
    """
    module = getattr(run.engine, "module", run.model)
    finite = all(bool(torch.isfinite(_local_values(p)).all()) for p in module.parameters())
    return report.all_reduce_max(0.0 if finite else 1.0) == 0.0


def _local_values(param: torch.Tensor) -> torch.Tensor:
    """The values this rank holds: the whole tensor, or under ZeRO-3 its partition without the padding at the
    end of the last one (DeepSpeed allocates that with torch.empty, so it holds whatever the memory held)."""
    part = getattr(param, "ds_tensor", None)
    if part is None:
        return param
    start = part.ds_numel * dist.get_rank(group=param.ds_process_group)
    return part.narrow(0, 0, max(0, min(part.numel(), param.ds_numel - start)))  # numel 0: swapped out to NVMe


def save_if_finite(run: Run) -> bool:
    """Save a checkpoint unless the weights are broken (then keep the last good one and say so); True if saved."""
    if not weights_finite(run):
        if run.is_main:
            print(f"warning: step {run.state.step}: weights hold NaN/inf; not saving a checkpoint ({_latest(run)})")
        return False
    checkpoint.save(run.engine, run.args.checkpoint_dir, run.state, run.args.keep_last)
    run.last_saved_step = run.state.step
    return True


@torch.no_grad()
def evaluate(run: Run) -> dict[str, Any]:
    """Mean loss and perplexity over ``eval_batches`` micro-batches per data-parallel rank of the val split."""
    engine, micro = run.engine, run.cfg.batch.micro
    per_round = micro * run.dp_size  # equal batch counts on every rank: ZeRO-3 and pipeline forwards are collective
    rows = min(run.args.eval_batches * per_round, len(run.val_data) // per_round * per_round)
    loader = make_eval_loader(run.val_data, micro, run.dp_rank, run.dp_size, max_rows=rows)
    batches = ({k: v.to(run.device) for k, v in batch.items()} for batch in loader)
    if run.pipe:
        loss = eval_step(engine, pipeline_batches(batches), num_micro_batches=rows // per_round)
    else:
        engine.eval()
        total = torch.zeros(2, device=run.device)
        for batch in batches:
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
    if run.last_saved_step != run.state.step and not save_if_finite(run):
        raise UserError(
            f"step {run.state.step}",
            f"the final weights hold NaN/inf; not saved or exported ({_latest(run)})",
            "lower --lr or raise --warmup-steps, try bf16 (ds_configs/zero2_bf16.json); then --resume",
        )
    if run.val_data is not None and args.eval_interval and run.state.step % args.eval_interval:
        report.log(run, evaluate(run), None)
    if args.export:
        probe_loader = make_eval_loader(run.val_data or run.train_data, 1, 0, 1, 1)
        probe = {k: v.to(run.device) for k, v in next(iter(probe_loader)).items()}
        if run.pipe:
            exported = export_pipeline_hf(
                run.engine, run.name_map, run.model, run.tokenizer, args.out_dir / "hf", probe
            )
        elif is_lora(run.engine.module):
            exported = export_lora_hf(run.engine, run.tokenizer, args.out_dir / "hf", probe)
        else:
            exported = export_hf(run.engine, run.tokenizer, args.out_dir / "hf", probe)
        if exported is not None:
            report.log(run, {"kind": "export", "step": run.state.step, **vars(exported), "ok": exported.ok}, None)
            if not exported.ok:
                raise UserError(
                    exported.path,
                    f"the reloaded export differs from the engine: max |Δlogit| {exported.max_abs_logit_diff:.3g} >"
                    f" tolerance {exported.tolerance:.3g} ({exported.dtype}); the trained weights are safe in"
                    f" {args.checkpoint_dir}/{checkpoint.latest_tag(args.checkpoint_dir)}",
                    f"export them with `python -m deepzero.export {args.out_dir} --out {args.out_dir}/hf-fp32`",
                )
    if run.is_main:
        report.print_summary(run)


if __name__ == "__main__":
    exit_process(main())
