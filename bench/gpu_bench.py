"""The GPU half of the benchmarks (driven by bench/gpu.sh): matmul ceiling, then training MFU of two models on one card.

    bench/gpu.sh [RESULTS_DIR]                                      # everything, < 8 minutes, on a CUDA machine
    python -m bench.gpu_bench matmul --out bench/results/gpu        # bf16 8192² matmul TFLOP/s
    python -m bench.gpu_bench train --case dense-1.3b --out bench/results/gpu
    python -m bench.gpu_bench report --out bench/results/gpu --results bench/results
    DS_ACCELERATOR=cpu python -m bench.gpu_bench train --case tiny --allow-cpu --out /tmp/g   # CPU smoke test

``train`` builds the case's architecture with ``from_config`` (random weights: nothing is downloaded) directly on the
GPU in bf16, wraps it with ``deepspeed.initialize`` using ds_configs/zero2_bf16.json resolved by deepzero.dsconfig
(ZeRO-2, bf16, AdamW; world size 1), and runs train.py's loop shape: ``accum`` × (forward, backward, step) per
optimizer step, the loss summed on the device, the host synchronized only at window ends. Batches are random token
rows already on the GPU, so the figure is the engine's, without the input pipeline (train.py's is pinned-memory,
non-blocking). FLOPs per token come from deepzero.flops (6 × active non-embedding params + attention). MFU is given
against the datasheet peak (deepzero.flops.PEAK_TFLOPS) and against the matmul ceiling measured by ``matmul``.
Without CUDA every subcommand prints why and exits with status 3 (gpu.sh turns that into a clean exit 0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from bench.scaling import machine, repo_path, write_results

NO_CUDA = 3
DENSE_TARGET_MFU = 0.40


@dataclass(frozen=True)
class Case:
    """One training measurement: an architecture (preset + overrides) and its batch shape."""

    preset: str
    about: str
    seq_len: int
    micro_batch: int
    grad_accum: int
    overrides: dict[str, Any] = field(default_factory=dict)
    warmup_steps: int = 3
    windows: int = 3
    window_steps: int = 4
    gradient_checkpointing: bool = False


CASES: dict[str, Case] = {
    "dense-1.3b": Case(
        preset="deepseek-coder-1.3b",
        about="DeepSeek-Coder-1.3B architecture (Llama, 24 layers, 2048 wide, vocab 32256), random init",
        seq_len=2048,
        micro_batch=8,
        grad_accum=2,
    ),
    "moe-v2-lite-8l": Case(
        preset="deepseek-v2-lite",
        about="DeepSeek-V2-Lite widths (MLA, 64 routed experts top-6 + 2 shared), 8 of its 27 layers, random init",
        seq_len=2048,
        micro_batch=2,
        grad_accum=4,
        overrides={"num_hidden_layers": 8},
    ),
    "tiny": Case(
        preset="tiny-deepseek-v3",
        about="smoke test of this script (CPU)",
        seq_len=256,
        micro_batch=2,
        grad_accum=2,
        warmup_steps=1,
        windows=2,
        window_steps=2,
    ),
}


def require_cuda(allow_cpu: bool = False) -> None:
    """Exit with NO_CUDA and a clear line unless a CUDA device is present (or the CPU smoke test is asked for)."""
    if torch.cuda.is_available() or allow_cpu:
        return
    print(
        "bench/gpu_bench: no CUDA device here (torch.cuda.is_available() is False), so nothing was measured."
        " Run bench/gpu.sh on a machine with an NVIDIA GPU; the CPU benchmarks are bench/scaling.py and"
        " bench/compare_loops.py.",
        file=sys.stderr,
    )
    sys.exit(NO_CUDA)


def matmul(args: argparse.Namespace) -> dict[str, Any]:
    """Dense bf16 matmul throughput (fp32 accumulate, torch's default): the practical ceiling for MFU."""
    require_cuda()
    n, iters = args.n, args.iters
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(10):
        torch.matmul(a, b, out=out)
    runs = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            torch.matmul(a, b, out=out)
        end.record()
        torch.cuda.synchronize()
        runs.append(2 * n**3 * iters / (start.elapsed_time(end) / 1e3) / 1e12)
    from deepzero.flops import peak_tflops

    result = {
        "n": n,
        "iters": iters,
        "tflops": max(runs),
        "tflops_runs": runs,
        "datasheet_tflops": peak_tflops(),
        "allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "machine": machine(),
    }
    print(f"matmul bf16 {n}²: {result['tflops']:.0f} TFLOP/s (datasheet {result['datasheet_tflops']})")
    return result


def init_single_process() -> None:
    """World of one without a launcher (deepspeed --num_gpus=1 sets the same variables)."""
    import deepspeed

    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    deepspeed.init_distributed(verbose=False)


def fused_adam_prebuilt() -> bool:
    """Whether DeepSpeed's FusedAdam op was built at install time (DS_BUILD_FUSED_ADAM=1).

    Otherwise the first use JIT-compiles it with nvcc (a minute or more, and a failure where there is no CUDA
    toolchain), which does not fit gpu.sh's time limits: "auto" then uses torch's AdamW (foreach) through DeepSpeed's
    ``torch_adam`` switch, and says so in the results. ``--optimizer fused`` forces FusedAdam (and its build).
    """
    try:
        from deepspeed.git_version_info import installed_ops

        return bool(installed_ops.get("fused_adam"))
    except ImportError:
        return False


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Train the case for warm-up + windows × window_steps optimizer steps; tokens/s, MFU, peak memory."""
    require_cuda(args.allow_cpu)
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from transformers import AutoModelForCausalLM

    from deepzero import dsconfig
    from deepzero.flops import count_params, flops_per_token, peak_tflops
    from deepzero.presets import PRESETS

    case = CASES[args.case]
    init_single_process()
    device = get_accelerator().current_device_name()
    overrides = list(args.ds)
    optimizer = "FusedAdam"
    if args.optimizer == "torch" or (args.optimizer == "auto" and not fused_adam_prebuilt()):
        overrides.append("optimizer.params.torch_adam=true")
        optimizer = "torch.optim.AdamW (foreach)"
    config = PRESETS[case.preset].config(**case.overrides)
    total_steps = case.warmup_steps + case.windows * case.window_steps
    hints = dsconfig.TrainingHints(
        max_steps=total_steps,
        micro_batch=case.micro_batch,
        grad_accum=case.grad_accum,
        hidden_size=config.hidden_size,
    )
    cfg = dsconfig.resolve(repo_path(args.deepspeed_config), dp_size=1, hints=hints, overrides=overrides)
    torch.manual_seed(0)
    with torch.device(device):  # init on the GPU in bf16: seconds, and no fp32 copy of a 4.6B model
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16, attn_implementation=args.attn_implementation
        )
    if case.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    counts = count_params(model)
    fpt = flops_per_token(model, case.seq_len)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=cfg.ds)
    g = torch.Generator(device=device).manual_seed(0)
    pool = [
        torch.randint(0, config.vocab_size, (case.micro_batch, case.seq_len), device=device, generator=g)
        for _ in range(4)
    ]
    loss_sum = torch.zeros((), device=device)
    step, window_s = 0, []

    def run_steps(n: int) -> None:
        nonlocal step, loss_sum
        for _ in range(n):
            for _ in range(case.grad_accum):
                batch = pool[step % len(pool)]
                loss = engine(input_ids=batch, labels=batch).loss
                engine.backward(loss)
                engine.step()
                loss_sum += loss.detach().float()
            step += 1

    run_steps(case.warmup_steps)
    get_accelerator().synchronize()
    for _ in range(case.windows):
        start = time.perf_counter()
        run_steps(case.window_steps)
        get_accelerator().synchronize()
        window_s.append((time.perf_counter() - start) / case.window_steps)
    step_s = statistics.median(window_s)
    tokens_per_step = case.micro_batch * case.grad_accum * case.seq_len
    tps = tokens_per_step / step_s
    peak = peak_tflops(args.peak_tflops)
    result = {
        "case": args.case,
        **asdict(case),
        "optimizer": optimizer,
        "deepspeed_config": args.deepspeed_config,
        "zero_stage": cfg.zero_stage,
        "precision": cfg.precision,
        "attn_implementation": args.attn_implementation,
        "experts_implementation": getattr(model.config, "_experts_implementation", None),
        "params_total": counts.total,
        "params_active": counts.active,
        "flops_per_token": fpt,
        "tokens_per_step": tokens_per_step,
        "step_time_s": step_s,
        "window_step_times_s": window_s,
        "tokens_per_s": tps,
        "achieved_tflops": fpt * tps / 1e12,
        "datasheet_tflops": peak,
        "mfu_datasheet": fpt * tps / (peak * 1e12) if peak else None,
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        "mean_loss": float(loss_sum) / (step * case.grad_accum),
        "machine": machine(),
    }
    print(
        f"{args.case}: {tps:,.0f} tokens/s, {result['achieved_tflops']:.1f} TFLOP/s"
        + (f", MFU {result['mfu_datasheet']:.1%} of {peak} TFLOP/s" if peak else "")
        + (f", peak {result['peak_mem_gb']:.1f} GB" if result["peak_mem_gb"] else "")
    )
    return result


def report(args: argparse.Namespace) -> dict[str, Any]:
    """Merge the per-step JSON files of ``--out`` into ``gpu.json`` and ``gpu.md`` in ``--results``."""
    out = repo_path(args.out)
    parts = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json"))}
    ceiling = parts.get("matmul", {}).get("tflops")
    cases = {}
    for name in CASES:
        r = parts.get(f"train-{name}")
        if r is None:
            continue
        r["mfu_measured_ceiling"] = r["achieved_tflops"] / ceiling if ceiling else None
        cases[name] = r
    result = {
        "matmul": parts.get("matmul"),
        "cases": cases,
        "missing": [n for n in ("dense-1.3b", "moe-v2-lite-8l") if n not in cases],
        "experts_impl": parts.get("experts_impl-gpu"),
        "train_py": parts.get("train_py"),
    }
    dense = cases.get("dense-1.3b")
    if dense and dense.get("mfu_datasheet") is not None:
        result["dense_target_met"] = dense["mfu_datasheet"] >= DENSE_TARGET_MFU
    write_results(args.results, "gpu", result, markdown(result))
    return result


def markdown(result: dict[str, Any]) -> str:
    mm = result["matmul"]
    gpu = next((r["machine"].get("gpu") for r in [mm, *result["cases"].values()] if r), None) or "unknown GPU"
    lines = [f"# GPU benchmark: {gpu}", ""]
    if mm:
        lines += [
            f"Matmul ceiling (bf16 {mm['n']}², fp32 accumulate): **{mm['tflops']:.0f} TFLOP/s**"
            f" (datasheet dense peak {mm['datasheet_tflops']}).",
            "",
        ]
    lines += [
        "| case | params total / active | seq × micro × accum | tokens/s | step s | FLOPs/token | TFLOP/s"
        " | MFU (datasheet) | MFU (measured ceiling) | peak GB | optimizer |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in result["cases"].items():
        mfu = f"{r['mfu_datasheet']:.1%}" if r.get("mfu_datasheet") is not None else "n/a"
        mfu_c = f"{r['mfu_measured_ceiling']:.1%}" if r.get("mfu_measured_ceiling") is not None else "n/a"
        mem = f"{r['peak_mem_gb']:.1f}" if r.get("peak_mem_gb") else "n/a"
        lines.append(
            f"| {name} | {r['params_total'] / 1e9:.2f}B / {r['params_active'] / 1e9:.2f}B"
            f" | {r['seq_len']} × {r['micro_batch']} × {r['grad_accum']} | {r['tokens_per_s']:,.0f}"
            f" | {r['step_time_s']:.3f} | {r['flops_per_token']:.3g} | {r['achieved_tflops']:.1f} | {mfu} | {mfu_c}"
            f" | {mem} | {r['optimizer']} |"
        )
    for name in result["missing"]:
        lines.append(f"| {name} | did not finish (see gpu.sh output) | | | | | | | | | |")
    if "dense_target_met" in result:
        verdict = "met" if result["dense_target_met"] else "NOT met"
        lines += ["", f"Dense target MFU ≥ {DENSE_TARGET_MFU:.0%} of the datasheet peak: **{verdict}**."]
    if ex := result.get("experts_impl"):
        for s in ex["sizes"]:
            timings = ", ".join(f"{i} {r['median_s'] * 1e3:.1f} ms" for i, r in s["results"].items())
            skipped = "; ".join(f"{i} skipped ({why})" for i, why in s["skipped"].items())
            lines += [
                "",
                f"Experts implementation, {s['size']} forward+backward: {timings}"
                + (f"; {skipped}" if skipped else "")
                + ".",
            ]
    lines += train_py_lines(result.get("train_py"))
    return "\n".join(lines) + "\n"


def train_py_lines(part: dict[str, Any] | None) -> list[str]:
    """train.py's own jobs (bench.gpu_train): measured peak against the planner's, tokens/s, the loss."""
    if not part:
        return []
    lines = [
        "",
        "train.py on this card (bench/gpu_train.py, R1-Distill-Qwen-1.5B architecture, random bf16 weights):",
        "",
        "| job | exit | steps | tokens/s | loss first → last | peak GiB measured | planned | flags |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, j in part["jobs"].items():
        speed = f"{j['tokens_per_s']:,.0f}" if j["tokens_per_s"] else "n/a"
        loss = " → ".join(f"{v:.3f}" for v in j["loss_first_last"]) if j["loss_first_last"] else "n/a"
        peak = f"{j['peak_mem_gib']:.2f} ({j['memory_kind']})" if j["peak_mem_gib"] else "n/a"
        planned = f"{j['planned_gib']:.2f}" if j["planned_gib"] else "n/a"
        flags = " ".join(j["flags"][6:])
        status = "ran past its limit" if j["exit"] is None else j["exit"]
        lines.append(f"| {name} | {status} | {j['steps']} | {speed} | {loss} | {peak} | {planned} | `{flags}` |")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="Exit 0 if a CUDA device is present, else 3 with a message.")
    m = sub.add_parser("matmul", help="bf16 matmul TFLOP/s.")
    m.add_argument("--n", type=int, default=8192)
    m.add_argument("--iters", type=int, default=50)
    t = sub.add_parser("train", help="One ZeRO-2 training case on one device.")
    t.add_argument("--case", choices=list(CASES), required=True)
    t.add_argument("--deepspeed-config", default="ds_configs/zero2_bf16.json")
    t.add_argument("--ds", nargs="*", default=[], help="Extra DeepSpeed overrides, key=value.")
    t.add_argument("--optimizer", choices=["auto", "fused", "torch"], default="auto")
    t.add_argument("--attn-implementation", default="sdpa")
    t.add_argument("--peak-tflops", type=float, default=None, help="Datasheet peak if the GPU name is not known.")
    t.add_argument("--allow-cpu", action="store_true", help="Run on the CPU (smoke test of this script only).")
    r = sub.add_parser("report", help="Merge the parts into gpu.json and gpu.md.")
    r.add_argument("--results", default="bench/results")
    for s in (m, t, r):
        s.add_argument("--out", default="bench/results/gpu", help="Folder of the per-step JSON parts.")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "check":
        require_cuda()
        print(f"bench/gpu_bench: {torch.cuda.get_device_name()} ({torch.cuda.device_count()} visible)")
        return 0
    if args.command == "report":
        report(args)
        return 0
    result = matmul(args) if args.command == "matmul" else train(args)
    out = repo_path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "matmul" if args.command == "matmul" else f"train-{args.case}"
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    from deepzero.distributed import exit_process

    exit_process(main())
