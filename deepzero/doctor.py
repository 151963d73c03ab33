"""Environment doctor: versions, GPUs, P2P, NCCL, all-reduce bandwidth, disk, each preset's precision and op builds.

For each ds_configs preset the report says the precision it trains in on this machine's training device (against
the native 16-bit kernels of the CPU and of that device) and which DeepSpeed ops it compiles on first use, with what.

Run ``python -m deepzero.doctor`` (plain text) or ``python -m deepzero.doctor --json``. Exit code 0 when the
all-reduce test passed or was skipped, 1 when it failed, hung or returned wrong sums, 2 on a bad flag.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import queue as queue_mod
import re
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

P2P_ADVICE = "export NCCL_P2P_DISABLE=1 NCCL_IB_DISABLE=1 (or: source launch/env_4090.sh)"
CKPT_BYTES_PER_PARAM = 14
"""DeepSpeed checkpoint with Adam: bf16 weights (2) + fp32 master weights, exp_avg, exp_avg_sq (4 + 4 + 4)."""
MIN_FREE_GB = 10.0
LOW_BUSBW_GBPS = 3.0
"""Below this NCCL bus bandwidth a PCIe box is misconfigured (x4 slot, chipset lanes, Gen1 link)."""
ALLREDUCE_WARMUP = 3
ALLREDUCE_ITERS = 10
ALLREDUCE_TIMEOUT_S = 120.0
MAX_GPU_PROCS = 8
OP_HINTS = {  # the ops a training config can need; the others (inference, evoformer, ...) are not advised on
    "async_io": "needed only for NVMe offload: apt install libaio-dev",
    "cpu_adam": "needed for offload_optimizer: cpu (ZeRO-Offload)",
    "fused_adam": "needed for DeepSpeed's Adam/AdamW on GPU",
}
JIT_TOOLS = {"c++": "a C++ compiler (c++ or g++)", "nvcc": "nvcc (in $CUDA_HOME/bin or on PATH)"}
"""What compiles a DeepSpeed op on first use: the C++ compiler everywhere, nvcc too when training on CUDA."""
PRESET_DIR = Path(__file__).resolve().parents[1] / "ds_configs"
_PACKAGES = ("torch", "deepspeed", "transformers", "accelerate")
_ENV_KEYS = ("DS_ACCELERATOR", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_MAX_CONNECTIONS", "OMP_NUM_THREADS")
_ENV_KEYS += ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
_GEFORCE_40 = re.compile(r"RTX\s*40\d0|40[6-9]0")


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


# ---------------------------------------------------------------------------------------------- advice


def _is_geforce_40(name: str) -> bool:
    return bool(_GEFORCE_40.search(name))


def _p2p_disabled(env: dict[str, str | None]) -> bool:
    return env.get("NCCL_P2P_DISABLE") == "1" or (env.get("NCCL_P2P_LEVEL") or "").upper() == "LOC"


def advice(report: dict[str, Any]) -> list[str]:
    """What to change, one line each, from a report (pure: reads only ``report``)."""
    tips: list[str] = []
    found_gpus = report.get("gpus", [])
    env = report.get("env", {})
    no_p2p = any(not pair["can_access"] for pair in report.get("p2p", []))
    if any(_is_geforce_40(g["name"]) for g in found_gpus) and no_p2p and not _p2p_disabled(env):
        tips.append(P2P_ADVICE)
    if not found_gpus:
        tips.append(
            "no CUDA GPU: training runs on CPU with the gloo backend (fine for tests, far too slow for real runs)"
        )
    for g in found_gpus:
        if tuple(int(x) for x in g["compute_capability"].split(".")) < (8, 0):
            tips.append(f"GPU {g['index']} ({g['name']}, cc {g['compute_capability']}) has no bf16: use an fp16 config")
    ds = report.get("deepspeed", {})
    if "error" in ds:
        tips.append(f"deepspeed does not import: {ds['error']}")
    if found_gpus and ds.get("accelerator") not in (None, "cuda"):
        tips.append(
            f"DeepSpeed picked the {ds['accelerator']} accelerator although CUDA GPUs are visible: "
            "unset DS_ACCELERATOR or export DS_ACCELERATOR=cuda"
        )
    for lock in ds.get("stale_build_locks", []):
        tips.append(f"{lock} was left by a killed DeepSpeed op build; every launch waits on it for ever: rm {lock}")
    if ds.get("ninja") is False:
        tips.append("ninja is missing: DeepSpeed cannot JIT-build its ops (pip install ninja)")
    training_ops = [op for op in ds.get("ops_incompatible", []) if op in OP_HINTS]
    if training_ops:
        named = "; ".join(f"{op} ({OP_HINTS[op]})" for op in training_ops)
        tips.append(f"note: DeepSpeed ops that cannot be built here: {named}. Configs that need them fail at startup")
    tips += _precision_advice(report.get("precision", {}))
    tips += _disk_advice(report.get("disk", {}))
    geforce = any(_is_geforce_40(g["name"]) for g in found_gpus) and not _p2p_disabled(env)
    hint = f" ({P2P_ADVICE})" if geforce and P2P_ADVICE not in tips else ""
    tips += _allreduce_advice(report.get("allreduce", {}), hint)
    return tips


def _precision_advice(p: dict[str, Any]) -> list[str]:
    """When ranks train on a CPU without native kernels for a 16-bit type: the presets that fall back to fp32."""
    device = p.get("device")
    if not device or device["device"] != "cpu":
        return []
    fallen = [row["preset"] for row in p["presets"] if row.get("dtype") == "fp32" and row["requested"] != "fp32"]
    if not fallen:
        return []
    lacking = [dtype for dtype in ("fp16", "bf16") if not device[dtype]]
    forced = "fp32, bf16 or fp16" if device["fp16"] else "fp32 or bf16"  # fp16 without native kernels is refused
    emulated = "" if device["bf16"] else "; bf16 runs emulated here, several times slower"
    return [
        f"this CPU ({device['name']}) has no native {' or '.join(lacking)} kernels, so {', '.join(fallen)} "
        f"{'trains' if len(fallen) == 1 else 'train'} in fp32 here; --precision forces a type ({forced}{emulated})"
    ]


def _disk_advice(d: dict[str, Any]) -> list[str]:
    """Less than MIN_FREE_GB free, or less than two checkpoints' worth when the model is known."""
    if "free_gb" not in d:
        return []
    reasons = []
    if d["free_gb"] < MIN_FREE_GB:
        reasons.append(f"less than {MIN_FREE_GB:.0f} GB")
    if d.get("checkpoint_gb") and d["free_gb"] < 2 * d["checkpoint_gb"]:
        reasons.append(f"one {d['model']} checkpoint is ~{d['checkpoint_gb']:.1f} GB and a save needs room for two")
    if not reasons:
        return []
    return [
        f"low disk: {d['free_gb']:.1f} GB free for {d['path']} ({'; '.join(reasons)}): free space or use --out elsewhere"
    ]


def _allreduce_advice(ar: dict[str, Any], hint: str) -> list[str]:
    """``hint`` is appended to failures: the P2P advice on GeForce RTX 40 boxes that did not get it yet."""
    if "error" in ar:
        return [f"all-reduce test failed: {ar['error']}{hint}"]
    if ar.get("correct") is False:
        return [f"all-reduce returned wrong sums: typical of broken GPU peer-to-peer{hint or ' (NCCL_P2P_DISABLE=1)'}"]
    if ar.get("backend") == "nccl" and ar.get("busbw_gbps", LOW_BUSBW_GBPS) < LOW_BUSBW_GBPS:
        return [
            f"low NCCL bus bandwidth ({ar['busbw_gbps']:.1f} GB/s): check each GPU's PCIe link "
            "(nvidia-smi -q | grep -A2 'Link Width'); ZeRO steps will be communication-bound"
        ]
    return []


# ---------------------------------------------------------------------------------------------- output


def _section(title: str, rows: list[tuple[str, Any]]) -> list[str]:
    width = max((len(k) for k, _ in rows), default=0)
    lines = [title]
    lines += [f"  {k.ljust(width)}  {'-' if v is None else v}" for k, v in rows]
    return [*lines, ""]


def _p2p_matrix(report: dict[str, Any]) -> list[tuple[str, Any]]:
    n = len(report["gpus"])
    if n < 2:
        return [("pairs", "none (fewer than 2 GPUs)")]
    ok = {(p["src"], p["dst"]): p["can_access"] for p in report["p2p"]}
    header = ("src\\dst", "  ".join(f"{b:>3}" for b in range(n)))
    rows = [
        (str(a), "  ".join(f"{'-' if a == b else ('yes' if ok[a, b] else 'no'):>3}" for b in range(n)))
        for a in range(n)
    ]
    return [header, *rows]


def _allreduce_line(ar: dict[str, Any]) -> list[tuple[str, Any]]:
    if "skipped" in ar:
        return [("skipped", ar["skipped"])]
    rows = [
        ("setup", f"{ar['backend']} x{ar['world_size']} on {ar['device']}, {ar['size_mb']} MiB, {ar['iters']} iters")
    ]
    if "error" in ar:
        return [*rows, ("error", ar["error"])]
    return [
        *rows,
        ("time", f"{ar['time_ms']:.2f} ms per all-reduce"),
        ("algbw", f"{ar['algbw_gbps']:.2f} GB/s"),
        ("busbw", f"{ar['busbw_gbps']:.2f} GB/s"),
        ("sums", "correct" if ar["correct"] else "WRONG"),
    ]


def _env_rows(env: dict[str, str | None]) -> list[tuple[str, Any]]:
    rows = list(env.items())
    return rows if any(k.startswith("NCCL_") for k in env) else [("NCCL_*", "none set"), *rows]


def _precision_cell(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"cannot run: {row['error']} (fix: {row['fix']})"
    if row["dtype"] == row["requested"]:
        return f"{row['dtype']} ({row['reason']})"
    return f"{row['dtype']}, not the {row['requested']} it asks for ({row['reason']})"


def _precision_rows(p: dict[str, Any]) -> list[tuple[str, Any]]:
    cpu, device = p["cpu"], p["device"]
    if device is None:
        trains_on = "unknown (deepspeed does not import)"
    else:
        trains_on = (
            "this CPU" if device == cpu else f"{device['device']}, {precision.DeviceKernels(**device).describe()}"
        )
    rows = [("cpu", precision.DeviceKernels(**cpu).describe()), ("trains on", trains_on)]
    return rows + [(row["preset"], _precision_cell(row)) for row in p["presets"]]


def _build_cell(row: dict[str, Any]) -> str:
    status = f"missing: {', '.join(row['missing'])}" if row["missing"] else "ok"
    if not row["ops"]:
        return f"no DeepSpeed op to compile: {status}"
    if not row["build"]:
        return f"{', '.join(row['ops'])} (prebuilt): {status}"
    return f"{', '.join(row['build'])}, compiled on first use with {' + '.join(row['tools'])}: {status}"


def _build_rows(b: dict[str, Any]) -> list[tuple[str, Any]]:
    return [*b["toolchain"].items(), *((row["preset"], _build_cell(row)) for row in b["presets"])]


def render_text(report: dict[str, Any]) -> str:
    """The report as aligned plain-text sections."""
    ds = report["deepspeed"]
    gpu_rows = [
        (str(g["index"]), f"{g['name']}  {g['total_memory_gb']:.1f} GB  cc {g['compute_capability']}")
        for g in report["gpus"]
    ]
    d = report["disk"]
    disk_rows = [
        ("path", f"{d['path']} (checked {d['checked']})"),
        ("free", f"{d['free_gb']:.1f} / {d['total_gb']:.1f} GB"),
    ]
    if d["checkpoint_gb"]:
        disk_rows.append(
            ("checkpoint", f"~{d['checkpoint_gb']:.1f} GB for {d['model']} ({d['n_params'] / 1e9:.2f}B params)")
        )
    lines = [
        *_section("versions", list(report["versions"].items())),
        *_section("cuda", list(report["cuda"].items())),
        *_section("gpus", gpu_rows or [("none", "no CUDA GPU visible")]),
        *_section("p2p (torch.cuda.can_device_access_peer)", _p2p_matrix(report)),
        *_section("environment", _env_rows(report["env"])),
        *_section("deepspeed", [(k, ", ".join(v) if isinstance(v, list) else v) for k, v in ds.items()]),
        *_section("precision per preset (native 16-bit kernels)", _precision_rows(report["precision"])),
        *_section("op builds per preset (DeepSpeed JIT)", _build_rows(report["op_builds"])),
        *_section("all-reduce", _allreduce_line(report["allreduce"])),
        *_section("disk", disk_rows),
        "advice",
        *([f"  - {tip}" for tip in report["advice"]] or ["  none: looks good"]),
    ]
    return "\n".join(lines)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m deepzero.doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--bandwidth-mb", type=float, default=64, help="all-reduce size in MiB; 0 skips the test")
    parser.add_argument("--checkpoint-dir", default="runs", help="where checkpoints go (free space is checked there)")
    parser.add_argument("--model", default=None, help="preset or local folder: size its checkpoint for the disk check")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Collect, advise, print. See the module docstring for exit codes."""
    args = _parse(argv)
    try:
        report = collect(args.bandwidth_mb, args.checkpoint_dir, args.model)
    except UserError as err:
        print(err, file=sys.stderr)
        return 2
    report["advice"] = advice(report)
    print(json.dumps(report, indent=2) if args.json else render_text(report))
    ar = report["allreduce"]
    return 1 if "error" in ar or ar.get("correct") is False else 0


if __name__ == "__main__":
    sys.exit(main())
