"""Launched by tests/test_grpo.py on 3 ranks: for every loss type, one GRPO step of 2 micro-batches a rank whose
completion lengths differ between ranks and micro-batches, once through the objective's own normaliser (its
all-reduce over the ranks) and once through TRL 1.16's ``GRPOTrainer._compute_loss`` with ``num_items_in_batch``
gathered as TRL gathers it. Each side's step gradient is what its engine makes of the backward passes: DeepSpeed
the mean over ranks and micro-batches, accelerate's DDP the mean over processes of the summed micro-batches.
Rank 0 writes ``{loss_type: largest relative difference of the LM head's gradient}`` to ``--out``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from deepzero.distributed import exit_process, init_distributed
from deepzero.losses.grpo.loss import advantages
from deepzero.losses.grpo.objective import GRPO
from deepzero.losses.grpo.rollout import completion_rows
from deepzero.losses.grpo.settings import LOSS_TYPES, GRPOSettings
from tests.test_grpo import fixed_inputs, tiny_qwen, trl_layout, trl_self

ACCUM = 2


def step_gradients(loss_type: str, rank: int, world: int, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(ours, TRL's) step gradient of the LM head, the same on every rank; ``local``: ours with dapo's token count
    of the rank alone (a wrong normaliser the comparison must catch)."""
    from trl import GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    settings = GRPOSettings(rewards=("x",), loss_type=loss_type, max_completion_length=8)
    ours_model, theirs_model = tiny_qwen(), tiny_qwen()
    add_fused_lm_head(theirs_model, temperature=1.0, outputs=("log_probs", "entropy"))
    micro = []
    for m in range(ACCUM):
        fx = fixed_inputs(6, seed=100 * rank + m + 1)  # two groups of 3 a micro-batch, lengths 1..8
        rows = completion_rows(fx["prompts"], fx["completions"], 0, torch.device("cpu"))
        micro.append((fx, rows, advantages(fx["rewards"], 3, "group")))

    objective = GRPO(settings)
    batches = [rows | {"advantages": adv} for _, rows, adv in micro]
    normalizer = objective.normalizer(batches, 1 if local else world) * (world if local else 1)
    for batch in batches:
        objective.loss(ours_model, batch, normalizer).backward()

    t = trl_self(theirs_model, settings, ACCUM)
    t.model, t.accelerator.num_processes, t.args.steps_per_generation = theirs_model, world, ACCUM
    layouts = [trl_layout(rows, fx["prompts"], fx["completions"]) for fx, rows, _ in micro]
    items = sum(layout["completion_mask"].sum() for layout in layouts).float()
    dist.all_reduce(items)  # TRL: accelerator.gather(loss_mask.sum()).sum() over the generation batch
    for layout, (_, _, adv) in zip(layouts, micro, strict=True):
        GRPOTrainer._compute_loss(t, theirs_model, layout | {"advantages": adv, "num_items_in_batch": items}).backward()

    ours, theirs = ours_model.lm_head.weight.grad.clone(), theirs_model.lm_head.weight.grad.clone()
    dist.all_reduce(ours)
    dist.all_reduce(theirs)
    return ours / (world * ACCUM), theirs / world


def main() -> None:
    out = Path(sys.argv[sys.argv.index("--out") + 1])
    rank, world = init_distributed()
    diffs = {}
    for loss_type in LOSS_TYPES:
        ours, theirs = step_gradients(loss_type, rank, world)
        diffs[loss_type] = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    ours, theirs = step_gradients("dapo", rank, world, local=True)
    diffs["dapo, each rank's own count"] = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    if rank == 0:
        out.write_text(json.dumps(diffs))


if __name__ == "__main__":
    main()
    exit_process(0)
