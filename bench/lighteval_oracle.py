"""lighteval 0.13's own figures for the crafted completions of tests/helpers/lighteval_cases.py, written to
tests/helpers/lighteval_expected.json (tests/test_scores.py checks ``python -m deepzero.score`` against them).

lighteval's dependencies are too many for the project's requirements (and pin an older latex2sympy2_extended), so
this runs in its own environment:

    make lighteval && .venv-lighteval/bin/python bench/lighteval_oracle.py

Per benchmark, as a lighteval run scores its task: each doc built by lighteval's own prompt function
(``aime_prompt``, ``math_500_prompt``, ``gpqa_instruct_prompt`` after the pipeline's ``random.seed(1234)``, records in
order), each response post-processed as the pipeline does (``remove_reasoning_tags`` with its default ``<think>``
pair into ``text_post_processed``), per sample the task's ``MultilingualExtractiveMatchMetric`` (``pass_at_k_math``'s
for AIME and MATH-500, ``gpqa_instruct_pass_at_k``'s for GPQA) on the preprocessed gold and post-processed text, then
per prompt ``PassAtK`` (k = 1, 2, 4, n), ``AvgAtN`` (n; it reads the raw text, lighteval's own quirk) and ``MajAtN``
(n), then over prompts ``np.mean`` and lighteval's ``mean_stderr``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    import logging
    import random

    import lighteval
    from lighteval.metrics.metrics import Metrics
    from lighteval.metrics.metrics_sample import AvgAtN, MajAtN, PassAtK
    from lighteval.metrics.utils.stderr import mean_stderr
    from lighteval.models.model_output import ModelResponse
    from lighteval.tasks.requests import Doc
    from lighteval.tasks.tasks.aime import aime_prompt
    from lighteval.tasks.tasks.gpqa import gpqa_instruct_prompt
    from lighteval.tasks.tasks.math_500 import math_500_prompt
    from lighteval.utils.utils import remove_reasoning_tags

    from tests.helpers.lighteval_cases import CASES

    logging.disable(logging.WARNING)  # its "did not manage to extract" line per unparsed sample
    prompt_functions = {"aime24": aime_prompt, "math500": math_500_prompt, "gpqa_diamond": gpqa_instruct_prompt}
    out: dict = {"lighteval": lighteval.__version__ if hasattr(lighteval, "__version__") else "0.13.0"}
    for case in CASES:
        name = case["benchmark"]
        math_task = name != "gpqa_diamond"
        metric = (Metrics.pass_at_k_math if math_task else Metrics.gpqa_instruct_pass_at_k).value.sample_level_fn
        scorer = metric.compute_score
        n = len(case["completions"][0])
        ks = sorted({1, 2, 4, n})
        per_prompt: dict[str, list[float]] = {}
        samples, docs = [], []
        random.seed(1234)  # Pipeline._init_random_seeds, then the prompt function over the records in order
        for record in case["records"]:
            docs.append(prompt_functions[name](record))
        for doc, texts in zip(docs, case["completions"], strict=True):
            cleaned = [remove_reasoning_tags(t, [("<think>", "</think>")]) for t in texts]
            response = ModelResponse(text=list(texts), text_post_processed=cleaned)
            gold_doc = Doc(
                query=doc.query, choices=[metric.preprocess(c) for c in doc.choices], gold_index=doc.gold_index
            )
            scores = [scorer(gold_doc, ModelResponse(text=[metric.preprocess(t)])) for t in cleaned]
            samples.append(scores)
            for k in ks:
                strip = metric.strip_strings
                value = PassAtK(k=k, n=n, strip_strings=strip, sample_scoring_function=scorer).compute(doc, response)
                per_prompt.setdefault(f"pass@{k}", []).append(float(value))
            avg = AvgAtN(n=n, sample_scoring_function=scorer).compute(doc, response)
            per_prompt.setdefault(f"avg@{n}", []).append(float(avg))
            if math_task:  # MajAtN rebuilds the Doc with the gold alone: a single-choice task's metric
                maj = MajAtN(n=n, sample_scoring_function=scorer).compute(doc, response)
                per_prompt.setdefault(f"maj@{n}", []).append(float(maj))
        figures = {key: float(np.mean(v)) for key, v in per_prompt.items()}
        figures |= {f"{key}_stderr": float(mean_stderr(v)) for key, v in per_prompt.items()}
        golds = [d.choices[d.gold_index] for d in docs]
        queries = [d.query for d in docs]
        out[name] = {"figures": figures, "per_prompt": per_prompt, "sample_scores": samples, "golds": golds,
                     "queries": queries}  # fmt: skip
    path = ROOT / "tests" / "helpers" / "lighteval_expected.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v["figures"] for k, v in out.items() if isinstance(v, dict)}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
