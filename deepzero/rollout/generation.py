"""Completions for GRPO: one small interface (``CompletionSampler``) and its Transformers ``generate`` backend.

A sampler turns prompt rows into one completion each on the model's current weights, all of a rank's rows in one
batched call (or in chunks of ``batch_rows``). Each row draws its tokens from its own random stream, seeded by
``(seed, generation, prompt index, row of the group)`` (``GroupSeeds``): a row's completion does not depend on
which other rows share its call, so the same prompt at the same generation gives the same completions on any rank,
in any world size, in any batch, and after a resume (the checkpoint records the seed and the generations done).
Transformers' own sampling draws every row from one stream (``torch.multinomial`` on the batch), so a row's tokens
would change with the batch around it; here ``RowStreams`` samples instead, by inverse CDF on each row's own
uniforms, after Transformers' own warpers (temperature, top-p, top-k, min-p), and ``generate`` runs greedy over
the one token it leaves.

``--generation-backend continuous`` is Transformers' continuous batching (``generate_batch``, a paged KV cache
whose rows leave as they finish and new ones take their place: ``ContinuousBatching``). It samples with
Transformers' own RNG, seeded once per call from the rows' seeds, so its completions are reproducible for the
same rows and world size but not independent of the batch. Another backend (vLLM) plugs in as a sampler.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from deepzero.errors import UserError, first_line

PROTOCOLS: dict[str, dict[str, float]] = {"r1": {"temperature": 0.6, "top_p": 0.95}, "greedy": {"temperature": 0.0}}
"""Evaluation's sampling: DeepSeek-R1's for its pass@1 (temperature 0.6, top-p 0.95), or greedy decoding."""
EVAL_GENERATION = -1
"""``GroupSeeds``' generation of evaluation samples (training draws 0, 1, ...): evaluate.py and train.py's eval
draw a prompt's samples from the same streams, so a run's eval and evaluate.py on its export sample alike."""


@dataclass
class GroupSeeds:
    """The sampling RNG of a run: every row's stream is derived from the run's seed and its position."""

    seed: int
    generations: int = 0
    """Generation batches drawn so far (saved in the checkpoint, so a resume continues the same completions)."""

    def of(self, generation: int, index: int) -> int:
        """The seed of prompt ``index``'s group at ``generation``."""
        return _hash(f"{self.seed}:{generation}:{index}")

    def rows(self, generation: int, index: int, count: int) -> list[int]:
        """The seeds of the ``count`` rows of prompt ``index``'s group at ``generation``."""
        group = self.of(generation, index)
        return [_hash(f"{group}:{row}") for row in range(count)]

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "generations": self.generations}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed, self.generations = int(state["seed"]), int(state["generations"])


def _hash(text: str) -> int:
    digest = hashlib.sha256(text.encode()).digest()
    return int.from_bytes(digest[:8], "little") % (2**63 - 1)


class CompletionSampler(Protocol):
    """Samples one completion per prompt row on the model's current weights."""

    eos_ids: tuple[int, ...]

    def sample(self, model: Any, prompts: list[torch.Tensor], seeds: list[int] | None) -> list[list[int]]:
        """A completion (token ids, ending at its first end-of-sequence token, which is kept) of each of ``prompts``
        (1-D, unpadded), row ``i`` drawn from the stream ``seeds[i]``; ``seeds`` None: greedy."""
        ...


class RowStreams:
    """A logits processor that picks each row's next token from that row's own stream: Transformers' warpers
    (``warpers``) on the row's logits, the softmax, and the token where the row's next uniform falls in its CDF.
    It returns logits that are −inf but at that token, so ``generate`` in greedy mode takes it. The uniforms are
    drawn up front, ``steps`` per row, each row from a generator seeded with its own seed."""

    def __init__(self, seeds: list[int], steps: int, prompt_len: int, warpers: Any, device: torch.device) -> None:
        draws = [torch.rand(steps, generator=torch.Generator().manual_seed(s), dtype=torch.float64) for s in seeds]
        self.uniforms = torch.stack(draws).to(device)
        self.prompt_len = prompt_len
        self.warpers = warpers

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_len
        scores = self.warpers(input_ids, scores)
        cdf = torch.softmax(scores.double(), dim=-1).cumsum(dim=-1)
        point = self.uniforms[:, step : step + 1] * cdf[:, -1:]
        token = torch.searchsorted(cdf, point).clamp_(max=scores.shape[-1] - 1)
        chosen = torch.full_like(scores, -torch.inf)
        return chosen.scatter_(1, token, 0.0)


@dataclass
class Sampling:
    """What a sampler is built with: TRL's options and defaults (``temperature`` 1, ``top_p`` 1, ``top_k`` 0 = off,
    ``min_p`` off, ``repetition_penalty`` 1, ``generation_kwargs`` passed on), a completion ending at any of
    ``eos_ids`` or after ``max_new_tokens``, and ``batch_rows`` rows per call (None: all in one)."""

    max_new_tokens: int
    eos_ids: tuple[int, ...]
    pad_id: int
    temperature: float = 1.0
    top_p: float = 1.0
    batch_rows: int | None = None
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    generation_kwargs: dict[str, Any] | None = None


@dataclass
class HFGenerate(Sampling):
    """Transformers' ``generate`` (KV cache, left-padded rows, positions from the attention mask), sampling row by
    row (``RowStreams``)."""

    def sample(self, model: Any, prompts: list[torch.Tensor], seeds: list[int] | None) -> list[list[int]]:
        size = self.batch_rows or max(len(prompts), 1)
        out: list[list[int]] = []
        for start in range(0, len(prompts), size):
            chunk = slice(start, start + size)
            out += self._call(model, prompts[chunk], None if seeds is None else seeds[chunk])
        return out

    @torch.no_grad()
    def _call(self, model: Any, prompts: list[torch.Tensor], seeds: list[int] | None) -> list[list[int]]:
        from transformers import (
            LogitsProcessorList,
            MinPLogitsWarper,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        inputs, mask = left_padded(prompts, self.pad_id)
        kwargs: dict[str, Any] = {
            **(self.generation_kwargs or {}),
            "max_new_tokens": self.max_new_tokens,
            "eos_token_id": list(self.eos_ids),
            "pad_token_id": self.pad_id,
            "use_cache": True,
            "attention_mask": mask,
            "do_sample": False,
            "temperature": None,
            "top_p": None,
            "top_k": None,
            "repetition_penalty": self.repetition_penalty,  # a processor: applied before the rows' own draws
        }
        if seeds is not None:  # Transformers' warpers in its own order (temperature, top-k, top-p, min-p)
            warpers = LogitsProcessorList()
            if self.temperature != 1.0:
                warpers.append(TemperatureLogitsWarper(self.temperature))
            if self.top_k:
                warpers.append(TopKLogitsWarper(self.top_k))
            if self.top_p < 1.0:
                warpers.append(TopPLogitsWarper(self.top_p))
            if self.min_p is not None:
                warpers.append(MinPLogitsWarper(self.min_p))
            streams = RowStreams(seeds, self.max_new_tokens, inputs.shape[1], warpers, inputs.device)
            kwargs["logits_processor"] = LogitsProcessorList([streams])
        out = model.generate(inputs, **kwargs)
        return [cut_at_eos(row[inputs.shape[1] :].tolist(), self.eos_ids) for row in out]


@dataclass
class ContinuousBatching(Sampling):
    """Transformers' continuous batching (``model.generate_batch``): every row a request, scheduled over a paged
    KV cache, so a short completion frees its slot for the next instead of waiting for the longest row. Sampling
    from Transformers' RNG, seeded from the rows' seeds (one stream per call); ``batch_rows`` is unused (the
    scheduler sizes its own batches from the paged cache)."""

    def sample(self, model: Any, prompts: list[torch.Tensor], seeds: list[int] | None) -> list[list[int]]:
        from transformers import GenerationConfig

        sampled = seeds is not None
        config = GenerationConfig(
            **(self.generation_kwargs or {}),
            max_new_tokens=self.max_new_tokens,
            do_sample=sampled,
            temperature=self.temperature if sampled else None,
            top_p=self.top_p if sampled else None,
            top_k=self.top_k if sampled else None,
            min_p=self.min_p if sampled else None,
            repetition_penalty=self.repetition_penalty,
            eos_token_id=list(self.eos_ids),
            pad_token_id=self.pad_id,
        )
        devices = [prompts[0].device] if prompts and prompts[0].device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(_hash(":".join(map(str, seeds))) if seeds else 0)
            rows = [p.tolist() for p in prompts]  # warm-up captures CUDA graphs: seconds wasted elsewhere
            try:
                out = model.generate_batch(
                    rows,
                    generation_config=config,
                    continuous_batching_config=self.paged_cache(rows),
                    progress_bar=False,
                    warmup=bool(devices),
                )
            except Exception as err:  # a model or machine Transformers' paged attention does not cover
                raise UserError(
                    "--generation-backend continuous",
                    f"Transformers' continuous batching failed here ({first_line(err)})",
                    "use --generation-backend generate (the default)",
                ) from None
        ordered = sorted(out.values(), key=lambda o: int(o.request_id.rsplit("_", 1)[-1]))
        return [cut_at_eos(list(o.generated_tokens), self.eos_ids) for o in ordered]

    def paged_cache(self, rows: list[list[int]]) -> Any:
        """The paged KV cache sized for these rows: every row's prompt and completion at once, in pages of
        ``PAGE`` tokens. Left to itself Transformers sizes it from the free memory (14 GB of a CPU host's RAM for a
        tiny model, measured: enough for three ranks to be killed for it)."""
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        pages = sum(-(-(len(r) + self.max_new_tokens) // PAGE) for r in rows)
        prompt_tokens = sum(len(r) for r in rows)
        return ContinuousBatchingConfig(page_size=PAGE, num_blocks=pages, max_batch_tokens=max(PAGE, prompt_tokens))


PAGE = 256
"""Tokens per page of the continuous-batching KV cache (Transformers' default page size)."""

BACKENDS = {"generate": HFGenerate, "continuous": ContinuousBatching}
"""``--generation-backend``: the samplers by name."""


def eos_ids(tokenizer: Any, model: Any) -> tuple[int, ...]:
    """The tokens that end a completion, as TRL 1.16 takes them: the tokenizer's end-of-sequence token and the
    model's generation config's (Llama-3 and Qwen2.5-Instruct checkpoints name more than one)."""
    config = getattr(getattr(model, "module", model), "generation_config", None)
    listed = getattr(config, "eos_token_id", None)
    listed = [] if listed is None else [listed] if isinstance(listed, int) else list(listed)
    return tuple(dict.fromkeys([tokenizer.eos_token_id, *listed]))


def left_padded(prompts: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``prompts`` (1-D) as one left-padded batch and its attention mask."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=prompts[0].device)
    mask = torch.zeros_like(ids)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt) :] = prompt
        mask[i, width - len(prompt) :] = 1
    return ids, mask


def truncated(completion: list[int], eos_ids: tuple[int, ...]) -> bool:
    """Cut by the length limit: the completion does not end in an end-of-sequence token."""
    return not completion or completion[-1] not in eos_ids


def cut_at_eos(ids: list[int], eos_ids: tuple[int, ...]) -> list[int]:
    """``ids`` up to and including the first end-of-sequence token (generate pads the rows that stopped early)."""
    for i, token in enumerate(ids):
        if token in eos_ids:
            return ids[: i + 1]
    return ids
