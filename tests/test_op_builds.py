"""A lock left by a killed DeepSpeed op build is found (both folder layouts torch uses); a live build's is not."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from deepzero.errors import UserError
from deepzero.op_builds import STALE_AFTER_S, check_op_builds, stale_locks


def lock(path: Path, age_s: float) -> Path:
    path.parent.mkdir(parents=True)
    path.touch()
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_only_locks_older_than_a_build_can_take_are_stale(tmp_path: Path) -> None:
    old = lock(tmp_path / "py311_cpu" / "fused_adam" / "lock", STALE_AFTER_S + 60)  # default root layout
    older = lock(tmp_path / "deepspeed_shm_comm" / "lock", 2 * STALE_AFTER_S)  # $TORCH_EXTENSIONS_DIR layout
    lock(tmp_path / "py311_cpu" / "cpu_adam" / "lock", 30)  # a build running now
    assert stale_locks(tmp_path) == [older, old]
    with pytest.raises(
        UserError, match=f"{re.escape(str(older))}: left by a DeepSpeed op build .* Fix: rm {re.escape(str(older))}"
    ):
        check_op_builds(tmp_path)


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
