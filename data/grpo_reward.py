"""The `make grpo` example's reward, in TRL's reward-function signature (docs/grpo.md, "Rewards").

train.py --reward data/grpo_reward.py:letter_share (logged as rewards/letter_share/mean)
"""

from __future__ import annotations

from typing import Any


def letter_share(
    prompts: list[str], completions: list[str], completion_ids: list[list[int]], letter: list[str], **columns: Any
) -> list[float]:
    """The share of the record's ``letter`` column among the completion's characters (0.0 for an empty one):
    checkable from the text alone, and a stdlib-trained tiny model already writes it now and then."""
    return [text.count(x) / len(text) if text else 0.0 for text, x in zip(completions, letter, strict=True)]
