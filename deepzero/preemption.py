"""Graceful preemption: SIGTERM (SLURM, spot instances, the deepspeed launcher) → all ranks save, then exit 0.

Launchers deliver the signal to ranks at different times (DeepSpeed's launcher terminates ranks one by one),
so ranks agree through a tiny all-reduce of a flag at each step boundary. It runs on its own gloo group over CPU
tensors, so it never waits for a GPU, and it is asynchronous: the all-reduce started at one step is read at the
next, so no rank waits there for the slowest one. All ranks stop at the same step, one step after the signal.
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
        self._group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._pending: tuple[dist.Work, torch.Tensor] | None = None
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_name is not None and signum == signal.SIGINT:  # a second Ctrl-C stops at once
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name

    def agreed(self) -> bool:
        """Whether any rank had been signalled by the previous call (the same answer on every rank)."""
        flag = torch.tensor([1 if self.signal_name else 0], dtype=torch.int32)
        if self._group is None:
            return bool(flag.item())
        stop = self._wait_pending()
        if stop:
            self.signal_name = self.signal_name or "peer rank"
        else:  # started now on every rank, read at the next call
            self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True), flag)
        return stop

    def _wait_pending(self) -> bool:
        if self._pending is None:
            return False
        work, flag = self._pending
        work.wait()
        self._pending = None
        return bool(flag.item())

    def restore(self) -> None:
        """Finish the all-reduce still in flight and put back the previous signal handlers."""
        self._wait_pending()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


LAUNCHER_GRACE_S = 30.0
"""deepspeed/launcher/launch.py ``terminate_process_tree``: SIGTERM to each rank, SIGKILL 30 s later."""
SAVE_OVERHEAD_S = 2.0
"""Fixed cost of a save besides writing the bytes: barriers, the agreement step, fsync of the folders (measured
about 0.5 s for the tiny model on CPU; bench/checkpoint_io.py)."""


def predicted_stop_seconds(checkpoint_bytes_per_node: int, write_bytes_per_s: float, step_seconds: float) -> float:
    """Seconds from SIGTERM to a committed checkpoint: the ranks agree one step after the signal (up to two
    optimizer steps), then write their node's share of the checkpoint at the disk's speed, fsynced."""
    return 2 * step_seconds + checkpoint_bytes_per_node / write_bytes_per_s + SAVE_OVERHEAD_S


def deadline_warning(
    checkpoint_bytes_per_node: int, write_bytes_per_s: float, step_seconds: float, grace_s: float = LAUNCHER_GRACE_S
) -> str | None:
    """A warning line when a preemption save is predicted to outlast the launcher's grace before SIGKILL."""
    need = predicted_stop_seconds(checkpoint_bytes_per_node, write_bytes_per_s, step_seconds)
    if need <= grace_s:
        return None
    return (
        f"a SIGTERM save needs about {need:.0f} s ({checkpoint_bytes_per_node / 1e9:.1f} GB per node at"
        f" {write_bytes_per_s / 1e6:.0f} MB/s, steps of {step_seconds:.1f} s) but the deepspeed launcher kills"
        f" ranks {grace_s:.0f} s after SIGTERM. Fix: signal earlier (SLURM --signal=TERM@{int(need * 2)}), write to"
        " a faster disk, or save more often (--save-interval); see docs/reliability.md"
    )
