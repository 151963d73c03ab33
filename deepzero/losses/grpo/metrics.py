"""TRL's GRPO metrics over a logging window (rewards, lengths, loss, clip ratios, pass@k, phase times)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from deepzero.distributed import every_ranks_object
from deepzero.losses.grpo.loss import nanstd
from deepzero.losses.grpo.samples import write_samples
from deepzero.rollout.rewards import RewardContext
from deepzero.rollout.scores import Condition, summarise
from deepzero.rollout.votes import voter_for


class GRPOMetrics:
    """The metric windows of the GRPO objective, a base of :class:`deepzero.losses.grpo.objective.GRPO`: it notes
    each generation's and micro-batch's sums, and ``window_stats`` reduces them over ranks. It reads the objective's
    ``settings``, ``rewards``, ``tokenizer``, ``truncated``, ``seeds``, ``out_dir`` and ``samples``."""

    def __init__(self) -> None:
        self._loss_stats: dict[str, list[torch.Tensor]] = {"train": [], "eval": []}
        self._rollout_stats: dict[str, list[torch.Tensor]] = {"train": [], "eval": []}
        self.timer = PhaseTimer()
        self._rollout_extremes: dict[str, list[torch.Tensor]] = {"train": [], "eval": []}
        self.tokens_generated = 0
        """Prompt and completion tokens of this rank's training generations, the run's (TRL's ``num_tokens``)."""
        self._reward_metrics: dict[str, list[float]] = {}
        self._outcomes: list[dict[str, Any]] = []

    def note_loss(self, mode: str, sums: torch.Tensor) -> None:
        """One micro-batch's ``loss_stats`` for the window."""
        self._loss_stats[mode].append(sums)

    def note_outcomes(self, per_name: dict, completions: list[list[int]], context: RewardContext, k: int) -> None:
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

    def note_rollout(
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

    def note_reward_metrics(self, context: RewardContext) -> None:
        """What the rewards logged as metrics (``log_metric``), for the window."""
        for name, values in context.metrics.items():
            self._reward_metrics.setdefault(name, []).extend(values)

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
            write_samples(self.out_dir, self.seeds.generations, self.samples)
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
