"""The guard every launch in the suite goes through: a hung rank fails its test with stacks, never stalls CI."""

from __future__ import annotations

import sys
import time

import pytest
from conftest import run_bounded


def test_returns_like_subprocess_run() -> None:
    proc = run_bounded([sys.executable, "-c", "import sys; print('out'); sys.exit(3)"], timeout=60)
    assert (proc.returncode, proc.stdout) == (3, "out\n")


def test_a_hung_grandchild_holding_the_pipes_is_stopped_with_its_stack() -> None:
    # The parent exits at once; its child (like a rank under the deepspeed launcher) keeps stdout open and hangs.
    child = "import time; print('child started', flush=True); time.sleep(600)"
    parent = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {child!r}])"
    start = time.monotonic()
    with pytest.raises(AssertionError, match="no exit after 5 s") as failure:
        run_bounded([sys.executable, "-c", parent], timeout=5)
    assert time.monotonic() - start < 60
    assert "child started" in str(failure.value)
    assert 'File "<string>", line 1 in <module>' in str(failure.value)  # the child's stack, from faulthandler
