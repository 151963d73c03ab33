"""A 4-bit base under LoRA adapters (QLoRA): ``--load-in-4bit`` or the preset's ``"quantization"`` section.

The frozen base loads through Transformers' ``BitsAndBytesConfig`` (NF4 blocks of 64 weights, double quantisation
of their absmax constants, compute in the run's precision) and is frozen (``prepare``); only the LoRA adapters
train. Under ZeRO-3 the 4-bit blocks are stored in the compute dtype (``bnb_4bit_quant_storage``) so
that DeepSpeed can flatten and partition them with the other parameters; under ZeRO-0/1/2 they stay uint8.

Transformers never partitions a quantised model at load (its ``zero.Init`` is skipped for any quantiser). Under ZeRO-2
every card holds the whole 4-bit base anyway; under ZeRO-3 the ranks of a machine load it on the host one at a time
and keep only their partition (``deepzero.adapters.partitioned_load``). The planner counts both loads.

Transformers' 4-bit loader quantises ``nn.Linear`` layers only. An MoE model's routed experts are fused 3-D
parameters (``mlp.experts.gate_up_proj`` / ``down_proj``: 14.1 B of DeepSeek-V2-Lite's 15.7 B weights) that it leaves
in 16 bits. ``quantise_experts`` puts them in NF4 too, with bitsandbytes' parametrisation
(``bitsandbytes.nn.parametrize``): each is dequantised when its layer runs, once per forward. A model with such
experts loads on the host, a rank of each machine at a time, under every ZeRO stage: no card ever holds them in 16
bits.

The export merges the trained adapters into the original 16-bit base read again from the model source (not the NF4
blocks dequantised), shard by shard, and writes a plain Transformers folder plus the adapters alone in peft's format
(``deepzero.adapters.merge``, through ``deepzero.adapters.exporters.export_streamed``, as a 16-bit LoRA run over
a base with files is). A checkpoint holds the adapters only (``deepzero.adapters.checkpoint``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from deepzero.adapters.lora import is_fused_expert
from deepzero.errors import UserError, first_line

FLAG = "--load-in-4bit"
SECTION = "quantization"
"""The preset's section: ``"quantization": {"load_in_4bit": true}`` (deepzero's, removed before DeepSpeed)."""
KEYS = ("load_in_4bit",)
BLOCK = 64
"""Weights per NF4 block (bitsandbytes' default blocksize): one absmax constant each."""
DOUBLE_QUANT_BLOCK = 256
"""Absmax constants per second-level block under double quantisation (one fp32 constant each, the rest 8-bit)."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
QUANTISE_BYTES = 16
"""Host bytes per element that bitsandbytes' CPU quantiser (``backends/default/ops.py``, ``quantize_4bit``) holds at
once for the weight it quantises: its fp32 copy, the scaled product and its clamp, the int32 buckets."""
CONSTANT_BYTES = 4 * 16 + 4 * 256 + 4
"""Per 4-bit weight matrix, whatever its size: the NF4 code (16 fp32), the 8-bit dynamic code of its absmax
constants (256 fp32) and their offset (one fp32), as bitsandbytes' ``QuantState`` holds them."""


def packed_bytes(numel: int) -> int:
    """Bytes of one weight's NF4 codes: two per byte (stored as uint8, or under ZeRO-3 reinterpreted as the compute
    dtype; the bytes are the same)."""
    return -(-numel // 2)


def quant_state_bytes(numel: int) -> int:
    """Bytes of one weight's ``QuantState`` beside its codes: one 8-bit absmax per block of 64 weights, one fp32
    absmax per 256 of those (double quantisation), and the constant tables. Not a parameter: DeepSpeed never
    partitions it, every rank holds it whole (measured: tests/test_plan.py)."""
    blocks = -(-numel // BLOCK)
    return blocks + 4 * -(-blocks // DOUBLE_QUANT_BLOCK) + CONSTANT_BYTES


@dataclass(frozen=True)
class FourBit:
    """The 4-bit base of a run: NF4 with double quantisation, computing in ``compute`` and stored in ``storage``."""

    compute: str
    """The run's precision (fp32, bf16, fp16): what each layer is dequantised to for its matmul."""
    storage: str
    """uint8, or under ZeRO-3 the compute dtype (DeepSpeed partitions floating-point parameters only)."""
    origin: str = FLAG
    """Where it was asked for: the flag or the preset's key (for the header and the errors)."""
    load_on_host: bool = False
    """Each rank reads the base into host RAM in turn (``deepzero.adapters.partitioned_load``) and keeps its
    partition (ZeRO-3) or moves it to its card (a model with fused routed experts, quantised on the host first);
    otherwise each tensor goes straight to the card as it loads."""
    experts: bool = False
    """The fused routed experts are quantised too (``quantise_experts``)."""

    def bnb_config(self) -> Any:
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=DTYPES[self.compute],
            bnb_4bit_quant_storage=self.storage_dtype,
        )

    def describe(self) -> str:
        experts = ", routed experts too" if self.experts else ""
        turns = ", read on the host one rank at a time" if self.load_on_host else ""
        return f"  base in 4 bits (NF4, double quant, compute {self.compute}, storage {self.storage}{experts}{turns})"

    @property
    def storage_dtype(self) -> torch.dtype:
        return DTYPES.get(self.storage, torch.uint8)

    def to_json(self) -> dict[str, Any]:
        return {"quant_type": "nf4", "double_quant": True, "compute": self.compute, "storage": self.storage}


def requested(flag: bool | None, section: Any, source: str) -> str | None:
    """Where a 4-bit base was asked for (None: it was not). ``--load-in-4bit [true|false]`` beats the preset's
    ``"quantization": {"load_in_4bit": ...}``."""
    if section is not None:
        if not isinstance(section, dict):
            raise UserError(f"{source}: {SECTION}", "must be an object", 'e.g. "quantization": {"load_in_4bit": true}')
        if unknown := [k for k in section if k not in KEYS]:
            raise UserError(f"{source}: {SECTION}.{unknown[0]}", "Unknown config key", f"use only {', '.join(KEYS)}")
        if not isinstance(section.get("load_in_4bit", False), bool):
            raise UserError(f"{source}: {SECTION}.load_in_4bit", "must be true or false", "set it to true or false")
    if flag is not None:
        return FLAG if flag else None
    if section is not None and section.get("load_in_4bit"):
        return f"{source}: {SECTION}.load_in_4bit"
    return None


def choose(
    origin: str | None,
    *,
    zero_engine: bool,
    lora: bool,
    pretrained: bool,
    stage: int,
    precision: str,
    offload_param: bool,
    hierarchical: bool = False,
    expert_targets: bool = False,
    quantized_source: bool = False,
    fused_experts: bool = False,
) -> FourBit | None:
    """The 4-bit base the run asked for, or one line saying why this run cannot have it."""
    if origin is None:
        return None
    if not zero_engine:
        raise UserError(
            origin,
            "a 4-bit base runs on the ZeRO engine only (the pipeline and the layer split place float weights)",
            "use ds_configs/zero2.json or zero3.json without --device-map",
        )
    if not lora:
        raise UserError(
            origin, "full fine-tuning of a 4-bit base is not possible (its NF4 weights are frozen)", "add --lora"
        )
    if not pretrained:
        raise UserError(
            origin,
            "a random-init preset has no weights to quantise",
            "pass a checkpoint (a preset naming one, a local folder or a hub id)",
        )
    if quantized_source:
        raise UserError(
            origin,
            "the model's config.json has a quantization_config: its weights are quantised already, and the export"
            " merges the adapters into the 16-bit base it reads again",
            "pass the 16-bit checkpoint the quantised one was made from as --model",
        )
    if expert_targets:
        raise UserError(
            origin,
            "LoRA on the fused routed experts (targets=experts) over a 4-bit base is not supported here (the export"
            " merges shard by shard into the files' per-expert tensors, which fused adapters do not name)",
            "drop 'experts' from --lora targets=, or train 16-bit LoRA without " + origin,
        )
    if offload_param:
        raise UserError(
            origin,
            "ZeRO-3 parameter offload of 4-bit weights is not supported here",
            "drop offload_param (the 4-bit base is small: ds_configs/zero3.json)",
        )
    if hierarchical and stage == 3:
        raise UserError(
            origin,
            "ZeRO++'s hierarchical partitioning (zero_hpz_partition_size) of a 4-bit base is not supported here",
            "drop zero_optimization.zero_hpz_partition_size",
        )
    storage = precision if stage == 3 else "uint8"
    four_bit = FourBit(precision, storage, origin, load_on_host=stage == 3 or fused_experts, experts=fused_experts)
    check_runnable(four_bit)
    return four_bit


def check_runnable(four_bit: FourBit, device: str | None = None) -> None:
    """bitsandbytes imports and runs a 4-bit matmul in the compute dtype here, or one line says what is missing."""
    fix = "pip install bitsandbytes (CUDA GPUs, or CPUs with bitsandbytes >= 0.48), or drop " + four_bit.origin
    try:
        import bitsandbytes as bnb
    except Exception as err:  # a missing package, or a build without a backend for this machine
        raise UserError(four_bit.origin, f"bitsandbytes cannot be imported ({first_line(err)})", fix) from None
    if device is None:
        from deepspeed.accelerator import get_accelerator

        device = get_accelerator().device_name()
    dtype = DTYPES[four_bit.compute]
    try:
        layer = bnb.nn.Linear4bit(
            BLOCK,
            8,
            bias=False,
            compute_dtype=dtype,
            quant_type="nf4",
            compress_statistics=True,
            quant_storage=DTYPES.get(four_bit.storage, torch.uint8),
        )
        layer = layer.to(device)
        out = layer(torch.ones(2, BLOCK, dtype=dtype, device=device))
        ok = out.shape == (2, 8) and bool(torch.isfinite(out).all())
    except Exception as err:  # bitsandbytes raises many types on a device without kernels for this dtype
        raise UserError(
            four_bit.origin,
            f"bitsandbytes has no 4-bit {four_bit.compute} kernel on {device} ({first_line(err)})",
            fix,
        ) from None
    if not ok:
        raise UserError(
            four_bit.origin, f"bitsandbytes' 4-bit {four_bit.compute} matmul on {device} is not finite", fix
        )


def prepare(model: torch.nn.Module) -> torch.nn.Module:
    """The 4-bit base frozen before the adapters are added. peft's ``prepare_model_for_kbit_training`` would also
    cast every other weight to fp32, which DeepSpeed casts back to the training dtype at ``initialize`` (measured:
    tests/test_plan.py): it would only double those weights' bytes on every card while the base loads (6 GiB for
    R1-Distill-Qwen-32B's embedding and head, the difference between fitting 24 GiB and not), and under ZeRO-3 with
    fp16 storage it casts the packed NF4 codes too (its test reads ``fp16 or (bf16 and not Params4bit)``). Its other
    step, input gradients for reentrant checkpointing, is not needed: the engine checkpoints with
    ``use_reentrant=False``."""
    model.requires_grad_(False)
    for module in model.modules():  # the same 4-bit layout on every CPU (see the note below)
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model


def is_packed(param: torch.Tensor) -> bool:
    """A 4-bit weight: two NF4 codes per byte, stored as uint8 or (ZeRO-3) reinterpreted as the compute dtype, so
    its "float" values are arbitrary bit patterns (NaN among them), never weights."""
    return type(param).__name__ == "Params4bit" or getattr(param, PACKED_EXPERTS, False)


PACKED_EXPERTS = "deepzero_packed_experts"
"""Attribute set on the parameter that holds a fused expert tensor's NF4 codes (``quantise_experts``)."""


def fused_experts(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str]]:
    """(module name, module, parameter name) of every fused 3-D routed-expert parameter (``lora.is_fused_expert``,
    which Transformers' 4-bit loader skips) not quantised yet."""
    return [
        (name, module, key)
        for name, module in model.named_modules()
        for key, param in module._parameters.items()
        if param is not None and is_fused_expert(f"{name}.{key}", param)
    ]


@torch.no_grad()
def quantise_experts(model: torch.nn.Module, four_bit: FourBit) -> int:
    """The fused routed experts in NF4 with double quantisation, blocks of 64, stored as ``four_bit.storage``
    (bitsandbytes quantises them where they are: on the host for a load in turns). Each stays an attribute of its
    module, dequantised to the compute dtype when read (bitsandbytes' parametrisation, cached for one forward of the
    experts module). Returns how many tensors were quantised."""
    import torch.nn.utils.parametrize as parametrize
    from bitsandbytes import functional as bnb_functional
    from bitsandbytes.nn.parametrize import Bnb4bitParametrization, _register_parametrization_hooks

    from deepzero.modeling import one_thread

    found = fused_experts(model)
    for _, module, key in found:
        weight = module._parameters[key].data.to(DTYPES[four_bit.compute])
        same_bytes = weight.device.type == "cpu" and not torch.cuda.is_available()  # on any CPU-only host
        with one_thread() if same_bytes else contextlib.nullcontext():
            codes, state = bnb_functional.quantize_4bit(
                weight,
                blocksize=BLOCK,
                compress_statistics=True,
                quant_type="nf4",
                quant_storage=four_bit.storage_dtype,
            )
        packed = torch.nn.Parameter(codes, requires_grad=False)
        setattr(packed, PACKED_EXPERTS, True)
        packed.quant_state = state  # as on bitsandbytes' Params4bit: the weight's shape, for counting it
        setattr(module, key, packed)
        del weight
        parametrize.register_parametrization(module, key, Bnb4bitParametrization(state), unsafe=True)
        _register_parametrization_hooks(module, key)
    return len(found)


def quant_states(model: torch.nn.Module) -> list[Any]:
    """Every ``QuantState`` of the model (not parameters nor buffers: ``.to`` and ``zero.Init`` leave them where
    they are): the 4-bit Linear weights' and the quantised experts' parametrisations'."""
    from bitsandbytes.nn.parametrize import Bnb4bitParametrization

    out = {}
    for module in model.modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if isinstance(module, Bnb4bitParametrization):
            state = module.quant_state
        if state is not None:
            out[id(state)] = state
    return list(out.values())
