"""The ``simpletir`` preset against strings and rules taken from SimpleTIR's released code.

Sources (github.com/ltzheng/SimpleTIR, commit e7b5b44):
* ``recipe/simpletir/agent_utils.py``: ``truncate_content``, ``AgentHelper.execute_predictions``
  (code pattern, ``final_answer`` prelude, feedback, ``\\boxed{`` ends), ``AgentHelper.run_llm_loop``
  (``final_prompt`` after the second-to-last turn, no feedback after the last one);
* ``recipe/simpletir/config/simpletir_trainer.yaml``: ``data.prompt``;
* ``recipe/simpletir/utils/reward_score/hf_math_verify.py``: ``extract_solution`` (stop words);
* ``recipe/simpletir/utils/reward_score/qwen_math_eval_toolkit/parser.py``: ``extract_answer``.
"""

import subprocess
import sys

import pytest

from megatron_tir.tir import TurnKind
from megatron_tir.tir import simpletir as st
from sandbox_cluster.protocol import ExecResult, Status


def res(stdout="", stderr="", status=Status.OK):
    return ExecResult(id="x", status=status, stdout=stdout, stderr=stderr)


# agent_utils.py, truncate_content: content[: max_length // 2] + note + content[-max_length // 2 :]
def test_truncate_content_head_and_tail():
    text = "".join(chr(ord("a") + i % 26) for i in range(600))
    out = st.truncate_content(text)
    assert out == text[:256] + "\n..._This content has been truncated to stay below 512 characters_...\n" + text[-256:]
    assert st.truncate_content(text[:512]) == text[:512]


# agent_utils.py, execute_predictions: obs = f"\nCode execution result: {truncated_stdout}\n"
def test_feedback_stdout_is_not_stripped():
    assert st.format_feedback(res("42\n"), turn_index=0, max_turns=5) == "\nCode execution result: 42\n\n"
    long = "z" * 1000
    fb = st.format_feedback(res(long), turn_index=0, max_turns=5)
    assert fb == "\nCode execution result: " + st.truncate_content(long) + "\n" and fb.count("z") == 512


# execute_predictions: any stderr -> "\n".join(stderr_lines[-self.error_n_line:]) with error_n_line = 1
def test_feedback_any_stderr_replaces_stdout_with_its_last_line():
    tb = 'Traceback (most recent call last):\n  File "<x>", line 5\nNameError: name \'y\' is not defined\n'
    fb = st.format_feedback(res("partial\n", tb, Status.ERROR), turn_index=0, max_turns=5)
    assert fb == "\nCode execution result: NameError: name 'y' is not defined\n"
    fb = st.format_feedback(res("7\n", "DeprecationWarning: old\n"), turn_index=0, max_turns=5)
    assert fb == "\nCode execution result: DeprecationWarning: old\n"


def test_feedback_empty_output_is_nothing():
    assert st.format_feedback(res(), turn_index=0, max_turns=5) == ""
    assert st.format_feedback(res(status=Status.TIMEOUT), turn_index=1, max_turns=5) == ""


# run_llm_loop: `if step == max_turns - 2: next_obs[i] += self.prompt_dict["final_prompt"]` ("\n"),
# and at step == max_turns - 1 the observation is not appended.
def test_feedback_around_the_last_turns():
    assert st.format_feedback(res("1\n"), turn_index=3, max_turns=5) == "\nCode execution result: 1\n\n\n"
    assert st.format_feedback(res(), turn_index=3, max_turns=5) == ""
    assert st.format_feedback(res("1\n"), turn_index=4, max_turns=5) == ""


# execute_predictions: the prelude string, then the stripped code
def test_prelude_is_simpletirs_four_lines():
    assert st.FINAL_ANSWER_PRELUDE == '\ndef final_answer(result):\n    print(f"\\\\boxed{{{result}}}")\n\n'
    assert st.FINAL_ANSWER_PRELUDE.count("\n") == 4
    program = st.program_for(st.extract_code("```py\n  \nx = 2 * 21\nfinal_answer(x)\n\n```"))
    r = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert r.stdout == "\\boxed{42}\n"


# execute_predictions: pattern = r"```(?:py|python)?\n(.*?)\n```" (DOTALL), match.group(1).strip()
@pytest.mark.parametrize(("text", "code"), [
    ("a\n```python\nprint(1)\n```", "print(1)"),
    ("mid-line ```py\n  x = 1\n```", "x = 1"),
    ("```\nprint(2)\n```", "print(2)"),
    ("```python3\nprint(3)\n```", None),  # "python3" is not in the pattern
    ("```python\n```", None),  # the pattern needs a line between the fences
    # the output block's closing fence and the next line start a bare block for this pattern
    ("```output\n5\n```\n```python\nprint(5)\n```", "```python\nprint(5)"),
])
def test_code_pattern(text, code):
    assert st.extract_code(text) == code


def test_turn_kinds():
    c = st.classify_turn("```python\nprint(1)\n```", "stop")
    assert c.kind is TurnKind.CODE and c.code == "print(1)" and not c.final
    c = st.classify_turn("So \\boxed{3}\n```python\nprint(3)\n```", "stop")
    assert c.kind is TurnKind.CODE and c.final
    c = st.classify_turn("\\boxed{", "length")  # "\\boxed{" in prediction: done, not void
    assert c.kind is TurnKind.ANSWER and c.final
    assert st.classify_turn("```python3\nx\n```", "eos").kind is TurnKind.VOID
    assert st.classify_turn("thinking", "abort").kind is TurnKind.ABORTED
    assert st.classify_turn("```python\nprint(1)\n```", "eos", tools=False).kind is TurnKind.VOID


# parser.py, extract_answer(pred_str, "math"): each branch in its order
@pytest.mark.parametrize(("response", "answer"), [
    ("so \\boxed{\\frac{1}{2}} and later \\boxed{7}.", "7"),
    ("the final answer is $\\frac{3}{4}$. I hope it is correct.", "\\frac{3}{4}"),
    ("It is $\\boxed 12$ then", "12"),  # "boxed" not followed by a brace: up to the next $
    ("\\boxed{5 and then the text ran out", "5 and then the text ran out"),  # unbalanced: to the end
    ("Code execution result: \\boxed{8}\n", "8"),  # tool output counts
    ("The answer is 17.", "17"),
    ("So the final answer is: 23", "23"),  # "he answer is" absent; "final answer is" + leading ":"
    ("we get 1,234 and then -3.5 apples", "-3.5"),
    ("no numbers at all", ""),
    ("\\boxed{3}<|im_end|>\\boxed{4}", "3"),  # extract_solution cuts at the first stop word
    ("The answer is\n  41/", "41"),  # newlines+spaces removed, a trailing "/" dropped
])
def test_extract_answer(response, answer):
    assert st.extract_answer(response) == answer


def test_tool_answer_needs_the_mark():
    assert st.tool_answer("\\boxed{42}\n") == "42"
    assert st.tool_answer("42\n") is None


# simpletir_trainer.yaml data.prompt, prepended to the message content (rl_dataset.py, tool_use)
def test_prompt_text():
    assert st.PROMPT.startswith("Solve the following problem step by step. You now have the ability to selectively")
    assert st.PROMPT.endswith("\\boxed{'The final answer goes here.'}\n\nUser Question:\n")
    assert "```py\nanswer = 5 + 3 + 1294.678\nfinal_answer(answer)\n```" in st.PROMPT
    msgs = [{"role": "user", "content": "What is 6*7?"}]
    # no chat template: the first message's content (apply_chat_template=False)
    assert st.build_prompt_text(msgs, tokenizer=None) == st.PROMPT + "What is 6*7?"
    assert st.build_prompt_text(msgs, tokenizer=None, tools=False) == "What is 6*7?"


def test_prompt_uses_the_chat_template(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    msgs = [{"role": "user", "content": "What is 6*7?"}]
    ids = st.build_prompt_ids(msgs, tok)
    expected = tok.apply_chat_template([{"role": "user", "content": st.PROMPT + "What is 6*7?"}],
                                       add_generation_prompt=True, tokenize=False)
    assert tok.decode(ids) == expected and ids == tok.encode(expected, add_special_tokens=False)
