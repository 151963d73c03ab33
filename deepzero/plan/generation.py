"""GRPO's generation on the card (``--grpo``): while a rank samples its completion rows with Transformers'
``generate`` (all of them in one call, or ``--generation-batch-size`` at a time), it holds the model states, the
rows' KV cache, one layer's working set and, under ZeRO-3, the whole gathered model (``deepzero.rollout.generation``, as
TRL's ``ds3_gather_for_generation``)."""

from __future__ import annotations

from deepzero.plan.arch import ModelStats
from deepzero.plan.setup import Setup


def kv_cache_width(stats: ModelStats) -> int:
    """Cached values per token and layer: keys and values of every KV head (GQA/MHA), or for MLA the compressed
    latent and the rotary key, which is what Transformers' DeepSeek-V2/V3 ``DynamicCache`` stores (measured:
    tests/test_plan.py reads a real cache)."""
    a = stats.arch
    if a.kv_lora_rank:
        return a.kv_lora_rank + a.qk_rope_dim
    return 2 * a.kv_heads * a.head_dim


def kv_layer_bytes(stats: ModelStats, rows: int, tokens: int, bytes_per_value: int) -> int:
    """One decoder layer's KV cache of ``rows`` rows of ``tokens`` tokens. This and the two terms below are what one
    ``generate`` call holds, for GRPO's rollouts and for evaluation and sampling alike (``plan.evaluation``)."""
    return rows * tokens * kv_cache_width(stats) * bytes_per_value


def prefill_bytes(stats: ModelStats, rows: int, prompt_len: int, bytes_per_value: int) -> int:
    """The prefill's largest transient: one layer's MLP over the rows' prompts (input, gate, up, activation)."""
    a = stats.arch
    width = max(a.intermediate, a.experts_per_token * a.moe_intermediate + a.shared_intermediate)
    return rows * prompt_len * (2 * a.hidden + 3 * width) * bytes_per_value


def sampling_logits_bytes(stats: ModelStats, rows: int, bytes_per_value: int) -> int:
    """The last position's logits of every row (``generate`` computes no other) in the model's dtype, plus their
    fp32 log-softmax and sampling probabilities."""
    return rows * stats.arch.vocab * (bytes_per_value + 4 + 4)


def kv_cache_bytes(stats: ModelStats, setup: Setup) -> int:
    """The KV cache of the rows generated together at its longest: prompt + completion tokens, every layer, in the
    training dtype."""
    assert setup.grpo is not None
    return stats.arch.layers * kv_layer_bytes(stats, setup.grpo.batch_rows, setup.seq_len, setup.bytes_per_value)


def generation_bytes(stats: ModelStats, setup: Setup) -> int:
    """What generating adds to the model states on the card (0 without GRPO): the rows' KV cache; the prefill's
    largest transient, one layer's MLP over the rows' prompts (input, gate, up, activation); the last position's
    logits in the training dtype plus fp32 log-softmax and sampling probabilities; under ZeRO-3 the whole model,
    gathered for the generation (the rank's own shards stay counted in the states)."""
    if setup.grpo is None:
        return 0
    p, rows = setup.bytes_per_value, setup.grpo.batch_rows
    prefill = prefill_bytes(stats, rows, setup.grpo.prompt_len, p)
    logits = sampling_logits_bytes(stats, rows, p)
    gathered = p * sum(stats.float_numels(setup.four_bit)) if setup.stage == 3 else 0
    return kv_cache_bytes(stats, setup) + prefill + logits + gathered


def reference_copy_bytes(stats: ModelStats, setup: Setup) -> int:
    """A frozen copy of the starting weights on every rank (β > 0 without LoRA; ZeRO-3 refuses it), else 0."""
    if setup.grpo is None or not setup.grpo.reference_copy:
        return 0
    return setup.bytes_per_value * stats.total
