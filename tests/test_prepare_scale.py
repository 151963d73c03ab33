"""Corpus-scale prepare (issue 16): worker-count determinism, shards, old format, bad input, kill safety, val rows."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from deepzero.data import PackedDataset, load_meta, stdlib_corpus, train_tokenizer
from deepzero.data.prepare import main, prepare
from deepzero.data.writer import split_of
from deepzero.errors import UserError

REPO = Path(__file__).resolve().parent.parent
CHATS = [
    [
        {"role": "user", "content": f"What is {i} times three?"},
        {"role": "assistant", "content": f"{3 * i}."},
        {"role": "user", "content": "Sure?"},
        {"role": "assistant", "content": f"Yes, {i} times three is {3 * i}."},
    ]
    for i in range(2000)
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 1 MB of standard-library source as separate files."""
    d = tmp_path_factory.mktemp("corpus")
    for f in stdlib_corpus(max_bytes=1_000_000):
        shutil.copy(f, d / f.name)
    return d


@pytest.fixture(scope="module")
def tok_dir(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(sorted(corpus.iterdir())[:20], vocab_size=512, out_dir=out)
    return out


@pytest.fixture(scope="module")
def chats(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))
    return path


def _files(d: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(d.glob("*.bin"))}


def _meta(d: Path) -> dict:
    return {k: v for k, v in json.loads((d / "meta.json").read_text()).items() if "seconds" not in k}


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_one_and_three_workers_write_identical_shards(
    kind: str, corpus: Path, chats: Path, tok_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # dozens of batches, finishing out of order
    monkeypatch.setattr("deepzero.data.tokenize_workers.BATCH_BYTES", 20_000)
    inputs, seq_len = ([str(corpus)], 32) if kind == "text" else ([str(chats)], 128)
    args = dict(tokenizer=str(tok_dir), seq_len=seq_len, val_fraction=0.1, shard_mb=0.05)
    one = prepare(inputs, tmp_path / "one", workers=1, **args)
    prepare(inputs, tmp_path / "three", workers=3, **args)
    shards = one["shards"]["train"]
    assert len(shards) >= 2 and all(s["rows"] <= 0.05 * 2**20 // ((seq_len + 1) * 2) for s in shards)
    assert one["n_docs"]["val"] > 0 and one["n_rows"]["val"] > 0
    assert _files(tmp_path / "one") == _files(tmp_path / "three")
    assert _meta(tmp_path / "one") == _meta(tmp_path / "three")
    if kind == "chat":
        assert len(list((tmp_path / "one").glob("train-*.mask.bin"))) == len(shards)
        assert one["mask_bits"] == {"target": 1, "doc_start": 2}


def test_many_shards_read_like_one(corpus: Path, tok_dir: Path, tmp_path: Path) -> None:
    args = dict(tokenizer=str(tok_dir), seq_len=32, val_fraction=0.1, workers=2)
    prepare([str(corpus)], tmp_path / "big", **args)
    meta = prepare([str(corpus)], tmp_path / "small", shard_mb=0.05, **args)
    assert len(meta["shards"]["train"]) > 3 and len(load_meta(tmp_path / "big")["shards"]["train"]) == 1
    big, small = PackedDataset(tmp_path / "big", "train"), PackedDataset(tmp_path / "small", "train")
    small = pickle.loads(pickle.dumps(small))  # what a DataLoader worker gets
    assert len(big) == len(small) == meta["n_rows"]["train"]
    edges = np.cumsum([s["rows"] for s in meta["shards"]["train"]])
    for i in sorted({0, 1, len(big) - 1, *(edges[:-1] - 1).tolist(), *edges[:-1].tolist()}):
        a, b = big[i], small[i]
        assert all(torch.equal(a[k], b[k]) for k in a), i
    with pytest.raises(IndexError):
        small[len(small)]


def test_old_format_folder_is_one_clear_error(corpus: Path, tok_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "data"
    prepare([str(corpus)], out, tokenizer=str(tok_dir), seq_len=32, workers=1)
    meta = json.loads((out / "meta.json").read_text())
    meta["format_version"] = 1
    (out / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=r"meta\.json: written in data format 1, this code reads format 2.*re-run"):
        load_meta(out)
    del meta["format_version"]
    (out / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="data format 1") as err:
        PackedDataset(out, "train")
    assert "\n" not in str(err.value)


def _bad_inputs(root: Path, tok_dir: Path) -> tuple[list[str], Path]:
    """Three good inputs and three bad ones: an unreadable file, invalid UTF-8 on line 3, bad JSON on line 1000."""
    good = root / "good"
    good.mkdir()
    for i, f in enumerate(stdlib_corpus(max_bytes=200_000)[:4]):
        shutil.copy(f, good / f"{i}.py")
    (good / "latin1.txt").write_bytes(b"first\nsecond\nna\xefve caf\xe9\n")
    (good / "locked.txt").write_text("you may not read me")
    lines = [json.dumps({"text": f"record {i} " * 20}) for i in range(999)] + ["{not json"]
    (root / "big.jsonl").write_text("\n".join([*lines, json.dumps({"text": "after the bad line"})]) + "\n")
    return [str(good), str(root / "big.jsonl")], good / "locked.txt"


def test_bad_input_stops_with_one_line_or_is_skipped_and_counted(
    tok_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    inputs, locked = _bad_inputs(tmp_path, tok_dir)
    read_bytes = Path.read_bytes

    def unreadable(self: Path) -> bytes:
        if self == locked:
            raise PermissionError(13, "Permission denied")
        return read_bytes(self)

    monkeypatch.setattr(Path, "read_bytes", unreadable)  # as root, chmod 000 would not stop a read
    out = tmp_path / "out"
    args = dict(tokenizer=str(tok_dir), seq_len=32, val_fraction=0.2, workers=2)
    before = prepare([str(tmp_path / "good" / "0.py"), str(tmp_path / "good" / "1.py")], out, **args)
    with pytest.raises(UserError, match=r"latin1\.txt:3: line 3 is not UTF-8 text .*--skip-bad"):
        prepare(inputs, out, **args)
    shutil.move(tmp_path / "good" / "latin1.txt", tmp_path / "latin1.txt")
    with pytest.raises(UserError, match=r"locked\.txt: cannot be read \(Permission denied\)"):
        prepare(inputs, out, **args)
    locked.unlink()
    capsys.readouterr()
    assert main(["--input", *inputs, "--tokenizer", str(tok_dir), "--seq-len", "32", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and "big.jsonl:1000: line 1000 is not valid JSON" in err
    assert _meta(out) == {k: v for k, v in before.items() if "seconds" not in k}  # the earlier dataset is untouched
    assert not list(tmp_path.glob(".out.*"))

    locked.write_text("you may not read me")
    shutil.move(tmp_path / "latin1.txt", tmp_path / "good" / "latin1.txt")
    meta = prepare(inputs, out, skip_bad=True, **args)
    assert meta["skipped"]["count"] == 3
    assert [line.split(": ")[0].rsplit("/", 1)[-1] for line in meta["skipped"]["first"]] == [
        "latin1.txt:3",
        "locked.txt",
        "big.jsonl:1000",
    ]
    assert sum(meta["n_docs"].values()) == 4 + 999 + 1
    assert "3 bad input(s) skipped" in capsys.readouterr().out


def test_killed_prepare_publishes_nothing_and_reruns(corpus: Path, tok_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "data"
    first = prepare([str(corpus)], out, tokenizer=str(tok_dir), seq_len=32, workers=1)
    big = tmp_path / "big"
    big.mkdir()
    for k in range(16):  # ~16 MB: seconds of tokenizing even on a fast core
        for f in corpus.iterdir():
            (big / f"{k}-{f.name}").write_bytes(f.read_bytes())
    cmd = [sys.executable, "data/prepare.py", "--input", str(big), "--tokenizer", str(tok_dir)]
    cmd += ["--seq-len", "32", "--workers", "1", "--shard-mb", "0.05", "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".data.tmp-*/*.bin")) and time.monotonic() < deadline:
        time.sleep(0.01)  # killed as soon as its first shard is written: into the tokenizing, whatever the CPU's speed
    assert proc.poll() is None, "prepare finished before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert list(tmp_path.glob(".data.tmp-*"))  # what it had written so far stayed in its temp folder
    assert _meta(out) == {k: v for k, v in first.items() if "seconds" not in k}
    again = prepare([str(big)], out, tokenizer=str(tok_dir), seq_len=32, workers=2, shard_mb=0.05)
    assert again["n_docs"]["train"] > first["n_docs"]["train"] and load_meta(out) == again
    assert not list(tmp_path.glob(".data.tmp-*"))  # the killed run's temp folder is cleaned up


def test_val_gets_a_row_even_when_no_document_hashes_into_it(tok_dir: Path, tmp_path: Path) -> None:
    texts = [f.read_text() for f in stdlib_corpus(max_bytes=100_000)[:6]]
    assert all(split_of(t, seed=0, val_fraction=0.01) == "train" for t in texts)
    paths = []
    for i, t in enumerate(texts):
        paths.append(tmp_path / f"{i}.txt")
        paths[-1].write_text(t)
    meta = prepare(list(map(str, paths)), tmp_path / "out", tokenizer=str(tok_dir), seq_len=32, val_fraction=0.01)
    assert meta["n_docs"] == {"train": 5, "val": 1} and meta["n_rows"]["val"] > 0  # the last document moved
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    val = PackedDataset(tmp_path / "out", "val", documents=False)
    assert val[0]["input_ids"].tolist() == tok(texts[-1], add_special_tokens=False)["input_ids"][:32]
    (tmp_path / "tiny").mkdir()
    for i in range(2):
        (tmp_path / "tiny" / f"{i}.txt").write_text(f"x = {i}\n")
    with pytest.raises(UserError, match="train split: holds less than one row of 33 tokens"):
        prepare([str(tmp_path / "tiny")], tmp_path / "out2", tokenizer=str(tok_dir), seq_len=32)


def test_cli_shows_progress_and_summary(corpus: Path, tok_dir: Path, tmp_path: Path) -> None:
    cmd = [sys.executable, "data/prepare.py", "--input", str(corpus), "--tokenizer", str(tok_dir)]
    cmd += ["--seq-len", "32", "--workers", "2", "--out", str(tmp_path / "d")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "B/s" in proc.stderr and "M tok/s" in proc.stderr and "100%" in proc.stderr
    summary = proc.stdout.splitlines()[-7:]
    assert summary[0].startswith("prepare: wrote") and "with 2 worker(s)" in summary[-1]
    assert len(proc.stdout.splitlines()) < 25


def test_a_worker_that_dies_fails_the_run_instead_of_hanging(
    corpus: Path, tok_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # forked in
    monkeypatch.setattr("deepzero.data.tokenize_workers.Encoder.__call__", lambda self, values: os._exit(9))
    with pytest.raises(UserError, match="--workers: a tokenizer process died"):
        prepare([str(corpus)], tmp_path / "out", tokenizer=str(tok_dir), seq_len=32, workers=2)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))
