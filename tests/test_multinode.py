"""Multi-node on one machine: two DeepSpeed launchers (node ranks 0 and 1, 2 ranks each) on the loopback address.

Each "node" runs what launch/multi_node.sh --no_ssh runs on a real node:
``deepspeed --hostfile H --no_ssh --node_rank N --master_addr 127.0.0.1 --master_port P train.py ...``.
With --no_ssh DeepSpeed still sizes the job from the hostfile (one ``name slots=K`` line per node, in node-rank
order); the names are never resolved or contacted in this mode, so ``node0``/``node1`` work on a single machine.
The 2 × 2 job must train exactly like 4 ranks on one node (the ranks ``--num_gpus=4`` starts, forked by the test
session's zygote): same global ranks, same batches, fp32.

Storage that is not shared (each node writes the same path onto its own disk) is simulated by giving node 1 its own
``--out``: its ranks then write into a folder node 0 never sees, which is what a node-local disk does to them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, cpu_env, free_port, launch, losses, records, run_bounded

pytestmark = pytest.mark.launcher

STEPS = 6
NODES, SLOTS = 2, 2
TIMEOUT = 600


def run_args(data: Path, out: Path) -> list[str]:
    return [
        "--deepspeed_config", "ds_configs/zero2.json", "--ds", "fp16.enabled=false",
        "--model", "tiny-deepseek-v3", "--data", str(data), "--out", str(out),
        "--lr", "3e-3", "--warmup-steps", "2", "--micro-batch", "1", "--grad-accum", "1",
        "--max-steps", str(STEPS), "--log-interval", "1", "--eval-interval", "0", "--save-interval", "0", "--no-export",
    ]  # fmt: skip


def launch_nodes(
    args: list[str], hostfile: Path, logs: Path, node_args: list[list[str]] | None = None, wait_all: bool = False
) -> list[tuple[int, str]]:
    """Start one launcher per node rank at once (they rendezvous through the master); wait, kill all on failure
    (``wait_all``: let every node end by itself). ``node_args[n]`` is appended to node n's arguments.
    Returns (exit code, output) per node."""
    deepspeed = Path(sys.executable).parent / "deepspeed"
    port = free_port()
    procs: list[subprocess.Popen[str]] = []
    files = []
    try:
        for node in range(NODES):
            cmd = [str(deepspeed), f"--hostfile={hostfile}", "--no_ssh", f"--node_rank={node}"]
            cmd += ["--master_addr=127.0.0.1", f"--master_port={port}", "train.py", *args]
            cmd += node_args[node] if node_args else []
            log = (logs / f"node{node}.log").open("w+")
            files.append(log)
            procs.append(
                subprocess.Popen(
                    cmd,
                    cwd=REPO,
                    env=cpu_env(),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + TIMEOUT
        while any(p.poll() is None for p in procs):
            failed = not wait_all and any(p.returncode not in (None, 0) for p in procs)
            if failed or time.monotonic() > deadline:
                break  # one node failed (the other would wait for it forever) or the whole job hangs
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                _kill_group(p)
    results = []
    for p, log in zip(procs, files, strict=True):
        log.seek(0)
        results.append((p.returncode, log.read()))
        log.close()
    return results


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """The launcher and the ranks it spawned (its own session, started above), then reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def test_two_nodes_of_two_ranks_match_one_node_of_four(tiny_data: Path, tmp_path: Path) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"node{i} slots={SLOTS}\n" for i in range(NODES)))
    multi = tmp_path / "multi"
    results = launch_nodes(run_args(tiny_data, multi), hostfile, tmp_path)
    for node, (code, out) in enumerate(results):
        assert code == 0, f"node {node} exit {code}\n{out[-4000:]}"
    node0, node1 = (out for _, out in results)
    assert "nnodes=2, num_local_procs=2, node_rank=0" in node0
    assert "nnodes=2, num_local_procs=2, node_rank=1" in node1
    assert "world 4 on cpu (gloo)" in node0 and "data-parallel 4 = global 4" in node0
    assert "world 4" not in node1  # the header and metrics come from global rank 0 only

    single = tmp_path / "single"
    proc = launch(run_args(tiny_data, single), nproc=NODES * SLOTS, timeout=TIMEOUT)  # 4 ranks as --num_gpus=4 has them
    assert "world 4 on cpu (gloo)" in proc.stdout

    a, b = losses(multi), losses(single)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    for step in a:
        assert a[step] == pytest.approx(b[step], abs=1e-5), (step, a[step], b[step])
    grads = [r["grad_norm"] for r in records(multi)], [r["grad_norm"] for r in records(single)]
    assert grads[0] == pytest.approx(grads[1], rel=1e-4)
    assert a[STEPS] < a[1]
    assert (multi / "checkpoints" / "latest").read_text() == f"step{STEPS:08d}"
    assert not list((multi / "checkpoints").glob(".shared-check-*"))  # the start-of-run marker is removed


def test_two_nodes_that_do_not_share_the_checkpoint_folder_stop_with_one_line(tiny_data: Path, tmp_path: Path) -> None:
    """Node 1's ranks write into their own folder (a node-local disk): every rank stops at start with one line."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"node{i} slots={SLOTS}\n" for i in range(NODES)))
    shared, local = tmp_path / "shared", tmp_path / "node1-disk"
    args = run_args(tiny_data, shared)
    start = time.monotonic()
    results = launch_nodes(args, hostfile, tmp_path, node_args=[[], ["--out", str(local)]], wait_all=True)
    seconds = time.monotonic() - start
    fix = "Fix: put --out on a filesystem that every node mounts at the same path (NFS, Lustre, ...)"
    problem = "ranks 2-3 of 4 do not see the file rank 0 wrote there, and only rank 0 publishes a checkpoint"
    for node, (code, out) in enumerate(results):
        assert code == 2, f"node {node} exit {code}\n{out[-4000:]}"
        assert "Traceback" not in out, out[-4000:]
    lines = [out.splitlines() for _, out in results]
    for rank in range(NODES * SLOTS):  # every rank says it, each naming the folder it writes into
        folder = (shared if rank < SLOTS else local) / "checkpoints"
        prefix = f"[rank {rank}] " if rank else ""
        line = f"{prefix}error: {folder}: {problem}, so every rank must write into the same folder. {fix}"
        assert line in lines[rank // SLOTS], "\n".join(lines[rank // SLOTS][-30:])
    assert list((shared / "checkpoints").iterdir()) == []  # no marker left, nothing published
    assert not (local / "checkpoints").exists() or not list((local / "checkpoints").iterdir())
    assert not (shared / "metrics.jsonl").exists()  # refused before the model and the metrics sink
    print(f"refused in {seconds:.1f} s (both launchers, start to exit)")


def test_node_local_checkpoint_storage_is_refused(tiny_data: Path, tmp_path: Path) -> None:
    """DeepSpeed's node-local storage has each node's local rank 0 write its own files; deepzero publishes from
    rank 0 only, so the option is refused in one line (here on one process: the option is never supported)."""
    args = run_args(tiny_data, tmp_path / "out")
    args.insert(args.index("fp16.enabled=false") + 1, "checkpoint.use_node_local_storage=true")
    proc = run_bounded([sys.executable, "train.py", *args], timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: ds_configs/zero2.json: checkpoint.use_node_local_storage: node-local checkpoint storage is not"
        " supported (rank 0 alone publishes a checkpoint, so the other nodes' files would never be part of it)."
        " Fix: remove it (or --ds checkpoint.use_node_local_storage=false) and put --out on a filesystem every"
        " node shares"
    )
    assert "Traceback" not in proc.stderr


def _check_in_group(rank: int, world: int, port: int, runs: list[list[str]], results: Any) -> None:
    """One rank of a plain gloo group: the start-of-run check on its folder of each run; puts (run, rank, seconds,
    error line or None) on ``results``."""
    import torch.distributed as dist

    from deepzero.checkpoint_storage import check_shared_storage
    from deepzero.errors import UserError

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    for i, folders in enumerate(runs):
        start = time.perf_counter()
        try:
            check_shared_storage(Path(folders[rank]), {}, "zero2.json")
            error = None
        except UserError as err:
            error = str(err)
        results.put((i, rank, time.perf_counter() - start, error))
    dist.barrier()


def test_the_shared_storage_check_costs_one_file_and_two_collectives(tmp_path: Path) -> None:
    """The check itself in a 3-rank gloo group: a shared folder passes in milliseconds and keeps nothing; one rank
    writing elsewhere makes every rank raise the line, each naming its own folder."""
    import torch.multiprocessing as mp

    shared, elsewhere = tmp_path / "shared" / "checkpoints", tmp_path / "elsewhere" / "checkpoints"
    runs = [[str(shared)] * 3, [str(shared), str(shared), str(elsewhere)]]
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_check_in_group, args=(3, free_port(), runs, results), nprocs=3, start_method="spawn")
    got: dict[tuple[int, int], tuple[float, str | None]] = {}
    while not results.empty():
        run, rank, seconds, error = results.get()
        got[run, rank] = (seconds, error)
    assert sorted(got) == [(r, k) for r in range(2) for k in range(3)]
    assert all(got[0, k][1] is None for k in range(3)), got
    seconds = max(got[0, k][0] for k in range(3))
    print(f"shared-storage check on 3 ranks: {seconds * 1000:.1f} ms")
    assert seconds < 1.0
    for rank in range(3):
        folder = elsewhere if rank == 2 else shared
        assert got[1, rank][1] == (
            f"{folder}: rank 2 of 3 does not see the file rank 0 wrote there, and only rank 0 publishes a checkpoint,"
            " so every rank must write into the same folder. Fix: put --out on a filesystem that every node mounts"
            " at the same path (NFS, Lustre, ...)"
        )
    assert list(shared.iterdir()) == []  # the marker is removed in both cases
