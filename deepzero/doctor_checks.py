"""The environment doctor's checks: versions, GPUs, P2P, NCCL, all-reduce bandwidth, disk, each preset's precision
and op builds, collected into one report (a dict; ``deepzero.doctor`` advises on it and prints it).
"""

from __future__ import annotations

import contextlib
import os
import platform
import queue as queue_mod
import shutil
import sys
import time
from dataclasses import asdict
from datetime import timedelta
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from deepzero import __version__, dsconfig, precision
from deepzero.errors import UserError
from deepzero.op_builds import preset_ops, stale_locks

CKPT_BYTES_PER_PARAM = 14
"""DeepSpeed checkpoint with Adam: bf16 weights (2) + fp32 master weights, exp_avg, exp_avg_sq (4 + 4 + 4)."""
ALLREDUCE_WARMUP = 3
ALLREDUCE_ITERS = 10
ALLREDUCE_TIMEOUT_S = 120.0
MAX_GPU_PROCS = 8
JIT_TOOLS = {"c++": "a C++ compiler (c++ or g++)", "nvcc": "nvcc (in $CUDA_HOME/bin or on PATH)"}
"""What compiles a DeepSpeed op on first use: the C++ compiler everywhere, nvcc too when training on CUDA."""
PRESET_DIR = Path(__file__).resolve().parents[1] / "ds_configs"
_PACKAGES = ("torch", "deepspeed", "transformers", "accelerate")
_ENV_KEYS = ("DS_ACCELERATOR", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_MAX_CONNECTIONS", "OMP_NUM_THREADS")
_ENV_KEYS += ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


# ---------------------------------------------------------------------------------------------- collection


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """Python and the versions of the packages a run needs (None: not installed)."""
    found: dict[str, str | None] = {"python": platform.python_version(), "deepzero": __version__}
    found.update({name: _version(name) for name in _PACKAGES})
    found["torch"] = torch.__version__
    return found


def cuda_info() -> dict[str, Any]:
    """CUDA and NCCL versions torch was built with, and whether a GPU is visible."""
    nccl = None
    with contextlib.suppress(AttributeError, RuntimeError, ImportError):
        raw = torch.cuda.nccl.version()
        nccl = ".".join(map(str, raw)) if isinstance(raw, tuple) else str(raw)
    available = torch.cuda.is_available()
    return {
        "available": available,
        "torch_cuda": torch.version.cuda,
        "nccl": nccl,
        "cudnn": torch.backends.cudnn.version() if available else None,
        "device_count": torch.cuda.device_count() if available else 0,
    }


def gpus() -> list[dict[str, Any]]:
    """Name, memory and compute capability of each visible GPU."""
    if not torch.cuda.is_available():
        return []
    found = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        found.append(
            {
                "index": i,
                "name": props.name,
                "total_memory_gb": round(props.total_memory / 1e9, 2),
                "compute_capability": f"{props.major}.{props.minor}",
            }
        )
    return found


def p2p(n_gpus: int) -> list[dict[str, Any]]:
    """Whether each GPU can access each other GPU's memory directly (ordered pairs)."""
    return [
        {"src": a, "dst": b, "can_access": bool(torch.cuda.can_device_access_peer(a, b))}
        for a in range(n_gpus)
        for b in range(n_gpus)
        if a != b
    ]


def env_settings() -> dict[str, str | None]:
    """NCCL_* variables that are set, and the other variables that change how a run behaves (None: unset)."""
    found: dict[str, str | None] = {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")}
    found.update({k: os.environ.get(k) for k in _ENV_KEYS})
    return found


def deepspeed_info() -> dict[str, Any]:
    """DeepSpeed's detected accelerator and which of its ops cannot be JIT-built here."""
    try:
        from deepspeed.accelerator import get_accelerator
        from deepspeed.git_version_info import installed_ops
        from deepspeed.ops.op_builder.all_ops import ALL_OPS
        from deepspeed.ops.op_builder.builder import probe_is_compatible
        from torch.utils.cpp_extension import is_ninja_available
    except Exception as err:  # a broken deepspeed install shows up as any error at import
        return {"error": f"{type(err).__name__}: {err}"}
    incompatible = [
        name
        for name, builder in ALL_OPS.items()
        if name != "deepspeed_not_implemented" and not probe_is_compatible(builder)
    ]
    return {
        "accelerator": get_accelerator().device_name(),
        "ninja": is_ninja_available(),
        "ops_incompatible": sorted(incompatible),
        "ops_prebuilt": sorted(name for name, built in installed_ops.items() if built),
        "stale_build_locks": [str(lock) for lock in stale_locks()],
    }


def param_count(model: str) -> int:
    """Number of parameters of a model (``--model`` as in plan), counted on the meta device (no weights)."""
    from transformers import AutoModelForCausalLM

    from deepzero.flops import count_params
    from deepzero.modeling import planning_config

    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(planning_config(model)[1])
    return count_params(net).total


def disk(checkpoint_dir: str, model: str | None) -> dict[str, Any]:
    """Free space where checkpoints go (the nearest existing folder), and a checkpoint size estimate."""
    checked = Path(checkpoint_dir).resolve()
    while not checked.exists():
        checked = checked.parent
    usage = shutil.disk_usage(checked)
    n_params = param_count(model) if model else None
    return {
        "path": checkpoint_dir,
        "checked": str(checked),
        "free_gb": round(usage.free / 1e9, 2),
        "total_gb": round(usage.total / 1e9, 2),
        "model": model,
        "n_params": n_params,
        "checkpoint_gb": round(n_params * CKPT_BYTES_PER_PARAM / 1e9, 2) if n_params else None,
    }


# ---------------------------------------------------------------------------------------------- presets


def load_presets(directory: Path = PRESET_DIR) -> dict[str, dict[str, Any] | UserError]:
    """Every preset in ``directory``, sorted, by the path a user passes (ds_configs/x.json); one that does not load
    maps to its error."""
    presets: dict[str, dict[str, Any] | UserError] = {}
    for path in sorted(directory.glob("*.json")):
        name = f"{directory.name}/{path.name}"
        try:
            presets[name] = dsconfig.load_json(path)
        except UserError as err:
            presets[name] = err
    return presets


def preset_precision(
    name: str, cfg: dict[str, Any] | UserError, kernels: precision.DeviceKernels | None
) -> dict[str, Any]:
    """The precision a preset trains in on the device ``kernels`` describes (None: unknown), or why it cannot run."""
    if isinstance(cfg, UserError):
        return {"preset": name, "requested": None, "error": cfg.problem, "fix": cfg.fix}
    requested = precision.requested_precision(cfg)
    if kernels is None:
        return {"preset": name, "requested": requested, "error": "training device unknown", "fix": "repair deepspeed"}
    try:
        choice = precision.decide(requested, name, None, kernels)
    except UserError as err:
        return {"preset": name, "requested": requested, "error": err.problem, "fix": err.fix}
    return {"preset": name, "requested": requested, "dtype": choice.dtype, "reason": choice.reason}


def precision_report(
    presets: dict[str, dict[str, Any] | UserError],
    cpu: precision.DeviceKernels,
    device: precision.DeviceKernels | None,
) -> dict[str, Any]:
    """This CPU's native 16-bit kernels, the training device's (None: deepspeed does not import), and the precision
    each preset trains in on that device."""
    return {
        "cpu": asdict(cpu),
        "device": asdict(device) if device else None,
        "presets": [preset_precision(name, cfg, device) for name, cfg in presets.items()],
    }


def toolchain() -> dict[str, str | None]:
    """Where the compilers of a DeepSpeed JIT op build are (None: not found)."""
    cuda_home = os.environ.get("CUDA_HOME")
    nvcc = Path(cuda_home, "bin", "nvcc") if cuda_home else None
    return {
        "c++": shutil.which("c++") or shutil.which("g++"),
        "nvcc": str(nvcc) if nvcc and nvcc.is_file() else shutil.which("nvcc"),
    }


def preset_build(
    name: str, cfg: dict[str, Any] | UserError, tools: dict[str, str | None], ds: dict[str, Any]
) -> dict[str, Any]:
    """What a preset compiles on first use with ``ds`` (deepspeed_info()) and ``tools`` (toolchain()), and what of
    that is missing here."""
    if isinstance(cfg, UserError):
        return {"preset": name, "ops": [], "build": [], "tools": [], "missing": [f"the preset: {cfg.problem}"]}
    ops = preset_ops(cfg, ds.get("accelerator"))
    build = [op for op in ops if op not in ds.get("ops_prebuilt", [])]
    needed = ([*JIT_TOOLS] if ds.get("accelerator") == "cuda" else ["c++"]) if build else []
    missing = [f"{op}, which DeepSpeed cannot build here" for op in build if op in ds.get("ops_incompatible", [])]
    missing += [JIT_TOOLS[tool] for tool in needed if not tools.get(tool)]
    if build and ds.get("ninja") is False:
        missing.append("ninja")
    return {"preset": name, "ops": ops, "build": build, "tools": needed, "missing": missing}


def build_report(
    presets: dict[str, dict[str, Any] | UserError], ds: dict[str, Any], tools: dict[str, str | None]
) -> dict[str, Any]:
    """The compilers (toolchain()), and per preset the ops it compiles on first use and what of that is missing."""
    return {"toolchain": tools, "presets": [preset_build(name, cfg, tools, ds) for name, cfg in presets.items()]}


# ---------------------------------------------------------------------------------------------- all-reduce


def _allreduce_worker(
    rank: int, world: int, port: int, backend: str, numel: int, iters: int, out: Any, timeout_s: float
) -> None:
    """One rank of the bandwidth test; rank 0 puts the timing on ``out``, a failing rank puts its error."""
    import torch.distributed as dist

    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)

        def sync() -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        buf = torch.zeros(numel, dtype=torch.float32, device=device)
        for _ in range(ALLREDUCE_WARMUP):
            dist.all_reduce(buf)
        sync()
        dist.all_reduce(torch.zeros(1, device=device))  # line the ranks up before the clock starts
        sync()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf)
        sync()
        seconds = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        check = torch.full((1024,), float(rank + 1), device=device)
        dist.all_reduce(check)
        correct = torch.tensor([float(bool((check == world * (world + 1) / 2).all()))], device=device)
        dist.all_reduce(correct, op=dist.ReduceOp.MIN)
        if rank == 0:
            out.put({"rank": 0, "seconds": seconds.item(), "correct": correct.item() == 1.0})
        dist.destroy_process_group()
    except Exception as err:  # reported to the parent, which prints it
        out.put({"rank": rank, "error": f"{type(err).__name__}: {err}"})


def allreduce_bench(size_mb: float, backend: str, world: int, timeout_s: float = ALLREDUCE_TIMEOUT_S) -> dict[str, Any]:
    """All-reduce ``size_mb`` MiB of fp32 across ``world`` local processes; bandwidths in GB/s (1e9 bytes)."""
    numel = max(1, int(size_mb * 2**20) // 4)
    nbytes = numel * 4
    result: dict[str, Any] = {"backend": backend, "world_size": world, "size_mb": size_mb, "iters": ALLREDUCE_ITERS}
    ctx = torch.multiprocessing.get_context("spawn")
    out = ctx.Queue()
    from deepzero.distributed import free_port  # imports deepspeed, which the doctor may find missing

    port = free_port()
    procs = [
        ctx.Process(
            target=_allreduce_worker,
            args=(rank, world, port, backend, numel, ALLREDUCE_ITERS, out, timeout_s),
            daemon=True,
        )
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout_s
    message = None
    try:
        while message is None and time.monotonic() < deadline:
            try:
                message = out.get(timeout=0.5)
            except queue_mod.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    message = {"error": f"a rank exited with code {dead[0].exitcode} without a report"}
    finally:
        for proc in procs:
            proc.join(timeout=5 if message and "seconds" in message else 0.1)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if message is None:
        hint = ": check the NCCL P2P settings" if backend == "nccl" else ""
        return {**result, "error": f"timed out after {timeout_s:.0f} s (a hung collective{hint})"}
    if "error" in message:
        return {**result, "error": f"rank {message.get('rank', '?')}: {message['error']}"}
    seconds = message["seconds"]
    algbw = nbytes / seconds / 1e9
    return {
        **result,
        "time_ms": round(seconds * 1e3, 3),
        "algbw_gbps": round(algbw, 3),
        "busbw_gbps": round(algbw * 2 * (world - 1) / world, 3),
        "correct": message["correct"],
    }


def allreduce(size_mb: float, n_gpus: int) -> dict[str, Any]:
    """The bandwidth test on all local GPUs with NCCL, or on 2 CPU processes with gloo when there are fewer than 2."""
    if size_mb <= 0:
        return {"skipped": "--bandwidth-mb 0"}
    if n_gpus >= 2:
        return {**allreduce_bench(size_mb, "nccl", min(n_gpus, MAX_GPU_PROCS)), "device": "cuda"}
    return {**allreduce_bench(size_mb, "gloo", 2), "device": "cpu"}


def collect(bandwidth_mb: float, checkpoint_dir: str, model: str | None) -> dict[str, Any]:
    """The full report, without advice. Library chatter printed meanwhile goes to stderr."""
    with contextlib.redirect_stdout(sys.stderr):
        disk_report = disk(checkpoint_dir, model)  # first: a bad --model fails fast
        found_gpus = gpus()
        ds = deepspeed_info()
        presets = load_presets()
        device = None if "error" in ds else precision.probe()
        return {
            "versions": versions(),
            "cuda": cuda_info(),
            "gpus": found_gpus,
            "p2p": p2p(len(found_gpus)),
            "env": env_settings(),
            "deepspeed": ds,
            "precision": precision_report(presets, precision.probe_cpu(), device),
            "op_builds": build_report(presets, ds, toolchain()),
            "allreduce": allreduce(bandwidth_mb, len(found_gpus)),
            "disk": disk_report,
        }
