"""The protocol presets a rollout runs under (``RolloutConfig.protocol``): ``default`` and ``simpletir``.

A preset answers every question the rollout driver asks about text: the prompt's ids,
the stop strings of the next engine request, what a turn is (:class:`TurnClass`), and
which answer the reward checks. Tool calls are read through the tools' syntax
(:class:`~megatron_tir.tir.calls.CallSyntax`): the turn ends with the first complete call
of any tool in use. The Python tool's calls are the preset's code blocks, and the preset
also says what the Python tool runs (``program``), what its feedback reads like
(``feedback``, from a :class:`~megatron_tir.tir.feedback.ProgramRun`) and whether its
output names a final answer (``tool_answer``).

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
import dataclasses
import enum
from collections.abc import Sequence

from megatron_tir.tir import feedback as default_feedback
from megatron_tir.tir import markup, simpletir
from megatron_tir.tir.calls import PYTHON, CallSyntax, CallText
from megatron_tir.tir.feedback import FeedbackConfig, ProgramRun
from megatron_tir.tir.markup import TurnClass, TurnKind
from megatron_tir.tir.prompt import PromptConfig, build_prompt_ids


class ProtocolName(str, enum.Enum):
    DEFAULT = "default"
    SIMPLETIR = "simpletir"


class TIRProtocol(abc.ABC):
    """What the rollout driver asks a protocol preset."""

    name: ProtocolName
    response_prefix: str = ""  # text the prompt ends with that belongs to the first turn

    def __init__(self, *, tools: bool) -> None:
        self.tools = tools

    def stop_strings(self, turn_text: str, tools: Sequence[CallSyntax] = ()) -> tuple[str, ...]:
        """Stop strings for the next engine request of a turn: every tool's (none without tools)."""
        return tuple(dict.fromkeys(stop for tool in tools for stop in tool.stop_strings(turn_text)))

    def code_stop_strings(self, turn_text: str) -> tuple[str, ...]:
        """The Python tool's stop strings: where a code block can close."""
        return markup.stop_strings(turn_text)

    def code_call(self, turn_text: str) -> CallText | None:
        """The Python tool's call: the turn's complete code block, by the preset's grammar."""
        cls = self._classify(turn_text, None, code=True)
        if cls.kind is not TurnKind.CODE:
            return None
        return CallText(payload=cls.code, end=cls.code_end, reason=cls.reason, lang=cls.lang)

    def classify(self, text: str, finish_reason=None, tools: Sequence[CallSyntax] = ()) -> TurnClass:
        """What the turn is, given the tools in use: a call of the tool whose complete call ends
        first (kind ``code``, ``tool`` its name), else an answer, void or aborted turn."""
        python = any(t.name == PYTHON for t in tools)
        cls = self._classify(text, finish_reason, code=python)
        calls = [(c.end, i, t.name, c) for i, t in enumerate(tools) if (c := t.find_call(text)) is not None]
        if not calls:
            return cls
        _, _, name, call = min(calls)
        if name == PYTHON and cls.kind is TurnKind.CODE:  # the preset's own reading of its code block
            return dataclasses.replace(cls, tool=PYTHON)
        reason = call.reason + (" and a boxed final answer (the trajectory ends after the call runs)"
                                if cls.answer is not None else "")
        return TurnClass(kind=TurnKind.CODE, reason=reason, code=call.payload, lang=call.lang, answer=cls.answer,
                         code_end=call.end, final=cls.answer is not None, tool=name)

    @abc.abstractmethod
    def _classify(self, text: str, finish_reason, *, code: bool) -> TurnClass:
        """The preset's reading of a turn; ``code``: its code blocks are calls (the Python tool is on)."""

    @abc.abstractmethod
    def prompt_ids(self, messages: Sequence[dict], tokenizer) -> list[int]: ...

    @abc.abstractmethod
    def program(self, code: str) -> str:
        """The program the Python tool runs for a turn's code."""

    @abc.abstractmethod
    def feedback(self, result: ProgramRun, *, turn_index: int, max_turns: int, turn_text: str, timeout: float,
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

    def _classify(self, text, finish_reason, *, code: bool) -> TurnClass:
        return markup.classify_turn(text, finish_reason, tools=code)

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

    def _classify(self, text, finish_reason, *, code: bool) -> TurnClass:
        return simpletir.classify_turn(text, finish_reason, tools=code)

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
