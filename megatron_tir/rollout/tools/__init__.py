"""Tools of a rollout: the :class:`Tool` protocol, the registry, and the Python sandbox tool."""

from megatron_tir.rollout.tools.base import FeedbackContext, Tool, ToolResult
from megatron_tir.rollout.tools.registry import TOOLS, ToolContext, build_tools, register

__all__ = ["FeedbackContext", "TOOLS", "Tool", "ToolContext", "ToolResult", "build_tools", "register"]
