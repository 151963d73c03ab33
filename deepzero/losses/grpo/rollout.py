"""A rollout's pieces: the model in generation mode (under ZeRO-3 gathered once, DeepSpeed's hooks off) and the
completion rows the loss trains on."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from deepzero.data import IGNORE_INDEX
from deepzero.losses.grpo.loss import Batch


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


def inner_module(engine: Any) -> nn.Module:
    """The model inside a DeepSpeed engine (peft model under LoRA), or ``engine`` itself."""
    return getattr(engine, "module", engine)


def unpadded(prompts: Batch) -> list[torch.Tensor]:
    """Each prompt's ids without the left padding."""
    return [ids[mask.bool()] for ids, mask in zip(prompts["prompt_ids"], prompts["prompt_mask"], strict=True)]


def uncounted() -> Any:
    from deepzero.moe_balance import uncounted

    return uncounted()


class generating:
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
        self.uncounted = uncounted()

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
