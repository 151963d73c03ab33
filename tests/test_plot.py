"""deepzero.plot: a fabricated metrics.jsonl becomes a valid, non-empty PNG (fast, no launcher)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from deepzero.errors import UserError
from deepzero.plot import main, plot

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def fake_metrics(path: Path, steps: int = 40, log_interval: int = 5) -> Path:
    """train records every log_interval steps (first window slow: warm-up), eval every 20, one NaN loss."""
    lines = []
    for step in range(log_interval, steps + 1, log_interval):
        tps = 800.0 if step == log_interval else 5000.0 + step
        loss = float("nan") if step == 15 else 8.0 - 0.1 * step
        lines.append({"kind": "train", "step": step, "loss": loss, "lr": 1e-3, "tokens_per_s": tps, "time": 1.0})
        if step % 20 == 0:
            lines.append({"kind": "eval", "step": step, "val_loss": 7.5 - 0.05 * step, "val_ppl": 100.0})
    lines.append({"kind": "export", "step": steps, "ok": True})
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plot_writes_a_png_next_to_the_metrics(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    out = plot(fake_metrics(tmp_path / "run" / "metrics.jsonl"))
    assert out == tmp_path / "run" / "curves.png"
    width, height = png_size(out)
    assert width >= 600 and height >= 300
    assert out.stat().st_size > 10_000  # two panels with lines, not a blank canvas


def test_cli_writes_to_the_given_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    metrics = fake_metrics(tmp_path / "metrics.jsonl")
    out = tmp_path / "plots" / "curves.png"
    assert main([str(metrics), "-o", str(out)]) == 0
    assert png_size(out)[0] > 0
    assert str(out) in capsys.readouterr().out


def test_missing_or_empty_metrics_are_one_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "nope.jsonl")]) == 2
    assert "no such metrics file" in capsys.readouterr().err
    empty = tmp_path / "metrics.jsonl"
    empty.write_text(json.dumps({"kind": "eval", "step": 1, "val_loss": 3.0}) + "\n")
    with pytest.raises(UserError, match="no train records"):
        plot(empty)


def test_moe_runs_get_an_expert_load_heatmap(tmp_path: Path) -> None:
    """Train records with per-layer expert loads add a third panel: the PNG is wider than a dense run's."""
    dense = plot(fake_metrics(tmp_path / "dense.jsonl"), tmp_path / "dense.png")
    moe = fake_metrics(tmp_path / "moe.jsonl")
    lines = [json.loads(line) for line in moe.read_text().splitlines()]
    for i, record in enumerate(lines):
        if record["kind"] == "train":
            skew = 3.0 / (1 + i)
            record["expert_load"] = [[1 + skew, 1 - skew / 7] + [1.0] * 6 for _ in range(3)]
            record["expert_load_imbalance"] = 1 + skew
    moe.write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = plot(moe, tmp_path / "moe.png")
    assert png_size(out)[0] > png_size(dense)[0] * 1.5
    assert out.stat().st_size > dense.stat().st_size


def test_preference_runs_get_a_rewards_panel(tmp_path: Path) -> None:
    """Train and eval records with TRL's reward metrics add a rewards panel: wider than the plain run's PNG."""
    plain = plot(fake_metrics(tmp_path / "plain.jsonl"), tmp_path / "plain.png")
    pref = fake_metrics(tmp_path / "pref.jsonl")
    lines = [json.loads(line) for line in pref.read_text().splitlines()]
    for record in lines:
        x = record["step"] / 40
        values = {"rewards/chosen": x, "rewards/rejected": -x, "rewards/margins": 2 * x, "rewards/accuracies": x}
        if record["kind"] == "train":
            record.update(values)
        elif record["kind"] == "eval":
            record.update({f"val_{k}": v for k, v in values.items()})
    pref.write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = plot(pref, tmp_path / "pref.png")
    assert png_size(out)[0] > png_size(plain)[0] * 1.3


def test_grpo_runs_get_a_panel_of_the_steps_phases(tmp_path: Path) -> None:
    """Train records with ``timing/<phase>_s`` (GRPO) add a panel of stacked phase times: a wider PNG."""
    plain = plot(fake_metrics(tmp_path / "plain.jsonl"), tmp_path / "plain.png")
    grpo = fake_metrics(tmp_path / "grpo.jsonl")
    lines = [json.loads(line) for line in grpo.read_text().splitlines()]
    for record in lines:
        if record["kind"] == "train":
            record |= {"timing/generation_s": 0.6, "timing/scoring_s": 0.05, "timing/reference_s": 0.1}
            record["timing/train_s"] = 0.25
    grpo.write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = plot(grpo, tmp_path / "grpo.png")
    assert png_size(out)[0] > png_size(plain)[0] * 1.3


def grpo_metrics(path: Path, evaluated: bool = True) -> Path:
    """A GRPO run's records as train.py writes them (deepzero.losses.grpo.metrics): TRL's ``reward``,
    ``reward_std`` and ``rewards/<name>/mean`` on the steps that generate, and at each eval ``val_reward`` and
    ``val_pass@1`` / ``val_pass@8`` / ``val_cons@8``."""
    lines = [json.loads(line) for line in fake_metrics(path).read_text().splitlines()]
    for record in lines:
        x = record["step"] / 40
        if record["kind"] == "train" and record["step"] % 10 == 0:  # rewards where a generation batch is made
            record |= {"reward": 0.2 + x, "reward_std": 0.3, "rewards/accuracy/mean": x, "rewards/format/mean": 0.2}
            record |= {"rewards/accuracy/std": 0.4, "rewards/format/std": 0.1, "frac_reward_zero_std": 0.25}
        elif record["kind"] == "eval" and evaluated:
            record |= {"val_reward": 0.1 + x, "val_reward_std": 0.2, "val_rewards/accuracy/mean": x}
            record |= {"val_pass@1": x / 2, "val_pass@8": x, "val_cons@8": 0.8 * x}
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def test_grpo_runs_get_a_panel_of_their_rewards_and_pass_at_1(tmp_path: Path) -> None:
    """GRPO's train and eval records add a rewards panel (a wider PNG): the mean reward with its ± std band over the
    steps that generated, each reward's mean, the val reward, and val pass@1 (and pass@k, cons@k) on an axis of
    their own, from 0 to 1; a run that never evaluated draws no second axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from deepzero.metrics import read_jsonl
    from deepzero.plot import grpo_reward_panel

    plain = plot(fake_metrics(tmp_path / "plain.jsonl"), tmp_path / "plain.png")
    metrics = grpo_metrics(tmp_path / "grpo.jsonl")
    assert png_size(plot(metrics, tmp_path / "grpo.png"))[0] > png_size(plain)[0] * 1.3

    fig, ax = plt.subplots()
    twin = grpo_reward_panel(ax, read_jsonl(metrics))
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {"reward", "rewards/accuracy/mean", "rewards/format/mean", "val reward"}
    assert list(lines["reward"].get_xdata()) == [10, 20, 30, 40]  # only the steps that generated
    assert list(lines["reward"].get_ydata()) == pytest.approx([0.45, 0.7, 0.95, 1.2])
    assert list(lines["val reward"].get_xdata()) == [20, 40]
    (band,) = ax.collections  # reward ± reward_std
    assert band.get_label() == "reward ± std"
    ys = band.get_paths()[0].vertices[:, 1]
    assert min(ys) == pytest.approx(0.45 - 0.3) and max(ys) == pytest.approx(1.2 + 0.3)
    scores = {line.get_label(): line for line in twin.get_lines()}
    assert list(scores) == ["pass@1", "cons@8", "pass@8"]
    assert list(scores["pass@1"].get_ydata()) == pytest.approx([0.25, 0.5])
    assert twin.get_ylim() == (0, 1.05)
    assert set(ax.get_legend_handles_labels()[1]) <= {t.get_text() for t in ax.get_legend().get_texts()}
    plt.close(fig)

    fig, ax = plt.subplots()
    assert grpo_reward_panel(ax, read_jsonl(grpo_metrics(tmp_path / "noeval.jsonl", evaluated=False))) is None
    assert "val reward" not in {line.get_label() for line in ax.get_lines()}
    plt.close(fig)
