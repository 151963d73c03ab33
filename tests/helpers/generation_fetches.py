"""Launched by tests/test_grpo.py: train.py's own GRPO engine under ZeRO-3 (its flags after ``--``), one step, and
how often DeepSpeed's parameter coordinator fetched and released a module while GRPO generated (hooks off: never).
The same generation once more with only the parameters gathered and the hooks on shows that the counter sees the
fetches a decoding step would make. Writes ``{"generating": {...}, "hooks_on": {...}, "gathered": N}`` to --out."""

from __future__ import annotations

import contextlib
import json
import sys
from collections import Counter
from pathlib import Path

import deepspeed
import torch.distributed as dist
from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

from deepzero.args import parse_args
from deepzero.distributed import exit_process
from deepzero.losses.grpo.rollout import unpadded
from deepzero.run import setup
from deepzero.trainer import micro_batches

COUNTS: Counter[str] = Counter()
SAMPLING = [False]


def counted(name: str, method: object) -> object:
    def wrapper(*args: object, **kwargs: object) -> object:
        if SAMPLING[0]:
            COUNTS[name] += 1
        return method(*args, **kwargs)

    return wrapper


def main() -> None:
    out = Path(sys.argv[sys.argv.index("--out") + 1])
    argv = sys.argv[sys.argv.index("--") + 1 :]
    for name in ("fetch_sub_module", "release_sub_module"):
        setattr(PartitionedParameterCoordinator, name, counted(name, getattr(PartitionedParameterCoordinator, name)))
    run = setup(parse_args(argv))
    objective = run.engine.objective
    sample = objective.sampler.sample
    gathered = [0]

    def sampling(model: object, prompts: list, seeds: list | None) -> list:
        gathered[0] = sum(1 for p in model.parameters() if p.ds_status.name == "AVAILABLE")
        SAMPLING[0] = True
        try:
            return sample(model, prompts, seeds)
        finally:
            SAMPLING[0] = False

    objective.sampler.sample = sampling
    with contextlib.closing(micro_batches(run)) as batches:
        run.engine.train_step(batches)
    generating = dict(COUNTS)
    COUNTS.clear()
    module = run.engine.engine.module
    prompts = [p for p in unpadded(next(iter(micro_batches(run))))]
    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        module.eval()
        sampling(module, prompts, [1] * len(prompts))
    if dist.get_rank() == 0:
        total = sum(1 for _ in module.parameters())
        result = {"generating": generating, "hooks_on": dict(COUNTS), "gathered": gathered[0], "params": total}
        out.write_text(json.dumps(result))
    run.sink.close()


if __name__ == "__main__":
    main()
    exit_process(0)
