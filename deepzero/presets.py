"""Named model presets: tiny random models built with ``from_config``, and the real DeepSeek checkpoints.

A preset with a ``hub_id`` is a short name for that checkpoint: its weights load with the checkpoint's own
config.json (``modeling.build_model``). For offline planning (plan, placement, FLOPs) the preset's architecture is
read from the checkpoint's published config.json kept in ``deepzero/published/`` (sources in its SOURCES.md).
Presets whose published config was found only in part (``<org>--<name>.partial.json``) take the missing keys from
a checkpoint of the same architecture; they and the one whose config was not found (DeepSeek-V3, plan only) say
``verified=False``.
Presets without a hub id are built with ``from_config`` and random weights.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
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
    verified: bool = False
    """True when ``arch`` is read from the checkpoint's published config.json in deepzero/published/."""

    def config(self, **overrides: Any) -> PretrainedConfig:
        """A Transformers config for this architecture (no weights, no download). Built from a copy: Transformers
        folds ``rope_theta`` into the ``rope_scaling`` dict it is given, which would change the preset."""
        return AutoConfig.for_model(self.model_type, **copy.deepcopy({**self.arch, **overrides}))


PUBLISHED_DIR = Path(__file__).resolve().parent / "published"
LOADER_KEYS = ("architectures", "auto_map", "torch_dtype", "transformers_version", "_name_or_path", "model_type")
"""Keys of a config.json that say how to load a checkpoint, not what its architecture is."""


def published_path(hub_id: str) -> Path:
    """Where the published config.json of ``hub_id`` is kept: deepzero/published/<org>--<name>.json."""
    return PUBLISHED_DIR / f"{hub_id.replace('/', '--')}.json"


def published_config(hub_id: str) -> dict[str, Any] | None:
    """The checkpoint's published config.json as a dict, or None when the repository does not keep it."""
    path = published_path(hub_id)
    return json.loads(path.read_text()) if path.is_file() else None


def partial_path(hub_id: str) -> Path:
    """Where the head of a published config.json is kept when no stored copy has the whole file."""
    return PUBLISHED_DIR / f"{hub_id.replace('/', '--')}.partial.json"


def _partly_published(name: str, hub_id: str, rest_from: str, about: str) -> ModelPreset:
    """A preset whose config.json was found only in part: the keys found, the rest from ``rest_from``'s published
    config (a checkpoint of the same architecture). Not verified, and says so."""
    head = json.loads(partial_path(hub_id).read_text())
    rest = published_config(rest_from)
    if rest is None:
        raise FileNotFoundError(f"{published_path(rest_from)}: preset {name} takes its missing keys from it")
    arch = {k: v for k, v in {**rest, **head}.items() if k not in LOADER_KEYS}
    return ModelPreset(name, head["model_type"], arch, hub_id=hub_id, about=f"{about} (config partly verified)")


def _published(name: str, hub_id: str, about: str) -> ModelPreset:
    """A preset whose architecture is the checkpoint's published config.json (all keys but the loader's)."""
    data = published_config(hub_id)
    if data is None:
        raise FileNotFoundError(f"{published_path(hub_id)}: preset {name} names a published config that is missing")
    arch = {k: v for k, v in data.items() if k not in LOADER_KEYS}
    return ModelPreset(name, data["model_type"], arch, hub_id=hub_id, about=about, verified=True)


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
    max_position_embeddings=32768,  # RoPE without scaling: any length; make sft-long trains 4,096-token rows
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
        _published(
            "deepseek-coder-1.3b",
            "deepseek-ai/deepseek-coder-1.3b-base",
            "dense Llama-arch code model, 1.35B params",
        ),
        _published(
            "deepseek-coder-1.3b-instruct",
            "deepseek-ai/deepseek-coder-1.3b-instruct",
            "dense Llama-arch code model, instruction-tuned, 1.35B params",
        ),
        _published(
            "deepseek-coder-6.7b",
            "deepseek-ai/deepseek-coder-6.7b-base",
            "dense Llama-arch code model, 6.7B params",
        ),
        _published(
            "deepseek-coder-6.7b-instruct",
            "deepseek-ai/deepseek-coder-6.7b-instruct",
            "dense Llama-arch code model, instruction-tuned, 6.7B params",
        ),
        _published(
            "deepseek-llm-7b",
            "deepseek-ai/deepseek-llm-7b-base",
            "dense Llama-arch base model, 6.9B params",
        ),
        _published(
            "deepseek-r1-distill-qwen-1.5b",
            "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
            "dense Qwen2-arch reasoning distill, 1.78B params",
        ),
        _published(
            "deepseek-r1-distill-qwen-7b",
            "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
            "dense Qwen2-arch reasoning distill, 7.6B params",
        ),
        _published(
            "deepseek-r1-distill-llama-8b",
            "deepseek-ai/DeepSeek-R1-Distill-Llama-8B",
            "dense Llama-3.1-arch reasoning distill, 8.0B params",
        ),
        _published(
            "deepseek-r1-distill-qwen-14b",
            "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B",
            "dense Qwen2-arch reasoning distill, 14.8B params",
        ),
        _published(
            "deepseek-r1-distill-qwen-32b",
            "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B",
            "dense Qwen2-arch reasoning distill, 32.8B params (config from the model card's values; QLoRA on 3x24 GB)",
        ),
        _published(
            "deepseek-r1-distill-llama-70b",
            "deepseek-ai/DeepSeek-R1-Distill-Llama-70B",
            "dense Llama-3.3-arch reasoning distill, 70.6B params (config from the model card's values; QLoRA on"
            " 3x24 GB)",
        ),
        _partly_published(
            "deepseek-v2-lite",
            "deepseek-ai/DeepSeek-V2-Lite",
            "deepseek-ai/DeepSeek-V2-Lite-Chat",
            "MoE with MLA, 15.7B total / 2.4B active params",
        ),
        _published(
            "deepseek-v2-lite-chat",
            "deepseek-ai/DeepSeek-V2-Lite-Chat",
            "MoE with MLA, chat-tuned V2-Lite, 15.7B total / 2.4B active params",
        ),
        _partly_published(
            "deepseek-coder-v2-lite",
            "deepseek-ai/DeepSeek-Coder-V2-Lite-Base",
            "deepseek-ai/DeepSeek-V2-Lite-Chat",
            "MoE code model with MLA, 15.7B total / 2.4B active params",
        ),
        _partly_published(
            "deepseek-coder-v2-lite-instruct",
            "deepseek-ai/DeepSeek-Coder-V2-Lite-Instruct",
            "deepseek-ai/DeepSeek-V2-Lite-Chat",
            "MoE code model with MLA, instruction-tuned, 15.7B total / 2.4B active params",
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
            about="MoE with MLA, 671B total / 37B active params (plan only: far beyond 3x24 GB; config not verified)",
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
