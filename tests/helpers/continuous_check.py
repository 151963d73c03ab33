"""Run by tests/test_generation.py in its own process: Transformers' continuous batching (``generate_batch``, a
scheduler thread and paged attention) on a tiny DeepSeek-V3, so that whatever it does to a process cannot take a
pytest worker down with it. Prints one JSON line: the sampled completions of 3 prompts × 2 rows, and the greedy
completions of the continuous and the generate backend."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM

from deepzero.presets import get_preset
from deepzero.rollout.generation import ContinuousBatching, HFGenerate

VOCAB, EOS = 300, 2


def main() -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(get_preset("tiny-deepseek-v3").config(vocab_size=VOCAB)).eval()
    gen = torch.Generator().manual_seed(1)
    batch = [torch.randint(3, VOCAB, (n,), generator=gen) for n in (5, 11, 8)]
    sampler = ContinuousBatching(6, (EOS,), 0)
    sampled = sampler.sample(model, [p for p in batch for _ in range(2)], list(range(6)))
    greedy = sampler.sample(model, batch, None)
    generate = HFGenerate(6, (EOS,), 0).sample(model, batch, None)
    pages = sampler.paged_cache([p.tolist() for p in batch]).num_blocks
    print(json.dumps({"sampled": sampled, "greedy": greedy, "generate": generate, "pages": pages}))


if __name__ == "__main__":
    main()
