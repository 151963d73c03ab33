"""Named model presets: tiny random models built with ``from_config``, and the real DeepSeek checkpoints.

Each preset carries the architecture of its checkpoint (copied from the checkpoint's ``config.json``), so
the memory planner and the FLOP counter can size it without downloading anything. Presets with a
``hub_id`` are loaded with ``from_pretrained(hub_id)``; presets without one are built with ``from_config``
and random weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from deepzero.errors import UserError


@dataclass(frozen=True)
class ModelPreset:
    """One named model: where its weights live (if anywhere) and its architecture."""

    name: str
    model_type: str
    arch: dict[str, Any]
    hub_id: str | None = None
    """Hugging Face hub id of the real checkpoint; None for a random-init preset built with from_config."""
    about: str = ""
    tags: tuple[str, ...] = field(default_factory=tuple)
    pretrain_lr: float | None = None
    """Peak lr for training this random-init preset from scratch; used unless --lr is given (the ds_configs lr
    of 3e-5 is a fine-tuning lr for real checkpoints and barely moves a random model)."""
    pretrain_warmup_steps: int | None = None

    def config(self, **overrides: Any) -> PretrainedConfig:
        """A Transformers config for this architecture (no weights, no download)."""
        return AutoConfig.for_model(self.model_type, **{**self.arch, **overrides})


_TINY_V3 = dict(
    hidden_size=128,
    intermediate_size=352,
    moe_intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    q_lora_rank=64,
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=32,
    max_position_embeddings=1024,
    vocab_size=4096,
    tie_word_embeddings=False,
)

PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in [
        ModelPreset(
            "tiny-deepseek-v3",
            "deepseek_v3",
            _TINY_V3,
            about="embedded default: DeepSeek-V3 architecture (MLA + MoE, 8 experts, top-2), ~2.5M params",
            tags=("tiny",),
            pretrain_lr=2e-3,
            pretrain_warmup_steps=30,
        ),
        ModelPreset(
            "tiny-deepseek-v2",
            "deepseek_v2",
            {
                **{k: v for k, v in _TINY_V3.items() if k not in ("n_group", "topk_group")},
                "q_lora_rank": None,
                "topk_method": "greedy",
            },
            about="DeepSeek-V2 architecture (MLA + MoE) at test size",
            tags=("tiny",),
            pretrain_lr=2e-3,
            pretrain_warmup_steps=30,
        ),
        ModelPreset(
            "deepseek-coder-1.3b",
            "llama",
            dict(
                hidden_size=2048,
                intermediate_size=5504,
                num_hidden_layers=24,
                num_attention_heads=16,
                num_key_value_heads=16,
                vocab_size=32256,
                max_position_embeddings=16384,
                rope_theta=100000.0,
                rms_norm_eps=1e-6,
                tie_word_embeddings=False,
            ),
            hub_id="deepseek-ai/deepseek-coder-1.3b-base",
            about="dense Llama-arch code model, 1.35B params",
        ),
        ModelPreset(
            "deepseek-llm-7b",
            "llama",
            dict(
                hidden_size=4096,
                intermediate_size=11008,
                num_hidden_layers=30,
                num_attention_heads=32,
                num_key_value_heads=32,
                vocab_size=102400,
                max_position_embeddings=4096,
                rms_norm_eps=1e-6,
                tie_word_embeddings=False,
            ),
            hub_id="deepseek-ai/deepseek-llm-7b-base",
            about="dense Llama-arch base model, 6.9B params",
        ),
        ModelPreset(
            "deepseek-r1-distill-qwen-1.5b",
            "qwen2",
            dict(
                hidden_size=1536,
                intermediate_size=8960,
                num_hidden_layers=28,
                num_attention_heads=12,
                num_key_value_heads=2,
                vocab_size=151936,
                max_position_embeddings=131072,
                rope_theta=10000.0,
                rms_norm_eps=1e-6,
                tie_word_embeddings=False,
            ),
            hub_id="deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
            about="dense Qwen2-arch reasoning distill, 1.78B params",
        ),
        ModelPreset(
            "deepseek-r1-distill-qwen-7b",
            "qwen2",
            dict(
                hidden_size=3584,
                intermediate_size=18944,
                num_hidden_layers=28,
                num_attention_heads=28,
                num_key_value_heads=4,
                vocab_size=152064,
                max_position_embeddings=131072,
                rope_theta=10000.0,
                rms_norm_eps=1e-6,
                tie_word_embeddings=False,
            ),
            hub_id="deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
            about="dense Qwen2-arch reasoning distill, 7.6B params",
        ),
        ModelPreset(
            "deepseek-v2-lite",
            "deepseek_v2",
            dict(
                hidden_size=2048,
                intermediate_size=10944,
                moe_intermediate_size=1408,
                num_hidden_layers=27,
                num_attention_heads=16,
                num_key_value_heads=16,
                n_routed_experts=64,
                n_shared_experts=2,
                num_experts_per_tok=6,
                first_k_dense_replace=1,
                q_lora_rank=None,
                kv_lora_rank=512,
                qk_rope_head_dim=64,
                qk_nope_head_dim=128,
                v_head_dim=128,
                topk_method="greedy",
                vocab_size=102400,
                max_position_embeddings=163840,
                rms_norm_eps=1e-6,
                tie_word_embeddings=False,
            ),
            hub_id="deepseek-ai/DeepSeek-V2-Lite",
            about="MoE with MLA, 15.7B total / 2.4B active params",
        ),
        ModelPreset(
            "deepseek-v3",
            "deepseek_v3",
            dict(
                hidden_size=7168,
                intermediate_size=18432,
                moe_intermediate_size=2048,
                num_hidden_layers=61,
                num_attention_heads=128,
                num_key_value_heads=128,
                n_routed_experts=256,
                n_shared_experts=1,
                num_experts_per_tok=8,
                n_group=8,
                topk_group=4,
                first_k_dense_replace=3,
                q_lora_rank=1536,
                kv_lora_rank=512,
                qk_rope_head_dim=64,
                qk_nope_head_dim=128,
                v_head_dim=128,
                vocab_size=129280,
                max_position_embeddings=163840,
                rms_norm_eps=1e-6,
                tie_word_embeddings=False,
            ),
            hub_id="deepseek-ai/DeepSeek-V3",
            about="MoE with MLA, 671B total / 37B active params (plan only: far beyond 3x24 GB)",
        ),
    ]
}


def get_preset(name: str) -> ModelPreset:
    """Look a preset up by name, with the list of names in the error."""
    try:
        return PRESETS[name]
    except KeyError:
        raise UserError(
            f"--model {name}", "unknown model preset", f"use a local folder, a hub id, or one of: {', '.join(PRESETS)}"
        ) from None
