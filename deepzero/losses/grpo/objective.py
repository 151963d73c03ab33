"""The GRPO objective: each step's rollout (generate, score, advantages, rows), its loss, its eval, its state.

The engine calls ``rollout`` for a step's micro-batches: one prompt batch per rank (``sampling``: ``micro × accum
/ G`` prompts), ``G`` completions of each prompt (``deepzero.rollout.generation``, one group per rank), rewards
(``deepzero.rollout.rewards``), advantages ``(r − mean_group) / (std_group + 1e-4)`` (``--scale-rewards``), and the
completion rows: the prompt left-padded, the completion right-padded, targets only on completion tokens. With
``--num-iterations`` μ > 1 the same rows serve μ optimizer steps, their log-probs at generation kept as "old".
"""

from __future__ import annotations

import copy
from dataclasses import asdict, is_dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from deepzero.data import IGNORE_INDEX
from deepzero.distributed import every_ranks_object
from deepzero.errors import RaisedElsewhere, UserError
from deepzero.losses.grpo.loss import (
    Batch,
    advantages,
    aggregate,
    global_std,
    loss_stats,
    per_token_loss,
    token_logps,
)
from deepzero.losses.grpo.metrics import GRPOMetrics
from deepzero.losses.grpo.rollout import completion_rows, generating, inner_module, uncounted, unpadded
from deepzero.losses.grpo.samples import logged_samples
from deepzero.losses.grpo.settings import GRPOSettings
from deepzero.losses.lm import loss_normalizer
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
from deepzero.watchdog import phase


class GRPO(GRPOMetrics):
    """The GRPO objective (see the module docstring); ``attach`` gives it the data, tokenizer and rewards."""

    perplexity = False

    def __init__(self, settings: GRPOSettings, seed: int = 0, sampler: CompletionSampler | None = None) -> None:
        super().__init__()
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
        self.samples: list[dict[str, Any]] = []
        """The last generation's samples for completions.jsonl (``logged_samples``)."""
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
        model = inner_module(engine)
        ids, index = unpadded(prompts), prompts["index"].tolist()
        generation = self.seeds.generations
        rows_prompts = [p for p in ids for _ in range(g)]
        seeds = [seed for i in index for seed in self.seeds.rows(generation, i, g)]
        with self.timer.phase("generation"), generating(engine, model), phase("generating completions", every=True):
            completions = self.sampler.sample(model, rows_prompts, seeds)
        self.timer.tokens += sum(map(len, completions))
        self.seeds.generations += 1
        each = [i for i in index for _ in range(g)]
        context = self._reward_context(generation)
        with self.timer.phase("scoring"):
            total, per_name = self.score(self.data, each, completions, context)
        self.note_reward_metrics(context)
        device = prompts["prompt_ids"].device
        total, per_name = total.to(device), {k: v.to(device) for k, v in per_name.items()}
        batch_std = global_std(total) if s.scale_rewards == "batch" else None
        adv = advantages(total, g, s.scale_rewards, batch_std)
        self.note_rollout("train", total, per_name, completions, g, batch_std, rows_prompts)
        self.samples = logged_samples(self.tokenizer, self.data, context, each, completions, total, g)
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
        with self.timer.phase("reference"), torch.no_grad(), uncounted():
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
        with inner_module(engine).disable_adapter():
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
            mode = "train" if inner_module(model).training else "eval"
            self.note_loss(mode, loss_stats(s, entropy, kl, coef, batch["advantages"], mask))
        return result

    def eval_sums(self, model: Any, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """TRL's eval loss of one micro-batch of held-out prompts and a count of 1 (``val_loss``: the mean over every
        rank's micro-batches, as TRL's ``prediction_step``): ``eval_generations`` completions of each prompt,
        sampled per ``eval_sampling`` from the evaluation's streams (``EVAL_GENERATION``: evaluate.py's samples of
        the same weights), scored, their advantages and the loss at the current policy. Their pass@k and cons@k
        (``deepzero.rollout.scores``; correct: the first reward ≥ 1) are logged beside."""
        s, mod = self.settings, inner_module(model)
        k = s.eval_generations
        ids, index = unpadded(batch), batch["index"].tolist()
        rows = [p for p in ids for _ in range(k)]
        seeds = (
            None if s.eval_sampling == "greedy" else [x for i in index for x in self.seeds.rows(EVAL_GENERATION, i, k)]
        )
        with generating(model, mod):
            completions = self.eval_sampler.sample(mod, rows, seeds)
        each = [i for i in index for _ in range(k)]
        context = self._reward_context(self.seeds.generations)
        total, per_name = self.score(self.data_eval, each, completions, context)
        device = batch["prompt_ids"].device
        total, per_name = total.to(device), {name: v.to(device) for name, v in per_name.items()}
        batch_std = global_std(total) if s.scale_rewards == "batch" else None
        self.note_rollout("eval", total, per_name, completions, k)
        self.note_outcomes(per_name, completions, context, k)
        rows_batch = self.completion_batch(rows, completions, device)
        rows_batch["advantages"] = advantages(total, k, s.scale_rewards, batch_std).float()
        if s.beta != 0.0:
            rows_batch["ref_logps"] = self.reference_logps(model, rows_batch)
        world = dist.get_world_size() if dist.is_initialized() else 1
        loss = self.loss(model, rows_batch, self.normalizer([rows_batch], world))
        return loss.detach(), torch.ones((), device=device)

    data_eval: Any = None

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
