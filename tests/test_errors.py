"""Every row of docs/errors.md, run for real: one `error:` line naming the problem and the fix, exit code 2,
no stack trace, and the run's existing checkpoints left exactly as they were (issue 5, item 7).

The expected lines are read from docs/errors.md itself, so the table and the program cannot drift apart.
Rows that fail before the process group starts run as `python train.py` (world 1, or WORLD_SIZE=3 for the batch
math, which is checked before any rank joins), two at a time, forked from one process that imported train.py's
modules once (tests/helpers/fork_cases.py; a faked CPU's row runs as its own process); the corrupt checkpoint goes
through the real `deepspeed` launcher on 2 ranks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from conftest import CPU, REPO, STDLIB, cpu_env, fake_cpu_vars, free_port, launch, run_bounded

from deepzero.op_builds import claim_op_builds

DOC = REPO / "docs" / "errors.md"
WILDCARDS = ("reason", "presets")
"""Placeholders that stand for text from a library (an OS or torch message, the list of presets)."""
PARALLEL = 2


@dataclass
class Case:
    """One row of the table: the command, the values of the row's placeholders, and the folder to keep intact."""

    argv: list[str]
    values: dict[str, str] = field(default_factory=dict)
    keep: Path | None = None
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Outcome:
    case: Case
    returncode: int
    stderr: str
    before: dict[str, bytes]


def doc_rows() -> dict[str, str]:
    """Input column → message column (without backticks) of every table row in docs/errors.md."""
    rows = {}
    table = DOC.read_text().split("\n## ")[0]  # the first table; later sections describe other events
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) == 3 and cells[2].startswith("`error: "):
            rows[cells[0]] = cells[2].strip("`")
    return rows


def expected_pattern(message: str, values: dict[str, str]) -> re.Pattern[str]:
    """The doc line as a regex: ``<name>`` becomes the row's value, or any text for the wildcards."""
    names = set(re.findall(r"<([a-z_]+)>", message))
    assert names <= set(values) | set(WILDCARDS), f"no value for {names - set(values) - set(WILDCARDS)}"
    pattern = re.escape(message)
    for name in names:
        value = values.get(name)
        pattern = pattern.replace(re.escape(f"<{name}>"), ".+" if value is None else re.escape(value))
    return re.compile(pattern)


def error_lines(stderr: str) -> list[str]:
    """Rank 0's `error:` lines. Ranks share the launcher's stderr unbuffered, so another rank's "[rank N] error: ..."
    can land inside rank 0's line: break before every rank prefix and every unprefixed `error: `."""
    text = re.sub(r"(?=\[rank \d+\] )|(?<!\] )(?=error: )", "\n", stderr)
    return [line for line in text.splitlines() if line.startswith("error: ")]


def snapshot(folder: Path | None) -> dict[str, bytes]:
    if folder is None or not folder.exists():
        return {}
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def train_py(*args: str) -> list[str]:
    return [sys.executable, "train.py", *args]


def small_args(data: Path, out: Path, *extra: str, batch: bool = True) -> list[str]:
    """Two steps, no export; micro 2 × accumulation 2 unless ``batch`` is False (the preset's own numbers)."""
    sizes = ["--micro-batch", "2", "--grad-accum", "2"] if batch else []
    return ["--data", str(data), "--out", str(out), "--max-steps", "2", "--no-export", *sizes, *extra]


def fake_run(root: Path) -> Path:
    """A run folder holding a published checkpoint (stand-in bytes): what a failing command must not touch."""
    out = root / "run"
    (out / "checkpoints" / "step00000001").mkdir(parents=True)
    (out / "checkpoints" / "step00000001" / "mp_rank_00_model_states.pt").write_bytes(b"earlier checkpoint")
    (out / "checkpoints" / "latest").write_text("step00000001")
    return out


def small_dataset(root: Path, tokenizer: Path) -> tuple[Path, int]:
    """A prepared dataset with fewer train rows than one global batch of 8."""
    text = (STDLIB / "json" / "decoder.py").read_text()
    inputs = []
    for i in range(3):
        inputs.append(root / f"doc{i}.txt")
        inputs[-1].write_text(text[i * 350 : (i + 1) * 350])
    out = root / "short"
    cmd = [sys.executable, "data/prepare.py", "--input", *map(str, inputs), "--tokenizer", str(tokenizer)]
    cmd += ["--seq-len", "64", "--val-fraction", "0.34", "--out", str(out)]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, env=cpu_env())
    rows = json.loads((out / "meta.json").read_text())["n_rows"]["train"]
    assert 0 < rows < 8
    return out, rows


def cases(tiny_data: Path, root: Path) -> dict[str, Case]:
    """Every single-process row, keyed by its Input column in docs/errors.md."""
    from deepzero.presets import get_preset

    made: dict[str, Case] = {}

    def row(name: str) -> Path:
        folder = root / re.sub(r"\W+", "-", name.lower()).strip("-")
        folder.mkdir()
        return folder

    d = row("Malformed JSON")
    config = d / "bad.json"
    config.write_text('{"train_batch_size": 24,}\n')
    out = fake_run(d)
    made["Malformed JSON in the DeepSpeed config"] = Case(
        train_py("--deepspeed_config", str(config), *small_args(tiny_data, out)), {"config": str(config)}, out
    )

    d = row("Unknown key")
    config = d / "typo.json"
    preset = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    preset["zero_optimization"]["reduce_scater"] = True
    config.write_text(json.dumps(preset))
    out = fake_run(d)
    made["Unknown or misspelled DeepSpeed key"] = Case(
        train_py("--deepspeed_config", str(config), *small_args(tiny_data, out)), {"config": str(config)}, out
    )

    d = row("Batch math")
    out = fake_run(d)
    overrides = ["--ds", "train_batch_size=16", "train_micro_batch_size_per_gpu=auto"]
    made["Global batch that the world size does not divide"] = Case(
        train_py("--deepspeed_config", "ds_configs/zero2.json", *small_args(tiny_data, out, *overrides, batch=False)),
        {"config": "ds_configs/zero2.json"},
        out,
        env={"WORLD_SIZE": "3"},
    )

    d = row("Missing model")
    out = fake_run(d)
    model = d / "no-such-model"
    made["Model path that does not exist"] = Case(
        train_py("--model", str(model), *small_args(tiny_data, out)), {"model": str(model)}, out
    )

    d = row("Empty data")
    out, data = fake_run(d), d / "empty-data"
    data.mkdir()
    made["Data folder that was never prepared (empty)"] = Case(
        train_py(*small_args(data, out)), {"data": str(data)}, out
    )

    d = row("Short data")
    out = fake_run(d)
    data, rows = small_dataset(d, tiny_data / "tokenizer")
    made["Dataset shorter than one global batch"] = Case(
        train_py(*small_args(data, out, "--micro-batch", "4")), {"rows": str(rows)}, out
    )

    d = row("Too long")
    out, model = fake_run(d), d / "short-context-model"
    get_preset("tiny-deepseek-v3").config(max_position_embeddings=32).save_pretrained(model)
    made["Sequence longer than the model's max positions"] = Case(
        train_py("--model", str(model), *small_args(tiny_data, out)), {"data": str(tiny_data)}, out
    )

    d = row("No chat template")
    tokenizer = d / "tokenizer-without-template"
    shutil.copytree(tiny_data / "tokenizer", tokenizer)
    (tokenizer / "chat_template.jinja").unlink()
    chats = d / "chats.jsonl"
    chat = {"messages": [{"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "5"}]}
    chats.write_text("\n".join(json.dumps(chat) for _ in range(4)) + "\n")
    prepared = d / "prepared"
    shutil.copytree(tiny_data, prepared)  # an earlier dataset in --out: a failed prepare keeps it
    prepare = [sys.executable, "data/prepare.py", "--input", str(chats), "--format", "chat"]
    made["Chat (SFT) data with a tokenizer that has no chat template"] = Case(
        [*prepare, "--tokenizer", str(tokenizer), "--seq-len", "64", "--out", str(prepared)],
        {"tokenizer": str(tokenizer)},
        prepared,
    )

    d = row("Unwritable out")
    (d / "a-file").write_text("not a folder")
    out = d / "a-file" / "run"
    made["Output folder that cannot be written"] = Case(
        train_py(*small_args(tiny_data, out)),
        {"out": str(out)},
    )

    d = row("Stale op lock")
    lock = d / "extensions" / "fused_adam" / "lock"
    lock.parent.mkdir(parents=True)
    claim_op_builds(lock.parent.parent)  # this process lives on the folder: only the lock's age can condemn it
    lock.touch()
    os.utime(lock, (1767225600, 1767225600))  # 2026-01-01 00:00 UTC
    made["Lock left by a DeepSpeed op build that was killed"] = Case(
        train_py(*small_args(tiny_data, d / "run")),
        {"lock": str(lock), "started": "2026-01-01 00:00"},
        env={"TORCH_EXTENSIONS_DIR": str(lock.parent.parent)},
    )

    d = row("Resume without checkpoint")
    out = d / "run"
    made["--resume with no checkpoint in --out"] = Case(
        train_py(*small_args(tiny_data, out, "--resume")), {"checkpoints": str(out / "checkpoints")}
    )

    d = row("Out reused")
    out = fake_run(d)
    made["A run's --out reused without --resume"] = Case(train_py(*small_args(tiny_data, out)), {"out": str(out)}, out)

    d = row("Latest missing")
    out = fake_run(d)
    (out / "checkpoints" / "latest").write_text("step00000009")
    made["'latest' naming a folder that is gone"] = Case(
        train_py(*small_args(tiny_data, out, "--resume")), {"checkpoints": str(out / "checkpoints")}, out
    )

    d = row("Misspelled flag")
    out = fake_run(d)
    made["Misspelled command-line flag"] = Case(train_py(*small_args(tiny_data, out, "--save-intervall", "5")), {}, out)

    d = row("Remote code")
    model = d / "custom-code-model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"model_type": "custom-lm", "auto_map": {"AutoConfig": "configuration_custom.CustomConfig"}})
    )
    (model / "configuration_custom.py").write_text("import pathlib\npathlib.Path(__file__).with_name('RAN').touch()\n")
    out = fake_run(d)
    made["Model that needs its own code (trust_remote_code)"] = Case(
        train_py("--model", str(model), *small_args(tiny_data, out)), {"model": str(model)}, out
    )

    d = row("Pickle weights")
    model = d / "bin-only-model"
    get_preset("tiny-deepseek-v3").config(vocab_size=512).save_pretrained(model)
    torch.save({}, model / "pytorch_model.bin")
    out = d / "fresh-run"  # the weights are found missing at load, after the plan (which refuses a used --out)
    made["Model folder with only pickled .bin weights"] = Case(
        train_py("--model", str(model), *small_args(tiny_data, out)), {"model": str(model)}
    )

    out = fake_run(row("Zero batch"))
    made["Batch size of zero"] = Case(
        train_py(
            "--ds",
            "train_micro_batch_size_per_gpu=0",
            "train_batch_size=auto",
            *small_args(tiny_data, out, batch=False),
        ),
        {"config": "ds_configs/zero2.json"},
        out,
    )

    broken = row("Broken meta") / "data"
    shutil.copytree(tiny_data, broken)
    (broken / "meta.json").write_text((tiny_data / "meta.json").read_text()[:40])
    out = fake_run(broken.parent)
    made["Data folder whose meta.json is not valid JSON"] = Case(
        train_py(*small_args(broken, out)), {"data": str(broken)}, out
    )

    out = fake_run(row("Negative lr"))
    made["Learning rate that is not a positive number"] = Case(
        train_py("--lr", "-1", *small_args(tiny_data, out)), {}, out
    )

    out = fake_run(row("Forced precision"))
    made["Forced precision the device cannot run"] = Case(
        train_py("--precision", "fp16", *small_args(tiny_data, out)), {"cpu": CPU.name}, out, fake_cpu_vars("")
    )

    out = fake_run(row("Experts on dense"))
    made["MoE experts kernel chosen for a dense model"] = Case(
        train_py("--model", "deepseek-coder-1.3b", "--experts-impl", "grouped_mm", *small_args(tiny_data, out)),
        {},
        out,
    )
    return made


IMPORT_TIME_ENV = ("PYTHONPATH", "DEEPZERO_FAKE_CPU_KERNELS")
"""Variables read when Python starts or imports (a faked CPU's sitecustomize): a case setting one runs on its own."""


def case_env(case: Case) -> dict[str, str]:
    return {"MASTER_PORT": str(free_port()), **case.env}


def run_case(case: Case) -> Outcome:
    """The case as its own ``python train.py`` process."""
    before = snapshot(case.keep)
    env = cpu_env(HF_HUB_OFFLINE="1", **case_env(case))
    env.pop("RANK", None)
    proc = run_bounded(case.argv, 300, env)
    return Outcome(case, proc.returncode, proc.stderr, before)


def run_cases_in_forks(made: dict[str, Case], root: Path) -> dict[str, Outcome]:
    """The cases as forks of one process that imported train.py's modules once (tests/helpers/fork_cases.py):
    each child is ``python train.py ARGS`` with the case's environment, without ~7 CPU-seconds of imports each."""
    befores = {name: snapshot(case.keep) for name, case in made.items()}
    spec = [
        {
            "args": case.argv[2:],
            "env": case_env(case),
            "stdout": str(root / f"{i}.out"),
            "stderr": str(root / f"{i}.err"),
        }
        for i, case in enumerate(made.values())
    ]
    (root / "cases.json").write_text(json.dumps(spec))
    env = cpu_env(HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    env.pop("RANK", None)
    cmd = [sys.executable, "tests/helpers/fork_cases.py", str(root / "cases.json"), str(PARALLEL)]
    proc = run_bounded(cmd, 600, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    codes = json.loads((root / "cases.json.out").read_text())["returncodes"]
    return {
        name: Outcome(case, code, Path(entry["stderr"]).read_text(), befores[name])
        for (name, case), code, entry in zip(made.items(), codes, spec, strict=True)
    }


@pytest.fixture(scope="module")
def outcomes(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    """Every single-process row: train.py's as forks of one process, but for a faked CPU's; data/prepare.py's."""
    made = cases(tiny_data, tmp_path_factory.mktemp("errors"))
    own = {k: v for k, v in made.items() if v.argv[1] != "train.py" or set(v.env) & set(IMPORT_TIME_ENV)}
    forked = run_cases_in_forks({k: v for k, v in made.items() if k not in own}, tmp_path_factory.mktemp("forked"))
    with ThreadPoolExecutor(PARALLEL) as pool:
        return forked | dict(zip(own, pool.map(run_case, own.values()), strict=True))


def check(outcome: Outcome, message: str) -> None:
    """Exit 2, exactly one `error:` line equal to the doc's, no traceback, the kept folder byte-identical."""
    assert outcome.returncode == 2, outcome.stderr[-3000:]
    errors = error_lines(outcome.stderr)
    assert len(errors) == 1, outcome.stderr[-3000:]
    assert expected_pattern(message, outcome.case.values).fullmatch(errors[0]), f"{errors[0]}\n!=\n{message}"
    assert "Traceback" not in outcome.stderr
    assert snapshot(outcome.case.keep) == outcome.before


SINGLE_PROCESS_ROWS = [
    "Malformed JSON in the DeepSpeed config",
    "Unknown or misspelled DeepSpeed key",
    "Global batch that the world size does not divide",
    "Model path that does not exist",
    "Data folder that was never prepared (empty)",
    "Dataset shorter than one global batch",
    "Sequence longer than the model's max positions",
    "Chat (SFT) data with a tokenizer that has no chat template",
    "Output folder that cannot be written",
    "Lock left by a DeepSpeed op build that was killed",
    "--resume with no checkpoint in --out",
    "A run's --out reused without --resume",
    "'latest' naming a folder that is gone",
    "Misspelled command-line flag",
    "Model that needs its own code (trust_remote_code)",
    "Model folder with only pickled .bin weights",
    "MoE experts kernel chosen for a dense model",
    "Forced precision the device cannot run",
    "Learning rate that is not a positive number",
    "Batch size of zero",
    "Data folder whose meta.json is not valid JSON",
]
LAUNCHER_ROWS = ["Corrupt checkpoint (truncated file)"]


def test_the_table_lists_exactly_the_tested_rows() -> None:
    assert sorted(doc_rows()) == sorted(SINGLE_PROCESS_ROWS + LAUNCHER_ROWS)


@pytest.mark.parametrize("name", SINGLE_PROCESS_ROWS)
def test_row(name: str, outcomes: dict[str, Outcome]) -> None:
    outcome = outcomes[name]
    check(outcome, doc_rows()[name])
    if "needs its own code" in name:
        assert not (Path(outcome.case.values["model"]) / "RAN").exists(), "the model's code ran"


@pytest.mark.launcher
def test_corrupt_checkpoint_through_the_launcher(tiny_data: Path, tmp_path: Path) -> None:
    """`latest` names a checkpoint whose model file was cut short; the previous checkpoint is the way out."""
    out = tmp_path / "run"
    ckpt = out / "checkpoints"
    for tag in ("step00000001", "step00000002"):
        (ckpt / tag).mkdir(parents=True)
        whole = ckpt / tag / "full.pt"
        torch.save({"module": {"w": torch.ones(1000)}, "global_steps": 2}, whole)
        (ckpt / tag / "mp_rank_00_model_states.pt").write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
        whole.unlink()
    (ckpt / "latest").write_text("step00000002")
    before = snapshot(out)
    args = ["--deepspeed_config", "ds_configs/zero2.json", *small_args(tiny_data, out, "--resume")]
    proc = launch(args, nproc=2, env=cpu_env(HF_HUB_OFFLINE="1"), check=False, real_launcher=True)
    outcome = Outcome(Case(args, {"checkpoints": str(ckpt)}, out), proc.returncode, proc.stderr, before)
    check(outcome, doc_rows()["Corrupt checkpoint (truncated file)"])


def test_the_error_line_is_one_write_so_ranks_sharing_stderr_cannot_split_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Ranks share the launcher's stderr unbuffered (PYTHONUNBUFFERED=1): print() wrote the text and its newline as
    two writes, and a peer's line landed between them in CI ("...(NFS, Lustre, ...)[rank 2] error: ...\\n\\n").
    train.py's error line is a single write that ends with its newline."""
    from deepzero import trainer

    writes: list[str] = []

    class Recorder:
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    monkeypatch.setattr(sys, "stderr", Recorder())
    monkeypatch.delenv("RANK", raising=False)
    missing = tmp_path / "missing.json"
    assert trainer.main(["--deepspeed_config", str(missing), "--out", str(tmp_path / "out")]) == 2
    errors = [w for w in writes if "error: " in w]
    assert len(errors) == 1 and errors[0].startswith("error: ") and errors[0].endswith("\n"), writes
    assert errors[0].count("\n") == 1 and ". Fix: " in errors[0]  # whichever input it names first
