"""Single-process layer split (naive model parallel): the model's layers spread over N cards, one process.

``LayerSplitEngine`` offers the slice of the DeepSpeed engine interface the trainer uses (forward, backward,
step with gradient accumulation, lr, grad norm, eval/train, save/load checkpoint), so the same loop, eval,
checkpoints and export run in this mode. The optimizer and LR schedule come from the same ds_configs JSON:
torch's AdamW with the preset's params and DeepSpeed's own LR schedule classes.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from deepspeed.runtime import lr_schedules

from deepzero.errors import UserError
from deepzero.placement import Placement, apply_placement, format_placement, plan_placement, torch_device


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
    skipped_steps = 0

    def __init__(self, model: torch.nn.Module, placement: Placement, ds: dict[str, Any]) -> None:
        self.module = model
        self.placement = placement
        self.first_device = torch_device(placement.device_map[next(iter(placement.device_map))])
        self.device = self.first_device
        """Where inputs go (DeepSpeed engines name theirs ``device`` too)."""
        opt = ds.get("optimizer", {"type": "AdamW", "params": {}})
        if str(opt.get("type", "")).lower() not in ("adam", "adamw"):
            raise UserError("--device-map", f"optimizer {opt.get('type')} is not supported here", 'use "AdamW"')
        params = {k: v for k, v in opt.get("params", {}).items() if k in ("lr", "betas", "eps", "weight_decay")}
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **params)
        sched = ds.get("scheduler")
        self.lr_scheduler = getattr(lr_schedules, sched["type"])(self.optimizer, **sched["params"]) if sched else None
        self.accum = int(ds["gradient_accumulation_steps"])
        self.clip = float(ds.get("gradient_clipping", 0.0) or 0.0)
        self.autocast_dtype = torch.bfloat16 if ds.get("bf16", {}).get("enabled") else None
        self.micro_steps = 0
        self.global_steps = 0
        self._grad_norm: torch.Tensor | None = None

    def synchronize(self) -> None:
        """Wait for every card of the placement (timing: the step's work ends on the last card)."""
        for device in {torch_device(row.device) for row in self.placement.cards}:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

    @property
    def training(self) -> bool:
        return self.module.training

    def train(self) -> None:
        self.module.train()

    def eval(self) -> None:
        self.module.eval()

    def __call__(self, **batch: torch.Tensor) -> Any:
        batch = {k: v.to(self.first_device) for k, v in batch.items()}
        use_amp = self.autocast_dtype is not None and self.first_device.type == "cuda"
        ctx = torch.autocast("cuda", dtype=self.autocast_dtype) if use_amp else contextlib.nullcontext()
        with ctx:
            return self.module(**batch)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.accum).backward()

    def step(self) -> None:
        self.micro_steps += 1
        if self.micro_steps % self.accum:
            return
        params = [p for p in self.module.parameters() if p.grad is not None]
        if self.clip:
            self._grad_norm = torch.nn.utils.clip_grad_norm_(params, self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.global_steps += 1

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> torch.Tensor | None:
        return self._grad_norm

    def zero_optimization_partition_weights(self) -> bool:
        return False

    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict, save_latest: bool = False) -> None:
        folder = Path(save_dir) / tag
        folder.mkdir(parents=True, exist_ok=True)
        state = {
            "module": {k: v.cpu() for k, v in self.module.state_dict().items()},
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
        self.optimizer.load_state_dict(state["optimizer"])
        if self.lr_scheduler and state["lr_scheduler"]:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.micro_steps, self.global_steps = state["steps"]
        return str(path.parent), state["client_state"]
