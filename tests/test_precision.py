"""The precision decision (issue 11): the preset's 16-bit type against what the device computes natively.

Both answers run on every machine: in-process with made-up kernels, and through launched ranks with the
CPU faked by tests/fake_cpu/sitecustomize.py. Either way round: a CPU without native 16-bit kernels trains in
fp32, which runs everywhere, and a faked fp16 is faked for DeepSpeed too, so it trains in fp16 (torch computes
fp16 on any CPU, slowly; test_reliability's overflow test runs that way).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import cpu_env, fake_cpu_vars, launch, records
from hypothesis import given
from hypothesis import strategies as st

from deepzero import precision
from deepzero.dsconfig import TrainingHints, resolve
from deepzero.errors import UserError
from deepzero.hf_export import ExportReport
from deepzero.precision import DeviceKernels, decide

NO_16BIT_CPU = DeviceKernels("cpu", "Old CPU", fp16=False, bf16=False, detail="no avx512_fp16/amx_fp16, no avx512_bf16")
BF16_CPU = DeviceKernels("cpu", "Zen 4", fp16=False, bf16=True, detail="avx512_bf16, no avx512_fp16/amx_fp16")
FULL_CPU = DeviceKernels("cpu", "Sapphire Rapids", fp16=True, bf16=True, detail="avx512_fp16 amx_bf16")
TURING = DeviceKernels("cuda", "Tesla T4", fp16=True, bf16=False, detail="compute capability 7.5")
ADA = DeviceKernels("cuda", "NVIDIA GeForce RTX 4090", fp16=True, bf16=True, detail="compute capability 8.9")
HINTS = TrainingHints(max_steps=10, hidden_size=64)


@pytest.mark.parametrize(
    ("kernels", "fp16_preset", "bf16_preset"),
    [(NO_16BIT_CPU, "fp32", "fp32"), (BF16_CPU, "fp32", "bf16"), (FULL_CPU, "fp16", "bf16"), (ADA, "fp16", "bf16")],
    ids=["cpu-none", "cpu-bf16", "cpu-both", "gpu"],
)
def test_presets_keep_their_type_where_native_and_fall_back_to_fp32_on_a_cpu(
    kernels: DeviceKernels, fp16_preset: str, bf16_preset: str
) -> None:
    for requested, expected in (("fp16", fp16_preset), ("bf16", bf16_preset), ("fp32", "fp32")):
        choice = decide(requested, "ds_configs/x.json", None, kernels)
        assert (choice.dtype, choice.requested, choice.changed) == (expected, requested, expected != requested)
        if choice.changed:
            assert f"no native {requested} kernels ({kernels.detail})" in choice.reason


def test_a_gpu_without_bf16_refuses_a_bf16_preset_in_one_line() -> None:
    with pytest.raises(UserError) as err:
        decide("bf16", "ds_configs/zero2_bf16.json", None, TURING)
    assert str(err.value) == (
        "ds_configs/zero2_bf16.json: bf16.enabled: Tesla T4 (compute capability 7.5) cannot train in bf16. "
        "Fix: use an fp16 preset (ds_configs/zero2.json) or --precision fp16"
    )
    assert decide("fp16", "ds_configs/zero2.json", None, TURING).dtype == "fp16"


def test_forced_precision_wins_where_the_device_can_run_it() -> None:
    assert decide("fp16", "p.json", "fp32", FULL_CPU).dtype == "fp32"
    assert decide("fp32", "p.json", "bf16", NO_16BIT_CPU).dtype == "bf16"  # emulated on a CPU: slow but runs
    assert decide("bf16", "p.json", "fp16", TURING).source == "--precision"
    with pytest.raises(
        UserError, match=r"^--precision fp16: Old CPU has no native fp16 kernels .* Fix: pass --precision fp32$"
    ):
        decide("bf16", "p.json", "fp16", NO_16BIT_CPU)
    with pytest.raises(UserError, match=r"Fix: pass --precision fp32 or --precision fp16$"):
        decide("fp16", "p.json", "bf16", TURING)


@given(
    device=st.sampled_from(["cpu", "cuda"]),
    fp16=st.booleans(),
    bf16=st.booleans(),
    requested=st.sampled_from(precision.PRECISIONS),
    forced=st.sampled_from([None, *precision.PRECISIONS]),
)
def test_the_decision_never_picks_a_type_the_device_would_refuse_or_emulate_unasked(
    device: str, fp16: bool, bf16: bool, requested: str, forced: str | None
) -> None:
    kernels = DeviceKernels(device, "dev", fp16=fp16 or device == "cuda", bf16=bf16, detail="made up")
    try:
        choice = decide(requested, "p.json", forced, kernels)
    except UserError as err:
        assert str(err).count("Fix: ") == 1 and "\n" not in str(err)
        return
    native = choice.dtype == "fp32" or getattr(kernels, choice.dtype)
    assert native or (forced == "bf16" and device == "cpu")  # only an explicit --precision bf16 may emulate
    if forced is None and (requested == "fp32" or getattr(kernels, requested) or device == "cuda"):
        assert choice.dtype == requested  # a GPU or a capable CPU runs the preset as written


def test_resolve_rewrites_the_deepspeed_sections_to_the_decision() -> None:
    cfg = resolve("ds_configs/zero2.json", 3, HINTS, kernels=NO_16BIT_CPU)
    assert cfg.precision == "fp32" and cfg.precision_choice.requested == "fp16"
    assert cfg.ds["fp16"]["enabled"] is False and cfg.ds["fp16"]["loss_scale"] == 0 and "bf16" not in cfg.ds
    cfg = resolve("ds_configs/zero2.json", 3, HINTS, precision="bf16", kernels=BF16_CPU)
    assert (cfg.ds["bf16"], cfg.ds["fp16"]["enabled"]) == ({"enabled": True}, False)
    cfg = resolve("ds_configs/zero3.json", 3, HINTS, kernels=FULL_CPU)
    assert cfg.precision == "bf16" and cfg.ds["bf16"]["enabled"] is True
    assert cfg.precision_choice.describe() == (
        "precision: bf16 (bf16 asked by ds_configs/zero3.json; Sapphire Rapids has native bf16)"
    )


def test_this_machines_cpu_is_probed_consistently_with_deepspeed() -> None:
    """DeepSpeed refuses fp16 on a CPU unless oneDNN has fp16 kernels: the probe must say the same."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    kernels = precision.probe_cpu()
    assert kernels.fp16 == bool(CPU_Accelerator().is_fp16_supported())
    assert kernels.name and kernels.detail and kernels.device == "cpu"


@pytest.mark.parametrize("kernels", ["", "fp16,bf16"])
def test_the_faked_cpu_is_faked_for_deepspeed_too(kernels: str) -> None:
    """tests/fake_cpu makes DeepSpeed's CPU accelerator agree with the faked probe on fp16 (so a faked fp16 run
    trains in fp16, and a faked no-fp16 CPU is refused fp16 by DeepSpeed too), on any real CPU."""
    script = (
        "from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator; from deepzero import precision;"
        "import torch; a = CPU_Accelerator(); k = precision.probe_cpu();"
        "print(k.fp16, k.bf16, a.is_fp16_supported(), torch.float16 in a.supported_dtypes())"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], env=cpu_env(**fake_cpu_vars(kernels)), capture_output=True, text=True
    )
    fp16, bf16 = "fp16" in kernels, "bf16" in kernels
    assert proc.stdout.split() == [str(fp16), str(bf16), str(fp16), str(fp16)], proc.stderr[-2000:]


def test_logit_tolerance_follows_the_dtype_and_the_magnitude() -> None:
    small, large = torch.tensor([0.5, -2.0]), torch.tensor([40.0])
    bf16 = precision.logit_tolerance(torch.bfloat16, small)
    assert bf16 == pytest.approx(4 * 2**-7 * 2.0)
    assert precision.logit_tolerance(torch.bfloat16, large) == pytest.approx(20 * bf16)
    assert precision.logit_tolerance(torch.float16, small) == pytest.approx(bf16 / 8)
    assert precision.logit_tolerance(torch.float32, small) == 1e-4  # floor


def test_the_export_check_allows_more_across_devices_but_not_a_wrong_model() -> None:
    logits = torch.full((1, 4, 8), 10.0)
    ulp = torch.finfo(torch.bfloat16).eps * 10
    few_ulps = torch.full_like(logits, 3 * ulp)
    cpu = ExportReport.measured(Path("hf"), few_ulps, torch.bfloat16, logits, "cpu")
    gpu = ExportReport.measured(Path("hf"), few_ulps, torch.bfloat16, logits, "cuda:0")
    assert not cpu.ok and gpu.ok  # same kernels must agree to rounding; a GPU engine vs a CPU reload, a few ulps
    wrong = torch.full_like(logits, 2.0)  # weights from another model move logits by the order of their scale
    assert not ExportReport.measured(Path("hf"), wrong, torch.bfloat16, logits, "cuda:0").ok


@pytest.mark.launcher
def test_the_seed_preset_on_a_cpu_without_fp16_trains_in_fp32_and_says_so(tiny_data: Path, tmp_path: Path) -> None:
    """Faked CPU without native 16-bit kernels, 1 rank: one warning line, the header and run_config.json record
    the decision, and the run trains (no loss scale: fp32)."""
    out = tmp_path / "run"
    args = ["--deepspeed_config", "ds_configs/zero2.json", "--data", str(tiny_data), "--out", str(out)]
    args += ["--max-steps", "2", "--micro-batch", "2", "--grad-accum", "1", "--log-interval", "1", "--no-export"]
    args += ["--eval-interval", "0", "--save-interval", "0", "--lr", "3e-3"]

    proc = launch(args, nproc=1, env=cpu_env(**fake_cpu_vars("")))
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: precision")]
    assert warnings == [
        "warning: precision: fp32 (fp16 asked by ds_configs/zero2.json; this CPU has no native fp16 kernels"
        " (faked by tests/fake_cpu: none); DeepSpeed refuses fp16 there, so fp32). Fix: pass --precision to choose"
        " another"
    ], proc.stderr[-2000:]
    assert "ZeRO-2  fp32" in proc.stdout and "precision: fp32 (fp16 asked by" in proc.stdout
    recorded = json.loads((out / "run_config.json").read_text())
    assert recorded["precision"]["dtype"] == "fp32" and recorded["precision"]["requested"] == "fp16"
    assert recorded["precision"]["kernels"]["fp16"] is False
    assert recorded["deepspeed"]["fp16"]["enabled"] is False
    assert [r["step"] for r in records(out)] == [1, 2] and "loss_scale" not in records(out)[-1]


@pytest.mark.parametrize(
    ("flags", "native_bf16"),
    [
        ({"avx2", "avx512f", "avx512bw", "avx512_vnni"}, False),  # Cascade Lake: oneDNN emulates bf16
        ({"avx2", "fma"}, False),  # EPYC without AVX-512
        ({"avx512f", "avx512_bf16"}, True),  # Zen 4, Cooper Lake
        ({"avx512f", "amx_tile", "amx_bf16"}, True),  # Sapphire Rapids
        ({"fp", "asimd", "bf16"}, True),  # aarch64 with BF16 (Graviton 3)
    ],
)
def test_bf16_is_native_only_with_its_own_instructions(
    monkeypatch: pytest.MonkeyPatch, flags: set[str], native_bf16: bool
) -> None:
    monkeypatch.setattr(precision, "cpu_flags", lambda: flags)
    kernels = precision.probe_cpu()
    assert kernels.bf16 is native_bf16
    assert ("no avx512_bf16/amx_bf16" in kernels.detail) is not native_bf16


def test_the_old_bfloat16_section_keeps_its_settings() -> None:
    ds = {"bfloat16": {"enabled": True, "immediate_grad_update": True}, "fp16": {"enabled": False}}
    precision.apply(ds, "bf16")
    assert ds == {"bf16": {"enabled": True, "immediate_grad_update": True}, "fp16": {"enabled": False}}


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny DeepSeek-V3 checkpoint stored in bf16, as the published DeepSeek checkpoints are; one weight 1e5."""
    from transformers import AutoModelForCausalLM

    from deepzero.presets import get_preset

    torch.manual_seed(0)
    net = AutoModelForCausalLM.from_config(get_preset("tiny-deepseek-v3").config(vocab_size=512), dtype=torch.bfloat16)
    folder = tmp_path_factory.mktemp("ckpt") / "bf16-model"
    net.save_pretrained(folder)
    with torch.no_grad():
        net.model.layers[1].self_attn.o_proj.weight[0, 0] = 1e5  # fine in bf16, inf in fp16
    net.save_pretrained(folder.with_name("bf16-overflowing"))
    return folder


def test_a_bf16_checkpoint_under_an_fp16_run_is_flagged_at_start(
    bf16_checkpoint: Path, tiny_data: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from deepzero.args import parse_args
    from deepzero.run import plan_run

    monkeypatch.setattr(precision, "probe", lambda: FULL_CPU)  # a CPU (or GPU) that trains the fp16 preset in fp16
    args = ["--model", str(bf16_checkpoint), "--data", str(tiny_data), "--out", str(bf16_checkpoint.parent / "run")]
    plan = plan_run(parse_args([*args, "--micro-batch", "2", "--grad-accum", "1"]), world=1)
    assert plan.cfg.precision == "fp16"
    warnings = [line for line in capsys.readouterr().err.splitlines() if "stored in bfloat16" in line]
    assert warnings == [
        f"warning: --model {bf16_checkpoint}: the checkpoint is stored in bfloat16 and this run trains in fp16"
        " (ds_configs/zero2.json); weights beyond fp16's ±65504 would become inf (checked once loaded). Fix: train in"
        " bf16 (ds_configs/zero2_bf16.json, or --precision bf16)"
    ]
    plan_run(parse_args([*args, "--micro-batch", "2", "--grad-accum", "1", "--precision", "bf16"]), world=1)
    assert "stored in bfloat16" not in capsys.readouterr().err


def test_weights_that_overflow_fp16_at_load_are_refused_by_name(bf16_checkpoint: Path) -> None:
    from deepzero import modeling

    for folder, overflows in ((bf16_checkpoint, False), (bf16_checkpoint.with_name("bf16-overflowing"), True)):
        source = modeling.resolve_model(str(folder))
        net = modeling.build_model(source, modeling.load_config(source), dtype=torch.float16)
        if not overflows:
            precision.check_fp16_range(net, str(folder))
            continue
        with pytest.raises(UserError) as err:
            precision.check_fp16_range(net, str(folder))
        assert str(err.value) == (
            f"--model {folder}: model.layers.1.self_attn.o_proj.weight holds values beyond fp16's ±65504: they became"
            " inf when the weights loaded in fp16. Fix: train in bf16 (ds_configs/zero2_bf16.json, or --precision bf16)"
        )
