"""The tools a rollout can use, by name (``RolloutConfig.toolset``).

Adding a tool is one module (a class with the :class:`~megatron_tir.rollout.tools.base.Tool`
methods and a ``make(context)`` function) plus one line in :data:`TOOLS`; a test may
:func:`register` one of its own. Without a package edit, a toolset entry may also be an import
path, ``module:attribute`` (:mod:`megatron_tir.import_path`), naming a ``make(context)`` callable
or a Tool class whose constructor takes the :class:`ToolContext`
(``rollout.toolset=python,my_project.tools:Calculator``); the tool's own ``name`` names it in
records. docs/extending.md walks one through.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_tir.import_path import is_import_path, load_object
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


def _maker(name: str) -> Callable[[ToolContext], Tool]:
    return TOOLS[name] if name in TOOLS else load_object(name, "rollout.toolset")


def check_toolset(names: Sequence[str]) -> tuple[str, ...]:
    """``names`` as a tuple; ValueError naming the registered tools for an unknown or repeated one,
    or the import path that does not load."""
    names = tuple(names)
    unknown = [n for n in names if n not in TOOLS and not is_import_path(n)]
    if unknown or len(set(names)) != len(names) or not names:
        raise ValueError(f"rollout.toolset must be distinct names among {sorted(TOOLS)}, got {list(names)} "
                         f"(or import paths: module:Class)")
    for name in names:
        _maker(name)
    return names


def build_tools(names: Sequence[str], context: ToolContext) -> list[Tool]:
    """The tools ``names`` for one rollout, in order (the first complete call in a turn wins)."""
    tools = [_maker(name)(context) for name in check_toolset(names)]
    for name, tool in zip(names, tools):
        if name in TOOLS:
            assert tool.name == name, f"tool {name!r} made a tool named {tool.name!r}"
        elif not isinstance(getattr(tool, "name", None), str) or not tool.name:
            raise ValueError(f"rollout.toolset: {name} made {type(tool).__name__}, which has no name")
    made = [tool.name for tool in tools]
    if len(set(made)) != len(made):
        raise ValueError(f"rollout.toolset: two tools share a name ({', '.join(made)})")
    return tools
