"""A 4-bit base loaded on the host a rank at a time: under ZeRO-3 partitioned while it loads, so that no card ever
holds the whole base; under ZeRO-0/1/2 a base with fused routed experts, quantised on the host (Transformers leaves
them in 16 bits, which would not fit a card: ``quant.quantise_experts``), then moved to the card whole.

Transformers skips ``zero.Init`` for a quantised load: every rank would put the whole 4-bit base on its card before
``deepspeed.initialize`` partitions it (35 GiB for R1-Distill-Llama-70B, more than a 24 GiB card). Here the ranks of
each machine take turns: one reads the whole base into host RAM (bitsandbytes quantises on the CPU), converts it with
DeepSpeed's ``zero.Init(module=...)`` (each parameter goes whole to the card, then only this rank's partition stays),
moves the buffers and the 4-bit weights' ``QuantState`` to the card, and frees the host copy before the next one
starts. A card holds its partition plus one whole tensor, the host one 4-bit base at a time.

``zero.Init(module=...)`` broadcasts every parameter from rank 0, which would need every rank to hold its whole model
at once. Each rank converts alone instead, without that broadcast; every rank read the same files with the same
quantiser, and the ranks compare fingerprints of what they loaded (codes and QuantStates) before training (one line
if they differ).
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from torch import nn

from deepzero import modeling
from deepzero.adapters.quant import quant_states
from deepzero.distributed import LONG_WAIT
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


def load_in_turns(build_model: Callable[[], nn.Module], ds_config: dict) -> tuple[nn.Module, list[int]]:
    """``build_model()`` (a 4-bit base loaded on the host) on each rank of a machine in turn, partitioned for ZeRO-3
    (else moved to the card whole) before the next rank starts, and its :func:`fingerprint`; the loading rank uses
    every core of the machine. Every rank calls it (torchrun sets LOCAL_WORLD_SIZE, DeepSpeed's launcher LOCAL_SIZE;
    without either, the whole world takes turns)."""
    partition = int(ds_config.get("zero_optimization", {}).get("stage", 0)) == 3
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or os.environ["WORLD_SIZE"])
    device = torch.device(get_accelerator().device_name(local_rank))
    waits = dist.new_group(backend="gloo", timeout=LONG_WAIT)  # the turns' barriers: minutes a turn for a 70B base
    turns = torch.tensor([local_size])
    dist.all_reduce(turns, op=dist.ReduceOp.MAX, group=waits)  # machines with fewer ranks wait as often
    model, prints = None, None
    for turn in range(int(turns)):
        if turn == local_rank:
            threads = torch.get_num_threads()
            torch.set_num_threads(os.cpu_count() or threads)  # the others only wait
            try:
                with modeling.zero3_init_off():  # Transformers refuses a device_map while zero.Init is on
                    model = build_model()
                prints = fingerprint(model)
                if partition:
                    converter = _PartitionAlone(module=model, config_dict_or_path=ds_config)
                    converter.alone = False
                else:
                    model.to(device)
                move_the_rest(model, device)
            finally:
                torch.set_num_threads(threads)
        dist.barrier(group=waits)
    dist.destroy_process_group(waits)
    assert model is not None and prints is not None
    check_same_everywhere(prints)
    return model, prints


@torch.no_grad()
def fingerprint(model: nn.Module) -> list[int]:
    """The CRC-32 of every parameter's bytes (the 4-bit codes and the 16-bit weights: what the ranks' partitions make
    up), read in place, then of every 4-bit weight's ``QuantState`` (:func:`quant_state_print`): the same codes with
    other block scales dequantise to another base."""
    out = [zlib.crc32(_bytes(param)) for param in model.parameters()]
    return out + [quant_state_print(state) for state in quant_states(model)]


def quant_state_print(state: Any, crc: int = 0) -> int:
    """The CRC-32 of a ``QuantState``: its blocksize, quant type, dtype and shape, the bytes of its absmax, code
    (the quantisation map) and offset, and its nested state (double quantisation's) the same way."""
    layout = (state.blocksize, state.quant_type, str(state.dtype), tuple(state.shape or ()), state.state2 is not None)
    crc = zlib.crc32(repr(layout).encode(), crc)
    for tensor in (state.absmax, state.code, state.offset):
        if isinstance(tensor, torch.Tensor):
            crc = zlib.crc32(_bytes(tensor), crc)
        elif tensor is not None:
            crc = zlib.crc32(repr(float(tensor)).encode(), crc)
    return crc if state.state2 is None else quant_state_print(state.state2, crc)


def _bytes(tensor: torch.Tensor) -> Any:
    return tensor.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy()


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
    """What ``zero.Init`` or ``.to`` leaves on the host, to the card: buffers (RoPE's ``inv_freq``) and every
    ``QuantState`` (not parameters; the engine does not move a model that is already partitioned)."""
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.device != device:
                module._buffers[name] = buffer.to(device)
    for state in quant_states(model):
        state.to(device)
