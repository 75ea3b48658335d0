"""Prompt templates: question text -> the query string the model continues.

Two kinds, chosen by name (`TEMPLATES`):
- ``plain``: ``"{question}\\n{instruction}\\n"`` plus an optional prefix,
  for base models;
- ``chat``: the tokenizer's own chat template with the generation prompt
  appended, for instruct models.
Both take the instruction as an argument, defaulting to `DEFAULT_INSTRUCTION`.
"""

from __future__ import annotations

from typing import Any, Protocol

DEFAULT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


class ChatTokenizer(Protocol):
    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


def plain_prompt(
    question: str, instruction: str | None = DEFAULT_INSTRUCTION, *, prefix: str = ""
) -> str:
    """``prefix + question + "\\n" + instruction + "\\n"`` (no instruction: just
    ``prefix + question + "\\n"``)."""
    text = prefix + question.strip() + "\n"
    if instruction:
        text += instruction + "\n"
    return text


def chat_prompt(
    question: str,
    tokenizer: ChatTokenizer,
    instruction: str | None = DEFAULT_INSTRUCTION,
    *,
    system: str | None = None,
) -> str:
    """The tokenizer's chat template over one user turn, ending with the
    assistant's generation prompt. Returns text (not ids).

    The user turn is ``question + "\\n" + instruction``; `system` adds a system
    turn. Raises ValueError when the tokenizer has no chat template.
    """
    if getattr(tokenizer, "chat_template", "unset") is None:
        raise ValueError(
            f"{type(tokenizer).__name__} has no chat template; use the 'plain' template "
            "for base models or load the instruct model's tokenizer"
        )
    user = question.strip() + ("\n" + instruction if instruction else "")
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user}
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if not isinstance(text, str):
        raise TypeError(
            f"apply_chat_template returned {type(text).__name__}, expected str with tokenize=False"
        )
    return text


TEMPLATES = ("plain", "chat")


def format_prompt(
    question: str,
    template: str = "plain",
    *,
    tokenizer: ChatTokenizer | None = None,
    instruction: str | None = DEFAULT_INSTRUCTION,
    **kwargs: Any,
) -> str:
    """Dispatch by template name; ``chat`` needs `tokenizer`."""
    if template == "plain":
        return plain_prompt(question, instruction, **kwargs)
    if template == "chat":
        if tokenizer is None:
            raise ValueError("the 'chat' template needs tokenizer=... (a HF tokenizer)")
        return chat_prompt(question, tokenizer, instruction, **kwargs)
    raise ValueError(f"unknown prompt template {template!r}; choose from {TEMPLATES}")
