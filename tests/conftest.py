"""Shared fixtures: a small real corpus prepared once per session, and the real deepspeed launcher."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import zygote

from deepzero.distributed import SHM_DIR, free_port
from deepzero.errors import UserError
from deepzero.op_builds import check_op_builds
from deepzero.precision import DeviceKernels, probe_cpu


def share_the_cores_between_workers() -> None:
    """Under make test's pytest-xdist workers, each worker's in-process torch (and what it runs) takes its share of
    the cores, so two workers' OpenMP pools do not oversubscribe the cores that the launched ranks also need."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, len(os.sched_getaffinity(0)) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


share_the_cores_between_workers()
os.environ.setdefault("DS_ACCELERATOR", "cpu")  # in-process checks see the device the test ranks use, GPU box or not
REPO = Path(__file__).resolve().parents[1]
STDLIB = Path(sysconfig.get_paths()["stdlib"])
# A few standard-library packages: real Python source, present on every machine, about 1.5 MB.
CORPUS = [STDLIB / name for name in ("json", "email", "http", "logging", "concurrent", "importlib")]
CPU = probe_cpu()
"""The test ranks run on the CPU (DS_ACCELERATOR=cpu, also on a GPU box): what it computes natively."""
FAKE_CPU = REPO / "tests" / "fake_cpu"
"""A sitecustomize.py that makes deepzero see a CPU with the kernels named in DEEPZERO_FAKE_CPU_KERNELS."""


NATIVE_16BIT = DeviceKernels("cpu", "a test CPU", fp16=True, bf16=True, detail="faked")
"""For in-process resolve() calls whose expectations must not depend on the machine: presets keep their types."""
A_4090 = DeviceKernels("cuda", "NVIDIA GeForce RTX 4090", fp16=True, bf16=True, detail="compute capability 8.9")


def plan_as_on_4090s(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plan a command for the cards it is written for, whatever this CPU computes natively (a bf16 preset resolves to
    fp32 on a CPU without AVX512-BF16, doubling every 16-bit term of the plan)."""
    from deepzero import precision

    monkeypatch.setattr(precision, "probe", lambda: A_4090)


def bf16_precision() -> str:
    """The precision the bf16 presets train in on this machine's CPU."""
    return "bf16" if CPU.bf16 else "fp32"


def pytest_report_header() -> str:
    return f"cpu: {CPU.describe()}"


SHM_BEFORE = pytest.StashKey[set[Path]]()


def shm_buffers() -> set[Path]:
    return set(SHM_DIR.glob("deepspeed_allreduce_buffer_*")) if SHM_DIR.is_dir() else set()


def is_xdist_worker(session: pytest.Session) -> bool:
    return hasattr(session.config, "workerinput")


def pytest_sessionstart(session: pytest.Session) -> None:
    """A lock left by a killed DeepSpeed op build would make every launch below wait until its timeout."""
    try:
        check_op_builds()
    except UserError as err:
        pytest.exit(f"error: {err}", returncode=2)
    if not is_xdist_worker(session):
        session.config.stash[SHM_BEFORE] = shm_buffers()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Belt and braces: remove DeepSpeed /dev/shm buffers that appeared during the run (a killed run can leave
    some), once every worker is done. Whether deepzero itself releases them is asserted per launch in test_train_e2e."""
    if not is_xdist_worker(session) and SHM_BEFORE in session.config.stash:
        for path in shm_buffers() - session.config.stash[SHM_BEFORE]:
            path.unlink(missing_ok=True)


def fake_cpu_vars(kernels: str) -> dict[str, str]:
    """Environment variables for processes that see a CPU with exactly ``kernels`` ("", "fp16", "bf16", "fp16,bf16")."""
    path = os.pathsep.join(filter(None, [str(FAKE_CPU), str(REPO), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, "DEEPZERO_FAKE_CPU_KERNELS": kernels}


def fp16_env(**extra: str) -> dict[str, str]:
    """The environment of a run that trains in fp16 on any machine, for what only fp16 does (loss scaling, skipped
    overflow steps): the CPU as it is where it has native fp16, else one faked to have it (tests/fake_cpu tells
    DeepSpeed so too; torch computes fp16 on every CPU, only slower without AVX512-FP16)."""
    if CPU.fp16:
        return cpu_env(**extra)
    return cpu_env(**fake_cpu_vars("fp16,bf16" if CPU.bf16 else "fp16"), **extra)


def cpu_env(**extra: str) -> dict[str, str]:
    """The machine's environment for a CPU run: no real wandb key leaks in; a test may pass one in ``extra``."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env["PYTHONFAULTHANDLER"] = "1"  # a rank that aborts or is stopped by run_bounded prints its Python stacks
    env.pop("WANDB_API_KEY", None)
    return {**env, **extra}


def run_bounded(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, capture_output=True)`` for a command that spawns ranks or workers, in its own session.

    On timeout the whole session is stopped, not just ``cmd``: the ranks hold the output pipes, so killing only the
    launcher would leave the test waiting for ever. SIGABRT first, so every Python process prints where it was
    stuck (PYTHONFAULTHANDLER), then SIGKILL; the test fails with those stacks.
    """
    popen = dict(cwd=REPO, env=env or cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with subprocess.Popen(cmd, **popen, start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
            return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
        except subprocess.TimeoutExpired:
            pass
        out, err = "", ""
        for sig in (signal.SIGABRT, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                out, err = proc.communicate(timeout=30)
                break
    raise AssertionError(f"{' '.join(cmd[:4])} ...: no exit after {timeout} s\n{out[-3000:]}\n{err[-6000:]}")


def prepare(out: Path, *extra: str, inputs: list[Path] | None = None, seq_len: int = 64) -> Path:
    cmd = [sys.executable, "data/prepare.py", "--input", *map(str, inputs or CORPUS)]
    cmd += ["--seq-len", str(seq_len), "--out", str(out), *extra]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True, env=cpu_env())
    return out


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Stdlib source, BPE tokenizer (vocab 512) trained here, packed into 64-token rows."""
    return prepare(
        tmp_path_factory.mktemp("data") / "stdlib",
        "--tokenizer",
        "train",
        "--vocab-size",
        "512",
        "--val-fraction",
        "0.1",
    )


RUN_TIME_ENV = frozenset({"MASTER_PORT", "WORLD_SIZE", "WANDB_MODE", "WANDB_API_KEY", "DEEPZERO_ROW_TRACE"})
"""Variables nothing reads before train.py runs: launches that differ only in these share a zygote."""


class Zygotes:
    """One tests/helpers/zygote.py per environment (but for RUN_TIME_ENV), started at its first launch and kept for
    the session: each launch's ranks are forks of a process that imported torch, Transformers and DeepSpeed once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.started: dict[tuple, tuple[subprocess.Popen, Path]] = {}

    def socket_for(self, env: dict[str, str]) -> Path:
        key = tuple(sorted((k, v) for k, v in env.items() if k not in RUN_TIME_ENV))
        if key not in self.started:
            path = self.root / f"z{len(self.started)}.sock"
            log = (self.root / f"z{len(self.started)}.log").open("w")
            try:
                self.started[key] = (zygote.start(path, env, stderr=log), path)
            except RuntimeError as err:
                raise AssertionError(f"{err}: {Path(log.name).read_text()[-3000:]}") from None
        return self.started[key][1]

    def close(self) -> None:
        for proc, _ in self.started.values():
            proc.kill()
            proc.wait()


_zygotes: Zygotes | None = None


@pytest.fixture(autouse=True, scope="session")
def zygotes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    global _zygotes
    _zygotes = Zygotes(tmp_path_factory.mktemp("zygotes"))
    yield
    _zygotes.close()
    _zygotes = None


def run_forked(
    sock: Path, nproc: int, script: str, args: list[str], env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """``run_bounded`` for ranks forked by a zygote: stdout and stderr through files; on timeout the launcher's whole
    session gets SIGABRT (every Python process prints its stacks), then SIGKILL, and the test fails with them."""
    files = Path(tempfile.mkdtemp(dir=sock.parent))
    request = {"nproc": nproc, "port": free_port(), "script": script, "args": args, "env": env}
    request |= {"stdout": str(files / "stdout"), "stderr": str(files / "stderr")}
    cmd = ["zygote", str(nproc), script, *args]
    pid, code = zygote.ask(sock, request, timeout)
    if code is not None:
        return subprocess.CompletedProcess(cmd, code, *(f.read_text() for f in (files / "stdout", files / "stderr")))
    for sig in (signal.SIGABRT, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)
        time.sleep(10)
    out, err = ((files / name).read_text() for name in ("stdout", "stderr"))
    raise AssertionError(f"{' '.join(cmd[:4])} ...: no exit after {timeout} s\n{out[-3000:]}\n{err[-6000:]}")


def launch(
    args: list[str],
    nproc: int = 3,
    env: dict[str, str] | None = None,
    timeout: int = 900,
    check: bool = True,
    script: str = "train.py",
    real_launcher: bool = False,
) -> subprocess.CompletedProcess[str]:
    """N ranks of SCRIPT ARGS on the CPU (gloo); SCRIPT defaults to train.py (the helpers under tests/helpers/ need
    ``PYTHONPATH`` set to the repo in ``env``).

    ``real_launcher`` runs `deepspeed --num_gpus=N`. Otherwise the ranks are forks of a zygote of the session
    (:class:`Zygotes`; tests/helpers/spawn_ranks.py outside a pytest session) with the environment and arguments the
    launcher gives them: no launcher importing torch and DeepSpeed twice, no rank importing them again, about 20 of
    a tiny launch's 31 s. Tests whose subject is the launcher (its log, its signals, several nodes) use the real one.
    """
    env = env or cpu_env()
    if not real_launcher and _zygotes is not None:
        proc = run_forked(_zygotes.socket_for(env), nproc, script, args, env, timeout)
    else:
        if real_launcher:
            cmd = [str(Path(sys.executable).parent / "deepspeed"), f"--num_gpus={nproc}"]
            cmd += [f"--master_port={free_port()}"]
        else:
            cmd = [sys.executable, str(REPO / "tests" / "helpers" / "spawn_ranks.py"), str(nproc), str(free_port())]
        proc = run_bounded([*cmd, script, *args], timeout, env)
    if check and proc.returncode != 0:
        raise AssertionError(f"launcher exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def records(out: Path, kind: str = "train") -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(out)}
