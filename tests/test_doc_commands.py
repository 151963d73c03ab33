"""Every train.py command in README.md and docs/ that trains a real checkpoint (a preset naming one, or a hub id) is
planned with its own flags, as train.py plans a run before loading weights (``deepzero.run.plan_run``), on 3 ×
24 GiB cards and a 128 GiB host, and must fit. The data is a local stand-in of 2,048-token rows (the length the
commands' prepare lines give); the disk check is left out (the 70B export would not fit this machine's disk)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import huggingface_hub
import pytest
from conftest import REPO, plan_as_on_4090s, prepare

from deepzero import run
from deepzero.args import parse_args
from deepzero.presets import PRESETS

SEQ_LEN = 2048
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def shell_blocks(text: str) -> list[str]:
    """The bodies of the fenced blocks tagged bash or sh (or untagged), fences paired in order: a closing fence is
    never read as the opening of a block of the prose after it."""
    blocks, lines, language = [], None, None
    for line in text.splitlines():
        if line.startswith("```"):
            if lines is None:
                lines, language = [], line[3:].strip()
            else:
                if language in ("", "bash", "sh"):
                    blocks.append("\n".join(lines) + "\n")
                lines = None
        elif lines is not None:
            lines.append(line)
    return blocks


def train_commands() -> list[tuple[str, list[str]]]:
    """(where, train.py's arguments) for each command in a shell block that trains a real checkpoint."""
    found = []
    for doc in DOCS:
        for block in shell_blocks(doc.read_text()):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                if "train.py" not in line:
                    continue
                words = shlex.split(line, comments=True)
                if "train.py" not in words:
                    continue
                argv = words[words.index("train.py") + 1 :]
                model = argv[argv.index("--model") + 1] if "--model" in argv else None
                preset = PRESETS.get(model or "")
                if (preset is not None and preset.hub_id) or (model and model.startswith("deepseek-ai/")):
                    found.append((f"{doc.name}: --model {model} {' '.join(argv)[:60]}", argv))
    return found


COMMANDS = train_commands()


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare(
        tmp_path_factory.mktemp("doc_commands") / "data",
        *("--tokenizer", "train", "--vocab-size", "1024", "--val-fraction", "0.02"),
        seq_len=SEQ_LEN,
    )


@pytest.fixture(scope="module")
def prompt_rows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GRPO's stand-in: prompts of 1,536 tokens with 1,024 left to the completion (grpo.md's prepare line)."""
    root = tmp_path_factory.mktemp("doc_prompts")
    (root / "p.jsonl").write_text(
        "".join(f'{{"prompt": "What is {i} + {i}?", "answer": "{2 * i}"}}\n' for i in range(200))
    )
    return prepare(root / "data", "--tokenizer", "train", "--vocab-size", "300", "--format", "prompts",
                   "--max-completion-length", "1024", inputs=[root / "p.jsonl"], seq_len=1536)  # fmt: skip


def test_the_docs_show_commands_for_every_model_size() -> None:
    models = {argv[argv.index("--model") + 1] for _, argv in COMMANDS}
    assert {"deepseek-r1-distill-qwen-7b", "deepseek-r1-distill-qwen-32b", "deepseek-r1-distill-llama-70b"} <= models
    assert any("--load-in-4bit" in argv for _, argv in COMMANDS) and any("--lora" in argv for _, argv in COMMANDS)


@pytest.mark.parametrize("where, argv", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_a_documented_command_fits_3_cards_of_24_gib(
    where: str, argv: list[str], rows: Path, prompt_rows: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = list(argv)
    argv[argv.index("--data") + 1] = str(prompt_rows if "--reward" in argv else rows)
    argv[argv.index("--out") + 1] = str(tmp_path / "run")
    planned: dict = {}
    real_check = run.check_fit

    def capture(*args: object, **kwargs: object) -> None:
        planned.update(args=args, kwargs=kwargs)

    monkeypatch.setattr(run, "check_fit", capture)  # without CUDA it would plan nothing: asked again below
    plan_as_on_4090s(monkeypatch)
    monkeypatch.setattr(run, "check_disk", lambda *args, **kwargs: None)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no hub here: no request, no retries
    warnings: list[str] = []
    monkeypatch.setattr(run, "warn", warnings.append)
    run.plan_run(parse_args(argv), 3)
    assert planned, where
    assert not [w for w in warnings if "never reaches its peak" in w], f"{where}: {warnings}"
    warning = real_check(*planned["args"], **planned["kwargs"] | {"gpu_mem_gb": 24, "cpu_mem_gb": 128})
    assert warning is None, f"{where}: {warning}"
