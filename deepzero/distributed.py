"""Joining the process group, and one DeepSpeed CPU quirk: its shared-memory buffers outlive every run."""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from deepzero.errors import RaisedElsewhere, UserError
from deepzero.op_builds import check_op_builds, lock_report
from deepzero.quiet import printed_lines_dropped
from deepzero.watchdog import phase

SHM_DIR = Path("/dev/shm")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for a process group's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def on_cuda() -> bool:
    """True when ranks train on CUDA cards: DeepSpeed's accelerator, not whether torch sees a GPU (a GPU box with
    DS_ACCELERATOR=cpu trains on the CPU)."""
    return get_accelerator().device_name() == "cuda"


def init_distributed() -> tuple[int, int]:
    """Join the group the launcher (deepspeed, torchrun, srun) described; a plain `python` run is rank 0 of 1."""
    for key, default in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, default)
    if "MASTER_PORT" not in os.environ:  # a lone `python train.py`: any free port, so several can run side by side
        os.environ["MASTER_PORT"] = str(free_port())
    get_accelerator().set_device(int(os.environ["LOCAL_RANK"]))
    if not on_cuda() and "OMP_NUM_THREADS" not in os.environ:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))  # CPU ranks share the cores
    check_op_builds()  # DeepSpeed builds its CPU comm op here: never behind a killed build's lock
    with (
        printed_lines_dropped(),
        phase("joining the process group (every rank, and DeepSpeed's comm op build)", detail=lock_report),
    ):
        deepspeed.init_distributed(dist_init_required=True, verbose=False)
    release_shm_buffers()
    return dist.get_rank(), dist.get_world_size()


def mean_and_max(means: Sequence[float], maxes: Sequence[float]) -> tuple[list[float], list[float]]:
    """Over every rank: the mean of each of ``means`` and the largest of each of ``maxes``, in one collective.

    A log point's numbers (loss, peak memory, non-finite streak) cost one all-reduce instead of one each: every rank
    writes its values into its own row of a ``[world, n]`` float64 table of zeros and the rows are summed.
    """
    table = every_ranks_row(torch.tensor([*means, *maxes], dtype=torch.float64))
    n = len(means)
    return table[:, :n].mean(dim=0).tolist(), table[:, n:].amax(dim=0).tolist()


def every_ranks_row(row: torch.Tensor) -> torch.Tensor:
    """``[world, n]``: each rank's ``row`` (a 1-D host tensor), the same table on every rank. One all-reduce: every
    rank writes its row into a table of zeros and the tables are summed (a plain process: ``row[None]``)."""
    if not dist.is_initialized():
        return row[None]
    table = torch.zeros(dist.get_world_size(), row.numel(), dtype=row.dtype)
    table[dist.get_rank()] = row
    table = _comm_tensor(table)
    dist.all_reduce(table)
    return table.cpu()


def _comm_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` where the group's collectives take it: gloo reduces host tensors, NCCL needs them on the card."""
    if dist.is_initialized() and dist.get_backend() != "gloo":
        return t.to(get_accelerator().current_device_name())
    return t


def all_reduce_max(x: float) -> float:
    """The largest ``x`` over every rank."""
    t = _comm_tensor(torch.tensor(x))
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def every_ranks_object(value: Any) -> list[Any]:
    """Each rank's ``value`` (picklable), in rank order, on every rank (a plain process: ``[value]``)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [value]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


def rank0_decides(decide: Callable[[], Any]) -> Any:
    """``decide()`` run on rank 0 and its answer on every rank (a one-process run without a group: run here)."""
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    box = [decide() if rank0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def broadcast_int(x: int) -> int:
    """Rank 0's ``x`` on every rank (an int64)."""
    t = _comm_tensor(torch.tensor(x, dtype=torch.int64))
    if dist.is_initialized():
        dist.broadcast(t, src=0)
    return int(t.item())


LONG_WAIT = timedelta(hours=6)
"""How long ranks may wait on one rank's host work (a 70B base quantised, or merged and written shard by shard):
longer than the main group's collective timeout (DeepSpeed's default: 10 minutes)."""


@contextmanager
def while_one_rank_works(timeout: timedelta = LONG_WAIT) -> Iterator[None]:
    """Every rank enters (a gloo group of its own is made first, while all are here); at the exit they meet on it
    with ``timeout`` instead of the main group's. A no-op outside a process group."""
    if not dist.is_initialized():
        yield
        return
    group = dist.new_group(backend="gloo", timeout=timeout)
    try:
        yield
    finally:
        dist.barrier(group=group)
        dist.destroy_process_group(group)


def ranks_where(flag: bool) -> list[int]:
    """The global ranks whose ``flag`` is true, the same list on every rank (one all-reduce of world-size bytes)."""
    flags = every_ranks_row(torch.tensor([int(flag)], dtype=torch.int32))[:, 0]
    return [r for r, f in enumerate(flags.tolist()) if f]


ERROR_EXIT_GRACE_S = 5.0


def report_user_error(err: UserError) -> int:
    """An entry point's bad input: its one line on stderr (rank 0's, or any rank's that reaches it; a line every rank
    raised alike, a ``RaisedElsewhere``, only rank 0's), exit code 2."""
    agreed = isinstance(err, RaisedElsewhere) and dist.is_initialized() and dist.get_rank() != 0
    if (os.environ.get("RANK", "0") == "0" or dist.is_initialized()) and not agreed:
        prefix = f"[rank {dist.get_rank()}] " if dist.is_initialized() and dist.get_rank() else ""
        # One write of the whole line: print() writes the text and its newline separately, and ranks sharing
        # the launcher's stderr then interleave ("...(NFS, Lustre, ...)[rank 2] error: ...\n\n", seen in CI).
        sys.stderr.write(f"{prefix}error: {err}\n")
        sys.stderr.flush()
    if os.environ.get("RANK", "0") != "0":
        # The launcher kills every rank once one exits non-zero: wait, so that rank 0 reaching the same error a
        # moment later still prints its line instead of being killed before it does (rank 0 exiting first ends
        # the job at once).
        time.sleep(ERROR_EXIT_GRACE_S)
    return 2


def exit_process(code: int) -> NoReturn:
    """End an entry point that joined a process group with ``code``, skipping interpreter shutdown.

    A gloo worker thread may still be releasing the tensors of the last collective, which needs the GIL. During
    interpreter shutdown that aborts the process after its work is done ("terminate called without an active
    exception", exit -6: seen in CI, about 1 launch in 30 here; core dump: ProcessGroupGloo::runLoop →
    ~AsyncAllgatherWork → take_gil during Py_FinalizeEx). ``destroy_process_group`` is no cure: gloo's threads
    outlive it, and tearing a group down is itself a known source of hangs (pytorch/pytorch#75097, #56297); a CI
    run hung in a launch that called it. So the group is left to the OS: callers close their files and
    trackers first, every collective has returned by then, and this flushes stdio and leaves with ``os._exit``.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def release_shm_buffers() -> int:
    """Unlink the /dev/shm buffers DeepSpeed's CPU comm op created for this job (66 MB per rank, never removed).

    Every rank maps its peers' buffers by name while the group starts; after a barrier the names are no longer
    needed, and unlinking them lets the kernel free the memory when the processes exit, even on SIGKILL.
    Without this, each CPU run leaks ~200 MB of RAM until reboot. Returns the number of names removed.
    """
    if get_accelerator().device_name() != "cpu" or not SHM_DIR.is_dir():
        return 0
    dist.barrier()
    pattern = f"deepspeed_allreduce_buffer_*_{os.environ['MASTER_ADDR']}_{os.environ['MASTER_PORT']}_*"
    removed = 0
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        for path in SHM_DIR.glob(pattern):
            path.unlink(missing_ok=True)
            removed += 1
    dist.barrier()
    return removed
