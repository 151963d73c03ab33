"""The live engine's export to a Hugging Face folder (safetensors) at the end of training, checked by reloading it.
The offline export of a saved checkpoint is ``deepzero.export``."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from deepzero.modeling import zero3_init_off
from deepzero.precision import logit_tolerance

SAME_DEVICE_ULPS = 2.0
"""Engine and reload compute in the same dtype on the same CPU: they agree to rounding."""
CROSS_DEVICE_ULPS = 16.0
"""A 16-bit engine on a GPU and its CPU reload use different kernels: a few ulps per layer add up."""


@dataclass(frozen=True)
class ExportReport:
    path: str
    max_abs_logit_diff: float
    dtype: str
    tolerance: float = 1e-3
    """Largest |Δlogit| accepted, from the dtype, the logit scale and whether the engine ran on another device."""

    @property
    def ok(self) -> bool:
        return self.max_abs_logit_diff <= self.tolerance

    @property
    def why(self) -> str:
        """What failed, in one line (for a report that is not ``ok``)."""
        return (
            f"the reloaded export differs from the engine: max |Δlogit| {self.max_abs_logit_diff:.3g} > tolerance"
            f" {self.tolerance:.3g} ({self.dtype})"
        )

    @classmethod
    def measured(
        cls, out_dir: Path, diff: torch.Tensor, dtype: torch.dtype, engine_logits: torch.Tensor, engine_device: str
    ) -> ExportReport:
        """The report of :func:`publish_and_compare`'s result for an engine that ran on ``engine_device``."""
        ulps = SAME_DEVICE_ULPS if engine_device.startswith("cpu") else CROSS_DEVICE_ULPS
        tolerance = logit_tolerance(dtype, engine_logits, ulps)
        if dtype == torch.float32 and not engine_device.startswith("cpu"):
            tolerance = max(tolerance, 1e-3)  # fp32 GPU kernels reorder sums too
        return cls(str(out_dir), diff.max().item(), str(dtype).removeprefix("torch."), tolerance)


def consolidated_state_dict(engine: Any) -> dict[str, torch.Tensor] | None:
    """Full 16-bit weights on rank 0 (ZeRO-3 gathers partitions; a collective, so call it on every rank)."""
    if engine.zero_optimization_partition_weights():
        return engine._zero3_consolidated_16bit_state_dict()
    return engine.module.state_dict() if engine.global_rank == 0 else None


@torch.no_grad()
def export_hf(engine: Any, tokenizer: Any, out_dir: Path, probe: dict[str, torch.Tensor]) -> ExportReport | None:
    """Write ``out_dir`` atomically on rank 0, reload it with from_pretrained, compare logits with the engine."""
    engine_logits = eval_logits(engine, probe)
    state_dict = consolidated_state_dict(engine)
    report = None
    if engine.global_rank == 0:
        dtype = next(iter(state_dict.values())).dtype  # read first: save_pretrained may consume the dict
        attn = attn_implementation_of(engine.module)
        with zero3_init_off():
            diff = publish_and_compare(engine.module, tokenizer, out_dir, probe, engine_logits, dtype, attn, state_dict)
        report = ExportReport.measured(out_dir, diff, dtype, engine_logits, str(engine.device))
    if dist.is_initialized():
        dist.barrier()
    return report


@torch.no_grad()
def eval_logits(engine: Any, probe: dict[str, torch.Tensor]) -> torch.Tensor:
    """The engine's fp32 logits for ``probe`` in eval mode (a forward: under ZeRO-3 every rank must call it)."""
    was_training = engine.training
    engine.eval()
    logits = engine(input_ids=probe["input_ids"]).logits.float().cpu()
    if was_training:
        engine.train()
    return logits


def publish_and_compare(
    model: Any,
    tokenizer: Any,
    out_dir: Path,
    probe: dict[str, torch.Tensor],
    engine_logits: torch.Tensor,
    dtype: torch.dtype,
    attn_implementation: str,
    state_dict: dict | None = None,
) -> torch.Tensor:
    """Publish ``model`` (:func:`publish_hf`), reload it in ``dtype`` and return |reloaded − engine| logits."""
    publish_hf(model, tokenizer, out_dir, state_dict)
    return (reloaded_logits(out_dir, dtype, attn_implementation, probe) - engine_logits).abs()


def publish_hf(model: Any, tokenizer: Any, out_dir: Path, state_dict: dict | None = None) -> None:
    """save_pretrained (safetensors) and the tokenizer under ``<out>.partial``, then renamed to ``out_dir``:
    a crash mid-write never leaves a half-written folder under the final name."""
    tmp = out_dir.with_name(f"{out_dir.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)


@torch.no_grad()
def reloaded_logits(out_dir: Path, dtype: torch.dtype, attn_implementation: str, probe: dict) -> torch.Tensor:
    """Logits of the exported folder, loaded by plain Transformers on the CPU, for ``probe``."""
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=dtype, attn_implementation=attn_implementation)
    reloaded.eval()
    return reloaded(input_ids=probe["input_ids"].cpu()).logits.float()


def attn_implementation_of(module: torch.nn.Module) -> str:
    """The attention kernel ``module`` was built with, to reload its export the same way."""
    return getattr(module.config, "_attn_implementation", None) or "sdpa"
