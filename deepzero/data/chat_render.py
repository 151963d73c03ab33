"""Which template renders a conversation for training, and which of its characters are targets.

A tokenizer's shipped chat template is made for inference: DeepSeek's R1-Distill and V3 templates drop everything up
to ``</think>`` from assistant turns and prefill ``<｜Assistant｜><think>\\n``, so rendering training data with them
silently removes the reasoning from the targets. Like TRL 1.16's ``SFTTrainer``, prepare renders chat data with a
training variant instead: ``trl.chat_template_utils.get_training_chat_template`` swaps the templates TRL knows for
copies that keep the reasoning and mark assistant output with ``{% generation %}``; ``--chat-template NAME|FILE``
names one (:data:`NAMED`) or a Jinja file of the user's. Marked templates give the target spans directly; an
unmarked template locates assistant turns by rendering prefixes, and must write each assistant turn's text whole.

When the tokenizer's own template drops the reasoning (checked on a probe conversation), the model never sees its
earlier turns' reasoning at inference: earlier assistant turns are rendered as that template renders them (the text
after the last ``</think>``) and are not targets; the last assistant turn is the target, reasoning included.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from transformers import PreTrainedTokenizerBase

from deepzero.data.record_shapes import NOT_TRAINED, Chat
from deepzero.errors import UserError

THINK_END = "</think>"
_PROBE_REASONING, _PROBE_ANSWER = "deepzero probe reasoning 7f3a", "deepzero probe answer 9c1e"
_PROBE = [
    {"role": "user", "content": "deepzero probe question"},
    {"role": "assistant", "content": f"<think>\n{_PROBE_REASONING}\n{THINK_END}\n\n{_PROBE_ANSWER}"},
]
_GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _trl_templates() -> dict[str, str]:
    from trl import chat_template_utils as trl_templates

    return {
        "r1-distill-training": trl_templates.deepseek_r1_distill_training_chat_template,
        "deepseek-v3-training": trl_templates.deepseekv3_training_chat_template,
        "r1-distill": trl_templates.deepseek_r1_distill_chat_template,
        "deepseek-v3": trl_templates.deepseekv3_chat_template,
    }


NAMED = ("r1-distill-training", "deepseek-v3-training", "r1-distill", "deepseek-v3")
"""``--chat-template`` names: TRL 1.16's byte-identical copies of DeepSeek's shipped R1-Distill and V3 templates and
their training variants. TRL's V3 variant marks assistant output but still drops the text up to ``</think>``: V3 data
with reasoning traces needs ``r1-distill-training`` (the same layout, reasoning kept), and prepare says so."""
FIX = "give --chat-template r1-distill-training (keeps the reasoning) or a Jinja FILE that writes every assistant turn whole"


@dataclass(frozen=True)
class ChatRenderer:
    """Renders conversations with the training template and finds their target character spans."""

    tok: PreTrainedTokenizerBase
    name: str
    """The ``--tokenizer`` given, for messages."""
    template: str
    source: str
    """Where the template came from, for meta.json and the summary."""
    strips_reasoning: bool
    """The tokenizer's own template drops the reasoning of assistant turns (only the last turn is a target)."""

    @property
    def marked(self) -> bool:
        return bool(_GENERATION_MARK.search(self.template))

    def spans(self, chat: Chat) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans of its target assistant turns."""
        assistants = [i for i, m in enumerate(chat) if m["role"] == "assistant"]
        trained = [i for i in assistants if not chat[i].get(NOT_TRAINED)]
        if self.strips_reasoning and trained:
            last = trained[-1]
            chat = [_as_at_inference(m) if m["role"] == "assistant" and i != last else m for i, m in enumerate(chat)]
            trained = [last]
        chat = [{k: v for k, v in m.items() if k != NOT_TRAINED} for m in chat]
        text, by_turn = self._marked_spans(chat, assistants) if self.marked else self._prefix_spans(chat, trained)
        spans = []
        for i in trained:
            lo, hi = by_turn[i]
            if chat[i]["content"].strip() not in text[lo:hi]:
                raise UserError(
                    f"--tokenizer {self.name}",
                    f"the chat template ({self.source}) does not write assistant turn {i}'s text whole "
                    f"(dropped from the targets: {_dropped(chat[i]['content'], text[lo:hi])})",
                    FIX,
                )
            spans.append((lo, hi))
        return text, spans

    def render(self, chat: Chat, add_generation_prompt: bool = False) -> str:
        try:
            return self.tok.apply_chat_template(
                chat, chat_template=self.template, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except TemplateError as err:
            raise refused(self.name, err) from None

    def _marked_spans(self, chat: Chat, assistants: list[int]) -> tuple[str, dict[int, tuple[int, int]]]:
        """Spans from the template's ``{% generation %}`` blocks, one per assistant turn in order."""
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            rendered, indices = render_jinja_template(
                conversations=[chat],
                chat_template=self.template,
                return_assistant_tokens_mask=True,
                **self.tok.special_tokens_map,
            )
        except TemplateError as err:
            raise refused(self.name, err) from None
        blocks = indices[0]
        if len(blocks) != len(assistants):
            raise UserError(
                f"--tokenizer {self.name}",
                f"the chat template ({self.source}) marks {len(blocks)} generation blocks for "
                f"{len(assistants)} assistant turns",
                FIX,
            )
        return rendered[0], dict(zip(assistants, blocks, strict=True))

    def _prefix_spans(self, chat: Chat, trained: list[int]) -> tuple[str, dict[int, tuple[int, int]]]:
        """Turn ``i`` spans from the end of ``render(chat[:i], add_generation_prompt=True)`` to the end of
        ``render(chat[: i + 1])``, which needs a template whose renderings of prefixes are prefixes of each other."""
        full = self.render(chat)
        spans = {}
        for i in trained:
            before, through = self.render(chat[:i], add_generation_prompt=True), self.render(chat[: i + 1])
            if not (through.startswith(before) and full.startswith(through)):
                raise UserError(
                    f"--tokenizer {self.name}",
                    f"its chat template ({self.source}) renders a conversation's prefix differently from the whole "
                    "(a generation prefill, or earlier turns rewritten), so assistant turns cannot be located",
                    FIX,
                )
            spans[i] = (len(before), len(through))
        return full, spans


def refused(name: str, err: TemplateError) -> UserError:
    """A template's refusal of a conversation, as one line naming the tokenizer."""
    return UserError(
        f"--tokenizer {name}",
        f"its chat template refused a conversation ({str(err).strip().splitlines()[0] if str(err) else err!r})",
        "give the roles the template accepts (DeepSeek: system first, then user/assistant turns)",
    )


def chat_renderer(tok: PreTrainedTokenizerBase, name: str, override: str | None = None) -> ChatRenderer:
    """The renderer prepare uses for ``tok``'s chat data: ``override`` (a :data:`NAMED` template or a file), else
    TRL's training variant of the tokenizer's template where TRL has one, else the tokenizer's own template."""
    shipped = _shipped(tok)
    if override:
        template, source = _named_or_file(override), f"--chat-template {override}"
    else:
        template, source = _training_variant(tok, shipped)
    renderer = ChatRenderer(tok, name, template, source, _drops_reasoning(tok, shipped))
    answer_only = [_PROBE[0], {"role": "assistant", "content": _PROBE_ANSWER}]
    renderer.spans(answer_only)  # a template that drops answers stops here; one that drops reasoning, at a trace
    return renderer


@dataclass(frozen=True)
class PairTemplate:
    """The template preference pairs render with (None: the tokenizer's own, as TRL's ``DPOTrainer``)."""

    template: str | None
    source: str
    strips_reasoning: bool
    """The tokenizer's own template drops assistant reasoning: a prompt's earlier turns are shown without it."""

    def prompt_view(self, chat: Chat) -> Chat:
        """A pair's prompt as the model sees it at inference (earlier assistant turns after their ``</think>``)."""
        return [_as_at_inference(m) if m["role"] == "assistant" else m for m in chat] if self.strips_reasoning else chat

    def check_answer(self, answer: Chat, rendered: str, where: str) -> None:
        """One line when the rendering lost the answer's reasoning (a template that drops it)."""
        content = answer[-1]["content"]
        reasoning = content.rpartition(THINK_END)[0].replace("<think>", "").strip()
        if reasoning and reasoning not in rendered:
            raise UserError(
                where,
                f"the chat template ({self.source}) drops the answer's reasoning up to {THINK_END}"
                f" ({len(reasoning)} characters), so it would not be trained",
                "pass --chat-template r1-distill-training (DeepSeek's layout, reasoning kept) or a Jinja FILE",
            )


def pair_template(tok: PreTrainedTokenizerBase, override: str | None = None) -> PairTemplate:
    """How preference pairs render: ``override``; else, where the tokenizer's own template drops assistant reasoning
    (DeepSeek's R1-Distill), TRL's training variant when it keeps it; else the tokenizer's own, as TRL does."""
    shipped = _shipped(tok)
    strips = bool(shipped) and _drops_reasoning(tok, shipped)
    if override:
        return PairTemplate(_named_or_file(override), f"--chat-template {override}", strips)
    if strips:
        variant, source = _training_variant(tok, shipped)
        if variant != shipped and not _drops_reasoning(tok, variant):
            return PairTemplate(variant, source, strips)
    return PairTemplate(None, "the tokenizer's own", strips)


def _shipped(tok: PreTrainedTokenizerBase) -> str:
    template = getattr(tok, "chat_template", None)
    return template["default"] if isinstance(template, dict) else template


def _named_or_file(override: str) -> str:
    templates = _trl_templates()
    if override in templates:
        return templates[override]
    path = Path(override).expanduser()
    if not path.is_file():
        raise UserError(f"--chat-template {override}", "is neither a known name nor a file", f"use one of {NAMED}")
    return path.read_text(encoding="utf-8")


def _training_variant(tok: PreTrainedTokenizerBase, shipped: str) -> tuple[str, str]:
    from trl.chat_template_utils import get_training_chat_template

    names = {v: k for k, v in _trl_templates().items()}
    try:
        variant = get_training_chat_template(tok)
    except ValueError:  # a template TRL does not know: used as it is, and checked turn by turn
        return shipped, "the tokenizer's own"
    if variant is None:
        return shipped, "the tokenizer's own"
    label = f"{names[variant]}, " if variant in names else ""
    return variant, f"{label}TRL's training variant of the tokenizer's {names.get(shipped, 'template')}"


def _drops_reasoning(tok: PreTrainedTokenizerBase, shipped: str) -> bool:
    """Whether the tokenizer's own template leaves out an assistant turn's reasoning but keeps its answer."""
    try:
        text = tok.apply_chat_template(_PROBE, chat_template=shipped, tokenize=False)
    except (TemplateError, ValueError):
        return False
    return _PROBE_REASONING not in text and _PROBE_ANSWER in text


def _as_at_inference(message: dict[str, Any]) -> dict[str, Any]:
    """An earlier assistant turn as DeepSeek's R1/V3 templates render it: the text after the last ``</think>``."""
    content = message["content"]
    return {**message, "content": content.split(THINK_END)[-1]} if THINK_END in content else message


def _dropped(content: str, written: str) -> str:
    """What of ``content`` the rendering lacks, shortened for a message."""
    reasoning, _, answer = content.rpartition(THINK_END)
    if reasoning and answer.strip() in written and reasoning.strip() not in written:
        return f"the reasoning up to {THINK_END}, {len(reasoning)} characters"
    for line in content.splitlines():
        if line.strip() and line.strip() not in written:
            return line.strip()[:60]
    return content.strip()[:60]
