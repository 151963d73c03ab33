"""GRPO's data: ``prepare --format prompts`` (string and message-list prompts with DeepSeek's real chat template,
every other field kept per record), the PromptDataset (items, left-padded collate, records), bad records, and
``--columns`` for every format (prompts, chat, preference, and TRL's prompt-completion SFT layout)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from deepzero.data import PromptDataset, load_meta, open_split
from deepzero.data.prepare import main, prepare
from deepzero.data.tokenizer import main as tokenizer_main
from deepzero.errors import UserError

SEQ_LEN, MAX_COMPLETION = 96, 40


def make_records(n: int) -> list[dict]:
    """GSM8K's layout (``question``/``answer``) plus an extra column; odd records have message-list prompts."""
    out = []
    for i in range(n):
        q = f"What is {i} plus {i * 3}?"
        question = (
            [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": q}] if i % 2 else q
        )
        out.append({"question": question, "answer": f"{i} + {i * 3} = {4 * i}\n#### {4 * i}", "tests": [i, {"k": "v"}]})
    return out


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSeek's published tokenizer and chat template, offline (data/tokenizer.py deepseek)."""
    out = tmp_path_factory.mktemp("deepseek") / "tokenizer"
    assert tokenizer_main(["deepseek", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def tok(tok_dir: Path):
    return AutoTokenizer.from_pretrained(tok_dir)


@pytest.fixture(scope="module")
def prompts(tok_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("prompts")
    records = make_records(24)
    jsonl = write_jsonl(root / "gsm.jsonl", records)
    kwargs = {"tokenizer": str(tok_dir), "seq_len": SEQ_LEN, "val_fraction": 0.25, "workers": 1}
    meta = prepare([str(jsonl)], root / "data", fmt="prompts", max_completion_length=MAX_COMPLETION,
                   columns={"prompt": "question"}, **kwargs)  # fmt: skip
    return {"root": root, "records": records, "jsonl": jsonl, "meta": meta, "data": root / "data"}


def expected_ids(tok, question: str | list) -> list[int]:
    """What TRL's GRPOTrainer tokenizes: a string with the tokenizer's special tokens, messages by the template."""
    if isinstance(question, str):
        return tok(question)["input_ids"]
    return list(
        tok.apply_chat_template(question, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    )


def test_prepare_prompts_writes_each_prompts_ids_and_keeps_every_other_field(prompts: dict, tok) -> None:
    meta = load_meta(prompts["data"])
    assert meta["format"] == "prompts" and meta["seq_len"] == SEQ_LEN
    assert (meta["max_prompt_len"], meta["max_completion_length"]) == (SEQ_LEN - MAX_COMPLETION, MAX_COMPLETION)
    assert meta["record_fields"] == ["answer", "tests"] and meta["n_rows"]["val"] > 0
    seen = []
    for split in ("train", "val"):
        ds = open_split(prompts["data"], split, vocab_size=len(tok))
        assert isinstance(ds, PromptDataset) and ds.rows_per_sample == 1 and len(ds) == meta["n_rows"][split]
        for i in range(len(ds)):
            item, fields = ds[i], ds.record(i)
            source = next(r for r in prompts["records"] if r["answer"] == fields["answer"])
            assert item["index"] == i and item["prompt_ids"].dtype == torch.long
            assert item["prompt_ids"].tolist() == expected_ids(tok, source["question"])
            assert fields == {"answer": source["answer"], "tests": source["tests"]}
            text = ds.prompt_text(i)
            if isinstance(source["question"], str):
                assert text == source["question"]
            else:  # DeepSeek's template: bos, system, user turn, then the assistant marker to generate after
                assert text.startswith("<｜begin▁of▁sentence｜>Answer with a number.<｜User｜>")
                assert text.endswith(f"{source['question'][1]['content']}<｜Assistant｜>")
            seen.append(source["answer"])
    assert sorted(seen) == sorted(r["answer"] for r in prompts["records"])


def test_collate_left_pads_with_the_pad_id_and_masks_the_prompt(prompts: dict) -> None:
    ds = open_split(prompts["data"], "train")
    items = [ds[i] for i in range(4)]
    batch = ds.collate(items)
    width = max(len(it["prompt_ids"]) for it in items)
    assert batch["prompt_ids"].shape == batch["prompt_mask"].shape == (4, width)
    assert batch["prompt_mask"].dtype == torch.bool and batch["index"].tolist() == [0, 1, 2, 3]
    for r, it in enumerate(items):
        n = len(it["prompt_ids"])
        assert batch["prompt_ids"][r, width - n :].tolist() == it["prompt_ids"].tolist()
        assert (batch["prompt_ids"][r, : width - n] == ds.meta["pad_id"]).all()
        assert batch["prompt_mask"][r].tolist() == [False] * (width - n) + [True] * n
    assert len({len(it["prompt_ids"]) for it in items}) > 1  # string and message prompts differ in length


def test_prompt_ids_past_the_vocabulary_stop_in_one_line(prompts: dict) -> None:
    ds = open_split(prompts["data"], "train", vocab_size=100)
    with pytest.raises(UserError, match=r"train-00000\.bin: row 0 \(train row 0\) holds token id \d+"):
        ds[0]


BAD = {
    "no prompt": ({"answer": "1"}, "record has no 'prompt'"),
    "empty prompt": ({"question": " ", "answer": "1"}, "'prompt' is empty"),
    "wrong type": ({"question": 7, "answer": "1"}, "'prompt' is neither a string nor"),
    "not an object": ("[1, 2]", "is not a JSON object"),
    "not json": ("{nope", "is not valid JSON"),
    "too long": ({"question": "word " * 80, "answer": "1"}, "longer than max_prompt_len 56 (--seq-len 96 - "),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_prompt_record_is_one_line_naming_file_and_line_or_skipped(
    prompts: dict, tok_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture, case: str
) -> None:
    record, problem = BAD[case]
    records = prompts["records"]
    jsonl = write_jsonl(tmp_path / "p.jsonl", [*records[:5], record, *records[5:12]])
    argv = ["--format", "prompts", "--input", str(jsonl), "--tokenizer", str(tok_dir), "--seq-len", str(SEQ_LEN),
            "--max-completion-length", str(MAX_COMPLETION), "--columns", "prompt=question", "--out",
            str(tmp_path / "out"), "--workers", "1"]  # fmt: skip
    assert main(argv) == 2 and not (tmp_path / "out").exists()
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {jsonl}:6: ") and problem in lines[0], lines
    assert main([*argv, "--skip-bad"]) == 0
    meta = load_meta(tmp_path / "out")
    assert meta["skipped"]["count"] == 1 and meta["skipped"]["first"][0].startswith(f"{jsonl}:6: ")
    assert sum(meta["n_rows"].values()) == 12


def test_max_completion_length_defaults_to_half_and_is_checked(prompts: dict, tok_dir: Path, tmp_path: Path) -> None:
    jsonl = str(prompts["jsonl"])
    meta = prepare([jsonl], tmp_path / "d", tokenizer=str(tok_dir), seq_len=128, fmt="prompts", workers=1,
                   columns={"prompt": "question"})  # fmt: skip
    assert (meta["max_completion_length"], meta["max_prompt_len"]) == (64, 64)
    with pytest.raises(UserError, match=r"--max-completion-length: must be between 1 and --seq-len - 1 = 127"):
        prepare([jsonl], tmp_path / "e", tokenizer=str(tok_dir), seq_len=128, fmt="prompts", max_completion_length=128)
    with pytest.raises(UserError, match=r"--max-completion-length: applies to --format prompts only"):
        prepare([jsonl], tmp_path / "e", tokenizer=str(tok_dir), seq_len=128, fmt="chat", max_completion_length=8)


def test_val_input_is_the_val_split_of_prompts(prompts: dict, tok_dir: Path, tmp_path: Path) -> None:
    records = prompts["records"]
    train = write_jsonl(tmp_path / "train.jsonl", records[:16])
    test = write_jsonl(tmp_path / "test.jsonl", records[16:])
    prepare([str(train)], tmp_path / "d", tokenizer=str(tok_dir), seq_len=SEQ_LEN, fmt="prompts", workers=1,
            columns={"prompt": "question"}, val_inputs=[str(test)])  # fmt: skip
    answers = {s: [open_split(tmp_path / "d", s).record(i)["answer"] for i in range(8 if s == "val" else 16)]
               for s in ("train", "val")}  # fmt: skip
    assert answers == {"train": [r["answer"] for r in records[:16]], "val": [r["answer"] for r in records[16:]]}


def test_the_dataset_refuses_a_records_file_that_does_not_match_its_rows(prompts: dict, tmp_path: Path) -> None:
    folder = tmp_path / "copy"
    import shutil

    shutil.copytree(prompts["data"], folder)
    lines = (folder / "train.records.jsonl").read_text().splitlines(keepends=True)
    (folder / "train.records.jsonl").write_text("".join(lines[:-1]))
    with pytest.raises(UserError, match=r"train\.records\.jsonl: holds \d+ records for \d+ prompt rows"):
        open_split(folder, "train").record(0)
    assert np.array_equal(
        open_split(folder, "train")[0]["prompt_ids"], open_split(prompts["data"], "train")[0]["prompt_ids"]
    )


# --- --columns and TRL's prompt-completion layout for SFT ------------------------------------------------------------


def rows_of(folder: Path) -> list[tuple[list[int], list[int]]]:
    """Every (input_ids, labels) of both splits, in order."""
    out = []
    for split in ("train", "val"):
        ds = open_split(folder, split)
        out += [(ds[i]["input_ids"].tolist(), ds[i]["labels"].tolist()) for i in range(len(ds))]
    return out


CONVERSATIONS = [
    [{"role": "user", "content": f"Name number {i}."}, {"role": "assistant", "content": f"Number {i}, friend."}]
    for i in range(12)
]


def test_columns_map_the_fields_of_chat_and_preference(tok_dir: Path, tmp_path: Path) -> None:
    kwargs = {"tokenizer": str(tok_dir), "seq_len": 64, "val_fraction": 0.25, "workers": 1}
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"messages": c} for c in CONVERSATIONS])
    mine = write_jsonl(tmp_path / "mine.jsonl", [{"dialog": c, "id": i} for i, c in enumerate(CONVERSATIONS)])
    prepare([str(plain)], tmp_path / "a", fmt="chat", **kwargs)
    meta = prepare([str(mine)], tmp_path / "b", fmt="chat", columns={"messages": "dialog"}, **kwargs)
    assert meta["columns"] == {"messages": "dialog"} and rows_of(tmp_path / "a") == rows_of(tmp_path / "b")
    with pytest.raises(
        UserError,
        match=r"mine\.jsonl:1: record has no 'messages' field \(nor 'conversations', 'instruction' and 'output', 'prompt' and 'completion'\) \(keys: \['dialog', 'id'\]\)",
    ):
        prepare([str(mine)], tmp_path / "c", fmt="chat", **kwargs)
    pairs = [{"prompt": f"Say {i}.", "chosen": f"{i}.", "rejected": f"{i + 1}?"} for i in range(12)]
    renamed = [{"question": p["prompt"], "good": p["chosen"], "bad": p["rejected"]} for p in pairs]
    kwargs["val_fraction"] = 0.3
    prepare([str(write_jsonl(tmp_path / "p.jsonl", pairs))], tmp_path / "pa", fmt="preference", **kwargs)
    prepare([str(write_jsonl(tmp_path / "q.jsonl", renamed))], tmp_path / "pb", fmt="preference",
            columns={"prompt": "question", "chosen": "good", "rejected": "bad"}, **kwargs)  # fmt: skip
    assert rows_of(tmp_path / "pa") == rows_of(tmp_path / "pb")


def test_prompt_completion_sft_trains_only_the_completion(tok_dir: Path, tok, tmp_path: Path) -> None:
    kwargs = {"tokenizer": str(tok_dir), "seq_len": 64, "val_fraction": 0.25, "workers": 1}
    as_messages = write_jsonl(tmp_path / "m.jsonl", [{"messages": c} for c in CONVERSATIONS])
    as_lists = write_jsonl(tmp_path / "l.jsonl", [{"prompt": c[:1], "completion": c[1:]} for c in CONVERSATIONS])
    as_strings = [{"prompt": c[0]["content"], "completion": c[1]["content"]} for c in CONVERSATIONS]
    prepare([str(as_messages)], tmp_path / "m", fmt="chat", **kwargs)
    prepare([str(as_lists)], tmp_path / "l", **kwargs)  # --format auto finds the layout
    prepare([str(write_jsonl(tmp_path / "s.jsonl", as_strings))], tmp_path / "s", fmt="chat", **kwargs)
    assert rows_of(tmp_path / "m") == rows_of(tmp_path / "l") == rows_of(tmp_path / "s")
    # a multi-turn prompt: its own assistant turn is context, only the completion is a target
    turns = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello there, human."},
             {"role": "user", "content": "Count to three."}]  # fmt: skip
    records = [{"prompt": turns, "completion": [{"role": "assistant", "content": f"One, two, three ({i})."}]}
               for i in range(8)]  # fmt: skip
    src = write_jsonl(
        tmp_path / "multi.jsonl", [{"question": r["prompt"], "completion": r["completion"]} for r in records]
    )
    prepare([str(src)], tmp_path / "multi", fmt="chat", columns={"prompt": "question"}, **kwargs)
    ds = open_split(tmp_path / "multi", "train")
    labels = ds[0]["labels"]
    targets = tok.decode(labels[labels != -100])
    assert "One, two, three (" in targets and "Hello there" not in targets and "Count to three" not in targets
    with pytest.raises(UserError, match=r"multi\.jsonl:1: 'completion' is neither a non-empty string nor a list"):
        prepare([str(write_jsonl(tmp_path / "multi.jsonl", [{"prompt": "q", "completion": ""}] * 4))],
                tmp_path / "bad", fmt="chat", **kwargs)  # fmt: skip
