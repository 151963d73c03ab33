"""Data pipeline: tokenizer, sources, prepare (text and chat SFT), dataset, sampler, loaders, and the HF loss."""

from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from deepzero.data import (
    IGNORE_INDEX,
    GlobalBatchSampler,
    PackedDataset,
    check_enough_rows,
    eval_indices,
    eval_sample,
    iter_docs,
    load_meta,
    make_eval_loader,
    make_train_loader,
    read_corpus,
    stdlib_corpus,
    train_tokenizer,
)
from deepzero.data.prepare import main, prepare
from deepzero.data.tokenizer import CHAT_TEMPLATE
from deepzero.data.writer import doc_prefix, split_of
from deepzero.errors import UserError

REPO = Path(__file__).resolve().parent.parent
CHATS = [
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": f"What is {i} plus {i}?"},
        {"role": "assistant", "content": f"It is {2 * i}."},
    ]
    if i % 2
    else [
        {"role": "user", "content": f"Name number {i}."},
        {"role": "assistant", "content": f"Number {i}."},
        {"role": "user", "content": "And the next one?"},
        {"role": "assistant", "content": f"That is {i + 1}, my friend."},
    ]
    for i in range(12)
]


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with copies of the first ~300 KB of the stdlib corpus."""
    d = tmp_path_factory.mktemp("corpus")
    for f in stdlib_corpus(max_bytes=300_000):
        shutil.copy(f, d / f.name)
    return d


@pytest.fixture(scope="module")
def tok_dir(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(sorted(corpus_dir.iterdir()), vocab_size=512, out_dir=out)
    return out


@pytest.fixture(scope="module")
def text_data(corpus_dir: Path, tok_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("text") / "data"
    prepare([str(corpus_dir)], out, tokenizer=str(tok_dir), seq_len=64, val_fraction=0.1)
    return out


@pytest.fixture(scope="module")
def chat_jsonl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("chat") / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))
    return path


@pytest.fixture(scope="module")
def chat_data(chat_jsonl: Path, tok_dir: Path) -> Path:
    out = chat_jsonl.parent / "data"
    prepare([str(chat_jsonl)], out, tokenizer=str(tok_dir), seq_len=96, val_fraction=0.25)
    return out


# --- tokenizer ---------------------------------------------------------------------------------------------------


def test_stdlib_corpus_is_sorted_filtered_and_capped() -> None:
    files = stdlib_corpus(max_bytes=200_000)
    assert files == sorted(files) and files
    assert sum(f.stat().st_size for f in files) <= 200_000
    assert not any({"test", "tests", "site-packages", "idlelib"} & set(f.parts) for f in stdlib_corpus())


def test_tokenizer_round_trip_reload_and_determinism(corpus_dir: Path, tok_dir: Path, tmp_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tok_dir)
    assert len(tok) == 512
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    text = "def f(x):\n    return x + 1  # héllo ✓\n"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.convert_tokens_to_ids("<|assistant|>") != tok.unk_token_id
    chat = [{"role": "user", "content": "hi"}]
    prompt = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|bos|><|user|>\nhi<|eos|><|assistant|>\n"
    again = train_tokenizer(sorted(corpus_dir.iterdir()), vocab_size=512, out_dir=tmp_path)
    assert again.backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()


# --- sources -----------------------------------------------------------------------------------------------------


def test_missing_file_and_empty_input_errors_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(UserError, match=r"nope\.txt"):
        read_corpus([str(missing)])
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(UserError, match="no non-empty documents"):
        read_corpus([str(empty)])
    with pytest.raises(UserError, match=r"--tokenizer \S+no-tok: no such tokenizer folder"):
        prepare([str(empty)], tmp_path / "out", tokenizer=str(tmp_path / "no-tok"))
    with pytest.raises(UserError, match=r"unsupported file type '\.csv'"):
        (tmp_path / "a.csv").write_text("x")
        read_corpus([str(tmp_path / "a.csv")])


def test_bad_jsonl_errors_name_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"body": "no text"}\n')
    with pytest.raises(UserError, match=r"bad\.jsonl:2: .*no 'text' or 'messages' field"):
        read_corpus([str(path)])
    path.write_text('{"text": "fine"}\n\n{not json\n')
    with pytest.raises(UserError, match=r"bad\.jsonl:3: line 3 is not valid JSON"):
        read_corpus([str(path)])
    path.write_text('{"messages": [{"role": "user"}]}\n')
    with pytest.raises(UserError, match=r"bad\.jsonl:1: 'messages'"):
        read_corpus([str(path)])
    path.write_text('{"text": "a"}\n{"messages": [{"role": "user", "content": "b"}]}\n')
    with pytest.raises(UserError, match="mix plain text and chat"):
        read_corpus([str(path)])
    with pytest.raises(UserError, match=r"bad\.jsonl:2: record has no 'text' field"):
        read_corpus([str(path)], fmt="text")


def test_parquet_and_hf_datasets_stream(tmp_path: Path) -> None:
    from datasets import Dataset

    Dataset.from_dict({"text": ["one", "two"], "id": [1, 2]}).to_parquet(tmp_path / "t.parquet")
    corpus = read_corpus([str(tmp_path / "t.parquet")])
    assert (corpus.docs, corpus.format) == (["one", "two"], "text")
    Dataset.from_dict({"messages": [CHATS[0], CHATS[1]]}).to_parquet(tmp_path / "c.parquet")
    corpus = read_corpus([str(tmp_path / "c.parquet")])
    assert (corpus.docs, corpus.format) == ([CHATS[0], CHATS[1]], "chat")
    Dataset.from_dict({"body": ["x"]}).to_parquet(tmp_path / "b.parquet")
    with pytest.raises(UserError, match=r"b\.parquet.*no 'text' or 'messages' column"):
        read_corpus([str(tmp_path / "b.parquet")])
    (tmp_path / "hub").mkdir()  # hf:NAME streams through datasets.load_dataset(streaming=True); a local folder here
    Dataset.from_dict({"text": ["three", "", "four"]}).to_parquet(tmp_path / "hub" / "train.parquet")
    docs = list(iter_docs([f"hf:{tmp_path / 'hub'}"]))
    assert [(d.value, d.where.rsplit(" ", 2)[1:]) for d in docs] == [("three", ["row", "0"]), ("four", ["row", "2"])]


def test_hf_specs_name_a_config_and_a_split(tmp_path: Path) -> None:
    """hf:NAME:CONFIG[:SPLIT] for data sets with configs (GSM8K's "main"); hf:NAME:SPLIT as before. A local data
    set with two configs declared in its README (what the hub's GSM8K does) stands in for the hub."""
    from datasets import Dataset

    from deepzero.data.sources import HubDataset

    assert HubDataset.parse("hf:openai/gsm8k:main") == HubDataset("openai/gsm8k", "main", "train")
    assert HubDataset.parse("hf:openai/gsm8k:main:test") == HubDataset("openai/gsm8k", "main", "test")
    assert HubDataset.parse("hf:org/name:validation") == HubDataset("org/name", None, "validation")
    assert HubDataset.parse("hf:org/name:train[:10]") == HubDataset("org/name", None, "train[:10]")
    assert HubDataset.parse("hf:org/name") == HubDataset("org/name", None, "train")
    assert HubDataset.parse("hf:HuggingFaceH4/ultrafeedback_binarized:train_prefs").split == "train_prefs"
    assert HubDataset.parse("hf:org/name:test_sft") == HubDataset("org/name", None, "test_sft")
    with pytest.raises(UserError, match=r"hf:a:b:c:d: is not hf:NAME\[:CONFIG\]\[:SPLIT\]"):
        HubDataset.parse("hf:a:b:c:d")
    hub = tmp_path / "gsm"
    for config, texts in (("main", ["m0", "m1"]), ("socratic", ["s0"])):
        (hub / config).mkdir(parents=True)
        Dataset.from_dict({"text": texts}).to_parquet(hub / config / "train.parquet")
        Dataset.from_dict({"text": [f"{config} test"]}).to_parquet(hub / config / "test.parquet")
    configs = "".join(
        f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}/train.parquet\n"
        f"  - split: test\n    path: {c}/test.parquet\n"
        for c in ("main", "socratic")
    )
    (hub / "README.md").write_text(f"---\nconfigs:\n{configs}---\n")
    assert [d.value for d in iter_docs([f"hf:{hub}:socratic"])] == ["s0"]
    assert [d.value for d in iter_docs([f"hf:{hub}:main:test"])] == ["main test"]


# --- prepare: text -----------------------------------------------------------------------------------------------


def test_prepare_text_packs_documents_with_eos(text_data: Path, corpus_dir: Path, tok_dir: Path) -> None:
    meta = load_meta(text_data)
    assert (meta["format"], meta["seq_len"], meta["dtype"], meta["vocab_size"]) == ("text", 64, "uint16", 512)
    assert [s["file"] for s in meta["shards"]["train"]] == ["train-00000.bin"]
    rows = np.fromfile(text_data / "train-00000.bin", dtype=np.uint16).reshape(-1, 65)
    assert rows.shape[0] == meta["n_rows"]["train"] > 0 and meta["n_rows"]["val"] > 0
    assert not (text_data / "train-00000.mask.bin").exists()
    tok = AutoTokenizer.from_pretrained(tok_dir)
    assert meta["doc_prefix_ids"] == [] and tok.bos_token_id is not None  # has a <|bos|> but does not add it
    docs = [d for d in read_corpus([str(corpus_dir)]).docs if split_of(d, seed=0, val_fraction=0.1) == "train"]
    stream = [t for d in docs for t in [*tok(d, add_special_tokens=False)["input_ids"], tok.eos_token_id]]
    assert rows.reshape(-1).tolist() == stream[: rows.size] and tok.bos_token_id not in stream
    item = PackedDataset(text_data, "train", documents=False)[3]
    assert item["input_ids"].tolist() == rows[3, :-1].tolist() and item["labels"].tolist() == rows[3, 1:].tolist()
    assert item["shift_labels"] is item["labels"] and item["input_ids"].dtype == torch.long
    assert item["position_ids"].tolist() == list(range(64))


def test_prepare_is_idempotent_and_reruns_on_change(tmp_path: Path, corpus_dir: Path, capsys) -> None:
    src = tmp_path / "src"
    shutil.copytree(corpus_dir, src)
    out = tmp_path / "out"
    args = dict(tokenizer="train", vocab_size=512, seq_len=64, val_fraction=0.1)
    first = prepare([str(src)], out, **args)
    assert AutoTokenizer.from_pretrained(out / "tokenizer").eos_token == "<|eos|>"
    assert first["tokenizer"] == str((out / "tokenizer").resolve())
    stamp = (out / "train-00000.bin").stat().st_mtime_ns
    capsys.readouterr()
    assert prepare([str(src)], out, **args) == first
    assert "up to date" in capsys.readouterr().out and (out / "train-00000.bin").stat().st_mtime_ns == stamp
    assert prepare([str(src)], out, **{**args, "seq_len": 32})["seq_len"] == 32  # a setting changed
    assert "up to date" not in capsys.readouterr().out
    edited = sorted(src.iterdir())[0]
    edited.write_text(edited.read_text() + "\n# edited\n")  # an input changed
    assert prepare([str(src)], out, **{**args, "seq_len": 32})["fingerprint"] != first["fingerprint"]
    assert "up to date" not in capsys.readouterr().out
    (out / "val-00000.bin").unlink()  # a damaged output is rebuilt
    assert prepare([str(src)], out, **{**args, "seq_len": 32})["n_rows"]["val"] > 0
    assert "up to date" not in capsys.readouterr().out
    # reuse the tokenizer that lives inside the folder being replaced
    meta = prepare([str(src)], out, tokenizer=str(out / "tokenizer"), seq_len=48, val_fraction=0.1)
    assert meta["tokenizer"] == str((out / "tokenizer").resolve()) and (out / "tokenizer" / "tokenizer.json").exists()
    assert not list(tmp_path.glob(".out.*"))  # temp folders cleaned up


def test_prepare_refuses_to_replace_a_foreign_folder(tmp_path: Path, corpus_dir: Path, tok_dir: Path) -> None:
    (tmp_path / "keep.txt").write_text("precious")
    with pytest.raises(UserError, match="not a prepared data folder"):
        prepare([str(corpus_dir)], tmp_path, tokenizer=str(tok_dir), seq_len=64)


def test_cli_main_and_standalone_wrapper(tmp_path: Path, corpus_dir: Path, tok_dir: Path, capsys) -> None:
    out = tmp_path / "cli"
    argv = ["--input", str(corpus_dir), "--tokenizer", str(tok_dir), "--seq-len", "64", "--out", str(out)]
    assert main(argv) == 0 and load_meta(out)["n_rows"]["train"] > 0
    capsys.readouterr()
    assert main(["--input", str(tmp_path / "missing.txt"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "missing.txt: no such file or folder. Fix:" in err
    proc = subprocess.run(
        [sys.executable, "data/prepare.py", *argv], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "up to date" in proc.stdout, proc.stderr


# --- prepare: chat -----------------------------------------------------------------------------------------------


def _pieces(tok, chats: list) -> list[tuple[str, bool]]:
    """Expected rendering of conversations as (text, is_target) runs: only assistant text and its <|eos|>."""
    pieces: list[tuple[str, bool]] = []
    for chat in chats:
        prompt = "<|bos|>"
        for m in chat:
            if m["role"] == "assistant":
                pieces += [(prompt + "<|assistant|>\n", False), (m["content"] + "<|eos|>", True)]
                prompt = ""
            else:
                prompt += f"<|{m['role']}|>\n{m['content']}<|eos|>"
    return pieces


def test_chat_labels_only_assistant_tokens(chat_data: Path, tok_dir: Path) -> None:
    meta = load_meta(chat_data)
    chats = {s: [c for c in CHATS if split_of(c, 0, 0.25) == s] for s in ("train", "val")}
    assert meta["format"] == "chat" and meta["n_docs"] == {s: len(c) for s, c in chats.items()}
    assert 0 < len(chats["val"]) < len(CHATS)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    for split in ("train", "val"):
        ds = PackedDataset(chat_data, split)
        raw = np.fromfile(chat_data / f"{split}-00000.bin", dtype=np.uint16).reshape(len(ds), 97)
        got: list[tuple[str, bool]] = []
        for i in range(len(ds)):
            labels = ds[i]["labels"]
            trained = labels != IGNORE_INDEX
            assert (labels[trained] == torch.from_numpy(raw[i, 1:].astype(np.int64))[trained]).all()
            is_target = [False, *trained.tolist()]
            keep = [j for j, t in enumerate(raw[i]) if t != tok.pad_token_id]
            assert not any(is_target[j] for j in range(97) if j not in keep)  # padding is never trained
            for flag, run in itertools.groupby(keep, key=lambda j: is_target[j]):
                got.append((tok.decode(raw[i, list(run)]), flag))
        assert got == _pieces(tok, chats[split])
        answers = [m["content"] + "<|eos|>" for c in chats[split] for m in c if m["role"] == "assistant"]
        assert [text for text, flag in got if flag] == answers


def test_chat_without_template_names_the_tokenizer(tmp_path: Path, tok_dir: Path, chat_jsonl: Path) -> None:
    plain = tmp_path / "plain-tok"
    shutil.copytree(tok_dir, plain)
    (plain / "chat_template.jinja").unlink()
    assert AutoTokenizer.from_pretrained(plain).chat_template is None
    with pytest.raises(UserError, match=rf"--tokenizer {plain}: has no chat_template.*Fix: use --tokenizer train"):
        prepare([str(chat_jsonl)], tmp_path / "out", tokenizer=str(plain), seq_len=96)


# --- prepare: a given val split (--val-input) ---------------------------------------------------------------------


def _split_tokens(data: Path, split: str, drop: int | None = None) -> list[int]:
    """Every token of the split's shards in row order, without the ``drop`` id (chat padding)."""
    meta = load_meta(data)
    rows = [np.fromfile(data / s["file"], dtype=meta["dtype"]) for s in meta["shards"][split]]
    return [t for t in np.concatenate(rows).tolist() if t != drop]


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_val_input_is_the_val_split_and_nothing_else(
    kind: str, tmp_path: Path, corpus_dir: Path, tok_dir: Path, capsys
) -> None:
    """--val-input FILE: val holds exactly FILE's tokens (tokenized and laid out as train's), train exactly --input's."""
    tok = AutoTokenizer.from_pretrained(tok_dir)
    if kind == "text":
        files = sorted(corpus_dir.iterdir())
        train = tmp_path / "train"
        train.mkdir()
        for f in files[1:]:
            shutil.copy(f, train / f.name)
        val = tmp_path / "held_out.py"
        shutil.copy(files[0], val)
        docs = {"train": [f.read_text() for f in files[1:]], "val": [val.read_text()]}
        seq_len = 64
    else:
        train, val = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
        docs = {"train": CHATS[:8], "val": CHATS[8:]}
        for path, chats in ((train, docs["train"]), (val, docs["val"])):
            path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
        seq_len = 96
    out = tmp_path / "data"
    argv = ["--input", str(train), "--val-input", str(val), "--tokenizer", str(tok_dir)]
    argv += ["--seq-len", str(seq_len), "--out", str(out)]
    assert main(argv) == 0
    assert f"(val from --val-input {val})" in capsys.readouterr().out
    meta = load_meta(out)
    assert (meta["format"], meta["val_inputs"], meta["val_fraction"]) == (kind, [str(val)], None)
    assert meta["split"].startswith("val = every document of val_inputs")
    assert meta["n_docs"] == {s: len(d) for s, d in docs.items()}
    for split, split_docs in docs.items():
        if kind == "text":
            ids = [[*tok(d, add_special_tokens=False)["input_ids"], tok.eos_token_id] for d in split_docs]
        else:
            ids = [
                tok(tok.apply_chat_template(c, tokenize=False), add_special_tokens=False)["input_ids"]
                for c in split_docs
            ]
        expected = [t for d in ids for t in d]
        got = _split_tokens(out, split, drop=tok.pad_token_id if kind == "chat" else None)
        assert got == expected[: len(got)], split  # text rows drop only the stream's last partial row
        assert len(expected) - len(got) <= (seq_len if kind == "text" else 0), split
    assert main(argv) == 0 and "up to date" in capsys.readouterr().out
    with val.open("a") as fh:  # the held-out file is part of the fingerprint
        fh.write("\n" if kind == "text" else json.dumps({"messages": CHATS[0]}) + "\n")
    assert main(argv) == 0 and "up to date" not in capsys.readouterr().out


def test_val_input_refusals_are_one_line(
    tmp_path: Path, corpus_dir: Path, tok_dir: Path, chat_jsonl: Path, capsys
) -> None:
    """--val-input with --val-fraction, with a format of its own, or missing: one line, exit code 2."""
    out = tmp_path / "out"
    base = ["--input", str(corpus_dir), "--tokenizer", str(tok_dir), "--seq-len", "64", "--out", str(out)]
    cases = {
        "error: --val-input and --val-fraction: cannot be used together": ["--val-input", str(corpus_dir), "--val-fraction", "0.1"],
        f"error: --val-input {chat_jsonl}:1: holds chat 'messages' while --input holds plain text": ["--val-input", str(chat_jsonl)],
        f"error: --val-input {tmp_path / 'missing.txt'}: no such file or folder": ["--val-input", str(tmp_path / "missing.txt")],
    }  # fmt: skip
    for start, extra in cases.items():
        assert main([*base, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith(start) and err.count("\n") == 1 and ". Fix: " in err, err
    assert not out.exists()


def test_val_input_holds_the_given_preference_pairs(tmp_path: Path, tok_dir: Path) -> None:
    from deepzero.data.preference import PairEncoder, parse_record

    records = [{"prompt": f"Say {i}.", "chosen": f"{i}.", "rejected": f"No {i}, {i + 1}."} for i in range(10)]
    train, val = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in records[:7]))
    val.write_text("".join(json.dumps(r) + "\n" for r in records[7:]))
    out = tmp_path / "data"
    argv = ["--format", "preference", "--input", str(train), "--val-input", str(val), "--tokenizer", str(tok_dir)]
    assert main([*argv, "--seq-len", "48", "--out", str(out)]) == 0
    meta = load_meta(out)
    assert (
        meta["n_pairs"] == {"train": 7, "val": 3} and meta["val_inputs"] == [str(val)] and meta["val_fraction"] is None
    )
    tok = AutoTokenizer.from_pretrained(tok_dir)
    encoder = PairEncoder(tok, str(tok_dir), doc_prefix(tok))
    for split, recs in (("train", records[:7]), ("val", records[7:])):
        expected = [t for r in recs for ids, _ in encoder.encode(parse_record(r, "")) for t in ids.tolist()]
        assert _split_tokens(out, split, drop=tok.pad_token_id) == expected, split


# --- per-document position_ids ------------------------------------------------------------------------------------


def test_text_rows_restart_positions_after_each_eos(text_data: Path, corpus_dir: Path, tok_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tok_dir)
    eos = tok.eos_token_id
    docs = [d for d in read_corpus([str(corpus_dir)]).docs if split_of(d, seed=0, val_fraction=0.1) == "train"]
    encoded = [tok(d, add_special_tokens=False)["input_ids"] for d in docs]
    ds, stream = PackedDataset(text_data, "train"), PackedDataset(text_data, "train", documents=False)
    restarts = 0
    for i in range(len(ds)):
        item, plain = ds[i], stream[i]
        ids, pos, labels = item["input_ids"], item["position_ids"], item["labels"]
        assert pos.dtype == torch.long and pos.shape == ids.shape == (64,) and pos[0] == 0
        assert torch.equal(ids, plain["input_ids"]) and plain["position_ids"].tolist() == list(range(64))
        after_eos = torch.cat([torch.tensor([False]), ids[:-1] == eos])
        assert torch.equal(pos == 0, after_eos | (torch.arange(64) == 0))  # restarts exactly after each eos
        assert torch.equal(pos[1:][~after_eos[1:]], pos[:-1][~after_eos[1:]] + 1)  # counts up in between
        assert torch.equal(labels == IGNORE_INDEX, ids == eos)  # no target across a document boundary
        kept = labels != IGNORE_INDEX
        assert torch.equal(labels[kept], plain["labels"][kept]) and (plain["labels"] != IGNORE_INDEX).all()
        for k in torch.nonzero(after_eos).flatten().tolist():  # a restart begins one of the documents
            n = int((pos[k:] == torch.arange(64 - k)).cumprod(0).sum())
            assert any(e[:n] == ids[k : k + n].tolist() for e in encoded)
            restarts += 1
    assert restarts >= 5


def test_chat_rows_restart_positions_at_conversation_starts(chat_data: Path, tok_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tok_dir)
    bos, eos = tok.bos_token_id, tok.eos_token_id
    ds, stream = PackedDataset(chat_data, "train"), PackedDataset(chat_data, "train", documents=False)
    mask = np.fromfile(chat_data / "train-00000.mask.bin", dtype=np.uint8).reshape(len(ds), 97)
    raw = np.fromfile(chat_data / "train-00000.bin", dtype=np.uint16).reshape(len(ds), 97)
    assert set(np.unique(mask).tolist()) == {0, 1, 2}
    assert np.array_equal((mask & 2) != 0, raw == bos)  # bit 1 marks each conversation's first token (its <|bos|>)
    several = 0
    for i in range(len(ds)):
        item, plain = ds[i], stream[i]
        ids, pos, labels = item["input_ids"], item["position_ids"], item["labels"]
        starts = (ids == bos) | (torch.arange(96) == 0)
        assert torch.equal(pos == 0, starts)  # eos inside a multi-turn chat does not restart positions
        assert int(((ids == eos) & (pos != 0)).sum()) > int(starts.sum())
        assert torch.equal(pos[1:][~starts[1:]], pos[:-1][~starts[1:]] + 1)  # padding keeps counting
        assert torch.equal(labels, plain["labels"])  # a conversation's start is never a target anyway
        assert plain["position_ids"].tolist() == list(range(96))
        assert (labels[torch.from_numpy(mask[i, 1:] & 1 == 0)] == IGNORE_INDEX).all()
        several += int(starts.sum()) > 1
    assert several > 0  # some rows hold more than one conversation


# --- dataset, sampler, loaders -----------------------------------------------------------------------------------


def test_load_meta_errors(tmp_path: Path, text_data: Path) -> None:
    with pytest.raises(UserError, match=r"no such data folder.*run python data/prepare\.py"):
        load_meta(tmp_path / "none")
    with pytest.raises(UserError, match=r"meta\.json: missing"):
        load_meta(tmp_path)
    broken = tmp_path / "broken"
    shutil.copytree(text_data, broken)
    with (broken / "val-00000.bin").open("r+b") as fh:
        fh.truncate(10)
    with pytest.raises(UserError, match=r"val-00000\.bin: expected \d+ bytes"):
        PackedDataset(broken, "val")
    with pytest.raises(UserError, match="fewer than one global batch of 24"):
        check_enough_rows(10, 24, "train")


def _flat(lists: list[list[int]]) -> list[int]:
    return list(itertools.chain.from_iterable(lists))


def _micro_batches(n_rows: int, micro: int, ga: int, world: int, steps: int, start: int = 0) -> list[list[list[int]]]:
    """For each optimizer step from ``start``: the micro-batches of every rank, in rank-major order."""
    its = [iter(GlobalBatchSampler(n_rows, micro, ga, r, world, seed=7, start_step=start)) for r in range(world)]
    per_rank = [list(itertools.islice(it, steps * ga)) for it in its]
    return [[mb for r in range(world) for mb in per_rank[r][s * ga : (s + 1) * ga]] for s in range(steps)]


def test_sampler_global_batches_do_not_depend_on_world_size() -> None:
    n, steps = 50, 20  # G = 6: 8 steps per epoch, 2 rows dropped per epoch, 20 steps span 3 epochs
    one = _micro_batches(n, 2, 3, world=1, steps=steps)
    three = _micro_batches(n, 2, 1, world=3, steps=steps)
    sampler = GlobalBatchSampler(n, 2, 3, 0, 1, seed=7)
    assert sampler.steps_per_epoch == 8
    for s in range(steps):
        flat_one, flat_three = _flat(one[s]), _flat(three[s])
        assert sorted(flat_one) == sorted(flat_three) == sorted(sampler.global_batch_indices(s))
    for epoch in range(2):
        seen = [i for s in range(epoch * 8, epoch * 8 + 8) for i in _flat(three[s])]
        assert len(seen) == len(set(seen)) == 48
    assert sorted(_flat(one[0])) != sorted(_flat(one[8]))  # a new epoch reshuffles


def test_sampler_resume_matches_uninterrupted_run() -> None:
    full = list(itertools.islice(iter(GlobalBatchSampler(40, 2, 2, 1, 2, seed=3)), 30))
    for k in (0, 3, 9, 12):
        resumed = list(itertools.islice(iter(GlobalBatchSampler(40, 2, 2, 1, 2, seed=3, start_step=k)), 30 - 2 * k))
        assert resumed == full[2 * k :]


def test_loaders(text_data: Path) -> None:
    ds = PackedDataset(text_data, "train")
    loader = make_train_loader(ds, GlobalBatchSampler(len(ds), 4, 2, 0, 1, seed=0))
    batch = next(iter(loader))
    assert batch["input_ids"].shape == batch["shift_labels"].shape == (4, 64)
    val = PackedDataset(text_data, "val")
    shards = [eval_indices(len(val), r, 3) for r in range(3)]
    assert sorted(_flat(shards)) == list(range(len(val)))
    assert sum(len(s) for s in (eval_indices(len(val), r, 3, max_rows=5) for r in range(3))) == min(5, len(val))
    rows = [b["input_ids"] for b in make_eval_loader(val, micro_batch=4, rank=1, world=3)]
    assert torch.equal(torch.cat(rows), torch.stack([val[i]["input_ids"] for i in shards[1]]))


# --- the loss contract with Transformers ---------------------------------------------------------------------------


@pytest.mark.parametrize("data", ["text_data", "chat_data"])
def test_shift_labels_give_next_token_loss_in_deepseek_v3(data: str, request: pytest.FixtureRequest) -> None:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    ds = PackedDataset(request.getfixturevalue(data), "train")
    config = DeepseekV3Config(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).eval()
    batch = torch.utils.data.default_collate([ds[0], ds[1]])
    with torch.no_grad():
        out = model(**batch)
        targets = batch["shift_labels"]
        manual = torch.nn.functional.cross_entropy(out.logits.float().flatten(0, 1), targets.flatten())
        assert torch.allclose(out.loss, manual, atol=1e-6)
        assert model(input_ids=batch["input_ids"], shift_labels=targets).loss is None  # labels switch the loss on
        assert not torch.allclose(model(input_ids=batch["input_ids"], labels=targets).loss, manual)  # shifted twice


# --- bos per document ---------------------------------------------------------------------------------------------


def test_a_tokenizer_that_adds_bos_gets_it_once_per_document_text_and_chat(
    tok_dir: Path, corpus_dir: Path, chat_jsonl: Path, tmp_path: Path
) -> None:
    """The same BPE, saved to add <|bos|> (its post-processor) and with a chat template that writes no bos: every
    text document and every conversation then starts with exactly one bos, at position 0, never a target, and
    the first content token is the bos position's target."""
    tok = AutoTokenizer.from_pretrained(tok_dir)
    tok.add_bos_token = True  # rebuilds the post-processor: <|bos|> $A
    tok.chat_template = CHAT_TEMPLATE.replace("{{ bos_token }}", "")
    tok.save_pretrained(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    bos, eos = tok.bos_token_id, tok.eos_token_id
    assert tok("x")["input_ids"][0] == bos and doc_prefix(tok) == (bos,)

    text = prepare([str(corpus_dir)], tmp_path / "text", tokenizer=str(tmp_path / "tok"), seq_len=64, val_fraction=0.1)
    assert text["doc_prefix_ids"] == [bos]
    docs = [d for d in read_corpus([str(corpus_dir)]).docs if split_of(d, 0, 0.1) == "train"]
    stream = [t for d in docs for t in [bos, *tok(d, add_special_tokens=False)["input_ids"], eos]]
    raw = np.fromfile(tmp_path / "text" / "train-00000.bin", dtype=np.uint16)
    assert raw.tolist() == stream[: raw.size]
    ds = PackedDataset(tmp_path / "text", "train")
    starts = 0
    for i in range(len(ds)):
        ids, pos, labels = (ds[i][k] for k in ("input_ids", "position_ids", "labels"))
        at_bos = ids == bos
        assert torch.equal(pos[1:] == 0, at_bos[1:])  # a document starts at its bos, and only there
        assert (labels[at_bos] == torch.from_numpy(raw.reshape(len(ds), 65)[i, 1:].astype(np.int64))[at_bos]).all()
        assert (labels[at_bos] != IGNORE_INDEX).all() and (labels[at_bos] != bos).all()  # first content token
        assert (labels[:-1][at_bos[1:]] == IGNORE_INDEX).all()  # bos itself is never a target
        starts += int(at_bos.sum())
    assert starts >= 5

    chat = prepare([str(chat_jsonl)], tmp_path / "chat", tokenizer=str(tmp_path / "tok"), seq_len=96, val_fraction=0.25)
    n_chats = sum(split_of(c, 0, 0.25) == "train" for c in CHATS)
    raw = np.fromfile(tmp_path / "chat" / "train-00000.bin", dtype=np.uint16).reshape(-1, 97)
    mask = np.fromfile(tmp_path / "chat" / "train-00000.mask.bin", dtype=np.uint8).reshape(-1, 97)
    assert chat["doc_prefix_ids"] == [bos] and int((raw == bos).sum()) == n_chats  # prepended: the template has none
    assert np.array_equal((mask & 2) != 0, raw == bos) and not (mask[raw == bos] & 1).any()
    with_template_bos = prepare([str(chat_jsonl)], tmp_path / "chat2", tokenizer=str(tok_dir), seq_len=96)
    assert with_template_bos["doc_prefix_ids"] == []  # --tokenizer train's own: nothing added, the template's bos


# --- evaluation sample ----------------------------------------------------------------------------------------------


def test_eval_sample_is_seeded_spread_over_the_split_and_the_same_for_any_world(text_data: Path) -> None:
    n, k = 1000, 24
    sample = eval_sample(n, k, seed=0)
    assert sample == eval_sample(n, k, seed=0) == sorted(set(sample)) and len(sample) == k  # every eval, any resume
    assert sample != list(range(k)) and sample[-1] - sample[0] > n // 2  # not the first rows: over the whole split
    assert sum(i < n // 4 for i in sample) < k // 2 and sum(i >= 3 * n // 4 for i in sample) > 0
    assert eval_sample(n, k, seed=1) != sample and eval_sample(n, None) == eval_sample(n, 5000) == list(range(n))
    assert set(eval_sample(n, 12, seed=0)) < set(sample)  # another world's rounding reads a subset
    for world in (1, 2, 3, 4):
        shares = [eval_indices(n, r, world, k, seed=0) for r in range(world)]
        assert sorted(_flat(shares)) == sample and max(map(len, shares)) - min(map(len, shares)) <= 1
    val = PackedDataset(text_data, "val")
    rows = eval_sample(len(val), 6, seed=3)
    assert rows != list(range(6))
    got = [b["input_ids"] for r in range(3) for b in make_eval_loader(val, 1, r, 3, max_rows=6, seed=3)]
    assert sorted(torch.cat(got).tolist()) == sorted(val[i]["input_ids"].tolist() for i in rows)


# --- token ids against the model's vocabulary ----------------------------------------------------------------------


def _corrupt(src: Path, dst: Path, row: int, column: int, value: int) -> Path:
    """A copy of a prepared folder whose train ``row`` holds ``value`` at ``column``."""
    shutil.copytree(src, dst)
    rows = np.memmap(dst / "train-00000.bin", dtype=np.uint16, mode="r+").reshape(-1, load_meta(dst)["seq_len"] + 1)
    rows[row, column] = value
    rows.flush()
    return dst


def test_rows_past_the_vocabulary_stop_in_one_line_naming_shard_and_row(text_data: Path, tmp_path: Path) -> None:
    bad = _corrupt(text_data, tmp_path / "bad", row=7, column=5, value=600)
    line = rf"{bad / 'train-00000.bin'}: row 7 \(train row 7\) holds token id 600 at column 5, past the model's"
    line += r" vocabulary of 512 ids\. Fix: re-run data/prepare\.py"
    assert PackedDataset(bad, "train")[7]["input_ids"].max() == 600  # unchecked without a vocab size
    ds = PackedDataset(bad, "train", vocab_size=512)
    with pytest.raises(UserError, match=line):
        ds[7]
    assert ds[6]["input_ids"].max() < 512
    sampler = GlobalBatchSampler(len(ds), 2, 1, 0, 2, seed=0)
    step = next(s for s in range(sampler.steps_per_epoch) if 7 in sampler.global_batch_indices(s))
    rank = sampler.global_batch_indices(step).index(7) // 2
    for r in range(2):  # both ranks stop at that step, also the one that does not read row 7 (its peers' check)
        loader = make_train_loader(ds, GlobalBatchSampler(len(ds), 2, 1, r, 2, seed=0), num_workers=1)
        batches = iter(loader)
        for _ in range(step):
            next(batches)
        with pytest.raises(UserError, match=line):  # from the worker process, as a UserError
            next(batches)
    assert rank in (0, 1)
    val = _corrupt(text_data, tmp_path / "val-bad", row=0, column=0, value=0)
    rows = np.memmap(val / "val-00000.bin", dtype=np.uint16, mode="r+").reshape(-1, 65)
    rows[0, 3] = 9999
    rows.flush()
    checked = PackedDataset(val, "val", vocab_size=512)
    assert eval_indices(len(checked), 0, 2)[0] == 0
    with pytest.raises(UserError, match=r"val-00000\.bin: row 0 \(val row 0\) holds token id 9999 at column 3"):
        list(make_eval_loader(checked, 1, 1, 2, num_workers=1))  # rank 1 stops at rank 0's bad row


def test_the_vocabulary_check_costs_microseconds_per_row(text_data: Path) -> None:
    import time

    plain, checked = PackedDataset(text_data, "train"), PackedDataset(text_data, "train", vocab_size=512)
    rows = list(range(len(plain)))
    timings = {}
    for name, ds in (("plain", plain), ("checked", checked)):
        ds[0]
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for i in rows:
                ds[i]
            best = min(best, time.perf_counter() - start)
        timings[name] = best / len(rows)
    start = time.perf_counter()
    checked.check_rows(rows)
    timings["check"] = (time.perf_counter() - start) / len(rows)
    print({k: f"{v * 1e6:.1f} us/row" for k, v in timings.items()})
    assert timings["check"] < 50e-6  # µs beside a training step of the tiny model (~100 ms here)


@pytest.mark.launcher
def test_train_py_stops_every_rank_at_a_row_past_the_vocabulary(tiny_data: Path, tmp_path: Path) -> None:
    """2 ranks through train.py; step 2's micro-batch 2 of rank 1 holds id 600 (vocab 512): every rank prints the
    same one line naming the shard and row, exit code 2, no traceback, before the embedding sees the row."""
    from conftest import cpu_env, launch

    n_rows = load_meta(tiny_data)["n_rows"]["train"]
    row = GlobalBatchSampler(n_rows, 2, 2, 0, 2, seed=0).global_batch_indices(1)[(1 * 2 + 1) * 2]
    bad = _corrupt(tiny_data, tmp_path / "data", row=row, column=9, value=600)
    args = ["--deepspeed_config", "ds_configs/zero2.json", "--data", str(bad), "--out", str(tmp_path / "run")]
    args += ["--max-steps", "3", "--micro-batch", "2", "--grad-accum", "2", "--log-interval", "1"]
    args += ["--eval-interval", "0", "--save-interval", "0", "--no-export"]
    proc = launch(args, nproc=2, env=cpu_env(HF_HUB_OFFLINE="1"), check=False)
    line = (
        f"error: {bad / 'train-00000.bin'}: row {row} (train row {row}) holds token id 600 at column 9, past the"
        " model's vocabulary of 512 ids. Fix: re-run data/prepare.py with the tokenizer of --model (a prepared"
        " shard that changed is corrupted)"
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = re.sub(r"(?=\[rank \d\] )|(?<!\] )(?=error: )", "\n", proc.stderr).splitlines()  # ranks interleave
    assert sorted(x for x in lines if "error: " in x) == sorted([line, f"[rank 1] {line}"]), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "IndexError" not in proc.stderr
    assert [r["step"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "train"] == [1]  # fmt: skip
