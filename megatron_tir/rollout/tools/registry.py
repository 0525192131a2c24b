"""The tools a rollout can use, by name (``RolloutConfig.toolset``).

Adding a tool is one module (a class with the :class:`~megatron_tir.rollout.tools.base.Tool`
methods and a ``make(context)`` function) plus one line in :data:`TOOLS`; a test may
:func:`register` one of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_tir.rollout.tools.base import Tool
from megatron_tir.tir.calls import PYTHON


@dataclass(kw_only=True, slots=True, frozen=True)
class ToolContext:
    """What a tool may need to be made: the rollout's sandbox, protocol preset and config."""

    sandbox: Any  # megatron_tir.rollout.sandbox.Sandbox | None
    protocol: Any  # megatron_tir.tir.protocol.TIRProtocol
    config: Any  # megatron_tir.rollout.driver.RolloutConfig


def _python(context: ToolContext) -> Tool:
    from megatron_tir.rollout.tools.python import PythonTool

    if context.sandbox is None:
        raise ValueError("a rollout with the python tool needs a sandbox")
    cfg = context.config
    return PythonTool(sandbox=context.sandbox, protocol=context.protocol, timeout_s=cfg.tool_timeout_s,
                      memory_mb=cfg.tool_memory_mb)


TOOLS: dict[str, Callable[[ToolContext], Tool]] = {
    PYTHON: _python,
}


def register(name: str, make: Callable[[ToolContext], Tool]) -> None:
    """Add a tool under ``name`` (ValueError if the name is taken)."""
    if not name or name in TOOLS:
        raise ValueError(f"tool name {name!r} is empty or already registered")
    TOOLS[name] = make


def check_toolset(names: Sequence[str]) -> tuple[str, ...]:
    """``names`` as a tuple; ValueError naming the registered tools for an unknown or repeated one."""
    names = tuple(names)
    unknown = [n for n in names if n not in TOOLS]
    if unknown or len(set(names)) != len(names) or not names:
        raise ValueError(f"rollout.toolset must be distinct names among {sorted(TOOLS)}, got {list(names)}")
    return names


def build_tools(names: Sequence[str], context: ToolContext) -> list[Tool]:
    """The tools ``names`` for one rollout, in order (the first complete call in a turn wins)."""
    tools = [TOOLS[name](context) for name in check_toolset(names)]
    for name, tool in zip(names, tools):
        assert tool.name == name, f"tool {name!r} made a tool named {tool.name!r}"
    return tools
