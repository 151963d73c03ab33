"""pass@k, avg@n, cons@n, maj@n and their standard errors (deepzero.rollout.scores, python -m deepzero.score) against
enumeration, lighteval 0.13's own figures on crafted completions, and the counting rules; the keep/correct conditions."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepzero.errors import UserError
from deepzero.rollout.scores import Condition, consensus_correct, majority, pass_at_k, text_majority_correct
from tests.conftest import REPO, cpu_env
from tests.helpers.lighteval_cases import AIME, CASES

EXPECTED = REPO / "tests" / "helpers" / "lighteval_expected.json"


def enumerated_pass_at_k(n: int, c: int, k: int) -> float:
    """The share of all k-subsets of n samples (the first c correct) holding at least one correct sample."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


@given(st.integers(1, 9).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_is_the_share_of_k_subsets_with_a_correct_sample(nck: tuple[int, int, int]) -> None:
    n, c, k = nck
    assert pass_at_k(n, c, k) == pytest.approx(enumerated_pass_at_k(n, c, k), abs=1e-12)
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_pass_at_1_is_r1s_mean_share_and_large_n_stays_finite() -> None:
    assert pass_at_k(16, 5, 1) == pytest.approx(5 / 16)
    assert pass_at_k(64, 0, 64) == 0.0 and pass_at_k(64, 1, 64) == 1.0
    # Chen et al. 2021's example regime: 200 samples, a rare success; no 200-choose-k overflow
    assert pass_at_k(200, 1, 100) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def case_files(case: dict, root: Path) -> tuple[Path, Path]:
    """A case's records (its benchmark's layout) and its completions as samples.jsonl lines."""
    data, samples = root / f"{case['benchmark']}.jsonl", root / f"{case['benchmark']}.samples.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in case["records"]))
    lines = [{"index": i, "completions": texts} for i, texts in enumerate(case["completions"])]
    samples.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return data, samples


def score(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """``python -m deepzero.score`` with ``args``."""
    cmd = [sys.executable, "-m", "deepzero.score", *map(str, args)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=cpu_env())


@pytest.mark.parametrize("case", CASES, ids=[c["benchmark"] for c in CASES])
def test_rescored_completions_give_lightevals_figures_to_the_last_digit(case: dict, tmp_path: Path) -> None:
    """``python -m deepzero.score --benchmark`` on crafted completions: each sample judged as lighteval 0.13's task
    metric judges it, and pass@k, avg@n, maj@n and their standard errors equal to the last bit the figures lighteval's
    own classes gave (bench/lighteval_oracle.py wrote them), which are its documented definitions."""
    expected = json.loads(EXPECTED.read_text())[case["benchmark"]]
    data, samples = case_files(case, tmp_path)
    proc = score("--samples", samples, "--data", data, "--benchmark", case["benchmark"], "--out", tmp_path / "o")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    for key, value in expected["figures"].items():
        assert summary[key] == value, key  # exact: the same floating-point operations as lighteval's
    lines = [json.loads(x) for x in (tmp_path / "o" / "samples.jsonl").read_text().splitlines()]
    for line, scores in zip(lines, expected["sample_scores"], strict=True):
        assert [ok is True for ok in line["correct"]] == [s == 1.0 for s in scores]
    for key, values in expected["per_prompt"].items():  # the oracle's figures are the documented definitions
        mu = sum(values) / len(values)
        sd = math.sqrt(sum((x - mu) ** 2 for x in values) / (len(values) - 1))
        assert expected["figures"][key] == pytest.approx(mu, abs=1e-15)
        assert expected["figures"][f"{key}_stderr"] == pytest.approx(sd / math.sqrt(len(values)), abs=1e-15)
    for i, scores in enumerate(expected["sample_scores"]):
        n, c = len(scores), int(sum(scores))
        assert expected["per_prompt"]["pass@2"][i] == pytest.approx(enumerated_pass_at_k(n, c, 2), abs=1e-12)


@pytest.mark.parametrize("verdicts", ["lighteval", "port"])
def test_cons_lets_every_sample_vote_and_groups_answers_math_verify_calls_equal(verdicts: str, tmp_path: Path) -> None:
    """cons@8 on the AIME case, prompt by prompt: six unparsed samples outvote two right ones (wrong); \\frac{1}{2},
    0.5 and 1/2 vote together and beat two \\boxed{3} (right, where lighteval's maj@8 on texts is wrong); a gold that
    does not parse (0: lighteval scores its samples 0, the port leaves them unscored, counted wrong); a 3-3 tie goes
    to the answer seen first (right); eight equal right texts (right); 204, "204." and 204.0 against three 205s, 204
    seen first (right). Verdicts by lighteval's own metric (its venv), or by the project's port without it."""
    data, samples = case_files(AIME, tmp_path)
    cmd = ["-m", "deepzero.score", "--samples", str(samples), "--data", str(data), "--benchmark", "aime24"]
    env = cpu_env(**({"DEEPZERO_LIGHTEVAL_PYTHON": "none"} if verdicts == "port" else {}))
    proc = subprocess.run([sys.executable, *cmd, "--out", str(tmp_path / "o")], cwd=REPO, capture_output=True,
                          text=True, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(x) for x in (tmp_path / "o" / "samples.jsonl").read_text().splitlines()]
    assert [consensus_correct(x["votes"], x["correct"]) for x in lines] == [False, True, False, True, True, True]
    maj = [text_majority_correct(x["completions"], x["correct"]) for x in lines]
    assert maj == [False, False, False, True, True, False]
    assert lines[1]["votes"][:5] == [0, 0, 0, 3, 3] and lines[0]["votes"].count(None) == 6
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["cons@8"] == pytest.approx(4 / 6)
    if verdicts == "port":
        assert summary["prompts_unscored"] == 1 and summary["verdicts"].startswith("math-verify")
        assert (
            summary["samples_unscored"] == 8
            and "8 samples unscored (1 prompts wholly), counted as wrong" in proc.stdout
        )
        assert "warning: benchmark verdicts by math-verify" in proc.stderr
    else:
        assert summary["prompts_unscored"] == 0 and summary["verdicts"] == "lighteval 0.13.0"


def test_majority_ties_go_to_the_first_vote_seen_and_no_answer_can_win() -> None:
    assert majority([3, 4, 4, 3]) == 3  # lighteval's max(answers, key=answers.count): the first seen
    assert majority([None, None, 2, None, 2]) is None  # "no answer" wins
    assert consensus_correct([0, 1, 1], [False, True, True])
    assert not consensus_correct([None, None, 2], [None, None, True])
    assert not consensus_correct([0, 0, 2], [None, None, True])  # the winning group unscored: wrong


def test_unscored_samples_count_as_wrong_and_a_reward_scoring_nothing_is_one_line(tmp_path: Path) -> None:
    """A reward's None is a wrong sample and every prompt stays in the denominators; a reward that scores no sample
    at all exits 2 in one line."""
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(3)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "r.py").write_text(
        "def half(prompts, completions, answer, **kw):\n"
        "    return [None if c == 'skip' else float(c == a) for c, a in zip(completions, answer)]\n"
        "def nothing(prompts, completions, **kw):\n    return [None] * len(completions)\n"
    )
    lines = [{"index": 0, "completions": ["0", "skip"]}, {"index": 1, "completions": ["skip", "skip"]}]
    lines += [{"index": 2, "completions": ["2", "2"]}]
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    base = ["--samples", tmp_path / "s.jsonl", "--data", tmp_path / "d.jsonl", "--out", tmp_path / "o"]
    proc = score(*base, "--reward", f"{tmp_path / 'r.py'}:half")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["pass@1"] == pytest.approx((1 / 2 + 0 + 1) / 3) and summary["pass@2"] == pytest.approx(2 / 3)
    assert summary["prompts_unscored"] == 1 and summary["samples_unscored"] == 3
    nothing = score(*base, "--reward", f"{tmp_path / 'r.py'}:nothing")
    assert nothing.returncode == 2 and "Traceback" not in nothing.stderr
    (line,) = [x for x in nothing.stderr.splitlines() if x.startswith("error:")]
    assert "scored none of the 6 samples" in line and "nothing" in line


def test_bad_samples_and_an_unknown_benchmark_are_one_line(tmp_path: Path) -> None:
    data, _ = case_files(AIME, tmp_path)
    (tmp_path / "bad.jsonl").write_text('{"index": 0, "completions": "not a list"}\n')
    args = ["--samples", tmp_path / "bad.jsonl", "--data", data, "--out", tmp_path / "o"]
    proc = score(*args, "--benchmark", "aime24")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "bad.jsonl:1" in proc.stderr and "'completions'" in proc.stderr
    unknown = score(*args, "--benchmark", "aime23")
    assert unknown.returncode == 2 and "--benchmark aime23: is no benchmark here" in unknown.stderr


def test_conditions_read_the_total_or_a_reward_and_bad_ones_are_one_line() -> None:
    keep = Condition.parse("reward>=1", ["accuracy"], "--keep")
    assert keep({"reward": 1.0}) and not keep({"reward": 0.5}) and not keep({"reward": None})
    assert Condition.parse(" accuracy == 0 ", ["accuracy"], "--keep")({"accuracy": 0.0})
    with pytest.raises(UserError, match=r"--keep acc>=1: 'acc' is no reward of this run.*reward, accuracy"):
        Condition.parse("acc>=1", ["accuracy"], "--keep")
    with pytest.raises(UserError, match=r"--correct reward: is not NAME OP NUMBER"):
        Condition.parse("reward", ["accuracy"], "--correct")


def test_reasoning_is_removed_before_the_verdict_as_lightevals_pipeline_does(tmp_path: Path) -> None:
    """lighteval's pipeline drops <think>...</think> from every response before pass@k: a box inside the reasoning
    is not the answer (issue 58's case: lighteval 1, the project 0 before)."""
    records = [{"problem": "p", "answer": "7"}]
    completions = ["<think>\\boxed{5}</think>The answer is 7.", "<think>\\boxed{7}</think>The answer is 5."]
    (tmp_path / "r.jsonl").write_text(json.dumps(records[0]) + "\n")
    (tmp_path / "s.jsonl").write_text(json.dumps({"index": 0, "completions": completions}) + "\n")
    cmd = [sys.executable, "-m", "deepzero.score", "--samples", str(tmp_path / "s.jsonl"), "--benchmark", "aime24"]
    cmd += ["--data", str(tmp_path / "r.jsonl"), "--out", str(tmp_path / "o")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=cpu_env())
    assert proc.returncode == 0, proc.stderr
    (line,) = [json.loads(x) for x in (tmp_path / "o" / "samples.jsonl").read_text().splitlines()]
    assert line["correct"] == [True, False]


def test_gpqa_is_the_multiple_choice_test_a_lighteval_run_builds() -> None:
    """Six records in the Hub layout: the correct answer at D A A A A A (the pipeline's random.seed(1234), one
    randint(0, 3) per record in order), in lighteval's query, rendered as its prompt manager sends the user turn
    (the instruction put back in front of the question with no separator)."""
    from deepzero.rollout.benchmarks import BENCHMARKS, GPQA_INSTRUCTION

    rows = [
        {"Question": f" Q{i}? ", "Correct Answer": "right", "Incorrect Answer 1": "w1", "Incorrect Answer 2": "w2",
         "Incorrect Answer 3": "w3"}
        for i in range(6)
    ]  # fmt: skip
    records = BENCHMARKS["gpqa_diamond"].records(rows, "gpqa.jsonl")
    assert "".join(r["gold"] for r in records) == "DAAAAA"
    assert records[0]["prompt"][0]["content"] == GPQA_INSTRUCTION + "Q0?\n\nA) w1\nB) w2\nC) w3\nD) right"
    assert records[1]["prompt"][0]["content"] == GPQA_INSTRUCTION + "Q1?\n\nA) right\nB) w1\nC) w2\nD) w3"


def test_pass_k_above_the_samples_is_one_line(tmp_path: Path) -> None:
    """--pass-k larger than a prompt's completions: one line naming it, never a figure silently dropped."""
    (tmp_path / "r.jsonl").write_text(json.dumps({"problem": "p", "answer": "7"}) + "\n")
    (tmp_path / "s.jsonl").write_text(json.dumps({"index": 0, "completions": ["7", "8"]}) + "\n")
    cmd = [sys.executable, "-m", "deepzero.score", "--samples", str(tmp_path / "s.jsonl"), "--benchmark", "aime24"]
    cmd += ["--data", str(tmp_path / "r.jsonl"), "--out", str(tmp_path / "o"), "--pass-k", "1", "4"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=cpu_env())
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("error: --pass-k 4: prompt 0")
