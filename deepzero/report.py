"""What a run reports: the start-up header, one record per log point, the closing summary. Formatting and writing
only: the numbers come from the loop (collectives in ``deepzero.distributed``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist
from tqdm.auto import tqdm

from deepzero.flops import count_params, routed_experts


class RunView(Protocol):
    """What the header, the log records and the summary read of a run (``deepzero.run.Run`` has it): report
    formats and writes, it never imports the run that calls it."""

    args: Any
    cfg: Any
    engine: Any
    train_data: Any
    val_data: Any
    state: Any
    sink: Any
    balancer: Any
    savers: Any
    history: list[dict[str, Any]]
    lr_source: str
    seq_len: int
    world: int
    flops_per_token: float
    peak_tflops: float | None
    reference_line: str | None

    @property
    def is_main(self) -> bool: ...

    @property
    def tokens_per_step(self) -> int: ...


def train_record(run: RunView, loss: float, steps: int, elapsed: float, peak_mem: tuple[float, str]) -> dict[str, Any]:
    """One logging point: global mean loss, lr, loss scale, grad norm, throughput, MFU, peak memory."""
    engine = run.engine
    tokens_per_s = steps * run.tokens_per_step / max(elapsed, 1e-9)
    mem_gb, mem_kind = peak_mem
    record: dict[str, Any] = {
        "kind": "train",
        "step": run.state.step,
        "loss": loss,
        "lr": engine.lr(),
        "grad_norm": engine.grad_norm(),
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": tokens_per_s / run.world,
        "step_time_s": elapsed / steps,
        "tokens_seen": run.state.tokens_seen,
        f"peak_{mem_kind}_mem_gb": mem_gb,
        "skipped_steps": engine.skipped_steps(),
    }
    if (scale := engine.loss_scale()) is not None:
        record["loss_scale"] = scale
    record.update(engine.objective.window_stats("train"))  # a collective: every rank logs
    if phases := [v for k, v in record.items() if k.startswith("timing/")]:  # GRPO: the rest of the step trains
        record["timing/train_s"] = max(record["step_time_s"] - sum(phases), 0.0)
    if run.peak_tflops:
        record["mfu"] = run.flops_per_token * tokens_per_s / (run.peak_tflops * 1e12 * run.world)
    return record


def log(run: RunView, record: dict[str, Any], bar: tqdm | None) -> None:
    run.history.append(record)
    if not run.is_main:
        return
    run.sink.log(record)
    text = "  ".join(_fmt(k, v) for k, v in record.items() if k != "kind" and not isinstance(v, list))
    (bar.write if bar is not None else print)(f"[{record['kind']}] {text}")


def _fmt(key: str, value: Any) -> str:
    if isinstance(value, float):
        return f"{key}={value:.4g}"
    return f"{key}={value}"


def launch_env() -> dict[str, str]:
    keep = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "DS_ACCELERATOR")
    return {k: v for k, v in os.environ.items() if k in keep or k.startswith(("NCCL_", "WANDB_", "HF_"))}


def write_run_config(out_dir: Path, run_config: dict[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "run_config.json").write_text(json.dumps(run_config, indent=2, default=str))


def print_header(run: RunView, model_name: str) -> None:
    model, cfg = run.engine.model, run.cfg
    counts = count_params(model)
    lines = [
        f"model: {model_name}  params {counts.total / 1e6:,.2f}M (active {counts.active / 1e6:,.2f}M)"
        f"  attention {model.config._attn_implementation}"
        + (f"  experts {model.config._experts_implementation}" if routed_experts(model.config) else ""),
        f"deepspeed: {cfg.path}  ZeRO-{cfg.zero_stage}  {cfg.precision}"
        + (f"  offload {'+'.join(cfg.offload)}" if cfg.offload else "")
        + run.engine.describe()
        + f"  world {run.world} on {run.engine.device.type} ({dist.get_backend()})",
        cfg.precision_choice.describe(),
        cfg.batch.describe(run.seq_len),
        *([run.balancer.choice.describe()] if run.balancer is not None else []),
        *([run.savers.describe()] if run.savers is not None else []),
        f"lr: peak {cfg.ds['optimizer']['params']['lr']:g} from {run.lr_source}; scheduler {cfg.ds.get('scheduler', {}).get('type', 'none')}"
        f" {_sched_brief(cfg.ds)}",
        _data_line(run) + f"; {run.engine.objective.describe()}",
        *([run.reference_line] if run.reference_line else []),
        f"FLOPs/token {run.flops_per_token:.3g}; MFU "
        + (
            f"against {run.peak_tflops} TFLOP/s per device"
            if run.peak_tflops
            else "not reported (no known peak: pass --peak-tflops)"
        ),
    ]
    if run.args.replaced:
        lines.append(f"recipe: {run.args.config}; the command line replaced {', '.join(run.args.replaced)}")
    if run.state.step:
        lines.append(f"resumed from step {run.state.step} ({run.state.tokens_seen:,} tokens seen)")
    print("\n".join(lines), flush=True)


def _data_line(run: RunView) -> str:
    """What the run trains on: rows and their packing, pairs, or prompts (GRPO generates the rest of each row)."""
    train, val = run.train_data, run.val_data
    prompt_len = getattr(train, "max_prompt_len", None)
    if prompt_len is not None:
        held_out = f", {len(val):,} val prompts" if val is not None else ""
        return f"data: {run.args.data}  {len(train):,} train prompts{held_out} of at most {prompt_len} tokens"
    line = f"data: {run.args.data}  {len(train) * train.rows_per_sample:,} train rows × {run.seq_len} tokens"
    line += f", {len(val) * val.rows_per_sample:,} val rows" if val is not None else ""
    if train.rows_per_sample == 2:
        return line + f" ({len(train):,} train pairs, 2 rows each)"
    return line + f"; packing {_PACKING[run.args.packing]}"


_PACKING = {
    "documents": "documents (each attends to itself, positions restart)",
    "stream": "stream (a row is one sequence)",
}


def _sched_brief(ds: dict[str, Any]) -> str:
    params = ds.get("scheduler", {}).get("params", {})
    decay = f", decay to step {params['total_num_steps']}" if "total_num_steps" in params else ""
    return f"(warmup {params['warmup_num_steps']} steps{decay})" if "warmup_num_steps" in params else ""


def print_summary(run: RunView) -> None:
    train = [r for r in run.history if r["kind"] == "train"]
    evals = [r for r in run.history if r["kind"] == "eval"]
    parts = [f"done: {run.state.step} steps, {run.state.tokens_seen:,} tokens"]
    if train:
        parts.append(f"loss {train[0]['loss']:.3f} (step {train[0]['step']}) → {train[-1]['loss']:.3f}")
    if evals and "val_ppl" in evals[-1]:
        parts.append(f"val ppl {evals[-1]['val_ppl']:.2f}")
    if train and "rewards/accuracies" in train[-1]:
        parts.append(
            f"reward accuracy {train[0]['rewards/accuracies']:.2f} → {train[-1]['rewards/accuracies']:.2f}, margin"
            f" {train[0]['rewards/margins']:.3g} → {train[-1]['rewards/margins']:.3g}"
        )
    parts.append(f"metrics: {run.sink.path}")
    print("; ".join(parts), flush=True)
