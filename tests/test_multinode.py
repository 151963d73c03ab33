"""Multi-node on one machine: two DeepSpeed launchers (node ranks 0 and 1, 2 ranks each) on the loopback address.

Each "node" runs what launch/multi_node.sh --no_ssh runs on a real node:
``deepspeed --hostfile H --no_ssh --node_rank N --master_addr 127.0.0.1 --master_port P train.py ...``.
With --no_ssh DeepSpeed still sizes the job from the hostfile (one ``name slots=K`` line per node, in node-rank
order); the names are never resolved or contacted in this mode, so ``node0``/``node1`` work on a single machine.
The 2 × 2 job must train exactly like one launcher with ``--num_gpus=4``: same global ranks, same batches, fp32.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, cpu_env, free_port, launch, losses, records

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


def launch_nodes(args: list[str], hostfile: Path, logs: Path) -> list[tuple[int, str]]:
    """Start one launcher per node rank at once (they rendezvous through the master); wait, kill all on failure.
    Returns (exit code, output) per node."""
    deepspeed = Path(sys.executable).parent / "deepspeed"
    port = free_port()
    procs: list[subprocess.Popen[str]] = []
    files = []
    try:
        for node in range(NODES):
            cmd = [str(deepspeed), f"--hostfile={hostfile}", "--no_ssh", f"--node_rank={node}"]
            cmd += ["--master_addr=127.0.0.1", f"--master_port={port}", "train.py", *args]
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
            if any(p.returncode not in (None, 0) for p in procs) or time.monotonic() > deadline:
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
    proc = launch(run_args(tiny_data, single), nproc=NODES * SLOTS, timeout=TIMEOUT)
    assert "world 4 on cpu (gloo)" in proc.stdout

    a, b = losses(multi), losses(single)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    for step in a:
        assert a[step] == pytest.approx(b[step], abs=1e-5), (step, a[step], b[step])
    grads = [r["grad_norm"] for r in records(multi)], [r["grad_norm"] for r in records(single)]
    assert grads[0] == pytest.approx(grads[1], rel=1e-4)
    assert a[STEPS] < a[1]
    assert (multi / "checkpoints" / "latest").read_text() == f"step{STEPS:08d}"
