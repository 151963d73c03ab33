"""The shipped chat SFT example's generator (data/sft_example.py): deterministic, valid chats, several hundred.

`make sft` itself (prepare + a 3-rank run) is measured in docs/sft.md, not run here."""

from __future__ import annotations

import importlib.util
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

from deepzero.data import read_corpus

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "data" / "sft_example.py"


def generate(out: Path) -> str:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sft") / "chats.jsonl"
    assert "conversations from 40 modules' docstrings" in generate(out)
    return out


def test_output_is_deterministic_and_an_unchanged_file_is_left_alone(jsonl: Path, tmp_path: Path) -> None:
    again = tmp_path / "again.jsonl"
    generate(again)
    assert again.read_bytes() == jsonl.read_bytes()
    before = again.stat().st_mtime_ns
    assert generate(again).rstrip().endswith("(unchanged)")
    assert again.stat().st_mtime_ns == before  # prepare's fingerprint (sizes, mtimes) stays valid


def test_several_hundred_valid_chats_as_prepare_reads_them(jsonl: Path) -> None:
    corpus = read_corpus([str(jsonl)])
    chats = corpus.docs
    assert corpus.format == "chat" and 300 <= len(chats) <= 1000
    shapes = {tuple(m["role"] for m in chat) for chat in chats}
    assert shapes == {("system", "user", "assistant"), ("system", "user", "assistant", "user", "assistant")}
    assert all(m["content"].strip() for chat in chats for m in chat)
    questions = [chat[1]["content"] for chat in chats]
    assert len(set(questions)) == len(questions)
    thinking = [chat for chat in chats if chat[2]["content"].startswith("<think>\n")]
    assert 0 < len(thinking) < len(chats) and all("\n</think>\n\n" in chat[2]["content"] for chat in thinking)
    assert sum(len(chat) == 5 for chat in chats) > len(chats) // 2


def test_answers_are_the_first_paragraph_of_the_docstring(jsonl: Path) -> None:
    chats = {json.loads(line)["messages"][1]["content"]: json.loads(line)["messages"] for line in jsonl.open()}
    chat = chats["What does json.dumps do?"]
    paragraph = " ".join(inspect.cleandoc(json.dumps.__doc__).split("\n\n")[0].split())
    assert chat[2]["content"].split("</think>\n\n")[-1] == paragraph
    assert chat[4]["content"] == f"`json.dumps{inspect.signature(json.dumps)}`"
    assert "What does json.JSONDecodeError do?" in chats and "What does json._default_decoder do?" not in chats
    spec = importlib.util.spec_from_file_location("sft_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.first_paragraph("  Line one\n  goes on.\n\n  Second.") == "Line one goes on."
