"""How an evaluation or sampling job holds its model: a whole copy per rank, or one copy's layers over the cards,
in 16 bits or with an NF4 base (``Layout``), chosen by the planner on CUDA (``deepzero.plan.evaluation``), and the
model loaded so."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from deepzero import modeling
from deepzero.data.tokenizer import check_data_tokenizer, plan_tokenizer
from deepzero.distributed import on_cuda
from deepzero.errors import UserError
from deepzero.plan.arch import model_stats
from deepzero.precision import TORCH_DTYPES
from deepzero.rollout.job_args import JobArgs

MOST_ROWS = 512
"""The most rows the planner gives one generate call."""


@dataclass(frozen=True)
class Layout:
    """How the job holds the model (``JobArgs.layout``'s choices but auto), and why."""

    name: str
    rows: int | None
    """The planner's rows per generate call on a card (None: the CPU's default, or a flag's layout)."""
    reason: str
    planned_bytes: int | None = None
    """The planner's fullest card, as ``torch.cuda.max_memory_allocated`` counts it."""


def choose_layout(args: JobArgs, prompt_len: int, completion_len: int) -> Layout:
    """The flag's layout, else on CUDA the planner's for the visible cards (``deepzero.plan.evaluation``), else a
    whole copy per CPU rank."""
    if args.layout != "auto":
        return Layout(args.layout, None, "--layout")
    if not on_cuda():
        return Layout("data-parallel", None, "CPU ranks: a whole copy each")
    from deepzero.plan.evaluation import DOES_NOT_FIT, plan_evaluation

    cards = torch.cuda.device_count()
    gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    plan = plan_evaluation(args.model, cards, gib, prompt_len, completion_len, most_rows=MOST_ROWS)
    if plan.mode == DOES_NOT_FIT:
        raise UserError(f"--model {args.model}", plan.reason, "use more or larger cards, or a shorter completion")
    return Layout(plan.mode, plan.rows_per_call, plan.reason, plan.allocated_bytes)


def job_precision(args: JobArgs) -> str:
    """The weights' dtype: ``--dtype``, or for auto bf16 on CUDA and fp32 on the CPU."""
    return args.dtype if args.dtype != "auto" else ("bf16" if on_cuda() else "fp32")


def load_model(args: JobArgs, meta: dict[str, Any], layout: str, rows: int, tokens: int) -> tuple[Any, torch.nn.Module]:
    """The tokenizer (the data's, checked against the model's own) and the pretrained model in eval mode: a copy on
    this rank's device, or its layers over every card (``deepzero.placement``, each layer's reserve its KV cache of
    ``rows`` rows of ``tokens`` prompt + completion tokens; on the CPU three "cpu" cards), the base in NF4 for the
    -4bit layouts (accelerate's map, each card's budget less its KV cache and working set)."""
    source = modeling.resolve_model(args.model)
    if source.random_init:
        raise UserError(f"--model {args.model}", "is a random-init preset: nothing to evaluate", "pass a trained model")
    tokenizer = plan_tokenizer(args, meta)
    check_data_tokenizer(args, meta, source)
    precision = job_precision(args)
    dtype = TORCH_DTYPES[precision]
    config = modeling.load_config(source, args.trust_remote_code)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if on_cuda() else torch.device("cpu")
    quant = None
    if layout.endswith("4bit"):
        from deepzero.adapters.quant import FourBit

        quant = FourBit(precision, "uint8").bnb_config()
    if layout == "placement-4bit":  # accelerate's map, each card's budget less its share of the KV cache
        model = modeling.build_model(
            source, config, dtype=dtype, trust_remote_code=args.trust_remote_code, quantization_config=quant,
            device_map="auto", max_memory=_weights_budget(args, config, rows, meta["max_prompt_len"], tokens),
        )  # fmt: skip
        return tokenizer, model.eval()
    model = modeling.build_model(
        source, config, dtype=dtype, trust_remote_code=args.trust_remote_code, quantization_config=quant,
        device_map={"": device} if quant is not None else None,
    )  # fmt: skip
    if layout == "placement":
        from deepzero.placement import plan_placement
        from deepzero.placement_hooks import apply_placement
        from deepzero.plan.generation import kv_layer_bytes

        cards = list(range(torch.cuda.device_count())) if on_cuda() else ["cpu"] * 3
        reserve = kv_layer_bytes(model_stats(config, args.model), rows, tokens, dtype.itemsize)
        apply_placement(model, plan_placement(config, cards, dtype=dtype, reserve_per_layer_bytes=reserve))
        return tokenizer, model.eval()
    return tokenizer, (model if quant is not None else model.to(device)).eval()


def _weights_budget(args: JobArgs, config: Any, rows: int, prompt_len: int, tokens: int) -> dict[int, int]:
    """Per card: its memory less the planner's KV cache, working set and logits of ``rows`` rows there (prompts of
    ``prompt_len``, ``tokens`` with the completion), and the CUDA context."""
    from deepzero.plan.evaluation import card_bytes
    from deepzero.plan.memory import CUDA_RESERVE

    cards = torch.cuda.device_count()
    total = torch.cuda.get_device_properties(0).total_memory
    stats = model_stats(config, args.model)
    held = card_bytes(stats, cards, rows, prompt_len, tokens - prompt_len, four_bit=True)
    return {k: total - (c.kv_cache + c.working + c.logits) - CUDA_RESERVE for k, c in enumerate(held)}
