"""recipes/: every file parses through train.py --config, plans to fit 3 × 24 GiB with its own flags, and its
schedule reaches its peak; flags override a recipe and unknown keys are one line. A tiny stand-in of the LoRA SFT
recipe trains on 3 CPU ranks (the recipe with the model, data and preset swapped for local ones)."""

from __future__ import annotations

from pathlib import Path

import huggingface_hub
import pytest
from conftest import REPO, launch, prepare, records

from deepzero import run
from deepzero.args import parse_args
from deepzero.errors import UserError

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


def data_for(recipe: Path, tmp: Path) -> Path:
    """A local stand-in of the recipe's data in its format, at its length (a BPE trained here)."""
    text = recipe.read_text()
    if "grpo" in recipe.name:
        rows = [f'{{"prompt": "What is {i} + {i}?", "answer": "{2 * i}"}}' for i in range(200)]
        (tmp / "p.jsonl").write_text("\n".join(rows) + "\n")
        return prepare(tmp / "prompts", "--tokenizer", "train", "--vocab-size", "300", "--format", "prompts",
                       "--max-completion-length", "1024", inputs=[tmp / "p.jsonl"], seq_len=1536)  # fmt: skip
    if "dpo" in recipe.name:
        rows = [f'{{"prompt": "q{i}", "chosen": "good {i}", "rejected": "bad {i}"}}' for i in range(200)]
        (tmp / "d.jsonl").write_text("\n".join(rows) + "\n")
        return prepare(tmp / "pairs", "--tokenizer", "train", "--vocab-size", "300", "--format", "preference",
                       inputs=[tmp / "d.jsonl"], seq_len=1024)  # fmt: skip
    assert "seq-len 2048" in text
    return prepare(tmp / "rows", "--tokenizer", "train", "--vocab-size", "1024", "--val-fraction", "0.02", seq_len=2048)


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_a_recipe_plans_to_fit_and_peaks(recipe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = data_for(recipe, tmp_path)
    argv = ["--config", str(recipe), "--data", str(data), "--out", str(tmp_path / "run")]
    planned: dict = {}
    warnings: list[str] = []
    real_check = run.check_fit
    monkeypatch.setattr(run, "check_fit", lambda *a, **k: planned.update(args=a, kwargs=k))
    monkeypatch.setattr(run, "check_disk", lambda *args, **kwargs: None)
    monkeypatch.setattr(run, "warn", warnings.append)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    args = parse_args(argv)
    assert args.data == str(data) and args.model in recipe.read_text()  # the command line overrides the recipe
    run.plan_run(args, 3)
    assert planned, recipe.name
    assert real_check(*planned["args"], **planned["kwargs"] | {"gpu_mem_gb": 24, "cpu_mem_gb": 128}) is None
    assert not [w for w in warnings if "never reaches its peak" in w], warnings


def test_an_unknown_recipe_key_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "r.yaml").write_text("model: tiny-deepseek-v3\nmax_step: 3\n")
    with pytest.raises(UserError, match=r"r\.yaml: unknown key 'max_step'.*did you mean 'max_steps'"):
        parse_args(["--config", str(tmp_path / "r.yaml")])
    (tmp_path / "l.yaml").write_text("- a\n")
    with pytest.raises(UserError, match="not a mapping"):
        parse_args(["--config", str(tmp_path / "l.yaml")])


def test_a_tiny_stand_in_of_the_lora_sft_recipe_trains(tiny_data: Path, tmp_path: Path) -> None:
    """The 7B LoRA SFT recipe's own flags (LoRA, epochs, warm-up ratio, cosine, checkpointing) on a tiny random
    DeepSeek-V3 saved as a checkpoint, the fp16 preset (this CPU's precision), micro-batch 1."""
    import torch
    from transformers import AutoModelForCausalLM

    from deepzero.presets import get_preset

    base = tmp_path / "base"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(get_preset("tiny-deepseek-v3").config(vocab_size=512)).save_pretrained(base)
    out = tmp_path / "run"
    launch([
        "--config", "recipes/r1-distill-qwen-7b-lora-sft.yaml", "--deepspeed_config", "ds_configs/zero2.json",
        "--model", str(base), "--data", str(tiny_data), "--out", str(out), "--allow-tokenizer-change",
        "--micro-batch", "1", "--grad-accum", "1", "--epochs", "0.05", "--log-interval", "1", "--eval-interval", "0",
        "--save-interval", "0", "--no-export", "--lr", "3e-3",
    ])  # fmt: skip
    curve = [r["loss"] for r in records(out)]
    assert len(curve) >= 3 and curve[-1] < curve[0]
