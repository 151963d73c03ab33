"""Which floating-point type a run trains in: the preset's choice, checked against what the device computes natively.

Decided once, in :func:`deepzero.dsconfig.resolve`, before any model loads. On a CUDA card a preset's fp16/bf16 is
kept as written (bf16 on a card without it is an error). A CPU is different: DeepSpeed refuses fp16 unless oneDNN has
fp16 kernels (AVX512-FP16 / AMX-FP16), and runs bf16 on any CPU, emulated ~7× slower than fp32 where the CPU lacks
AVX512-BF16 / AMX-BF16. So on a CPU the preset's 16-bit type is kept only where the CPU has native kernels for it,
else the run trains in fp32 — the fastest precision every CPU really has — and says so in one warning line.
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

from deepzero.errors import UserError

PRECISIONS = ("fp32", "fp16", "bf16")
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
"""The one map from a precision name to its torch dtype."""

CPU_FEATURES = {"fp16": ("avx512_fp16", "amx_fp16"), "bf16": ("avx512_bf16", "amx_bf16", "bf16")}
"""/proc/cpuinfo flags that give native kernels for each 16-bit type (x86 AVX-512/AMX; "bf16" is aarch64's)."""


@dataclass(frozen=True)
class DeviceKernels:
    """What one device computes natively: the answer of :func:`probe`, recorded in run_config.json."""

    device: str
    """DeepSpeed's accelerator name: "cpu", "cuda", ..."""
    name: str
    """CPU model or GPU name."""
    fp16: bool
    bf16: bool
    detail: str
    """The evidence, e.g. the CPU flags found, or the GPU's compute capability."""

    def describe(self) -> str:
        have = [t for t in ("fp16", "bf16") if getattr(self, t)]
        return f"{self.name}: native {' and '.join(have) if have else 'fp32 only'} ({self.detail})"


@dataclass(frozen=True)
class Precision:
    """The decision: the type the run trains in, what was asked for, and why."""

    dtype: str
    requested: str
    source: str
    """Where ``requested`` came from: the preset file or --precision."""
    reason: str
    kernels: DeviceKernels

    @property
    def changed(self) -> bool:
        return self.dtype != self.requested

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    def describe(self) -> str:
        """One line for the run header."""
        asked = f"{self.requested} asked by {self.source}"
        return f"precision: {self.dtype} ({asked}; {self.reason})"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (Linux); empty where there is none."""
    path = Path("/proc/cpuinfo")
    if not path.is_file():
        return set()
    for line in path.read_text(errors="replace").splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def cpu_model() -> str:
    path = Path("/proc/cpuinfo")
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                return value.strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def probe_cpu() -> DeviceKernels:
    """Native 16-bit kernels of this CPU. fp16 is what DeepSpeed itself checks (oneDNN's fp16 support); bf16 counts
    as native only with AVX512-BF16 / AMX-BF16 (aarch64: BF16), since oneDNN emulates it on other AVX-512 CPUs."""
    flags = cpu_flags()
    found = {t: sorted(flags.intersection(names)) for t, names in CPU_FEATURES.items()}
    fp16 = bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_fp16_supported())
    bf16 = bool(found["bf16"]) or (not flags and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))
    missing = [f"no {'/'.join(CPU_FEATURES[t][:2])}" for t, native in (("fp16", fp16), ("bf16", bf16)) if not native]
    detail = ", ".join(found["fp16"] + found["bf16"] + missing) or "no /proc/cpuinfo flags"
    return DeviceKernels("cpu", cpu_model(), fp16, bf16, detail)


def probe_cuda() -> DeviceKernels:
    major, minor = torch.cuda.get_device_capability()
    bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    return DeviceKernels("cuda", torch.cuda.get_device_name(), True, bf16, f"compute capability {major}.{minor}")


@cache
def probe() -> DeviceKernels:
    """The kernels of the device this process trains on (DeepSpeed's accelerator)."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    name = accelerator.device_name()
    if name == "cpu":
        return probe_cpu()
    if name == "cuda":
        return probe_cuda()
    fp16, bf16 = bool(accelerator.is_fp16_supported()), bool(accelerator.is_bf16_supported())
    return DeviceKernels(name, name, fp16, bf16, "as DeepSpeed's accelerator reports")


def requested_precision(ds: dict[str, Any]) -> str:
    """The precision a DeepSpeed config asks for (its "bf16"/"bfloat16" or "fp16" section)."""
    for key, dtype in (("bf16", "bf16"), ("bfloat16", "bf16"), ("fp16", "fp16")):
        if isinstance(ds.get(key), dict) and ds[key].get("enabled") is True:
            return dtype
    return "fp32"


def decide(requested: str, source: str, forced: str | None, kernels: DeviceKernels) -> Precision:
    """Pick the training precision. ``forced`` (--precision) wins when the device can run it; a preset's choice is
    kept on GPUs and on CPUs with native kernels for it, and becomes fp32 on a CPU that would emulate it."""
    if forced is not None:
        _check_runnable(forced, kernels)
        return Precision(forced, forced, "--precision", "forced", kernels)
    if requested == "fp32" or getattr(kernels, requested):
        why = "as written" if requested == "fp32" else f"{kernels.name} has native {requested}"
        return Precision(requested, requested, source, why, kernels)
    if kernels.device != "cpu":
        fix = "use an fp16 preset (ds_configs/zero2.json) or --precision fp16" if requested == "bf16" else None
        raise UserError(
            f"{source}: {requested}.enabled",
            f"{kernels.name} ({kernels.detail}) cannot train in {requested}",
            fix or "use --precision fp32",
        )
    instead = "DeepSpeed refuses fp16 there" if requested == "fp16" else "emulated bf16 is several times slower"
    reason = f"this CPU has no native {requested} kernels ({kernels.detail}); {instead}, so fp32"
    return Precision("fp32", requested, source, reason, kernels)


def _check_runnable(dtype: str, kernels: DeviceKernels) -> None:
    if dtype == "fp32" or getattr(kernels, dtype):
        return
    if kernels.device == "cpu" and dtype == "bf16":
        return  # DeepSpeed emulates bf16 on any CPU: slow, but it runs what the user asked for
    raise UserError(
        f"--precision {dtype}",
        f"{kernels.name} has no native {dtype} kernels ({kernels.detail}), so DeepSpeed cannot train in {dtype} here",
        "pass --precision fp32" + ("" if kernels.device == "cpu" else " or --precision fp16"),
    )


def apply(ds: dict[str, Any], dtype: str) -> None:
    """Set the config's precision sections to ``dtype`` in place (keeping the chosen section's other settings)."""
    if "bfloat16" in ds:  # DeepSpeed's older name for the bf16 section
        ds["bf16"] = {**ds.pop("bfloat16"), **(ds.get("bf16") or {})}
    for section in ("fp16", "bf16"):
        if section == dtype:
            ds[section] = {**(ds.get(section) or {}), "enabled": True}
        elif section in ds:
            ds[section] = {**ds[section], "enabled": False}


FP16_MAX = float(torch.finfo(torch.float16).max)


def checkpoint_dtype(config: Any) -> torch.dtype | None:
    """The dtype a checkpoint's config.json says its weights are stored in (``dtype``, formerly ``torch_dtype``)."""
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else None


def fp16_risk(config: Any, precision: Precision, source: str) -> str | None:
    """A warning when a checkpoint stored in bf16/fp32 will be trained in fp16: weights beyond ±65504 overflow."""
    stored = checkpoint_dtype(config)
    if precision.dtype != "fp16" or stored not in (torch.bfloat16, torch.float32):
        return None
    return (
        f"--model {source}: the checkpoint is stored in {str(stored).removeprefix('torch.')} and this run trains in fp16"
        f" ({precision.source}); weights beyond fp16's ±{FP16_MAX:g} would become inf (checked once loaded). Fix: train"
        " in bf16 (ds_configs/zero2_bf16.json, or --precision bf16)"
    )


def check_fp16_range(model: torch.nn.Module, source: str, local: Any = lambda p: p) -> None:
    """Refuse a model whose fp16 copy overflowed at load: the first tensor holding inf, by name. ``local`` gives
    the values this rank holds (ZeRO-3 partitions)."""
    for name, param in model.named_parameters():
        values = local(param)
        if values.dtype == torch.float16 and values.numel() and bool(torch.isinf(values).any()):
            raise UserError(
                f"--model {source}",
                f"{name} holds values beyond fp16's ±{FP16_MAX:g}: they became inf when the weights loaded in fp16",
                "train in bf16 (ds_configs/zero2_bf16.json, or --precision bf16)",
            )


def logit_tolerance(dtype: torch.dtype, reference: torch.Tensor, ulps: float = 4.0) -> float:
    """How far two computations of the same logits may differ when their weights/activations are in ``dtype``:
    ``ulps`` units of ``dtype``'s precision at the logits' scale (fp32: also an absolute 1e-4 floor). Wrong weights
    move logits by the order of the scale itself, far above this."""
    scale = max(float(reference.abs().max()), 1.0)
    floor = 1e-4 if dtype == torch.float32 else 0.0
    return max(floor, ulps * torch.finfo(dtype).eps * scale)


def main() -> int:
    """``python -m deepzero.precision``: this machine's CPU (and training device) and their native 16-bit kernels."""
    cpu = probe_cpu()
    print(f"cpu: {cpu.describe()}")
    device = probe()
    if device.device != "cpu":
        print(f"{device.device}: {device.describe()}")
    for requested in ("fp16", "bf16"):
        try:
            choice = decide(requested, f"a {requested} preset", None, device)
            print(f"a {requested} preset trains in {choice.dtype} here ({choice.reason})")
        except UserError as err:
            print(f"a {requested} preset cannot train here: {err}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
