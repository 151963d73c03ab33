"""What the engines minimise, as one plug-in (``Objective``): the causal-LM loss over target tokens, or a preference
loss over pairs (DPO and its variants). The engine draws a step's micro-batches, asks the objective for the
normalizer and for each micro-batch's loss, and steps; the loop reads the objective's window statistics.

Preference losses follow TRL's ``DPOTrainer`` (``trl/trainer/dpo_trainer.py``) and, for SimPO, ``CPOTrainer``.
With ``Δ = (log π(c) − log π_ref(c)) − (log π(r) − log π_ref(r))`` summed over each answer's tokens:

- ``sigmoid`` (DPO): ``−(1 − ε) log σ(βΔ) − ε log σ(−βΔ)`` (ε: ``label_smoothing``, the conservative DPO of
  Mitchell 2023; ε = 0 is TRL's ``sigmoid``);
- ``ipo``: ``(Δ_c / n_c − Δ_r / n_r − 1/(2β))²`` with each answer's log-ratio averaged over its n tokens (TRL);
- ``hinge``: ``relu(1 − βΔ)``;
- ``simpo`` (reference-free): ``−(1 − ε) log σ(βm) − ε log σ(−βm)``, ``m = log π(c)/n_c − log π(r)/n_r − γ/β``.

Rewards as TRL logs them: ``β (log π − log π_ref)`` per answer (SimPO: ``β log π / n``); ``rewards/accuracies`` is
the share of pairs whose chosen reward is higher, ``rewards/margins`` the mean difference.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from deepzero.data import IGNORE_INDEX
from deepzero.errors import UserError
from deepzero.losses.lm import lm_loss, loss_normalizer, target_count
from deepzero.tiled_loss import has_tiled_loss

LOSSES = ("sigmoid", "ipo", "hinge", "simpo")
REFERENCES = ("precomputed", "adapters-off")
REFERENCE_FREE = frozenset({"simpo"})
ROUTING_BIAS = "e_score_correction_bias"
STATS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)

Batch = dict[str, torch.Tensor]


class Objective(Protocol):
    """The training objective of a run, called by the engines."""

    perplexity: bool
    """Whether exp(mean loss) means something (the LM loss) and evaluation reports it."""

    def normalizer(self, micro: list[Batch], dp_size: int, group: Any = None) -> torch.Tensor:
        """What each micro-batch's summed loss is divided by, so that the step's gradient is that of the mean over
        the global batch (tokens or pairs), however it is cut into micro-batches, accumulation steps and ranks."""
        ...

    def loss(self, model: Any, batch: Batch, normalizer: torch.Tensor) -> torch.Tensor:
        """One micro-batch's summed loss / ``normalizer`` (and its statistics noted for the window)."""
        ...

    def eval_sums(self, model: Any, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """One eval micro-batch's summed loss and the count it is a sum over."""
        ...

    def window_stats(self, mode: str) -> dict[str, float]:
        """The statistics noted since the last call (``mode``: train or eval), averaged over every rank; a
        collective (every rank calls it). Empty for the LM loss."""
        ...

    def describe(self) -> str: ...

    def to_json(self) -> dict[str, Any]: ...

    def rollout(self, engine: Any, batches: Iterator[Batch], accum: int) -> list[Batch]:
        """The step's ``accum`` micro-batches, drawn from ``batches`` (GRPO: completions of drawn prompts)."""
        ...

    def sampling(self, micro: int, accum: int, start_step: int) -> tuple[int, int, int]:
        """The data sampler's micro-batch, accumulation steps and start step for the batch math's ones."""
        ...

    def eval_micro(self, micro: int) -> int:
        """The eval loader's micro-batch (data rows) for the batch math's ``micro`` (rows trained together)."""
        ...


class Drawn:
    """The micro-batches are the data's rows as drawn (LM and preference losses)."""

    def rollout(self, engine: Any, batches: Iterator[Batch], accum: int) -> list[Batch]:
        return [next(batches) for _ in range(accum)]

    def sampling(self, micro: int, accum: int, start_step: int) -> tuple[int, int, int]:
        return micro, accum, start_step

    def eval_micro(self, micro: int) -> int:
        return micro


class LanguageModeling(Drawn):
    """The causal-LM loss: mean cross-entropy over the global batch's target tokens (Transformers' own loss,
    given ``num_items_in_batch``, or the tiled loss installed on the model)."""

    perplexity = True

    def normalizer(self, micro: list[Batch], dp_size: int, group: Any = None) -> torch.Tensor:

        return loss_normalizer(micro, dp_size, group)

    def loss(self, model: Any, batch: Batch, normalizer: torch.Tensor) -> torch.Tensor:

        return lm_loss(model, batch, normalizer)

    def eval_sums(self, model: Any, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:

        one = torch.ones((), device=batch["input_ids"].device)
        return lm_loss(model, batch, one).float(), target_count([batch])

    def window_stats(self, mode: str) -> dict[str, float]:
        return {}

    def describe(self) -> str:
        return "loss: mean over the global batch's target tokens"

    def to_json(self) -> dict[str, Any]:
        return {"kind": "lm", "mean_over": "target tokens of the global batch"}


@dataclass
class PreferenceSettings:
    """The preference loss chosen by the flags (``--preference-loss``, ``--beta``, ...), as run_config records it."""

    loss: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    reference: str = "precomputed"
    """Where log π_ref comes from: one pass of the starting weights before training, or (LoRA) the same model
    with its adapters switched off; none for a reference-free loss."""

    def __post_init__(self) -> None:
        if self.loss in REFERENCE_FREE:
            self.reference = "none"


PREFERENCE_SECTION = "preference"
"""The DeepSpeed preset's section that deepzero owns (removed before DeepSpeed sees the config)."""
PREFERENCE_KEYS = {
    "loss": "--preference-loss",
    "beta": "--beta",
    "label_smoothing": "--label-smoothing",
    "simpo_gamma": "--simpo-gamma",
    "reference": "--reference",
}
"""The preset section's keys and the flag that beats each."""


def choose_preference(flags: dict[str, Any], section: Any, where: str) -> PreferenceSettings:
    """The preference settings: each flag given (``flags``, by section key) beats the preset's ``"preference"``
    section (``section``, from ``where``: the preset's path); the defaults fill the rest. Every value is checked,
    and an error names the flag or the preset key it came from."""
    fix_keys = f'use only {", ".join(PREFERENCE_KEYS)} in the "{PREFERENCE_SECTION}" section'
    if section is None:
        section = {}
    if not isinstance(section, dict):
        raise UserError(f"{where}: {PREFERENCE_SECTION}", "must be an object", fix_keys)
    if unknown := [k for k in section if k not in PREFERENCE_KEYS]:
        raise UserError(f"{where}: {PREFERENCE_SECTION}.{unknown[0]}", "Unknown config key", fix_keys)
    values, origin = {}, {}
    for key, flag in PREFERENCE_KEYS.items():
        if flags.get(key) is not None:
            values[key], origin[key] = flags[key], flag
        elif key in section:
            values[key], origin[key] = section[key], f"{where}: {PREFERENCE_SECTION}.{key}"
    loss = values.get("loss", "sigmoid")
    if loss not in LOSSES:
        raise UserError(origin["loss"], f"unknown preference loss {loss!r}", f"use one of {', '.join(LOSSES)}")
    checks = {
        "beta": (lambda v: v > 0, "a positive number", "0.1"),
        "label_smoothing": (lambda v: 0 <= v < 0.5, "a number in [0, 0.5)", "0.1"),
        "simpo_gamma": (lambda v: True, "a number", "0.5"),
    }
    for key, (ok, what, example) in checks.items():
        value = values.get(key)
        if value is not None and not (_is_number(value) and math.isfinite(value) and ok(value)):
            raise UserError(origin[key], f"must be {what}, got {value!r}", f"pass e.g. {example}")
    reference = values.get("reference")
    if reference is not None and reference not in REFERENCES:
        raise UserError(origin["reference"], f"unknown reference {reference!r}", f"use {' or '.join(REFERENCES)}")
    if loss not in REFERENCE_FREE and "simpo_gamma" in values:
        raise UserError(origin["simpo_gamma"], f"is SimPO's margin, not used by the {loss} loss", "drop it")
    if loss in REFERENCE_FREE and reference is not None:
        raise UserError(origin["reference"], f"{loss} uses no reference model", "drop it")
    if loss in ("ipo", "hinge") and values.get("label_smoothing"):
        raise UserError(origin["label_smoothing"], f"applies to sigmoid and simpo, not {loss}", "drop it")
    return PreferenceSettings(
        loss=loss,
        beta=float(values.get("beta", 2.0 if loss == "simpo" else 0.1)),
        label_smoothing=float(values.get("label_smoothing", 0.0)),
        simpo_gamma=float(values.get("simpo_gamma", 0.5)),
        reference=reference or "precomputed",
    )


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class Preference(Drawn):
    """A preference loss over pairs: the mean over the global batch's pairs (see the module docstring)."""

    perplexity = False

    def __init__(self, settings: PreferenceSettings) -> None:
        self.settings = settings
        self._sums: dict[str, torch.Tensor | None] = {"train": None, "eval": None}
        self._start_buffers: dict[str, torch.Tensor] = {}

    def remember_start(self, model: nn.Module) -> None:
        """Keep the starting values of the state that training changes outside the adapters: DeepSeek-V3's routing
        biases (``e_score_correction_bias``, moved by the balancer). The adapters-off reference runs with them, so
        it is the starting model, as a precomputed reference is. Call before any step or checkpoint load."""
        self._start_buffers = {
            name: buf.detach().float().cpu().clone()
            for name, buf in model.named_buffers()
            if name.endswith(ROUTING_BIAS)
        }

    def normalizer(self, micro: list[Batch], dp_size: int, group: Any = None) -> torch.Tensor:
        """Pairs of the global batch / (accumulation steps × data-parallel size): every rank's micro-batches hold
        the same number of pairs, so no collective is needed."""
        pairs = sum(b["input_ids"].shape[0] // 2 for b in micro)
        return torch.tensor(pairs / len(micro), dtype=torch.float32, device=micro[0]["input_ids"].device)

    def loss(self, model: Any, batch: Batch, normalizer: torch.Tensor) -> torch.Tensor:
        losses = self.pair_losses(model, batch)
        return losses.sum() / normalizer

    def eval_sums(self, model: Any, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        losses = self.pair_losses(model, batch)
        return losses.sum(), torch.tensor(float(losses.numel()), device=losses.device)

    def pair_losses(self, model: Any, batch: Batch) -> torch.Tensor:
        """Each pair's loss (fp32), its rewards and log-probs noted for the window statistics."""
        logps, counts = sequence_logps(model, batch)
        chosen, rejected = logps.chunk(2)
        n_chosen, n_rejected = counts.clamp(min=1).chunk(2)  # an answer without tokens: TRL's clamp, no 0/0
        reference = None if self.settings.loss in REFERENCE_FREE else self.reference_logps(model, batch)
        losses, chosen_rewards, rejected_rewards = pair_loss(
            self.settings, chosen, rejected, n_chosen, n_rejected, reference
        )
        if self.settings.loss == "simpo":  # TRL's CPOTrainer logs SimPO's per-token mean log-probs
            chosen, rejected = chosen / n_chosen, rejected / n_rejected
        self._note(model, chosen_rewards, rejected_rewards, chosen, rejected)
        return losses

    def reference_logps(self, model: Any, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """log π_ref of the chosen and rejected answers: from the batch (precomputed), or the model's own forward
        with its LoRA adapters off."""
        if self.settings.reference == "precomputed":
            ref = batch["ref_logps"].to(torch.float32)
            return ref[:, 0], ref[:, 1]
        from deepzero.moe_balance import uncounted

        peft_model = getattr(model, "module", model)
        with torch.no_grad(), peft_model.disable_adapter(), uncounted(), self._starting_buffers(peft_model):
            logps, _ = sequence_logps(model, batch)  # the routers neither count nor balance this pass
        return logps.chunk(2)

    @contextmanager
    def _starting_buffers(self, model: nn.Module) -> Iterator[None]:
        """The remembered starting buffers in place of the current ones, for the duration of the block."""
        buffers = dict(model.named_buffers())
        current = {name: buffers[name].detach().clone() for name in self._start_buffers}
        try:
            for name, start in self._start_buffers.items():
                buffers[name].copy_(start)
            yield
        finally:
            for name, value in current.items():
                buffers[name].copy_(value)

    @torch.no_grad()
    def _note(self, model: Any, chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, *logps: torch.Tensor):
        chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
        values = torch.stack(
            [
                chosen_rewards.sum(),
                rejected_rewards.sum(),
                (chosen_rewards > rejected_rewards).float().sum(),
                (chosen_rewards - rejected_rewards).sum(),
                logps[0].detach().sum(),
                logps[1].detach().sum(),
                torch.tensor(float(chosen_rewards.numel()), device=chosen_rewards.device),
            ]
        )
        mode = "train" if getattr(model, "module", model).training else "eval"  # DeepSpeed's eval() sets the module's
        self._sums[mode] = values if self._sums[mode] is None else self._sums[mode] + values

    def window_stats(self, mode: str) -> dict[str, float]:
        sums, self._sums[mode] = self._sums[mode], None
        if sums is None:
            return {}
        if dist.is_initialized():
            dist.all_reduce(sums)
        values = (sums[:-1] / sums[-1].clamp(min=1)).tolist()
        return dict(zip(STATS, values, strict=True))

    def describe(self) -> str:
        s = self.settings
        extra = f", label smoothing {s.label_smoothing:g}" if s.label_smoothing else ""
        extra += f", gamma {s.simpo_gamma:g}" if s.loss == "simpo" else ""
        reference = {
            "precomputed": "reference log-probs precomputed by the starting weights (no second model)",
            "adapters-off": "reference = the model with its LoRA adapters off (no second model)",
            "none": "reference-free",
        }[s.reference]
        return f"loss: preference {s.loss} (beta {s.beta:g}{extra}), mean over the global batch's pairs; {reference}"

    def to_json(self) -> dict[str, Any]:
        return {"kind": "preference", "mean_over": "pairs of the global batch", **asdict(self.settings)}


def pair_loss(
    s: PreferenceSettings,
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    n_chosen: torch.Tensor,
    n_rejected: torch.Tensor,
    reference: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each pair's loss and the chosen and rejected rewards, from the answers' summed log-probs and target counts
    (and the reference's summed log-probs, except for a reference-free loss): the module docstring's formulas."""
    if s.loss == "simpo":
        chosen_rewards, rejected_rewards = s.beta * chosen / n_chosen, s.beta * rejected / n_rejected
        margin = chosen / n_chosen - rejected / n_rejected - s.simpo_gamma / s.beta
        return smoothed_sigmoid(s.beta * margin, s.label_smoothing), chosen_rewards, rejected_rewards
    assert reference is not None, f"{s.loss} needs the reference log-probs"
    chosen_ratio, rejected_ratio = chosen - reference[0], rejected - reference[1]
    delta = chosen_ratio - rejected_ratio
    if s.loss == "sigmoid":
        losses = smoothed_sigmoid(s.beta * delta, s.label_smoothing)
    elif s.loss == "hinge":
        losses = torch.relu(1 - s.beta * delta)
    else:  # ipo
        losses = (chosen_ratio / n_chosen - rejected_ratio / n_rejected - 1 / (2 * s.beta)) ** 2
    return losses, s.beta * chosen_ratio, s.beta * rejected_ratio


def smoothed_sigmoid(logits: torch.Tensor, smoothing: float) -> torch.Tensor:
    """``−(1 − ε) log σ(x) − ε log σ(−x)``."""
    loss = -nn.functional.logsigmoid(logits) * (1 - smoothing)
    return loss - nn.functional.logsigmoid(-logits) * smoothing if smoothing else loss


def sequence_logps(model: Any, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's summed log-probability of its targets (labels not -100), in fp32, and its target count.

    With the tiled loss installed (``--tiled-loss on``, the default) the model returns them from its hidden states
    over the LM head in tiles of the real targets only: prompt and padding positions never reach the head and the
    [tokens × vocab] logits are never whole. Otherwise the model runs without labels (its own forward: logits in
    the model's dtype) and the log-softmax is taken in fp32 one row at a time.
    """
    kwargs = {k: v for k, v in batch.items() if k in ("input_ids", "position_ids", "attention_mask")}
    labels = batch["labels"]
    keep = labels != IGNORE_INDEX
    if has_tiled_loss(model):
        return model(**kwargs, shift_labels=labels, row_logps=True, use_cache=False).row_logps, keep.sum(-1).float()
    logits = model(**kwargs, use_cache=False).logits
    labels, keep = labels.to(logits.device), keep.to(logits.device)
    safe = labels.masked_fill(~keep, 0)
    rows = []
    for i in range(logits.shape[0]):
        row = logits[i].float()
        token = row.gather(-1, safe[i, :, None]).squeeze(-1) - torch.logsumexp(row, dim=-1)
        rows.append((token * keep[i]).sum())
    return torch.stack(rows), keep.sum(-1).float()


def build_objective(preference: PreferenceSettings | None, grpo: Any = None, seed: int = 0) -> Objective:
    """The LM loss, the preference loss ``preference`` names, or GRPO (``grpo``: its settings)."""
    if grpo is not None:
        from deepzero.losses.grpo.objective import GRPO

        return GRPO(grpo, seed)
    return LanguageModeling() if preference is None else Preference(preference)
