"""Graceful preemption: SIGTERM (SLURM, spot instances, the deepspeed launcher) → all ranks save, then exit 0.

Launchers deliver the signal to ranks at different times (DeepSpeed's launcher terminates ranks one by one),
so ranks agree through a tiny all-reduce at each step boundary. It runs on a separate gloo group over CPU
tensors, so on GPUs it never waits for the device: it is no host-device sync.
"""

from __future__ import annotations

import signal
from types import FrameType

import torch
import torch.distributed as dist


class StopRequest:
    """Set by SIGTERM/SIGINT; ``agreed()`` is True on every rank once any rank was signalled."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._group = None
        if dist.is_initialized():
            self._group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_name is not None and signum == signal.SIGINT:  # a second Ctrl-C stops at once
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name

    def agreed(self) -> bool:
        flag = torch.tensor([1 if self.signal_name else 0], dtype=torch.int32)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        if flag.item() and self.signal_name is None:
            self.signal_name = "peer rank"
        return bool(flag.item())

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
