"""The data people have: Alpaca, ShareGPT and OpenAI messages with DeepSeek's reasoning_content prepare as chats;
a record of no known shape is refused in one line naming the keys it has."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepzero.data.prepare import main, prepare
from deepzero.data.record_shapes import record_doc
from deepzero.data.sources import iter_docs
from deepzero.errors import UserError


def write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_alpaca_joins_the_input_as_llama_factory_does() -> None:
    record = {"instruction": "Translate to French.", "input": "cat", "output": "chat", "system": "Be exact."}
    assert record_doc(record, "x", "auto") == [
        {"role": "system", "content": "Be exact."},
        {"role": "user", "content": "Translate to French.\ncat"},
        {"role": "assistant", "content": "chat"},
    ]
    no_input = record_doc({"instruction": "Say hi.", "input": "", "output": "hi"}, "x", "alpaca")
    assert no_input == [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]


def test_sharegpt_maps_from_value_and_system() -> None:
    record = {"system": "S", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    assert record_doc(record, "x", "chat") == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    ]
    with pytest.raises(UserError, match=r"from 'robot'.*use one of human"):
        record_doc({"conversations": [{"from": "robot", "value": "q"}]}, "x", "sharegpt")


def test_reasoning_content_is_written_as_a_think_block() -> None:
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning_content": "Add."}]
    assert record_doc({"messages": messages}, "x", "auto")[1]["content"] == "<think>\nAdd.\n</think>\n\n4"


def test_every_shape_prepares_and_trains_the_answer_with_its_input(tmp_path: Path) -> None:
    rows = [{"instruction": f"Echo the word {i}.", "input": f"w{i}", "output": f"w{i} w{i}"} for i in range(30)]
    meta = prepare([write(tmp_path / "a.jsonl", rows)], tmp_path / "a", seq_len=64, vocab_size=300, val_fraction=0.1)
    assert meta["format"] == "chat" and sum(meta["n_docs"].values()) == 30
    docs = [d.value for d in iter_docs([str(tmp_path / "a.jsonl")])]
    assert docs[3][0]["content"] == "Echo the word 3.\nw3"  # the input is not dropped
    share = [
        {"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]} for i in range(30)
    ]
    meta = prepare([write(tmp_path / "s.jsonl", share)], tmp_path / "s", seq_len=64, vocab_size=300, val_fraction=0.1)
    assert meta["format"] == "chat" and sum(meta["n_docs"].values()) == 30


def test_an_unknown_shape_is_one_line_naming_its_keys(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = write(tmp_path / "u.jsonl", [{"question": "q", "answer": "a"}])
    assert main(["--input", path, "--out", str(tmp_path / "o"), "--format", "chat"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "keys: ['answer', 'question']" in err and "'conversations'" in err
    assert "--columns" in err
