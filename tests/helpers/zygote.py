"""A process that imports train.py's modules once, then starts the test session's launches as forks of itself.

    python tests/helpers/zygote.py SOCKET

It prints ``ready`` once imported and listening on the Unix socket SOCKET. A client (tests/conftest.launch) sends
one JSON line, ``{"nproc", "port", "script", "args", "env", "stdout", "stderr"}``; the zygote forks a launcher for it
that starts its own session (so the client can stop it and its ranks as one process group), replaces its environment
with ``env``, points stdout and stderr at the named files, answers ``{"pid": ...}``, runs the ranks as
tests/helpers/spawn_ranks.py does and answers ``{"returncode": ...}`` at the end. What Python reads at start-up or
import comes from the zygote's own environment, so the client keeps one zygote per such environment.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import traceback

from forked import preimport, redirect_output
from spawn_ranks import run_ranks


def serve(conn: socket.socket) -> None:
    """In the forked launcher: one request, its ranks, its exit code; never returns."""
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
