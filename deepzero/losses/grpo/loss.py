"""GRPO's loss math (TRL 1.16's ``_compute_loss``): group advantages, per-token log-probs, the clipped loss
aggregated by ``--loss-type``, and the sums of TRL's loss metrics.

Per token (log-probs of the logits / temperature, through the tiled LM head): ``ρ = exp(logp − logp_old)``,
``ℓ = −min(ρA, clip(ρ, 1 − ε, 1 + ε_high)A) + β·(exp(ref − logp) − (ref − logp) − 1)``, aggregated by
``--loss-type``: grpo (mean of each completion's token mean), bnpo (token mean of the micro-batch), dr_grpo
(sum / (completions × max completion length)), dapo (sum / the global batch's completion tokens; TRL's default).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from deepzero.data import IGNORE_INDEX
from deepzero.losses.grpo.settings import GRPOSettings
from deepzero.tiled_loss import has_tiled_loss

Batch = dict[str, torch.Tensor]


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """TRL's ``nanstd``: the unbiased standard deviation ignoring NaNs."""
    keep = ~torch.isnan(x)
    count = keep.sum() if dim is None else keep.sum(dim)
    mean = torch.nanmean(x) if dim is None else torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2) if dim is None else torch.nanmean((x - mean) ** 2, dim=dim)
    return torch.sqrt(variance * count / (count - 1))


def advantages(rewards: torch.Tensor, group: int, scale: str, batch_std: torch.Tensor | None = None) -> torch.Tensor:
    """TRL's ``sum_then_normalize`` advantages of ``rewards`` [n] (NaN: unscorable) in groups of ``group``:
    ``r − mean_group``, divided by ``std + 1e-4`` (the group's, or ``batch_std``: the global batch's), NaN → 0."""
    grouped = rewards.view(-1, group)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group)
    std = nanstd(grouped, dim=1).repeat_interleave(group)
    adv = rewards - mean
    if scale == "group":
        adv = adv / (std + 1e-4)
    elif scale == "batch":
        adv = adv / (batch_std + 1e-4)
    return torch.nan_to_num(adv, nan=0.0)


def global_std(total: torch.Tensor) -> torch.Tensor:
    """nanstd of the rewards of every rank's generation batch (two all-reduces: mean, then squares)."""
    ok = ~torch.isnan(total)
    sums = torch.stack([total.nan_to_num().sum(), ok.float().sum()])
    if dist.is_initialized():
        dist.all_reduce(sums)
    mean = sums[0] / sums[1]
    square = torch.stack([((total - mean) ** 2).nan_to_num().sum()])
    if dist.is_initialized():
        dist.all_reduce(square)
    return torch.sqrt(square[0] / (sums[1] - 1))


def token_logps(model: Any, batch: Batch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each position's target log-probability (logits / temperature) and entropy, ``[b, L]`` fp32, 0 where the
    target is -100: over the tiled LM head when installed, else from the model's whole logits."""
    kwargs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    labels = batch["labels"]
    if has_tiled_loss(model):
        out = model(**kwargs, shift_labels=labels, token_logps=True, temperature=temperature, use_cache=False)
        return out.token_logps, out.entropy
    logits = model(**kwargs, use_cache=False).logits.float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    keep = labels != IGNORE_INDEX
    target = logp.gather(-1, labels.masked_fill(~keep, 0)[..., None]).squeeze(-1) * keep
    entropy = -(logp.exp() * logp).sum(-1) * keep
    return target, entropy.detach()


def per_token_loss(
    s: GRPOSettings, logps: torch.Tensor, batch: Batch, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """TRL's per-token loss, its per-token KL (β > 0) and the importance ratios ``ρ`` ([b, L] per token, [b, 1] per
    completion under GSPO's sequence level), as ``GRPOTrainer._compute_loss`` computes them."""
    old = batch.get("old_logps")
    old = logps.detach() if old is None else old
    log_ratio = logps - old
    if s.importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef1 = torch.exp(log_ratio)
    kl = None
    if s.beta != 0.0:
        ref = batch["ref_logps"]
        kl = torch.exp(ref - logps) - (ref - logps) - 1
        if s.bias_correction_kl:
            kl = kl * coef1
    adv = batch["advantages"].unsqueeze(1)
    coef2 = torch.clamp(coef1, 1 - s.epsilon, 1 + s.clip_high)
    loss = -torch.min(coef1 * adv, coef2 * adv)
    if kl is not None:
        loss = loss + s.beta * kl
    return loss, kl, coef1


def aggregate(s: GRPOSettings, loss: torch.Tensor, mask: torch.Tensor, normalizer: torch.Tensor) -> torch.Tensor:
    """One micro-batch's loss by ``--loss-type`` (dapo: ``normalizer`` = global completion tokens / (ranks ×
    accumulation steps), the LM loss's token normalizer)."""
    if s.loss_type == "grpo":
        return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if s.loss_type == "bnpo":
        return (loss * mask).sum() / mask.sum().clamp(min=1.0)
    if s.loss_type == "dr_grpo":
        return (loss * mask).sum() / (loss.shape[0] * s.max_completion_length)
    return (loss * mask).sum() / normalizer


def loss_stats(
    s: GRPOSettings,
    entropy: torch.Tensor,
    kl: torch.Tensor | None,
    coef: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """One micro-batch's sums for TRL's loss metrics: entropy and kl summed over completion tokens, their count; the
    low / high / region clip indicators summed over what TRL averages them over (tokens, or completions under the
    sequence level), that count; and each completion's clip fractions' smallest low and largest high (TRL's
    ``clip_ratio/low_min`` and ``high_max``; NaN-free over completions with tokens)."""
    adv = advantages.unsqueeze(1)
    low = ((coef < 1 - s.epsilon) & (adv < 0)).float()
    high = ((coef > 1 + s.clip_high) & (adv > 0)).float()
    region = torch.maximum(low, high)
    tokens = mask.sum()
    if coef.shape[1] == 1:  # one ratio per completion: TRL averages over completions
        clips, count = [x.sum() for x in (low, high, region)], torch.tensor(float(coef.shape[0]), device=mask.device)
        low_seq, high_seq = low.squeeze(1), high.squeeze(1)
    else:
        clips, count = [(x * mask).sum() for x in (low, high, region)], tokens
        per = mask.sum(-1)
        low_seq, high_seq = (low * mask).sum(-1) / per, (high * mask).sum(-1) / per  # NaN for an empty completion
    kl_sum = (kl * mask).sum() if kl is not None else torch.zeros((), device=mask.device)
    extremes = [_nan_extreme(low_seq, min), _nan_extreme(high_seq, max)]
    return torch.stack([(entropy * mask).sum(), kl_sum, tokens, *clips, count, *extremes]).detach().float()


def _nan_extreme(x: torch.Tensor, which: Any) -> torch.Tensor:
    """TRL's ``nanmin`` / ``nanmax`` of one micro-batch (NaN where every value is NaN)."""
    kept = x[~torch.isnan(x)]
    if kept.numel() == 0:
        return torch.full((), float("nan"), device=x.device)
    return kept.min() if which is min else kept.max()
