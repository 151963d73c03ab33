"""GRPO as an objective plug-in: each step samples completions of the step's prompts, scores them, and minimises
TRL 1.16's ``GRPOTrainer`` loss over them (``trl/trainer/grpo_trainer.py``, ``_compute_loss``).

The objective (``objective``) takes its flags from ``settings``, builds each step's rows (``rollout``), minimises
the per-token loss (``loss``), and logs TRL's metrics (``metrics``) and a few samples (``samples``:
completions.jsonl).
"""
