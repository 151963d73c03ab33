"""The model's shapes and parameter counts, read from its config on the meta device (no weights)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from deepzero.adapters import quant
from deepzero.adapters.lora import LoraSpec
from deepzero.errors import UserError
from deepzero.flops import routed_experts


@dataclass(frozen=True)
class Arch:
    """The shape numbers the activation formula needs, read from a Transformers config."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    q_lora_rank: int | None = None
    """MLA (DeepSeek-V2/V3) low-rank query projection; None = plain q_proj."""
    kv_lora_rank: int | None = None
    """MLA compressed key/value width; None = standard (GQA/MHA) attention."""
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    moe_layers: int = 0
    """Decoder layers whose MLP is a mixture of experts."""
    experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0
    shared_intermediate: int = 0
    """Intermediate width of the always-on shared experts (moe_intermediate × n_shared_experts)."""
    max_positions: int = 0
    """The config's max_position_embeddings (0: not given): the context the checkpoint was trained for."""


@dataclass(frozen=True)
class ModelStats:
    """Parameter counts of a model, from a meta-device instance (no weights)."""

    name: str
    arch: Arch
    param_numels: tuple[int, ...]
    """Numel of every parameter in ``model.parameters()`` order (what DeepSpeed flattens and partitions)."""
    total: int
    embedding: int
    """Input embedding + lm_head (once if tied)."""
    routed_experts: int
    active: int
    """Parameters one token passes through: routed experts counted by experts_per_token / experts."""
    largest_module: int
    """Most parameters directly owned by one module: what ZeRO-3 gathers at once (DeepSpeed's 'largest layer')."""
    lora_shapes: tuple[tuple[int, int], ...]
    """(in, out) of every Linear a LoRA adapter wraps: all linears in the decoder layers, or those a ``LoraSpec``
    selects (a fused routed-expert parameter [E, a, b] counts as (E·a, E·b): peft's rank is per expert)."""
    stage_numels: tuple[int, ...] = ()
    """Parameters of [embedding, decoder layer 0 .. L-1, final norm + lm_head]: the pipeline's and the layer
    split's units (an lm_head tied to the embedding is counted in the embedding)."""
    moe_mask: tuple[bool, ...] = ()
    """Per decoder layer: whether its MLP is a mixture of experts."""
    four_bit_mask: tuple[bool, ...] = ()
    """Per entry of ``param_numels``: whether a 4-bit load (``--load-in-4bit``) quantises it. Transformers'
    bitsandbytes loader replaces every ``nn.Linear`` but the output embedding (and the model's fp32 modules);
    ``quant.quantise_experts`` adds the fused routed experts. Routers stay in the training dtype."""
    largest_shard_bytes: int | None = None
    """The largest safetensors file of the model's own folder (what the shard-by-shard export holds a few of at
    once); None for a hub id or a config (not on disk here)."""
    dequantised_experts: tuple[int, ...] = ()
    """Per MoE layer, the weights of its 4-bit fused experts: dequantised together while the layer runs (and kept
    for backward by autograd unless activation checkpointing recomputes the layer)."""

    def four_bit_numels(self) -> tuple[int, ...]:
        """Numel of every weight a 4-bit load quantises, in model order."""
        return tuple(n for n, q in zip(self.param_numels, self.four_bit_mask, strict=True) if q)

    def float_numels(self, four_bit: bool) -> tuple[int, ...]:
        """Numel of every parameter kept in floating point: all of them, or under a 4-bit load the others."""
        if not four_bit:
            return self.param_numels
        return tuple(n for n, q in zip(self.param_numels, self.four_bit_mask, strict=True) if not q)

    def lora_numels(self, rank: int) -> tuple[int, ...]:
        """Numel of the LoRA A and B matrices, in model order."""
        return tuple(n for i, o in self.lora_shapes for n in (rank * i, o * rank))


def _arch(config: PretrainedConfig, model: torch.nn.Module) -> Arch:
    c = config
    heads = c.num_attention_heads
    layers = list(model.model.layers)
    moe = [layer.mlp for layer in layers if hasattr(layer.mlp, "experts")]
    experts = routed_experts(c)
    n_shared = getattr(c, "n_shared_experts", None) or 0
    moe_inter = getattr(c, "moe_intermediate_size", 0) or 0
    return Arch(
        hidden=c.hidden_size,
        layers=c.num_hidden_layers,
        heads=heads,
        kv_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
        intermediate=c.intermediate_size,
        vocab=c.vocab_size,
        q_lora_rank=getattr(c, "q_lora_rank", None),
        kv_lora_rank=getattr(c, "kv_lora_rank", None),
        qk_nope_dim=getattr(c, "qk_nope_head_dim", 0) or 0,
        qk_rope_dim=getattr(c, "qk_rope_head_dim", 0) or 0,
        v_head_dim=getattr(c, "v_head_dim", 0) or 0,
        moe_layers=len(moe),
        experts=experts if moe else 0,
        experts_per_token=(getattr(c, "num_experts_per_tok", 0) or 0) if moe else 0,
        moe_intermediate=moe_inter,
        shared_intermediate=moe_inter * n_shared,
        max_positions=getattr(c, "max_position_embeddings", 0) or 0,
    )


def model_stats(config: PretrainedConfig, name: str = "model", lora: LoraSpec | None = None) -> ModelStats:
    """Count parameters by building the model on the meta device (no memory, no weights). ``lora``: count the
    adapters that spec wraps (``deepzero.adapters.lora``'s own target resolution); None: every decoder linear."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    if not isinstance(getattr(getattr(model, "model", None), "layers", None), torch.nn.ModuleList):
        kind = getattr(config, "model_type", type(model).__name__)
        raise UserError(
            f"--model {name}",
            f"is a {kind} model, whose decoder layers are not at model.layers (the Llama/Qwen/DeepSeek layout"
            " the planner, placement and LoRA targets read)",
            "pass a DeepSeek, Llama, Qwen or Mistral-family model",
        )
    params = list(model.parameters())  # deduplicates tied weights, like DeepSpeed sees them
    numels = tuple(p.numel() for p in params)
    arch = _arch(config, model)
    routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    active = sum(numels) - routed + (routed * arch.experts_per_token // arch.experts if arch.experts else 0)
    embeds = {id(m.weight): m.weight.numel() for m in (model.get_input_embeddings(), model.get_output_embeddings())}
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    layers = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    embed = model.get_input_embeddings().weight.numel()
    stages = (embed, *layers, sum(numels) - embed - sum(layers))
    moe_mask = tuple(hasattr(layer.mlp, "experts") for layer in model.model.layers)
    shapes = _lora_shapes(model, lora)
    return ModelStats(
        name,
        arch,
        numels,
        sum(numels),
        sum(embeds.values()),
        routed,
        active,
        largest,
        shapes,
        stages,
        moe_mask,
        _four_bit_mask(model, params),
        largest_shard_bytes(name),
        tuple(_experts_per_layer(model).values()),
    )


def largest_shard_bytes(name: str) -> int | None:
    """The largest ``*.safetensors`` file of the folder ``name`` (None when ``name`` is no folder with any)."""
    from pathlib import Path

    folder = Path(name)
    sizes = [p.stat().st_size for p in folder.glob("*.safetensors")] if folder.is_dir() else []
    return max(sizes) if sizes else None


def _four_bit_mask(model: torch.nn.Module, params: list[torch.nn.Parameter]) -> tuple[bool, ...]:
    """Which of ``params`` Transformers' 4-bit loader quantises: its own rule (``replace_with_bnb_linear`` on every
    ``nn.Linear`` outside ``get_keys_to_not_convert`` and the model's ``_keep_in_fp32_modules``)."""
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    skip = get_keys_to_not_convert(model) + list(getattr(model, "_keep_in_fp32_modules", None) or [])
    linears = model.named_modules()
    quantised = {id(m.weight) for n, m in linears if type(m) is torch.nn.Linear and should_convert_module(n, skip)}
    quantised |= {id(m._parameters[k]) for _, m, k in quant.fused_experts(model)}
    return tuple(id(p) in quantised for p in params)


def _experts_per_layer(model: torch.nn.Module) -> dict[str, int]:
    """Weights of the fused routed experts, per experts module (``ModelStats.dequantised_experts``)."""
    out: dict[str, int] = {}
    for name, module, key in quant.fused_experts(model):
        out[name] = out.get(name, 0) + module._parameters[key].numel()
    return out


def _lora_shapes(model: torch.nn.Module, spec: LoraSpec | None) -> tuple[tuple[int, int], ...]:
    """(in, out) of what LoRA wraps: every decoder linear but the router (``spec`` None), or what ``spec`` selects."""
    if spec is None:
        return tuple(
            (m.in_features, m.out_features)
            for n, m in model.model.layers.named_modules()
            if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] != "gate"
        )
    from deepzero.adapters.lora import expert_param_names, resolve_targets

    targets = resolve_targets(model, spec)
    modules = dict(model.named_modules())
    shapes = [(modules[n].in_features, modules[n].out_features) for n in targets.wrapped_modules(model)]
    params = dict(model.named_parameters())
    for name in expert_param_names(model):
        if any(name.endswith(t) for t in targets.parameters):
            experts, a, b = params[name].shape  # peft ParamWrapper: A (in, r·E), B (r·E, out)
            shapes.append((experts * a, experts * b))
    return tuple(shapes)
