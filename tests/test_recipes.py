"""recipes/: every training file parses through train.py --config, plans to fit 3 × 24 GiB with its own flags, and
its schedule reaches its peak; the evaluation file parses through evaluate.py --config and its planned layout fits
3 × 24 GiB; flags override a recipe and unknown keys are one line. A tiny stand-in of each kind runs on 2 CPU ranks:
the recipe file itself, with the model, the data and the preset (ds_configs/zero2.json, this CPU's) swapped for local
ones and the run cut to a few steps of tiny rows: LoRA and QLoRA SFT (the loss falls), DPO (the pairs are learnt),
GRPO on GSM8K-format prompts in R1's instruction (math-verify's reward logged), and the AIME evaluation under R1's
protocol (its summary)."""

from __future__ import annotations

import json
from pathlib import Path

import huggingface_hub
import pytest
from conftest import REPO, launch, plan_as_on_4090s, prepare, records

from deepzero import run
from deepzero.args import parse_args
from deepzero.errors import UserError
from deepzero.rollout.job_args import parse_job_args

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
EVALUATE = [r for r in RECIPES if "evaluate.py --config" in r.read_text()]
TRAIN = [r for r in RECIPES if r not in EVALUATE]


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


def test_every_recipe_is_headed_by_its_own_launch_line() -> None:
    """Each file's header names its exact launch command, and README.md's recipe table lists every file."""
    assert EVALUATE and len(TRAIN) >= 7
    readme = (REPO / "README.md").read_text()
    for recipe in RECIPES:
        script = "evaluate.py" if recipe in EVALUATE else "train.py"
        assert f"deepspeed --num_gpus=3 {script} --config recipes/{recipe.name}\n" in recipe.read_text(), recipe.name
        assert f"`{recipe.name}`" in readme, recipe.name


@pytest.mark.parametrize("recipe", TRAIN, ids=[r.stem for r in TRAIN])
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
    plan_as_on_4090s(monkeypatch)
    args = parse_args(argv)
    assert args.data == str(data) and args.model in recipe.read_text()  # the command line overrides the recipe
    run.plan_run(args, 3)
    assert planned, recipe.name
    assert real_check(*planned["args"], **planned["kwargs"] | {"gpu_mem_gb": 24, "cpu_mem_gb": 128}) is None
    assert not [w for w in warnings if "never reaches its peak" in w], warnings


@pytest.mark.parametrize("recipe", TRAIN, ids=[r.stem for r in TRAIN])
def test_flags_override_a_recipe_as_training_arguments_do(recipe: Path) -> None:
    """--max-steps beats the recipe's epochs and --warmup-steps its warmup_ratio (Transformers' TrainingArguments:
    max_steps overrides num_train_epochs, warmup_steps overrides warmup_ratio), and the reverse; each replaced value
    is named."""
    text = recipe.read_text()
    args = parse_args(["--config", str(recipe), "--max-steps", "2", "--warmup-steps", "1"])
    assert (args.max_steps, args.warmup_steps, args.epochs, args.warmup_ratio) == (2, 1, None, None)
    assert ("\nepochs:" in text) == any(r.startswith("epochs:") for r in args.replaced)
    assert ("\nwarmup_ratio:" in text) == any(r.startswith("warmup_ratio:") for r in args.replaced)
    back = parse_args(["--config", str(recipe), "--epochs", "1", "--warmup-ratio", "0.1"])
    assert (back.epochs, back.warmup_ratio, back.warmup_steps) == (1.0, 0.1, None)


def test_an_unknown_recipe_key_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "r.yaml").write_text("model: tiny-deepseek-v3\nmax_step: 3\n")
    with pytest.raises(UserError, match=r"r\.yaml: unknown key 'max_step'.*did you mean 'max_steps'"):
        parse_args(["--config", str(tmp_path / "r.yaml")])
    (tmp_path / "l.yaml").write_text("- a\n")
    with pytest.raises(UserError, match="not a mapping"):
        parse_args(["--config", str(tmp_path / "l.yaml")])
    (tmp_path / "e.yaml").write_text("model: m\nbenchmark: aime24\nsample: 4\n")  # evaluate.py's flags, its own keys
    with pytest.raises(UserError, match=r"e\.yaml: unknown key 'sample'.*did you mean 'samples'") as err:
        parse_job_args(["--config", str(tmp_path / "e.yaml"), "--out", "o"], "evaluate.py")
    assert "\n" not in str(err.value)
    (tmp_path / "e.yaml").write_text("model: m\nbenchmark: aime24\nmax_steps: 4\n")  # a train.py key
    with pytest.raises(UserError, match=r"unknown key 'max_steps'"):
        parse_job_args(["--config", str(tmp_path / "e.yaml"), "--out", "o"], "evaluate.py")


@pytest.mark.parametrize("recipe", EVALUATE, ids=[r.stem for r in EVALUATE])
def test_the_evaluation_recipe_is_r1s_protocol_and_its_layout_fits(recipe: Path) -> None:
    """evaluate.py --config: R1's sampling (temperature 0.6, top-p 0.95, k samples, 32,768-token completions) on a
    benchmark, flags over the file; the layout evaluate.py asks the planner for on CUDA (``choose_layout``: prompts of
    1,024 tokens, the recipe's completions) fits 3 × 24 GiB with a row or more a call."""
    from deepzero.plan import GiB, plan_evaluation
    from deepzero.plan.evaluation import DOES_NOT_FIT
    from deepzero.rollout.job_args import R1_MAX_LENGTH
    from deepzero.rollout.layout import MOST_ROWS

    args = parse_job_args(["--config", str(recipe)], "evaluate.py")
    assert (args.temperature, args.top_p, args.max_completion_length) == (0.6, 0.95, R1_MAX_LENGTH)
    assert args.benchmark in ("aime24", "aime25", "math500") and args.samples >= 4 and args.model in recipe.read_text()
    assert args.data and args.data.startswith("hf:")  # the benchmark's own Hub copy unless --data says otherwise
    over = parse_job_args(["--config", str(recipe), "--samples", "4", "--out", "elsewhere"], "evaluate.py")
    assert (over.samples, over.out, over.pass_k) == (4, "elsewhere", [1, 2, 4])
    plan = plan_evaluation(args.model, 3, 24, 1024, args.max_completion_length, MOST_ROWS)
    assert plan.mode != DOES_NOT_FIT and plan.rows_per_call >= 1 and plan.per_card_bytes <= 24 * GiB, plan.reason


# --- tiny stand-ins: the recipe file, local model, data and preset, a few steps of tiny rows, on 2 CPU ranks ----------

RANKS = 2
LOCAL = ["--deepspeed_config", "ds_configs/zero2.json", "--log-interval", "1", "--eval-interval", "0"]
LOCAL += ["--save-interval", "0", "--no-export"]


def epochs_for(steps: int, data: Path, per_step: int) -> str:
    """``--epochs`` giving ``steps`` optimizer steps of ``per_step`` rows (preference data: pairs) over ``data``'s
    train split: the recipes train in epochs, which here would be hundreds of steps."""
    meta = json.loads((data / "meta.json").read_text())
    return f"{steps * per_step / meta.get('n_pairs', meta['n_rows'])['train']:.6g}"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """GSM8K-format records (``question``, ``answer`` ending in ``#### N``), a BPE trained on them, and a tiny Qwen2
    saved with that tokenizer and a chat template whose generation prompt opens a <think> block (as R1-Distill's
    does); the records then prepared as the GRPO recipes' header says: the r1-math instruction, that template,
    ``--columns prompt=question,solution=answer``."""
    from test_grpo import save_tiny_qwen
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("recipe_chat")
    rows = [{"question": f"Tom has {i} pens and buys {i + 3} more. How many pens?", "answer": f"{i}+{i + 3}={2 * i + 3}"
             f"\n#### {2 * i + 3}"} for i in range(60)]  # fmt: skip
    (root / "gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare(root / "bpe", "--format", "prompts", "--tokenizer", "train", "--vocab-size", "300", "--columns",
            "prompt=question", inputs=[root / "gsm8k.jsonl"], seq_len=64)  # fmt: skip
    save_tiny_qwen(root / "bpe", root / "model")
    tok = AutoTokenizer.from_pretrained(root / "model")
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<think>\n{% endif %}"
    )
    tok.save_pretrained(root / "model")
    prompts = prepare(root / "gsm8k-r1", "--format", "prompts", "--prompt-template", "r1-math", "--columns",
                      "prompt=question,solution=answer", "--tokenizer", str(root / "model"),
                      "--max-completion-length", "8", "--val-fraction", "0.1", inputs=[root / "gsm8k.jsonl"],
                      seq_len=128)  # fmt: skip
    return {"root": root, "model": root / "model", "prompts": prompts}


@pytest.mark.launcher
@pytest.mark.parametrize("recipe", ["r1-distill-qwen-7b-lora-sft", "r1-distill-qwen-14b-qlora-sft"])
def test_a_tiny_stand_in_of_the_sft_recipes_trains(recipe: str, tiny_data: Path, tmp_path: Path) -> None:
    """The LoRA and QLoRA SFT recipes' own flags (LoRA r16 on attn and mlp, the 4-bit NF4 base, cosine,
    checkpointing) on a tiny random Llama saved in bf16, 10 steps of micro-batch 1: ``--max-steps 10 --warmup-steps
    1`` replace the recipe's ``epochs`` and ``warmup_ratio`` as Transformers' TrainingArguments would (the header
    names both), it trains exactly 10 steps, the loss falls (and the QLoRA one's header names its 4-bit base)."""
    from test_qlora import pretrained

    base = pretrained(tmp_path / "base")
    out = tmp_path / "run"
    proc = launch([
        "--config", f"recipes/{recipe}.yaml", *LOCAL, "--model", str(base), "--data", str(tiny_data), "--out",
        str(out), "--allow-tokenizer-change", "--micro-batch", "1", "--grad-accum", "1", "--max-steps", "10",
        "--warmup-steps", "1", "--lr", "1e-2",
    ], nproc=RANKS)  # fmt: skip
    assert ("base in 4 bits (NF4" in proc.stdout) == ("qlora" in recipe), proc.stdout[-3000:]
    assert "epochs: 2 → --max-steps" in proc.stdout and "warmup_ratio: 0.03 → --warmup-steps" in proc.stdout
    steps = records(out)
    curve = [r["loss"] for r in steps]
    assert steps[-1]["step"] == 10 and sum(curve[-3:]) / 3 < sum(curve[:3]) / 3, curve


@pytest.mark.launcher
def test_a_tiny_stand_in_of_the_dpo_recipe_learns_the_pairs(tmp_path: Path) -> None:
    """The LoRA DPO recipe's flags (sigmoid, LoRA on attn and mlp, warm-up ratio, cosine, checkpointing) on a tiny
    random DeepSeek-V3 (dense) and tiny pairs, 6 steps of 2 pairs a rank: the margins open and the loss falls."""
    import torch
    from test_preference import make_pairs, write_jsonl
    from test_preference import prepare as prepare_pairs
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from deepzero.presets import get_preset

    data = tmp_path / "pairs"
    proc = prepare_pairs(write_jsonl(tmp_path / "pairs.jsonl", make_pairs(40)), data)
    assert proc.returncode == 0, proc.stderr
    tok = AutoTokenizer.from_pretrained(data / "tokenizer")
    config = get_preset("tiny-deepseek-v3").config(vocab_size=len(tok), num_hidden_layers=2, first_k_dense_replace=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    out = tmp_path / "run"
    launch([
        "--config", "recipes/deepseek-llm-7b-dpo-lora.yaml", *LOCAL, "--model", str(tmp_path / "model"), "--data",
        str(data), "--out", str(out), "--micro-batch", "2", "--grad-accum", "1", "--epochs",
        epochs_for(6, data, 2 * RANKS), "--lr", "1e-2",
    ], nproc=RANKS)  # fmt: skip
    curve = records(out)
    objective = json.loads((out / "run_config.json").read_text())["objective"]
    assert objective["loss"] == "sigmoid" and len(curve) >= 6
    assert curve[0]["rewards/margins"] == 0 and curve[-1]["rewards/margins"] > 0.1, curve
    assert curve[-1]["loss"] < curve[0]["loss"], curve


@pytest.mark.launcher
def test_a_tiny_stand_in_of_the_grpo_recipe_runs_with_its_reward(chat_model: dict) -> None:
    """The 1.5B GRPO recipe's flags (math-verify's accuracy, 8 generations a prompt, micro-batch 8, checkpointing) on
    the tiny Qwen2 and the r1-math prompts, 2 steps of 8-token completions: each step logs the accuracy reward (a
    random model's: 0) and its metrics, and the run ends."""
    out = chat_model["root"] / "grpo"
    proc = launch([
        "--config", "recipes/r1-distill-qwen-1.5b-grpo-gsm8k.yaml", *LOCAL, "--model", str(chat_model["model"]),
        "--data", str(chat_model["prompts"]), "--out", str(out), "--max-steps", "2", "--max-completion-length", "8",
    ], nproc=RANKS)  # fmt: skip
    steps = {r["step"]: r for r in records(out)}
    assert sorted(steps) == [1, 2], proc.stdout[-3000:]
    for record in steps.values():
        assert 0 <= record["reward"] <= 1 and "rewards/accuracy/mean" in record, record
        assert record["completions/max_length"] <= 8
    generations = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    sample = generations[0]["samples"][0]
    prompt, gold = sample["prompt"], sample["solution"]  # R1's instruction in the template, its <think> opened
    assert prompt.endswith("put your final answer within \\boxed{}.<think>\n"), sample
    assert sample["gold_parsed"] != "[]" and gold.startswith(prompt.split()[2]), sample  # the record's own, parsed


@pytest.mark.launcher
@pytest.mark.parametrize("recipe", EVALUATE, ids=[r.stem for r in EVALUATE])
def test_a_tiny_stand_in_of_the_evaluation_recipe_scores_a_model(recipe: Path, chat_model: dict) -> None:
    """evaluate.py --config with the recipe's protocol on the tiny Qwen2 and three local records in the benchmark's
    Hub layout (as docs/evaluate.md's offline copy), 2 samples of 8 tokens each: the summary is the recipe's
    benchmark at R1's temperature and top-p, every prompt scored."""
    args = parse_job_args(["--config", str(recipe)], "evaluate.py")
    rows = [{"problem": f"What is {i} times {i + 1}?", "answer": str(i * (i + 1))} for i in range(3)]
    if args.benchmark == "math500":
        rows = [{"problem": r["problem"], "solution": f"So \\boxed{{{r['answer']}}}."} for r in rows]
    local = chat_model["root"] / f"{args.benchmark}.jsonl"
    local.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = chat_model["root"] / recipe.stem
    launch([
        "--config", str(recipe), "--model", str(chat_model["model"]), "--data", str(local), "--out", str(out),
        "--samples", "2", "--max-completion-length", "8",
    ], nproc=RANKS, script="evaluate.py")  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["benchmark"], summary["temperature"], summary["top_p"]) == (args.benchmark, 0.6, 0.95), summary
    assert summary["prompts"] == 3 and summary["samples_unscored"] == 0 and 0 <= summary["pass@1"] <= 1, summary
    lines = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert sorted(x["index"] for x in lines) == [0, 1, 2] and all(len(x["completions"]) == 2 for x in lines)
