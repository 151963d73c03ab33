"""Export a trained DeepSpeed engine to a Hugging Face folder (safetensors) and prove it loads back identically."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM


@dataclass(frozen=True)
class ExportReport:
    path: str
    max_abs_logit_diff: float
    dtype: str

    @property
    def ok(self) -> bool:
        return self.max_abs_logit_diff <= 1e-3


def consolidated_state_dict(engine: Any) -> dict[str, torch.Tensor] | None:
    """Full 16-bit weights on rank 0 (ZeRO-3 gathers partitions; a collective, so call it on every rank)."""
    if engine.zero_optimization_partition_weights():
        return engine._zero3_consolidated_16bit_state_dict()
    return engine.module.state_dict() if engine.global_rank == 0 else None


@torch.no_grad()
def export_hf(engine: Any, tokenizer: Any, out_dir: Path, probe: dict[str, torch.Tensor]) -> ExportReport | None:
    """Write ``out_dir`` atomically on rank 0, reload it with from_pretrained, compare logits with the engine."""
    was_training = engine.training
    engine.eval()
    engine_logits = engine(input_ids=probe["input_ids"]).logits.float().cpu()
    if was_training:
        engine.train()
    state_dict = consolidated_state_dict(engine)
    report = None
    if engine.global_rank == 0:
        with _zero3_init_off():
            report = _write_and_verify(engine, tokenizer, out_dir, state_dict, probe, engine_logits)
    if dist.is_initialized():
        dist.barrier()
    return report


@contextlib.contextmanager
def _zero3_init_off() -> Iterator[None]:
    """Rank 0 alone saves and reloads: Transformers must not wrap that in zero.Init (a collective → deadlock)."""
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


def _write_and_verify(
    engine: Any, tokenizer: Any, out_dir: Path, state_dict: dict, probe: dict, engine_logits: torch.Tensor
) -> ExportReport:
    """Save on rank 0 under a temporary name, publish with a rename, reload and compare logits."""
    tmp = out_dir.with_name(f"{out_dir.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    module = engine.module
    dtype = next(iter(state_dict.values())).dtype  # read first: save_pretrained may consume the dict
    module.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=dtype, attn_implementation=_attn(module))
    reloaded.eval()
    logits = reloaded(input_ids=probe["input_ids"].cpu()).logits.float()
    diff = (logits - engine_logits).abs().max().item()
    return ExportReport(str(out_dir), diff, str(dtype).removeprefix("torch."))


def _attn(module: torch.nn.Module) -> str:
    return getattr(module.config, "_attn_implementation", None) or "sdpa"
