"""The first screen a user sees: rank 0's progress bar under a pseudo-terminal (also one nobody sized, as `script`
and `docker run -t` make), through the real deepspeed launcher."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO, cpu_env

from deepzero.distributed import free_port


def run_under_pty(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    """``cmd`` with stdin, stdout and stderr on a fresh pseudo-terminal of 0 × 0 cells; its exit code and output."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    out, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the other side closed
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        return proc.wait(timeout=max(1.0, deadline - time.monotonic())), out.decode(errors="replace")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        os.close(master)


def test_rank_0_draws_a_progress_bar_under_a_terminal(tiny_data: Path, tmp_path: Path) -> None:
    launcher = str(Path(sys.executable).parent / "deepspeed")
    cmd = [launcher, "--log_level=error", "--num_gpus=2", f"--master_port={free_port()}", "train.py"]
    cmd += [
        "--data",
        str(tiny_data),
        "--out",
        str(tmp_path / "run"),
        "--max-steps",
        "3",
        "--ds",
        "train_batch_size=auto",
    ]
    cmd += ["--log-interval", "3", "--eval-interval", "0", "--save-interval", "0", "--no-export"]
    code, screen = run_under_pty(cmd, cpu_env(), 300)
    assert code == 0, screen[-3000:]
    assert "3/3 [" in screen  # tqdm's bar, drawn 80 columns wide where the terminal reports 0
    assert screen.count("step/s]") + screen.count("s/step]") >= 1
    assert screen.count("[train] step=3") == 1  # one rank logs


def test_bitsandbytes_kernel_hub_notice_is_dropped_and_nothing_else() -> None:
    """bitsandbytes' CPU backend logs a failed Hub kernel load on every rank at import (on CPUs with AVX512-BF16,
    a GPU host's too); deepzero.quiet drops exactly that message. Where this CPU makes bitsandbytes say it, the real
    import is checked too; the logged stand-ins are checked on every CPU."""
    probe = (
        "import logging, sys\n"
        "if sys.argv[1] == 'quiet':\n"
        "    from deepzero import quiet; quiet.install()\n"
        "import bitsandbytes\n"
        "log = logging.getLogger('bitsandbytes.backends.cpu.ops')\n"
        "log.warning('Failed to load CPU gemm_4bit_forward from kernels-community: stand-in')\n"
        "log.warning('another bitsandbytes warning')\n"
    )
    run = {m: subprocess.run([sys.executable, "-c", probe, m], cwd=REPO, capture_output=True, text=True, check=True)
           for m in ("loud", "quiet")}  # fmt: skip
    assert "stand-in" in run["loud"].stderr and "stand-in" not in run["quiet"].stderr
    assert "another bitsandbytes warning" in run["quiet"].stderr
    assert "kernels-community" not in run["quiet"].stderr


def test_library_progress_bars_stay_out_of_a_log() -> None:
    """Transformers' "Loading weights" / "Writing model shards" bars (and huggingface_hub's) print into a log as lines
    of carriage returns: off when stderr is not a terminal, as in every launch's log file."""
    probe = (
        "import sys\n"
        "from deepzero import quiet; quiet.install()\n"
        "from huggingface_hub.utils import are_progress_bars_disabled\n"
        "from transformers.utils.logging import is_progress_bar_enabled\n"
        "print(is_progress_bar_enabled(), are_progress_bars_disabled())\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert proc.stdout.split() == ["False", "True"], proc.stdout
