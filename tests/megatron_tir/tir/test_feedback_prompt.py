"""Feedback text, the final_answer prelude and the prompt builder."""

import subprocess
import sys

import pytest

from megatron_tir.tir import (
    FEEDBACK_HEADER,
    FeedbackConfig,
    PromptConfig,
    PromptMode,
    build_prompt_ids,
    build_prompt_text,
    find_boxed,
    format_feedback,
    program_for,
    truncate_middle,
)
from sandbox_cluster.protocol import ExecResult, Status

CFG = FeedbackConfig(max_output_chars=40, stderr_lines=2)


def fb(**kw):
    return format_feedback(ExecResult(id="x", **kw), CFG, timeout=5.0, memory_mb=512)


def test_ok_output():
    assert fb(status=Status.OK, stdout="42\n") == f"\n{FEEDBACK_HEADER}\n```output\n42\n```\n"


def test_long_output_keeps_head_and_tail():
    out = "".join(f"{i:03d}" for i in range(100))  # 300 chars
    text = fb(status=Status.OK, stdout=out)
    assert out[:20] in text and out[-20:] in text
    assert "[260 characters omitted]" in text
    assert out[20:280] not in text


def test_truncate_middle_exact():
    assert truncate_middle("abcdefghij", 10) == "abcdefghij"
    assert truncate_middle("abcdefghijk", 4) == "ab\n... [7 characters omitted] ...\njk"


def test_empty_output_is_said_plainly():
    assert "no output; use print()" in fb(status=Status.OK, stdout="")


def test_error_shows_last_stderr_lines_and_stdout():
    err = "Traceback (most recent call last):\n  File \"x.py\", line 2, in <module>\n    1/0\nZeroDivisionError: division by zero\n"
    text = fb(status=Status.ERROR, stdout="partial\n", stderr=err, exit_code=1)
    assert "partial" in text
    assert "    1/0\nZeroDivisionError: division by zero" in text
    assert "Traceback" not in text  # only the last 2 lines


def test_successful_run_shows_stdout_then_the_stderr_tail():
    err = "<x>:3: RuntimeWarning: divide by zero encountered in divide\n  y = a / b\n"
    assert fb(status=Status.OK, stdout="inf\n", stderr=err) == (
        f"\n{FEEDBACK_HEADER}\n```output\ninf\n<x>:3: RuntimeWarning: divide by zero encountered in divide\n"
        "  y = a / b\n```\n")
    assert "no output" not in fb(status=Status.OK, stderr="warning only\n")
    assert fb(status=Status.OK, stdout="1\n", stderr="\n") == f"\n{FEEDBACK_HEADER}\n```output\n1\n```\n"


def test_timeout_and_memory_are_said_plainly():
    assert "TimeoutError: the program did not finish within the 5 s time limit" in fb(status=Status.TIMEOUT)
    assert "MemoryError: the program exceeded the 512 MB memory limit" in fb(status=Status.MEMORY)
    assert "too much output" in fb(status=Status.OUTPUT_LIMIT, stdout="y\n" * 10)


@pytest.mark.parametrize("status", [Status.SANDBOX_ERROR, Status.OVERLOADED])
def test_infrastructure_failures_are_not_feedback(status):
    with pytest.raises(ValueError, match="infrastructure"):
        fb(status=status)


def test_feedback_config_validation():
    with pytest.raises(ValueError, match="max_output_chars"):
        FeedbackConfig(max_output_chars=0)


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", program_for(code)], capture_output=True, text=True, timeout=60)


def test_final_answer_prelude_prints_boxed_and_returns():
    r = _run("x = final_answer(6 * 7)\nprint(x + 1)")
    assert r.returncode == 0
    assert r.stdout == "\\boxed{42}\n43\n"
    assert find_boxed(r.stdout) == ["42"]


def test_final_answer_prelude_uses_latex_for_sympy():
    r = _run("import sympy\nfinal_answer(sympy.sqrt(2) / 2)")
    assert r.stdout.strip() == "\\boxed{\\frac{\\sqrt{2}}{2}}"


def test_prelude_is_one_line():
    r = _run("\nraise ValueError('boom')")
    assert 'line 3' in r.stderr  # model's line 2 + the one prelude line


MESSAGES = [{"role": "user", "content": "What is 6*7?"}]


def test_plain_prompt():
    text = build_prompt_text(MESSAGES, PromptConfig())
    assert "What is 6*7?" in text and "```python" in text and "\\boxed{" in text and "final_answer(" in text
    assert text.endswith("Solution:")


def test_chat_prompt_uses_template(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    cfg = PromptConfig(mode="chat", response_prefix="```python\n")
    ids = build_prompt_ids(MESSAGES, cfg, tok)
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nSolve the following math problem")
    assert "<|im_start|>user\nWhat is 6*7?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n```python\n")


def test_prompt_errors():
    with pytest.raises(ValueError, match="prompt mode"):
        PromptConfig(mode="jinja")
    with pytest.raises(ValueError, match="no user message"):
        build_prompt_text([{"role": "system", "content": "x"}], PromptConfig())
    with pytest.raises(ValueError, match="chat template"):
        build_prompt_text(MESSAGES, PromptConfig(mode=PromptMode.CHAT), tokenizer=None)
