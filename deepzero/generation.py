"""Completions for GRPO: one small interface (``CompletionSampler``) and its Transformers ``generate`` backend.

A sampler turns one prompt into ``count`` completions on the model's current weights. Each group (one prompt's
completions) is drawn from its own random stream, seeded by ``(seed, generation, prompt index)``: the same prompt
at the same generation gives the same completions on any rank, in any world size, and after a resume (the
checkpoint records the seed and the generations done, ``GroupSeeds``). ``generate`` runs one call per group, its
``count`` rows batched with a KV cache; a faster backend (vLLM, a batched server) plugs in as another sampler.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class GroupSeeds:
    """The sampling RNG of a run: every group's stream is derived from the run's seed and its position."""

    seed: int
    generations: int = 0
    """Generation batches drawn so far (saved in the checkpoint, so a resume continues the same completions)."""

    def of(self, generation: int, index: int) -> int:
        """The seed of prompt ``index``'s group at ``generation``."""
        digest = hashlib.sha256(f"{self.seed}:{generation}:{index}".encode()).digest()
        return int.from_bytes(digest[:8], "little") % (2**63 - 1)

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "generations": self.generations}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed, self.generations = int(state["seed"]), int(state["generations"])


class CompletionSampler(Protocol):
    """Samples completions of one prompt on the model's current weights."""

    def sample(self, model: Any, prompt_ids: torch.Tensor, count: int, seed: int | None) -> list[list[int]]:
        """``count`` completions (token ids, each ending at its first end-of-sequence token, which is kept) of
        ``prompt_ids`` (1-D, unpadded); ``seed`` None: greedy."""
        ...


@dataclass
class HFGenerate:
    """Transformers' ``generate`` (KV cache, the ``count`` rows of a group batched), sampling with ``temperature``
    and ``top_p`` (top-k off, as TRL's default), stopping at ``eos_ids`` or after ``max_new_tokens``."""

    max_new_tokens: int
    eos_ids: tuple[int, ...]
    pad_id: int
    temperature: float = 1.0
    top_p: float = 1.0

    @torch.no_grad()
    def sample(self, model: Any, prompt_ids: torch.Tensor, count: int, seed: int | None) -> list[list[int]]:
        inputs = prompt_ids.view(1, -1).expand(count, -1)
        kwargs: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "eos_token_id": list(self.eos_ids),
            "pad_token_id": self.pad_id,
            "use_cache": True,
            "attention_mask": torch.ones_like(inputs),
        }
        if seed is None:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kwargs.update(do_sample=True, temperature=self.temperature, top_p=self.top_p, top_k=0)
        devices = [prompt_ids.device] if prompt_ids.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            if seed is not None:
                torch.manual_seed(seed)
            out = model.generate(inputs, **kwargs)
        return [cut_at_eos(row[inputs.shape[1] :].tolist(), self.eos_ids) for row in out]


def cut_at_eos(ids: list[int], eos_ids: tuple[int, ...]) -> list[int]:
    """``ids`` up to and including the first end-of-sequence token (generate pads the rows that stopped early)."""
    for i, token in enumerate(ids):
        if token in eos_ids:
            return ids[: i + 1]
    return ids
