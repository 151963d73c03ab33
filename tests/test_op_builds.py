"""A lock left by a killed DeepSpeed op build is cleared at once when no deepzero process lives, found by its age
beside a live one (both folder layouts torch uses); each environment builds into its own folder."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deepzero.errors import UserError
from deepzero.op_builds import STALE_AFTER_S, check_op_builds, stale_locks
from tests.conftest import REPO


def lock(path: Path, age_s: float) -> Path:
    path.parent.mkdir(parents=True)
    path.touch()
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


HOLD = "import sys, time; from pathlib import Path; from deepzero.op_builds import claim_op_builds\n"
HOLD += "claim_op_builds(Path(sys.argv[1])); print('holding', flush=True); time.sleep(60)"


def live_process(root: Path) -> subprocess.Popen:
    """Another deepzero process on ``root`` (it holds the shared flock, as every launch does)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(root)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "holding"
    return proc


def test_with_a_live_process_only_locks_older_than_a_build_can_take_are_stale(tmp_path: Path) -> None:
    other = live_process(tmp_path)
    old = lock(tmp_path / "py311_cpu" / "fused_adam" / "lock", STALE_AFTER_S + 60)  # default root layout
    older = lock(tmp_path / "deepspeed_shm_comm" / "lock", 2 * STALE_AFTER_S)  # $TORCH_EXTENSIONS_DIR layout
    young = lock(tmp_path / "py311_cpu" / "cpu_adam" / "lock", 30)  # a build running now, in the live process
    try:
        assert stale_locks(tmp_path) == [older, old]
        with pytest.raises(
            UserError, match=f"{re.escape(str(older))}: left by a DeepSpeed op build .* Fix: rm {re.escape(str(older))}"
        ):
            check_op_builds(tmp_path)
        assert young.exists()
    finally:
        other.kill()
        other.wait()


def test_a_killed_builds_lock_is_cleared_at_once_when_no_deepzero_process_lives(tmp_path: Path) -> None:
    """A build killed a second ago (its lock fresh): the next launch, the only deepzero process on the folder,
    removes it with one line and goes on to build; with a live process beside, it stays (that build is running)."""
    other = live_process(tmp_path)
    fresh = lock(tmp_path / "deepspeed_shm_comm" / "lock", 1)
    try:
        code = f"from pathlib import Path; from deepzero.op_builds import check_op_builds; check_op_builds(Path({str(tmp_path)!r}))"
        kept = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
        assert kept.returncode == 0 and fresh.exists() and "removed" not in kept.stdout
    finally:
        other.kill()
        other.wait()
    cleared = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert cleared.returncode == 0 and not fresh.exists()
    assert f"removed {fresh}, left by a DeepSpeed op build that was killed" in cleared.stdout


def test_each_environment_builds_into_its_own_folder() -> None:
    """Unless the user set TORCH_EXTENSIONS_DIR, ops build under this environment's prefix: two checkouts with their
    own .venv never rebuild each other's."""
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    code = "from deepzero.op_builds import build_root; print(build_root())"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=env).stdout
    assert Path(out.strip()) == Path(sys.prefix) / "torch_extensions"
    mine = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          env=env | {"TORCH_EXTENSIONS_DIR": "/somewhere/else"}).stdout  # fmt: skip
    assert mine.strip() == "/somewhere/else"


def test_no_locks_no_error(tmp_path: Path) -> None:
    assert stale_locks(tmp_path / "missing") == []
    check_op_builds(tmp_path)


def test_setup_builds_what_the_seed_preset_loads() -> None:
    """make setup's build (python -m deepzero.op_builds) leaves the seed preset's ops compiled for this venv, where
    the first launch loads them (the suite's launches then compile nothing)."""
    from deepzero.dsconfig import load_json
    from deepzero.op_builds import build_cpu_ops, build_root, preset_ops

    built = build_cpu_ops()
    assert built == preset_ops(load_json("ds_configs/zero2.json"), "cpu") == ["deepspeed_shm_comm"]
    for name in built:
        folder = next(build_root().glob(f"*/{name}"), None) or build_root() / name
        assert (folder / f"{name}.so").is_file(), folder
        assert not (folder / "lock").exists()


def test_a_lock_released_while_it_is_looked_at_is_not_an_error(tmp_path: Path, monkeypatch) -> None:
    """torch takes and drops an op's lock on every load: another rank's lock seen by the glob may be gone by the
    time its age is read (seen in CI as a FileNotFoundError from every rank of a launch)."""
    import deepzero.op_builds as op_builds

    real = lock(tmp_path / "cpu_adam" / "lock", 2 * STALE_AFTER_S)
    gone = tmp_path / "deepspeed_shm_comm" / "lock"  # listed, then released before its stat
    monkeypatch.setattr(op_builds, "op_locks", lambda root: [gone, real])
    monkeypatch.setattr(op_builds, "claim_op_builds", lambda root=None: [])
    assert stale_locks(tmp_path) == [real]
    real.unlink()  # released since: its age is read once, so the message never stats it again
    check_op_builds(tmp_path)


def test_a_real_build_killed_mid_way_then_a_launch_finishes_the_build_and_trains(
    tiny_data: Path, tmp_path: Path
) -> None:
    """The hang as users meet it: `make setup`'s op build (python -m deepzero.op_builds) is SIGKILLed while it
    compiles, leaving torch's lock; the next launch says so in one line, builds the op and trains (before, every
    rank slept on the lock for ever after the header)."""
    import signal

    from conftest import cpu_env, launch, records

    from deepzero.op_builds import op_locks

    root = tmp_path / "extensions"
    env = cpu_env(TORCH_EXTENSIONS_DIR=str(root))
    build = subprocess.Popen([sys.executable, "-m", "deepzero.op_builds"], cwd=REPO, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while not (root.is_dir() and op_locks(root)) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)  # the compiler is running
    os.killpg(build.pid, signal.SIGKILL)
    build.wait()
    left = op_locks(root)
    assert left and not list(root.glob("**/*.so")), "the build was not killed mid-way"
    out = tmp_path / "run"
    proc = launch(["--data", str(tiny_data), "--out", str(out), "--max-steps", "2", "--ds", "train_batch_size=auto",
                   "--log-interval", "1", "--eval-interval", "0", "--save-interval", "0", "--no-export"],
                  nproc=1, env=env, timeout=600)  # fmt: skip
    assert f"removed {left[0]}, left by a DeepSpeed op build that was killed" in proc.stdout
    assert [r["step"] for r in records(out)] == [1, 2] and list(root.glob("**/*.so"))


def test_a_wait_behind_an_op_lock_names_the_lock_its_age_and_the_fix(tmp_path: Path, capsys) -> None:
    """The watchdog's line for a launch stuck behind an op lock names the lock, its age and whether a build is
    running beside it: none, a killed build's, with the rm that clears it; a process compiling in the op's folder is
    a live build, not to be removed."""
    from deepzero import op_builds
    from deepzero.watchdog import phase

    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    lock.write_text("")
    with phase("joining", limit_s=0.05, detail=lambda: op_builds.lock_report(tmp_path)):
        time.sleep(0.5)
    line = capsys.readouterr().err
    assert "still joining after" in line and f"op build lock {lock} (" in line
    assert f"no build is running: a killed build's; rm {lock}" in line
    compiler = subprocess.Popen(["sleep", "30"], cwd=lock.parent)
    try:
        time.sleep(0.2)
        assert "a build is running" in op_builds.lock_report(tmp_path)
    finally:
        compiler.kill()
        compiler.wait()
    assert op_builds.lock_report(tmp_path / "empty") == ""
