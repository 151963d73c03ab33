"""Preference tuning (DPO and its variants): the data format, the losses, and TRL's DPOTrainer as the oracle.

The oracle runs train.py on launched ranks (fp32, ZeRO-2 on 1 rank × accumulation 3, ZeRO-3 on 3 ranks × 1)
and TRL's ``DPOTrainer`` in this process on the same tiny model, the same pairs in the same batch order, the same
AdamW, clipping and learning-rate schedule: per step, the loss and TRL's reward metrics agree within 1e-5.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import REPO, cpu_env, launch, records

from deepzero.data import GlobalBatchSampler, PreferenceDataset, open_split
from deepzero.data.preference import parse_record, read_pairs
from deepzero.data.writer import split_of
from deepzero.errors import UserError
from deepzero.losses.objectives import PreferenceSettings
from deepzero.presets import get_preset

SEQ_LEN, SEED, VAL = 96, 0, 0.15
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()  # noqa: SIM905
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")  # fmt: skip
TOL = 1e-5


def make_pairs(n: int) -> list[dict]:
    """Deterministic conversational pairs: a question about a word, a right and a wrong short answer."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        a, b, c = (WORDS[j] for j in rng.choice(len(WORDS), 3, replace=False))
        words = " ".join(WORDS[j] for j in rng.choice(len(WORDS), 1 + i % 5))
        out.append(
            {
                "prompt": [{"role": "user", "content": f"Which word follows {a} in list {i}?"}],
                "chosen": [{"role": "assistant", "content": f"It is {b}, then {words}."}],
                "rejected": [{"role": "assistant", "content": f"{c}{'.' * (i % 3)}"}],
            }
        )
    return out


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def prepare(jsonl: Path, out: Path, *extra: str, tokenizer: str = "train") -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "data/prepare.py", "--format", "preference", "--input", str(jsonl), "--out", str(out)]
    cmd += ["--tokenizer", tokenizer, "--vocab-size", "384", "--seq-len", str(SEQ_LEN), "--val-fraction", str(VAL)]
    return subprocess.run([*cmd, *extra], cwd=REPO, capture_output=True, text=True, env=cpu_env())


@pytest.fixture(scope="module")
def pref(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Pairs, their prepared folder (BPE trained here), and a tiny dense DeepSeek-V3 (MLA, no routed experts)
    saved with save_pretrained: the starting weights of both trainers."""
    root = tmp_path_factory.mktemp("pref")
    pairs = make_pairs(40)
    jsonl = write_jsonl(root / "pairs.jsonl", pairs)
    proc = prepare(jsonl, root / "data")
    assert proc.returncode == 0, proc.stderr
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(root / "data" / "tokenizer")
    config = get_preset("tiny-deepseek-v3").config(
        vocab_size=len(tok), num_hidden_layers=2, first_k_dense_replace=2, max_position_embeddings=128
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    train = [p for p in pairs if split_of(parse_record(p, "").key(), SEED, VAL) == "train"]
    return {"root": root, "data": root / "data", "model": root / "model", "train": train, "jsonl": jsonl}


# --- data -----------------------------------------------------------------------------------------------------------


def test_both_layouts_and_the_implicit_prompt_give_the_same_rows(pref: dict, tmp_path: Path) -> None:
    """String pairs (prompt = a user turn, answers = assistant turns) and message lists without a prompt (the
    shared first messages) are the same pairs as the explicit conversational layout, row for row."""
    pairs = make_pairs(40)
    strings = [
        {
            "prompt": p["prompt"][0]["content"],
            "chosen": p["chosen"][0]["content"],
            "rejected": p["rejected"][0]["content"],
        }
        for p in pairs
    ]
    implicit = [{"chosen": p["prompt"] + p["chosen"], "rejected": p["prompt"] + p["rejected"]} for p in pairs]
    tok = str(pref["data"] / "tokenizer")
    base = open_split(pref["data"], "train")
    for name, layout in (("strings", strings), ("implicit", implicit)):
        out = tmp_path / name
        proc = prepare(write_jsonl(tmp_path / f"{name}.jsonl", layout), out, tokenizer=tok)
        assert proc.returncode == 0, proc.stderr
        data = open_split(out, "train")
        assert isinstance(data, PreferenceDataset) and len(data) == len(base)
        for i in range(len(base)):
            for key in ("input_ids", "labels"):
                assert torch.equal(data[i][key], base[i][key]), (name, i, key)


def test_a_pair_is_two_rows_with_only_the_answers_as_targets(pref: dict) -> None:
    from transformers import AutoTokenizer

    data = open_split(pref["data"], "train")
    tok = AutoTokenizer.from_pretrained(pref["data"] / "tokenizer")
    pair = pref["train"][0]
    sample = data[0]
    assert sample["input_ids"].shape == (2, SEQ_LEN)
    for row, answer in zip(range(2), ("chosen", "rejected"), strict=True):
        targets = sample["labels"][row][sample["labels"][row] != -100]
        text = tok.decode(targets)
        assert pair[answer][0]["content"] in text and pair["prompt"][0]["content"] not in text
    batch = PreferenceDataset.collate([data[0], data[1]])
    assert torch.equal(batch["input_ids"][1], data[1]["input_ids"][0])  # chosen rows first, then rejected
    assert torch.equal(batch["input_ids"][2], data[0]["input_ids"][1])


BAD = {
    "missing": ({"prompt": "q", "chosen": "a"}, "record has no 'rejected'"),
    "empty": ({"prompt": "q", "chosen": "  ", "rejected": "b"}, "the chosen answer is empty"),
    "same": ({"prompt": "q", "chosen": "a", "rejected": "a"}, "chosen and rejected are the same answer"),
    "too long": ({"prompt": "q", "chosen": "word " * 400, "rejected": "b"}, "a row holds 97 (--seq-len 96 + 1)"),
    "not json": ("{oops", "is not valid JSON"),
    "wrong type": ({"prompt": "q", "chosen": 3, "rejected": "b"}, "'chosen' is neither a string nor a list"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_record_is_one_line_naming_file_and_line_or_skipped_and_counted(
    pref: dict, tmp_path: Path, case: str
) -> None:
    record, problem = BAD[case]
    jsonl = write_jsonl(tmp_path / "pairs.jsonl", [*make_pairs(6), record, *make_pairs(30)[6:]])
    tok = str(pref["data"] / "tokenizer")
    proc = prepare(jsonl, tmp_path / "out", tokenizer=tok)
    assert proc.returncode == 2 and not (tmp_path / "out").exists()
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {jsonl}:7: ") and problem in lines[0], proc.stderr
    proc = prepare(jsonl, tmp_path / "out", "--skip-bad", tokenizer=tok)
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["skipped"]["count"] == 1 and meta["skipped"]["first"][0].startswith(f"{jsonl}:7: ")
    assert sum(meta["n_pairs"].values()) == 30


def test_read_pairs_refuses_a_file_that_is_not_jsonl(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(UserError, match=r"preference data is read from \.jsonl files only"):
        list(read_pairs([str(tmp_path / "a.txt")], on_bad=None))


# --- the oracle -------------------------------------------------------------------------------------------------------


def train(pref: dict, out: Path, *extra: str, nproc: int = 1, config: str = "zero2.json") -> list[dict]:
    args = ["--deepspeed_config", f"ds_configs/{config}", "--data", str(pref["data"]), "--out", str(out)]
    args += ["--model", str(pref["model"]), "--precision", "fp32", "--lr", "1e-3", "--warmup-steps", "1"]
    args += ["--lr-schedule", "constant"]  # TRL's side steps DeepSpeed's WarmupLR (trl_run)
    args += ["--log-interval", "1", "--eval-interval", "0", "--save-interval", "0", "--no-export"]
    args += ["--ds", "optimizer.params.weight_decay=0", *extra]
    launch(args, nproc=nproc, env=cpu_env())
    return records(out)


def trl_run(pref: dict, loss: str, batch: int, steps: int, precompute: bool, schedule: dict, out: Path) -> list[dict]:
    """TRL's DPOTrainer on the same pairs in this product's order (step s: GlobalBatchSampler's rows of step s)."""
    from datasets import Dataset
    from deepspeed.runtime.lr_schedules import WarmupLR
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    sampler = GlobalBatchSampler(len(pref["train"]), batch, 1, 0, 1, SEED)
    order = [i for s in range(steps) for i in sampler.global_batch_indices(s)]
    dataset = Dataset.from_list([pref["train"][i] for i in order])
    losses: list[float] = []

    class InOrder(DPOTrainer):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            value = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            losses.append(float(value.detach()))
            return value

    model = AutoModelForCausalLM.from_pretrained(pref["model"], dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    config = DPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        fp16=False,
        max_grad_norm=1.0,
        beta=0.1,
        loss_type=[loss],
        precompute_ref_log_probs=precompute,
        max_length=None,
        seed=SEED,
        dataloader_num_workers=0,
    )
    trainer = InOrder(
        model=model,
        args=config,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(pref["model"]),
        optimizers=(optimizer, WarmupLR(optimizer, **schedule)),
    )
    trainer.train()
    logged = [r for r in trainer.state.log_history if "rewards/chosen" in r]
    return [{"loss": value, **{k: r[k] for k in METRICS}} for value, r in zip(losses, logged, strict=True)]


def schedule_of(out: Path) -> dict:
    params = json.loads((out / "run_config.json").read_text())["deepspeed"]["scheduler"]["params"]
    return {k: params[k] for k in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type")}


def assert_same(ours: list[dict], theirs: list[dict], what: str = "") -> None:
    """Per step, the loss and TRL's metrics within TOL; the largest relative difference is printed (pytest -s)."""
    assert len(ours) == len(theirs)
    worst = 0.0
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True), start=1):
        for key in ("loss", *METRICS):
            assert math.isclose(a[key], b[key], rel_tol=TOL, abs_tol=TOL), (step, key, a[key], b[key])
            worst = max(worst, abs(a[key] - b[key]) / max(abs(b[key]), 1e-12) if a[key] != b[key] else 0.0)
    print(f"{what}: {len(ours)} steps, max relative difference {worst:.2g}")


ACCUM_3 = ["--micro-batch", "2", "--grad-accum", "3", "--max-steps", "6"]
RANKS_3 = ["--micro-batch", "2", "--grad-accum", "1", "--max-steps", "6"]


@pytest.fixture(scope="module")
def ours(pref: dict) -> dict[str, list[dict]]:
    """This product's runs: sigmoid, ipo, hinge and SimPO on 1 rank × accumulation 3 (ZeRO-2); sigmoid on 3 ranks
    × 1 (ZeRO-3), which scores the reference pass with ZeRO-3's collective forwards."""
    root = pref["root"]
    runs = {
        "sigmoid": train(pref, root / "sigmoid", *ACCUM_3),
        "ipo": train(pref, root / "ipo", "--preference-loss", "ipo", *ACCUM_3),
        "hinge": train(pref, root / "hinge", "--preference-loss", "hinge", *ACCUM_3),
        "simpo": train(pref, root / "simpo", "--preference-loss", "simpo", "--label-smoothing", "0.1", *ACCUM_3),
        "zero3": train(pref, root / "zero3", *RANKS_3, nproc=3, config="zero3.json"),
    }
    return runs


@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "hinge"])
@pytest.mark.parametrize("precompute", [True, False], ids=["precomputed", "reference-model"])
def test_loss_and_rewards_equal_trl_dpo_trainer_per_step(
    pref: dict, ours: dict, loss: str, precompute: bool, tmp_path: Path
) -> None:
    theirs = trl_run(pref, loss, 6, 6, precompute, schedule_of(pref["root"] / loss), tmp_path)
    assert_same(ours[loss], theirs, f"{loss} ({'precomputed' if precompute else 'reference model'}) vs TRL")
    curve = ours[loss]
    assert curve[0]["rewards/margins"] == 0 and curve[-1]["rewards/margins"] > 0.1  # it learnt: the test can fail
    assert curve[-1]["loss"] < curve[0]["loss"] and curve[-1]["rewards/accuracies"] > 0.5


def test_simpo_is_reference_free_and_learns_the_pairs(pref: dict, ours: dict) -> None:
    """SimPO (label smoothing 0.1) through train.py: no reference pass or folder, the choice in run_config.json,
    rewards as TRL's CPOTrainer logs them (beta × the mean log-prob per answer token), and the pairs are learnt."""
    run = pref["root"] / "simpo"
    assert not (run / "reference").exists()
    objective = json.loads((run / "run_config.json").read_text())["objective"]
    assert (objective["loss"], objective["reference"], objective["label_smoothing"]) == ("simpo", "none", 0.1)
    curve = ours["simpo"]
    for r in curve:
        assert math.isclose(r["rewards/chosen"], 2.0 * r["logps/chosen"], rel_tol=1e-5)
    assert curve[-1]["rewards/margins"] > curve[0]["rewards/margins"] and curve[-1]["loss"] < curve[0]["loss"]


def test_three_ranks_by_one_equal_one_rank_by_three_accumulation_steps(ours: dict) -> None:
    """ZeRO-3 over 3 ranks (micro 2, no accumulation) trains the same global batches as ZeRO-2 on 1 rank × 3."""
    assert_same(ours["zero3"], ours["sigmoid"], "3 ranks x 1 (ZeRO-3) vs 1 rank x 3 (ZeRO-2)")


def test_resume_mid_run_continues_the_curve_exactly_and_reuses_the_reference(pref: dict, ours: dict) -> None:
    out = pref["root"] / "resumed"
    common = ["--micro-batch", "2", "--grad-accum", "1", "--save-interval", "3"]
    train(pref, out, *common, "--max-steps", "3", nproc=3, config="zero3.json")
    stamp = (out / "reference" / "reference.json").stat().st_mtime_ns
    after = train(pref, out, *common, "--max-steps", "6", "--resume", nproc=3, config="zero3.json")
    assert (out / "reference" / "reference.json").stat().st_mtime_ns == stamp
    for a, b in zip([r for r in after if r["step"] > 3], ours["zero3"][3:], strict=True):
        assert all(a[k] == b[k] for k in ("loss", *METRICS)), (a, b)


# --- LoRA's adapters-off reference and MoE balancing ------------------------------------------------------------------

PAD_ID, TINY_VOCAB = 63, 64


def padded_pairs(seed: int, pairs: int = 2, seq: int = 24) -> dict[str, torch.Tensor]:
    """A collated micro-batch of ``pairs`` pairs (chosen rows, then rejected rows) whose rows end in padding of
    different lengths: targets after a 4-token prompt, none on the padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, PAD_ID, (2 * pairs, seq), generator=g)
    labels = torch.full_like(ids, -100)
    for row in range(2 * pairs):
        end = seq - 3 * (row + 1)
        ids[row, end:] = PAD_ID
        labels[row, 4 : end - 1] = ids[row, 5:end]
    return {"input_ids": ids, "labels": labels}


def test_the_adapters_off_reference_pass_is_neither_counted_nor_balanced_by_the_routers() -> None:
    """LoRA on the V3 MoE: the reference forward with the adapters off (train mode, no grad) adds no router loads, no
    balance loss and no shift of the micro-batches' padding masks. Loads, balance-loss calls and every gradient equal
    those of the same step with the reference log-probs precomputed (the adapters start at zero: the same numbers)."""
    from transformers import AutoModelForCausalLM

    from deepzero.adapters.lora import LoraSpec, apply_lora
    from deepzero.losses.objectives import Preference, PreferenceSettings, sequence_logps
    from deepzero.moe_balance import BalanceChoice, Balancer

    def lora_moe() -> torch.nn.Module:
        torch.manual_seed(0)
        config = get_preset("tiny-deepseek-v3").config(vocab_size=TINY_VOCAB, num_hidden_layers=3)
        config.use_cache = False
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        return apply_lora(model, LoraSpec.parse("r=4,targets=attn,mlp"), verbose=False).train()

    micro = [padded_pairs(seed) for seed in (1, 2)]
    choice = BalanceChoice("both", "deepseek_v3", bias_rate=0.01, aux_alpha=0.05, seq_aux=True)
    steps = {}
    for reference in ("adapters-off", "precomputed"):
        model = lora_moe()
        batches = [dict(b) for b in micro]
        if reference == "precomputed":
            with torch.no_grad(), model.disable_adapter():
                for b in batches:
                    b["ref_logps"] = torch.stack(sequence_logps(model, b)[0].chunk(2), dim=1)
        objective = Preference(PreferenceSettings(reference=reference))
        balancer = Balancer(model, choice, lambda: 1.0, "cpu")
        for b in balancer.watch(iter(batches), PAD_ID):
            objective.loss(model, b, torch.tensor(2.0 * len(batches))).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        steps[reference] = (balancer.step_counts.clone(), balancer.loss_calls.clone(), grads)
    (counts, calls, grads), (counts_pre, calls_pre, grads_pre) = steps["adapters-off"], steps["precomputed"]
    real = sum(int((b["input_ids"] != PAD_ID).sum()) for b in micro)
    assert int(counts.sum()) == 2 * real * 2  # 2 MoE layers × real tokens × top-2: the reference pass not counted
    assert torch.equal(counts, counts_pre) and torch.equal(calls, calls_pre) and int(calls.sum()) == 2 * len(micro)
    assert grads.keys() == grads_pre.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_pre[name], rtol=1e-5, atol=1e-7, msg=name)


def test_lora_on_the_moe_model_trains_one_curve_with_either_reference_and_balances(pref: dict) -> None:
    """LoRA on a DeepSeek-V3 MoE (balancing on: V3's bias and sequence-wise loss) through train.py: the reference as
    the model with its adapters off equals the precomputed reference step for step (loss, TRL's metrics, router
    loads), keeps no reference folder, and the pairs are learnt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = pref["root"]
    tok = AutoTokenizer.from_pretrained(pref["data"] / "tokenizer")
    config = get_preset("tiny-deepseek-v3").config(
        vocab_size=len(tok), num_hidden_layers=2, first_k_dense_replace=1, max_position_embeddings=128
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "moe")
    tok.save_pretrained(root / "moe")
    moe = {**pref, "model": root / "moe"}
    common = ["--lora", "r=8,targets=attn,mlp", "--lr", "1e-2", "--micro-batch", "2", "--grad-accum", "2"]
    common += ["--max-steps", "6"]
    runs = {
        ref: train(moe, root / f"lora-{ref}", *common, "--reference", ref) for ref in ("adapters-off", "precomputed")
    }
    off, pre = runs["adapters-off"], runs["precomputed"]
    assert_same(off, pre, "LoRA MoE: adapters-off vs precomputed reference")
    for a, b in zip(off, pre, strict=True):
        assert "expert_load_imbalance" in a and a["dead_experts"] == b["dead_experts"]
        assert math.isclose(a["expert_load_imbalance"], b["expert_load_imbalance"], rel_tol=1e-6)
        assert math.isclose(a["balance_loss"], b["balance_loss"], rel_tol=1e-4)
    assert (
        not (root / "lora-adapters-off" / "reference").exists() and (root / "lora-precomputed" / "reference").is_dir()
    )
    objective = json.loads((root / "lora-adapters-off" / "run_config.json").read_text())["objective"]
    assert objective["reference"] == "adapters-off" and objective["loss"] == "sigmoid"
    assert off[0]["rewards/margins"] == 0 and off[-1]["rewards/margins"] > 0.1 and off[-1]["loss"] < off[0]["loss"]


@pytest.mark.launcher
def test_dpo_on_a_4bit_base_has_the_same_curve_with_either_reference(pref: dict) -> None:
    """QLoRA DPO (--load-in-4bit, ZeRO-2, uint8 blocks): the reference as the 4-bit model with its adapters off equals
    the reference log-probs precomputed from the same 4-bit model, step for step, and the pairs are learnt."""
    common = ["--lora", "r=8,targets=attn", "--load-in-4bit", "--lr", "1e-2", "--micro-batch", "2"]
    common += ["--grad-accum", "2", "--max-steps", "6"]
    root = pref["root"]
    runs = {
        ref: train(pref, root / f"qlora-{ref}", *common, "--reference", ref) for ref in ("adapters-off", "precomputed")
    }
    off, pre = runs["adapters-off"], runs["precomputed"]
    assert_same(off, pre, "QLoRA: adapters-off vs precomputed reference")
    assert json.loads((root / "qlora-adapters-off" / "run_config.json").read_text())["four_bit"]["storage"] == "uint8"
    assert off[0]["rewards/margins"] == 0 and off[-1]["rewards/margins"] > 0.1 and off[-1]["loss"] < off[0]["loss"]


@pytest.mark.parametrize(
    ("loss", "smoothing"), [("simpo", 0.0), ("simpo", 0.1), ("sigmoid", 0.1), ("hinge", 0.0)], ids=str
)
def test_the_pair_losses_equal_trl_cpo_trainers_formulas(loss: str, smoothing: float) -> None:
    """SimPO (with and without label smoothing), conservative DPO and hinge against TRL's ``CPOTrainer.cpo_loss``
    on the same log-probs: CPO's logits are the policy's log-ratio without a reference (a zero reference here),
    SimPO's the per-token means. Losses and rewards within 1e-6."""
    from types import SimpleNamespace

    from trl.experimental.cpo import CPOTrainer

    from deepzero.losses.objectives import PreferenceSettings, pair_loss

    g = torch.Generator().manual_seed(0)
    n_chosen, n_rejected = torch.randint(1, 40, (2, 16), generator=g).float()
    chosen, rejected = -torch.rand(2, 16, generator=g) * 80
    settings = PreferenceSettings(loss=loss, beta=2.0 if loss == "simpo" else 0.1, label_smoothing=smoothing)
    zero = torch.zeros(16)
    ours = pair_loss(settings, chosen, rejected, n_chosen, n_rejected, None if loss == "simpo" else (zero, zero))
    trl_self = SimpleNamespace(
        alpha=0.0, beta=settings.beta, loss_type=loss, simpo_gamma=settings.simpo_gamma,
        label_smoothing=smoothing, accelerator=SimpleNamespace(device=torch.device("cpu")),
    )  # fmt: skip
    averaged = loss == "simpo"
    args = (chosen / n_chosen, rejected / n_rejected) if averaged else (chosen, rejected)
    theirs = CPOTrainer.cpo_loss(trl_self, *args)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert ours[0].std() > 0  # the pairs differ: a test that can fail


@pytest.mark.parametrize("empty", ["chosen", "rejected"])
@pytest.mark.parametrize("loss", ["ipo", "simpo"])
def test_an_answer_without_target_tokens_gives_trls_finite_loss(
    loss: str, empty: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """IPO and SimPO divide an answer's summed log-prob by its token count; a row with none counts as one, as TRL's
    DPOTrainer clamps it (``.clamp(min=1)``): the loss and the window's statistics stay finite. Oracles: IPO is
    DPOTrainer's own loss code on per-token log-probs that sum to ours; SimPO is CPOTrainer.cpo_loss on the per-token
    means with that clamp (CPOTrainer's own mean divides by zero there)."""
    from collections import defaultdict

    from trl import DPOTrainer
    from trl.experimental.cpo import CPOTrainer

    from deepzero.losses import objectives

    pairs, length = 3, 8
    g = torch.Generator().manual_seed(1)
    mask = torch.zeros(2 * pairs, length)
    for row, n in enumerate([3, 5, 2, 4, 6, 1]):
        mask[row, 1 : 1 + n] = 1  # answer tokens after a 1-token prompt
    mask[0 if empty == "chosen" else pairs] = 0  # pair 0's chosen (or rejected) answer: no token at all
    per_token = -torch.rand(2 * pairs, length - 1, generator=g) * 5 * mask[:, 1:]
    logps, counts = per_token.sum(-1), mask.sum(-1)
    ref = -torch.rand(pairs, 2, generator=g) * 20
    monkeypatch.setattr(objectives, "sequence_logps", lambda model, batch: (logps, counts))
    settings = PreferenceSettings(loss=loss, beta=2.0 if loss == "simpo" else 0.1, reference="precomputed")
    objective = objectives.Preference(settings)
    model = torch.nn.Linear(1, 1)  # only its train/eval mode is read: the log-probs are the ones above
    ours = objective.pair_losses(model, {"input_ids": torch.zeros(2 * pairs, length), "ref_logps": ref})
    stats = objective.window_stats("train")
    assert torch.isfinite(ours).all() and all(math.isfinite(v) for v in stats.values()), (ours, stats)
    if loss == "ipo":
        trl_self = SimpleNamespace(
            model=model, accelerator=SimpleNamespace(device="cpu", gather=lambda t: t, gather_for_metrics=lambda t: t),
            aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
            loss_types=["ipo"], loss_weights=[1.0], beta=settings.beta, use_weighting=False,
            _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1,
        )  # fmt: skip
        zeros = torch.zeros_like(per_token)
        outputs = SimpleNamespace(log_probs=per_token, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())
        inputs = {"input_ids": torch.zeros(2 * pairs, length, dtype=torch.long), "attention_mask": torch.ones_like(mask),
                  "completion_mask": mask, "ref_chosen_logps": ref[:, 0], "ref_rejected_logps": ref[:, 1]}  # fmt: skip
        theirs = DPOTrainer._compute_loss(trl_self, lambda **kwargs: outputs, inputs, return_outputs=False)
        torch.testing.assert_close(ours.mean(), theirs, rtol=1e-6, atol=1e-7)
    else:
        trl_self = SimpleNamespace(
            alpha=0.0, beta=settings.beta, loss_type="simpo", simpo_gamma=settings.simpo_gamma, label_smoothing=0.0,
            accelerator=SimpleNamespace(device=torch.device("cpu")),
        )  # fmt: skip
        means = (logps / counts.clamp(min=1)).chunk(2)
        theirs = CPOTrainer.cpo_loss(trl_self, *means)[0]
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
        assert torch.isnan(CPOTrainer.cpo_loss(trl_self, *(logps / counts).chunk(2))[0][0])  # without the clamp


# --- choosing the loss: flags, the preset's "preference" section, refusals ---------------------------------------------


def plan_with(pref: dict, tmp_path: Path, *extra: str, preset: dict | None = None, data: Path | None = None):
    """``plan_run`` (no launch) on the pairs with ZeRO-2, the preset optionally given a "preference" section."""
    from deepzero.args import parse_args
    from deepzero.run import plan_run

    config = REPO / "ds_configs" / "zero2.json"
    if preset is not None:
        config = tmp_path / "preset.json"
        config.write_text(json.dumps({**json.loads((REPO / "ds_configs/zero2.json").read_text()), **preset}))
    argv = ["--deepspeed_config", str(config), "--data", str(data or pref["data"]), "--model", str(pref["model"])]
    argv += ["--out", str(tmp_path / "run"), "--micro-batch", "1", "--grad-accum", "1", "--precision", "fp32"]
    return plan_run(parse_args([*argv, *extra]), 1)


def test_the_preset_section_picks_the_loss_and_the_flags_beat_it(pref: dict, tmp_path: Path) -> None:
    """A preference folder alone trains sigmoid DPO; the preset's "preference" section (or --ds on it) picks
    another loss and its beta, and each flag beats the key it names; the section never reaches DeepSpeed."""
    assert plan_with(pref, tmp_path).preference == PreferenceSettings()
    section = {"preference": {"loss": "ipo", "beta": 0.3}}
    plan = plan_with(pref, tmp_path, preset=section)
    assert (plan.preference.loss, plan.preference.beta) == ("ipo", 0.3) and "preference" not in plan.cfg.ds
    plan = plan_with(pref, tmp_path, "--beta", "0.05", preset=section)
    assert (plan.preference.loss, plan.preference.beta) == ("ipo", 0.05)
    plan = plan_with(pref, tmp_path, "--ds", "preference.loss=simpo", "--ds", "preference.simpo_gamma=1.0")
    assert (plan.preference.loss, plan.preference.beta, plan.preference.simpo_gamma) == ("simpo", 2.0, 1.0)
    assert plan.preference.reference == "none"


REFUSALS = {
    "unknown key": ({"preference": {"los": "ipo"}}, [], "preset.json: preference.los: Unknown config key"),
    "bad loss": ({"preference": {"loss": "kto"}}, [], "preset.json: preference.loss: unknown preference loss 'kto'"),
    "bad beta": ({"preference": {"beta": -1}}, [], "preset.json: preference.beta: must be a positive number"),
    "flag": ({}, ["--label-smoothing", "0.7"], "--label-smoothing: must be a number in [0, 0.5), got 0.7"),
    "gamma without simpo": ({"preference": {"simpo_gamma": 1}}, [], "preference.simpo_gamma: is SimPO's margin"),
    "reference-free": ({}, ["--preference-loss", "simpo", "--reference", "precomputed"], "simpo uses no reference"),
    "smoothing with ipo": ({}, ["--preference-loss", "ipo", "--label-smoothing", "0.1"], "not ipo"),
    "adapters-off without LoRA": ({}, ["--reference", "adapters-off"], "only when LoRA adapters train"),
    "layer split": ({}, ["--device-map", "balanced"], "runs on the ZeRO engine only, not with --device-map"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_a_bad_preference_choice_is_one_line_naming_the_flag_or_the_preset_key(
    pref: dict, tmp_path: Path, case: str
) -> None:
    preset, flags, expected = REFUSALS[case]
    with pytest.raises(UserError) as err:
        plan_with(pref, tmp_path, *flags, preset=preset)
    assert expected in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_a_preference_choice_on_text_data_is_refused(pref: dict, tmp_path: Path, tiny_data: Path) -> None:
    for preset, flags, where in (
        ({}, ["--beta", "0.2"], "--beta"),
        ({"preference": {}}, [], f"{tmp_path / 'preset.json'}: preference"),
    ):
        with pytest.raises(UserError) as err:
            plan_with(pref, tmp_path, *flags, preset=preset or None, data=tiny_data)
        assert str(err.value).startswith(f"{where}: ") and "holds text data, not preference pairs" in str(err.value)


def test_reference_log_probs_of_other_weights_or_data_are_refused_in_one_line(pref: dict, tmp_path: Path) -> None:
    """A reference folder whose stamp does not match this run (another model, precision or data) stops the run
    before anything is scored, naming the stamp file and what changed; a matching one is loaded as it is."""
    from deepzero import reference

    data = open_split(pref["data"], "train")
    expected = reference.stamp(str(pref["model"]), False, 0, "fp32", pref["data"])
    values = {"train": np.arange(2 * len(data), dtype=np.float32).reshape(-1, 2)}
    reference.publish(tmp_path / "reference", values, {**expected, "pairs": {"train": len(data)}})
    line = reference.attach(None, {"train": data}, tmp_path, expected)
    assert "reused" in line and np.array_equal(data.reference, values["train"])
    for key, value in (("precision", "bf16"), ("data", "0" * 16), ("weights", "other")):
        with pytest.raises(UserError) as err:
            reference.attach(None, {"train": data}, tmp_path, {**expected, key: value})
        message = str(err.value)
        assert message.startswith(f"{tmp_path / 'reference' / 'reference.json'}: ") and f"{key} " in message
        assert "\n" not in message and "delete" in message


def test_the_stamp_of_a_hub_model_names_the_revision_it_loaded(
    pref: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hub id (or a preset naming one) is stamped with the commit its weights were loaded from, read from the
    cache Transformers loaded it through: the same id at a new upstream commit is other weights, refused."""
    import huggingface_hub.constants

    from deepzero import reference

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))

    def loaded(repo: str, commit: str) -> None:
        """What from_pretrained leaves in the cache: refs/main -> the commit, its snapshot with config.json."""
        cached = tmp_path / "hub" / f"models--{repo.replace('/', '--')}"
        (cached / "refs").mkdir(parents=True, exist_ok=True)
        (cached / "refs" / "main").write_text(commit)
        (cached / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
        (cached / "snapshots" / commit / "config.json").write_text("{}")

    old, new = "a" * 40, "b" * 40
    for spec, repo in (("org/model", "org/model"), ("deepseek-coder-1.3b", "deepseek-ai/deepseek-coder-1.3b-base")):
        loaded(repo, old)
        before = reference.stamp(spec, False, 0, "fp32", pref["data"])
        loaded(repo, new)
        after = reference.stamp(spec, False, 0, "fp32", pref["data"])
        assert old in before["weights"] and new in after["weights"], (before, after)
        data = open_split(pref["data"], "train")
        reference.publish(tmp_path / "reference", {"train": np.zeros((len(data), 2), np.float32)},
                          {**before, "pairs": {"train": len(data)}})  # fmt: skip
        with pytest.raises(UserError, match=f"weights .*{old}.* -> .*{new}"):
            reference.attach(None, {"train": data}, tmp_path, after)


def test_re_preparing_the_same_data_keeps_the_reference_stamp(pref: dict, tmp_path: Path) -> None:
    """The stamp hashes the prepared rows (ids, masks) and how to read them, not meta.json's timings, paths or the
    inputs' mtimes: the same pairs prepared again (another mtime, another path) keep it; one changed pair does not."""
    import os

    from deepzero import reference

    tokenizer = str(pref["data"] / "tokenizer")
    first = write_jsonl(tmp_path / "pairs.jsonl", make_pairs(12))
    assert prepare(first, tmp_path / "data", tokenizer=tokenizer).returncode == 0
    before = reference.stamp(str(pref["model"]), False, 0, "fp32", tmp_path / "data")
    meta_before = json.loads((tmp_path / "data" / "meta.json").read_text())
    os.utime(first, (1e9, 1e9))  # the input touched: prepare's fingerprint changes, so it rebuilds
    copy = write_jsonl(tmp_path / "elsewhere.jsonl", make_pairs(12))
    for source in (first, copy):
        assert prepare(source, tmp_path / "data", tokenizer=tokenizer).returncode == 0
        meta = json.loads((tmp_path / "data" / "meta.json").read_text())
        assert meta != meta_before  # the rebuild happened and meta.json differs ...
        assert reference.stamp(str(pref["model"]), False, 0, "fp32", tmp_path / "data") == before  # ... the rows not
    changed = make_pairs(12)
    changed[0]["chosen"][0]["content"] = "It is something else entirely."
    assert prepare(write_jsonl(first, changed), tmp_path / "data", tokenizer=tokenizer).returncode == 0
    assert reference.stamp(str(pref["model"]), False, 0, "fp32", tmp_path / "data")["data"] != before["data"]


def _reference_worker(rank: int, port: int, root: str, data_dir: str) -> None:
    """One of two ranks, each with its own out folder per case (a node-local disk): rank 0's view decides."""
    import datetime

    import torch.distributed as dist

    from deepzero import reference

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )

    def fake_logps(model: object, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return -batch["input_ids"].double().sum(-1) / 1000, (batch["labels"] != -100).sum(-1).float()

    reference.sequence_logps = fake_logps  # scoring without a model: the ranks' agreement is under test
    engine = SimpleNamespace(engine=torch.nn.Linear(1, 1), dp_rank=rank, dp_size=2, device=torch.device("cpu"))
    expected = {"model": "m", "weights": "w", "precision": "fp32", "data": "d"}
    results = {}
    for case in CASES:
        out = Path(root, case, f"rank{rank}")
        data = open_split(data_dir, "train")
        try:
            line = reference.attach(engine, {"train": data}, out, expected)
            results[case] = {"reused": "reused" in line, "reference": data.reference.tolist()}
        except UserError as err:
            results[case] = {"error": str(err)}
    Path(root, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


CASES = {
    # what each rank's out folder holds before the run: "valid" (a matching stamp), "stale" (another precision)
    "reuse": ("valid", None),
    "compute": (None, "stale"),
    "refuse": ("stale", "valid"),
}


def test_every_rank_follows_rank_0s_look_at_the_reference_folder(pref: dict, tmp_path: Path) -> None:
    """Ranks that see the out folder differently (a node-local disk) still agree: rank 0 decides load, compute or
    refuse and every rank follows, with rank 0's numbers; nothing hangs in a collective."""
    import time

    import torch.multiprocessing as mp

    from deepzero import reference
    from deepzero.distributed import free_port

    data = open_split(pref["data"], "train")
    expected = {"model": "m", "weights": "w", "precision": "fp32", "data": "d"}
    valid = np.arange(2 * len(data), dtype=np.float32).reshape(-1, 2)
    for case, views in CASES.items():
        for rank, view in enumerate(views):
            if view is not None:
                stamp = {**expected, "precision": "bf16" if view == "stale" else "fp32", "pairs": {"train": len(data)}}
                reference.publish(tmp_path / case / f"rank{rank}" / reference.FOLDER, {"train": valid}, stamp)
    ctx = mp.spawn(_reference_worker, args=(free_port(), str(tmp_path), str(pref["data"])), nprocs=2, join=False)
    deadline = time.monotonic() + 240
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for process in ctx.processes:
                process.kill()
            pytest.fail("the ranks hung in a collective")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]
    got = ranks[0]
    assert got["reuse"] == {"reused": True, "reference": valid.tolist()}
    assert not got["compute"]["reused"] and got["compute"]["reference"] != valid.tolist()
    published = json.loads((tmp_path / "compute" / "rank0" / reference.FOLDER / reference.STAMP).read_text())
    assert published["precision"] == "fp32"  # rank 0 published what every rank computed
    assert "precision 'bf16' -> 'fp32'" in got["refuse"]["error"] and "\n" not in got["refuse"]["error"]
