"""The training loop: main → setup → fit → finish. It reads top to bottom and never asks how the cards are used:
the engine (``deepzero.engines``) steps, evaluates, saves and exports; the run (``deepzero.run``) was planned and
built before the first step."""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from deepzero import checkpoint, progress, quiet, report, universal
from deepzero.args import parse_args
from deepzero.data import GlobalBatchSampler, make_eval_loader, make_train_loader
from deepzero.distributed import all_reduce_max, exit_process, mean_and_max, report_user_error
from deepzero.engines.base import Batch, to_device
from deepzero.errors import UserError
from deepzero.metrics import peak_memory_gb
from deepzero.moe_balance import padding_id
from deepzero.preemption import StopRequest
from deepzero.run import Run, setup
from deepzero.watchdog import phase

ROW_TRACE_ENV = "DEEPZERO_ROW_TRACE"
"""A folder: every rank records the row ids of its micro-batches there (see ``traced_rows``)."""


def main(argv: list[str] | None = None) -> int:
    """Entry point of train.py: one clear line and exit code 2 for bad input, never a deep stack trace."""
    run = None
    quiet.install()  # torch's and DeepSpeed's messages the user can do nothing about, each by its exact text
    try:
        args = parse_args(argv)
        run = setup(args)
        fit(run)
        finish(run)
    except Preempted as stop:
        if dist.is_initialized() and dist.get_rank() == 0:
            print(f"preempted: {stop}", flush=True)
    except UserError as err:
        return report_user_error(err)
    finally:  # on every way out: the entry point ends without interpreter shutdown (exit_process)
        if run is not None:
            run.sink.close()
    return 0


def micro_batches(run: Run) -> Iterator[Batch]:
    """This rank's micro-batches, starting at the first sample the checkpoint had not seen (any world size)."""
    b, engine = run.cfg.batch, run.engine
    start = universal.data_start_step(run.state.samples_seen, b.global_batch)
    micro, accum, start = engine.objective.sampling(b.micro, b.accum, start)  # GRPO: a prompt batch per generation
    sampler = GlobalBatchSampler(
        len(run.train_data), micro, accum, engine.dp_rank, engine.dp_size, run.args.seed, start_step=start
    )
    trace = os.environ.get(ROW_TRACE_ENV)
    rows = traced_rows(sampler, Path(trace), start, accum, engine.dp_rank) if trace else sampler
    loader = make_train_loader(run.train_data, rows, num_workers=1, pin_memory=engine.device.type == "cuda")
    batches = to_device(iter(loader), engine.device)
    if run.balancer is not None:  # it counts and balances only the real tokens (chat rows end in padding)
        prompts = run.train_data.meta["format"] == "prompts"  # GRPO's completion rows: every token counted
        batches = run.balancer.watch(batches, None if prompts else padding_id(run.train_data.meta))
    yield from batches  # closing this generator (fit) stops the loader's worker


def traced_rows(batches: Iterable[list[int]], folder: Path, start: int, accum: int, rank: int) -> Iterator[list[int]]:
    """The sampler's micro-batches, each also appended to ``folder/rows.rank<r>.jsonl`` as ``{step, micro, rows}``
    (``ROW_TRACE_ENV``; tests use it to check which rows each optimizer step trained on). The loader draws ahead,
    so the file may list a step or two past the last one trained."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / f"rows.rank{rank}.jsonl").open("a") as fh:
        for i, rows in enumerate(batches):
            fh.write(json.dumps({"step": start + i // accum, "micro": i % accum, "rows": rows}) + "\n")
            fh.flush()
            yield rows


def fit(run: Run) -> None:
    """Train to ``max_steps``. The data worker is stopped on every way out: the pipeline engine keeps a reference
    to its data iterator, and a worker left to the interpreter's exit (which only sends it SIGTERM) would hang it."""
    with contextlib.closing(micro_batches(run)) as batches:
        train_loop(run, batches)


def train_loop(run: Run, batches: Iterator[Batch]) -> None:
    """The loop: one optimizer step per iteration, and a wait for the device only at log/eval/save points."""
    args, engine = run.args, run.engine
    stop = StopRequest()
    bar = progress.bar(args.max_steps, show=run.is_main, initial=run.state.step, unit="step")
    loss_sum = torch.zeros((), device=engine.device)
    bad_streak = torch.zeros((), dtype=torch.int64, device=engine.device)  # consecutive steps with non-finite loss
    window = Window(engine.synchronize)
    while run.state.step < args.max_steps:
        with phase("in a training step (its collectives, or GRPO's generation and rewards)", every=True):
            step_loss = engine.train_step(batches)
        if run.balancer is not None:
            run.balancer.after_step()  # the V3 bias update: one all-reduce of the step's loads, no host wait
        bad_streak = (bad_streak + 1) * (~torch.isfinite(step_loss))
        loss_sum += step_loss
        run.state.advance(run.cfg.batch.global_batch, run.tokens_per_step)
        window.steps += 1
        bar.update(1)
        step = run.state.step
        if step % args.log_interval == 0 or step == args.max_steps:
            elapsed = window.elapsed()
            peak_gb, kind = peak_memory_gb()
            (loss,), (peak_gb, streak) = mean_and_max([(loss_sum / window.steps).item()], [peak_gb, bad_streak.item()])
            record = report.train_record(run, loss, window.steps, elapsed, (peak_gb, kind))
            record.update(run.balancer.window_stats() if run.balancer is not None else {})
            bar.set_postfix(loss=f"{loss:.3f}", lr=f"{record['lr']:.2e}", tok_s=f"{record['tokens_per_s']:.0f}")
            report.log(run, record, bar)
            check_finite(run, int(streak))
            loss_sum.zero_()
            window = Window(engine.synchronize)
        if run.val_data is not None and args.eval_interval and step % args.eval_interval == 0:
            with window.paused():
                report.log(run, evaluate(run), bar)
        if args.save_interval and step % args.save_interval == 0 and check_finite(run, global_streak(bad_streak)):
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


class Preempted(Exception):
    """A signal asked the job to stop; a checkpoint was saved. Exit code 0: the scheduler may requeue it."""


def global_streak(bad_streak: torch.Tensor) -> int:
    """The longest run of non-finite losses, up to the last step, over every rank."""
    return int(all_reduce_max(float(bad_streak.item())))


def check_finite(run: Run, streak: int) -> bool:
    """True when the last step's loss was finite (``streak``: :func:`global_streak`); stop the run after
    ``max_nonfinite_steps`` bad steps in a row."""
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


def save_if_finite(run: Run) -> bool:
    """Save a checkpoint unless some rank's weights are broken (then keep the last good one and say so).

    A finite loss at step s was computed before update s, so only the weights say whether that update broke them.
    """
    if all_reduce_max(0.0 if run.engine.weights_finite() else 1.0):
        if run.is_main:
            print(f"warning: step {run.state.step}: weights hold NaN/inf; not saving a checkpoint ({_latest(run)})")
        return False
    checkpoint.save(run.engine, run.args.checkpoint_dir, run.state, run.args.keep_last)
    run.last_saved_step = run.state.step
    return True


def evaluate(run: Run) -> dict[str, Any]:
    """Mean loss and perplexity (preference: rewards) over ``eval_batches`` micro-batches per data-parallel rank of a fixed sample of the
    val split (drawn with ``--seed`` from the whole split: the same rows at every eval and after a resume)."""
    engine = run.engine
    micro = engine.objective.eval_micro(run.cfg.batch.micro)  # GRPO: prompts, each sampled several times
    per_round = micro * engine.dp_size  # equal batch counts on every rank: ZeRO-3 and pipeline forwards are collective
    rows = min(run.args.eval_batches * per_round, len(run.val_data) // per_round * per_round)
    loader = make_eval_loader(run.val_data, micro, engine.dp_rank, engine.dp_size, max_rows=rows, seed=run.args.seed)
    loss = engine.eval_loss(to_device(iter(loader), engine.device), rows // per_round)
    record = {"kind": "eval", "step": run.state.step, "val_loss": loss}
    if engine.objective.perplexity:
        record["val_ppl"] = math.exp(min(loss, 50.0))
    return record | {f"val_{k}": v for k, v in engine.objective.window_stats("eval").items()}


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
        probe = next(to_device(iter(make_eval_loader(run.val_data or run.train_data, 1, 0, 1, 1)), run.engine.device))
        exported = run.engine.export(run.tokenizer, args.out_dir / "hf", probe)
        if exported is not None:
            report.log(run, {"kind": "export", "step": run.state.step, **vars(exported), "ok": exported.ok}, None)
            if not exported.ok:
                raise UserError(
                    exported.path,
                    f"{exported.why}; the trained weights are safe in"
                    f" {args.checkpoint_dir}/{checkpoint.latest_tag(args.checkpoint_dir)}",
                    f"resume from there, or (ZeRO checkpoints) export them offline with `python -m deepzero.export"
                    f" {args.out_dir} --out {args.out_dir}/hf-fp32`",
                )
    if run.is_main:
        report.print_summary(run)


if __name__ == "__main__":
    exit_process(main())
