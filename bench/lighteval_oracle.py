"""lighteval 0.13's own figures for the crafted completions of tests/helpers/lighteval_cases.py, written to
tests/helpers/lighteval_expected.json (tests/test_scores.py checks ``python -m deepzero.score`` against them).

lighteval's dependencies are too many for the project's requirements (and pin an older latex2sympy2_extended), so
this runs in its own environment:

    python -m venv /tmp/lv && /tmp/lv/bin/pip install lighteval==0.13.0 torch
    /tmp/lv/bin/python bench/lighteval_oracle.py

Per benchmark, as lighteval scores its task: per sample the task's ``MultilingualExtractiveMatchMetric``
(``pass_at_k_math``'s for AIME, ``gpqa_instruct_pass_at_k``'s for GPQA), then per prompt ``PassAtK`` (k = 1, 2, 4, n),
``AvgAtN`` (n) and ``MajAtN`` (n, the same per-sample scoring), then over prompts ``np.mean`` and lighteval's
``mean_stderr``.
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

    import lighteval
    from lighteval.metrics.metrics import Metrics
    from lighteval.metrics.metrics_sample import AvgAtN, MajAtN, PassAtK
    from lighteval.metrics.utils.stderr import mean_stderr
    from lighteval.models.model_output import ModelResponse
    from lighteval.tasks.requests import Doc

    from deepzero.rollout.benchmarks import BENCHMARKS, gpqa_choices
    from tests.helpers.lighteval_cases import CASES

    logging.disable(logging.WARNING)  # its "did not manage to extract" line per unparsed sample
    out: dict = {"lighteval": lighteval.__version__ if hasattr(lighteval, "__version__") else "0.13.0"}
    for case in CASES:
        name = case["benchmark"]
        bench = BENCHMARKS[name]
        if bench.scoring == "math":
            scorer = Metrics.pass_at_k_math.value.sample_level_fn.compute_score
            strip = True  # pass_at_k_math's PassAtK(strip_strings=True)
        else:
            scorer = Metrics.gpqa_instruct_pass_at_k.value.sample_level_fn.compute_score
            strip = False
        n = len(case["completions"][0])
        ks = sorted({1, 2, 4, n})
        per_prompt: dict[str, list[float]] = {}
        samples = []
        for i, (record, texts) in enumerate(zip(case["records"], case["completions"], strict=True)):
            query, gold = bench.query(record, i)
            if bench.scoring == "letters":
                _, gold_index = gpqa_choices(record, i)
                doc = Doc(query=query, choices=list("ABCD"), gold_index=gold_index)
            else:
                doc = Doc(query=query, choices=[gold], gold_index=0)
            response = ModelResponse(text=list(texts))
            scores = [scorer(doc, ModelResponse(text=[t.strip() if strip else t])) for t in texts]
            samples.append(scores)
            for k in ks:
                value = PassAtK(k=k, n=n, strip_strings=strip, sample_scoring_function=scorer).compute(doc, response)
                per_prompt.setdefault(f"pass@{k}", []).append(float(value))
            avg = AvgAtN(n=n, sample_scoring_function=scorer).compute(doc, response)
            per_prompt.setdefault(f"avg@{n}", []).append(float(avg))
            if bench.scoring == "math":  # MajAtN rebuilds the Doc with the gold alone: a single-choice task's metric
                maj = MajAtN(n=n, sample_scoring_function=scorer).compute(doc, response)
                per_prompt.setdefault(f"maj@{n}", []).append(float(maj))
        figures = {key: float(np.mean(v)) for key, v in per_prompt.items()}
        figures |= {f"{key}_stderr": float(mean_stderr(v)) for key, v in per_prompt.items()}
        out[name] = {"figures": figures, "per_prompt": per_prompt, "sample_scores": samples}
    path = ROOT / "tests" / "helpers" / "lighteval_expected.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v["figures"] for k, v in out.items() if isinstance(v, dict)}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
