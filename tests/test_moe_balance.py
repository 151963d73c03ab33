"""deepzero.moe_balance in process: defaults per family, the balance losses, the injected gradient's scaling, the
bias update and its agreement across ranks (gloo), activation-checkpoint recomputation, telemetry."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import prepare, records, run_bounded
from transformers import AutoModelForCausalLM

from deepzero import moe_balance
from deepzero.distributed import free_port, mean_and_max
from deepzero.errors import UserError
from deepzero.moe_balance import BalanceChoice, Balancer, balance_loss, choose, load_stats
from deepzero.presets import PRESETS

VOCAB = 64


def tiny(family: str = "v3", **overrides: object) -> torch.nn.Module:
    """A 3-layer DeepSeek (2 MoE layers of 8 experts, top-2), seeded: two calls give the same weights."""
    torch.manual_seed(0)
    config = PRESETS[f"tiny-deepseek-{family}"].config(vocab_size=VOCAB, num_hidden_layers=3, **overrides)
    config.use_cache = False
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").train()


def batch(seed: int, rows: int = 2, seq: int = 16) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def test_defaults_follow_the_model_family() -> None:
    v3 = choose(PRESETS["tiny-deepseek-v3"].config())
    assert (v3.mode, v3.bias_rate, v3.aux_alpha, v3.seq_aux) == ("both", 0.001, 0.0001, True)
    assert v3.describe() == "moe balance: bias γ 0.001 + sequence-wise complementary loss α 0.0001 (auto: DeepSeek-V3)"
    v2 = choose(PRESETS["tiny-deepseek-v2"].config(aux_loss_alpha=0.002, seq_aux=False))
    assert (v2.mode, v2.aux_alpha, v2.seq_aux, v2.uses_bias) == ("aux", 0.002, False, False)
    assert choose(PRESETS["tiny-deepseek-v2"].config()).aux_alpha == 0.001  # V2-Lite's value when the config has none
    assert (
        choose(PRESETS["tiny-deepseek-v3"].config(), "bias", bias_rate=0.01)
        .describe()
        .startswith("moe balance: bias γ 0.01 (")
    )
    assert choose(PRESETS["tiny-deepseek-v3"].config(), "off").describe() == "moe balance: off (--moe-balance off)"
    dense = choose(PRESETS["deepseek-coder-1.3b"].config())
    assert dense.mode == "off" and "dense" in dense.describe()


@pytest.mark.parametrize(
    ("preset", "mode", "match"),
    [
        ("tiny-deepseek-v2", "bias", "no e_score_correction_bias"),
        ("tiny-deepseek-v2", "both", "no e_score_correction_bias"),
        ("deepseek-coder-1.3b", "aux", "dense model"),
    ],
)
def test_impossible_choices_are_one_error(preset: str, mode: str, match: str) -> None:
    with pytest.raises(UserError, match=match):
        choose(PRESETS[preset].config(), mode)


def test_negative_coefficients_are_refused() -> None:
    with pytest.raises(UserError, match="--moe-bias-rate"):
        choose(PRESETS["tiny-deepseek-v3"].config(), "bias", bias_rate=-1.0)


def test_balance_loss_is_one_when_balanced_and_grows_with_skew() -> None:
    experts, tokens = 4, 8
    uniform = torch.full((tokens, experts), 1 / experts)
    spread = torch.arange(tokens * 2).reshape(tokens, 2) % experts  # every expert chosen equally often
    assert balance_loss(uniform, spread, rows=2, per_sequence=True).item() == pytest.approx(1.0)
    skewed_scores = torch.tensor([[0.7, 0.1, 0.1, 0.1]]).repeat(tokens, 1)
    collapsed = torch.tensor([[0, 1]]).repeat(tokens, 1)
    assert balance_loss(skewed_scores, collapsed, rows=2, per_sequence=True).item() == pytest.approx(1.6)
    assert balance_loss(skewed_scores, collapsed, rows=1, per_sequence=False).item() == pytest.approx(1.6)


def gate_outputs(model: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """Record (router logits, top-k, rows) of every router call (a plain hook, no Balancer)."""
    seen: list[tuple[torch.Tensor, torch.Tensor, int]] = []
    for router in moe_balance.find_routers(model):
        router.register_forward_hook(lambda m, args, out: seen.append((out[0], out[2], args[0].shape[0])))
    return seen


@pytest.mark.parametrize("family", ["v3", "v2"])
def test_injected_aux_gradient_equals_the_gradient_of_the_summed_loss(family: str) -> None:
    """Two micro-batches of accumulation and a loss scale of 8: the engine backpropagates loss·8/2; the injected
    balance loss must land in the gradients as if α·aux had been added to each micro-batch's loss."""
    accum, loss_scale, alpha = 2, 8.0, 0.05  # a large α, so a wrong scale shows in the router gradient
    injected, direct, plain = tiny(family), tiny(family), tiny(family)
    choice = BalanceChoice("aux", f"deepseek_{family}", aux_alpha=alpha, seq_aux=True)
    Balancer(injected, choice, lambda: loss_scale / accum, "cpu")
    seen = gate_outputs(direct)
    for micro in range(accum):
        (injected(**batch(micro)).loss * loss_scale / accum).backward()
        seen.clear()
        lm = direct(**batch(micro)).loss
        aux = sum(
            alpha * balance_loss(moe_balance.router_scores(lg, choice.family), k, rows, True) for lg, k, rows in seen
        )
        ((lm + aux) * loss_scale / accum).backward()
        (plain(**batch(micro)).loss * loss_scale / accum).backward()
    grads = dict(direct.named_parameters())
    for name, param in injected.named_parameters():
        assert torch.allclose(param.grad, grads[name].grad, rtol=1e-4, atol=1e-6), name
    router = "model.layers.1.mlp.gate.weight"
    without = dict(plain.named_parameters())[router].grad
    assert (dict(injected.named_parameters())[router].grad - without).abs().max() > 1e-3 * without.abs().max()


def test_bias_moves_toward_balance_in_fp32_from_the_steps_counts() -> None:
    model = tiny("v3").to(torch.bfloat16)
    seen = gate_outputs(model)
    balancer = Balancer(model, BalanceChoice("bias", "deepseek_v3", bias_rate=0.01), lambda: 1.0, "cpu")
    assert all(r.e_score_correction_bias.dtype == torch.float32 for r in balancer.routers)
    for micro in range(2):
        model(**batch(micro))
    counts = torch.stack([torch.bincount(seen[i][1].flatten(), minlength=8) for i in range(2)])
    counts += torch.stack([torch.bincount(seen[i][1].flatten(), minlength=8) for i in range(2, 4)])
    balancer.after_step()
    expected = 0.01 * torch.sign(counts.float().mean(1, keepdim=True) - counts.float())
    assert torch.equal(balancer.biases(), expected)
    assert expected.abs().sum() > 0
    assert balancer.step_counts.sum() == 0 and torch.equal(balancer.window_counts, counts)
    stats = balancer.window_stats()
    loads = counts.double() / counts.double().mean(1, keepdim=True)
    assert stats["expert_load_imbalance"] == pytest.approx(float(loads.max(1).values.mean()))
    assert stats["dead_experts"] == int((counts == 0).sum())
    assert len(stats["expert_load"]) == 2 and len(stats["expert_load"][0]) == 8
    assert balancer.window_counts.sum() == 0


def test_eval_forwards_and_recomputation_are_not_counted() -> None:
    model = tiny("v3")
    balancer = Balancer(model, BalanceChoice("both", "deepseek_v3", 0.001, 0.0001), lambda: 1.0, "cpu")
    model(**batch(0)).loss.backward()
    once = balancer.step_counts.clone()
    assert once.sum() == 2 * 2 * 16 * 2  # layers × rows × tokens × top-k
    model.eval()
    with torch.no_grad():
        model(**batch(0))
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model(**batch(0)).loss.backward()  # the backward recomputes each layer's forward
    assert torch.equal(balancer.step_counts, 2 * once)
    assert int(balancer.loss_calls.sum()) == 4


PAD = VOCAB - 1
"""The pad id of the padded batches (real tokens are drawn below it)."""


def padded(seed: int, pad: int = 16, rows: int = 2, seq: int = 16) -> tuple[dict, dict]:
    """The same real rows twice, in PackedDataset's format (targets already shifted, -100 where none): as they are,
    and each followed by ``pad`` positions of padding (pad id, no target), as data/prepare.py ends a chat row."""
    ids = torch.randint(0, PAD, (rows, seq), generator=torch.Generator().manual_seed(seed))
    targets = torch.cat([ids[:, 1:], torch.full((rows, 1), -100)], dim=1)
    tail = torch.full((rows, pad), PAD)
    padded_targets = torch.cat([targets, torch.full_like(tail, -100)], dim=1)
    return (
        {"input_ids": ids, "labels": targets, "shift_labels": targets},
        {"input_ids": torch.cat([ids, tail], dim=1), "labels": padded_targets, "shift_labels": padded_targets},
    )


def balanced_step(family: str, choice: BalanceChoice, micro: list[dict]) -> tuple[Balancer, dict, torch.Tensor]:
    """One optimizer step's forwards and backwards on a fresh tiny model, the micro-batches drawn through
    ``Balancer.watch`` as train.py draws them; the step's loads, the world's loads after the bias update, the
    balance-loss sum and the gradients."""
    model = tiny(family)
    balancer = Balancer(model, choice, lambda: 0.5, "cpu")
    for b in balancer.watch(iter(micro), PAD):
        (model(**b).loss / len(micro)).backward()
    counts = balancer.step_counts.clone()
    balancer.after_step()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return balancer, grads, counts


@pytest.mark.parametrize(
    ("family", "choice"),
    [
        ("v3", BalanceChoice("both", "deepseek_v3", bias_rate=0.01, aux_alpha=0.05, seq_aux=True)),
        ("v2", BalanceChoice("aux", "deepseek_v2", aux_alpha=0.05, seq_aux=True)),
        ("v2", BalanceChoice("aux", "deepseek_v2", aux_alpha=0.05, seq_aux=False)),
    ],
    ids=["v3-bias-sequence-wise", "v2-sequence", "v2-batch"],
)
def test_padding_is_neither_counted_nor_balanced(family: str, choice: BalanceChoice) -> None:
    """Half of every position padding (two micro-batches): the loads, the bias update, the balance loss and every
    gradient (the injected loss's included) equal those of the same real tokens without padding."""
    pairs = [padded(seed) for seed in (1, 2)]
    plain, plain_grads, plain_counts = balanced_step(family, choice, [p for p, _ in pairs])
    pad, pad_grads, pad_counts = balanced_step(family, choice, [q for _, q in pairs])
    assert int(plain_counts.sum()) == 2 * 2 * 2 * 16 * 2  # micro × layers × rows × real tokens × top-k
    assert torch.equal(pad_counts, plain_counts)
    assert torch.equal(pad.window_counts, plain.window_counts)
    if choice.uses_bias:
        assert plain.biases().abs().sum() > 0 and torch.equal(pad.biases(), plain.biases())
    assert plain.loss_sum.sum() > 0
    assert torch.allclose(pad.loss_sum, plain.loss_sum, rtol=1e-5, atol=0)
    assert pad.window_stats()["balance_loss"] == pytest.approx(plain.window_stats()["balance_loss"], rel=1e-5)
    for name, grad in plain_grads.items():
        assert torch.allclose(pad_grads[name], grad, rtol=1e-4, atol=1e-7), name


def test_padding_counted_would_show() -> None:
    """The check above can fail: drawn without ``watch`` (every position counted), the padded batch's loads,
    bias and balance loss differ from the unpadded batch's."""
    choice = BalanceChoice("both", "deepseek_v3", bias_rate=0.01, aux_alpha=0.05)
    plain, _, plain_counts = balanced_step("v3", choice, [padded(1)[0]])
    model = tiny("v3")
    unwatched = Balancer(model, choice, lambda: 1.0, "cpu")
    model(**padded(1)[1]).loss.backward()
    assert int(unwatched.step_counts.sum()) == 2 * int(plain_counts.sum())
    assert not torch.allclose(unwatched.loss_sum, plain.loss_sum, rtol=1e-3)
    unwatched.after_step()
    assert not torch.equal(unwatched.biases(), plain.biases())


def test_real_tokens_keep_prompts_and_a_closing_eos_that_is_also_the_pad() -> None:
    """A chat row: prompt (no target), answer and its closing eos (targets), padding. With the pad id a separate
    token only the final run of it is padding; with pad = eos the answer's closing eos (a target) stays real, and
    an eos inside the row (a prompt's) is real; text rows have no padding."""
    eos, pad = 5, 7
    row = [1, 9, 5, 9, 9, 8, 8, 5, eos, eos, eos]  # row[t]: prompt 0-4 (5 = a prompt's eos), answer 5-7 + eos
    target = [0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0]
    for pad_id, tail in ((eos, row), (pad, row[:8] + [pad] * 3)):
        ids = torch.tensor([tail])
        labels = torch.tensor([[tok if hit else -100 for tok, hit in zip(tail[1:], target[1:], strict=True)]])
        real = moe_balance.real_tokens({"input_ids": ids[:, :-1], "labels": labels}, pad_id)
        assert real.tolist() == [[True] * 8 + [False] * 2], pad_id
    text = {"input_ids": torch.tensor([[1, 2, eos, eos]]), "labels": torch.tensor([[2, eos, eos, 3]])}
    assert moe_balance.real_tokens(text, moe_balance.padding_id({"format": "text", "eos_token_id": eos})) is None
    assert moe_balance.padding_id({"format": "chat", "pad_token_id": None, "eos_token_id": eos}) == eos
    assert moe_balance.padding_id({"format": "chat", "pad_token_id": pad, "eos_token_id": eos}) == pad


SYNCS = ("item", "tolist", "cpu", "__bool__", "__float__", "__int__", "numpy")
"""Tensor methods that make the host wait for the device."""


def count_syncs(monkeypatch: pytest.MonkeyPatch, calls: list[str]) -> None:
    for name in SYNCS:
        original = getattr(torch.Tensor, name)

        def counted(
            self: torch.Tensor, *args: object, _name: str = name, _f: object = original, **kw: object
        ) -> object:
            calls.append(_name)
            return _f(self, *args, **kw)  # type: ignore[operator]

        monkeypatch.setattr(torch.Tensor, name, counted)


def test_a_training_step_with_balancing_waits_for_the_device_no_more_than_without(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Forward + backward of two padded micro-batches and the bias update: the Balancer's real-token masks, hooks,
    losses and update add no host read of a tensor (counted over every Tensor method that waits); only ``window_stats`` reads them."""
    plain, balanced = tiny("v3"), tiny("v3")
    balancer = Balancer(balanced, BalanceChoice("both", "deepseek_v3", 0.001, 0.0001), lambda: 0.5, "cpu")
    counts: dict[str, list[str]] = {"plain": [], "balanced": []}
    for name, model in (("plain", plain), ("balanced", balanced)):
        with monkeypatch.context() as patch:
            count_syncs(patch, counts[name])
            micro = iter([padded(seed)[1] for seed in range(2)])  # half padding: the real-token masks too
            for b in balancer.watch(micro, PAD) if model is balanced else micro:
                (model(**b).loss / 2).backward()
            if model is balanced:
                balancer.after_step()
    assert counts["balanced"] == counts["plain"]
    with monkeypatch.context() as patch:
        reads: list[str] = []
        count_syncs(patch, reads)
        assert balancer.window_stats()["dead_experts"] >= 0
    assert reads  # the log point is where the numbers come to the host


def test_load_stats_of_a_collapsed_and_a_balanced_layer() -> None:
    counts = torch.tensor([[8, 8, 0, 0], [4, 4, 4, 4]])
    stats = load_stats(counts)
    assert stats["expert_load_imbalance"] == pytest.approx((2.0 + 1.0) / 2)
    assert stats["dead_experts"] == 2
    assert stats["expert_load"] == [[2.0, 2.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]


def _rank_main(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = tiny("v3")
    balancer = Balancer(model, BalanceChoice("bias", "deepseek_v3", bias_rate=0.001), lambda: 1.0, "cpu")
    local_counts = []
    for step in range(3):
        for micro in range(2):  # each rank its own rows
            model(**batch(100 * rank + 10 * step + micro))
        local_counts.append(balancer.step_counts.clone())
        balancer.after_step()
        if step == 0:
            first_bias = balancer.biases()
    gathered = [torch.zeros(2, 8) for _ in range(world)]
    dist.all_gather(gathered, balancer.biases())
    bias_stats = balancer.window_stats()  # the loads were summed over the world at each step already
    # Telemetry without the bias (aux loss on): a window's loads and losses, summed over the world at the log point.
    aux_model = tiny("v3")
    aux = Balancer(aux_model, BalanceChoice("aux", "deepseek_v3", aux_alpha=0.01), lambda: 1.0, "cpu")
    for micro in range(2):
        aux_model(**batch(100 * rank + micro))
    window = {"counts": aux.step_counts.clone(), "loss_sum": aux.loss_sum.clone(), "calls": aux.loss_calls.clone()}
    aux.after_step()
    window["stats"] = aux.window_stats()
    window["mean_and_max"] = mean_and_max([float(rank), 1.5], [float(rank) * 2, -float(rank)])
    torch.save(
        {
            "biases": gathered,
            "first_counts": local_counts[0],
            "first_bias": first_bias,
            "window": window,
            "steps_counts": torch.stack(local_counts).sum(0),
            "bias_stats": bias_stats,
        },
        f"{out}/{rank}.pt",
    )
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """What each of three gloo ranks of ``_rank_main`` saved (one spawn for the tests below)."""
    out, world = tmp_path_factory.mktemp("ranks"), 3
    mp.start_processes(_rank_main, args=(world, free_port(), str(out)), nprocs=world, start_method="spawn")
    return {rank: torch.load(out / f"{rank}.pt") for rank in range(world)}


def test_every_rank_keeps_the_same_bias_from_the_world_summed_loads(three_ranks: dict[int, dict]) -> None:
    """Three gloo ranks on different rows: after three steps every rank's bias is bit-identical and not zero."""
    world, results = 3, three_ranks
    first = results[0]["biases"][0]
    assert first.abs().sum() > 0
    for rank in range(world):
        assert all(torch.equal(b, first) for b in results[rank]["biases"])
    local = [results[r]["first_counts"].float() for r in range(world)]
    summed = sum(local)
    assert torch.equal(results[0]["first_bias"], 0.001 * torch.sign(summed.mean(1, keepdim=True) - summed))
    alone = [torch.sign(c.mean(1, keepdim=True) - c) for c in local]  # what each rank would do on its own counts
    assert any(not torch.equal(a, alone[0]) for a in alone[1:])


def test_a_log_points_telemetry_and_numbers_are_the_worlds(three_ranks: dict[int, dict]) -> None:
    """Three gloo ranks: the window's loads and balance loss are those of every rank's summed (one all-reduce), and
    ``mean_and_max`` gives each value's mean and largest over the ranks, the same on every rank."""
    windows = [three_ranks[rank]["window"] for rank in range(3)]
    counts = sum(w["counts"] for w in windows)
    assert any(not torch.equal(w["counts"], windows[0]["counts"]) for w in windows[1:])  # the ranks saw other rows
    expected = load_stats(counts)
    per_layer = sum(w["loss_sum"].double() for w in windows) / sum(w["calls"].double() for w in windows)
    for w in windows:
        stats = dict(w["stats"])
        assert stats.pop("balance_loss") == pytest.approx(float(per_layer.sum()), rel=1e-6)
        assert stats == expected
        assert w["mean_and_max"] == ([1.0, 1.5], [4.0, 0.0])
    with_bias = load_stats(sum(three_ranks[rank]["steps_counts"] for rank in range(3)))
    assert all(three_ranks[rank]["bias_stats"] == with_bias for rank in range(3))


# Through train.py (one process, fp32 ZeRO-2) on a tiny DeepSeek-V3 whose routers favour experts 0 and 1.

STEPS = 60


@pytest.fixture(scope="module")
def skewed(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from bench.moe_balance import write_skewed_model
    from deepzero.data import load_meta
    from deepzero.modeling import load_tokenizer

    vocab = len(load_tokenizer(load_meta(tiny_data)["tokenizer"], False))
    return write_skewed_model(tmp_path_factory.mktemp("skewed") / "model", vocab)


def train(model: Path, data: Path, out: Path, *extra: str, steps: int = STEPS) -> list[dict]:
    from bench.moe_balance import train_args

    cmd = [sys.executable, "train.py", *train_args(model, data, out, steps, 10, *extra, micro=2)]
    proc = run_bounded(cmd, 300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return records(out)


@pytest.fixture(scope="module")
def off_run(skewed: Path, tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return train(skewed, tiny_data, tmp_path_factory.mktemp("off") / "run", "--moe-balance", "off")


@pytest.mark.parametrize(
    "flags",
    [("--moe-balance", "bias", "--moe-bias-rate", "0.02"), ("--moe-balance", "aux", "--moe-aux-alpha", "0.1")],
    ids=["bias", "aux"],
)
def test_balancing_brings_a_skewed_router_toward_balance_and_loss_no_worse(
    flags: tuple[str, ...], off_run: list[dict], skewed: Path, tiny_data: Path, tmp_path: Path
) -> None:
    """Off: the imbalance (max/mean tokens per expert) stays above 2.5 in every window; balanced: the mean of the
    last three windows (steps 40-60) is under 1.75, halfway between perfect balance (1.0) and off's floor, no expert
    is dead at the end, and the LM loss over those windows is no worse than off's (same seed, same rows). Means over
    windows and margins, not one window against a tight bound: a near-tie in top-k routing rounds differently on
    another CPU (an AVX512 Xeon's aux curve ended 1.35, 1.49, 1.502 against a bound of 1.5 on the last window)."""
    assert all(r["expert_load_imbalance"] > 2.5 for r in off_run), [r["expert_load_imbalance"] for r in off_run]
    assert off_run[-1]["dead_experts"] > 0
    balanced = train(skewed, tiny_data, tmp_path / "run", *flags)
    curve = [round(r["expert_load_imbalance"], 2) for r in balanced]
    last = balanced[-3:]
    assert [r["step"] for r in last] == [40, 50, 60]
    assert sum(r["expert_load_imbalance"] for r in last) / 3 < 1.75, curve
    assert balanced[-1]["dead_experts"] == 0
    loss, off_loss = (sum(r["loss"] for r in run[-3:]) / 3 for run in (balanced, off_run))
    print(f"{flags[1]}: imbalance {curve}, last-3 loss {loss:.4f} vs off {off_loss:.4f}")
    assert loss <= off_loss + 0.05, (loss, off_loss)
    assert ("balance_loss" in balanced[-1]) == (flags[1] == "aux")
    assert len(balanced[-1]["expert_load"]) == 3 and len(balanced[-1]["expert_load"][0]) == 8


def test_bias_resumes_exactly_and_reaches_the_export(skewed: Path, tiny_data: Path, tmp_path: Path) -> None:
    """Bias and sequence-wise loss on: stopped at step 10 and resumed, the curve and the final bias are those of the
    uninterrupted run; the exported safetensors carry the bias (the export's reload matched the engine's logits)."""
    from safetensors.torch import load_file

    flags = ("--moe-balance", "both", "--moe-bias-rate", "0.02", "--save-interval", "10", "--log-interval", "1")
    whole = train(skewed, tiny_data, tmp_path / "whole", *flags, "--export", steps=20)
    train(skewed, tiny_data, tmp_path / "cut", *flags, steps=10)
    resumed = train(skewed, tiny_data, tmp_path / "cut", *flags, "--resume", "--export", steps=20)
    assert [r["loss"] for r in whole[10:]] == [r["loss"] for r in resumed[-10:]]
    assert [r["expert_load"] for r in whole[10:]] == [r["expert_load"] for r in resumed[-10:]]
    exports = [r for d in ("whole", "cut") for r in records(tmp_path / d, "export")]
    assert len(exports) == 2 and all(r["ok"] for r in exports)
    a, b = (load_file(tmp_path / d / "hf" / "model.safetensors") for d in ("whole", "cut"))
    keys = sorted(k for k in a if k.endswith("e_score_correction_bias"))
    assert len(keys) == 3
    for key in keys:
        assert a[key].dtype == torch.float32 and a[key].abs().sum() > 0
        assert torch.equal(a[key], b[key]), key


# Through train.py on chat rows that end in padding: a pad embedding steered to expert 7 changes nothing.

CHAT_WORDS = ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"]


@pytest.fixture(scope="module")
def padded_chats(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """Chat data of one conversation per 64-token row (about 40% padding), and tiny-deepseek-v3 saved twice: as
    built, and with the pad id's embedding pointed along every router's expert 7."""
    import json
    import random

    from deepzero.data import load_meta
    from deepzero.modeling import load_tokenizer

    root = tmp_path_factory.mktemp("padded_chats")
    rng = random.Random(0)
    turns = [" ".join(rng.choices(CHAT_WORDS, k=rng.randint(14, 18))) for _ in range(2 * 100)]  # a token a word
    chats = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
        for q, a in zip(turns[::2], turns[1::2], strict=True)
    ]
    (root / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    args = ("--tokenizer", "train", "--vocab-size", "300", "--val-fraction", "0.1")
    data = prepare(root / "data", *args, inputs=[root / "chats.jsonl"], seq_len=64)
    meta = load_meta(data)
    torch.manual_seed(0)
    config = PRESETS["tiny-deepseek-v3"].config(vocab_size=len(load_tokenizer(meta["tokenizer"], False)))
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(root / "plain")
    rows = torch.stack([torch.nn.functional.normalize(r.weight[7], dim=0) for r in moe_balance.find_routers(model)])
    with torch.no_grad():
        model.get_input_embeddings().weight[moe_balance.padding_id(meta)] = 4 * rows.sum(0) / rows.norm()
    model.save_pretrained(root / "steered")
    return data, root / "plain", root / "steered"


def test_padding_steers_neither_loads_nor_bias_nor_loss_through_train_py(
    padded_chats: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    """The padding found in PackedDataset rows is exactly what prepare wrote as no token; counted, the steered pad
    ids would move onto expert 7 (its load +1× the mean or more in a layer). Trained through train.py (bias + sequence-wise loss,
    gradient checkpointing, 4 steps), the plain and the steered model give the same losses, balance losses and
    per-expert loads: the padding neither routes the bias nor enters the loss."""
    from deepzero.data import PackedDataset

    data, plain, steered = padded_chats
    rows = PackedDataset(data, "train")
    pad = moe_balance.padding_id(rows.meta)
    real = [moe_balance.real_tokens({k: v[None] for k, v in rows[i].items()}, pad) for i in range(len(rows))]
    assert sum(int(r.sum()) for r in real) == rows.meta["n_tokens"]["train"]  # every row ends in padding
    assert sum(int(r.sum()) for r in real) < 0.7 * len(rows) * rows.seq_len
    first = {k: torch.stack([rows[i][k] for i in range(8)]) for k in ("input_ids", "labels")}
    counted = {}
    for folder in (plain, steered):
        model = AutoModelForCausalLM.from_pretrained(folder).train()
        balancer = Balancer(model, BalanceChoice("off", "deepseek_v3"), lambda: 1.0, "cpu")  # no watch: all counted
        model(**first)
        counted[folder] = load_stats(balancer.step_counts)["expert_load"]
    moved = torch.tensor(counted[steered]) - torch.tensor(counted[plain])
    assert moved[:, 7].max() > 1.0 and moved[:, 7].min() >= 0, moved  # the pads move onto expert 7
    flags = ("--moe-balance", "both", "--moe-bias-rate", "0.02", "--moe-aux-alpha", "0.05", "--gradient-checkpointing")
    a = train(plain, data, tmp_path / "plain", *flags, "--log-interval", "2", steps=4)
    b = train(steered, data, tmp_path / "steered", *flags, "--log-interval", "2", steps=4)
    assert len(a) == len(b) == 2
    for ra, rb in zip(a, b, strict=True):
        assert rb["loss"] == pytest.approx(ra["loss"], abs=1e-5)
        assert rb["balance_loss"] == pytest.approx(ra["balance_loss"], rel=1e-4)
        for la, lb in zip(ra["expert_load"], rb["expert_load"], strict=True):
            assert lb == pytest.approx(la, abs=0.02), (la, lb)


@pytest.mark.launcher
def test_a_saved_v3_folders_bias_moves_through_train_py_into_the_checkpoint_hf_and_a_resume(
    tiny_data: Path, tmp_path: Path
) -> None:
    """A DeepSeek-V3 folder saved by Transformers, fully fine-tuned by train.py on 3 ranks with the default balancing
    (γ 0.001): after 3 steps every layer's e_score_correction_bias has moved (±γ per step), the checkpoint and hf/
    hold the same bias, and a --resume starts from it and moves it on."""
    from conftest import launch
    from safetensors.torch import load_file
    from test_qlora import pretrained_moe

    base = pretrained_moe(tmp_path / "v3", "tiny-deepseek-v3")
    out = tmp_path / "run"
    args = ["--deepspeed_config", "ds_configs/zero2.json", "--model", str(base), "--data", str(tiny_data)]
    args += ["--out", str(out), "--micro-batch", "2", "--grad-accum", "1", "--log-interval", "1"]
    args += ["--eval-interval", "0", "--precision", "fp32", "--save-interval", "3"]
    launch([*args, "--max-steps", "3"])
    source = load_file(base / "model.safetensors")
    keys = [k for k in source if k.endswith("e_score_correction_bias")]
    assert keys

    def checkpointed(step: int) -> dict[str, torch.Tensor]:
        folder = out / "checkpoints" / f"step{step:08d}"
        states = torch.load(next(folder.glob("*model_states.pt")), weights_only=False)["module"]
        return {k: states[k].float() for k in keys}

    at3, exported = checkpointed(3), load_file(out / "hf" / "model.safetensors")
    for key in keys:
        moved = at3[key] - source[key].float()
        assert moved.abs().max() >= 0.001 - 1e-6, key  # at least one step's ±γ stands
        assert torch.equal(exported[key].float(), at3[key]), key  # hf/ holds the trained bias (fp32 kept)
    launch([*args, "--max-steps", "4", "--resume", "--save-interval", "4"])
    at4 = checkpointed(4)
    assert all(not torch.equal(at4[k], at3[k]) for k in keys)
    assert all((at4[k] - at3[k]).abs().max() <= 0.001 + 1e-6 for k in keys)  # one step on from where it stood
