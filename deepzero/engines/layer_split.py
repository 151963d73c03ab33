"""Single-process layer split (naive model parallel): the model's layers spread over N cards, one process.

``LayerSplitEngine`` implements the trainer's engine interface (``deepzero.engines.base.TrainEngine``), so the
same loop, eval, checkpoints and export run in this mode. The optimizer and LR schedule come from the same
ds_configs JSON: torch's AdamW with the preset's params and DeepSpeed's own LR schedule classes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from deepspeed.runtime import lr_schedules

from deepzero.dsconfig import BatchMath
from deepzero.engines.base import Batch, ModelFactory, draw, mean_eval_loss
from deepzero.errors import UserError
from deepzero.hf_export import ExportReport, export_hf
from deepzero.losses.lm import lm_loss, loss_normalizer
from deepzero.losses.objectives import LanguageModeling
from deepzero.modeling import cast_parameters
from deepzero.placement import Placement, format_placement, plan_placement, torch_device
from deepzero.placement_hooks import apply_placement
from deepzero.plan.setup import EngineTerms


def parse_devices(spec: str | None) -> list[str | int]:
    """``--device-map-devices 0,1,2`` or ``cpu,cpu,cpu``; default: every visible GPU."""
    if spec:
        return [int(d) if d.strip().isdigit() else d.strip() for d in spec.split(",")]
    if torch.cuda.device_count() == 0:
        raise UserError(
            "--device-map balanced", "no CUDA GPU visible", "pass --device-map-devices cpu,cpu,cpu to try it on CPU"
        )
    return list(range(torch.cuda.device_count()))


def place_model(model: torch.nn.Module, devices: list[str | int], seq_len: int, micro_batch: int) -> Placement:
    """Balance layers over ``devices`` for training, print the table, move the model."""
    placement = plan_placement(model.config, devices, training=True, seq_len=seq_len, micro_batch=micro_batch)
    print(format_placement(placement), flush=True)
    apply_placement(model, placement)
    return placement


class LayerSplitEngine:
    """A model placed over several devices, trained by one process with the ds_config's optimizer and schedule."""

    global_rank = 0
    dp_rank = 0
    dp_size = 1
    objective = LanguageModeling()

    def __init__(self, model: torch.nn.Module, placement: Placement, ds: dict[str, Any]) -> None:
        self.model = self.module = model
        self.placement = placement
        self.first_device = torch_device(placement.device_map[next(iter(placement.device_map))])
        self.device = self.first_device
        """Where inputs go; the loss comes back from the last card."""
        opt = ds.get("optimizer", {"type": "AdamW", "params": {}})
        if str(opt.get("type", "")).lower() not in ("adam", "adamw"):
            raise UserError("--device-map", f"optimizer {opt.get('type')} is not supported here", 'use "AdamW"')
        keys = ("lr", "betas", "eps", "weight_decay", "fused", "foreach")
        params = {k: v for k, v in opt.get("params", {}).items() if k in keys}
        if ds.get("bf16", {}).get("enabled"):  # as DeepSpeed does: 16-bit weights, fp32 master weights to step
            cast_parameters(model, torch.bfloat16)  # buffers (RoPE inv_freq, V3's routing bias) stay fp32
        self.names = [name for name, p in model.named_parameters() if p.requires_grad]
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().clone() for p in self.trainable]
        """The fp32 weights the optimizer steps (the trainable parameters themselves in fp32 training): a bf16
        update of lr 3e-5 × a unit gradient would round away on most weights."""
        self.optimizer = torch.optim.AdamW(self.masters, **params)
        sched = ds.get("scheduler")
        self.lr_scheduler = getattr(lr_schedules, sched["type"])(self.optimizer, **sched["params"]) if sched else None
        self.accum = int(ds["gradient_accumulation_steps"])
        self.clip = float(ds.get("gradient_clipping", 0.0) or 0.0)
        self.micro_steps = 0
        self.global_steps = 0
        self._grad_norm: torch.Tensor | None = None

    @classmethod
    def build(
        cls, build_model: ModelFactory, ds: dict[str, Any], devices: list[str | int], seq_len: int
    ) -> LayerSplitEngine:
        """Build the model, balance its layers over ``devices`` (printing the table) and move them there."""
        model = build_model()
        micro = int(ds["train_micro_batch_size_per_gpu"])
        return cls(model, place_model(model, devices, seq_len, micro), ds)

    def describe(self) -> str:
        return f"  layer split over {len(self.placement.cards)} cards"

    def train_step(self, batches: Iterator[Batch]) -> torch.Tensor:
        micro = draw(batches, self.accum)
        normalizer = loss_normalizer(micro, dp_size=1)
        total = torch.zeros((), device=self.device)
        for batch in micro:
            loss = lm_loss(self, batch, normalizer)
            (loss / self.accum).backward()
            total += loss.detach().float().to(self.device)
        self._optimizer_step()
        return total / self.accum

    def eval_loss(self, batches: Iterator[Batch], micro_batches: int) -> float:
        return mean_eval_loss(self, batches)

    def export(self, tokenizer: Any, out_dir: Path, probe: Batch) -> ExportReport | None:
        return export_hf(self, tokenizer, out_dir, probe)

    def synchronize(self) -> None:
        """Wait for every card of the placement (timing: the step's work ends on the last card)."""
        for device in {torch_device(row.device) for row in self.placement.cards}:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

    @torch.no_grad()
    def weights_finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for p in self.model.parameters())

    @property
    def training(self) -> bool:
        return self.model.training

    def train(self) -> None:
        self.model.train()

    def eval(self) -> None:
        self.model.eval()

    def __call__(self, **inputs: Any) -> Any:
        """The model on ``inputs``, their tensors moved to the first card (the loss comes back from the last)."""
        return self.model(**{k: v.to(self.first_device) if torch.is_tensor(v) else v for k, v in inputs.items()})

    @torch.no_grad()
    def _optimizer_step(self) -> None:
        """Gradients to the fp32 masters, clip, step, and the masters back into the 16-bit weights."""
        self.micro_steps += self.accum
        for param, master in zip(self.trainable, self.masters, strict=True):
            if master is not param:
                master.grad = None if param.grad is None else param.grad.float()
        masters = [m for m in self.masters if m.grad is not None]
        if self.clip:
            self._grad_norm = torch.nn.utils.clip_grad_norm_(masters, self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for param, master in zip(self.trainable, self.masters, strict=True):
            if master is not param:
                param.copy_(master)
                param.grad = None
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.global_steps += 1

    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def grad_norm(self) -> float | None:
        return None if self._grad_norm is None else float(self._grad_norm)

    def skipped_steps(self) -> int:
        return 0

    def loss_scale(self) -> float | None:
        return None

    def zero_optimization_partition_weights(self) -> bool:
        """For ``export_hf``: the whole model is in this process."""
        return False

    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict, save_latest: bool = False) -> None:
        folder = Path(save_dir) / tag
        folder.mkdir(parents=True, exist_ok=True)
        state = {
            "module": {k: v.cpu() for k, v in self.module.state_dict().items()},
            "masters": {name: m.detach().cpu() for name, m in zip(self.names, self.masters, strict=True)},
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler else None,
            "steps": [self.micro_steps, self.global_steps],
            "client_state": client_state,
        }
        torch.save(state, folder / "layer_split_states.pt")

    def load_checkpoint(self, load_dir: str, tag: str, **_: Any) -> tuple[str | None, dict]:
        path = Path(load_dir) / tag / "layer_split_states.pt"
        if not path.is_file():
            return None, {}
        state = torch.load(path, weights_only=True, map_location="cpu")
        self.module.load_state_dict(state["module"])
        with torch.no_grad():
            for name, master in zip(self.names, self.masters, strict=True):
                master.copy_(state["masters"][name])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.lr_scheduler and state["lr_scheduler"]:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.micro_steps, self.global_steps = state["steps"]
        return str(path.parent), state["client_state"]


@dataclass(frozen=True)
class LayerSplitSettings:
    """One process, the layers balanced over ``devices`` (``--device-map-devices``; default: every GPU)."""

    devices: str | None = None

    def dp_size(self, world: int) -> int:
        if world > 1:
            raise UserError(
                "--device-map",
                f"layer split runs in one process, not {world}",
                "run `python train.py --device-map balanced`",
            )
        return 1

    def check_batch(self, batch: BatchMath) -> None:
        return None

    def plan_terms(self) -> EngineTerms:
        return EngineTerms("layer split", devices=tuple(parse_devices(self.devices)))

    def build(self, build_model: ModelFactory, ds_config: dict[str, Any], seq_len: int) -> LayerSplitEngine:
        if ds_config.get("fp16", {}).get("enabled"):
            raise UserError(
                "--device-map",
                "the layer split trains in bf16 or fp32 (fp32 master weights); fp16 would need loss scaling",
                "pass --precision bf16 or --precision fp32",
            )
        return LayerSplitEngine.build(build_model, ds_config, parse_devices(self.devices), seq_len)
