"""GRPO as an objective plug-in: each step samples completions of the step's prompts, scores them, and minimises
TRL 1.16's ``GRPOTrainer`` loss over them (``trl/trainer/grpo_trainer.py``, ``_compute_loss``).

The engine calls ``rollout`` for a step's micro-batches: one prompt batch per rank (``sampling``: ``micro × accum
/ G`` prompts), ``G`` completions of each prompt (``deepzero.rollout.generation``, one group per rank), rewards
(``deepzero.rollout.rewards``), advantages ``(r − mean_group) / (std_group + 1e-4)`` (``--scale-rewards``), and the
completion rows: the prompt left-padded, the completion right-padded, targets only on completion tokens. With
``--num-iterations`` μ > 1 the same rows serve μ optimizer steps, their log-probs at generation kept as "old".

Per token (log-probs of the logits / temperature, through the tiled LM head): ``ρ = exp(logp − logp_old)``,
``ℓ = −min(ρA, clip(ρ, 1 − ε, 1 + ε_high)A) + β·(exp(ref − logp) − (ref − logp) − 1)``, aggregated by
``--loss-type``: grpo (mean of each completion's token mean), bnpo (token mean of the micro-batch), dr_grpo
(sum / (completions × max completion length)), dapo (sum / the global batch's completion tokens; TRL's default).
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, is_dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from deepzero.data import IGNORE_INDEX
from deepzero.distributed import every_ranks_object
from deepzero.errors import RaisedElsewhere, UserError
from deepzero.losses.lm import loss_normalizer
from deepzero.losses.tiled import has_tiled_loss
from deepzero.rollout.generation import (
    BACKENDS,
    EVAL_GENERATION,
    PROTOCOLS,
    CompletionSampler,
    GroupSeeds,
    eos_ids,
    truncated,
)
from deepzero.rollout.rewards import RewardContext
from deepzero.rollout.scores import Condition, summarise
from deepzero.rollout.votes import voter_for
from deepzero.watchdog import phase

LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo")
SCALES = ("group", "batch", "none")
IMPORTANCE_LEVELS = ("token", "sequence")
RESERVED_GENERATION_KWARGS = frozenset(
    {"do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens", "eos_token_id",
     "pad_token_id", "logits_processor", "attention_mask", "use_cache", "num_return_sequences"}
)  # fmt: skip
"""``generate`` arguments the flags and the row-by-row sampler own."""
COMPLETIONS_FILE = "completions.jsonl"
LOGGED_COMPLETIONS = 4
"""Prompts (with their completions and rewards) written to completions.jsonl at each log point."""

Batch = dict[str, torch.Tensor]


@dataclass
class GRPOSettings:
    """GRPO's settings (the flags), defaults as TRL 1.16's GRPOConfig (max_completion_length: 256, not 512)."""

    rewards: tuple[str, ...] = ()
    num_generations: int = 8
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    """Upper clip (None: ``epsilon``)."""
    loss_type: str = "dapo"
    beta: float = 0.0
    scale_rewards: str = "group"
    num_iterations: int = 1
    reference: str = "none"
    """β > 0: "adapters-off" (LoRA) or "frozen-copy" (full fine-tuning); none for β = 0."""
    bias_correction_kl: bool = True
    """TRL 1.16's ``use_bias_correction_kl`` (its default): the KL term multiplied by the importance ratio ρ
    (DeepSeek-V3.2's unbiased reverse KL), which changes the KL gradient even on-policy, where ρ = 1."""
    importance_sampling_level: str = "token"
    """TRL's ``importance_sampling_level``: "token" (one ratio per token) or "sequence" (GSPO: the exponential of
    the completion's mean log-ratio, one per completion)."""
    top_k: int = 0
    """0: off (TRL's default)."""
    min_p: float | None = None
    repetition_penalty: float = 1.0
    generation_kwargs: dict[str, Any] = field(default_factory=dict)
    """More ``generate`` / ``GenerationConfig`` arguments (``--generation-kwargs JSON``, TRL's ``generation_kwargs``)."""
    mask_truncated_completions: bool = False
    """A completion that reached ``max_completion_length`` without an end-of-sequence token has no loss tokens."""
    generation_batch_size: int | None = None
    """Rows per generate call (None: all of a rank's rows at once)."""
    generation_backend: str = "generate"
    """``deepzero.rollout.generation.BACKENDS``: Transformers' generate, or its continuous batching."""
    num_generations_eval: int | None = None
    """Completions per held-out prompt at an eval (TRL's; None: ``num_generations``)."""
    eval_sampling: str = "train"
    """``EVAL_SAMPLING``: the eval samples as training does (TRL), as DeepSeek-R1 reports (T 0.6, top-p 0.95), or
    greedily (one completion per prompt)."""

    @property
    def eval_generations(self) -> int:
        if self.eval_sampling == "greedy":
            return 1
        return self.num_generations if self.num_generations_eval is None else self.num_generations_eval

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def check(self) -> None:
        """Each value in range; the error names the flag."""
        checks = [
            ("--num-generations", self.num_generations >= 2, "at least 2 (a group's advantages need 2)", "8"),
            ("--max-completion-length", self.max_completion_length >= 1, "at least 1", "256"),
            ("--temperature", math.isfinite(self.temperature) and self.temperature > 0, "positive", "1.0"),
            ("--top-p", 0 < self.top_p <= 1, "in (0, 1]", "1.0"),
            ("--top-k", self.top_k >= 0, "0 (off) or more", "0"),
            ("--min-p", self.min_p is None or 0 <= self.min_p <= 1, "in [0, 1]", "0.1"),
            (
                "--repetition-penalty",
                math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
                "positive",
                "1.0",
            ),
            ("--epsilon", math.isfinite(self.epsilon) and 0 <= self.epsilon < 1, "in [0, 1)", "0.2"),
            ("--epsilon-high", self.epsilon_high is None or self.epsilon_high >= 0, "0 or more", "0.28"),
            ("--beta", math.isfinite(self.beta) and self.beta >= 0, "0 or more", "0.04"),
            ("--num-iterations", self.num_iterations >= 1, "at least 1", "1"),
            (
                "--num-generations-eval",
                self.num_generations_eval is None or self.num_generations_eval >= 1,
                "at least 1",
                "4",
            ),
        ]
        for flag, ok, what, example in checks:
            if not ok:
                raise UserError(flag, f"must be {what}", f"pass e.g. {example}")
        if taken := sorted(set(self.generation_kwargs) & RESERVED_GENERATION_KWARGS):
            raise UserError(
                f"--generation-kwargs {taken[0]}",
                "is set by deepzero's own flags or sampler",
                "use --temperature / --top-p / --top-k / --min-p / --repetition-penalty / --max-completion-length",
            )
        if self.importance_sampling_level not in IMPORTANCE_LEVELS:
            raise UserError(
                "--importance-sampling-level",
                f"unknown {self.importance_sampling_level!r}",
                f"use one of {', '.join(IMPORTANCE_LEVELS)}",
            )
        if self.loss_type not in LOSS_TYPES:
            raise UserError(
                "--loss-type", f"unknown GRPO loss {self.loss_type!r}", f"use one of {', '.join(LOSS_TYPES)}"
            )
        if self.scale_rewards not in SCALES:
            raise UserError("--scale-rewards", f"unknown {self.scale_rewards!r}", f"use one of {', '.join(SCALES)}")
        if not self.rewards:
            raise UserError("--reward", "a prompts data folder trains with GRPO, which needs a reward", "pass --reward")


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


def completion_rows(
    prompts: list[torch.Tensor], completions: list[list[int]], pad_id: int, device: torch.device
) -> Batch:
    """Rows ``prompt (left-padded) + completion (right-padded)`` with their attention mask, and as ``labels`` the
    shifted targets: the next token where it is a completion token, else -100 (TRL's layout and targets)."""
    p_len = max(len(p) for p in prompts)
    c_len = max(max(len(c) for c in completions), 1)
    n = len(completions)
    ids = torch.full((n, p_len + c_len), pad_id, dtype=torch.long)
    mask = torch.zeros((n, p_len + c_len), dtype=torch.long)
    is_completion = torch.zeros((n, p_len + c_len), dtype=torch.bool)
    for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        ids[i, p_len - len(prompt) : p_len] = prompt.cpu()
        mask[i, p_len - len(prompt) : p_len] = 1
        ids[i, p_len : p_len + len(completion)] = torch.tensor(completion, dtype=torch.long)
        mask[i, p_len : p_len + len(completion)] = 1
        is_completion[i, p_len : p_len + len(completion)] = True
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, :-1] = ids[:, 1:].masked_fill(~is_completion[:, 1:], IGNORE_INDEX)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


class GRPO:
    """The GRPO objective (see the module docstring); ``attach`` gives it the data, tokenizer and rewards."""

    perplexity = False

    def __init__(self, settings: GRPOSettings, seed: int = 0, sampler: CompletionSampler | None = None) -> None:
        self.settings = settings
        self.seeds = GroupSeeds(seed)
        self.sampler = sampler
        self.data: Any = None
        self.tokenizer: Any = None
        self.rewards: Any = None
        self.out_dir: Path | None = None
        self.pad_id = 0
        self.reference_model: nn.Module | None = None
        self._buffer: list[Batch] | None = None
        self._uses = 0
        self._loss_stats: dict[str, list[torch.Tensor]] = {"train": [], "eval": []}
        self._rollout_stats: dict[str, list[torch.Tensor]] = {"train": [], "eval": []}
        self._samples: list[dict[str, Any]] = []
        self.timer = PhaseTimer()
        self._rollout_extremes: dict[str, list[torch.Tensor]] = {"train": [], "eval": []}
        self.tokens_generated = 0
        """Prompt and completion tokens of this rank's training generations, the run's (TRL's ``num_tokens``)."""
        self._reward_metrics: dict[str, list[float]] = {}
        self._extra: dict[str, list[Any]] = {}
        self._outcomes: list[dict[str, Any]] = []
        self.eval_sampler: CompletionSampler | None = None

    # -- set-up -------------------------------------------------------------------------------------------------
    def attach(self, data: Any, tokenizer: Any, rewards: Any, out_dir: Path | None, model: nn.Module) -> None:
        """The prompts, the tokenizer (pad, end-of-sequence, decoding), the rewards, and (β > 0, full fine-tuning)
        a frozen copy of the starting weights; call before any step or checkpoint load."""
        s = self.settings
        self.data, self.tokenizer, self.rewards, self.out_dir = data, tokenizer, rewards, out_dir
        eos = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        if self.sampler is None:
            self.sampler = BACKENDS[s.generation_backend](
                s.max_completion_length, eos_ids(tokenizer, model), self.pad_id, s.temperature, s.top_p,
                s.generation_batch_size, s.top_k, s.min_p, s.repetition_penalty, dict(s.generation_kwargs),
            )  # fmt: skip
        self.eval_sampler = self.sampler
        if s.eval_sampling != "train" and is_dataclass(self.sampler):
            protocol = PROTOCOLS[s.eval_sampling]
            self.eval_sampler = replace(  # evaluate.py's sampling: none of training's warpers or generate kwargs
                self.sampler, temperature=protocol["temperature"] or 1.0, top_p=protocol.get("top_p", 1.0),
                top_k=0, min_p=None, repetition_penalty=1.0, generation_kwargs={},
            )  # fmt: skip
        if s.reference == "frozen-copy":
            self.reference_model = copy.deepcopy(model).eval().requires_grad_(False)

    def sampling(self, micro: int, accum: int, start_step: int) -> tuple[int, int, int]:
        """The prompt sampler's shape: one batch of ``micro × accum / G`` prompts per rank per generation, a
        generation every ``num_iterations`` steps; resumed between two generations (a restored generation batch),
        the sampler starts at the next one."""
        mu = self.settings.num_iterations
        start = -(-start_step // mu) if self._buffer is not None else start_step // mu
        return micro * accum // self.settings.num_generations, 1, start

    def eval_micro(self, micro: int) -> int:
        """Held-out prompts per eval micro-batch: ``micro`` completion rows, ``eval_generations`` a prompt (TRL's
        per-device eval batch counts completions), at least one prompt."""
        return max(1, micro // self.settings.eval_generations)

    def state_dict(self) -> dict[str, Any]:
        return {"sampling": self.seeds.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "sampling" in state:
            self.seeds.load_state_dict(state["sampling"])

    def rank_state(self) -> dict[str, Any]:
        """This rank's generation batch while ``num_iterations`` > 1 has steps left on it (its completions, old and
        reference log-probs), for its own checkpoint file: a resume then trains on it as the uninterrupted run."""
        tokens = {"tokens_generated": self.tokens_generated}  # this rank's share of TRL's num_tokens
        if self._buffer is None or self._uses >= self.settings.num_iterations:
            return tokens
        return {"generation_batch": self._buffer, "uses": self._uses, **tokens}

    def load_rank_state(self, state: dict[str, Any]) -> None:
        self.tokens_generated = int(state.get("tokens_generated", 0))
        if state.get("generation_batch") is not None:
            self._buffer, self._uses = state["generation_batch"], int(state["uses"])

    # -- the step -----------------------------------------------------------------------------------------------
    def rollout(self, engine: Any, batches: Any, accum: int) -> list[Batch]:
        """The step's completion micro-batches: a new generation every ``num_iterations`` steps, else the last."""
        self.timer.steps += 1
        if self._buffer is None or self._uses >= self.settings.num_iterations:
            prompts = next(batches)
            self._buffer = self.generate_and_score(engine, prompts, accum)
            self._uses = 0
        self._uses += 1
        return self._buffer

    def generate_and_score(self, engine: Any, prompts: Batch, accum: int) -> list[Batch]:
        """Sample G completions of each prompt, score them, and build ``accum`` micro-batches of rows."""
        s, g = self.settings, self.settings.num_generations
        model = _module(engine)
        ids, index = _unpadded(prompts), prompts["index"].tolist()
        generation = self.seeds.generations
        rows_prompts = [p for p in ids for _ in range(g)]
        seeds = [seed for i in index for seed in self.seeds.rows(generation, i, g)]
        with self.timer.phase("generation"), _generating(engine, model), phase("generating completions", every=True):
            completions = self.sampler.sample(model, rows_prompts, seeds)
        self.timer.tokens += sum(map(len, completions))
        self.seeds.generations += 1
        each = [i for i in index for _ in range(g)]
        context = self._reward_context(generation)
        with self.timer.phase("scoring"):
            total, per_name = self.score(self.data, each, completions, context)
        self._note_reward_logs(context, len(completions))
        device = prompts["prompt_ids"].device
        total, per_name = total.to(device), {k: v.to(device) for k, v in per_name.items()}
        batch_std = self._global_std(total) if s.scale_rewards == "batch" else None
        adv = advantages(total, g, s.scale_rewards, batch_std)
        self._note_rollout("train", total, per_name, completions, g, batch_std, rows_prompts)
        self._keep_samples(each, completions, total, g)
        n = len(completions)
        if n % accum:
            raise UserError("--num-generations", f"{n} completions do not split into {accum} micro-batches", "fix")
        size = n // accum
        micro = []
        for k in range(accum):
            part = slice(k * size, (k + 1) * size)
            batch = self.completion_batch(rows_prompts[part], completions[part], device)
            batch["advantages"] = adv[part].float()
            micro.append(batch)
        with self.timer.phase("reference"), torch.no_grad(), _uncounted():
            for batch in micro:
                if s.num_iterations > 1:
                    batch["old_logps"] = token_logps(engine, batch, s.temperature)[0]
                if s.beta != 0.0:
                    batch["ref_logps"] = self.reference_logps(engine, batch)
        return micro

    def _reward_context(self, generations: int) -> RewardContext:
        """TRL's reward context after ``generations`` generation batches: each served ``num_iterations`` steps."""
        return RewardContext(global_step=generations * self.settings.num_iterations)

    def truncated(self, completion: list[int]) -> bool:
        """Cut by the length limit: no end-of-sequence token at its end."""
        return truncated(completion, self.sampler.eos_ids)

    def completion_batch(self, prompts: list[torch.Tensor], completions: list[list[int]], device: Any) -> Batch:
        """The rows of ``completions`` after their ``prompts`` (``completion_rows``); with
        ``mask_truncated_completions`` (TRL's) a truncated row's tokens leave the loss and its normaliser."""
        batch = completion_rows(prompts, completions, self.pad_id, device)
        if self.settings.mask_truncated_completions:
            cut = torch.tensor([self.truncated(c) for c in completions], device=device)
            batch["labels"] = batch["labels"].masked_fill(cut[:, None], IGNORE_INDEX)
        return batch

    def reference_logps(self, engine: Any, batch: Batch) -> torch.Tensor:
        """log π_ref per token: the frozen copy of the starting weights, or the model with its adapters off."""
        if self.reference_model is not None:
            return token_logps(self.reference_model, batch, self.settings.temperature)[0]
        with _module(engine).disable_adapter():
            return token_logps(engine, batch, self.settings.temperature)[0]

    def score(
        self, data: Any, each: list[int], completions: list[list[int]], context: RewardContext
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The rewards of every completion (of prompt ``each[i]`` of ``data``); a bad reward stops every rank with
        the failing rank's line."""
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        error = None
        total, per_name = torch.zeros(0), {}
        try:
            total, per_name = self.rewards.score_rows(data, each, texts, completions, context)
        except UserError as err:
            error = str(err)
        if first := next((e for e in every_ranks_object(error) if e), None):
            raise RaisedElsewhere(first)
        return total.float(), {k: v.float() for k, v in per_name.items()}

    def normalizer(self, micro: list[Batch], dp_size: int, group: Any = None) -> torch.Tensor:
        """dapo: the global completion-token count / (accumulation steps × ranks); the others normalise inside
        each micro-batch (1)."""
        if self.settings.loss_type != "dapo":
            return torch.ones((), device=micro[0]["input_ids"].device)

        return loss_normalizer(micro, dp_size, group)

    def loss(self, model: Any, batch: Batch, normalizer: torch.Tensor) -> torch.Tensor:
        s = self.settings
        logps, entropy = token_logps(model, batch, s.temperature)
        mask = (batch["labels"] != IGNORE_INDEX).float()
        loss, kl, coef = per_token_loss(s, logps, batch, mask)
        result = aggregate(s, loss, mask, normalizer)
        with torch.no_grad():
            mode = "train" if _module(model).training else "eval"
            self._loss_stats[mode].append(loss_stats(s, entropy, kl, coef, batch["advantages"], mask))
        return result

    def eval_sums(self, model: Any, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """TRL's eval loss of one micro-batch of held-out prompts and a count of 1 (``val_loss``: the mean over every
        rank's micro-batches, as TRL's ``prediction_step``): ``eval_generations`` completions of each prompt,
        sampled per ``eval_sampling`` from the evaluation's streams (``EVAL_GENERATION``: evaluate.py's samples of
        the same weights), scored, their advantages and the loss at the current policy. Their pass@k and cons@k
        (``deepzero.rollout.scores``; correct: the first reward ≥ 1) are logged beside."""
        s, mod = self.settings, _module(model)
        k = s.eval_generations
        ids, index = _unpadded(batch), batch["index"].tolist()
        rows = [p for p in ids for _ in range(k)]
        seeds = (
            None if s.eval_sampling == "greedy" else [x for i in index for x in self.seeds.rows(EVAL_GENERATION, i, k)]
        )
        with _generating(model, mod):
            completions = self.eval_sampler.sample(mod, rows, seeds)
        each = [i for i in index for _ in range(k)]
        context = self._reward_context(self.seeds.generations)
        total, per_name = self.score(self.data_eval, each, completions, context)
        device = batch["prompt_ids"].device
        total, per_name = total.to(device), {name: v.to(device) for name, v in per_name.items()}
        batch_std = self._global_std(total) if s.scale_rewards == "batch" else None
        self._note_rollout("eval", total, per_name, completions, k)
        self._note_outcomes(per_name, completions, context, k)
        rows_batch = self.completion_batch(rows, completions, device)
        rows_batch["advantages"] = advantages(total, k, s.scale_rewards, batch_std).float()
        if s.beta != 0.0:
            rows_batch["ref_logps"] = self.reference_logps(model, rows_batch)
        world = dist.get_world_size() if dist.is_initialized() else 1
        loss = self.loss(model, rows_batch, self.normalizer([rows_batch], world))
        return loss.detach(), torch.ones((), device=device)

    def _note_outcomes(self, per_name: dict, completions: list[list[int]], context: RewardContext, k: int) -> None:
        """Each eval prompt's samples judged (the first reward ≥ 1, as evaluate.py's default) with the answers they
        give, for pass@k / cons@k."""
        judge = Condition.first_reward_at_least_one(self.rewards.names)
        values = per_name[judge.name].tolist()
        answers = context.answers(len(values))
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        voter = voter_for(judge.name)
        for start in range(0, len(values), k):
            part = range(start, start + k)
            self._outcomes.append(
                {
                    "correct": [judge.verdict({judge.name: values[r]}) for r in part],
                    "votes": voter.groups([texts[r] for r in part], [answers[r] for r in part]),
                    "lengths": [len(completions[r]) for r in part],
                    "truncated": [self.truncated(completions[r]) for r in part],
                }
            )

    def _outcome_metrics(self) -> dict[str, float]:
        """pass@1, pass@k and cons@k over every rank's eval prompts since the last eval (a collective)."""
        mine, self._outcomes = self._outcomes, []
        lines = [line for part in every_ranks_object(mine) for line in part]
        k = self.settings.eval_generations
        summary = summarise(lines, [1, k])
        return {
            key: float(v)
            for key, v in summary.items()
            if key.startswith(("pass@", "cons@")) and "_" not in key and v is not None
        }

    data_eval: Any = None

    # -- metrics ------------------------------------------------------------------------------------------------
    def _note_rollout(
        self,
        mode: str,
        total: torch.Tensor,
        per_name: dict,
        completions: list[list[int]],
        g: int,
        batch_std: torch.Tensor | None = None,
        prompts: list[torch.Tensor] | None = None,
    ) -> None:
        """One generation's sums for TRL's rollout metrics (``window_stats``), and its extremes (lengths)."""
        dev = total.device
        lengths = torch.tensor([float(len(c)) for c in completions], device=dev)
        truncated = torch.tensor([self.truncated(c) for c in completions], device=dev)
        ok = ~torch.isnan(total)
        zero_std = torch.zeros((), device=dev)
        if batch_std is not None:  # scale_rewards=batch: TRL's zero-std test is the batch's
            zero_std = torch.isclose(batch_std, torch.zeros_like(batch_std)).float() * len(completions)
        elif g > 1:
            std = nanstd(total.view(-1, g), dim=1)
            zero_std = torch.isclose(std, torch.zeros_like(std)).float().sum() * g
        values = [total.nan_to_num().sum(), (total.nan_to_num() ** 2).sum(), ok.float().sum()]
        for name in self.rewards.names:
            v = per_name[name]
            keep = ~torch.isnan(v)
            values += [v.nan_to_num().sum(), keep.float().sum(), (v.nan_to_num() ** 2).sum()]
        ended = lengths[~truncated]
        values += [lengths.sum(), truncated.float().sum(), zero_std, torch.tensor(float(len(completions)), device=dev)]
        values += [ended.sum(), torch.tensor(float(ended.numel()), device=dev)]
        if mode == "train" and prompts is not None:
            self.tokens_generated += int(lengths.sum().item()) + sum(len(p) for p in prompts)
        self._rollout_stats[mode].append(torch.stack(values).float())
        none = torch.tensor([math.inf], device=dev)
        low = torch.stack([lengths.min(), ended.min() if ended.numel() else none[0]])
        high = torch.stack([lengths.max(), ended.max() if ended.numel() else -none[0]])
        self._rollout_extremes[mode].append(torch.cat([low, -high]).float())  # one MIN reduction for all four

    def _note_reward_logs(self, context: RewardContext, n: int) -> None:
        """What the rewards logged: their metrics for the window, their extra columns (one value per completion)
        for this generation's samples."""
        for name, values in context.metrics.items():
            self._reward_metrics.setdefault(name, []).extend(values)
        self._extra = {k: v for k, v in context.extra.items() if len(v) == n}

    def _keep_samples(self, each: list[int], completions: list[list[int]], total: torch.Tensor, g: int) -> None:
        """The first ``LOGGED_COMPLETIONS`` prompts' completions (of prompt ``each[i]``) for completions.jsonl."""
        texts = self.tokenizer.batch_decode(completions[: LOGGED_COMPLETIONS * g], skip_special_tokens=True)
        self._samples = [
            {"prompt": self.data.prompt_text(each[i]), "completion": texts[i], "reward": float(total[i])}
            | {column: values[i] for column, values in self._extra.items()}
            for i in range(len(texts))
        ]

    def _global_std(self, total: torch.Tensor) -> torch.Tensor:
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

    def window_stats(self, mode: str) -> dict[str, float]:
        """TRL's metrics, each the mean over the window of its per-generation (rewards, lengths) or per-micro-batch
        (entropy, kl, clip ratios; token-weighted over every rank) values; a collective."""
        out: dict[str, float] = {}
        rollouts, self._rollout_stats[mode] = self._rollout_stats[mode], []
        losses, self._loss_stats[mode] = self._loss_stats[mode], []
        if rollouts:
            r = torch.stack(rollouts)
            extremes, self._rollout_extremes[mode] = torch.stack(self._rollout_extremes[mode]), []
            if dist.is_initialized():
                dist.all_reduce(r)
                dist.all_reduce(extremes, op=dist.ReduceOp.MIN)
            out.update(self._rollout_metrics(r, extremes, mode))
        if losses:
            m = torch.stack(losses)
            sums, low_min, high_max = m[:, :7].clone(), m[:, 7].clone(), m[:, 8].clone()
            if dist.is_initialized():  # per micro-batch over ranks, as TRL's gather at each micro-batch
                dist.all_reduce(sums)
                dist.all_reduce(low_min.nan_to_num_(nan=math.inf), op=dist.ReduceOp.MIN)
                dist.all_reduce(high_max.nan_to_num_(nan=-math.inf), op=dist.ReduceOp.MAX)
                low_min[torch.isinf(low_min)], high_max[torch.isinf(high_max)] = math.nan, math.nan
            tokens, count = sums[:, 2].clamp(min=1), sums[:, 6].clamp(min=1)
            out["entropy"] = (sums[:, 0] / tokens).mean().item()
            for k, name in enumerate(("low_mean", "high_mean", "region_mean")):
                out[f"clip_ratio/{name}"] = (sums[:, 3 + k] / count).mean().item()
            out["clip_ratio/low_min"] = torch.nanmean(low_min).item()
            out["clip_ratio/high_max"] = torch.nanmean(high_max).item()
            if self.settings.beta != 0.0:
                out["kl"] = (sums[:, 1] / tokens).mean().item()
        if mode == "eval":
            out.update(self._outcome_metrics())
        if mode == "train":
            out.update(self.timer.window())
            out.update(self._reward_metrics_window())
        if mode == "train" and rollouts:
            self._write_samples()
        return out

    def _reward_metrics_window(self) -> dict[str, float]:
        """The rewards' ``log_metric`` values since the last log, each averaged over every rank's (TRL: over the
        logging step); a collective, so every rank calls it."""
        mine, self._reward_metrics = self._reward_metrics, {}
        merged: dict[str, list[float]] = {}
        for part in every_ranks_object(mine):
            for name, values in part.items():
                merged.setdefault(name, []).extend(values)
        return {name: sum(v) / len(v) for name, v in sorted(merged.items()) if v}

    def _rollout_metrics(self, r: torch.Tensor, extremes: torch.Tensor, mode: str) -> dict[str, float]:
        """TRL's rollout metrics from each generation's global sums (rows of ``r``) and extremes, each the mean over
        the window's generations of TRL's per-generation value."""

        def mean_std(total: torch.Tensor, squares: torch.Tensor, n: torch.Tensor) -> tuple[float, float]:
            n = n.clamp(min=1)
            mean = total / n
            std = torch.sqrt(((squares - n * mean**2) / (n - 1).clamp(min=1)).clamp(min=0))
            return mean.mean().item(), std.mean().item()

        out: dict[str, float] = {}
        out["reward"], out["reward_std"] = mean_std(r[:, 0], r[:, 1], r[:, 2])
        for k, name in enumerate(self.rewards.names):
            column = 3 + 3 * k
            mean, std = mean_std(r[:, column], r[:, column + 2], r[:, column + 1])
            out[f"rewards/{name}/mean"], out[f"rewards/{name}/std"] = mean, std
        base = 3 + 3 * len(self.rewards.names)
        lengths, truncated, zero_std, count, ended, n_ended = r[:, base : base + 6].unbind(1)
        count = count.clamp(min=1)
        out["completions/mean_length"] = (lengths / count).mean().item()
        out["completions/min_length"] = extremes[:, 0].mean().item()
        out["completions/max_length"] = (-extremes[:, 2]).mean().item()
        out["completions/clipped_ratio"] = (truncated / count).mean().item()
        none = torch.isinf(extremes[:, 1])  # TRL: 0 where no completion ended
        out["completions/mean_terminated_length"] = (ended / n_ended.clamp(min=1)).mean().item()
        out["completions/min_terminated_length"] = extremes[:, 1].masked_fill(none, 0).mean().item()
        out["completions/max_terminated_length"] = (-extremes[:, 3]).masked_fill(none, 0).mean().item()
        if mode == "train":
            out["frac_reward_zero_std"] = (zero_std / count).mean().item()
            tokens = torch.tensor([float(self.tokens_generated)], device=r.device)
            if dist.is_initialized():
                dist.all_reduce(tokens)
            out["num_tokens"] = tokens.item()
        return out

    def _write_samples(self) -> None:
        if self.out_dir is None or not self._samples or (dist.is_initialized() and dist.get_rank() != 0):
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with (self.out_dir / COMPLETIONS_FILE).open("a") as fh:
            fh.write(json.dumps({"generation": self.seeds.generations, "samples": self._samples}) + "\n")

    def describe(self) -> str:
        s = self.settings
        ref = {
            "none": "no reference",
            "adapters-off": "reference = adapters off",
            "frozen-copy": "reference = a frozen copy",
        }
        rows = "a rank's rows" if s.generation_batch_size is None else f"{s.generation_batch_size} rows"
        rows += " (continuous batching)" if s.generation_backend == "continuous" else ""
        masked = ", truncated completions masked" if s.mask_truncated_completions else ""
        return (
            f"loss: GRPO {s.loss_type} (G {s.num_generations}, epsilon {s.epsilon:g}/{s.clip_high:g}, beta {s.beta:g},"
            f" {ref[s.reference]}, scale rewards {s.scale_rewards}, {s.num_iterations} iteration(s) per generation);"
            f" sampling T {s.temperature:g} top-p {s.top_p:g}, up to {s.max_completion_length} tokens,"
            f" {rows} per generate call{masked}; rewards {', '.join(s.rewards)}"
        )

    def to_json(self) -> dict[str, Any]:
        return {"kind": "grpo", **asdict(self.settings)}


def _module(engine: Any) -> nn.Module:
    """The model inside a DeepSpeed engine (peft model under LoRA), or ``engine`` itself."""
    return getattr(engine, "module", engine)


def _unpadded(prompts: Batch) -> list[torch.Tensor]:
    """Each prompt's ids without the left padding."""
    return [ids[mask.bool()] for ids, mask in zip(prompts["prompt_ids"], prompts["prompt_mask"], strict=True)]


def _uncounted() -> Any:
    from deepzero.moe_balance import uncounted

    return uncounted()


class PhaseTimer:
    """Wall time of a step's GRPO phases on this rank (generation, scoring, reference: the old and reference
    log-probs), the device synchronised at each phase's end, and the completion tokens generated; ``window`` gives
    each phase's mean seconds per step since the last call, averaged over ranks (a collective), as verl and TRL log
    them, and the generation's tokens per second."""

    PHASES = ("generation", "scoring", "reference")

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        self.tokens = 0
        self.steps = 0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        from deepspeed.accelerator import get_accelerator

        start = time.perf_counter()
        try:
            yield
        finally:
            get_accelerator().synchronize()
            self.seconds[name] += time.perf_counter() - start

    def window(self) -> dict[str, float]:
        from deepspeed.accelerator import get_accelerator

        steps, generated = max(self.steps, 1), self.seconds["generation"] > 0
        rate = self.tokens / self.seconds["generation"] if generated else 0.0
        values = [*(self.seconds[p] / steps for p in self.PHASES), rate]
        total = torch.tensor(values, dtype=torch.float64, device=get_accelerator().current_device_name())
        if dist.is_initialized():
            dist.all_reduce(total)
            total /= dist.get_world_size()
        self.__init__()
        *phases, rate = total.tolist()
        out = {f"timing/{p}_s": v for p, v in zip(self.PHASES, phases, strict=True)}
        return out | ({"generation/tokens_per_s": rate} if generated else {})


class _generating:
    """Generation mode: eval (no dropout), routers not counting, and under ZeRO-3 every parameter gathered once for
    the whole generation with DeepSpeed's fetch and release hooks off, as TRL's ``unwrap_model_for_generation``
    does (its ``remove_hooks`` / ``add_hooks``): each rank holds the whole model meanwhile (a 4-bit base as its
    packed codes), and no forward of a decoding step fetches anything."""

    def __init__(self, engine: Any, model: nn.Module) -> None:
        self.engine, self.model = engine, model
        params = [p for p in model.parameters() if hasattr(p, "ds_id")]
        if params:
            import deepspeed

            self.gather = deepspeed.zero.GatheredParameters(params)
        else:
            self.gather = nullcontext()
        self.hooks = bool(params) and getattr(engine, "optimizer", None) is not None
        self.uncounted = _uncounted()

    def __enter__(self) -> None:
        self.was_training = self.model.training
        self.gather.__enter__()
        if self.hooks:
            from trl.models.utils import remove_hooks

            remove_hooks(self.engine)
        self.uncounted.__enter__()
        self.model.eval()

    def __exit__(self, *exc: Any) -> None:
        self.model.train(self.was_training)
        self.uncounted.__exit__(*exc)
        if self.hooks:
            from trl.models.utils import add_hooks

            add_hooks(self.engine)
        self.gather.__exit__(*exc)
