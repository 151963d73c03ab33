"""The end of a LoRA run over a 16-bit model the export cannot read again from files: the engine's whole model
merged in memory into a plain Hugging Face folder (safetensors, original names, loadable without peft), the adapters
alone in peft's format beside it, and the merged folder reloaded and compared with the engine token by token
(``logit_check``). Every rank calls :func:`export_lora_hf`. Only for a base without files (a random-init preset) or
adapters on the fused routed experts (``targets=experts``: the files' per-expert tensors cannot take them, nor the
adapter folder's full-path targets name them); any other LoRA run streams its export from the base's own files, as
QLoRA's does (``deepzero.adapters.exporters``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepzero import modeling
from deepzero.adapters.logit_check import TokenGaps, routing_flips, routing_recorded, token_gaps, tolerance_for
from deepzero.adapters.lora import is_adapter_param, merged_model
from deepzero.adapters.merge import Adapters, write_adapter
from deepzero.distributed import while_one_rank_works
from deepzero.hf_export import (
    ExportReport,
    attn_implementation_of,
    consolidated_state_dict,
    eval_logits,
    publish_and_compare,
)

IN_MEMORY_COPIES = 2.5
"""Whole models in the training dtype this export holds on rank 0's host at once, as the planner counts it
(``plan.memory.export_host_bytes``): the engine's consolidated state dict (gathered to the host under ZeRO-3),
merged in place, and about 1.5 models more beside it (save_pretrained's buffers, the written folder reloaded for the
comparison): ``python -m bench.lora_export_memory`` measured 1.46 × the base above the level before the export (a
208 MB bf16 Llama, r8 attention adapters, ZeRO-2 on the CPU, where the state dict is the engine's own weights; the
streamed export of the same run 0.64 × for its merge, 1.29 × with its round trip; docs/qlora.md)."""


@dataclass(frozen=True)
class LoraExportReport(TokenGaps, ExportReport):
    """ExportReport for a merged adapter. Merging rounds W + B·A·α/r to the weights' dtype once, while the engine
    computes W·x and B·A·x apart: in 16 bits logits agree to that dtype's precision. ``ok``: every token within the
    tolerance, but for near-tie routing flips (``logit_check``); max, p99 and median over tokens are recorded."""

    merged_modules: int = 0
    adapter_path: str = ""
    """The adapters alone in peft's format (empty where they include fused expert tensors)."""

    @property
    def ok(self) -> bool:
        return self.logits_ok

    @property
    def why(self) -> str:
        return self.logits_why("the reloaded export differs from the engine")


@torch.no_grad()
def export_lora_hf(
    engine: Any, tokenizer: Any, out_dir: Path, probe: dict[str, torch.Tensor]
) -> LoraExportReport | None:
    """Merge the adapters and write a plain HF folder (safetensors, original names) on rank 0; reload it without
    peft and compare logits on ``probe`` with the engine. Every rank must call it (ZeRO-3 gathers inside)."""
    with routing_recorded() as routes:
        engine_logits = eval_logits(engine, probe)
    state_dict = consolidated_state_dict(engine)
    report = None
    with while_one_rank_works():  # the others wait on a group of their own, not the main group's 10 minutes
        if engine.global_rank == 0:
            report = _merge_and_compare(engine, state_dict, tokenizer, out_dir, probe, (engine_logits, routes))
    return report


def _merge_and_compare(
    engine: Any, state_dict: dict[str, torch.Tensor], tokenizer: Any, out_dir: Path, probe: dict, engine_run: tuple
) -> LoraExportReport:
    """Rank 0: the adapter folder, the merged folder, and its logits against the engine's (``engine_run``: its
    logits and router calls)."""
    engine_logits, engine_routes = engine_run
    peft_model = engine.module
    base = peft_model.get_base_model()
    wrapped = sum(1 for n, _ in peft_model.named_modules() if n.endswith(".lora_A"))
    adapter_dir = _write_adapter_folder(state_dict, peft_model.peft_config["default"], out_dir)
    same_device = engine.device.type == "cpu"
    with modeling.zero3_init_off():
        merged = merged_model(state_dict, peft_model.peft_config["default"], base.config)
        del state_dict
        attn = attn_implementation_of(base)
        with routing_recorded() as routes:
            diff = publish_and_compare(merged, tokenizer, out_dir, probe, engine_logits, merged.dtype, attn)
        tolerance = tolerance_for(merged.dtype, engine_logits, same_device)
        if merged.dtype == torch.float32 and not same_device:
            tolerance = max(tolerance, 1e-3)  # fp32 GPU kernels reorder sums too (ExportReport.measured)
        gaps = token_gaps(diff, tolerance, routing_flips(engine_routes, routes, merged.dtype))
        report = LoraExportReport(
            path=str(out_dir),
            dtype=str(merged.dtype).removeprefix("torch."),
            tolerance=tolerance,
            merged_modules=wrapped,
            adapter_path=str(adapter_dir or ""),
            **gaps,
        )
    return report


def _write_adapter_folder(state_dict: dict[str, torch.Tensor], config: Any, out_dir: Path) -> Path | None:
    """``<out_dir>-adapter`` in peft's format from the engine's whole state dict, V3's routers (their trained routing
    bias) as modules to save (None where the adapters include fused expert tensors, which the folder's full-path
    targets cannot name)."""
    if config.target_parameters:
        return None
    adapters = {k: v for k, v in state_dict.items() if is_adapter_param(k)}
    folder = out_dir.with_name(f"{out_dir.name}-adapter")
    spec = Adapters.from_state(adapters, config.r, config.lora_alpha, config.lora_dropout)
    base = {k.removeprefix("base_model.model."): v for k, v in state_dict.items() if not is_adapter_param(k)}
    write_adapter(spec.with_routers(base, base.__getitem__), config.base_model_name_or_path or "", folder)
    return folder
