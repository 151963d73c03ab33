"""A process that imports train.py's modules once, then starts the test session's launches as forks of itself.

    python tests/helpers/zygote.py SOCKET

It prints ``ready`` once imported and listening on the Unix socket SOCKET. A client (tests/conftest.launch) sends
one JSON line, ``{"nproc", "port", "script", "args", "env", "stdout", "stderr"}``; the zygote forks a launcher for it
that starts its own session (so the client can stop it and its ranks as one process group), replaces its environment
with ``env``, points stdout and stderr at the named files, answers ``{"pid": ...}``, runs the ranks as
tests/helpers/spawn_ranks.py does and answers ``{"returncode": ...}`` at the end. What Python reads at start-up or
import comes from the zygote's own environment, so the client keeps one zygote per such environment.

Clients call :func:`start` and :func:`ask` (tests/conftest.launch, bench/launch_cost.py); the server imports its
helpers inside its functions, so this module also imports as ``helpers.zygote`` or ``tests.helpers.zygote``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import traceback
from pathlib import Path
from typing import IO, Any


def start(sock: Path, env: dict[str, str], stderr: IO[str] | None = None) -> subprocess.Popen[str]:
    """A zygote listening on SOCK, started in the repository with ENV in its own session, once it says ``ready``."""
    cmd = [sys.executable, __file__, str(sock)]
    popen: dict[str, Any] = dict(cwd=Path(__file__).parents[2], env=env, stderr=stderr, start_new_session=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, **popen)
    if proc.stdout is None or proc.stdout.readline().strip() != "ready":
        proc.kill()
        raise RuntimeError(f"the zygote on {sock} did not start (exit {proc.wait()})")
    return proc


def ask(sock: Path, request: dict[str, Any], timeout: float | None = None) -> tuple[int, int | None]:
    """One launch: send REQUEST, return its launcher's pid and exit code (None if TIMEOUT s pass or no answer)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(str(sock))
        conn.sendall((json.dumps(request) + "\n").encode())
        answers = conn.makefile("r")
        conn.settimeout(60)
        pid = json.loads(answers.readline())["pid"]
        conn.settimeout(timeout)
        try:
            answer = answers.readline()
        except TimeoutError:
            return pid, None
        return pid, json.loads(answer)["returncode"] if answer else None


def serve(conn: socket.socket) -> None:
    """In the forked launcher: one request, its ranks, its exit code; never returns."""
    from forked import redirect_output  # the server runs as a script, beside these modules
    from spawn_ranks import run_ranks

    code = 1
    try:
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the ranks are waited for
        request = json.loads(conn.makefile("r").readline())
        os.environ.clear()
        os.environ.update(request["env"])
        redirect_output(request["stdout"], request["stderr"])
        conn.sendall((json.dumps({"pid": os.getpid()}) + "\n").encode())
        code = run_ranks(str(request["nproc"]), str(request["port"]), request["script"], request["args"])
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            conn.sendall((json.dumps({"returncode": code}) + "\n").encode())
        finally:
            os._exit(0)


def main(path: str) -> None:
    from forked import preimport

    preimport()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # launchers that finished are reaped by the kernel
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            server.close()
            serve(conn)
        conn.close()


if __name__ == "__main__":
    main(sys.argv[1])
