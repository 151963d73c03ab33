"""GRPO's flags: their defaults (TRL 1.16's GRPOConfig) and their checks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from deepzero.errors import UserError

LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo")
SCALES = ("group", "batch", "none")
IMPORTANCE_LEVELS = ("token", "sequence")
RESERVED_GENERATION_KWARGS = frozenset(
    {"do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens", "eos_token_id",
     "pad_token_id", "logits_processor", "attention_mask", "use_cache", "num_return_sequences"}
)  # fmt: skip
"""``generate`` arguments the flags and the row-by-row sampler own."""


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
