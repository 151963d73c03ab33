"""FLOPs per token (MFU's numerator) against an independent count: torch's FlopCounterMode on a real forward and
backward, for dense, DeepSeek-V2 and DeepSeek-V3 (MLA + MoE) models, and for LoRA, whose frozen weights need no
weight-gradient matmuls."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM, LlamaConfig

from deepzero.adapters.lora import LoraSpec, apply_lora
from deepzero.flops import flops_per_token
from deepzero.presets import get_preset

SEQ, ROWS, VOCAB = 128, 4, 512


def model(family: str) -> torch.nn.Module:
    """Eager attention and eager experts: the kernels FlopCounterMode sees as matmuls (it counts no CPU sdpa or
    grouped_mm), computing the same function as the fast ones."""
    torch.manual_seed(0)
    if family == "llama":
        config = LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
        )
        config.vocab_size = VOCAB
        return AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    config = get_preset(f"tiny-deepseek-{family}").config(vocab_size=VOCAB)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager", experts_implementation="eager")


def counted_flops_per_token(net: torch.nn.Module, backward: bool) -> float:
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        loss = net(input_ids=ids, labels=ids).loss
        if backward:
            loss.backward()
    return counter.get_total_flops() / (ROWS * SEQ) * (1 if backward else 3)


@pytest.mark.parametrize("family", ["llama", "v2", "v3"])
def test_flops_per_token_match_a_counted_forward_and_backward(family: str) -> None:
    net = model(family)
    with torch.no_grad():
        forward_x3 = counted_flops_per_token(net, backward=False)
    assert flops_per_token(net, SEQ) == pytest.approx(forward_x3, rel=0.02)
    assert flops_per_token(net, SEQ) == pytest.approx(counted_flops_per_token(net, backward=True), rel=0.02)


def test_mla_query_key_width_is_nope_plus_rope_without_qk_head_dim() -> None:
    """Transformers' DeepseekV2Config sets head_dim = qk_rope_head_dim; a config without qk_head_dim (e.g. the
    hub's own remote code) must still count q·k over nope + rope."""
    net = model("v2")
    expected = flops_per_token(net, SEQ)
    del net.config.qk_head_dim
    assert (
        net.config.head_dim == net.config.qk_rope_head_dim != net.config.qk_nope_head_dim + net.config.qk_rope_head_dim
    )
    assert flops_per_token(net, SEQ) == expected


@pytest.mark.parametrize("targets", ["attn", "attn,mlp", "attn,mlp,experts"])
def test_lora_flops_count_what_lora_computes(targets: str) -> None:
    full = flops_per_token(model("v3"), SEQ)
    net = apply_lora(model("v3"), LoraSpec.parse(f"r=8,alpha=16,targets={targets}"), verbose=False)
    counted = counted_flops_per_token(net, backward=True)
    assert flops_per_token(net, SEQ) == pytest.approx(counted, rel=0.03)
    assert counted < 0.95 * full  # frozen weights skip their weight gradients: LoRA is not 6N
