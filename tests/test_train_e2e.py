"""End to end on 3 ranks on the CPU (gloo): train, log, save, resume, export; the seed run through the real
`deepspeed --num_gpus=3`."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import REPO, bf16_precision, cpu_env, fp16_env, launch, losses, records
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

pytestmark = pytest.mark.launcher

STEPS = 24


def tiny_args(data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--model", "tiny-deepseek-v3", "--data", str(data), "--out", str(out),
        "--lr", "3e-3", "--warmup-steps", "4", "--micro-batch", "2", "--grad-accum", "2",
        "--log-interval", "1", "--eval-interval", "12", "--eval-batches", "2", "--save-interval", "12",
        *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def zero2_run(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The seed preset (ZeRO-2, fp16, WarmupLR) for STEPS steps on 3 ranks with `deepspeed`, uninterrupted, in fp16 on every CPU (its
    own fp16 kernels or faked ones: ``fp16_env``), so that a CPU without fp16 meets what an AVX512-FP16 one meets;
    the fp32 fallback of the precision decision is tested in test_precision.py."""
    out = tmp_path_factory.mktemp("zero2") / "run"
    proc = launch(
        ["--deepspeed_config", "ds_configs/zero2.json", *tiny_args(tiny_data, out, "--max-steps", str(STEPS))],
        env=fp16_env(),
        real_launcher=True,  # the headline command as users type it: its log is checked for warnings below
    )
    return out, proc.stdout + proc.stderr


def test_seed_preset_trains_on_three_ranks_and_loss_falls(zero2_run: tuple[Path, str]) -> None:
    out, log = zero2_run
    assert "ZeRO-2  fp16" in log and "world 3 on cpu (gloo)" in log
    assert "precision: fp16 (fp16 asked by ds_configs/zero2.json;" in log
    assert "warning: precision: fp32" not in log
    assert "micro 2 × accumulation 2 × data-parallel 3 = global 12" in log
    port = re.search(r"--master_port=(\d+)", log).group(1)  # DeepSpeed's CPU comm buffers were released
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
    curve = losses(out)
    assert sorted(curve) == list(range(1, STEPS + 1))
    first, last = curve[1], sum(curve[s] for s in range(STEPS - 3, STEPS + 1)) / 4
    assert first > 5.5 and last < first - 1.0, f"loss did not fall clearly: {first:.3f} -> {last:.3f}"


LAUNCHER_WARNINGS = ("Unable to find hostfile, will proceed with training with local resources only.",)
"""Printed by DeepSpeed's launcher process (runner.py) before train.py starts: outside the run's reach."""


def test_the_log_holds_no_warning_the_run_does_not_explain(zero2_run: tuple[Path, str]) -> None:
    """A newcomer's first log: the only warnings are deepzero's own ``warning: ...`` lines (rank 0, one each; the
    precision one is the header's ``precision:`` line), none from torch or DeepSpeed that the user can do nothing
    about (torch's all_gather_into_tensor FutureWarning, the scheduler's "before it has started": deepzero.quiet)."""
    _, log = zero2_run
    stray = [
        line
        for line in log.splitlines()
        if "warn" in line.lower() and not line.startswith("warning: ") and not line.endswith(LAUNCHER_WARNINGS)
    ]
    assert not stray, "\n".join(stray)
    own = [line for line in log.splitlines() if line.startswith("warning: ")]
    assert len(own) == len(set(own)), own  # from rank 0 only
    assert "built successfully" not in log  # DeepSpeed's print on loading its CPU comm op, every rank (quiet.py)


def test_make_train_names_the_accelerator_and_keeps_the_launcher_quiet() -> None:
    """`make train`'s launch line: DS_ACCELERATOR named (cpu where nvidia-smi lists no GPU), so DeepSpeed does not
    warn on every process that it fell back to the CPU, and the launcher at --log_level=error (no INFO lines, no
    "Unable to find hostfile" on one machine)."""
    dry = subprocess.run(["make", "-n", "train", "ACCELERATOR=cpu"], cwd=REPO, capture_output=True, text=True)
    line = next(line for line in dry.stdout.splitlines() if "deepspeed " in line)
    assert "DS_ACCELERATOR=cpu deepspeed --log_level=error --num_gpus=3 train.py" in line, line
    if shutil.which("nvidia-smi") is None:
        auto = subprocess.run(["make", "-n", "train"], cwd=REPO, capture_output=True, text=True).stdout
        assert "DS_ACCELERATOR=cpu deepspeed" in auto


def test_every_log_point_reports_the_promised_metrics(zero2_run: tuple[Path, str]) -> None:
    out, _ = zero2_run
    last = records(out)[-1]
    keys = ["loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "peak_host_mem_gb"]
    for key in [*keys, "loss_scale"]:
        assert isinstance(last[key], float) and last[key] > 0, key
    assert last["tokens_per_s"] == pytest.approx(12 * 64 / last["step_time_s"], rel=1e-6)
    evals = records(out, "eval")
    assert [e["step"] for e in evals] == [12, 24]
    assert evals[-1]["val_ppl"] == pytest.approx(2.718281828 ** evals[-1]["val_loss"], rel=1e-6)
    assert evals[0]["val_loss"] > evals[1]["val_loss"]


def test_checkpoints_are_published_and_export_reloads_with_same_logits(zero2_run: tuple[Path, str]) -> None:
    out, _ = zero2_run
    ckpt = out / "checkpoints"
    assert (ckpt / "latest").read_text() == "step00000024"
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["step00000012", "step00000024"]
    export = records(out, "export")[-1]
    dtype = torch.float16
    assert export["ok"] and export["dtype"] == str(dtype).removeprefix("torch.")
    assert export["max_abs_logit_diff"] <= export["tolerance"] < 0.05  # a few ulps of the logit scale
    hf = out / "hf"
    assert list(hf.glob("*.safetensors")) and not list(hf.glob("*.bin"))
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(hf)
    assert AutoConfig.from_pretrained(hf).model_type == "deepseek_v3"
    ids = tok("def main():\n    return 0\n", return_tensors="pt").input_ids
    loss = model(input_ids=ids, labels=ids).loss.item()
    assert loss < 6.0  # a random model would be near ln(512) = 6.24 or above


def test_resume_continues_the_uninterrupted_curve(zero2_run: tuple[Path, str], tiny_data: Path, tmp_path: Path) -> None:
    """Resumed from the uninterrupted run's step-12 checkpoint (its ``latest`` pointed back at it, the product's way
    to resume from an older checkpoint), steps 13-24 continue that run's curve (fp16, loss scale included)."""
    full, _ = zero2_run
    out = tmp_path / "run"
    half = STEPS // 2
    shutil.copytree(full / "checkpoints", out / "checkpoints")
    shutil.rmtree(out / "checkpoints" / f"step{STEPS:08d}")
    (out / "checkpoints" / "latest").write_text(f"step{half:08d}")
    args = tiny_args(tiny_data, out, "--max-steps", str(STEPS), "--resume", "--no-export")
    proc = launch(["--deepspeed_config", "ds_configs/zero2.json", *args], env=fp16_env())
    assert f"resumed from step {half}" in proc.stdout
    resumed, reference = losses(out), losses(full)
    assert sorted(resumed) == list(range(half + 1, STEPS + 1))
    for step in range(half + 1, STEPS + 1):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-5, abs=1e-5), step


def test_one_rank_and_three_ranks_give_the_same_curve(tiny_data: Path, tmp_path: Path) -> None:
    """Same global batch (6 sequences): 1 rank × accumulation 3 versus 3 ranks × accumulation 1, in fp32.

    The 1-rank run also switches the MoE experts kernel (--experts-impl eager vs the default grouped_mm):
    the kernel must change the speed, never the curve."""
    common = ["--deepspeed_config", "ds_configs/zero2.json", "--ds", "fp16.enabled=false", "train_batch_size=auto"]
    common += ["--max-steps", "8", "--eval-interval", "0", "--no-export", "--save-interval", "0", "--micro-batch", "2"]
    one, three = tmp_path / "one", tmp_path / "three"
    one_log = launch([*tiny_args(tiny_data, one, "--grad-accum", "3", "--experts-impl", "eager"), *common], nproc=1)
    three_log = launch([*tiny_args(tiny_data, three, "--grad-accum", "1"), *common], nproc=3)
    assert "experts eager" in one_log.stdout and "experts grouped_mm" in three_log.stdout
    a, b = losses(one), losses(three)
    assert len(a) == len(b) == 8
    for step in a:
        assert a[step] == pytest.approx(b[step], abs=2e-4), (step, a[step], b[step])
    assert a[8] < a[1] - 0.3


def test_cosine_decay_resumes_exactly_inside_the_decay(tiny_data: Path, tmp_path: Path) -> None:
    """--lr-schedule cosine on 1 rank: warm-up 2 steps (the lr a log point shows is the next step's), then the lr
    falls to 0.1 × the peak at --max-steps; a resume
    from step 4 (inside the decay) gives the same lr and loss at steps 5-8 as the uninterrupted run."""
    import shutil

    out = tmp_path / "run"
    args = ["--deepspeed_config", "ds_configs/zero2.json", "--precision", "fp32", "--lr-schedule", "cosine"]
    args += tiny_args(tiny_data, out, "--max-steps", "8", "--warmup-steps", "2", "--save-interval", "4")
    args += ["--eval-interval", "0", "--no-export"]
    proc = launch(args, nproc=1)
    assert "scheduler WarmupCosineLR (warmup 2 steps, decay to step 8)" in proc.stdout
    full = {r["step"]: r for r in records(out)}
    warm, decay = [full[s]["lr"] for s in (1, 2, 3)], [full[s]["lr"] for s in range(3, 9)]
    assert warm == sorted(warm) and decay == sorted(decay, reverse=True) and len(set(decay)) == len(decay)
    assert decay[-1] == pytest.approx(0.1 * 3e-3)  # cos_min_ratio × the peak, reached at --max-steps
    again = tmp_path / "again"
    shutil.copytree(out, again)
    (again / "checkpoints" / "latest").write_text("step00000004")
    (again / "metrics.jsonl").unlink()
    args[args.index(str(out))] = str(again)
    proc = launch([*args, "--resume"], nproc=1)
    assert "resumed from step 4" in proc.stdout
    resumed = {r["step"]: r for r in records(again)}
    for step in range(5, 9):
        assert resumed[step]["lr"] == full[step]["lr"], step
        assert resumed[step]["loss"] == pytest.approx(full[step]["loss"], rel=1e-6), step


def test_local_pretrained_deepseek_v2_under_zero3_with_wandb_offline(tiny_data: Path, tmp_path: Path) -> None:
    """--model <folder> goes through from_pretrained; ZeRO-3 bf16; wandb offline; secrets stay out of logs."""
    from deepzero.presets import get_preset

    tok = AutoTokenizer.from_pretrained(tiny_data / "tokenizer")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(get_preset("tiny-deepseek-v2").config(vocab_size=len(tok)))
    folder = tmp_path / "my-deepseek-v2"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    out = tmp_path / "run"
    env = cpu_env(WANDB_MODE="offline", WANDB_API_KEY="sk-secret-never-logged")
    args = tiny_args(tiny_data, out, "--max-steps", "6", "--report-to", "wandb")
    args[args.index("tiny-deepseek-v3")] = str(folder)
    proc = launch(["--deepspeed_config", "ds_configs/zero3.json", *args], env=env)
    assert f"ZeRO-3  {bf16_precision()}  partitioned at load" in proc.stdout  # from_pretrained under zero.Init
    assert list((out / "wandb").glob("offline-run-*")), "wandb offline run missing"
    everything = proc.stdout + proc.stderr + (out / "run_config.json").read_text() + (out / "metrics.jsonl").read_text()
    assert "sk-secret-never-logged" not in everything
    assert json.loads((out / "run_config.json").read_text())["env"]["WANDB_API_KEY"] == "***"  # seen, then redacted
    assert records(out, "export")[-1]["ok"]
    assert AutoConfig.from_pretrained(out / "hf").model_type == "deepseek_v2"


def test_bad_preset_fails_fast_with_one_line_before_loading_the_model(tiny_data: Path, tmp_path: Path) -> None:
    cfg = json.loads(Path("ds_configs/zero2.json").read_text())
    cfg["zero_optimization"]["reduce_scater"] = True
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(cfg))
    proc = launch(
        ["--deepspeed_config", str(bad), *tiny_args(tiny_data, tmp_path / "run", "--max-steps", "2")], check=False
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert str(bad) in errors[0] and "zero_optimization.reduce_scater" in errors[0] and "reduce_scatter" in errors[0]
    assert "Traceback" not in proc.stderr and "model:" not in proc.stdout


def test_pipeline_preset_trains_resumes_and_exports_through_train_py(tiny_data: Path, tmp_path: Path) -> None:
    """ds_configs/pipeline.json: 3 stages × data-parallel 1; resume from step 4 reproduces steps 5-8."""
    import shutil

    out = tmp_path / "run"
    args = ["--deepspeed_config", "ds_configs/pipeline.json", *tiny_args(tiny_data, out, "--max-steps", "8")]
    args += ["--save-interval", "4", "--eval-interval", "4", "--grad-accum", "6"]
    proc = launch(args)
    assert "pipeline 3 stages × data-parallel 1" in proc.stdout
    full = losses(out)
    assert records(out, "export")[-1]["ok"] and full[8] < full[1]
    again = tmp_path / "again"
    shutil.copytree(out, again)
    (again / "checkpoints" / "latest").write_text("step00000004")
    (again / "metrics.jsonl").unlink()
    args[args.index(str(out))] = str(again)
    proc = launch([*args, "--resume", "--no-export"])
    assert "resumed from step 4" in proc.stdout
    resumed = losses(again)
    for step in range(5, 9):
        assert resumed[step] == pytest.approx(full[step], rel=1e-5), step


def test_lora_through_train_py_trains_adapters_and_exports_a_merged_model(tiny_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = tiny_args(tiny_data, out, "--max-steps", "6", "--lora", "r=8,alpha=16,targets=attn", "--eval-interval", "0")
    proc = launch(["--deepspeed_config", "ds_configs/zero2.json", *args, "--lr", "1e-2"])
    assert "trainable" in proc.stdout.lower()
    curve = losses(out)
    assert curve[6] < curve[1]
    export = records(out, "export")[-1]
    assert export["ok"] and export["merged_modules"] > 0
    weights = list((out / "hf").glob("*.safetensors"))
    assert weights and not list((out / "hf").glob("adapter_*"))
    model = AutoModelForCausalLM.from_pretrained(out / "hf")
    assert not any("lora" in name for name, _ in model.named_parameters())
