"""Training FLOPs per token and MFU, from the model itself (MoE counted by active experts)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

# Dense bf16/fp16 tensor-core peak per device, TFLOP/s (vendor datasheets, no sparsity).
PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "RTX 4090": 165.2,
    "RTX 4080": 97.5,
    "RTX 3090": 71.0,
    "A6000": 154.8,
}


def routed_experts(config: Any) -> int:
    """Routed experts per MoE layer (DeepSeek ``n_routed_experts``, Mixtral ``num_local_experts``, Qwen-MoE
    ``num_experts``); 0 for a dense model."""
    for key in ("n_routed_experts", "num_local_experts", "num_experts"):
        n = getattr(config, key, None)
        if isinstance(n, int) and n > 0:
            return n
    return 0


@dataclass(frozen=True)
class ParamCounts:
    total: int
    active: int
    """Parameters touched per token: routed experts scaled by top-k / n_experts."""
    embedding: int
    trainable: int
    """Parameters that require grad (all of them, unless frozen, e.g. around LoRA adapters)."""
    frozen_active: int = 0
    """Active non-embedding parameters whose weight gradient backward never computes: frozen, and not merged with
    an adapter inside the forward (peft's ParamWrapper adds B·A to the fused experts, so their gradient is formed)."""


def numel(p: torch.nn.Parameter) -> int:
    """Weights of ``p``, also when ZeRO-3 has partitioned it away (``ds_numel``; the local tensor is empty) and when
    it is a 4-bit weight (its tensor packs two NF4 codes per byte; its ``quant_state`` keeps the weight's shape)."""
    shape = getattr(getattr(p, "quant_state", None), "shape", None)
    if shape is not None:
        return math.prod(shape)
    return int(getattr(p, "ds_numel", p.numel()))


def count_params(model: torch.nn.Module) -> ParamCounts:
    """Total, active (MoE), input-embedding and trainable parameter counts, on meta, ZeRO-3 or real tensors."""
    config = model.config
    total = sum(numel(p) for p in model.parameters())
    trainable = sum(numel(p) for p in model.parameters() if p.requires_grad)
    embedding = sum(numel(p) for p in model.get_input_embeddings().parameters())
    n_experts = routed_experts(config)
    top_k = getattr(config, "num_experts_per_tok", None)
    embedding_ids = {id(p) for p in model.get_input_embeddings().parameters()}

    def is_routed(name: str) -> bool:
        return bool(n_experts and top_k) and ".experts." in f".{name}" and "shared" not in name

    routed = sum(numel(p) for name, p in model.named_parameters() if is_routed(name))
    active = total - routed + (routed * top_k // n_experts if routed else 0)
    merged = _merged_with_adapters(model)
    frozen = [
        (name, p)
        for name, p in model.named_parameters()
        if not p.requires_grad and id(p) not in embedding_ids and id(p) not in merged
    ]
    frozen_routed = sum(numel(p) for name, p in frozen if is_routed(name))
    frozen_active = sum(numel(p) for _, p in frozen) - frozen_routed
    frozen_active += frozen_routed * top_k // n_experts if frozen_routed else 0
    return ParamCounts(total, active, embedding, trainable, frozen_active)


def _merged_with_adapters(model: torch.nn.Module) -> set[int]:
    """Ids of the frozen tensors that peft's ParamWrapper (LoRA on fused 3-D expert weights) merges with B·A in
    every forward: backward then forms their full gradient, as in full fine-tuning."""
    return {
        id(p)
        for module in model.modules()
        if type(module).__name__ == "ParamWrapper"
        for p in module.get_base_layer().parameters(recurse=False)
    }


def flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """6 × active non-embedding params (4 × for frozen ones: no weight gradient) + attention scores:
    6 · layers · seq · heads · (d_qk + d_v). MLA's q/k head is nope + rope wide (DeepSeek-V2/V3)."""
    config = model.config
    counts = count_params(model)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    mla_qk = (getattr(config, "qk_nope_head_dim", None) or 0) + (getattr(config, "qk_rope_head_dim", None) or 0)
    d_qk = mla_qk or getattr(config, "qk_head_dim", None) or head_dim
    d_v = getattr(config, "v_head_dim", None) or head_dim
    attention = 6 * config.num_hidden_layers * seq_len * heads * (d_qk + d_v)
    return 6 * (counts.active - counts.embedding) - 2 * counts.frozen_active + attention


def peak_tflops(override: float | None = None) -> float | None:
    """Peak TFLOP/s of this rank's device: the override, a datasheet lookup by GPU name, or None (CPU)."""
    if override:
        return override
    from deepzero.distributed import on_cuda

    if not on_cuda():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
