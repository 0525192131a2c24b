"""What runs in the sandbox and what the model reads back.

* :data:`FINAL_ANSWER_PRELUDE` is prefixed to every executed block. It defines
  ``final_answer(x)``, which prints ``\\boxed{x}`` (LaTeX for SymPy objects when SymPy is
  already imported, ``str(x)`` otherwise) and returns ``x``. It is one line, so line
  numbers in tracebacks are one more than in the model's block.
* :func:`format_feedback` turns an :class:`~sandbox_cluster.protocol.ExecResult` into
  the text appended after the block: ``Code Execution Result:`` and the stdout, cut in
  the middle (head and tail kept) past ``max_output_chars``, then the last
  ``stderr_lines`` lines of stderr if there are any -- on an error and on a successful run
  alike (a warning such as numpy's ``RuntimeWarning: divide by zero`` tells the model why
  a printed value is ``inf``; SimpleTIR instead replaces the whole feedback by stderr's
  last line, which hides what the program printed); a plain sentence for empty output, a
  timeout, a memory kill or an output flood. Infrastructure failures (``sandbox_error``,
  ``overloaded``) are not model feedback: the driver records them as a failed tool call.
"""

from __future__ import annotations

from dataclasses import dataclass

from sandbox_cluster.protocol import ExecResult, Status

FINAL_ANSWER_PRELUDE = (
    "def final_answer(result):"
    " import sys as _sys;"
    " _sp = _sys.modules.get('sympy');"
    " print('\\\\boxed{' + (_sp.latex(result) if _sp is not None and isinstance(result, _sp.Basic)"
    " else str(result)) + '}');"
    " return result\n"
)

FEEDBACK_HEADER = "Code Execution Result:"
INFRA_FAILURES = frozenset({Status.SANDBOX_ERROR, Status.OVERLOADED})


def program_for(code: str) -> str:
    """The program sent to the sandbox for a model's code block."""
    return FINAL_ANSWER_PRELUDE + code


@dataclass(kw_only=True, slots=True)
class FeedbackConfig:
    max_output_chars: int = 1024  # stdout kept: head and tail halves around a cut marker
    stderr_lines: int = 5  # last lines of stderr shown on an error
    max_stderr_chars: int = 1024

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


def format_feedback(result: ExecResult, config: FeedbackConfig, *, timeout: float, memory_mb: int,
                    leading_newline: bool = True) -> str:
    """The feedback text for one execution (not for infrastructure failures)."""
    if result.status in INFRA_FAILURES:
        raise ValueError(f"{result.status.value} is an infrastructure failure, not model feedback")
    stdout = result.stdout.rstrip("\n")
    parts: list[str] = []
    if stdout:
        parts.append(truncate_middle(stdout, config.max_output_chars))
    status = result.status
    if status is Status.OK:
        if result.stdout_truncated:
            parts.append("[output truncated by the sandbox]")
        if result.stderr.strip():  # warnings of a successful run (e.g. numpy's divide by zero)
            parts.append(stderr_tail(result.stderr, config.stderr_lines, config.max_stderr_chars))
        if not parts:
            parts.append("[no output; use print() to see values]")
    elif status is Status.ERROR:
        tail = stderr_tail(result.stderr, config.stderr_lines, config.max_stderr_chars)
        parts.append(tail or f"[the program failed with exit code {result.exit_code} and no error message]")
    elif status is Status.TIMEOUT:
        parts.append(f"TimeoutError: the program did not finish within the {timeout:g} s time limit")
    elif status is Status.MEMORY:
        parts.append(f"MemoryError: the program exceeded the {memory_mb} MB memory limit and was killed")
    elif status is Status.OUTPUT_LIMIT:
        parts.append("[the program printed too much output and was stopped]")
    else:  # pragma: no cover - Status is closed; a new member must be handled here
        raise AssertionError(f"unhandled sandbox status {status!r}")
    body = "\n".join(parts)
    lead = "\n" if leading_newline else ""
    return f"{lead}{FEEDBACK_HEADER}\n```output\n{body}\n```\n"
