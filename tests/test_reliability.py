"""Reliability with the real `deepspeed` launcher on the CPU (gloo): exact resume, atomic checkpoints, preemption,
rank death, world-size change, offline export, non-finite loss, and the security defaults (issue 5).

Signals go to the rank processes (the launcher's direct children), as SLURM and spot instances deliver them.
DeepSpeed's own launcher (deepspeed/launcher/launch.py), when it gets SIGTERM itself, terminates the rank process
trees one after the other (SIGTERM, then up to 30 s wait each, then SIGKILL) and exits 1 whatever the ranks
returned; the `deepspeed` runner in front of it installs no handler on a single node, so signalling the runner
alone leaves the job running. The rank-level behaviour is what these tests pin down.
"""

from __future__ import annotations

import ast
import contextlib
import itertools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch
from conftest import REPO, bf16_precision, cpu_env, fp16_env, free_port, launch, losses, records
from safetensors.torch import load_file

from deepzero.checkpoint import latest_tag, published_tags, tag_for
from deepzero.precision import FP16_MAX, logit_tolerance

launcher = pytest.mark.launcher
"""Tests that start the real launcher (deselect with -m "not launcher")."""

STEPS = 6
HALF = STEPS // 2
EXIT_BOUND_S = 120
"""A signalled or broken job must be gone within this many seconds (ranks start in ~30 s here; steps take ~1 s)."""
LAUNCHER_GRACE_S = 30
"""deepspeed/launcher/launch.py terminate_process_tree: SIGTERM, then SIGKILL after 30 s."""
SECRETS = {"WANDB_API_KEY": "sk-wandb-never-logged-1234", "HF_TOKEN": "hf_never_logged_5678"}


def tiny_args(data: Path, out: Path, *extra: str) -> list[str]:
    """The tiny DeepSeek-V3 preset on the test corpus: micro 2 × accumulation 2, a loss line every step."""
    return [
        "--model", "tiny-deepseek-v3", "--data", str(data), "--out", str(out),
        "--lr", "3e-3", "--warmup-steps", "4", "--micro-batch", "2", "--grad-accum", "2",
        "--log-interval", "1", "--eval-interval", "0", *extra,
    ]  # fmt: skip


ZERO3 = ["--deepspeed_config", "ds_configs/zero3.json"]
ZERO2 = ["--deepspeed_config", "ds_configs/zero2.json"]


# ------------------------------------------------------------------------------------------------ helpers


@dataclass
class Job:
    """A launcher started in its own session, so that a test can signal its ranks and clean up after itself."""

    proc: subprocess.Popen[bytes]
    log: Path

    def ranks(self) -> list[psutil.Process]:
        """The rank processes: direct children of deepspeed.launcher.launch (not their DataLoader workers)."""
        tree = psutil.Process(self.proc.pid).children(recursive=True)
        launchers = [p for p in tree if "deepspeed.launcher.launch" in " ".join(_cmdline(p))]
        return [p for p in tree if launchers and p.ppid() == launchers[0].pid and "train.py" in _cmdline(p)]

    def wait(self, timeout: float) -> tuple[int, float]:
        """Exit code and seconds waited; kills the whole session if it overruns."""
        start = time.monotonic()
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"job still running after {timeout} s\n{self.text()[-3000:]}") from None
        return rc, time.monotonic() - start

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def start(args: list[str], log: Path, nproc: int = 2, env: dict[str, str] | None = None) -> Job:
    """`deepspeed --num_gpus=N train.py ARGS` in the background; stdout and stderr go to ``log``."""
    deepspeed = Path(sys.executable).parent / "deepspeed"
    cmd = [str(deepspeed), f"--num_gpus={nproc}", f"--master_port={free_port()}", "train.py", *args]
    with log.open("wb") as f:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env or cpu_env(), stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
    return Job(proc, log)


def holding_save(env: dict[str, str], step: int, marker: Path) -> dict[str, str]:
    """``env`` that also holds rank 0 mid-save at ``step`` (tests/hold_save; a fake CPU in ``env`` stays), touching
    ``marker`` then."""
    path = os.pathsep.join(filter(None, [str(REPO / "tests" / "hold_save"), str(REPO), env.get("PYTHONPATH")]))
    return {**env, "PYTHONPATH": path, "DEEPZERO_HOLD_SAVE": f"{step}:{marker}"}


def logged_step(out: Path) -> int:
    """The last step in metrics.jsonl (0 before the first line; a half-written last line is skipped)."""
    path = out / "metrics.jsonl"
    step = 0
    if path.is_file():
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                step = max(step, json.loads(line).get("step", 0))
    return step


def wait_until(job: Job, ready: Callable[[], bool], what: str, timeout: float = 300, poll: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if job.proc.poll() is not None:
            raise AssertionError(f"job exited ({job.proc.returncode}) before {what}\n{job.text()[-3000:]}")
        if time.monotonic() > deadline:
            job.kill()
            raise AssertionError(f"no {what} after {timeout} s\n{job.text()[-3000:]}")
        time.sleep(poll)


@pytest.fixture
def cleanup() -> Iterator[list[Job]]:
    jobs: list[Job] = []
    yield jobs
    for job in jobs:
        job.kill()


def zero_files(tag_dir: Path, world: int, stage: int) -> set[str]:
    """The files a complete checkpoint of ``world`` ranks holds (DeepSpeed's names plus our RNG files). DeepSpeed
    prefixes the optimizer files with bf16_ in a bf16 run: here the ZeRO-3 preset, where the CPU has native bf16."""
    names = {f"rng_rank{r:03d}.pt" for r in range(world)}
    prefix = "bf16_" if stage == 3 and bf16_precision() == "bf16" else ""
    names |= {f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world)}
    if stage == 3:
        names |= {f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)}
    else:
        names.add("mp_rank_00_model_states.pt")
    return names


def assert_complete(tag_dir: Path, world: int, stage: int) -> None:
    missing = zero_files(tag_dir, world, stage) - {p.name for p in tag_dir.iterdir()}
    assert not missing, f"{tag_dir} lacks {sorted(missing)}"


def error_lines(stderr: str) -> list[str]:
    """Rank 0's `error:` lines. Ranks share the launcher's stderr unbuffered, so another rank's "[rank N] error: ..."
    can land inside rank 0's line: break before every rank prefix and every unprefixed `error: `."""
    text = re.sub(r"(?=\[rank \d+\] )|(?<!\] )(?=error: )", "\n", stderr)
    return [line for line in text.splitlines() if line.startswith("error: ")]


def export_cli(ckpt: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "deepzero.export", str(ckpt), "--out", str(out), *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def assert_same_model(master: Path, trained: Path) -> None:
    """``master`` (fp32 master weights) rounded to the trainer's dtype is bit-equal to ``trained`` (what the export
    guarantees), and their logits (both computed in fp32) agree within a few units of that dtype's precision at the
    logit scale wherever the MoE routing agrees.

    Why only there: the trainer's own export holds each fp32 master weight rounded to bf16/fp16 (relative error at
    most eps/2 per weight); those roundings perturb the logits by about the same relative amount, but a top-k routing
    choice on a near-tie can flip, and then a token's logits move by order 0.1 (0.0996 against 0.0195 allowed on an
    AVX512-FP16 Xeon, fp16). A flip at a token also reaches the later tokens of its row through attention, so each
    row is compared up to its first token whose experts differ in any layer, and at least a quarter of all tokens
    must be compared. ``logit_tolerance`` allows 4 units on the median token and 16 on the worst. Wrong or shuffled
    weights move the logits by order 1. An fp32 run exports its masters unrounded: equal.
    """
    from transformers import AutoModelForCausalLM

    a, b = load_file(master / "model.safetensors"), load_file(trained / "model.safetensors")
    assert a.keys() == b.keys()
    assert {v.dtype for v in a.values()} == {torch.float32}
    for name in a:
        assert torch.equal(a[name].to(b[name].dtype), b[name]), name
    low = next((v.dtype for v in b.values() if v.dtype != torch.float32), torch.float32)
    ids = torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(0))
    (la, ra), (lb, rb) = (
        logits_and_routing(AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval(), ids)
        for d in (master, trained)
    )
    gap = (la - lb).abs()
    if low == torch.float32:
        assert gap.max().item() == 0
        return
    agreed = (ra == rb).all(-1).all(0).int().cumprod(-1).bool()  # [rows, seq]: before the row's first flip
    assert agreed.float().mean() >= 0.25, f"routing agrees on {agreed.float().mean():.2f} of the tokens"
    compared = gap.amax(-1)[agreed]
    typical, worst = compared.median().item(), compared.max().item()
    assert 0 < typical <= logit_tolerance(low, lb), f"median-token |Δlogit| {typical:.5f} ({low})"
    assert worst <= logit_tolerance(low, lb, ulps=16), f"max |Δlogit| {worst:.5f} ({low}, routing agreed)"


def logits_and_routing(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of ``ids`` ``[rows, seq]`` and each router's sorted top-k experts ``[layers, rows, seq, k]`` (a
    dense model: ``[0, rows, seq, 0]``)."""
    from deepzero.moe_balance import find_routers

    picks: list[torch.Tensor] = []
    hooks = [
        router.register_forward_hook(lambda _m, _a, out: picks.append(out[-1].sort(-1).values))
        for router in find_routers(model)
    ]
    try:
        with torch.no_grad():
            logits = model(input_ids=ids).logits
    finally:
        for hook in hooks:
            hook.remove()
    rows, seq = ids.shape
    routing = torch.stack([p.reshape(rows, seq, -1) for p in picks]) if picks else torch.zeros(0, rows, seq, 0)
    return logits, routing


# ----------------------------------------------------------------------- 1 + 3: ZeRO-3 bf16, preempt, resume


@pytest.fixture(scope="module")
def zero3_full(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """ZeRO-3 bf16 on 3 ranks for STEPS steps, uninterrupted (checkpoints at HALF and STEPS, HF export).

    Secrets sit in the environment to prove they stay out of logs and the saved run config (item 8).
    """
    out = tmp_path_factory.mktemp("zero3") / "run"
    env = {**cpu_env(), **SECRETS, "DEEPZERO_ROW_TRACE": str(out.parent / "rows")}
    proc = launch(
        [*ZERO3, *tiny_args(tiny_data, out, "--max-steps", str(STEPS), "--save-interval", str(HALF))], env=env
    )
    return out, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def zero3_preempted(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, float, str]:
    """The same run, stopped by SIGTERM to every rank once step 2 is logged: (out, exit code, seconds, log)."""
    root = tmp_path_factory.mktemp("preempt")
    out = root / "run"
    args = [*ZERO3, *tiny_args(tiny_data, out, "--max-steps", str(STEPS), "--save-interval", "0", "--no-export")]
    job = start(args, root / "launcher.log", nproc=3)
    try:
        wait_until(job, lambda: logged_step(out) >= 2, "step 2")
        ranks = job.ranks()
        assert len(ranks) == 3, [_cmdline(p) for p in ranks]
        signalled = time.monotonic()
        for rank in ranks:
            rank.send_signal(signal.SIGTERM)
        wait_until(job, lambda: latest_tag(out / "checkpoints") is not None, "a committed checkpoint", EXIT_BOUND_S)
        committed = time.monotonic() - signalled
        rc, seconds = job.wait(EXIT_BOUND_S)
    finally:
        job.kill()
    print(f"SIGTERM → committed checkpoint: {committed:.2f} s; → exit: {seconds + committed:.2f} s")
    return out, rc, committed, job.text()


@launcher
def test_sigterm_makes_every_rank_save_and_exit_zero(zero3_preempted: tuple[Path, int, float, str]) -> None:
    """Within the launcher's grace (deepspeed/launcher/launch.py waits 30 s before SIGKILL) by a wide margin."""
    out, rc, seconds, log = zero3_preempted
    assert seconds < LAUNCHER_GRACE_S / 2, f"SIGTERM → committed checkpoint took {seconds:.1f} s"
    assert rc == 0, log[-3000:]
    assert seconds < EXIT_BOUND_S
    match = re.search(r"^preempted: SIGTERM at step (\d+): checkpoint saved; continue with --resume$", log, re.M)
    assert match, log[-3000:]
    step = int(match.group(1))
    assert 2 <= step < STEPS, f"signalled at step 2 but stopped at {step}"
    ckpt = out / "checkpoints"
    assert latest_tag(ckpt) == tag_for(step) and published_tags(ckpt) == [tag_for(step)]
    assert_complete(ckpt / tag_for(step), world=3, stage=3)
    assert not list(ckpt.glob("*.partial"))
    assert log.count("exits successfully") == 3  # the launcher saw every rank return 0


@pytest.fixture(scope="module")
def zero3_resumed(zero3_preempted: tuple[Path, int, float, str], tiny_data: Path) -> tuple[Path, str]:
    out = zero3_preempted[0]
    args = [*ZERO3, *tiny_args(tiny_data, out, "--max-steps", str(STEPS), "--save-interval", "0", "--no-export")]
    proc = launch([*args, "--resume"])
    return out, proc.stdout + proc.stderr


@launcher
def test_zero3_bf16_resume_after_preemption_continues_the_uninterrupted_curve(
    zero3_full: tuple[Path, str], zero3_resumed: tuple[Path, str]
) -> None:
    """Same data order, RNG and lr schedule: every resumed step equals the uninterrupted run's step."""
    full, _ = zero3_full
    out, log = zero3_resumed
    stopped = int(re.search(r"resumed from step (\d+)", log).group(1))
    reference = {r["step"]: r for r in records(full)}
    resumed = {r["step"]: r for r in records(out) if r["step"] > stopped}
    assert sorted(resumed) == list(range(stopped + 1, STEPS + 1))
    for step, record in resumed.items():
        assert record["loss"] == pytest.approx(reference[step]["loss"], rel=1e-5, abs=1e-5), step
        assert record["lr"] == pytest.approx(reference[step]["lr"], rel=1e-9), step
        assert record["tokens_seen"] == reference[step]["tokens_seen"], step
    assert latest_tag(out / "checkpoints") == tag_for(STEPS)


@launcher
def test_sigterm_to_the_whole_process_group_still_saves(tiny_data: Path, tmp_path: Path, cleanup: list[Job]) -> None:
    """One rank started directly (as srun or torchrun start ranks); SIGTERM reaches its DataLoader worker too."""
    out = tmp_path / "run"
    cmd = [sys.executable, "train.py", *ZERO2, *tiny_args(tiny_data, out, "--max-steps", "40", "--save-interval", "0")]
    log = tmp_path / "train.log"
    with log.open("wb") as f:
        proc = subprocess.Popen(
            [*cmd, "--no-export"],
            cwd=REPO,
            env=cpu_env(MASTER_PORT=str(free_port())),
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    job = Job(proc, log)
    cleanup.append(job)
    wait_until(job, lambda: logged_step(out) >= 2, "step 2")
    os.killpg(proc.pid, signal.SIGTERM)
    rc, _ = job.wait(EXIT_BOUND_S)
    assert rc == 0 and "preempted: SIGTERM" in job.text(), job.text()[-2000:]
    assert latest_tag(out / "checkpoints") is not None


# --------------------------------------------------------------------- 5: world-size change and HF export


@pytest.fixture(scope="module")
def universal_resume(
    zero3_full: tuple[Path, str], tiny_data: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, str]:
    """Step HALF of the 3-rank run, converted to a universal checkpoint and loaded on 2 ranks (no further steps)."""
    from deepzero import universal

    full, _ = zero3_full
    out = tmp_path_factory.mktemp("universal") / "run"
    rc = universal.main(
        [str(full / "checkpoints"), "--tag", tag_for(HALF), "--out", str(out / "checkpoints"), "--workers", "1"]
    )
    assert rc == 0
    args = tiny_args(tiny_data, out)
    args += [
        "--max-steps",
        str(HALF),
        "--save-interval",
        str(HALF),
        "--resume",  # train.py turns load_universal on because 'latest' names a universal checkpoint
    ]
    proc = launch([*ZERO3, *args], nproc=2)
    return out, proc.stdout + proc.stderr


@launcher
def test_checkpoint_from_three_ranks_resumes_on_two_with_the_same_parameters(
    zero3_full: tuple[Path, str], universal_resume: tuple[Path, str], tmp_path: Path
) -> None:
    from deepzero.export import export_checkpoint

    full, _ = zero3_full
    out, log = universal_resume
    assert "world 2 on cpu" in log and f"resumed from step {HALF}" in log
    ckpt = out / "checkpoints"
    assert latest_tag(ckpt) == tag_for(HALF) and (ckpt / tag_for(HALF) / "zero").is_dir()
    assert (full / "checkpoints" / tag_for(HALF)).is_dir(), "the source checkpoint must stay"
    master, _ = export_checkpoint(full / "checkpoints", tmp_path / "master", tag=tag_for(HALF))
    a, b = load_file(master / "model.safetensors"), load_file(out / "hf" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:  # the bf16 weights DeepSpeed rebuilt on 2 ranks are the 3-rank fp32 masters, rounded
        assert torch.equal(a[name].to(b[name].dtype), b[name]), name
    assert records(out, "export")[-1]["ok"]


AFTER = 4
"""Optimizer steps the 2-rank run trains after the world-size change."""


@pytest.fixture(scope="module")
def universal_trained(
    zero3_full: tuple[Path, str], tiny_data: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    """Step HALF of the 3-rank run, converted, resumed on 2 ranks with micro 3 (the same global batch of 12) and
    trained AFTER more steps, with the row trace on: (run folder, trace folder)."""
    from deepzero import universal

    out = tmp_path_factory.mktemp("universal_trained") / "run"
    rc = universal.main(
        [
            str(zero3_full[0] / "checkpoints"),
            "--tag",
            tag_for(HALF),
            "--out",
            str(out / "checkpoints"),
            "--workers",
            "1",
        ]
    )
    assert rc == 0
    rows = out.parent / "rows"
    args = tiny_args(
        tiny_data, out, "--micro-batch", "3", "--max-steps", str(HALF + AFTER), "--save-interval", str(HALF)
    )
    launch([*ZERO3, *args, "--no-export", "--resume"], nproc=2, env=cpu_env(DEEPZERO_ROW_TRACE=str(rows)))
    return out, rows


def trained_rows(trace: Path, steps: range) -> dict[int, list[int]]:
    """Step (0-based) → every row id the ranks trained on in it, from the ``rows.rank<r>.jsonl`` trace files (the
    loader draws ahead, so steps past ``steps`` are dropped)."""
    by_step: dict[int, list[int]] = {s: [] for s in steps}
    for path in sorted(trace.glob("rows.rank*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record["step"] in by_step:
                by_step[record["step"]] += record["rows"]
    return by_step


@launcher
def test_three_to_two_ranks_trains_on_every_row_exactly_once_and_continues_the_loss(
    zero3_full: tuple[Path, str], universal_trained: tuple[Path, Path], tiny_data: Path
) -> None:
    """Issue 17: after the change the 2-rank run trains AFTER steps; the global batches before (3 ranks) and after
    (2 ranks) are the uninterrupted order's, no row twice, none skipped; the loss follows the 3-rank run."""
    from deepzero.data import GlobalBatchSampler, PackedDataset

    full, _ = zero3_full
    out, trace = universal_trained
    before = trained_rows(full.parent / "rows", range(HALF))
    after = trained_rows(trace, range(HALF, HALF + AFTER))
    reference = trained_rows(full.parent / "rows", range(STEPS))
    order = GlobalBatchSampler(len(PackedDataset(tiny_data, "train")), 2, 2, 0, 3, seed=0)
    for step, rows in {**before, **after}.items():
        assert len(rows) == 12 and sorted(rows) == sorted(order.global_batch_indices(step)), step
        if step < STEPS:
            assert sorted(rows) == sorted(reference[step]), f"step {step + 1} differs from the uninterrupted run"
    seen = [r for rows in (*before.values(), *after.values()) for r in rows]
    assert len(seen) == len(set(seen)) == (HALF + AFTER) * 12, "a row was trained twice or skipped"
    curve, ref = losses(out), losses(full)
    assert sorted(curve) == list(range(HALF + 1, HALF + AFTER + 1))
    for step in range(HALF + 1, STEPS + 1):  # same weights, same rows: only the reduction order differs
        assert curve[step] == pytest.approx(ref[step], rel=5e-3), (step, curve[step], ref[step])
    assert math.isfinite(curve[HALF + AFTER]) and curve[HALF + AFTER] < curve[HALF + 1] * 1.05
    assert latest_tag(out / "checkpoints") == tag_for(HALF + AFTER)
    # The universal load restores buffers too: V3's routing bias continues (reset, it would lag by HALF updates).
    biases = [routing_bias(run / "checkpoints" / tag_for(STEPS)) for run in (out, full)]
    assert biases[0].keys() == biases[1].keys() and biases[0]
    gap = torch.cat([(biases[0][k] - biases[1][k]).abs().flatten() for k in biases[0]]).mean().item()
    assert gap < 0.5e-3, f"routing bias differs from the uninterrupted run by {gap:.2e} on average (γ = 1e-3)"


def routing_bias(tag_dir: Path) -> dict[str, torch.Tensor]:
    path = sorted(tag_dir.glob("*model_states.pt"))[0]  # ZeRO-3: zero_pp_rank_0_mp_rank_00_model_states.pt
    states = torch.load(path, map_location="cpu", weights_only=False)["module"]
    return {k: v.float() for k, v in states.items() if k.endswith("e_score_correction_bias")}


@launcher
def test_disk_full_during_a_save_ends_every_rank_with_one_line(
    tiny_data: Path, tmp_path: Path, cleanup: list[Job]
) -> None:
    """The run folder on a 36 MB tmpfs: step 1's checkpoint (about 23 MB, fp32 ZeRO-2 on 2 ranks) fits, step 2's
    does not. Every rank ends with one error line naming the last good checkpoint; the .partial is gone."""
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root (the write failure is injected in test_fuzz.py)")
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=36m", "tmpfs", str(mount)], capture_output=True)
    if made.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    try:
        out = mount / "run"
        args = tiny_args(tiny_data, out, "--max-steps", "3", "--save-interval", "1", "--no-export")
        proc = launch([*ZERO2, *args, "--ds", "fp16.enabled=false"], nproc=2, check=False)
        ckpt = out / "checkpoints"
        (tmp_path / "stderr.txt").write_text(proc.stderr)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr
        lines = error_lines(proc.stderr)
        assert len(lines) == 1 and re.fullmatch(
            rf"error: {ckpt}/step00000002: saving the checkpoint failed \(No space left on device[^;]*\); removed the"
            rf" partial folder, the last good checkpoint is {ckpt}/step00000001\. Fix: free"
            rf" space under {ckpt} \(or lower --keep-last\), then --resume",
            lines[0],
        ), lines
        assert "[rank 1] error: " in proc.stderr
        assert latest_tag(ckpt) == "step00000001" and published_tags(ckpt) == ["step00000001"]
        assert not list(ckpt.glob("*.partial"))
        assert_complete(ckpt / "step00000001", world=2, stage=2)
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@launcher
def test_converting_in_place_keeps_the_source_and_flags_the_next_resume(
    zero3_full: tuple[Path, str], tmp_path: Path
) -> None:
    """Without --out the universal folder sits next to its source as '<tag>.universal' and 'latest' names it;
    configure_resume turns load_universal on for exactly that checkpoint."""
    from deepzero import universal
    from deepzero.errors import UserError
    from deepzero.export import export_checkpoint

    ckpt = tmp_path / "checkpoints"
    shutil.copytree(zero3_full[0] / "checkpoints", ckpt)
    ds: dict = {}
    assert universal.configure_resume(ds, ckpt) is False and ds == {"checkpoint": {"load_universal": False}}
    made = universal.convert(ckpt, workers=1)
    assert made == ckpt / f"{tag_for(STEPS)}.universal" and latest_tag(ckpt) == made.name
    assert_complete(ckpt / tag_for(STEPS), world=3, stage=3)
    assert universal.configure_resume(ds, ckpt) is True and ds["checkpoint"]["load_universal"] is True
    with pytest.raises(UserError, match="is already a universal checkpoint"):
        universal.convert(ckpt)
    with pytest.raises(UserError, match="is a universal checkpoint"):
        export_checkpoint(ckpt, tmp_path / "hf")
    assert not list(ckpt.glob("*.partial"))


def test_data_position_continues_from_samples_seen_after_a_world_size_change() -> None:
    """3 ranks × 4 steps (global 12) then 2 ranks (global 8): the new run reads on from row 48 of the same order."""
    from deepzero.data import GlobalBatchSampler
    from deepzero.universal import data_start_step

    old = GlobalBatchSampler(500, 2, 2, 0, 3, seed=0)
    new = GlobalBatchSampler(500, 2, 2, 0, 2, seed=0)
    order = old.permutation(0).tolist()
    seen = 4 * old.global_batch
    start = data_start_step(seen, new.global_batch)
    assert new.global_batch_indices(start) == order[seen : seen + new.global_batch]
    assert new.global_batch_indices(start + 1) == order[seen + 8 : seen + 16]
    assert data_start_step(7 * 12, 12) == 7  # unchanged world: the optimizer step itself
    assert 60 - data_start_step(60, 8) * 8 == 4  # 60 is no multiple of 8: 4 rows are read twice, none skipped


@launcher
def test_export_cli_turns_a_zero3_checkpoint_into_safetensors_matching_the_trainer_export(
    zero3_full: tuple[Path, str], tmp_path: Path
) -> None:
    full, _ = zero3_full
    proc = export_cli(full, tmp_path / "hf")
    assert proc.stdout.startswith("export: 63 tensors (fp32)")
    assert not list((tmp_path / "hf").glob("*.bin"))
    assert_same_model(tmp_path / "hf", full / "hf")


# ---------------------------------------------------------------------- 2: SIGKILL mid-save, keep-last-K


@pytest.fixture(scope="module")
def killed_mid_save(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, float, str]:
    """ZeRO-2 in fp16 on every CPU (its own fp16 or one faked to have it: ``fp16_env``, so the export tests below
    meet fp16's rounding everywhere), a checkpoint every step (keep 2), rank 0 SIGKILLed in the middle of step 3's
    save: tests/hold_save holds it there, with DeepSpeed's files written and its own last file not."""
    root = tmp_path_factory.mktemp("sigkill")
    out = root / "run"
    held = root / "held"
    args = tiny_args(tiny_data, out, "--max-steps", "60", "--save-interval", "1", "--keep-last", "2", "--no-export")
    job = start([*ZERO2, *args], root / "launcher.log", nproc=2, env=holding_save(fp16_env(), 3, held))
    try:
        wait_until(job, held.exists, "rank 0 held mid-save")
        ranks = sorted(job.ranks(), key=lambda p: [a for a in _cmdline(p) if a.startswith("--local_rank")])
        ranks[0].send_signal(signal.SIGKILL)
        rc, seconds = job.wait(EXIT_BOUND_S)
    finally:
        job.kill()
    return out, rc, seconds, job.text()


@launcher
def test_sigkill_mid_save_leaves_the_previous_checkpoint_published(
    killed_mid_save: tuple[Path, int, float, str],
) -> None:
    out, rc, seconds, log = killed_mid_save
    assert rc != 0 and seconds < EXIT_BOUND_S, log[-3000:]
    ckpt = out / "checkpoints"
    stale = [p.name for p in ckpt.glob("*.partial")]
    assert len(stale) == 1, f"the kill should land mid-save: {stale}"
    latest = latest_tag(ckpt)
    assert latest is not None and latest < stale[0].removesuffix(".partial")
    assert_complete(ckpt / latest, world=2, stage=2)


@launcher
def test_only_the_last_k_checkpoints_are_kept(killed_mid_save: tuple[Path, int, float, str]) -> None:
    out = killed_mid_save[0]
    ckpt = out / "checkpoints"
    tags = published_tags(ckpt)
    latest = latest_tag(ckpt)
    assert len(tags) == 2 and tags[-1] == latest, tags
    assert int(tags[0][4:]) == int(latest[4:]) - 1


@pytest.fixture(scope="module")
def resumed_after_kill(killed_mid_save: tuple[Path, int, float, str], tiny_data: Path) -> tuple[Path, int, str]:
    """Resume the killed run for 2 more steps, with the HF export. A marker file is left in the stale
    ``.partial`` folder first: a later save of the same step must not publish what a dead run left there."""
    out = killed_mid_save[0]
    ckpt = out / "checkpoints"
    stopped = int(latest_tag(ckpt)[4:])
    for stale in ckpt.glob("*.partial"):
        (stale / "left_by_the_killed_run.pt").write_bytes(b"stale")
    args = tiny_args(tiny_data, out, "--max-steps", str(stopped + 2), "--save-interval", "1", "--keep-last", "2")
    proc = launch([*ZERO2, *args, "--resume"], nproc=2, env=fp16_env())
    return out, stopped, proc.stdout + proc.stderr


@launcher
def test_resume_after_sigkill_loads_the_published_checkpoint(resumed_after_kill: tuple[Path, int, str]) -> None:
    out, stopped, log = resumed_after_kill
    assert f"resumed from step {stopped}" in log
    log_lines = records(out)
    before, after = log_lines[:-2], log_lines[-2:]
    assert [r["step"] for r in after] == [stopped + 1, stopped + 2]
    killed = {r["step"]: r["loss"] for r in before}
    # the killed run logged the step whose save it did not finish; redone from the checkpoint, it is the same
    assert after[0]["loss"] == pytest.approx(killed[stopped + 1], rel=1e-5)
    ckpt = out / "checkpoints"
    assert published_tags(ckpt) == [tag_for(stopped + 1), tag_for(stopped + 2)]
    assert not list(ckpt.glob("*.partial"))
    assert records(out, "export")[-1]["ok"]


@launcher
def test_a_stale_partial_folder_is_not_published(resumed_after_kill: tuple[Path, int, str]) -> None:
    out, stopped, _ = resumed_after_kill
    assert not (out / "checkpoints" / tag_for(stopped + 1) / "left_by_the_killed_run.pt").exists()


@launcher
def test_export_cli_turns_a_zero2_checkpoint_into_safetensors_matching_the_trainer_export(
    resumed_after_kill: tuple[Path, int, str], tmp_path: Path
) -> None:
    out, stopped, _ = resumed_after_kill
    export_cli(out / "checkpoints", tmp_path / "hf", "--tag", tag_for(stopped + 2))
    assert_same_model(tmp_path / "hf", out / "hf")


# ------------------------------------------------------------------------------------- 2: fp16 overflows

FP16_TO_INF = FP16_MAX + 16
"""The smallest value fp16 rounds to inf: 65504 plus half its last step (32)."""
FP16_STEPS = 10
FP16_TOKENS_PER_RANK = 1 * 1 * 64
"""Micro-batch 1 × accumulation 1 × 64-token rows: at most this many targets per rank and step."""


def certain_overflow_power(tokens_per_rank: int) -> int:
    """The loss-scale power at which the first fp16 step overflows whatever the weights are.

    Each micro-batch's loss is its summed cross-entropy × accumulation × data-parallel size / N (N: the step's global
    target count, ``loss_normalizer``), and DeepSpeed's backward multiplies it by scale / accumulation. A target's
    logit then gets the gradient scale · (p_target − 1) / (N / dp), where N / dp ≤ ``tokens_per_rank``. Both losses
    (the tiled one and Transformers') compute it in fp32 and cast it to the model's fp16, so with p_target ≤ 1/2
    (at init p_target ≈ 1/vocab) it is inf once scale ≥ 2 · 65520 · tokens_per_rank."""
    return math.ceil(math.log2(2 * FP16_TO_INF * tokens_per_rank))


@pytest.fixture(scope="module")
def fp16_overflows(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """ZeRO-2 in fp16 on 2 ranks (this CPU's own fp16, or one faked to have it: ``fp16_env``), the loss scale
    starting at the certain-overflow power without hysteresis: every overflow halves it."""
    out = tmp_path_factory.mktemp("fp16") / "run"
    args = tiny_args(tiny_data, out, "--max-steps", str(FP16_STEPS), "--save-interval", "0", "--no-export")
    args += ["--micro-batch", "1", "--grad-accum", "1"]  # last wins: FP16_TOKENS_PER_RANK
    power = certain_overflow_power(FP16_TOKENS_PER_RANK)
    args += ["--ds", f"fp16.initial_scale_power={power}", "fp16.hysteresis=1"]
    proc = launch([*ZERO2, *args], nproc=2, env=fp16_env())
    return out, proc.stdout + proc.stderr


@launcher
def test_fp16_overflow_steps_are_counted_and_logged(fp16_overflows: tuple[Path, str]) -> None:
    """Step 1 overflows for certain (``certain_overflow_power``) and is skipped; each skipped step halves the scale
    and counts once, a step that does not overflow keeps it. Some step is taken: even if all before it overflowed,
    the last runs at 2^14, below where this model's natural gradients overflow (measured, fp16 faked on an EPYC:
    2^23 to 2^18 overflowed, 2^17 trained).
    The loss stays finite: an overflow skips the update."""
    out, log = fp16_overflows
    power = certain_overflow_power(FP16_TOKENS_PER_RANK)
    assert power == 23  # 2 · 65520 · 64 = 2^22.9996
    assert re.search(r"^precision: fp16 \(fp16 asked by ds_configs/zero2\.json; .* has native fp16\)$", log, re.M), log
    assert json.loads((out / "run_config.json").read_text())["precision"]["dtype"] == "fp16"
    log_lines = records(out)
    assert [r["step"] for r in log_lines] == list(range(1, FP16_STEPS + 1))
    skipped, scales = [r["skipped_steps"] for r in log_lines], [r["loss_scale"] for r in log_lines]
    assert skipped[0] == 1 and scales[0] == 2 ** (power - 1), (skipped, scales)
    for before, after in itertools.pairwise(log_lines):
        change = (after["skipped_steps"] - before["skipped_steps"], after["loss_scale"] / before["loss_scale"])
        assert change in ((1, 0.5), (0, 1.0)), (skipped, scales)
    assert skipped[-1] < FP16_STEPS, (skipped, scales)
    assert all(math.isfinite(r["loss"]) for r in log_lines)


# ----------------------------------------------------------------------------------- 4: one rank dies


@launcher
def test_one_rank_killed_mid_step_ends_the_whole_job_nonzero(tiny_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = tiny_args(tiny_data, out, "--max-steps", "200", "--save-interval", "0", "--no-export")
    job = start([*ZERO2, *args], tmp_path / "launcher.log", nproc=2)
    try:
        wait_until(job, lambda: logged_step(out) >= 2, "step 2")
        ranks = job.ranks()
        assert len(ranks) == 2
        ranks[1].send_signal(signal.SIGKILL)
        rc, seconds = job.wait(EXIT_BOUND_S)
        time.sleep(1)
        survivors = [p for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        job.kill()
    assert rc != 0 and seconds < EXIT_BOUND_S, job.text()[-3000:]
    assert not survivors, "ranks outlived the launcher"
    assert logged_step(out) < 200


# ------------------------------------------------------------------------------- 6: non-finite loss


@pytest.fixture(scope="module")
def nan_run(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """fp32 ZeRO-2 with a learning rate of 1e39 (a stand-in for a diverged run): beyond fp32's range, so once the
    warm-up is over an update makes the weights infinite and the loss is NaN from then on (DeepSpeed then skips the
    updates, whose gradients are not finite).

    A checkpoint every step and ``--max-nonfinite-steps 2``.
    """
    out = tmp_path_factory.mktemp("nan") / "run"
    args = tiny_args(tiny_data, out, "--max-steps", "12", "--save-interval", "1", "--no-export")
    args[args.index("3e-3")] = "1e39"
    args += ["--warmup-steps", "1", "--max-nonfinite-steps", "2", "--ds", "fp16.enabled=false"]
    return out, launch([*ZERO2, *args], nproc=2, check=False)


@launcher
def test_nan_loss_for_k_steps_stops_with_one_clear_line_naming_the_last_good_checkpoint(
    nan_run: tuple[Path, subprocess.CompletedProcess],
) -> None:
    out, proc = nan_run
    assert proc.returncode == 2, proc.stderr[-3000:]
    curve = losses(out)
    first_bad = min(s for s, loss in curve.items() if not math.isfinite(loss))
    assert max(curve) == first_bad + 1  # stopped at the 2nd non-finite step in a row
    latest = latest_tag(out / "checkpoints")
    assert error_lines(proc.stderr) == [
        f"error: step {first_bad + 1}: loss was NaN/inf for 2 steps in a row; stopped without saving "
        f"(latest checkpoint: {latest}). Fix: lower --lr or raise --warmup-steps, try bf16 "
        "(ds_configs/zero2_bf16.json), check the data; then --resume"
    ], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert int(latest[4:]) < first_bad and math.isfinite(curve[int(latest[4:])])
    assert all(int(t[4:]) < first_bad for t in published_tags(out / "checkpoints"))


@launcher
def test_the_checkpoint_kept_after_nan_holds_finite_weights(nan_run: tuple[Path, subprocess.CompletedProcess]) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    out, _ = nan_run
    state = get_fp32_state_dict_from_zero_checkpoint(str(out / "checkpoints"))
    bad = [name for name, tensor in state.items() if not torch.isfinite(tensor).all()]
    assert not bad, f"{len(bad)} of {len(state)} tensors hold NaN/inf, e.g. {bad[:3]}"


@launcher
def test_a_run_that_ends_with_broken_weights_neither_saves_nor_exports_them(tiny_data: Path, tmp_path: Path) -> None:
    """The 1e39 learning rate again, but the run ends (3 steps) before --max-nonfinite-steps (5) is reached: the
    final save and the HF export must refuse the broken weights with one line and keep the last good checkpoint."""
    out = tmp_path / "run"
    args = tiny_args(tiny_data, out, "--max-steps", "3", "--save-interval", "1")
    args[args.index("3e-3")] = "1e39"
    args += ["--warmup-steps", "1", "--max-nonfinite-steps", "5", "--ds", "fp16.enabled=false"]
    proc = launch([*ZERO2, *args], nproc=2, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    latest = latest_tag(out / "checkpoints")
    assert latest is not None and int(latest[4:]) < 3
    assert error_lines(proc.stderr) == [
        f"error: step 3: the final weights hold NaN/inf; not saved or exported (latest checkpoint: {latest}). "
        "Fix: lower --lr or raise --warmup-steps, try bf16 (ds_configs/zero2_bf16.json); then --resume"
    ], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not (out / "hf").exists()


# ------------------------------------------------------------------------------------------ 8: security


@launcher
def test_secrets_stay_out_of_logs_and_the_saved_run_config(zero3_full: tuple[Path, str]) -> None:
    out, log = zero3_full
    saved = json.loads((out / "run_config.json").read_text())
    assert saved["env"]["WANDB_API_KEY"] == "***" and saved["env"]["HF_TOKEN"] == "***"  # seen, then redacted
    files = [p for p in out.rglob("*") if p.is_file() and p.suffix in (".json", ".jsonl", ".txt", ".log", "")]
    everything = log + "".join(p.read_text(errors="replace") for p in files)
    for secret in SECRETS.values():
        assert secret not in everything


def test_remote_code_is_not_run_unless_asked(tmp_path: Path) -> None:
    from deepzero.args import TrainArgs
    from deepzero.errors import UserError
    from deepzero.modeling import load_config, resolve_model

    assert TrainArgs().trust_remote_code is False
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "evil-lm", "auto_map": {"AutoConfig": "configuration_evil.EvilConfig"}})
    )
    (tmp_path / "configuration_evil.py").write_text(
        "import pathlib\npathlib.Path(__file__).with_name('RAN').touch()\n"
        "from transformers import PretrainedConfig\nclass EvilConfig(PretrainedConfig):\n    model_type = 'evil-lm'\n"
    )
    with pytest.raises(UserError, match=r"needs custom code from the model repo\. Fix: pass --trust-remote-code"):
        load_config(resolve_model(str(tmp_path)))
    assert not (tmp_path / "RAN").exists()


class _Payload:
    """Unpickling this touches a file: what a malicious pytorch_model.bin would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))


def test_pickled_weights_are_refused_without_being_opened(tmp_path: Path) -> None:
    from deepzero.errors import UserError
    from deepzero.modeling import build_model, load_config, resolve_model
    from deepzero.presets import get_preset

    get_preset("tiny-deepseek-v3").config().save_pretrained(tmp_path)
    marker = tmp_path / "UNPICKLED"
    torch.save({"model.embed_tokens.weight": _Payload(marker)}, tmp_path / "pytorch_model.bin")
    source = resolve_model(str(tmp_path))
    with pytest.raises(UserError, match=r"no \.safetensors weights \(pickled \.bin weights are not loaded\)"):
        build_model(source, load_config(source))
    assert not marker.exists()


def test_every_torch_load_in_the_package_is_weights_only() -> None:
    """Our own loads (RNG states, ...) never unpickle arbitrary objects. DeepSpeed's checkpoint loader still
    unpickles its own files: resume and export only checkpoints you wrote."""
    calls = []
    for path in sorted((REPO / "deepzero").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load":
                safe = any(k.arg == "weights_only" and ast.unparse(k.value) == "True" for k in node.keywords)
                calls.append((f"{path.relative_to(REPO)}:{node.lineno}", safe))
    assert calls, "no torch.load found: did the checkpoint code move?"
    assert [where for where, safe in calls if not safe] == []


def test_export_and_universal_refuse_a_folder_without_checkpoints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One clear line and exit code 2, no stack trace."""
    from deepzero import export, universal

    assert export.main([str(tmp_path), "--out", str(tmp_path / "hf")]) == 2
    assert universal.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: {tmp_path}: no 'latest' file, so no checkpoint to {verb}. Fix: pass --tag stepNNNNNNNN"
        for verb in ("export", "convert")
    ]
    assert not (tmp_path / "hf").exists()
