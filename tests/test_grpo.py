"""GRPO (prompts data, rewards, generation each step): the loss and metrics against TRL 1.16's ``GRPOTrainer`` as
the oracle, and train.py's runs.

The oracle: TRL's own ``GRPOTrainer._compute_loss`` (with its fused LM head, ``add_fused_lm_head``) and this
product's objective on the same tiny model, the same prompts and completions, advantages, old and reference
log-probs: per loss type, with and without the KL term, the loss, its gradient and TRL's metrics agree.
"""

from __future__ import annotations

import copy
import types
from collections import defaultdict
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from deepzero.losses.grpo import (
    GRPO,
    LOSS_TYPES,
    GRPOSettings,
    advantages,
    completion_rows,
    nanstd,
)
from deepzero.losses.tiled import TiledLoss, install_tiled_loss

TOL = 1e-5


def tiny_qwen(vocab: int = 300, seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).float()


def fixed_inputs(n: int = 6, seed: int = 1) -> dict:
    """Prompts and completions of various lengths (the prompts left-padded, completions right-padded, as TRL)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 300, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g) for _ in range(n)]
    completions = [
        torch.randint(3, 300, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]
    rewards = torch.rand(n, generator=g)
    return {"prompts": prompts, "completions": completions, "rewards": rewards, "g": g}


def trl_layout(rows: dict, prompts: list, completions: list) -> dict:
    """TRL's tensors from our rows: the prompt part and the completion part of each row."""
    p_len = max(len(p) for p in prompts)
    return {
        "prompt_ids": rows["input_ids"][:, :p_len],
        "prompt_mask": rows["attention_mask"][:, :p_len],
        "completion_ids": rows["input_ids"][:, p_len:],
        "completion_mask": rows["attention_mask"][:, p_len:],
    }


def to_rows(per_token: torch.Tensor, p_len: int) -> torch.Tensor:
    """TRL's [b, C] per-token values at our shifted positions [b, P + C] (position t predicts token t + 1)."""
    out = torch.zeros(per_token.shape[0], p_len + per_token.shape[1])
    out[:, p_len - 1 : -1] = per_token
    return out


def trl_self(model, settings: GRPOSettings, accum: int) -> SimpleNamespace:
    from trl import GRPOTrainer

    accelerator = SimpleNamespace(
        num_processes=1, gather=lambda x: x, reduce=lambda x, reduction: x, autocast=nullcontext,
        gather_for_metrics=lambda x: x, is_main_process=True,
    )  # fmt: skip
    ns = SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token",
        beta=settings.beta, loss_type=settings.loss_type, epsilon_low=settings.epsilon,
        epsilon_high=settings.clip_high, use_vllm=False, vllm_importance_sampling_correction=False, model=model,
        current_gradient_accumulation_steps=accum, max_completion_length=settings.max_completion_length,
        accelerator=accelerator, _metrics=defaultdict(lambda: defaultdict(list)), _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=accum),
    )  # fmt: skip
    ns._get_per_token_logps_and_entropies = types.MethodType(GRPOTrainer._get_per_token_logps_and_entropies, ns)
    return ns


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_gradient_and_metrics_equal_trl_grpo_trainer(loss_type: str, beta: float) -> None:
    """Our GRPO loss of one micro-batch (tiled LM head, temperature 0.7, old log-probs off the current ones as
    with num_iterations > 1, a reference model for beta > 0) equals ``accum`` × TRL's ``_compute_loss`` (TRL
    divides by the accumulation steps itself; DeepSpeed does here), and so do the LM head's gradient and TRL's
    entropy / clip_ratio / kl metrics. The largest relative difference is printed (pytest -s)."""
    from trl import GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    accum = 2
    settings = GRPOSettings(
        rewards=("x",), loss_type=loss_type, beta=beta, temperature=0.7, epsilon=0.2, epsilon_high=0.28,
        max_completion_length=8, num_iterations=2, reference="frozen-copy" if beta else "none",
    )  # fmt: skip
    fx = fixed_inputs()
    ours_model = tiny_qwen()
    theirs_model = copy.deepcopy(ours_model)
    ref_model = tiny_qwen(seed=5)
    install_tiled_loss(ours_model, TiledLoss.choose("on", 300, 32))
    add_fused_lm_head(theirs_model, temperature=0.7, outputs=("log_probs", "entropy"))
    add_fused_lm_head(ref_model, temperature=0.7)

    rows = completion_rows(fx["prompts"], fx["completions"], 0, torch.device("cpu"))
    p_len = max(len(p) for p in fx["prompts"])
    trl_inputs = trl_layout(rows, fx["prompts"], fx["completions"])
    adv = advantages(fx["rewards"], 3, "group")
    t = trl_self(ref_model, settings, accum)
    with torch.no_grad():
        ids = torch.cat([trl_inputs["prompt_ids"], trl_inputs["completion_ids"]], 1)
        att = torch.cat([trl_inputs["prompt_mask"], trl_inputs["completion_mask"]], 1)
        ref, _, _ = t._get_per_token_logps_and_entropies(ref_model, ids, att, ids.shape[1] - p_len)
    old = -torch.rand(ref.shape, generator=fx["g"]) * 0.3 + (ref * 0.9)  # off-policy: ratios on both sides of clip
    trl_inputs |= {
        "advantages": adv, "old_per_token_logps": old * trl_inputs["completion_mask"],
        "ref_per_token_logps": ref, "num_items_in_batch": trl_inputs["completion_mask"].sum(),
    }  # fmt: skip
    batch = rows | {"advantages": adv, "old_logps": to_rows(old * trl_inputs["completion_mask"], p_len)}
    if beta:
        batch["ref_logps"] = to_rows(ref, p_len)

    t.model = theirs_model
    theirs = GRPOTrainer._compute_loss(t, theirs_model, trl_inputs)
    theirs.backward()
    objective = GRPO(settings)
    normalizer = rows["labels"].ne(-100).sum().float() / accum
    ours = objective.loss(ours_model, batch, normalizer)
    ours.backward()
    stats = objective.window_stats("train")

    diffs = {"loss": abs(ours.item() - accum * theirs.item()) / abs(accum * theirs.item())}
    for key in ("entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl"):
        if key in t._metrics["train"]:
            expected = t._metrics["train"][key][0]
            diffs[key] = abs(stats[key] - expected) / max(abs(expected), 1e-12)
    assert ("kl" in stats) == bool(beta)
    grad_ours, grad_theirs = ours_model.lm_head.weight.grad, theirs_model.lm_head.weight.grad * accum
    diffs["grad"] = ((grad_ours - grad_theirs).abs().max() / grad_theirs.abs().max()).item()
    print(f"{loss_type} beta {beta}: largest relative differences {diffs}")
    assert all(d <= TOL for d in diffs.values()), diffs
    assert stats["clip_ratio/region_mean"] > 0  # the test exercises the clip


def test_advantages_equal_trls_for_every_scaling() -> None:
    """(r − group mean) / (std + 1e-4) with TRL's nanstd: group, batch and none; an unscorable row gets 0."""
    from trl.trainer.utils import nanstd as trl_nanstd

    r = torch.tensor([0.1, 0.5, 0.9, 0.3, float("nan"), 0.3, 1.0, 2.0, 0.0])
    grouped = r.view(-1, 3)
    mean = torch.nanmean(grouped, 1).repeat_interleave(3)
    std_group = trl_nanstd(grouped, dim=1).repeat_interleave(3)
    std_batch = trl_nanstd(r)
    expected = {
        "group": torch.nan_to_num((r - mean) / (std_group + 1e-4)),
        "batch": torch.nan_to_num((r - mean) / (std_batch + 1e-4)),
        "none": torch.nan_to_num(r - mean),
    }
    for scale, want in expected.items():
        got = advantages(r, 3, scale, nanstd(r) if scale == "batch" else None)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert got[4] == 0
