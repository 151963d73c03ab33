"""A 4-bit base under ZeRO-3, partitioned while it loads, so that no card ever holds the whole base.

Transformers skips ``zero.Init`` for a quantised load: every rank would put the whole 4-bit base on its card before
``deepspeed.initialize`` partitions it (35 GiB for R1-Distill-Llama-70B, more than a 24 GiB card). Here the ranks of
each machine take turns: one reads the whole base into host RAM (bitsandbytes quantises on the CPU), converts it with
DeepSpeed's ``zero.Init(module=...)`` (each parameter goes whole to the card, then only this rank's partition stays),
moves the buffers and the 4-bit weights' ``QuantState`` to the card, and frees the host copy before the next one
starts. A card holds its partition plus one whole tensor, the host one 4-bit base at a time.

``zero.Init(module=...)`` broadcasts every parameter from rank 0, which would need every rank to hold its whole model
at once. Each rank converts alone instead, without that broadcast; every rank read the same files with the same
quantiser, and the ranks compare fingerprints of what they loaded before training (one line if they differ).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from torch import nn

from deepzero import modeling
from deepzero.errors import UserError


class _PartitionAlone(deepspeed.zero.Init):
    """``zero.Init(module=...)`` that keeps this rank's own copy of the module's parameters (no broadcast from rank
    0); parameters converted later (the LoRA adapters, at ``deepspeed.initialize``) are broadcast as usual."""

    alone = True

    def _zero_init_param(self, param: nn.Parameter) -> None:
        if not self.alone:
            super()._zero_init_param(param)
            return
        self._convert_to_deepspeed_param(param)
        param.partition()


def load_partitioned(build_model: Callable[[], nn.Module], ds_config: dict) -> nn.Module:
    """``build_model()`` (a 4-bit base loaded on the host) on each rank of a machine in turn, partitioned for ZeRO-3
    before the next rank starts. Every rank calls it (torchrun sets LOCAL_WORLD_SIZE, DeepSpeed's launcher LOCAL_SIZE;
    without either, the whole world takes turns)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or os.environ["WORLD_SIZE"])
    device = torch.device(get_accelerator().device_name(local_rank))
    model, prints = None, None
    for turn in range(local_size):
        if turn == local_rank:
            with modeling.zero3_init_off():  # Transformers refuses a device_map while zero.Init is on
                model = build_model()
            prints = fingerprint(model)
            converter = _PartitionAlone(module=model, config_dict_or_path=ds_config)
            converter.alone = False
            move_the_rest(model, device)
        dist.barrier()
    assert model is not None and prints is not None
    check_same_everywhere(prints)
    return model


@torch.no_grad()
def fingerprint(model: nn.Module) -> list[int]:
    """Per tensor of the state dict (4-bit codes and their constants included), the sum of its bytes."""
    return [
        int(t.detach().contiguous().view(-1).view(torch.uint8).sum(dtype=torch.int64))
        for t in model.state_dict().values()
        if isinstance(t, torch.Tensor)
    ]


def check_same_everywhere(prints: list[int]) -> None:
    """One line if two ranks loaded different bytes (their partitions would not make one model)."""
    everyone: list[list[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, prints)
    differ = [rank for rank, other in enumerate(everyone) if other != everyone[0]]
    if differ:
        raise UserError(
            "--load-in-4bit under ZeRO-3",
            f"ranks {differ} loaded a different 4-bit base from rank 0 (each rank reads and quantises the files itself)",
            "make every rank read the same model files (one path on shared storage, or identical copies)",
        )


@torch.no_grad()
def move_the_rest(model: nn.Module, device: torch.device) -> None:
    """What ``zero.Init`` leaves on the host, to the card: buffers (RoPE's ``inv_freq``) and each 4-bit weight's
    ``QuantState`` (not parameters; the engine does not move a model that is already partitioned)."""
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.device != device:
                module._buffers[name] = buffer.to(device)
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is not None:
            state.to(device)
