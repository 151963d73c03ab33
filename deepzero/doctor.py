"""Environment doctor: versions, GPUs, P2P, NCCL, all-reduce bandwidth, disk, each preset's precision and op builds.

For each ds_configs preset the report says the precision it trains in on this machine's training device (against
the native 16-bit kernels of the CPU and of that device) and which DeepSpeed ops it compiles on first use, with what.
The checks that fill the report are ``deepzero.doctor_checks``; this module turns it into advice and prints it.

Run ``python -m deepzero.doctor`` (plain text) or ``python -m deepzero.doctor --json``. Exit code 0 when the
all-reduce test passed or was skipped, 1 when it failed, hung or returned wrong sums, 2 on a bad flag.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

from deepzero import precision
from deepzero.doctor_checks import collect
from deepzero.errors import UserError

P2P_ADVICE = "export NCCL_P2P_DISABLE=1 NCCL_IB_DISABLE=1 (or: source launch/env_4090.sh)"
MIN_FREE_GB = 10.0
LOW_BUSBW_GBPS = 3.0
"""Below this NCCL bus bandwidth a PCIe box is misconfigured (x4 slot, chipset lanes, Gen1 link)."""
OP_HINTS = {  # the ops a training config can need; the others (inference, evoformer, ...) are not advised on
    "async_io": "needed only for NVMe offload: apt install libaio-dev",
    "cpu_adam": "needed for offload_optimizer: cpu (ZeRO-Offload)",
    "fused_adam": "needed for DeepSpeed's Adam/AdamW on GPU",
}
_GEFORCE_40 = re.compile(r"RTX\s*40\d0|40[6-9]0")


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
