"""Count the attention-mask builds and host syncs of one pipeline training step, per rank.

Launched by tests/test_pipeline.py with the real launcher (on the CPU accelerator)::

    DS_ACCELERATOR=cpu deepspeed --num_gpus=3 tests/helpers/pipeline_masks.py --out masks.json

Cuts a tiny decoder into deepzero's pipeline stages (``build_pipeline_engine``, 3 stages), trains two steps on
packed rows (positions restart at every document) and counts during the second: the calls of Transformers'
``create_causal_mask`` / ``create_sliding_window_causal_mask`` and the Python-level host syncs (``bool(tensor)``,
``.item()``, ``.tolist()``, ``int()``/``float()`` of a tensor) by the file that made them. First it compares the
pipeline's logits of a packed row with the Hugging Face model's own (which builds the block-diagonal mask itself).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers.masking_utils as masking
from transformers import AutoModelForCausalLM, Qwen2Config

from deepzero.distributed import exit_process, init_distributed
from deepzero.engines.pipeline import build_pipeline_engine, pipeline_batches, pipeline_logits
from deepzero.presets import get_preset

LENGTHS = (7, 12, 5)
"""Three documents per packed row of 24 tokens."""
MICRO, ACCUM, STAGES, VOCAB = 2, 3, 3, 128
SYNCS = ("__bool__", "item", "tolist", "__int__", "__float__")

builds: collections.Counter[str] = collections.Counter()
syncs: collections.Counter[str] = collections.Counter()
counting = False


def model_config(family: str, layers: int) -> Any:
    """``deepseek_v3``: the tiny preset; ``qwen2_sliding``: Qwen2 with all but the first layer sliding."""
    if family == "deepseek_v3":
        return get_preset("tiny-deepseek-v3").config(vocab_size=VOCAB, num_hidden_layers=layers)
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4)
    return Qwen2Config(
        **small, vocab_size=VOCAB, num_key_value_heads=2, tie_word_embeddings=False, use_sliding_window=True,
        sliding_window=5, max_window_layers=1,
    )  # fmt: skip


def caller_file() -> str:
    """``package/file.py`` of the frame that called the patched method."""
    path = Path(sys._getframe(2).f_code.co_filename)
    return f"{path.parent.name}/{path.name}"


def count_builds(name: str, make: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if counting:
            builds[name] += 1
        return make(*args, **kwargs)

    return wrapper


def count_syncs(method: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if counting:
            syncs[caller_file()] += 1
        return method(self, *args, **kwargs)

    return wrapper


def instrument() -> None:
    for name in ("create_causal_mask", "create_sliding_window_causal_mask"):
        setattr(masking, name, count_builds(name, getattr(masking, name)))
    for name in SYNCS:
        setattr(torch.Tensor, name, count_syncs(getattr(torch.Tensor, name)))


def packed_batch(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """``MICRO`` rows of three documents each; positions restart per document, no target across a document end."""
    ids = torch.randint(0, VOCAB, (MICRO, sum(LENGTHS)), generator=gen)
    positions = torch.cat([torch.arange(n) for n in LENGTHS]).expand(MICRO, -1).contiguous()
    labels = torch.roll(ids, -1, dims=1)
    labels[:, torch.cumsum(torch.tensor(LENGTHS), 0) - 1] = -100
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def ds_config() -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUM,
        "train_batch_size": MICRO * ACCUM,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True},
        },  # as the presets
        "zero_optimization": {"stage": 1},
        "steps_per_print": 1_000_000,
    }


def step_items(gen: torch.Generator) -> Iterator[Any]:
    return pipeline_batches([packed_batch(gen) for _ in range(ACCUM)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--family", choices=("deepseek_v3", "qwen2_sliding"), default="deepseek_v3")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (the tiny preset has 4)")
    parser.add_argument("--local_rank", type=int, default=0, help="set by the deepspeed launcher")
    args = parser.parse_args()

    global counting
    init_distributed()
    instrument()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        model_config(args.family, args.layers), dtype=torch.float32, attn_implementation="sdpa"
    )
    engine, _ = build_pipeline_engine(model, ds_config(), STAGES, partition_method="type:DecoderStage")
    gen = torch.Generator().manual_seed(1)
    probe = packed_batch(gen)  # before training: every rank's whole model still holds the stages' weights
    _, logits = pipeline_logits(engine, probe)
    with torch.no_grad():
        expected = model.eval()(
            input_ids=probe["input_ids"], position_ids=probe["position_ids"], use_cache=False
        ).logits
    engine.train_batch(step_items(gen))  # the first step also exchanges the activation shapes
    counting = True
    loss = engine.train_batch(step_items(gen))
    counting = False
    local = [type(f).__name__ for f in engine.module.forward_funcs]
    row = {
        "rank": dist.get_rank(),
        "stage": engine.stage_id,
        "decoder_layers": local.count("DecoderStage"),
        "sliding_layers": sum(bool(getattr(f, "_sliding", False)) for f in engine.module.forward_funcs),
        "micro_batches": ACCUM,
        "mask_builds": dict(builds),
        "syncs": dict(syncs),
        "loss": float(loss),
        "max_abs_logit_diff": (logits - expected).abs().max().item(),
    }
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        args.out.write_text(json.dumps({"family": args.family, "layers": args.layers, "ranks": rows}, indent=2))
        print(f"pipeline_masks: wrote {args.out}")


if __name__ == "__main__":
    main()
    exit_process(0)
