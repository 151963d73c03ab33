"""Start N local ranks of a script as DeepSpeed's launcher would, as forks of one process that imported once.

``python tests/helpers/spawn_ranks.py N PORT SCRIPT ARGS...`` gives each rank what ``deepspeed --num_gpus=N`` gives
it (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE, MASTER_ADDR/PORT, CROSS_RANK/SIZE, CUDA_VISIBLE_DEVICES, ``--local_rank``)
and, as its launch.py does, stops every rank (SIGTERM, SIGKILL 30 s later) when one exits non-zero, then exits with
that rank's code. The real launcher (runner + launch.py) imports torch and DeepSpeed twice before the first rank
starts, and each rank imports them again; here the ranks are forks of this process after one import
(tests/helpers/forked.py), or of a zygote that imported once for the whole test session (tests/helpers/zygote.py).
"""

from __future__ import annotations

import os
import signal
import sys
import time

from forked import fork_script, preimport


def run_ranks(nproc: str, port: str, script: str, args: list[str]) -> int:
    """Fork the ranks of ``script`` (this process has imported what they need), wait, and return the exit code."""
    world = int(nproc)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": nproc, "LOCAL_SIZE": nproc}
    env.update(CROSS_RANK="0", CROSS_SIZE="1", CUDA_VISIBLE_DEVICES=",".join(map(str, range(world))))
    ranks = [
        fork_script(script, [f"--local_rank={rank}", *args], {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)})
        for rank in range(world)
    ]
    running = set(ranks)

    def stop() -> None:
        for pid in running:
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while running and time.monotonic() < deadline:
            pid, _ = os.waitpid(-1, os.WNOHANG)
            running.discard(pid)
            time.sleep(0.05)
        for pid in running:
            os.kill(pid, signal.SIGKILL)

    signal.signal(signal.SIGTERM, lambda signum, frame: (stop(), sys.exit(1)))
    while running:
        pid, status = os.wait()
        if pid not in running:
            continue
        running.discard(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            time.sleep(1)  # as launch.py's 1 s poll: ranks failing together print their own lines first
            stop()
            print(f"spawn_ranks: rank {ranks.index(pid)} exited with code {code}", file=sys.stderr, flush=True)
            return code if code > 0 else 1
    return 0


if __name__ == "__main__":
    nproc, port, script, *args = sys.argv[1:]
    preimport()
    sys.exit(run_ranks(nproc, port, script, args))
