"""Crafted completions that hit each of lighteval's counting rules, for tests/test_scores.py and
bench/lighteval_oracle.py (which scores them with lighteval 0.13's own metric classes into lighteval_expected.json).

Each case: a benchmark, its records (in the benchmark's Hub layout) and each record's completions.
"""

from __future__ import annotations

UNPARSED = "I could not finish this one."
"""A completion math-verify extracts nothing from (no number, no LaTeX)."""

AIME = {
    "benchmark": "aime24",
    "records": [
        {"problem": "Six unparsed samples and two right ones.", "answer": "3"},
        {"problem": "Three forms of one half against two threes.", "answer": "1/2"},
        {"problem": "A gold that does not parse.", "answer": "see the figure"},
        {"problem": "A tie between 6 and 5: the first seen wins.", "answer": "6"},
        {"problem": "All eight the same right text.", "answer": "12"},
        {"problem": "Three of eight right, scattered.", "answer": "204"},
    ],
    "completions": [
        [UNPARSED] * 3 + ["So \\boxed{3}."] + [UNPARSED] * 3 + ["Hence \\boxed{3}."],
        ["$\\frac{1}{2}$", "$0.5$", "$1/2$", "\\boxed{3}", "\\boxed{3}", "\\boxed{7}", "\\boxed{8}", "\\boxed{9}"],
        ["\\boxed{4}", "\\boxed{5}", UNPARSED, "\\boxed{4}", "see the figure", "\\boxed{6}", "\\boxed{7}", "x"],
        ["\\boxed{6}", "\\boxed{5}", "\\boxed{6}", "\\boxed{5}", "\\boxed{6}", "\\boxed{5}", UNPARSED, UNPARSED],
        ["Therefore, the final answer is: $\\boxed{12}$. I hope it is correct"] * 8,
        [
            "Therefore, the final answer is: $\\boxed{204}$. I hope it is correct",
            "\\boxed{205}",
            "The answer is 204.",
            UNPARSED,
            "\\boxed{204.0}",
            "\\boxed{240}",
            "\\boxed{205}",
            "\\boxed{205}",
        ],
    ],
}

GPQA = {
    "benchmark": "gpqa_diamond",
    "records": [
        {
            "Question": f"Question {i}?",
            "Correct Answer": f"right {i}",
            "Incorrect Answer 1": f"wrong {i}a",
            "Incorrect Answer 2": f"wrong {i}b",
            "Incorrect Answer 3": f"wrong {i}c",
        }
        for i in range(4)
    ],
    "completions": [
        ["Answer: A", "Answer: B", "Answer: C", "Answer: D"],
        ["The final answer is (B). I hope", "answer: b", "B", "I pick C\nAnswer: B"],
        ["no letter here", "no letter here", "Answer: D", "(A)"],
        ["**Answer: C**", "C.", "Answer:C", "the answer is A, not C"],
        ["<think>Answer: A</think>Answer: B", "ANSWER: (c)", "The correct option is **D**", "\\boxed{B}"],
        ["Final answer: B)", "answer is b", "<think>so B</think>", "Answer: A\nAnswer: D"],
    ],
}
GPQA["records"] += [  # letters in more forms, and reasoning around them
    {"Question": f"Question {i}?", "Correct Answer": f"right {i}", "Incorrect Answer 1": f"wrong {i}a",
     "Incorrect Answer 2": f"wrong {i}b", "Incorrect Answer 3": f"wrong {i}c"}
    for i in (4, 5)
]  # fmt: skip

MATH500 = {
    "benchmark": "math500",
    "records": [  # MATH-500's layout: the worked solution ends in its boxed answer
        {"problem": p, "solution": f"Working omitted, so the answer is $\\boxed{{{a}}}$.", "answer": a}
        for p, a in (
            ("Several boxes, near and far, and a box inside the reasoning.", "204"),
            ("Decimals for a surd.", "2\\sqrt{3}"),
            ("Decimals for pi.", "\\pi"),
            ("A percentage.", "20\\%"),
            ("Currency.", "\\$18.90"),
            ("A tuple.", "(3, -1)"),
        )
    ],
    "completions": [
        [
            "First \\boxed{17} then \\boxed{204}",
            "\\boxed{204} and later \\boxed{17}",
            "So \\boxed{17}.\n\nMany words come in between, on and on, before the end.\n\nFinally \\boxed{204}",
            "<think>\\boxed{204}</think>The answer is \\boxed{17}.",
            "<think>\\boxed{17}</think>The answer is \\boxed{204}.",
            "\\boxed{20} and \\boxed{4}",
        ],
        ["ANSWER: 3.4641016", "\\boxed{2\\sqrt{3}}", "\\boxed{\\sqrt{12}}", "ANSWER: 3.464", "\\boxed{3.46410161514}",
         "ANSWER: $2\\sqrt3$"],
        ["\\boxed{3.14159265}", "\\boxed{\\pi}", "ANSWER: 3.14", "\\boxed{\\frac{22}{7}}", "ANSWER: $\\pi$",
         "\\boxed{180^\\circ}"],
        ["\\boxed{20}", "\\boxed{20\\%}", "ANSWER: 20%", "\\boxed{0.2}", "ANSWER: 20 percent", "\\boxed{\\frac{1}{5}}"],
        ["\\boxed{18.90}", "\\boxed{\\$18.90}", "ANSWER: $18.9", "\\boxed{18.9}", "ANSWER: \\$18.90", "\\boxed{1890}"],
        ["\\boxed{(3,-1)}", "\\boxed{(-1, 3)}", "ANSWER: (3, -1)", "\\boxed{3, -1}", "\\boxed{x=3, y=-1}",
         "<think>(3,-1)</think>ANSWER: (1,3)"],
    ],
}  # fmt: skip

CASES = [AIME, GPQA, MATH500]
