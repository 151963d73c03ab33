"""Completions from a model and their scores, one package for every job that samples: GRPO's rollouts
(``deepzero.losses.grpo``), ``evaluate.py`` (pass@k, cons@k) and ``sample.py`` (rejection sampling).

- ``generation``: the samplers (one batched ``generate`` call per rank, each row its own seeded stream);
- ``rewards``: the reward functions (TRL's, math-verify's, a user's file) and their scoring;
- ``scores``: pass@k, cons@k and the keep filter, from the per-sample rewards;
- ``jobs``: the evaluation / rejection-sampling job over a prompts folder, streamed and resumable; its flags
  (``job_args``), how it holds the model (``layout``), and its summaries side by side (``compare``).
"""
