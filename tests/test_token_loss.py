"""Token-weighted loss: a step's gradient is that of the mean cross-entropy over every target token of the global
batch, whatever micro-batch, accumulation and world size (issue 15). Chat data with very uneven target counts per
row is where the per-micro-batch mean (Transformers' default without ``num_items_in_batch``) goes wrong."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from conftest import launch, prepare, records
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from deepzero.data import GlobalBatchSampler, PackedDataset
from deepzero.losses.lm import lm_loss, loss_normalizer

pytestmark = pytest.mark.launcher

STEPS, MICRO, GLOBAL = 6, 2, 6
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda", "sigma", "omega"]


def uneven_chats(n: int) -> list[list[dict[str, str]]]:
    """Conversations whose assistant turns range from one word to a paragraph, behind prompts of any length."""
    rng = random.Random(0)
    chats = []
    for i in range(n):
        long_answer = i % 2 == 0  # about one conversation per row: rows with ~2 or ~100 target tokens
        answer = " ".join(rng.choices(WORDS, k=40 if long_answer else 1))
        question = " ".join(rng.choices(WORDS, k=2 if long_answer else 40))
        chats.append([{"role": "user", "content": question}, {"role": "assistant", "content": answer}])
    return chats


@pytest.fixture(scope="module")
def chat_setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Prepared uneven chat data and a tiny dense model saved with its (random) initial weights."""
    root = tmp_path_factory.mktemp("token_loss")
    jsonl = root / "chats.jsonl"
    jsonl.write_text("".join(json.dumps({"messages": c}) + "\n" for c in uneven_chats(300)))
    data = prepare(
        root / "data",
        "--tokenizer",
        "train",
        "--vocab-size",
        "300",
        "--val-fraction",
        "0.1",
        inputs=[jsonl],
        seq_len=128,
    )
    config = AutoConfig.for_model(
        "llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "model")
    return data, root / "model"


def run(data: Path, model: Path, out: Path, ranks: int, accum: int, preset: str = "ds_configs/zero2.json") -> Path:
    launch(
        [
            "--deepspeed_config", preset, "--precision", "fp32", "--model", str(model),
            "--data", str(data), "--out", str(out), "--max-steps", str(STEPS), "--micro-batch", str(MICRO),
            "--grad-accum", str(accum), "--lr", "1e-3", "--warmup-steps", "2", "--log-interval", "1",
            "--eval-interval", "0", "--save-interval", "0",
        ],
        nproc=ranks,
    )  # fmt: skip
    return out


@pytest.fixture(scope="module")
def runs(chat_setup: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    data, model = chat_setup
    root = tmp_path_factory.mktemp("runs")
    return {
        "1x3": run(data, model, root / "1x3", ranks=1, accum=GLOBAL // MICRO),
        "3x1": run(data, model, root / "3x1", ranks=3, accum=1),
        "pipeline": run(data, model, root / "pipe", ranks=3, accum=GLOBAL // MICRO, preset="ds_configs/pipeline.json"),
    }


def global_batch(data: PackedDataset, step: int) -> list[dict[str, torch.Tensor]]:
    """The rows optimizer step ``step`` (0-based) trains on, as micro-batches of MICRO rows."""
    rows = GlobalBatchSampler(len(data), MICRO, GLOBAL // MICRO, 0, 1, seed=0).global_batch_indices(step)
    items = [data[i] for i in rows]
    return [{k: torch.stack([it[k] for it in items[j : j + MICRO]]) for k in items[0]} for j in range(0, GLOBAL, MICRO)]


def direct_training(data_dir: Path, model_dir: Path, lrs: list[float]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, no DeepSpeed: each step's loss is the summed cross-entropy of the whole global batch over its
    target count, then clipping and AdamW as the preset configures them, at the lr the run logged for that step."""
    data = PackedDataset(data_dir, "train")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    curve = []
    for step, lr in enumerate(lrs):
        micro = global_batch(data, step)
        normalizer = loss_normalizer(micro, dp_size=1) * len(micro)  # the global target count
        loss = sum(lm_loss(model, batch, normalizer) for batch in micro)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        opt.zero_grad()
        curve.append(loss.item())
    return curve, {k: v.detach() for k, v in model.state_dict().items()}


def test_the_data_is_uneven_enough_to_tell_the_means_apart(chat_setup: tuple[Path, Path]) -> None:
    data_dir, model_dir = chat_setup
    data = PackedDataset(data_dir, "train")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    micro = global_batch(data, 0)
    targets = [int((b["labels"] != -100).sum()) for b in micro]
    assert max(targets) > 2 * min(targets), targets
    with torch.no_grad():
        token_mean = sum(lm_loss(model, b, loss_normalizer(micro, 1) * len(micro)) for b in micro).item()
        batch_means = sum(model(**b, use_cache=False).loss.item() for b in micro) / len(micro)
    assert abs(token_mean - batch_means) > 1e-3, (token_mean, batch_means)


def test_one_rank_times_three_equals_three_ranks_times_one(runs: dict[str, Path]) -> None:
    curves = {name: [r["loss"] for r in records(out)] for name, out in runs.items()}
    assert len(curves["1x3"]) == STEPS
    assert curves["1x3"] == pytest.approx(curves["3x1"], abs=1e-5)
    a, b = (load_file(runs[name] / "hf" / "model.safetensors") for name in ("1x3", "3x1"))
    for key in a:
        assert torch.allclose(a[key], b[key], atol=1e-5), key


@pytest.mark.parametrize("name", ["3x1", "pipeline"])
def test_runs_follow_the_direct_token_mean(name: str, runs: dict[str, Path], chat_setup: tuple[Path, Path]) -> None:
    """ZeRO on 3 ranks, and the pipeline engine (3 stages × accumulation 3, the loss on the last stage only)."""
    data_dir, model_dir = chat_setup
    logged = records(runs[name])
    lrs = [0.0] + [r["lr"] for r in logged[:-1]]  # a record's lr is the next step's (WarmupLR starts at 0)
    curve, weights = direct_training(data_dir, model_dir, lrs)
    assert [r["loss"] for r in logged] == pytest.approx(curve, abs=1e-5)
    trained = load_file(runs[name] / "hf" / "model.safetensors")
    start = load_file(model_dir / "model.safetensors")
    moved = sum(float((trained[k] - start[k]).norm() ** 2) for k in trained) ** 0.5
    off = sum(float((trained[k] - weights[k]).norm() ** 2) for k in trained) ** 0.5
    assert moved > 1e-2 and off < 1e-3 * moved, (moved, off)
