"""GRPO (prompts data, rewards, generation each step): the loss and metrics against TRL 1.16's ``GRPOTrainer`` as
the oracle, and train.py's runs.

The oracle: TRL's own ``GRPOTrainer._compute_loss`` (with its fused LM head, ``add_fused_lm_head``) and this
product's objective on the same tiny model, the same prompts and completions, advantages, old and reference
log-probs: per loss type, with and without the KL term, the loss, its gradient and TRL's metrics agree.
"""

from __future__ import annotations

import copy
import json
import types
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from deepzero.losses.grpo.loss import advantages, nanstd
from deepzero.losses.grpo.objective import GRPO
from deepzero.losses.grpo.rollout import completion_rows
from deepzero.losses.grpo.settings import LOSS_TYPES, GRPOSettings
from deepzero.tiled_loss import TiledLoss, install_tiled_loss

TOL = 1e-5


def tiny_qwen(vocab: int = 300, seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).float()


def fixed_inputs(n: int = 6, seed: int = 1) -> dict:
    """Prompts and completions of various lengths (the prompts left-padded, completions right-padded, as TRL)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 300, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g) for _ in range(n)]
    completions = [
        torch.randint(3, 300, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]
    rewards = torch.rand(n, generator=g)
    return {"prompts": prompts, "completions": completions, "rewards": rewards, "g": g}


def trl_layout(rows: dict, prompts: list, completions: list) -> dict:
    """TRL's tensors from our rows: the prompt part and the completion part of each row."""
    p_len = max(len(p) for p in prompts)
    return {
        "prompt_ids": rows["input_ids"][:, :p_len],
        "prompt_mask": rows["attention_mask"][:, :p_len],
        "completion_ids": rows["input_ids"][:, p_len:],
        "completion_mask": rows["attention_mask"][:, p_len:],
    }


def to_rows(per_token: torch.Tensor, p_len: int) -> torch.Tensor:
    """TRL's [b, C] per-token values at our shifted positions [b, P + C] (position t predicts token t + 1)."""
    out = torch.zeros(per_token.shape[0], p_len + per_token.shape[1])
    out[:, p_len - 1 : -1] = per_token
    return out


def trl_self(model, settings: GRPOSettings, accum: int) -> SimpleNamespace:
    from trl import GRPOTrainer

    accelerator = SimpleNamespace(
        num_processes=1, gather=lambda x: x, reduce=lambda x, reduction: x, autocast=nullcontext,
        gather_for_metrics=lambda x: x, is_main_process=True,
    )  # fmt: skip
    ns = SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token",
        beta=settings.beta, loss_type=settings.loss_type, epsilon_low=settings.epsilon,
        epsilon_high=settings.clip_high, use_vllm=False, vllm_importance_sampling_correction=False, model=model,
        current_gradient_accumulation_steps=accum, max_completion_length=settings.max_completion_length,
        accelerator=accelerator, _metrics=defaultdict(lambda: defaultdict(list)), _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        args=SimpleNamespace(use_bias_correction_kl=settings.bias_correction_kl, delta=None, steps_per_generation=accum),
    )  # fmt: skip
    ns.importance_sampling_level = settings.importance_sampling_level
    ns._get_per_token_logps_and_entropies = types.MethodType(GRPOTrainer._get_per_token_logps_and_entropies, ns)
    return ns


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_gradient_and_metrics_equal_trl_grpo_trainer(loss_type: str, beta: float, level: str) -> None:
    """Our GRPO loss of one micro-batch (tiled LM head, temperature 0.7, old log-probs off the current ones as
    with num_iterations > 1, a reference model for beta > 0) equals ``accum`` × TRL's ``_compute_loss`` (TRL
    divides by the accumulation steps itself; DeepSpeed does here), and so do the LM head's gradient and TRL's
    entropy / clip_ratio / kl metrics, at TRL 1.16's defaults (the KL's bias correction on), per token and per
    sequence (GSPO). The largest relative difference is printed (pytest -s)."""
    from trl import GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    accum = 2
    settings = GRPOSettings(
        rewards=("x",), loss_type=loss_type, beta=beta, temperature=0.7, epsilon=0.2, epsilon_high=0.28,
        max_completion_length=8, num_iterations=2, reference="frozen-copy" if beta else "none",
        importance_sampling_level=level,
    )  # fmt: skip
    assert settings.bias_correction_kl  # TRL 1.16's default
    fx = fixed_inputs()
    ours_model = tiny_qwen()
    theirs_model = copy.deepcopy(ours_model)
    ref_model = tiny_qwen(seed=5)
    install_tiled_loss(ours_model, TiledLoss.choose("on", 300, 32))
    add_fused_lm_head(theirs_model, temperature=0.7, outputs=("log_probs", "entropy"))
    add_fused_lm_head(ref_model, temperature=0.7)

    rows = completion_rows(fx["prompts"], fx["completions"], 0, torch.device("cpu"))
    p_len = max(len(p) for p in fx["prompts"])
    trl_inputs = trl_layout(rows, fx["prompts"], fx["completions"])
    adv = advantages(fx["rewards"], 3, "group")
    t = trl_self(ref_model, settings, accum)
    with torch.no_grad():
        ids = torch.cat([trl_inputs["prompt_ids"], trl_inputs["completion_ids"]], 1)
        att = torch.cat([trl_inputs["prompt_mask"], trl_inputs["completion_mask"]], 1)
        ref, _, _ = t._get_per_token_logps_and_entropies(ref_model, ids, att, ids.shape[1] - p_len)
    old = -torch.rand(ref.shape, generator=fx["g"]) * 0.3 + (ref * 0.9)  # off-policy: ratios on both sides of clip
    trl_inputs |= {
        "advantages": adv, "old_per_token_logps": old * trl_inputs["completion_mask"],
        "ref_per_token_logps": ref, "num_items_in_batch": trl_inputs["completion_mask"].sum(),
    }  # fmt: skip
    batch = rows | {"advantages": adv, "old_logps": to_rows(old * trl_inputs["completion_mask"], p_len)}
    if beta:
        batch["ref_logps"] = to_rows(ref, p_len)

    t.model = theirs_model
    theirs = GRPOTrainer._compute_loss(t, theirs_model, trl_inputs)
    theirs.backward()
    objective = GRPO(settings)
    normalizer = rows["labels"].ne(-100).sum().float() / accum
    ours = objective.loss(ours_model, batch, normalizer)
    ours.backward()
    stats = objective.window_stats("train")

    diffs = {"loss": abs(ours.item() - accum * theirs.item()) / abs(accum * theirs.item())}
    keys = ("entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl")
    for key in (*keys, "clip_ratio/low_min", "clip_ratio/high_max"):
        assert (key in t._metrics["train"]) == (key in stats), key
        if key in t._metrics["train"]:
            expected = t._metrics["train"][key][0]
            diffs[key] = abs(stats[key] - expected) / max(abs(expected), 1e-12)
    assert ("kl" in stats) == bool(beta)
    grad_ours, grad_theirs = ours_model.lm_head.weight.grad, theirs_model.lm_head.weight.grad * accum
    diffs["grad"] = ((grad_ours - grad_theirs).abs().max() / grad_theirs.abs().max()).item()
    print(f"{loss_type} beta {beta}: largest relative differences {diffs}")
    assert all(d <= TOL for d in diffs.values()), diffs
    assert stats["clip_ratio/region_mean"] > 0  # the test exercises the clip


@pytest.mark.launcher
def test_three_ranks_step_gradient_equals_trls_for_every_loss_type(tmp_path) -> None:
    """3 ranks × 2 micro-batches of uneven completion lengths: the objective's normaliser (dapo: the token count
    all-reduced over the ranks; the others per micro-batch) gives TRL's step gradient for every loss type, and dapo
    normalised by each rank's own count does not (tests/helpers/grpo_normaliser.py)."""
    from tests.conftest import REPO, cpu_env, launch

    out = tmp_path / "diffs.json"
    launch(["--out", str(out)], env=cpu_env(PYTHONPATH=str(REPO)), script="tests/helpers/grpo_normaliser.py")
    diffs = json.loads(out.read_text())
    print(diffs)
    assert all(diffs[loss_type] <= TOL for loss_type in LOSS_TYPES), diffs
    assert diffs["dapo, each rank's own count"] > 1e-3, diffs


def test_advantages_equal_trls_for_every_scaling() -> None:
    """(r − group mean) / (std + 1e-4) with TRL's nanstd: group, batch and none; an unscorable row gets 0."""
    from trl.trainer.utils import nanstd as trl_nanstd

    r = torch.tensor([0.1, 0.5, 0.9, 0.3, float("nan"), 0.3, 1.0, 2.0, 0.0])
    grouped = r.view(-1, 3)
    mean = torch.nanmean(grouped, 1).repeat_interleave(3)
    std_group = trl_nanstd(grouped, dim=1).repeat_interleave(3)
    std_batch = trl_nanstd(r)
    expected = {
        "group": torch.nan_to_num((r - mean) / (std_group + 1e-4)),
        "batch": torch.nan_to_num((r - mean) / (std_batch + 1e-4)),
        "none": torch.nan_to_num(r - mean),
    }
    for scale, want in expected.items():
        got = advantages(r, 3, scale, nanstd(r) if scale == "batch" else None)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert got[4] == 0


# --- train.py -------------------------------------------------------------------------------------------------------

REWARD_FILE = """
import os

calls = [0]


def share(prompts, completions, completion_ids, chars, **kw):
    \"\"\"The share of the completion's characters that are among the record's chars (a random model's
    byte-level completions score from 0 to 1: groups differ, so every step has a gradient).\"\"\"
    return [sum(ch in x for ch in c) / max(len(c), 1) for c, x in zip(completions, chars)]


def broken(prompts, completions, completion_ids, chars, **kw):
    \"\"\"share for one generation (steps 1 and 2), then (rank 1 only, from its second call on) an error.\"\"\"
    calls[0] += 1
    if os.environ.get("RANK") == "1" and calls[0] >= 2:
        raise ValueError("no nines")
    return share(prompts, completions, completion_ids, chars)
"""
STEPS = 4


@pytest.fixture(scope="module")
def rl(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Prompts with an extra column (prepared with --format prompts, a BPE trained here), a reward file reading
    it, and a tiny Qwen2 saved with that tokenizer."""
    import json
    import random
    import string
    import subprocess
    import sys

    from tests.conftest import REPO, cpu_env

    root = tmp_path_factory.mktemp("grpo")
    rng = random.Random(0)
    chars = string.ascii_letters + string.digits
    rows = [{"prompt": f"{rng.randint(0, 9)}+{rng.randint(0, 9)}=", "chars": chars} for _ in range(120)]
    (root / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "reward.py").write_text(REWARD_FILE)
    cmd = [sys.executable, "data/prepare.py", "--input", str(root / "p.jsonl"), "--format", "prompts"]
    cmd += ["--tokenizer", "train", "--vocab-size", "300", "--seq-len", "32", "--out", str(root / "data")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=cpu_env())
    assert proc.returncode == 0, proc.stderr
    save_tiny_qwen(root / "data", root / "model")
    return {"root": root, "data": root / "data", "model": root / "model", "reward": root / "reward.py"}


def save_tiny_qwen(data: Path, out: Path) -> None:
    """A tiny random Qwen2 with the prepared ``data``'s tokenizer (its end and pad tokens), saved with it to ``out``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(data / "tokenizer")
    model = tiny_qwen(vocab=len(tok))
    model.config.eos_token_id, model.config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)


def grpo_args(rl: dict, out, reward: str = "share", accum: int = 1, *extra: str) -> list[str]:
    return [
        "--deepspeed_config", "ds_configs/zero2.json", "--model", str(rl["model"]), "--data", str(rl["data"]),
        "--out", str(out), "--reward", f"{rl['reward']}:{reward}", "--num-generations", "4", "--micro-batch", "4",
        "--grad-accum", str(accum), "--max-completion-length", "8", "--max-steps", str(STEPS), "--log-interval", "1",
        "--eval-interval", "0", "--save-interval", "2", "--lr", "1e-3", "--warmup-steps", "1", "--no-export",
        "--precision", "fp32", "--num-iterations", "2",
        *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def rl_runs(rl: dict) -> dict:
    """Four launches shared by the tests below, each generating every second step (``--num-iterations 2``): 3 ranks
    × 4 steps (accumulation 1: 12 completions a step); 1 rank × 3 accumulation steps; a run whose reward fails on
    rank 1 at step 3 (after checkpoints at steps 1 and 2); and that run resumed from its step-1 checkpoint, between
    two generations, with the working reward (in a copy of its folder, metrics.jsonl gone)."""
    import shutil

    from tests.conftest import cpu_env, launch

    root = rl["root"]
    launch(grpo_args(rl, root / "full"), env=cpu_env())
    launch(grpo_args(rl, root / "one", "share", 3), nproc=1, env=cpu_env())
    broken = launch(grpo_args(rl, root / "broken", "broken", 1, "--save-interval", "1"), env=cpu_env(), check=False)
    shutil.copytree(root / "broken", root / "resumed")
    (root / "resumed" / "metrics.jsonl").unlink()
    (root / "resumed" / "checkpoints" / "latest").write_text("step00000001")  # mid generation batch
    resumed = launch(grpo_args(rl, root / "resumed", "share", 1, "--resume"), env=cpu_env())
    return {"root": root, "broken": broken, "resumed": resumed}


METRICS = (
    "loss", "reward", "reward_std", "completions/mean_length", "entropy", "clip_ratio/region_mean", "num_tokens",
    "rewards/share/std", "completions/max_length", "completions/min_terminated_length", "clip_ratio/high_max",
)  # fmt: skip


@pytest.mark.launcher
def test_train_py_logs_trls_metrics_and_resumes_exactly_and_1x3_equals_3x1(rl_runs: dict) -> None:
    """train.py on 3 ranks logs TRL's metric names (the user's reward by its function name) and completions.jsonl;
    a run resumed from the step-1 checkpoint, half-way through a generation batch, gives steps 2-4 equal to the
    uninterrupted run (the batch is in each rank's checkpoint file, the sampling state in the checkpoint); 1 rank ×
    3 accumulation steps gives the same curve as 3 ranks × 1."""
    from tests.conftest import records

    root = rl_runs["root"]
    full = {r["step"]: r for r in records(root / "full")}
    resumed = {r["step"]: r for r in records(root / "resumed")}
    one = {r["step"]: r for r in records(root / "one")}
    assert "resumed from step 1" in rl_runs["resumed"].stdout
    meta = json.loads((root / "data" / "meta.json").read_text())
    rows, longest = meta["n_rows"], meta["max_prompt_len"]
    header = f" {rows['train']:,} train prompts, {rows['val']:,} val prompts of at most {longest} tokens; loss: GRPO"
    assert header in rl_runs["resumed"].stdout
    assert "rewards/share/mean" in full[1] and "frac_reward_zero_std" in full[1]
    assert (root / "full" / "completions.jsonl").read_text().count("\n") == STEPS // 2  # one per generation
    assert sorted(resumed) == [2, 3, 4]
    generated = {s for s in full if "reward" in full[s]}
    assert generated == {1, 3}  # rewards are logged where a generation batch is made, as TRL does
    for runs, steps, tolerance in ((resumed, (2, 3, 4), (1e-6, 1e-9)), (one, range(1, STEPS + 1), (1e-5, 1e-7))):
        for step in steps:
            assert {k for k in METRICS if k in runs[step]} == {k for k in METRICS if k in full[step]}, step
            for key in [k for k in METRICS if k in full[step]]:
                want = pytest.approx(full[step][key], rel=tolerance[0], abs=tolerance[1])
                assert runs[step][key] == want, (step, key)
    assert len({full[s]["reward"] for s in generated}) > 1  # completions differ between generations
    for step in generated:  # TRL's rollout metrics, each consistent with the others
        r = full[step]
        assert r["completions/min_length"] <= r["completions/mean_length"] <= r["completions/max_length"] <= 8
        ended = ("min_terminated_length", "mean_terminated_length", "max_terminated_length")
        low, mean, high = (r[f"completions/{k}"] for k in ended)
        assert low <= mean <= high and (high > 0) == (r["completions/clipped_ratio"] < 1)
        assert r["rewards/share/std"] == pytest.approx(r["reward_std"])  # one reward: the same
        assert 0 <= r["clip_ratio/low_min"] <= r["clip_ratio/high_max"] + 1
    tokens = [full[s]["num_tokens"] for s in sorted(generated)]
    assert tokens == sorted(tokens) and tokens[0] > 12 * 8  # prompts + completions, all ranks, cumulative
    for step, record in full.items():  # the step's wall time split into its phases, as verl and TRL log it
        phases = [record[f"timing/{p}_s"] for p in ("generation", "scoring", "reference", "train")]
        assert min(phases) >= 0 and sum(phases) == pytest.approx(record["step_time_s"], rel=1e-6), record
        assert (record["timing/generation_s"] > 0) == ("generation/tokens_per_s" in record) == (step in generated)
    assert all(full[s]["grad_norm"] > 0 for s in full)  # every step learns something: the equalities mean much


@pytest.mark.launcher
def test_a_reward_that_raises_stops_every_rank_with_one_line_and_keeps_the_last_checkpoint(rl_runs: dict) -> None:
    """Rank 1's reward raises at step 3: every rank stops with the same one line naming the reward file and the
    record, no traceback; the step-2 checkpoint stays the latest, whole (the resume above trains on from step 1)."""
    import re

    proc, ckpt = rl_runs["broken"], rl_runs["root"] / "broken" / "checkpoints"
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert proc.returncode != 0 and errors, proc.stderr[-3000:]
    lines = {re.sub(r"^.*?error: ", "", line) for line in errors}
    assert len(lines) == 1, errors
    assert re.fullmatch(
        r"--reward .*reward\.py:broken: raised ValueError: no nines on completion 0 of the batch \(record \d+, prompt"
        r" '.*'\)\. Fix: fix .*reward\.py:broken for this input",
        lines.pop(),
    ), errors
    assert "Traceback" not in proc.stderr
    assert (ckpt / "latest").read_text() == "step00000002"
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["step00000001", "step00000002"]


@pytest.mark.launcher
def test_lora_under_zero3_with_the_adapters_off_reference_starts_on_the_full_runs_curve(
    rl: dict, rl_runs: dict
) -> None:
    """GRPO with LoRA under ZeRO-3 (parameters gathered for generation) and beta 0.04 against the model with its
    adapters off: LoRA's B starts at zero, so step 1 generates the same completions from the same weights as the full
    ZeRO-2 run above and logs its reward and loss; the KL starts at 0 and grows once the adapters move."""
    from tests.conftest import cpu_env, launch, records

    out = rl_runs["root"] / "lora_zero3"
    extra = ["--deepspeed_config", "ds_configs/zero3.json", "--lora", "r=8", "--beta", "0.04", "--lr", "2e-2"]
    proc = launch(grpo_args(rl, out, "share", 1, *extra), env=cpu_env())
    assert "ZeRO-3" in proc.stdout and "beta 0.04, reference = adapters off" in proc.stdout, proc.stdout[-3000:]
    full = {r["step"]: r for r in records(rl_runs["root"] / "full")}
    lora = {r["step"]: r for r in records(out)}
    for key in ("reward", "reward_std", "completions/mean_length", "loss"):
        assert lora[1][key] == pytest.approx(full[1][key], rel=1e-5, abs=1e-7), key
    assert lora[1]["kl"] == pytest.approx(0.0, abs=1e-7)
    assert lora[STEPS]["kl"] > 0 and all(lora[s]["grad_norm"] > 0 for s in lora)


@pytest.mark.launcher
def test_grpo_on_a_4bit_base_under_zero3(rl: dict, rl_runs: dict) -> None:
    """QLoRA GRPO (--load-in-4bit, ZeRO-3: the 4-bit blocks partitioned and gathered for generation) with beta 0.04
    against the 4-bit model with its adapters off: the KL is exactly 0 at step 1 (the adapters start at zero), then
    grows; every step has a gradient and a reward. The same launch runs TRL's other switches end to end: rewards
    scaled by the whole batch's std (an all-reduce over the 3 ranks; frac_reward_zero_std is then all or nothing),
    truncated completions masked, and a rank's 4 rows generated 3 at a time."""
    from tests.conftest import cpu_env, launch, records

    out = rl_runs["root"] / "qlora_zero3"
    extra = ["--deepspeed_config", "ds_configs/zero3.json", "--lora", "r=8", "--load-in-4bit", "--beta", "0.04"]
    extra += ["--scale-rewards", "batch", "--mask-truncated-completions", "--generation-batch-size", "3"]
    proc = launch(grpo_args(rl, out, "share", 1, *extra, "--lr", "2e-2"), env=cpu_env())
    assert (
        "scale rewards batch" in proc.stdout and "3 rows per generate call, truncated completions masked" in proc.stdout
    )
    header = "base in 4 bits (NF4, double quant, compute fp32, storage fp32, read on the host one rank at a time)"
    assert header in proc.stdout and "partitioned at load" in proc.stdout, proc.stdout[-3000:]
    assert "beta 0.04, reference = adapters off" in proc.stdout
    steps = {r["step"]: r for r in records(out)}
    assert sorted(steps) == list(range(1, STEPS + 1))
    assert steps[1]["kl"] == 0 and steps[STEPS]["kl"] > 0, steps
    assert all(steps[s]["grad_norm"] > 0 and 0 <= steps[s]["reward"] <= 1 for s in (1, 3)), steps
    assert all(steps[s]["frac_reward_zero_std"] in (0.0, 1.0) for s in (1, 3)), steps


@pytest.mark.launcher
def test_zero3_generation_gathers_every_parameter_once_and_fetches_nothing_per_token(rl: dict, tmp_path) -> None:
    """train.py's GRPO engine under ZeRO-3 on 2 ranks, its first step: while it generates, every parameter is
    gathered (once, before the first token) and DeepSpeed's coordinator fetches and releases nothing (its hooks are
    off, as TRL's ``unwrap_model_for_generation`` does); the same generation with the hooks on fetches modules at
    every decoding step, which shows the counter would see it."""
    from tests.conftest import REPO, cpu_env, launch

    out = tmp_path / "fetches.json"
    args = grpo_args(rl, tmp_path / "run", "share", 1)
    args[args.index("ds_configs/zero2.json")] = "ds_configs/zero3.json"
    env = cpu_env(PYTHONPATH=str(REPO))
    launch(["--out", str(out), "--", *args], nproc=2, env=env, script="tests/helpers/generation_fetches.py")
    counts = json.loads(out.read_text())
    assert counts["gathered"] == counts["params"] > 0
    assert counts["generating"] == {}, counts
    assert counts["hooks_on"].get("fetch_sub_module", 0) > counts["params"], counts


@pytest.mark.parametrize("mask", [False, True])
def test_mask_truncated_completions_leaves_the_cut_rows_out_of_the_loss(mask: bool) -> None:
    """``--mask-truncated-completions`` (TRL's semantics): a completion that ends without an end-of-sequence token
    (cut by the length limit) has no target tokens, so it leaves the loss and dapo's token normaliser; its reward
    still counts in its group's advantages. Without the flag every completion keeps its targets."""
    from deepzero.losses.grpo.objective import GRPO

    completions = [[5, 6, 2], [5, 6, 7, 8], [9, 2], [4, 4, 4, 4]]  # EOS is 2; rows 1 and 3 are cut
    sampler = SimpleNamespace(eos_ids=(2,), sample=lambda model, prompts, seeds: completions)
    objective = GRPO(GRPOSettings(rewards=("x",), num_generations=2, max_completion_length=4), sampler=sampler)
    objective.settings.mask_truncated_completions = mask
    objective.data = SimpleNamespace(record=lambda i: {}, prompt_text=lambda i: "p", prompt=lambda i: "p")
    objective.tokenizer = SimpleNamespace(batch_decode=lambda rows, skip_special_tokens: ["x"] * len(rows))
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    objective.rewards = SimpleNamespace(names=(), score_rows=lambda *a: (rewards, {}))
    prompts = {"prompt_ids": torch.tensor([[3, 4], [3, 5]]), "prompt_mask": torch.ones(2, 2), "index": torch.arange(2)}
    (batch,) = objective.generate_and_score(tiny_qwen(), prompts, accum=1)
    targets = (batch["labels"] != -100).sum(1).tolist()
    assert targets == ([3, 0, 2, 0] if mask else [3, 4, 2, 4])
    assert batch["advantages"].tolist() == pytest.approx(advantages(rewards, 2, "group").tolist())


def test_train_py_takes_the_planners_generation_batch_on_a_card_and_the_flag_over_it(
    rl: dict, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planning a GRPO run (in process): on the CPU every row of a rank goes in one generate call; with a card
    detected, the planner's most rows that fit (``plan.generation_rows``, tested in test_plan) where fewer than a
    rank's 16; ``--generation-batch-size`` wins over both. The header says which."""
    from deepzero.args import parse_args
    from deepzero.plan import fit
    from deepzero.run import plan_run

    args = grpo_args(rl, tmp_path / "run", "share", 4)  # micro 4 × accumulation 4: 16 rows per rank
    assert plan_run(parse_args(args), 3).grpo.generation_batch_size is None
    monkeypatch.setattr(fit, "detected_gpu_mem_gb", lambda: 24.0)
    monkeypatch.setattr(fit, "generation_rows", lambda stats, setup, gpu, cpu, most: min(most, 5))
    planned = plan_run(parse_args(args), 3).grpo
    assert planned.generation_batch_size == 5
    assert "5 rows per generate call" in GRPO(planned).describe()
    assert plan_run(parse_args([*args, "--generation-batch-size", "3"]), 3).grpo.generation_batch_size == 3


def test_grpo_trains_at_trls_learning_rate_when_the_preset_says_auto(rl: dict, tmp_path) -> None:
    """The presets' ``"lr": "auto"`` is TRL 1.16's GRPO default, 1e-6, on prompts data (3e-5 elsewhere), and the
    header's source says so; ``--lr`` still wins."""
    from deepzero.args import parse_args
    from deepzero.run import plan_run

    args = grpo_args(rl, tmp_path / "run")
    at = args.index("--lr")
    planned = plan_run(parse_args(args[:at] + args[at + 2 :]), 3)
    assert planned.cfg.ds["optimizer"]["params"]["lr"] == 1e-6
    assert "TRL 1.16's GRPO default" in planned.lr_source
    assert plan_run(parse_args(args), 3).cfg.ds["optimizer"]["params"]["lr"] == 1e-3


def test_the_completion_limit_is_the_datas_unless_a_flag_says_otherwise(
    rl: dict, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --max-completion-length GRPO generates up to the data's max_completion_length (meta.json); a flag that
    differs is used and said in one warning line; --reward soft_overlong always punishes against the data's."""
    from transformers import AutoConfig

    from deepzero.args import parse_args
    from deepzero.data import load_meta
    from deepzero.methods import grpo as grpo_plan

    meta, config = load_meta(rl["data"]), AutoConfig.from_pretrained(rl["model"])
    data_limit = meta["max_completion_length"]
    args = grpo_args(rl, tmp_path / "run", "share")
    at = args.index("--max-completion-length")
    base = args[:at] + args[at + 2 :] + ["--reward", "soft_overlong"]
    settings, rewards = grpo_plan.plan(parse_args(base), meta, config)
    assert settings.max_completion_length == data_limit and "differs" not in capsys.readouterr().err
    flagged, again = grpo_plan.plan(parse_args([*base, "--max-completion-length", "4"]), meta, config)
    assert flagged.max_completion_length == 4 and "differs from the data's" in capsys.readouterr().err
    long = [[5] * (data_limit - 1)]
    _, each = rewards.score(["p"], ["x"], long, [{"chars": "x"}], [0])
    _, same = again.score(["p"], ["x"], long, [{"chars": "x"}], [0])
    assert 0 > each["soft_overlong"].item() == same["soft_overlong"].item() > -1  # in the data's limit's cache


TRL_STYLE_REWARDS = '''
def reward_len(completions, **kwargs):
    """TRL's docs' example, for conversational data: completion[0]["content"]."""
    return [-abs(20 - len(completion[0]["content"])) for completion in completions]


def with_state(prompts, completions, completion_ids, solution, trainer_state, log_extra, log_metric, **kwargs):
    assert all(isinstance(p, list) and p[-1]["role"] == "user" for p in prompts), prompts
    contents = [c[0]["content"] for c in completions]
    log_extra("chars", [len(c) for c in contents])
    log_metric("step_seen", float(trainer_state.global_step))
    return [float(c.endswith(s)) for c, s in zip(contents, solution)]
'''


def test_a_reward_file_in_trls_style_for_chat_prompts_runs_unchanged(tmp_path) -> None:
    """GRPO's scoring as TRL 1.16 calls rewards, through the product's generate_and_score: message-list prompts as
    given, each completion as ``[{"role": "assistant", "content": ...}]``, every column, ``trainer_state``,
    ``log_extra`` (a column of completions.jsonl) and ``log_metric`` (a metric of the window); a reward file written
    for TRL's GRPOTrainer (its docs' ``reward_len``) scores without a change."""
    from deepzero.losses.grpo.objective import GRPO
    from deepzero.rollout.rewards import parse_rewards

    (tmp_path / "r.py").write_text(TRL_STYLE_REWARDS)
    rewards = parse_rewards([f"{tmp_path}/r.py:reward_len", f"{tmp_path}/r.py:with_state"], 8)
    texts = {5: "abc", 6: "abcdef"}
    completions = [[5, 2], [6, 2]]
    sampler = SimpleNamespace(eos_ids=(2,), sample=lambda model, prompts, seeds: completions)
    settings = GRPOSettings(rewards=("x",), num_generations=2, max_completion_length=8, num_iterations=3)
    objective = GRPO(settings, sampler=sampler)
    chat = [{"role": "user", "content": "say it"}]
    objective.data = SimpleNamespace(
        record=lambda i: {"solution": "def"}, prompt_text=lambda i: "x", prompt=lambda i: chat
    )
    objective.tokenizer = SimpleNamespace(batch_decode=lambda rows, skip_special_tokens: [texts[r[0]] for r in rows])
    objective.rewards, objective.out_dir = rewards, tmp_path
    objective.seeds.generations = 4  # 4 generations of 3 steps each done: TRL's global_step 12
    prompts = {"prompt_ids": torch.tensor([[3, 4]]), "prompt_mask": torch.ones(1, 2), "index": torch.arange(1)}
    objective.generate_and_score(tiny_qwen(), prompts, accum=1)
    stats = objective.window_stats("train")
    assert stats["rewards/reward_len/mean"] == pytest.approx((-17 - 14) / 2)
    assert stats["rewards/with_state/mean"] == pytest.approx(0.5) and stats["step_seen"] == 12.0
    (line,) = (tmp_path / "completions.jsonl").read_text().splitlines()
    assert [s["chars"] for s in json.loads(line)["samples"]] == [3, 6]


def test_the_grpo_examples_scorer_runs_on_a_model(rl: dict, tmp_path) -> None:
    """``make grpo``'s before/after figure: data/grpo_example.py writes its prompts, data/prepare.py tokenizes them
    with a model's tokenizer, and ``--score`` prints that model's held-out mean reward (greedy, one batched call)."""
    import subprocess
    import sys

    from tests.conftest import REPO, cpu_env

    def run(*args: str) -> str:
        proc = subprocess.run([sys.executable, *args], cwd=REPO, env=cpu_env(), capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    run("data/grpo_example.py", "--out", str(tmp_path / "g.jsonl"))
    prep = ["--format", "prompts", "--tokenizer", str(rl["model"]), "--seq-len", "96", "--max-completion-length", "8"]
    run(
        "data/prepare.py",
        "--input",
        str(tmp_path / "g.jsonl"),
        *prep,
        "--val-fraction",
        "0.02",
        "--out",
        str(tmp_path / "d"),
    )
    out = run("data/grpo_example.py", "--score", str(rl["model"]), "--data", str(tmp_path / "d"))
    assert "held-out mean reward" in out and "(greedy)" in out, out
