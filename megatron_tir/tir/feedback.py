"""What runs in the sandbox and what the model reads back.

* :data:`FINAL_ANSWER_PRELUDE` is prefixed to every executed block. It defines
  ``final_answer(x)``, which prints ``\\boxed{x}`` (LaTeX for SymPy objects when SymPy is
  already imported, ``str(x)`` otherwise) and returns ``x``. It is one line, so line
  numbers in tracebacks are one more than in the model's block.
* :func:`format_feedback` turns a :class:`ProgramRun` (what running the block gave: the
  Python tool fills it from the sandbox's record) into the text appended after the block: ``Code Execution Result:`` and the stdout, cut in
  the middle (head and tail kept) past ``max_output_chars``, then the last
  ``stderr_lines`` lines of stderr if there are any -- on an error and on a successful run
  alike (a warning such as numpy's ``RuntimeWarning: divide by zero`` tells the model why
  a printed value is ``inf``; SimpleTIR instead replaces the whole feedback by stderr's
  last line, which hides what the program printed); a plain sentence for empty output, a
  timeout, a memory kill or an output flood. Infrastructure failures are not model
  feedback (they have no :class:`RunStatus`): the driver records them as a failed tool call.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

FINAL_ANSWER_PRELUDE = (
    "def final_answer(result):"
    " import sys as _sys;"
    " _sp = _sys.modules.get('sympy');"
    " print('\\\\boxed{' + (_sp.latex(result) if _sp is not None and isinstance(result, _sp.Basic)"
    " else str(result)) + '}');"
    " return result\n"
)

FEEDBACK_HEADER = "Code Execution Result:"


class RunStatus(str, enum.Enum):
    """How a program the model wrote ended: always the model's doing (its code, its limits)."""

    OK = "ok"
    ERROR = "error"  # it raised / exited non-zero
    TIMEOUT = "timeout"
    MEMORY = "memory"
    OUTPUT_LIMIT = "output_limit"


class ProgramRun(Protocol):
    """What running a program gave, as the feedback reads it (the sandbox's record fits)."""

    status: str  # a RunStatus value
    stdout: str
    stderr: str
    exit_code: int | None
    stdout_truncated: bool


def run_status(result: ProgramRun) -> RunStatus:
    """``result.status`` as a RunStatus; ValueError for anything else (an infrastructure failure)."""
    try:
        return RunStatus(getattr(result.status, "value", result.status))
    except ValueError:
        raise ValueError(f"{getattr(result.status, 'value', result.status)} is not a program outcome: an "
                         "infrastructure failure, not model feedback") from None


def program_for(code: str) -> str:
    """The program sent to the sandbox for a model's code block."""
    return FINAL_ANSWER_PRELUDE + code


@dataclass(kw_only=True, slots=True)
class FeedbackConfig:
    max_output_chars: int = 1024  # stdout kept: head and tail halves around a cut marker
    stderr_lines: int = 5  # last lines of stderr shown on an error
    max_stderr_chars: int = 1024  # stderr kept on an error (head and tail)

    def __post_init__(self) -> None:
        if self.max_output_chars < 16:
            raise ValueError(f"max_output_chars must be >= 16, got {self.max_output_chars}")
        if self.stderr_lines < 1:
            raise ValueError(f"stderr_lines must be >= 1, got {self.stderr_lines}")
        if self.max_stderr_chars < 16:
            raise ValueError(f"max_stderr_chars must be >= 16, got {self.max_stderr_chars}")


def truncate_middle(text: str, max_chars: int) -> str:
    """``text`` if short enough, else its head and tail with a marker saying what was cut."""
    if len(text) <= max_chars:
        return text
    head = max_chars // 2
    tail = max_chars - head
    cut = len(text) - head - tail
    return f"{text[:head]}\n... [{cut} characters omitted] ...\n{text[len(text) - tail:]}"


def stderr_tail(stderr: str, lines: int, max_chars: int) -> str:
    kept = stderr.rstrip("\n").splitlines()[-lines:]
    out = "\n".join(kept)
    return out if len(out) <= max_chars else "..." + out[len(out) - max_chars + 3:]


def format_feedback(result: ProgramRun, config: FeedbackConfig, *, timeout: float, memory_mb: int,
                    leading_newline: bool = True) -> str:
    """The feedback text for one execution (not for infrastructure failures)."""
    status = run_status(result)
    stdout = result.stdout.rstrip("\n")
    parts: list[str] = []
    if stdout:
        parts.append(truncate_middle(stdout, config.max_output_chars))
    if status is RunStatus.OK:
        if result.stdout_truncated:
            parts.append("[output truncated by the sandbox]")
        if result.stderr.strip():  # warnings of a successful run (e.g. numpy's divide by zero)
            parts.append(stderr_tail(result.stderr, config.stderr_lines, config.max_stderr_chars))
        if not parts:
            parts.append("[no output; use print() to see values]")
    elif status is RunStatus.ERROR:
        tail = stderr_tail(result.stderr, config.stderr_lines, config.max_stderr_chars)
        parts.append(tail or f"[the program failed with exit code {result.exit_code} and no error message]")
    elif status is RunStatus.TIMEOUT:
        parts.append(f"TimeoutError: the program did not finish within the {timeout:g} s time limit")
    elif status is RunStatus.MEMORY:
        parts.append(f"MemoryError: the program exceeded the {memory_mb} MB memory limit and was killed")
    elif status is RunStatus.OUTPUT_LIMIT:
        parts.append("[the program printed too much output and was stopped]")
    else:  # pragma: no cover - RunStatus is closed; a new member must be handled here
        raise AssertionError(f"unhandled sandbox status {status!r}")
    body = "\n".join(parts)
    lead = "\n" if leading_newline else ""
    return f"{lead}{FEEDBACK_HEADER}\n```output\n{body}\n```\n"
