"""peft 0.21 on transformers 5 rewrites ``gate_proj``/``up_proj``/``down_proj`` targets of DeepSeek/Qwen-MoE models
onto the fused routed experts (huggingface/peft#3711): injecting (``lora.wrap``) and loading an adapter folder
(:func:`load_adapter`) here switch that rewrite off, so full-path targets are taken as written."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch


@contextlib.contextmanager
def no_v4_target_remap() -> Iterator[None]:
    """Switch off peft's transformers-4 → 5 MoE target rewrite while injecting: on DeepSeek/Qwen-MoE bases it maps
    every gate_proj/up_proj/down_proj target onto the fused routed experts, dropping the dense and shared-expert
    Linears (huggingface/peft#3711, open in peft 0.21.2)."""
    try:
        from peft.utils import transformers_weight_conversion as conversion
    except ImportError:  # a peft without the rewrite
        yield
        return
    saved = conversion.convert_peft_config_for_transformers
    conversion.convert_peft_config_for_transformers = lambda *args, **kwargs: None
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = saved


def load_adapter(base: torch.nn.Module, folder: str | Path) -> torch.nn.Module:
    """``PeftModel.from_pretrained(base, folder)`` with peft's MoE target rewrite off (:func:`no_v4_target_remap`):
    what stock peft 0.21 needs for adapters on the dense or shared-expert MLP of DeepSeek/Qwen-MoE bases; its fix
    (huggingface/peft#3715) keeps full-path targets as written, the form the folders here use."""
    from peft import PeftModel

    with no_v4_target_remap():
        return PeftModel.from_pretrained(base, folder)
