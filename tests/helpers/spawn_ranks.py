"""Start N local ranks of a script the way DeepSpeed's launcher does, without importing torch or DeepSpeed.

``python tests/helpers/spawn_ranks.py N PORT SCRIPT ARGS...`` sets what ``deepspeed --num_gpus=N`` sets for each rank
(RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE, MASTER_ADDR/PORT, CROSS_RANK/SIZE, CUDA_VISIBLE_DEVICES, ``--local_rank``)
and, as its launch.py does, stops every rank when one exits non-zero and exits with that rank's code. The real
launcher (runner + launch.py) imports torch and DeepSpeed twice before the first rank starts, about 10 CPU-seconds
per launch; the tests whose subject is not the launcher start their ranks with this instead (tests/conftest.launch).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def main(argv: list[str]) -> int:
    nproc, port, script, *args = argv
    world = int(nproc)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": nproc, "LOCAL_SIZE": nproc}
    env.update(CROSS_RANK="0", CROSS_SIZE="1", CUDA_VISIBLE_DEVICES=",".join(map(str, range(world))))
    ranks = [
        subprocess.Popen(
            [sys.executable, "-u", script, f"--local_rank={rank}", *args],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
        )
        for rank in range(world)
    ]

    def stop() -> None:
        for rank in running.values():
            rank.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        for rank in running.values():
            try:
                rank.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rank.kill()

    signal.signal(signal.SIGTERM, lambda signum, frame: (stop(), sys.exit(1)))
    running = {rank.pid: rank for rank in ranks}
    while running:
        pid, status = os.wait()
        if running.pop(pid, None) is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            time.sleep(1)  # as launch.py's 1 s poll: ranks failing together print their own lines first
            stop()
            print(f"spawn_ranks: rank {[r.pid for r in ranks].index(pid)} exited with code {code}", file=sys.stderr)
            return code if code > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
