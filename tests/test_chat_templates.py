"""R1-Distill as its users run it: a model folder carrying the chat template DeepSeek ships with every R1-Distill
(TRL 1.16's byte-identical copy) prepares reasoning traces with its own tokenizer, keeps the reasoning in the targets
and the user's words out, trains on 3 ranks, and renders GRPO prompts with the shipped prefill."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import launch, records
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
from trl.chat_template_utils import (
    deepseek_r1_distill_chat_template,
    deepseek_r1_distill_training_chat_template,
    deepseekv3_chat_template,
)

from deepzero.data.prepare import prepare
from deepzero.data.tokenizer import deepseek_tokenizer
from deepzero.errors import UserError

SYSTEM = "Answer briefly."


def chats() -> list[list[dict[str, str]]]:
    """Ten single-turn reasoning traces and one two-turn one."""
    out = [
        [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"What is {i} times {i + 3}?"},
            {"role": "assistant", "content": f"<think>\nMultiply {i} by {i + 3}: {i * (i + 3)}.\n</think>\n\n"
             f"It is {i * (i + 3)}."},
        ]
        for i in range(10)
    ]  # fmt: skip
    out.append(
        [
            {"role": "user", "content": "Name a prime."},
            {"role": "assistant", "content": "<think>\nTwo is the smallest.\n</think>\n\n2"},
            {"role": "user", "content": "And an even one?"},
            {"role": "assistant", "content": "<think>\nOnly two is even and prime.\n</think>\n\nAgain 2."},
        ]
    )
    return out


def model_folder(root: Path, template: str) -> Path:
    """A tiny random Qwen2 (R1-Distill-Qwen's architecture) saved with DeepSeek's tokenizer and ``template``."""
    tok = deepseek_tokenizer()
    tok.chat_template = template
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(root)
    tok.save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def r1(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("r1")
    folder = model_folder(root / "model", deepseek_r1_distill_chat_template)
    (root / "chats.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats()))
    meta = prepare([str(root / "chats.jsonl")], root / "data", tokenizer=str(folder), seq_len=128, val_fraction=0.1)
    return {"root": root, "model": folder, "data": root / "data", "meta": meta}


def target_texts(data: Path, tok) -> list[str]:
    """Each stored row's target tokens, decoded run by run."""
    meta = json.loads((data / "meta.json").read_text())
    out = []
    for split in ("train", "val"):
        for shard in meta["shards"][split]:
            ids = np.fromfile(data / shard["file"], dtype=np.uint32).reshape(-1, 129)
            mask = np.fromfile(data / shard["file"].replace(".bin", ".mask.bin"), dtype=np.uint8).reshape(-1, 129)
            for row, bits in zip(ids, mask, strict=True):
                target = (bits & 1).astype(bool)
                edges = np.flatnonzero(np.diff(np.concatenate([[0], target.astype(int), [0]])))
                out += [tok.decode(row[lo:hi]) for lo, hi in zip(edges[::2], edges[1::2], strict=True)]
    return out


def test_the_shipped_template_is_deepseek_s_own() -> None:
    """The fixture's template is the one DeepSeek ships: it strips the reasoning and prefills <think>."""
    tok = deepseek_tokenizer()
    chat = chats()[0]
    shown = tok.apply_chat_template(chat, chat_template=deepseek_r1_distill_chat_template, tokenize=False)
    assert "Multiply" not in shown and "It is 0." in shown
    prompt = tok.apply_chat_template(
        chat[:2], chat_template=deepseek_r1_distill_chat_template, tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<｜Assistant｜><think>\n")


def test_reasoning_is_in_the_targets_and_the_user_s_words_are_not(r1: dict) -> None:
    tok = AutoTokenizer.from_pretrained(r1["model"])
    pieces = target_texts(r1["data"], tok)
    want = [f"<｜Assistant｜>{c[-1]['content']}<｜end▁of▁sentence｜>" for c in chats()]
    assert sorted(pieces) == sorted(want)  # the last turn of each chat, reasoning included, and nothing else
    assert not any("What is" in p or SYSTEM in p or "And an even" in p for p in pieces)
    assert r1["meta"]["chat_template"]["source"].startswith("r1-distill-training")
    n_targets = sum(r1["meta"]["n_target_tokens"].values())
    assert n_targets == sum(len(tok.encode(w, add_special_tokens=False)) for w in want)


def test_earlier_turns_are_rendered_as_at_inference(r1: dict) -> None:
    """The two-turn chat's first answer is stored as the shipped template shows it (no reasoning), untrained."""
    tok = AutoTokenizer.from_pretrained(r1["model"])
    two_turn = chats()[-1]
    shown = tok.apply_chat_template(two_turn[:3], tokenize=False, add_generation_prompt=True)
    assert "Two is the smallest" not in shown
    stored = "".join(
        tok.decode(np.fromfile(r1["data"] / s["file"], dtype=np.uint32))
        for split in ("train", "val")
        for s in r1["meta"]["shards"][split]
    )
    assert shown in stored and "Two is the smallest" not in stored


def test_v3_template_trains_answers_and_names_the_fix_for_reasoning(tmp_path: Path) -> None:
    """V3's shipped template: answers prepare with TRL's V3 training variant; that variant still drops the text up to
    </think>, so reasoning traces stop in one line naming r1-distill-training, which keeps them."""
    folder = model_folder(tmp_path / "v3", deepseekv3_chat_template)
    answers = [[*c[:-1], {**c[-1], "content": c[-1]["content"].split("</think>")[-1]}] for c in chats()]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in answers))
    meta = prepare([str(tmp_path / "a.jsonl")], tmp_path / "a", tokenizer=str(folder), seq_len=128, val_fraction=0.1)
    pieces = target_texts(tmp_path / "a", folder_tok(folder))
    assert meta["chat_template"]["source"].startswith("deepseek-v3-training")
    assert sum("It is" in p for p in pieces) == 10 and not any("What is" in p for p in pieces)
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats()))
    with pytest.raises(UserError, match=r"dropped from the targets.*--chat-template r1-distill-training"):
        prepare([str(tmp_path / "c.jsonl")], tmp_path / "d", tokenizer=str(folder), seq_len=128, val_fraction=0.1)
    prepare(
        [str(tmp_path / "c.jsonl")], tmp_path / "d", tokenizer=str(folder), seq_len=128, val_fraction=0.1,
        chat_template="r1-distill-training",
    )  # fmt: skip
    assert sum("Multiply" in p for p in target_texts(tmp_path / "d", folder_tok(folder))) == 10


def test_a_template_that_drops_the_reasoning_stops_in_one_line_naming_the_override(tmp_path: Path) -> None:
    """R1's template with the prefill removed by hand (the old workaround): unknown to TRL, it drops the reasoning;
    prepare names what was dropped and --chat-template, which then keeps it."""
    by_hand = deepseek_r1_distill_chat_template.replace("{{'<｜Assistant｜><think>\\n'}}", "{{'<｜Assistant｜>'}}")
    assert by_hand != deepseek_r1_distill_chat_template
    folder = model_folder(tmp_path / "m", by_hand)
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats()))
    with pytest.raises(UserError, match="--chat-template r1-distill-training") as err:
        prepare([str(tmp_path / "c.jsonl")], tmp_path / "d", tokenizer=str(folder), seq_len=128, val_fraction=0.1)
    assert "dropped from the targets: the reasoning up to </think>" in str(err.value) and "\n" not in str(err.value)
    (tmp_path / "t.jinja").write_text(deepseek_r1_distill_training_chat_template)
    for override in ("r1-distill-training", str(tmp_path / "t.jinja")):
        meta = prepare(
            [str(tmp_path / "c.jsonl")], tmp_path / override[-5:], tokenizer=str(folder), seq_len=128,
            val_fraction=0.1, chat_template=override,
        )  # fmt: skip
        assert sum("Multiply" in p for p in target_texts(tmp_path / override[-5:], folder_tok(folder))) == 10
        assert meta["chat_template"]["source"] == f"--chat-template {override}"


def folder_tok(folder: Path):
    return AutoTokenizer.from_pretrained(folder)


def test_grpo_prompts_end_with_the_shipped_prefill(r1: dict, tmp_path: Path) -> None:
    rows = [{"prompt": [{"role": "user", "content": f"What is {i}+1?"}], "answer": str(i + 1)} for i in range(8)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare(
        [str(tmp_path / "p.jsonl")], tmp_path / "p", tokenizer=str(r1["model"]), seq_len=64, fmt="prompts",
        val_fraction=0.25, max_completion_length=32,
    )  # fmt: skip
    texts = [json.loads(x)["text"] for x in (tmp_path / "p" / "train.records.jsonl").read_text().splitlines()]
    assert texts and all(t.endswith("<｜Assistant｜><think>\n") for t in texts)


def test_three_ranks_train_on_the_reasoning_traces_in_bf16(r1: dict) -> None:
    """bf16 as on a card (forced: a CPU without native bf16 emulates it); the export's tokenizer carries the shipped
    template unchanged, as Transformers loads it for inference (the training variant only renders the data)."""
    out = r1["root"] / "run"
    launch(
        [
            "--deepspeed_config", "ds_configs/zero2_bf16.json", "--precision", "bf16", "--model", str(r1["model"]),
            "--data", str(r1["data"]), "--out", str(out), "--max-steps", "4", "--lr", "3e-3", "--warmup-steps", "1",
            "--micro-batch", "1", "--grad-accum", "1", "--log-interval", "1", "--eval-interval", "0",
            "--save-interval", "0",
        ]
    )  # fmt: skip
    curve = [r["loss"] for r in records(out)]
    assert len(curve) == 4 and curve[-1] < curve[0]
    assert records(out, "export")[-1]["ok"]
    exported = AutoTokenizer.from_pretrained(out / "hf")
    assert exported.chat_template == deepseek_r1_distill_chat_template


def test_gsm8k_prompts_in_r1_s_math_template_end_with_the_prefill(r1: dict, tmp_path: Path) -> None:
    """GSM8K's layout (question, answer) with --prompt-template r1-math: the user turn carries R1's instruction, the
    rendered prompt ends with the shipped <think> prefill, and the reward reads the gold from the record."""
    rows = [{"question": f"Tom has {i} apples and buys 2. How many?", "answer": f"{i}+2={i + 2}\n#### {i + 2}"}
            for i in range(12)]  # fmt: skip
    (tmp_path / "g.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare(
        [str(tmp_path / "g.jsonl")], tmp_path / "g", tokenizer=str(r1["model"]), seq_len=96, fmt="prompts",
        val_fraction=0.2, max_completion_length=32, columns={"prompt": "question"}, prompt_template="r1-math",
    )  # fmt: skip
    lines = [json.loads(x) for x in (tmp_path / "g" / "train.records.jsonl").read_text().splitlines()]
    assert lines and all(x["text"].endswith("<｜Assistant｜><think>\n") for x in lines)
    assert all("put your final answer within \\boxed{}" in x["prompt"][0]["content"] for x in lines)
    assert all(x["fields"]["answer"].startswith(x["prompt"][0]["content"].split()[2]) for x in lines)
    with pytest.raises(UserError, match="--prompt-template"):
        prepare([str(tmp_path / "g.jsonl")], tmp_path / "h", tokenizer=str(r1["model"]), seq_len=96, fmt="prompts",
                columns={"prompt": "question"}, prompt_template="no placeholder")  # fmt: skip


def test_a_template_flag_on_other_data_is_one_line(r1: dict, tmp_path: Path) -> None:
    """--prompt-template belongs to prompts and --chat-template to chats: with other data each would be ignored;
    a template without {prompt} is the flag's error even with --skip-bad (never every record skipped as bad)."""
    (tmp_path / "t.txt").write_text("plain text " * 50)
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(8)))
    common = {"tokenizer": str(r1["model"]), "seq_len": 64, "val_fraction": 0.25}
    with pytest.raises(UserError, match="--prompt-template: applies to --format prompts"):
        prepare([str(tmp_path / "t.txt")], tmp_path / "a", prompt_template="r1-math", **common)
    with pytest.raises(UserError, match="--chat-template: applies to chat data"):
        prepare([str(tmp_path / "t.txt")], tmp_path / "b", chat_template="r1-distill-training", **common)
    with pytest.raises(UserError, match="--chat-template: applies to chat and preference data, not --format prompts"):
        prepare([str(tmp_path / "p.jsonl")], tmp_path / "c", fmt="prompts", chat_template="r1-distill", **common)
    with pytest.raises(UserError, match="--prompt-template no placeholder: is neither"):
        prepare([str(tmp_path / "p.jsonl")], tmp_path / "d", fmt="prompts", prompt_template="no placeholder",
                skip_bad=True, max_completion_length=32, **common)  # fmt: skip


def test_preference_pairs_keep_both_answers_reasoning_and_a_template_that_drops_it_is_one_line(
    r1: dict, tmp_path: Path
) -> None:
    """DPO pairs of reasoning traces on an R1-Distill folder render with TRL's training variant: each answer's
    reasoning is in its targets, the prompt (ending in the shipped prefill) is not. The V3 template, whose training
    variant still drops the reasoning, stops in one line naming --chat-template; with it the pairs prepare."""
    pairs = [
        {"prompt": f"What is {i} plus {i}?", "chosen": f"<think>\nAdd {i} to {i}.\n</think>\n\n{2 * i}",
         "rejected": f"<think>\nGuess {i}.\n</think>\n\n{2 * i + 1}"}
        for i in range(6)
    ]  # fmt: skip
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    common = {"seq_len": 128, "val_fraction": 0.3, "fmt": "preference"}
    meta = prepare([str(tmp_path / "pairs.jsonl")], tmp_path / "r1", tokenizer=str(r1["model"]), **common)
    assert meta["chat_template"]["source"].startswith("r1-distill-training")
    tok = AutoTokenizer.from_pretrained(r1["model"])
    pieces = sorted(target_texts(tmp_path / "r1", tok))
    want = sorted(f"{p[k].removeprefix('<think>')}<｜end▁of▁sentence｜>" for p in pairs for k in ("chosen", "rejected"))
    assert [p.lstrip("\n") for p in pieces] == [w.lstrip("\n") for w in want], pieces[:2]
    assert not any("What is" in p for p in pieces)
    v3 = model_folder(tmp_path / "v3", deepseekv3_chat_template)
    with pytest.raises(UserError, match=r"drops the answer's reasoning up to </think>.*--chat-template r1-distill-tra"):
        prepare([str(tmp_path / "pairs.jsonl")], tmp_path / "v3-data", tokenizer=str(v3), **common)
    fixed = prepare([str(tmp_path / "pairs.jsonl")], tmp_path / "v3-fixed", tokenizer=str(v3),
                    chat_template="r1-distill-training", **common)  # fmt: skip
    assert fixed["chat_template"]["source"] == "--chat-template r1-distill-training"
