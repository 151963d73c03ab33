"""GRPO's rewards (deepzero/rollout/rewards.py): the built-ins are TRL 1.16's own functions called as GRPOTrainer calls
them, ``exact``, a user's file reading an extra column, TRL's weighting and None rule, and one-line errors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from trl.rewards import (
    accuracy_reward,
    get_soft_overlong_punishment,
    reasoning_accuracy_reward,
    think_format_reward,
)

from deepzero.errors import UserError
from deepzero.rollout.rewards import final_answer, parse_rewards

COMPLETIONS = [
    "<think>\n2 + 2 is 4\n</think>\nThe answer is \\boxed{4}",
    "<think>\nhmm</think> It is \\boxed{\\frac{1}{3}}",
    "I think it is 5.",
    "<think>a<think>b</think> \\boxed{7}",
    "no answer at all",
]
SOLUTIONS = ["4", "\\frac{1}{3}", "6", "7", "not latex @@"]
IDS = [[1] * n for n in (10, 85, 90, 100, 130)]
PROMPTS = [f"Question {i}: what is it?" for i in range(5)]


def messages(texts: list[str]) -> list[list[dict[str, str]]]:
    return [[{"role": "assistant", "content": t}] for t in texts]


def score(specs: list[str], records: list[dict], completions: list[str] = COMPLETIONS, **kwargs):
    return parse_rewards(specs, **kwargs).score(PROMPTS[: len(completions)], completions, IDS, records)


def test_each_builtin_equals_calling_trls_function_directly() -> None:
    records = [{"solution": s, "extra": i} for i, s in enumerate(SOLUTIONS)]
    _, each = score(["accuracy", "reasoning_accuracy", "think_format", "soft_overlong"], records,
                    max_completion_length=100, soft_punish_cache=20)  # fmt: skip
    trl = {
        "accuracy": accuracy_reward(messages(COMPLETIONS), SOLUTIONS),
        "reasoning_accuracy": reasoning_accuracy_reward(messages(COMPLETIONS), SOLUTIONS),
        "think_format": think_format_reward(messages(COMPLETIONS)),
        "soft_overlong": get_soft_overlong_punishment(100, 20)(IDS),
    }
    assert trl["accuracy"][-1] is None and trl["soft_overlong"] == [0.0, -0.25, -0.5, -1.0, -1.0]
    for name, values in trl.items():
        expected = torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float32)
        assert torch.equal(each[name].isnan(), expected.isnan()), name
        assert torch.equal(each[name].nan_to_num(), expected.nan_to_num()), name
    # accuracy reads our 'answer' column when the records have no 'solution'
    _, by_answer = score(["accuracy"], [{"answer": s} for s in SOLUTIONS])
    assert torch.equal(by_answer["accuracy"].nan_to_num(-9), each["accuracy"].nan_to_num(-9))
    # soft_punish_cache defaults to a fifth of max_completion_length
    _, default = score(["soft_overlong"], records, max_completion_length=100)
    assert default["soft_overlong"].tolist() == get_soft_overlong_punishment(100, 20)(IDS)


def test_exact_compares_final_answers() -> None:
    assert final_answer("Natalia sold 48/2 = 24 clips.\n#### 72") == "72"
    assert final_answer("so \\boxed{x+1} and then 3") == "x+1"
    assert final_answer("It costs $1,250.") == "1250"
    assert final_answer("yes\n\n  the end  \n") == "the end"
    completions = ["... so she sold 72 clips.", "#### 72", "The answer is 72.0", "71", "\\boxed{72}"]
    _, each = score(["exact"], [{"answer": "48 + 24 = 72\n#### 72"}] * 5, completions=completions)
    assert each["exact"].tolist() == [1.0, 1.0, 1.0, 0.0, 1.0]


def write(path: Path, source: str) -> str:
    path.write_text(source)
    return str(path)


def test_a_users_file_reads_an_extra_column_with_trls_signature(tmp_path: Path) -> None:
    path = write(tmp_path / "my_rewards.py", """
def by_tests(prompts, completions, completion_ids, tests, **columns):
    assert isinstance(prompts[0], str) and isinstance(completions[0], str) and isinstance(completion_ids[0], list)
    assert sorted(columns) == ["answer"]
    return [sum(t in c for t in ts) / len(ts) for c, ts in zip(completions, tests)]
""")  # fmt: skip
    records = [{"tests": ["think it", "5"], "answer": "x"}] * 5
    total, each = score([f"{path}:by_tests:2"], records)
    assert each["by_tests"].tolist() == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert total.tolist() == [0.0, 0.0, 2.0, 0.0, 0.0]


def test_weights_and_none_follow_trls_rule(tmp_path: Path) -> None:
    path = write(tmp_path / "r.py", """
def some(completions, **kw):
    return [None, 1.0, None, 0.5, None]

def none(completions, **kw):
    return [None, None, 2.0, None, None]
""")  # fmt: skip
    rewards = parse_rewards([f"{path}:some:0.5", f"{path}:none:-2", "think_format:3"])
    assert rewards.names == ["some", "none", "think_format"]  # TRL's rule: a function's __name__
    records = [{}] * 5
    total, each = rewards.score(PROMPTS, COMPLETIONS, IDS, records)
    per = torch.stack(list(each.values()), dim=1)
    weights = torch.tensor([0.5, -2.0, 3.0])
    # TRL 1.16 GRPOTrainer._generate_and_score_completions, sum_then_normalize:
    expected = (per * weights.unsqueeze(0)).nansum(dim=1)
    expected[torch.isnan(per).all(dim=1)] = torch.nan
    assert torch.allclose(total, expected, equal_nan=True)
    assert total.tolist()[:4] == [3.0, 3.5, -4.0, 0.25 + 0.0]
    only_none = parse_rewards([f"{path}:none"]).score(PROMPTS, COMPLETIONS, IDS, records)[0]
    assert torch.isnan(only_none).tolist() == [True, True, False, True, True]  # unscorable: NaN, not 0


def one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text and ". Fix: " in text, text
    return text


def test_a_failing_reward_is_one_line_naming_the_function_and_the_record(tmp_path: Path) -> None:
    path = write(tmp_path / "bad.py", """
def raises(completions, answer, **kw):
    return [float(a) for a in answer]

def short(completions, **kw):
    return [1.0]

def text(completions, **kw):
    return [1.0, "high", 0.0, 0.0, 0.0]

def scalar(completions, **kw):
    return 1.0
""")  # fmt: skip
    records = [{"answer": a} for a in ("1", "2", "three\nfour", "4", "5")]
    cases = {
        "raises": r"--reward .*bad\.py:raises: raised ValueError: could not convert string to float: 'three\\nfour' on"
        r" completion 2 of the batch \(record 12, prompt 'Question 2: what is it\?'\)",
        "short": r"bad\.py:short: returned 1 values for 5 completions",
        "text": r"bad\.py:text: returned 'high' \(str\) for completion 1 of the batch \(record 11, prompt 'Question 1",
        "scalar": r"bad\.py:scalar: returned a float for 5 completions",
    }
    for name, pattern in cases.items():
        rewards = parse_rewards([f"{path}:{name}"])
        with pytest.raises(UserError, match=pattern) as err:
            rewards.score(PROMPTS, COMPLETIONS, IDS, records, indices=[10, 11, 12, 13, 14])
        one_line(err)
    with pytest.raises(
        UserError,
        match=r"--reward exact: completion 1 of the batch \(prompt 'Question 1: what is it\?'\) has no 'answer' field",
    ) as err:
        parse_rewards(["exact"]).score(PROMPTS, COMPLETIONS, IDS, [{"answer": "1"}, {}, {}, {}, {}])
    one_line(err)


def test_bad_specs_are_one_line_at_parse_time(tmp_path: Path) -> None:
    good = write(tmp_path / "ok.py", "def fine(completions, **kw):\n    return [0.0] * len(completions)\n")
    broken = write(tmp_path / "broken.py", "import not_a_module_anywhere\n")
    cases = {
        "bleu": r"--reward bleu: unknown reward 'bleu'. Fix: pass --reward NAME\[:WEIGHT\] with NAME one of accuracy",
        "accuracy:heavy": r"--reward accuracy:heavy: weight 'heavy' is not a finite number",
        "exact:nan": r"weight 'nan' is not a finite number",
        f"{tmp_path}/missing.py:f": r"missing\.py:f: no such file .*missing\.py",
        f"{good}:absent": r"ok\.py:absent: .*ok\.py has no function 'absent' \(it has fine\)",
        f"{good}:fine:x": r"ok\.py:fine:x: weight 'x' is not a finite number",
        f"{broken}:f": r"broken\.py:f: importing .*broken\.py raised ModuleNotFoundError: No module named",
        "soft_overlong": r"--reward soft_overlong: needs the maximum completion length",
    }
    for spec, pattern in cases.items():
        with pytest.raises(UserError, match=pattern) as err:
            parse_rewards([spec])
        one_line(err)
    with pytest.raises(UserError, match=r"--reward exact:2: exact is given twice") as err:
        parse_rewards(["exact", "exact:2"])
    one_line(err)
    other = write(tmp_path / "other.py", "def fine(completions, **kw):\n    return [1.0] * len(completions)\n")
    with pytest.raises(UserError, match=r"other\.py:fine: .*ok\.py:fine is also named 'fine'.*rewards/fine/mean"):
        parse_rewards([f"{good}:fine", f"{other}:fine"])
    with pytest.raises(UserError, match=r"--reward: no reward given") as err:
        parse_rewards([])
    rewards = parse_rewards(["exact", f"{good}:fine"])
    rewards.check_fields(["answer", "id"], "data/gsm8k")
    with pytest.raises(UserError, match=r"--reward exact: reads the records' 'answer' field, data/gsm8k has \['id'\]"):
        rewards.check_fields(["id"], "data/gsm8k")


def test_a_reward_that_never_returns_is_one_line_naming_it_after_reward_timeout(tmp_path) -> None:
    """A reward sleeping far past --reward-timeout stops at the deadline with one line naming the file and function
    (a hung reward otherwise hangs every rank without a word)."""
    import time

    from deepzero.errors import UserError
    from deepzero.rollout.rewards import parse_rewards

    (tmp_path / "slow.py").write_text("import time\ndef sleepy(prompts, completions, **kw):\n    time.sleep(60)\n")
    rewards = parse_rewards([f"{tmp_path / 'slow.py'}:sleepy"], timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(UserError, match=r"slow\.py:sleepy: did not return within 0\.5 s.*--reward-timeout"):
        rewards.score(["p"], ["c"], [[1]], [{}])
    assert time.monotonic() - start < 5


def test_a_wait_past_its_limit_says_what_it_waits_on(capsys: pytest.CaptureFixture[str]) -> None:
    """deepzero.watchdog: a phase that outlasts its limit prints one line naming it, again as the wait doubles; a
    loop phase is judged against its own usual time."""
    import time

    from deepzero import watchdog

    with watchdog.phase("testing a wait", limit_s=0.2):
        time.sleep(0.7)
    lines = [x for x in capsys.readouterr().err.splitlines() if "testing a wait" in x]
    assert 2 <= len(lines) <= 3 and lines[0].startswith("deepzero: still testing a wait after")
    with watchdog.phase("a loop phase", every=True):
        time.sleep(0.01)
    assert watchdog._usual["a loop phase"] >= 0.01
    with watchdog.phase("a quick one", limit_s=5):
        pass
    assert "a quick one" not in capsys.readouterr().err
