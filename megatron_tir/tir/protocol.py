"""The protocol presets a rollout runs under (``RolloutConfig.protocol``): ``default`` and ``simpletir``.

A preset answers every question the rollout driver asks about text: the prompt's ids,
the stop strings of the next engine request, what a turn is (:class:`TurnClass`), the
program sent to the sandbox, the feedback appended after it, whether the tool printed a
final answer, and which answer the reward checks.

* ``default``: this project's protocol -- the grammar of :mod:`megatron_tir.tir.markup`,
  the prompt of :mod:`megatron_tir.tir.prompt`, the feedback of
  :mod:`megatron_tir.tir.feedback`; the reward checks the last complete ``\\boxed{}`` of
  the model's prose or of a ``final_answer()`` printout.
* ``simpletir``: the released SimpleTIR code's behaviour (:mod:`megatron_tir.tir.simpletir`).

Both presets share two turn rules: a turn with a final answer ends the trajectory (a code
block in that turn runs first and its feedback is appended), and with ``tools=False``
there is one text-only turn (no code stop strings, nothing executed): an answer, or void.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Sequence

from megatron_tir.tir import feedback as default_feedback
from megatron_tir.tir import markup, simpletir
from megatron_tir.tir.feedback import FeedbackConfig
from megatron_tir.tir.markup import TurnClass
from megatron_tir.tir.prompt import PromptConfig, build_prompt_ids
from sandbox_cluster.protocol import ExecResult


class ProtocolName(str, enum.Enum):
    DEFAULT = "default"
    SIMPLETIR = "simpletir"


class TIRProtocol(abc.ABC):
    """What the rollout driver asks a protocol preset."""

    name: ProtocolName
    response_prefix: str = ""  # text the prompt ends with that belongs to the first turn

    def __init__(self, *, tools: bool) -> None:
        self.tools = tools

    def stop_strings(self, turn_text: str) -> tuple[str, ...]:
        """Stop strings for the next engine request of a turn (none when tools are off)."""
        return markup.stop_strings(turn_text) if self.tools else ()

    @abc.abstractmethod
    def prompt_ids(self, messages: Sequence[dict], tokenizer) -> list[int]: ...

    @abc.abstractmethod
    def classify(self, text: str, finish_reason=None) -> TurnClass: ...

    @abc.abstractmethod
    def program(self, code: str) -> str:
        """The program the sandbox runs for a turn's code."""

    @abc.abstractmethod
    def feedback(self, result: ExecResult, *, turn_index: int, max_turns: int, turn_text: str, timeout: float,
                 memory_mb: int) -> str:
        """The text appended after a code turn ("" appends nothing); never for infrastructure failures."""

    @abc.abstractmethod
    def tool_answer(self, stdout: str) -> str | None:
        """The final answer the program printed, if any (it ends the trajectory)."""

    @abc.abstractmethod
    def final_answer(self, answers: Sequence[tuple[str, str]], response_text: str) -> tuple[str | None, str | None]:
        """``(answer, source)`` the reward checks.

        ``answers``: ``(answer, "model" | "tool")`` in the order the turns gave them;
        ``response_text``: the whole response decoded without special tokens.
        """


class DefaultProtocol(TIRProtocol):
    name = ProtocolName.DEFAULT

    def __init__(self, *, tools: bool, prompt: PromptConfig, feedback: FeedbackConfig) -> None:
        super().__init__(tools=tools)
        self.prompt = prompt
        self.feedback_config = feedback
        self.response_prefix = prompt.response_prefix

    def prompt_ids(self, messages, tokenizer) -> list[int]:
        return build_prompt_ids(messages, self.prompt, tokenizer, tools=self.tools)

    def classify(self, text, finish_reason=None) -> TurnClass:
        return markup.classify_turn(text, finish_reason, tools=self.tools)

    def program(self, code: str) -> str:
        return default_feedback.program_for(code)

    def feedback(self, result, *, turn_index, max_turns, turn_text, timeout, memory_mb) -> str:
        return default_feedback.format_feedback(result, self.feedback_config, timeout=timeout, memory_mb=memory_mb,
                                                leading_newline=not turn_text.endswith("\n"))

    def tool_answer(self, stdout: str) -> str | None:
        return markup.last_boxed(stdout)

    def final_answer(self, answers, response_text):
        return answers[-1] if answers else (None, None)


class SimpleTIRProtocol(TIRProtocol):
    name = ProtocolName.SIMPLETIR

    def prompt_ids(self, messages, tokenizer) -> list[int]:
        return simpletir.build_prompt_ids(messages, tokenizer, tools=self.tools)

    def classify(self, text, finish_reason=None) -> TurnClass:
        return simpletir.classify_turn(text, finish_reason, tools=self.tools)

    def program(self, code: str) -> str:
        return simpletir.program_for(code)

    def feedback(self, result, *, turn_index, max_turns, turn_text, timeout, memory_mb) -> str:
        return simpletir.format_feedback(result, turn_index=turn_index, max_turns=max_turns)

    def tool_answer(self, stdout: str) -> str | None:
        return simpletir.tool_answer(stdout)

    def final_answer(self, answers, response_text):
        return simpletir.extract_answer(response_text), "response"


def make_protocol(name: str | ProtocolName, *, tools: bool, prompt: PromptConfig,
                  feedback: FeedbackConfig) -> TIRProtocol:
    name = ProtocolName(name)
    if name is ProtocolName.SIMPLETIR:
        return SimpleTIRProtocol(tools=tools)
    return DefaultProtocol(tools=tools, prompt=prompt, feedback=feedback)
