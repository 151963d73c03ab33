"""The referee: one long-lived process per worker slot of a :class:`~deepzero.rollout.sandbox.Sandbox`, outside every
sandbox, run as ``python -I -S referee.py`` (standard library only). It reads a settings line, then one job per line
(JSON), and writes one verdict per line (JSON).

Each job runs in a forked child of the judge: it starts the candidate (the model's code under
:mod:`deepzero.rollout.candidate`) in its own sandbox, connected by two pipes, and runs the job's *judge program*
(the benchmark's own test code: HumanEval's ``check``, LiveCodeBench's grader) here, where the candidate cannot read
or write it. The judge program reaches the candidate only through ``__remote__``, whose answers cross as plain
literals (:func:`candidate.decode`): an object whose ``__eq__`` is always true, a forged marker, ``os._exit``,
signals or a patched ``__main__`` cannot pass a test, since nothing inside the candidate decides the verdict.

A ``script`` job (``code_io``) has no judge program: the verdict is its exit, and its stdout is returned for the
caller to compare. stdout is kept up to the job's ``keep`` bytes (the rest counted, and whether it was blank);
how much a program prints never decides its verdict otherwise.
"""

import builtins
import contextlib
import ctypes
import json
import marshal
import os
import select
import shutil
import signal
import struct
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import confine  # noqa: E402 (beside this file; run as a script, this folder is not on the path)

with open(os.path.join(HERE, "candidate.py"), encoding="utf-8") as _fh:
    CANDIDATE = _fh.read()
_codec: dict = {"__name__": "deepzero_candidate"}
exec(compile(CANDIDATE, "candidate.py", "exec"), _codec)
decode, frame, MAX_FRAME = _codec["decode"], _codec["frame"], _codec["MAX_FRAME"]
STDERR_KEPT = 65536
PR_SET_CHILD_SUBREAPER = 36
_libc = ctypes.CDLL(None, use_errno=True)


class JudgeTimeout(BaseException):
    """The program's wall clock (or one test's own limit) ran out. Not an ``Exception``: test code's ``except
    Exception`` cannot swallow it (nor the two below)."""


class CandidateGone(BaseException):
    """The candidate's process ended while the judge waited on it."""


class NotAnAnswer(BaseException):
    """The candidate answered with something other than a plain value (an object of its own class, ...)."""


class RemoteError(Exception):
    """The candidate raised an exception that is not one of Python's built-in ones."""


def _alarm(*_):
    raise JudgeTimeout("wall-clock limit")


class Output:
    """One of the candidate's output pipes: the first ``keep`` bytes (stdout) or the last ``keep`` (stderr)."""

    def __init__(self, fd: int, keep: int, tail: bool = False) -> None:
        self.fd, self.keep, self.tail = fd, keep, tail
        self.data, self.cut, self.blank, self.open = bytearray(), 0, True, True

    def pump(self) -> None:
        try:
            chunk = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return
        if not chunk:
            self.open = False
            return
        if self.tail:
            self.data += chunk
            del self.data[: max(0, len(self.data) - self.keep)]
            return
        room = self.keep - len(self.data)
        self.data += chunk[:room]
        rest = chunk[room:] if room < len(chunk) else b""
        self.cut += len(rest)
        self.blank = self.blank and not rest.strip()


class Remote:
    """The judge program's handle on the candidate: requests out, plain values back."""

    def __init__(self, pid: int, requests: int, replies: int, outputs: list) -> None:
        self.pid, self.requests, self.replies, self.outputs = pid, requests, replies, outputs
        self.buffer = bytearray()

    def _wait(self, until: float | None) -> None:
        """Read whatever arrives (a reply, output) until a reply frame is whole; the deadline ``until``."""
        while True:
            if len(self.buffer) >= 4:
                (size,) = struct.unpack(">I", self.buffer[:4])
                if size > MAX_FRAME:
                    raise NotAnAnswer("its answer is over 64 MB")
                if len(self.buffer) >= 4 + size:
                    return
            fds = [self.replies] + [o.fd for o in self.outputs if o.open]
            left = None if until is None else until - time.monotonic()
            if left is not None and left <= 0:
                raise JudgeTimeout("test timeout")
            ready, _, _ = select.select(fds, [], [], left)
            for fd in ready:
                if fd == self.replies:
                    chunk = os.read(fd, 1 << 20)
                    if not chunk:
                        raise CandidateGone("ended")
                    self.buffer += chunk
                else:
                    next(o for o in self.outputs if o.fd == fd).pump()

    def request(self, message: tuple, timeout: float | None = None):
        """Send ``message``; the candidate's answer as a plain value, or its exception raised here."""
        try:
            data = frame(marshal.dumps(message, 4))
        except ValueError as err:  # the test passed something that is not a plain value
            raise TypeError(f"the judge can pass plain values only ({err})") from None
        try:
            while data:
                data = data[os.write(self.requests, data) :]
        except BrokenPipeError:
            raise CandidateGone("ended") from None
        self._wait(None if timeout is None else time.monotonic() + timeout)
        (size,) = struct.unpack(">I", self.buffer[:4])
        payload = bytes(self.buffer[4 : 4 + size])
        del self.buffer[: 4 + size]
        try:
            reply = decode(payload)
        except ValueError as err:
            raise NotAnAnswer(f"its answer is {err}") from None
        if not (isinstance(reply, tuple) and reply and reply[0] in ("ok", "raise")):
            raise NotAnAnswer("its answer is not a reply")
        if reply[0] == "ok" and len(reply) == 2:
            return reply[1]
        if reply[0] == "raise" and len(reply) == 3 and all(isinstance(x, str) for x in reply[1:]):
            raise _exception(reply[1], reply[2])
        raise NotAnAnswer("its answer is not a reply")

    def function(self, name: str):
        """The candidate's top-level function ``name`` as a callable here."""

        def call(*args, **kwargs):
            return self.request(("call", name, args, kwargs))

        call.__name__ = name
        return call

    def bind(self, namespace: dict, entry_point: str | None, names: list) -> None:
        """Bind the candidate's functions into the judge's ``namespace``: the entry point, and each name the trusted
        prompt did not define (the prompt's own helpers stay the prompt's)."""
        for name in names:
            if isinstance(name, str) and (name == entry_point or name not in namespace):
                namespace[name] = self.function(name)
        if entry_point and entry_point not in names:
            namespace[entry_point] = self.function(entry_point)

    def stdio(self, inputs: str, timeout: float | None = None):
        """What the LCB-loaded program prints when fed ``inputs`` on stdin."""
        return self.request(("stdio", inputs), timeout)

    def lcb_call(self, name: str, args: list, timeout: float | None = None):
        """LCB's call-based test: ``Solution().name(*args)`` (or the module's function)."""
        return self.request(("lcb_call", name, args), timeout)


def _exception(name: str, message: str) -> BaseException:
    """The candidate's exception as one the judge program can catch: a built-in type by its name, else RemoteError."""
    kind = getattr(builtins, name, None)
    safe = isinstance(kind, type) and issubclass(kind, Exception) and kind.__module__ == "builtins"
    if safe and name not in ("StopIteration", "StopAsyncIteration"):
        try:
            return kind(message)
        except Exception:
            pass
    return RemoteError(f"{name}: {message}")


# --- the candidate's process --------------------------------------------------------------------------------------


def _exit_verdict(code: int | None, stderr: str, oom: bool) -> tuple:
    """The (status, detail) of the candidate's exit ``code`` (None: still running, killed at the wall clock)."""
    lines = [x.strip() for x in stderr.splitlines() if x.strip()]
    last = lines[-1][:300] if lines else ""
    if code is not None and code > 128:  # bwrap's init reports a signal as 128 + its number
        code = 128 - code
    if oom:
        return "memory", "memory limit (the program's cgroup)"
    if code in (-signal.SIGXCPU, -signal.SIGKILL):
        return "timeout", "CPU limit"
    if last.startswith("MemoryError"):
        return "memory", last
    if code == 0:
        return "passed", ""
    if last.startswith("AssertionError"):
        return "failed", last
    if code is not None and code < 0:
        return "error", f"killed by {signal.Signals(-code).name}"
    return "error", last or f"exit code {code}"


def _judged(remote: Remote, job: dict) -> tuple:
    """Load the candidate, then run the job's judge program against it: (status, detail)."""
    try:
        names = remote.request(("load", job["load"], job["source"]), job.get("load_timeout"))
        if not isinstance(names, list):
            raise NotAnAnswer("its answer to the load is not a list")
        namespace = {"__name__": "__judge__", "__remote__": remote, "__candidate_names__": names}
        exec(compile(job["judge"], "judge.py", "exec"), namespace)
    except (JudgeTimeout, CandidateGone, NotAnAnswer):
        raise
    except AssertionError as err:
        return "failed", f"AssertionError: {err}" if str(err) else "AssertionError"
    except MemoryError as err:
        return "memory", f"MemoryError: {err}"
    except RemoteError as err:
        return "error", str(err)[:300]
    except BaseException as err:
        return "error", f"{type(err).__name__}: {err}"[:300]
    return "passed", ""


def run_job(settings: dict, job: dict, cgroup: dict | None) -> dict:
    """One program's verdict as plain data."""
    lim = settings["limits"]
    ooms = confine.oom_kills(cgroup)
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, lim["wall_s"])
    pid, status, detail, code = None, "error", "", None
    work = os.path.join(settings["tmp"], f"deepzero-sandbox-{os.getpid()}")
    outputs: list = []
    try:
        if settings["mode"] != "bwrap":
            os.mkdir(work, 0o700)
            if settings["uid"] is not None:
                os.chown(work, settings["uid"], settings["uid"])
        pid, req_w, rep_r, out_r, err_r = confine.spawn(settings, job, cgroup, work, settings["candidate_code"])
        outputs = [Output(out_r, job.get("keep", lim["output_bytes"])), Output(err_r, STDERR_KEPT, tail=True)]
        remote = Remote(pid, req_w, rep_r, outputs)
        try:
            if job["load"] == "script":
                remote.request(("load", "script", job["source"]))  # no reply comes: it runs to its exit
            else:
                status, detail = _judged(remote, job)
        except CandidateGone as gone:
            status, detail = "gone", str(gone)
            code = _exit_code(pid, outputs)
        except NotAnAnswer as wrong:
            status, detail = "failed", str(wrong)
    except JudgeTimeout as err:
        status, detail = "timeout", str(err)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        if pid is not None:
            confine.kill(pid, code is None)
            confine.empty_cgroup(cgroup)
            if cgroup is None:  # with one, emptying it killed whatever the program left
                confine.kill_uid(settings["uid"])
            _drain(outputs)
            if status == "gone":
                stderr = outputs[1].data.decode("utf-8", "replace")
                status, detail = _exit_verdict(code, stderr, confine.oom_kills(cgroup) > ooms)
                if status == "passed" and job["load"] != "script":
                    status, detail = "failed", "left before its tests finished"
        if settings["mode"] != "bwrap":
            shutil.rmtree(work, ignore_errors=True)
    out = outputs[0] if outputs else Output(-1, 0)
    return {
        "status": status, "detail": detail, "stdout": out.data.decode("utf-8", "replace"), "cut": out.cut,
        "tail_blank": out.blank,
    }  # fmt: skip


def _exit_code(pid: int, outputs: list) -> int:
    """The candidate's exit code, its output read meanwhile (a program blocked on a full pipe would never exit; a
    daemon it left may hold the pipes open after it); the wall clock's alarm ends the wait."""
    exited = os.pidfd_open(pid)
    try:
        while True:
            ready, _, _ = select.select([exited] + [o.fd for o in outputs if o.open], [], [])
            for fd in ready:
                if fd != exited:
                    next(o for o in outputs if o.fd == fd).pump()
            if exited in ready:
                return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    finally:
        os.close(exited)


def _drain(outputs: list) -> None:
    """What is left in the output pipes (0.5 s at most: one a leftover process holds open is not waited for)."""
    end = time.monotonic() + 0.5
    while any(o.open for o in outputs) and time.monotonic() < end:
        ready, _, _ = select.select([o.fd for o in outputs if o.open], [], [], max(0, end - time.monotonic()))
        for fd in ready:
            next(o for o in outputs if o.fd == fd).pump()
    for o in outputs:
        os.close(o.fd)


def _reap_orphans() -> None:
    """Kill and reap every process left under this judge (it is their subreaper: a daemon that left its group)."""
    while True:
        kids = []
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/children") as fh:
                    kids += [int(x) for x in fh.read().split()]
            except OSError:
                continue
        for kid in kids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(kid, signal.SIGKILL)
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def main() -> None:
    """Settings on the first line, then a job a line; a verdict a line back, in order. It ends when its stdin does
    (the caller ended: no parent-death signal, which would follow the thread that started it, not the process)."""
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    sys.set_int_max_str_digits(0)
    settings = json.loads(sys.stdin.readline())
    settings["candidate_code"] = confine.compiled(settings["python"], CANDIDATE)
    cgroup = confine.make_cgroup(settings)
    try:
        _serve(settings, cgroup)
    finally:
        confine.empty_cgroup(cgroup, remove=True)


def _serve(settings: dict, cgroup: dict | None) -> None:
    for line in sys.stdin:
        job = json.loads(line)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            try:
                result = run_job(settings, job, cgroup)
            except BaseException as err:  # the judge's own failure is a verdict, never a hang
                result = {"status": "error", "detail": f"judge: {type(err).__name__}: {err}"[:300], "stdout": ""}
            data = json.dumps(result).encode()
            while data:
                data = data[os.write(write, data) :]
            os._exit(0)
        os.close(write)
        chunks = []
        while chunk := os.read(read, 1 << 20):
            chunks.append(chunk)
        os.close(read)
        _reap_orphans()
        result = b"".join(chunks) or b'{"status": "error", "detail": "judge: died"}'
        sys.stdout.write(result.decode() + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
