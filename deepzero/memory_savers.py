"""What keeps a long sequence off the card, decided once while the run is planned and applied to the model
before an engine wraps it: the tiled LM loss (``deepzero.tiled_loss``), the checkpointed hidden states kept in
host memory, and the MLPs run in sequence tiles (DeepSpeed's ``TiledMLP`` from Arctic Long Sequence Training).

Each is exact (the same loss and gradients, tested in fp32) and trades time for memory: the tiled loss recomputes
the LM head's logits in backward, the offload copies each layer's input to the host and back, the tiled MLP
runs its forward once more in backward.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from deepzero.errors import UserError
from deepzero.tiled_loss import TiledLoss, install_tiled_loss


@dataclass(frozen=True)
class MemorySavers:
    """The long-sequence decision of a run, recorded in the header and run_config.json."""

    loss: TiledLoss
    offload_checkpoints: bool = False
    """Checkpointed layer inputs live in host memory (torch's ``save_on_cpu`` around each checkpointed layer)."""
    mlp_tiles: int = 0
    """Sequence tiles each dense MLP (and shared expert) runs in: ceil(seq_len / hidden), DeepSpeed's rule, or the
    count asked, either rounded to the pieces torch.chunk makes of a row (``chunk_count``); 0 off."""
    mlp_tiles_asked: int = 0
    """The count before that rounding (the header says when it differs)."""
    seq_len: int = 0
    """The row length the count was rounded for."""

    @classmethod
    def choose(
        cls, args: Any, config: Any, seq_len: int, pipeline: bool, vocab_size: int | None = None
    ) -> MemorySavers:
        """From the flags, the model config, the sequence length and the vocabulary the model is built with
        (default the config's). Every engine tiles the loss: the ZeRO engines and the layer split through the
        model's forward, the pipeline in its last stage's loss (``engines.pipeline.TokenMeanLoss``)."""
        if args.activation_offload and not args.gradient_checkpointing:
            raise UserError(
                "--activation-offload",
                "offloads the hidden states that activation checkpointing keeps; checkpointing is off",
                "add --gradient-checkpointing",
            )
        if args.activation_offload and (pipeline or args.device_map):
            raise UserError(
                "--activation-offload", "works with the ZeRO engines only", "use a ZeRO preset without --device-map"
            )
        loss = TiledLoss.choose(args.tiled_loss, vocab_size or config.vocab_size, config.hidden_size)
        auto = {"on": math.ceil(seq_len / config.hidden_size), "off": 0}
        asked = auto[args.tiled_mlp] if args.tiled_mlp in auto else int(args.tiled_mlp)
        tiles = chunk_count(seq_len, asked) if asked > 1 else 0
        if tiles <= 1:
            return cls(loss, args.activation_offload)
        return cls(loss, args.activation_offload, tiles, asked, seq_len)

    def describe(self) -> str:
        """One header line."""
        parts = [self.loss.describe()]
        if self.offload_checkpoints:
            parts.append("checkpointed hidden states in host memory")
        if not self.mlp_tiles:
            parts.append("MLP untiled")
        elif self.mlp_tiles_asked not in (0, self.mlp_tiles):
            parts.append(
                f"MLP in {self.mlp_tiles} sequence tiles ({self.mlp_tiles_asked} asked: torch.chunk cuts a"
                f" {self.seq_len:,}-token row into {self.mlp_tiles})"
            )
        else:
            parts.append(f"MLP in {self.mlp_tiles} sequence tiles")
        return "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "loss": self.loss.to_json(),
            "offload_checkpoints": self.offload_checkpoints,
            "mlp_tiles": self.mlp_tiles,
        }

    def apply(self, model: nn.Module) -> nn.Module:
        """Install the chosen savers on a Hugging Face causal LM (before LoRA and the engine)."""
        install_tiled_loss(model, self.loss)
        if self.mlp_tiles:
            tile_mlps(model, self.mlp_tiles)
        if self.offload_checkpoints:
            enable_offloaded_checkpointing(model)
        return model


def offloaded_checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """torch's non-reentrant checkpoint whose saved inputs (the layer's hidden states) go to host memory, pinned
    on a GPU. Transformers' own ``offload=True`` pins unconditionally, which a CPU-only torch refuses."""
    with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
        return checkpoint(function, *args, use_reentrant=False, **kwargs)


def enable_offloaded_checkpointing(model: nn.Module) -> None:
    """Activation checkpointing on every decoder layer, with the checkpointed inputs offloaded."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for module in model.modules():
        if hasattr(module, "gradient_checkpointing"):
            module._gradient_checkpointing_func = offloaded_checkpoint


def is_mlp(module: nn.Module) -> bool:
    """A dense gated MLP of the supported families (Llama, Qwen2, DeepSeek-V2/V3 dense layers and shared
    experts): the routed experts are not tiled (their tokens are already split by the router)."""
    return type(module).__name__.endswith("MLP") and all(hasattr(module, n) for n in ("gate_proj", "down_proj"))


def chunk_count(tokens: int, tiles: int) -> int:
    """How many pieces ``torch.chunk`` cuts ``tokens`` rows into when asked for ``tiles``: pieces of
    ceil(tokens / tiles) rows, so fewer when the last ones would be empty (4,096 tokens in 1,000 tiles: 820 of 5).

    DeepSpeed's TiledMLP asks torch.chunk for ``shards`` pieces and marks the parameters' gradients ready for ZeRO
    (``ds_grad_is_ready``) at piece number ``shards`` only; with fewer pieces that never happens and ZeRO leaves the
    MLP's gradients out. A count torch.chunk makes of a row's tokens it also makes of any whole number of rows (the
    flattened micro-batch its backward cuts)."""
    if tokens < 1:
        return tiles  # torch.chunk of nothing: ``tiles`` empty pieces
    return math.ceil(tokens / math.ceil(tokens / tiles))


def mlp_tile_bytes(tokens: int, tiles: int, width: int, hidden: int) -> int:
    """16-bit bytes one MLP holds while :func:`tile_mlps` recomputes a tile in backward (0 untiled): the tile's
    SwiGLU intermediates (8 bytes per token and intermediate unit: gate and up outputs, SiLU input and output), its
    output gradient (2h per token) and DeepSpeed's zeros for the whole input's gradient (2h per token of ``tokens``);
    ``width`` is the widest tiled MLP's intermediate size. The planner counts this (one formula, next to the code)."""
    if tiles <= 1:
        return 0
    tile = -(-tokens // tiles)
    return tile * (8 * width + 2 * hidden) + 2 * hidden * tokens


def offloaded_bytes(layers: int, hidden: int, tokens: int, element_bytes: int) -> int:
    """Host bytes one rank's offloaded checkpoints hold (:func:`enable_offloaded_checkpointing`): every checkpointed
    layer's input, ``[tokens × hidden]`` in the training dtype; the planner counts this."""
    return element_bytes * layers * hidden * tokens


def _tiled_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP  # DeepSpeed only where an MLP is tiled

    params = [p for p in self.parameters() if p.requires_grad]
    shards = chunk_count(x.shape[-2], self._mlp_tiles)  # this call's row (a sequence-parallel piece is shorter)
    return TiledMLP.apply(partial(type(self).forward), self, x, shards, params)


def tile_mlps(model: nn.Module, tiles: int) -> int:
    """Run every dense MLP of ``model`` in ``tiles`` sequence tiles, or as many as torch.chunk makes of each call's
    rows (``chunk_count``); the forward is recomputed tile by tile in backward. Returns how many MLPs were tiled."""
    mlps = [m for m in model.modules() if is_mlp(m)]
    for mlp in mlps:
        mlp._mlp_tiles = tiles
        mlp.forward = types.MethodType(_tiled_forward, mlp)
    return len(mlps)
