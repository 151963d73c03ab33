"""The training methods beside the LM loss, each meeting ``deepzero.run``'s setup through the same phases, in the
order the setup calls them:

1. ``plan(args, meta, ...)``: its settings from the flags and the data, checked before any weight loads (None when
   the data folder is not its format; its flags on other data are refused in one line);
2. ``engine(settings, method, ...)``: the engine settings with the method in them (both run on the ZeRO engine,
   each sample's rows on one rank);
3. ``check_batch(method, batch)``: what the resolved batch must hold for it (GRPO: whole groups per rank);
4. ``attach(...)``: what its objective needs once the engine exists (preference: the reference; GRPO: prompts,
   tokenizer, rewards, a frozen copy for its KL term).

``preference`` (DPO and its relatives, ``deepzero.losses.objectives``) and ``grpo`` (``deepzero.losses.grpo``,
with its generation and rewards in ``deepzero.rollout``).
"""

from deepzero.methods import grpo, preference

__all__ = ["grpo", "preference"]
