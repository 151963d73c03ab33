"""Test-only: processes started with this folder on PYTHONPATH see a CPU whose native 16-bit kernels are exactly
those named in DEEPZERO_FAKE_CPU_KERNELS ("", "fp16", "bf16" or "fp16,bf16"), so both branches of the precision
decision run on every machine.

DeepSpeed is told the same about fp16: its CPU accelerator's ``is_fp16_supported`` (and so ``supported_dtypes``
and the engine's "Type fp16 is not supported on your device" check) follows the fake. A faked fp16 therefore
really trains in fp16 — torch computes fp16 on any CPU, only slowly without AVX512-FP16 — which is how the fp16-only
behaviour (loss scaling, skipped overflow steps) is tested on CPUs without it. DeepSpeed runs bf16 on every CPU
(emulated where not native), so there is nothing to fake for bf16 on its side.
"""

import os

_SPEC = os.environ.get("DEEPZERO_FAKE_CPU_KERNELS")
_DS_MODULE = "deepspeed.accelerator.cpu_accelerator"

if _SPEC is not None:
    import dataclasses
    import importlib.abc
    import importlib.machinery
    import sys

    import deepzero.precision as _precision

    _real_probe_cpu = _precision.probe_cpu
    _kinds = {k for k in _SPEC.split(",") if k}

    def _fake_probe_cpu() -> _precision.DeviceKernels:
        real = _real_probe_cpu()
        detail = f"faked by tests/fake_cpu: {_SPEC or 'none'}"
        return dataclasses.replace(real, fp16="fp16" in _kinds, bf16="bf16" in _kinds, detail=detail)

    _precision.probe_cpu = _fake_probe_cpu

    def _fake_deepspeed_fp16(module: object) -> None:
        """DeepSpeed's CPU accelerator reports fp16 exactly when the fake names it (``supported_dtypes`` asks this)."""
        module.CPU_Accelerator.is_fp16_supported = lambda self: "fp16" in _kinds

    class _PatchDeepSpeedOnImport(importlib.abc.MetaPathFinder):
        """Patches DeepSpeed's CPU accelerator once it is imported; importing DeepSpeed here would slow every process
        and print its accelerator banner into their output."""

        def find_spec(self, name: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
            if name != _DS_MODULE:
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def exec_and_patch(module: object) -> None:
                exec_module(module)
                _fake_deepspeed_fp16(module)

            spec.loader.exec_module = exec_and_patch
            return spec

    sys.meta_path.insert(0, _PatchDeepSpeedOnImport())
