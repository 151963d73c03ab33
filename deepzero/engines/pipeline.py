"""Pipeline parallelism on DeepSpeed's ``PipelineModule`` for Hugging Face decoders (DeepSeek-V2/V3, Llama, Qwen2).

The causal LM becomes a flat list of stages that pass one tensor, the hidden states ``[B, S, H]``, between ranks::

    EmbeddingStage(input_ids, position_ids) → DecoderStage × num_hidden_layers → HeadStage → logits;
    loss_fn(logits, labels)

Between stages travels ``(hidden [B, S, H], position_ids [B, S])``: the positions restart at every packed document.
Each ``DecoderStage`` rebuilds what ``XxxModel.forward`` shares across layers from them: the rotary ``(cos, sin)``
from its own reference to ``model.model.rotary_emb`` (kept in fp32, outside the engine's bf16/fp16 cast, like
``from_pretrained`` keeps it) and the mask from ``create_causal_mask`` — block-diagonal causal when the positions
restart (Transformers finds the documents from them), else ``None`` for sdpa (``is_causal``) or a causal 4-D mask.
The mask is built once per micro-batch per pipeline rank, not per layer: ``StageMasks`` keeps it for the positions
tensor the rank's layers pass along (Transformers' packed-row detection is a host sync per build).

The stages hold the HF modules themselves, so every parameter keeps a 1:1 HF name: ``build_name_map`` records
``"<layer index>.<name in stage>" → "<HF name>"`` before ``deepspeed.initialize`` and ``export_pipeline_hf`` uses it
to write a ``save_pretrained`` folder from the stage-sharded engine.

Data: ``engine.train_batch(it)`` pulls ``gradient_accumulation_steps`` items ``((input_ids, position_ids), labels)``
per call; only the first stage (inputs) and the last stage (labels) read them. Every rank gets the same micro-batches
(sampler rank = data-parallel id, world = data-parallel size) and draws a whole step's first, to count its targets:
``TokenMeanLoss`` divides by the global target count, so the gradient is the token mean over the global batch.

Memory: every rank builds the whole HF model on the host once; ``PipelineModule`` moves only its own stages to the
device and only those are trained. Models that do not fit in host memory per rank need per-stage construction.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from deepzero.data import IGNORE_INDEX
from deepzero.dsconfig import BatchMath
from deepzero.engines.base import Batch, DeepSpeedBacked, ModelFactory, draw
from deepzero.errors import UserError
from deepzero.hf_export import ExportReport, attn_implementation_of, publish_and_compare
from deepzero.losses import TiledLoss, tiled_cross_entropy
from deepzero.losses.lm import loss_normalizer
from deepzero.losses.objectives import LanguageModeling
from deepzero.plan.setup import EngineTerms

PARTITION_METHODS = ("parameters", "uniform")


@dataclass(frozen=True)
class PipelineSettings:
    """The ``"pipeline"`` section of a ds_config: stage count, how layers are split, activation checkpointing."""

    stages: int
    partition: str = "parameters"
    """``parameters`` balances trainable parameter counts; ``uniform`` balances layer counts;
    ``type:DecoderStage`` balances decoder layers only."""
    activation_checkpoint_interval: int = 0
    """Recompute every N stage modules in backward (0: off)."""

    @classmethod
    def from_ds(cls, ds: dict[str, Any], where: str = "ds_config") -> PipelineSettings:
        """Read and check ``ds["pipeline"]``; one UserError listing every problem."""
        section = ds.get("pipeline")
        if not isinstance(section, dict):
            raise UserError(where, 'no "pipeline" section', 'add "pipeline": {"stages": 3, "partition": "parameters"}')
        stages, partition = section.get("stages"), section.get("partition", "parameters")
        interval = section.get("activation_checkpoint_interval", 0)
        problems = []
        if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
            problems.append(f"'pipeline.stages' must be a positive integer, got {stages!r}")
        if not (partition in PARTITION_METHODS or str(partition).startswith("type:")):
            problems.append(f"'pipeline.partition' {partition!r} is not one of {[*PARTITION_METHODS, 'type:<Class>']}")
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 0:
            problems.append(f"'pipeline.activation_checkpoint_interval' must be an integer >= 0, got {interval!r}")
        zero_section = ds.get("zero_optimization", {})
        zero = zero_section.get("stage", 0) if isinstance(zero_section, dict) else zero_section
        if not isinstance(zero, int) or isinstance(zero, bool):
            problems.append(f"'zero_optimization.stage' must be 0 or 1 with a pipeline, got {zero!r}")
        elif zero > 1:
            problems.append(f"ZeRO stage {zero} cannot be combined with pipeline parallelism (DeepSpeed allows 0 or 1)")
        if problems:
            raise UserError(where, "; ".join(problems), "edit the file or override with --ds pipeline.stages=3")
        return cls(stages, str(partition), interval)

    def dp_size(self, world: int) -> int:
        """Data-parallel size = world / stages; pass it to ``dsconfig.resolve(dp_size=...)``. Raises if uneven."""
        if world % self.stages:
            raise UserError(
                "pipeline.stages",
                f"{self.stages} stages do not divide the world size {world}",
                f"launch a multiple of {self.stages} ranks or set pipeline.stages to a divisor of {world}",
            )
        return world // self.stages

    def check_batch(self, batch: BatchMath) -> None:
        """Each optimizer step is one pipeline schedule of ``accum`` micro-batches; fewer than ``stages`` idles ranks."""
        accum = batch.accum
        if accum < self.stages:
            raise UserError(
                "gradient_accumulation_steps",
                f"{accum} micro-batches per step cannot fill a {self.stages}-stage pipeline",
                f"set gradient_accumulation_steps to {self.stages} or more (more micro-batches → smaller bubble)",
            )

    def plan_terms(self) -> EngineTerms:
        interval = self.activation_checkpoint_interval
        return EngineTerms(
            "pipeline", interval > 0, stages=self.stages, partition=self.partition, checkpoint_interval=interval
        )

    def build(self, build_model: ModelFactory, ds_config: dict[str, Any], seq_len: int) -> PipelineEngine:
        return PipelineEngine.build(build_model, ds_config, self)


class EmbeddingStage(nn.Module):
    """First stage: token ids ``[B, S]`` → hidden states ``[B, S, H]``."""

    def __init__(self, embed_tokens: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids, position_ids = inputs
        return self.embed_tokens(input_ids), position_ids


class StageMasks:
    """The causal masks of the micro-batch a pipeline rank is running, built once and shared by its decoder layers.

    Layers on one rank pass the same ``position_ids`` tensor along (views of it under activation checkpointing): a
    mask is rebuilt only when the positions' storage, layout or version, or the hidden states' batch, sequence,
    dtype or device change. The positions are held, so their storage cannot be reused by the next micro-batch.
    """

    def __init__(self, config: Any) -> None:
        self.config = config
        self._positions: torch.Tensor | None = None
        self._key: tuple[Any, ...] = ()
        self._masks: dict[bool, Any] = {}

    def get(self, hidden: torch.Tensor, position_ids: torch.Tensor, sliding: bool) -> Any:
        """Transformers' (sliding-window) causal mask for ``hidden`` at ``position_ids``; None where sdpa's
        ``is_causal`` does."""
        from transformers import masking_utils

        key = (
            position_ids.untyped_storage().data_ptr(), position_ids.storage_offset(), position_ids.shape,
            position_ids.stride(), position_ids._version, hidden.shape[:2], hidden.dtype, hidden.device,
        )  # fmt: skip
        if key != self._key:
            self._positions, self._key, self._masks = position_ids, key, {}
        if sliding not in self._masks:
            make = masking_utils.create_sliding_window_causal_mask if sliding else masking_utils.create_causal_mask
            self._masks[sliding] = make(
                config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None, position_ids=position_ids
            )
        return self._masks[sliding]


class DecoderStage(nn.Module):
    """One HF decoder layer; computes its rotary tables from the positions and takes its mask from ``masks``."""

    def __init__(
        self, layer: nn.Module, rotary_emb: nn.Module, masks: StageMasks, layer_type: str = "full_attention"
    ) -> None:
        super().__init__()
        self.layer = layer
        self._rotary = (rotary_emb,)  # a tuple, not a submodule: shared, never cast to bf16, never saved
        self._masks = masks
        self._sliding = layer_type == "sliding_attention"

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, position_ids = inputs
        rotary = self._rotary[0]
        if rotary.inv_freq.device != hidden.device:
            rotary.to(hidden.device)  # moves buffers only; their dtype (fp32) is kept
        mask = self._masks.get(hidden, position_ids, self._sliding)
        out = self.layer(
            hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=rotary(hidden, position_ids)
        )
        return (out[0] if isinstance(out, tuple) else out), position_ids


class HeadStage(nn.Module):
    """Last stage: final norm and LM head → logits ``[B, S, V]``; with the tiled loss (``loss`` enabled) only the final
    norm → hidden states ``[B, S, H]``, and ``TokenMeanLoss`` runs the LM head over them in tiles."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module, loss: TiledLoss | None = None) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head
        self.tiled = loss if loss is not None and loss.enabled else None

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        hidden = self.norm(inputs[0])
        return hidden if self.tiled else self.lm_head(hidden)

    def logits(self, output: torch.Tensor) -> torch.Tensor:
        """The logits of this stage's ``output`` (the hidden states under the tiled loss)."""
        return nn.functional.linear(output, self.lm_head.weight, self.lm_head.bias) if self.tiled else output


class TokenMeanLoss:
    """The pipeline's loss: summed cross-entropy over non-ignored targets divided by ``normalizer`` (the mean over
    the micro-batch's targets while it is None). ``labels`` are already shifted (HF's ``shift_labels`` path). With a
    tiled ``head`` the last stage's output is the hidden states and the loss is ``losses.tiled_cross_entropy``
    over the head's weight (the [tokens × vocab] logits are never whole)."""

    def __init__(self, head: HeadStage | None = None) -> None:
        self.normalizer: torch.Tensor | None = None
        self.head = head if head is not None and head.tiled else None

    def __call__(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        labels = labels.to(output.device)
        if self.head is not None:
            count = (labels != IGNORE_INDEX).sum().float().clamp(min=1)
            normalizer = count if self.normalizer is None else self.normalizer
            return tiled_cross_entropy(output, self.head.lm_head.weight, labels, normalizer, self.head.tiled)
        flat_logits, flat_labels = output.float().reshape(-1, output.shape[-1]), labels.reshape(-1)
        if self.normalizer is None:
            return F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE_INDEX)
        summed = F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE_INDEX, reduction="sum")
        return summed / self.normalizer.to(summed.device)


causal_lm_loss = TokenMeanLoss()
"""The micro-batch mean (no normalizer): for checks against a Hugging Face model's own loss."""


def to_pipeline_layers(model: nn.Module) -> list[nn.Module]:
    """``[EmbeddingStage, DecoderStage × L, HeadStage]`` over the model's own modules (no copies)."""
    base = getattr(model, "model", None)
    missing = [a for a in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(base, a)]
    if missing or not hasattr(model, "lm_head"):
        raise UserError(
            type(model).__name__,
            f"not a decoder with model.{{embed_tokens,layers,norm,rotary_emb}} and lm_head (missing {missing})",
            "use a Llama/Qwen2/DeepSeek-style *ForCausalLM or train it with a ZeRO config",
        )
    if model.lm_head.weight is base.embed_tokens.weight:
        raise UserError(
            type(model).__name__,
            "tied input/output embeddings are not supported by the pipeline stages (they live on different ranks)",
            "train this model with a ZeRO config (ds_configs/zero2*.json)",
        )
    config = model.config
    types = list(getattr(config, "layer_types", None) or [])
    types += ["full_attention"] * (len(base.layers) - len(types))
    masks = StageMasks(config)  # one per model: in a pipeline, each rank's copy serves its own layers
    decoders = [DecoderStage(layer, base.rotary_emb, masks, types[i]) for i, layer in enumerate(base.layers)]
    head = HeadStage(base.norm, model.lm_head, getattr(model, "_tiled_loss", None))  # losses.install_tiled_loss
    return [EmbeddingStage(base.embed_tokens), *decoders, head]


def build_name_map(model: nn.Module, layers: list[nn.Module]) -> dict[str, str]:
    """``"<index>.<stage key>" → HF state-dict key``, matched by tensor identity; call before deepspeed.initialize."""
    hf_names = {id(t): name for name, t in model.state_dict(keep_vars=True).items()}
    name_map: dict[str, str] = {}
    for index, layer in enumerate(layers):
        for key, t in layer.state_dict(keep_vars=True).items():
            if id(t) not in hf_names:
                raise RuntimeError(f"stage {index} ({type(layer).__name__}) holds {key}, which is not in the HF model")
            name_map[f"{index}.{key}"] = hf_names[id(t)]
    uncovered = set(hf_names.values()) - set(name_map.values())
    if uncovered:
        raise RuntimeError(f"pipeline stages miss HF weights: {sorted(uncovered)[:5]}")
    return name_map


def sequential_forward(
    layers: Iterable[nn.Module], input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Run the stages one after another in this process (no DeepSpeed): logits for checks and debugging."""
    x: Any = (input_ids, positions_of(input_ids, position_ids))
    for layer in layers:
        x = layer(x)
    return x


def build_pipeline_engine(
    model: nn.Module,
    ds_config: dict[str, Any],
    num_stages: int,
    partition_method: str = "parameters",
    activation_checkpoint_interval: int = 0,
) -> tuple[Any, dict[str, str]]:
    """``deepspeed.initialize`` on a ``PipelineModule`` of the model's stages; returns ``(engine, name_map)``.

    Call on every rank after ``deepspeed.init_distributed``; ``ds_config`` must be resolved with
    ``dp_size = world // num_stages`` and may keep its ``"pipeline"`` section (DeepSpeed reads it).
    """
    import deepspeed
    from deepspeed.pipe import PipelineModule

    model.config.use_cache = False
    layers = to_pipeline_layers(model)
    name_map = build_name_map(model, layers)
    module = PipelineModule(
        layers=layers,
        num_stages=num_stages,
        loss_fn=TokenMeanLoss(layers[-1]),
        partition_method=partition_method,
        activation_checkpoint_interval=activation_checkpoint_interval,
        checkpointable_layers=["DecoderStage"],
    )
    params = [p for p in module.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=module, model_parameters=params, config=ds_config)
    return engine, name_map


PipeItem = tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]
"""``((input_ids, position_ids), labels)``: one micro-batch as ``train_batch``/``eval_batch`` take it."""


def positions_of(input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    """``position_ids`` of a batch, ``0 .. S-1`` on every row when it has none (one sequence per row)."""
    if position_ids is not None:
        return position_ids
    return torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids).contiguous()


def pipeline_batches(batches: Iterable[dict[str, torch.Tensor]]) -> Iterator[PipeItem]:
    """PackedDataset dict batches → the ``((input_ids, position_ids), labels)`` items the pipeline engine takes."""
    for batch in batches:
        ids = batch["input_ids"]
        yield (ids, positions_of(ids, batch.get("position_ids"))), batch["labels"]


@torch.no_grad()
def eval_step(engine: Any, data_iter: Iterator[PipeItem], num_micro_batches: int | None = None) -> float:
    """Mean loss over ``num_micro_batches`` (default: gradient_accumulation_steps) micro-batches, on every rank.

    Eval micro-batches may be shaped differently from training ones (same shape within one call): the cached
    activation shapes are reset before and after, on every rank.
    """
    engine.reset_activation_shape()
    loss = engine.eval_batch(data_iter, num_micro_batches=num_micro_batches)
    engine.reset_activation_shape()
    return float(loss)


def stage_hf_state_dict(engine: Any, name_map: dict[str, str]) -> dict[str, torch.Tensor]:
    """This rank's stage weights on the CPU under their HF names (empty on data-parallel replicas other than 0)."""
    if engine.grid.data_parallel_id != 0:
        return {}
    return {name_map[k]: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}


def gather_hf_state_dict(engine: Any, name_map: dict[str, str]) -> dict[str, torch.Tensor] | None:
    """The full HF state dict on rank 0 (None elsewhere); a collective, call it on every rank.

    Uses ``gather_object`` of CPU tensors: fine for models of a few GB; larger ones should write per-stage shards.
    """
    local = stage_hf_state_dict(engine, name_map)
    parts: list[dict[str, torch.Tensor]] | None = (
        [{} for _ in range(dist.get_world_size())] if dist.get_rank() == 0 else None
    )
    dist.gather_object(local, parts, dst=0)
    if parts is None:
        return None
    merged = {k: v for part in parts for k, v in part.items()}
    missing = set(name_map.values()) - set(merged)
    if missing:
        raise RuntimeError(f"gathered pipeline state misses {sorted(missing)[:5]}")
    return merged


@torch.no_grad()
def pipeline_logits(engine: Any, batch: Batch) -> tuple[float, torch.Tensor]:
    """Loss and fp32 CPU logits of one micro-batch through the pipeline, on every rank (a collective)."""
    engine.reset_activation_shape()
    engine.module.loss_fn.normalizer = None
    items = pipeline_batches([batch])
    loss, logits = engine.eval_batch(items, return_logits=True, num_micro_batches=1)
    engine.reset_activation_shape()
    head = engine.module.loss_fn.head
    logits = head.logits(logits) if engine.is_last_stage() and head is not None else logits
    box = [logits.float().cpu() if engine.is_last_stage() else None]
    dist.broadcast_object_list(box, src=engine.grid.stage_to_global(engine.num_stages - 1))
    return float(loss), box[0]


@torch.no_grad()
def export_pipeline_hf(
    engine: Any,
    name_map: dict[str, str],
    model: nn.Module,
    tokenizer: Any,
    out_dir: Path,
    probe: dict[str, torch.Tensor],
) -> ExportReport | None:
    """Gather the stages, ``save_pretrained`` on rank 0 (atomically), reload and compare logits with the engine.

    ``model`` is the HF model the stages were built from (only its config and class are used). Every rank must
    call this; rank 0 returns the report, the others None.
    """
    _, engine_logits = pipeline_logits(engine, probe)
    state_dict = gather_hf_state_dict(engine, name_map)
    report = None
    if state_dict is not None:
        out_dir = Path(out_dir)
        dtype = state_dict[name_map["0.embed_tokens.weight"]].dtype
        attn = attn_implementation_of(model)
        diff = publish_and_compare(model, tokenizer, out_dir, probe, engine_logits, dtype, attn, state_dict)
        report = ExportReport.measured(out_dir, diff, dtype, engine_logits, str(engine.device))
    dist.barrier()
    return report


class PipelineEngine(DeepSpeedBacked):
    """DeepSpeed's PipelineEngine over the model's stages: each optimizer step is one 1F1B schedule."""

    objective = LanguageModeling()

    def __init__(self, engine: Any, model: nn.Module, name_map: dict[str, str]) -> None:
        self.engine = engine
        self.model = model
        """The whole HF model the stages were built from; this rank trains only its own stages."""
        self.name_map = name_map
        self.device = engine.device
        self.dp_rank = engine.grid.data_parallel_id
        self.dp_size = engine.grid.data_parallel_size

    @classmethod
    def build(cls, build_model: ModelFactory, ds_config: dict[str, Any], settings: PipelineSettings) -> PipelineEngine:
        """Build the whole model on every rank, cut it into stages, keep this rank's (DeepSpeed PipelineModule)."""
        model = build_model()
        engine, name_map = build_pipeline_engine(
            model, ds_config, settings.stages, settings.partition, settings.activation_checkpoint_interval
        )
        return cls(engine, model, name_map)

    def describe(self) -> str:
        return f"  pipeline {self.engine.num_stages} stages × data-parallel {self.dp_size}"

    def train_step(self, batches: Iterator[Batch]) -> torch.Tensor:
        """One 1F1B schedule over a step's micro-batches; the global token-mean loss, the same on every rank."""
        micro = draw(batches, self.engine.gradient_accumulation_steps())
        self._normalize_by(micro)
        return self.engine.train_batch(pipeline_batches(micro)).detach().float()

    def eval_loss(self, batches: Iterator[Batch], micro_batches: int) -> float:
        micro = draw(batches, micro_batches)
        self._normalize_by(micro)
        return eval_step(self.engine, pipeline_batches(micro), num_micro_batches=micro_batches)

    def _normalize_by(self, micro: list[Batch]) -> None:
        """The engine averages micro-batch losses over the schedule and the data-parallel replicas: dividing each
        summed loss by ``loss_normalizer`` makes that average the token mean over all of ``micro`` on every replica."""
        group = self.engine.grid.get_data_parallel_group()
        self.engine.module.loss_fn.normalizer = loss_normalizer(micro, self.dp_size, group)

    def export(self, tokenizer: Any, out_dir: Path, probe: Batch) -> ExportReport | None:
        return export_pipeline_hf(self.engine, self.name_map, self.model, tokenizer, out_dir, probe)

    @torch.no_grad()
    def weights_finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for p in self.engine.module.parameters())
