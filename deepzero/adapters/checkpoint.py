"""What a checkpoint of a run over a frozen 4-bit base holds: the adapters, never the base.

DeepSpeed's checkpoint holds the module's state dict, and ZeRO-1/2 also the fragments of every frozen parameter. For
QLoRA that is the whole 4-bit base plus each weight's ``QuantState`` entries (``weight.absmax``, ``weight.quant_map``,
...), which a strict load rejects. Here a save keeps only what trains and the persistent buffers (routing biases),
and a load restores exactly those. The base is read again from the model source at start and compared with the
fingerprint the checkpoint recorded (the bytes of every parameter and every ``QuantState``: block scales, code,
nested state), so a resume on other base files, or on the same files quantised otherwise, stops in one line instead of
training on them.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
from torch import nn

from deepzero.errors import UserError

BASE_KEY = "four_bit_base"
"""The checkpoint's client_state key for the base's fingerprint."""


def base_fingerprint(prints: list[int], storage: str, quant_states: int = 0) -> dict[str, Any]:
    """One record for the CRC-32s of the loaded base (``partitioned_load.fingerprint``: every parameter, then the
    last ``quant_states`` are every 4-bit weight's ``QuantState``; ``tensors`` counts both). ``params_crc32`` is the
    parameters' alone: all a checkpoint written before the QuantState was fingerprinted holds."""
    params = prints[: len(prints) - quant_states]
    return {
        "tensors": len(prints),
        "crc32": f"{_crc(prints):08x}",
        "storage": storage,
        "quant_states": quant_states,
        "params_crc32": f"{_crc(params):08x}",
    }


def _crc(prints: list[int]) -> int:
    return zlib.crc32(np.asarray(prints, dtype=np.uint32).tobytes())


def kept_keys(model: nn.Module) -> set[str]:
    """State-dict keys a checkpoint holds: the trainable parameters and the persistent buffers."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    return trainable | set(persistent_buffers(model))


def persistent_buffers(model: nn.Module) -> Iterator[str]:
    """Names of ``model``'s persistent buffers (those its state dict holds)."""
    for prefix, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                yield f"{prefix}.{name}" if prefix else name


def adapters_state_dict(model: nn.Module) -> dict[str, Any]:
    """The module state a checkpoint holds: :func:`kept_keys`, taken as ``state_dict()`` takes them, without calling
    any module's ``_save_to_state_dict`` (bitsandbytes' unpacks every 4-bit weight there, which fails on a ZeRO-3
    partition on CPUs where it repacks the codes for its kernels)."""
    buffers = set(persistent_buffers(model))
    state = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
    return state | {name: b.detach() for name, b in model.named_buffers() if name in buffers}


@contextlib.contextmanager
def adapters_only(engine: Any) -> Iterator[None]:
    """While ``engine`` (DeepSpeed's) saves: its module state is :func:`adapters_state_dict` (no 4-bit codes, no
    QuantState entries, no frozen 16-bit weights)."""
    engine.module_state_dict = lambda *args, **kwargs: adapters_state_dict(engine.module)
    try:
        yield
    finally:
        del engine.module_state_dict


def load_adapters(src: dict[str, Any], dst: nn.Module) -> None:
    """DeepSpeed's ``custom_load_fn``: the saved adapters and buffers into ``dst``; every trainable parameter must be
    in the checkpoint (else it was written by another run)."""
    keep = kept_keys(dst)
    trainable = [name for name, p in dst.named_parameters() if p.requires_grad]
    if missing := [name for name in trainable if name not in src]:
        raise UserError(
            "--resume",
            f"the checkpoint holds no weights for {len(missing)} of the {len(trainable)} adapter tensors"
            f" (e.g. {missing[0]})",
            "resume with the --lora settings the run was started with (its run_config.json)",
        )
    dst.load_state_dict({k: v for k, v in src.items() if k in keep}, strict=False)


def check_same_base(saved: dict[str, Any] | None, own: dict[str, Any], where: str, source: str) -> None:
    """One line when the checkpoint was trained on other base files (or another 4-bit storage) than this run loaded."""
    if saved is None:
        raise UserError(
            where,
            "was not written by a run with a 4-bit base (no base fingerprint in it)",
            "resume it without --load-in-4bit, or start this run in a new --out",
        )
    if "params_crc32" not in saved:  # written before the QuantState was fingerprinted: its parameters only
        own = {"tensors": own["tensors"] - own["quant_states"], "crc32": own["params_crc32"], "storage": own["storage"]}
    if saved != own:
        raise UserError(
            where,
            f"was trained on another 4-bit base ({saved['tensors']} tensors, CRC-32 {saved['crc32']}, storage"
            f" {saved['storage']}) than --model {source} loads now ({own['tensors']}, {own['crc32']},"
            f" {own['storage']})",
            "resume with the model files and ZeRO stage the run started with (its run_config.json names them)",
        )
