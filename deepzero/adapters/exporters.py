"""The end of a LoRA or QLoRA run: which export it gets, and the streamed one.

A base with files (a local folder or a hub id with safetensors weights, as ``merge.base_files`` reads them) is
exported by :func:`export_streamed`: only the adapters and the buffers the run trained are gathered, and rank 0 merges
them into the base read again from its own files, shard by shard (``deepzero.adapters.merge``): host memory near a
few of the largest shards, whatever the model's size. A 4-bit base (QLoRA) always is: its 16-bit weights are only in
the files. A 16-bit base without files (a random-init preset) or with adapters on the fused routed experts
(``targets=experts``, peft ``target_parameters``: the files hold per-expert tensors the fused adapters do not name),
or whose embeddings were resized for the tokenizer (the files lack the new rows), is merged from the engine's whole
model on rank 0 (``lora_export.export_lora_hf``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from deepzero import modeling
from deepzero.adapters.checkpoint import persistent_buffers
from deepzero.adapters.lora_export import export_lora_hf
from deepzero.adapters.merge import Adapters, MergedExport, base_files, export_merged
from deepzero.distributed import while_one_rank_works
from deepzero.errors import UserError
from deepzero.hf_export import attn_implementation_of


def lora_exporter(model: torch.nn.Module, source: str | None, four_bit: bool = False) -> Callable[..., Any]:
    """The exporter of a run over the peft ``model`` whose base came from ``source`` (None: a random-init model).
    Streamed (:func:`export_streamed`) for a 4-bit base, and for a 16-bit one with files of the run's vocabulary and
    adapters on Linear layers only; else the in-memory merge (``export_lora_hf``). Rank 0 decides and tells the others
    (the two exports gather different tensors: the ranks must agree)."""
    if four_bit:
        return partial(export_streamed, source=source)
    streamed: list[bool | None] = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        vocab = model.get_base_model().config.get_text_config().vocab_size
        streamed[0] = not model.peft_config["default"].target_parameters and files_vocab(source) == vocab
    if dist.is_initialized():
        dist.broadcast_object_list(streamed, src=0)
    return partial(export_streamed, source=source) if streamed[0] else export_lora_hf


def files_vocab(source: str | None) -> int | None:
    """The vocabulary of the 16-bit safetensors base the streamed export reads from ``source`` (its config.json);
    None where there is none (a random-init model, a quantised checkpoint, pickled weights). A run whose embeddings
    were resized for the tokenizer has rows the files lack: its vocabulary differs."""
    if not source:
        return None
    try:
        config = json.loads(base_files(source).config.read_text())
    except UserError:
        return None
    return (config.get("text_config") or config).get("vocab_size")


@torch.no_grad()
def export_streamed(
    engine: Any, tokenizer: Any, out_dir: Path, probe: dict[str, torch.Tensor], source: str
) -> MergedExport | None:
    """Every rank calls it. Rank 0 merges the engine's adapters (and the buffers the run trained: V3's routing bias)
    into the 16-bit base read again from ``source``, shard by shard: ``out_dir`` loads with plain Transformers,
    ``<out_dir>-adapter`` with peft. The other ranks wait on a group of their own, not on the main group's 10-minute
    timeout."""
    state = adapter_state_dict(engine)
    report = None
    with while_one_rank_works():
        if engine.global_rank == 0:
            config = engine.module.peft_config["default"]
            adapters = Adapters.from_state(state, config.r, config.lora_alpha, config.lora_dropout)
            attn = attn_implementation_of(engine.module.get_base_model())
            trained = trained_buffers(engine.module)
            with modeling.zero3_init_off():
                report = export_merged(source, adapters, tokenizer, out_dir, probe["input_ids"], attn, trained=trained)
    return report


def trained_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The persistent buffers of the run's peft model (V3's routing bias, which balancing moves) under the base's
    own names, on the host (buffers are never partitioned)."""
    names = set(persistent_buffers(model))
    return {n.removeprefix("base_model.model."): b.detach().cpu() for n, b in model.named_buffers() if n in names}


def adapter_state_dict(engine: Any) -> dict[str, torch.Tensor]:
    """The adapters' weights under their peft names, whole, on every rank (ZeRO-3 gathers them: a collective)."""
    import deepspeed

    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    with deepspeed.zero.GatheredParameters([p for _, p in named], enabled=engine.zero_optimization_partition_weights()):
        return {n: p.detach().float().cpu().clone() for n, p in named}
