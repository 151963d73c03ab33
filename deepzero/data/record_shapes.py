"""The shapes of a training record people have, each read as plain text or a conversation.

- ``text``: a string (plain text).
- ``messages``: OpenAI's ``[{role, content}]``; an assistant message's ``reasoning_content`` (DeepSeek's API field)
  is written before its content as ``<think>\\n{reasoning}\\n</think>\\n\\n``, as DeepSeek's R1 models emit it.
- ``conversations``: ShareGPT's ``[{from, value}]`` (``human``/``user``, ``gpt``/``assistant``, ``system``), an
  optional top-level ``system``.
- ``instruction`` + ``output`` (Alpaca): the user turn is the instruction and, when given, the ``input`` joined with
  a newline (as LLaMA-Factory's Alpaca converter joins them); an optional ``system``.
- ``prompt`` + ``completion`` (TRL's prompt-completion): only the completion is trained.

``--format auto`` or ``chat`` detects the shape in that order; ``--format alpaca|sharegpt`` names one. A record of
none of them is refused in one line naming the keys it has.
"""

from __future__ import annotations

from typing import Any, Literal

from deepzero.errors import UserError

Chat = list[dict[str, str]]
Format = Literal["auto", "text", "chat", "alpaca", "sharegpt"]
NOT_TRAINED = "not_trained"
"""A message key set on a prompt-completion record's prompt turns: an assistant turn there is not a target."""
FIX_RECORD = (
    'give each record "text", "messages" [{role, content}], ShareGPT "conversations" [{from, value}], Alpaca '
    '"instruction"/"input"/"output", or "prompt" and "completion", or map your field names with --columns'
)
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
_SHAPES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "messages": (("messages",), ()),
    "sharegpt": (("conversations",), ("system",)),
    "alpaca": (("instruction", "output"), ("input", "system")),
    "text": (("text",), ()),
    "prompt_completion": (("prompt", "completion"), ()),
}
"""Each shape's required and optional fields."""
_ORDER: dict[str, tuple[str, ...]] = {
    "auto": ("messages", "text", "sharegpt", "alpaca", "prompt_completion"),
    "chat": ("messages", "sharegpt", "alpaca", "prompt_completion"),
    "text": ("text",),
    "alpaca": ("alpaca",),
    "sharegpt": ("sharegpt",),
}
_WANTED = {
    "messages": "'messages'",
    "sharegpt": "'conversations'",
    "alpaca": "'instruction' and 'output'",
    "text": "'text'",
    "prompt_completion": "'prompt' and 'completion'",
}


def pick_fields(keys: set[str], fmt: Format) -> tuple[str, ...] | None:
    """The fields a record's document is read from (the first shape of ``fmt`` whose required fields it has, with
    its optional fields present); None when it has no shape of ``fmt``."""
    for shape in _ORDER[fmt]:
        required, optional = _SHAPES[shape]
        if set(required) <= keys:
            return required + tuple(f for f in optional if f in keys)
    return None


def wanted(fmt: Format, kind: str) -> str:
    """What a record of ``fmt`` lacks, for a message: ``'text' or 'messages' field (nor ...)``."""
    main = [s for s in ("text", "messages") if s in _ORDER[fmt]] or list(_ORDER[fmt][:1])
    others = [_WANTED[s] for s in _ORDER[fmt] if s not in main]
    return " or ".join(_WANTED[s] for s in main) + f" {kind}" + (f" (nor {', '.join(others)})" if others else "")


def record_doc(record: dict[str, Any], where: str, fmt: Format) -> str | Chat:
    """A record as plain text or a conversation, or a UserError naming ``where`` and what is wrong."""
    fields = pick_fields(set(record), fmt)
    if fields is None:
        raise UserError(where, f"record has no {wanted(fmt, 'field')} (keys: {sorted(record)})", FIX_RECORD)
    if fields[0] == "text":
        if not isinstance(record["text"], str):
            raise UserError(where, f"'text' is {type(record['text']).__name__}, not a string", FIX_RECORD)
        return record["text"]
    if fields[0] == "prompt":
        return _prompt_completion(record["prompt"], record["completion"], where)
    if fields[0] == "conversations":
        return _sharegpt(record, where)
    if fields[0] == "instruction":
        return _alpaca(record, where)
    return messages(record["messages"], where, "messages")


def messages(value: Any, where: str, name: str) -> Chat:
    """A ``[{role, content}]`` list as a conversation, ``reasoning_content`` written into its content."""
    if not isinstance(value, list) or not value or not all(is_message(m) for m in value):
        raise UserError(where, f"'{name}' is not a non-empty list of {{role, content}} strings", FIX_RECORD)
    return [{"role": m["role"], "content": _with_reasoning(m)} for m in value]


def is_message(m: Any) -> bool:
    reasoning = m.get("reasoning_content") if isinstance(m, dict) else None
    return (
        isinstance(m, dict)
        and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), str)
        and (reasoning is None or isinstance(reasoning, str))
    )


def _with_reasoning(m: dict[str, Any]) -> str:
    reasoning = m.get("reasoning_content")
    if m["role"] != "assistant" or not reasoning:
        return m["content"]
    return f"<think>\n{reasoning.strip()}\n</think>\n\n{m['content'].lstrip()}"


def _sharegpt(record: dict[str, Any], where: str) -> Chat:
    turns = record["conversations"]
    if not isinstance(turns, list) or not turns:
        raise UserError(where, "'conversations' is not a non-empty list of {from, value}", FIX_RECORD)
    chat = [{"role": "system", "content": record["system"]}] if isinstance(record.get("system"), str) else []
    for i, turn in enumerate(turns):
        if not (isinstance(turn, dict) and isinstance(turn.get("from"), str) and isinstance(turn.get("value"), str)):
            raise UserError(where, f"'conversations'[{i}] is not a {{from, value}} of strings", FIX_RECORD)
        role = SHAREGPT_ROLES.get(turn["from"])
        if role is None:
            raise UserError(
                where,
                f"'conversations'[{i}] is from {turn['from']!r}",
                f"use one of {', '.join(SHAREGPT_ROLES)} (tool turns are not read)",
            )
        chat.append({"role": role, "content": turn["value"]})
    return chat


def _alpaca(record: dict[str, Any], where: str) -> Chat:
    parts = [record.get(k) for k in ("instruction", "input", "output", "system")]
    if not all(p is None or isinstance(p, str) for p in parts):
        raise UserError(
            where, "an Alpaca field ('instruction', 'input', 'output', 'system') is not a string", FIX_RECORD
        )
    instruction, given, output, system = parts
    if not (instruction or "").strip() or not (output or "").strip():
        raise UserError(where, "Alpaca record with an empty 'instruction' or 'output'", "give both, or drop the record")
    query = "\n".join(p for p in (instruction, given) if p)
    chat = [{"role": "system", "content": system}] if system else []
    return [*chat, {"role": "user", "content": query}, {"role": "assistant", "content": output}]


def _prompt_completion(prompt: Any, completion: Any, where: str) -> Chat:
    """TRL's prompt-completion SFT record as a conversation: a string prompt is a user turn and a string completion
    an assistant turn (message lists are kept). Only the completion is trained: the prompt's own assistant turns
    (a multi-turn prompt) carry ``NOT_TRAINED``, which the chat path leaves out of the targets."""
    turns = []
    for name, value, role in (("prompt", prompt, "user"), ("completion", completion, "assistant")):
        if isinstance(value, str) and value.strip():
            turns.append([{"role": role, "content": value}])
        elif isinstance(value, list) and value and all(is_message(m) for m in value):
            turns.append(messages(value, where, name))
        else:
            raise UserError(
                where, f"'{name}' is neither a non-empty string nor a list of {{role, content}}", FIX_RECORD
            )
    if not any(m["role"] == "assistant" for m in turns[1]):
        raise UserError(where, "'completion' has no assistant message", 'give it {"role": "assistant", ...} turns')
    return [{**m, NOT_TRAINED: True} if m["role"] == "assistant" else m for m in turns[0]] + turns[1]
