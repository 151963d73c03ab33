"""Run in lighteval 0.13's own environment (``make lighteval`` builds ``.venv-lighteval``): each sample's verdict by
lighteval's own metric code, for :mod:`deepzero.rollout.lighteval_verdicts`. Imports nothing of deepzero.

One JSON job per stdin line, ``{"scoring": "math" | "letters", "query", "gold", "texts"}``, one JSON line back,
``{"scores": [...]}``: for each text, what ``PassAtK`` scores it (``Metrics.pass_at_k_math`` for AIME and MATH-500,
``Metrics.gpqa_instruct_pass_at_k`` for GPQA) after the pipeline's default reasoning-tag removal, exactly as a
lighteval run: the gold and the prediction preprocessed by the metric (``strip_strings``), then its
``compute_score``. The first line written is ``{"ready": VERSION}``.
"""

import json
import logging
import sys


def main() -> None:
    from importlib.metadata import version

    from lighteval.metrics.metrics import Metrics
    from lighteval.models.model_output import ModelResponse
    from lighteval.tasks.requests import Doc
    from lighteval.utils.utils import remove_reasoning_tags

    logging.disable(logging.WARNING)  # its "did not manage to extract" line per unparsed sample
    metrics = {
        "math": Metrics.pass_at_k_math.value.sample_level_fn,
        "letters": Metrics.gpqa_instruct_pass_at_k.value.sample_level_fn,
    }
    tags = [("<think>", "</think>")]  # PipelineParameters' default reasoning_tags
    print(json.dumps({"ready": version("lighteval")}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        metric = metrics[job["scoring"]]
        if job["scoring"] == "math":
            choices, gold_index = [job["gold"]], 0
        else:
            choices, gold_index = list("ABCD"), "ABCD".index(job["gold"])
        doc = Doc(query=job["query"], choices=[metric.preprocess(c) for c in choices], gold_index=gold_index)
        scores = []
        for text in job["texts"]:
            prediction = metric.preprocess(remove_reasoning_tags(text, tags))
            scores.append(float(metric.compute_score(doc=doc, model_response=ModelResponse(text=[prediction]))))
        print(json.dumps({"scores": scores}), flush=True)


if __name__ == "__main__":
    main()
