"""How the referee starts a candidate and cleans up after it: the candidate's process (forked, then contained and
exec'd: bwrap or plain Python), its cgroup, its limits and uid, and killing what it leaves. Standard library only:
imported by :mod:`deepzero.rollout.referee` from its own folder."""

import contextlib
import ctypes
import os
import resource
import signal
import subprocess
import time

PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def contain(settings: dict, cgroup: dict | None) -> None:
    """In the candidate's process before exec: the cgroup, the rlimits, the slot's uid, death with the judge."""
    lim, uid = settings["limits"], settings["uid"]
    if cgroup:
        for folder in cgroup["folders"]:
            with open(os.path.join(folder, "cgroup.procs"), "w") as fh:
                fh.write(str(os.getpid()))
    for which, value in (
        (resource.RLIMIT_CPU, lim["cpu_s"]),
        (resource.RLIMIT_AS, lim["memory_mb"] << 20),
        (resource.RLIMIT_FSIZE, lim["file_mb"] << 20),
        (resource.RLIMIT_NOFILE, lim["open_files"]),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(which, (value, value))
    processes = lim["processes"]
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    else:  # the limit counts every process of the user: the ones running now come on top
        processes += user_tasks(os.getuid())
    resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def user_tasks(uid: int) -> int:
    """Threads of ``uid`` now (what ``RLIMIT_NPROC`` counts)."""
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                count += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue
    return count


def make_cgroup(settings: dict) -> dict | None:
    """This referee's cgroup, which each of its programs joins (memory and process count for all the program's
    processes together), or None without one. Made once: a process's first move into a new cgroup is slow."""
    spec = settings.get("cgroup")
    if not spec:
        return None
    lim, name = settings["limits"], f"deepzero-{os.getpid()}"
    memory, pids = os.path.join(spec["memory"], name), os.path.join(spec["pids"], name)
    folders = [memory] if memory == pids else [memory, pids]
    for folder in folders:
        os.makedirs(folder, exist_ok=True)
    v2 = spec["version"] == 2
    files = {
        memory: [("memory.max" if v2 else "memory.limit_in_bytes", str(lim["memory_mb"] << 20))],
        pids: [("pids.max", str(lim["processes"]))],
    }
    if v2:
        files[memory].append(("memory.swap.max", "0"))
    for folder, values in files.items():
        for file, value in values:
            path = os.path.join(folder, file)
            if os.path.exists(path):
                with open(path, "w") as fh:
                    fh.write(value)
    return {"folders": folders, "memory": memory, "version": spec["version"]}


def oom_kills(cgroup: dict | None) -> int:
    """How many processes the cgroup's memory limit has killed so far."""
    if not cgroup:
        return 0
    path = os.path.join(cgroup["memory"], "memory.events" if cgroup["version"] == 2 else "memory.oom_control")
    try:
        with open(path) as fh:
            return sum(int(line.split()[1]) for line in fh if line.split()[:1] == ["oom_kill"])
    except OSError:
        return 0


def empty_cgroup(cgroup: dict | None, remove: bool = False) -> None:
    """Kill whatever is left in the cgroup (``remove``: then remove it)."""
    if not cgroup:
        return
    for folder in cgroup["folders"]:
        for _ in range(1000):
            try:
                with open(os.path.join(folder, "cgroup.procs")) as fh:
                    pids = [int(x) for x in fh.read().split()]
            except OSError:
                break
            if not pids and not remove:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if remove:
                try:
                    os.rmdir(folder)
                    break
                except OSError:
                    pass
            time.sleep(0.001)


def memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, 0)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


BOOTSTRAP = "import marshal, os, sys; exec(marshal.loads(os.pread(int(sys.argv[3]), {size}, 0)))"
"""The candidate's ``-c``: the stub's code object, compiled once by the candidate's own Python, from a fresh memfd."""


def compiled(python: str, source: str) -> bytes:
    """``source`` compiled by ``python`` (the sandbox's; its bytecode is that version's), as marshal bytes."""
    compile_it = (
        "import marshal, sys; sys.stdout.buffer.write(marshal.dumps(compile(sys.stdin.read(), 'candidate.py', 'exec')))"
    )
    return subprocess.run([python, "-I", "-S", "-c", compile_it], input=source.encode(), capture_output=True,
                          check=True).stdout  # fmt: skip


def spawn(settings: dict, job: dict, cgroup: dict | None, work: str, candidate: bytes) -> tuple:
    """The candidate's process under the settings' containment (forked here, no threads to mind), with its
    request/reply pipes and output pipes: (pid, requests, replies, stdout, stderr). ``candidate``: the code object
    of :mod:`deepzero.rollout.candidate` (:func:`compiled`), handed over in a memfd of this program's own."""
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    given = memfd("stdin", job.get("stdin", "").encode())
    code = memfd("candidate", candidate)
    keep = [req_r, rep_w, code]
    boot = BOOTSTRAP.format(size=len(candidate))
    argv = [settings["python"], "-I", "-S", "-B", "-c", boot, str(req_r), str(rep_w), str(code)]
    if settings["mode"] == "bwrap":
        cmd, env, cwd = list(settings["bwrap"]), {}, "/"
        if settings.get("seccomp"):
            policy = os.open(settings["seccomp"], os.O_RDONLY)
            keep.append(policy)
            cmd += ["--seccomp", str(policy)]
        cmd += argv
    else:
        cmd, cwd = argv, work
        env = {"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work}
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            for fd, target in ((given, 0), (out_w, 1), (err_w, 2)):
                os.dup2(fd, target)
            for fd in keep:
                os.set_inheritable(fd, True)
            os.chdir(cwd)
            contain(settings, cgroup)
            os.execve(cmd[0], cmd, env)
        except BaseException as err:
            os.write(2, f"the sandbox did not start: {type(err).__name__}: {err}\n".encode())
        os._exit(127)
    for fd in (*keep, given, out_w, err_w):
        os.close(fd)
    for fd in (rep_r, out_r, err_r):
        os.set_blocking(fd, False)
    return pid, req_w, rep_r, out_r, err_r


def kill(pid: int, reap: bool) -> None:
    """SIGKILL the candidate's session (bwrap's: its PID namespace dies with it); reap it unless it was."""
    for target in (-pid, pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(target, signal.SIGKILL)
    if reap:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def kill_uid(uid: int | None) -> None:
    """Kill every process of the slot's ``uid`` (run as root: a daemon the program left, whatever its parent)."""
    if uid is None:
        return
    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(uid)
            os.setuid(uid)
            os.kill(-1, signal.SIGKILL)  # every process this uid may signal, this one excepted
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
