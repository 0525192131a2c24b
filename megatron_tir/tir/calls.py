"""The text side of a tool: how its call is recognised in a model turn.

A rollout-side tool (:mod:`megatron_tir.rollout.tools`) has this syntax; the protocol
presets (:mod:`megatron_tir.tir.protocol`) read turns through it, so what a turn *is*
does not depend on which tools exist. The Python tool's syntax is the preset's own code
grammar (:mod:`megatron_tir.tir.markup`, or SimpleTIR's); other tools bring theirs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

PYTHON = "python"  # the tool whose calls are the presets' code blocks


@dataclass(kw_only=True, slots=True, frozen=True)
class CallText:
    """A complete call found in a turn's text."""

    payload: str  # what the tool executes (code, an expression, a query)
    end: int  # offset just past the call: the turn ends there
    reason: str  # why this is a call (the turn's reason)
    lang: str | None = None


class CallSyntax(Protocol):
    name: str

    def stop_strings(self, turn_text: str) -> tuple[str, ...]:
        """Stop strings for the next engine request so that generation pauses where a call can end."""
        ...

    def find_call(self, turn_text: str) -> CallText | None:
        """The first complete call in ``turn_text`` (None when there is none yet)."""
        ...
