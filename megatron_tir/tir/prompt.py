"""The prompt a rollout starts from: a plain prefix (default, base models) or a chat template.

The plain prefix is what zero-RL from a base model uses: no chat template, a short
instruction saying that ```` ```python ```` blocks are executed and their output is
returned, and that the final answer goes in ``\\boxed{}`` or is passed to
``final_answer(x)``. The chat mode puts the same instruction in a system message and
applies the tokenizer's chat template (instruct models).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

TOOL_INSTRUCTION = (
    "Solve the following math problem step by step. You can write Python code in a "
    "```python code block; the code is executed and its output is shown to you after "
    '"Code Execution Result:". Use print() to see values. Give the final answer as '
    "\\boxed{answer}, or call final_answer(answer) in your code."
)


TEXT_INSTRUCTION = (
    "Solve the following math problem step by step. Give the final answer as \\boxed{answer}."
)


class PromptMode(str, enum.Enum):
    PLAIN = "plain"
    CHAT = "chat"


@dataclass(kw_only=True, slots=True)
class PromptConfig:
    mode: PromptMode = PromptMode.PLAIN  # plain (a text prefix, base models) | chat (the tokenizer's chat template)
    # None: TOOL_INSTRUCTION, or TEXT_INSTRUCTION for text-only rollouts (RolloutConfig.tools=False).
    instruction: str | None = None
    # Plain mode: "{instruction}", "{problem}" are filled in.
    plain_template: str = "{instruction}\n\nProblem: {problem}\n\nSolution:"
    # Text appended after the template's generation prompt (both modes), e.g. to open a
    # code block and make the model start with code.
    response_prefix: str = ""

    def __post_init__(self) -> None:
        try:
            self.mode = PromptMode(self.mode)
        except ValueError:
            raise ValueError(f"prompt mode must be 'plain' or 'chat', got {self.mode!r}") from None
        for key in ("{instruction}", "{problem}"):
            if key not in self.plain_template:
                raise ValueError(f"plain_template must contain {key}")
        from megatron_tir.tir.markup import extract_code

        if extract_code(self.response_prefix) is not None:
            raise ValueError("response_prefix must not contain a complete code block (it starts the first turn)")


def problem_text(messages: Sequence[dict]) -> str:
    """The problem statement: the content of the last user message."""
    for msg in reversed(messages):
        if msg.get("role") == "user":
            return str(msg.get("content", ""))
    raise ValueError("prompt has no user message")


def build_prompt_text(messages: Sequence[dict], config: PromptConfig, tokenizer=None, *, tools: bool = True) -> str:
    """The prompt as text (chat mode needs the tokenizer for its template)."""
    instruction = config.instruction
    if instruction is None:
        instruction = TOOL_INSTRUCTION if tools else TEXT_INSTRUCTION
    if config.mode is PromptMode.PLAIN:
        text = config.plain_template.format(instruction=instruction, problem=problem_text(messages))
    else:
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("chat prompt mode needs a tokenizer with a chat template")
        msgs = [dict(m) for m in messages if m.get("role") != "system"]
        msgs.insert(0, {"role": "system", "content": instruction})
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return text + config.response_prefix


def build_prompt_ids(messages: Sequence[dict], config: PromptConfig, tokenizer, *, tools: bool = True) -> list[int]:
    """Token ids of the prompt. Plain mode adds the tokenizer's BOS if it has one."""
    text = build_prompt_text(messages, config, tokenizer, tools=tools)
    if config.mode is PromptMode.CHAT:  # the template already wrote any special tokens
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(text, add_special_tokens=True))
