"""Test-only: processes started with this folder on PYTHONPATH see a CPU whose native 16-bit kernels are exactly
those named in DEEPZERO_FAKE_CPU_KERNELS ("", "fp16", "bf16" or "fp16,bf16"), so both branches of the precision
decision run on every machine. Faking a kernel the CPU lacks only makes sense for checks that stop before
DeepSpeed starts (DeepSpeed probes fp16 itself)."""

import os

_SPEC = os.environ.get("DEEPZERO_FAKE_CPU_KERNELS")

if _SPEC is not None:
    import dataclasses

    import deepzero.precision as _precision

    _real_probe_cpu = _precision.probe_cpu
    _kinds = {k for k in _SPEC.split(",") if k}

    def _fake_probe_cpu() -> _precision.DeviceKernels:
        real = _real_probe_cpu()
        detail = f"faked by tests/fake_cpu: {_SPEC or 'none'}"
        return dataclasses.replace(real, fp16="fp16" in _kinds, bf16="bf16" in _kinds, detail=detail)

    _precision.probe_cpu = _fake_probe_cpu
