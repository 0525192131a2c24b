"""The released SimpleTIR code's protocol (``RolloutConfig.protocol="simpletir"``).

Reproduces, from github.com/ltzheng/SimpleTIR (``recipe/simpletir``), what a rollout
sees and how it is scored, so that curves can be compared with the published ones:

* **prompt** (``config/simpletir_trainer.yaml``, ``data.prompt``; ``train.sh`` sets
  ``APPLY_CHAT_TEMPLATE=True``): :data:`PROMPT` is prepended to the content of every
  message of the problem, then the tokenizer's chat template is applied with the
  generation prompt (a tokenizer without a template gets the first message's content, as
  with ``apply_chat_template=False``); ids are encoded without special tokens.
* **code** (``agent_utils.py``, ``AgentHelper.execute_predictions``): the first match of
  :data:`CODE_PATTERN` anywhere in the turn, stripped; the program is
  :data:`FINAL_ANSWER_PRELUDE` (4 lines) + the code.
* **turn end** (same function): ``\\boxed{`` anywhere in the turn's text ends the
  trajectory (after the turn's code, if any, has run); no code and no ``\\boxed{`` is a
  void turn; ``\\boxed{`` anywhere in the tool's stdout ends the trajectory.
* **feedback** (same function): ``"\\nCode execution result: " + stdout + "\\n"`` with
  :func:`truncate_content` at 512 characters (head and tail halves); any stderr replaces
  it with its last line; no output at all appends nothing. ``run_llm_loop`` adds
  ``"\\n"`` (its ``final_prompt``) to non-empty feedback after the second-to-last turn and
  appends no feedback after the last turn.
* **answer** (``utils/reward_score/hf_math_verify.py``, ``extract_solution`` ->
  ``qwen_math_eval_toolkit/parser.py``, ``extract_answer``): over the whole decoded
  response (model text and tool output), cut at the first stop word: the text after the
  last ``boxed`` (brace-balanced), else after the last "he answer is" / "final answer
  is", else the last number. The verifier then checks ``\\boxed{answer}``.

The code here is written for this project; only the strings and rules are SimpleTIR's.
Where this project departs on purpose (exact sampled tokens are kept instead of a
decode/re-tokenize round trip; an infrastructure failure ends the trajectory instead of
reading as empty output; ``strip_string``'s normalisation is left to math-verify) is
listed in docs/protocol.md (the "simpletir departures from SimpleTIR" row).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from megatron_tir.tir.feedback import ProgramRun, run_status
from megatron_tir.tir.markup import TurnClass, TurnKind

PROMPT = (
    "Solve the following problem step by step. You now have the ability to selectively write executable Python "
    "code to enhance your reasoning process. The Python code will be executed by an external sandbox, and the "
    'output (after "Code execution result: ") is returned to aid your reasoning and help you arrive at the final '
    "answer. The Python code should be complete scripts, including necessary imports.\n\n"
    "Code Format:\n"
    "Each code snippet is wrapped between ```. You need to use `print()` to output intermediate results.\n\n"
    "Answer Format:\n"
    "You can use the `final_answer()` function in the code to return your final answer. For example, to answer "
    "the User Question: What is the result of the 5 + 3 + 1294.678?, you can write:\n"
    "```py\nanswer = 5 + 3 + 1294.678\nfinal_answer(answer)\n```\n\n"
    "You can also use \\boxed to return your answer. The last part of your response should be:\n"
    "\\boxed{'The final answer goes here.'}\n\n"
    "User Question:\n"
)

CODE_PATTERN = re.compile(r"```(?:py|python)?\n(.*?)\n```", re.DOTALL)
FINAL_ANSWER_PRELUDE = '\ndef final_answer(result):\n    print(f"\\\\boxed{{{result}}}")\n\n'
ANSWER_MARK = "\\boxed{"
FEEDBACK_PREFIX = "\nCode execution result: "
MAX_FEEDBACK_CHARS = 512
STDERR_LINES = 1
FINAL_PROMPT = "\n"  # added to non-empty feedback after the second-to-last turn
STOP_WORDS = ("</s>", "<|im_end|>", "<|endoftext|>", "[END]")
_NUMBER = re.compile(r"-?\d*\.?\d+")


def truncate_content(content: str, max_length: int = MAX_FEEDBACK_CHARS) -> str:
    """Head and tail halves around SimpleTIR's truncation note."""
    if len(content) <= max_length:
        return content
    half = max_length // 2
    return (content[:half] + f"\n..._This content has been truncated to stay below {max_length} characters_...\n"
            + content[-half:])


def build_prompt_text(messages: Sequence[dict], tokenizer, *, tools: bool = True) -> str:
    """The prompt text: :data:`PROMPT` before every message's content (only when tools are on)."""
    chat = [{**m, "content": (PROMPT if tools else "") + str(m.get("content", ""))} for m in messages]
    if not chat:
        raise ValueError("prompt has no messages")
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return chat[0]["content"]


def build_prompt_ids(messages: Sequence[dict], tokenizer, *, tools: bool = True) -> list[int]:
    return list(tokenizer.encode(build_prompt_text(messages, tokenizer, tools=tools), add_special_tokens=False))


def extract_code(text: str) -> str | None:
    m = CODE_PATTERN.search(text)
    return None if m is None else m.group(1).strip()


def classify_turn(text: str, finish_reason=None, *, tools: bool = True) -> TurnClass:
    """SimpleTIR's reading of a turn: code (first pattern match), ``\\boxed{`` anywhere, or void."""
    final = ANSWER_MARK in text
    code = extract_code(text) if tools else None
    fr = getattr(finish_reason, "value", finish_reason)
    if code is not None:
        m = CODE_PATTERN.search(text)
        return TurnClass(kind=TurnKind.CODE, code=code, lang="", code_end=m.end(), final=final,
                         reason="code block" + (" and \\boxed{ (the trajectory ends after it runs)" if final else ""))
    if final:
        return TurnClass(kind=TurnKind.ANSWER, reason="\\boxed{ in the turn", final=True)
    if fr == "abort":
        return TurnClass(kind=TurnKind.ABORTED, reason="aborted by the engine")
    return TurnClass(kind=TurnKind.VOID, reason="neither a code block nor \\boxed{" + (f" ({fr})" if fr else ""))


def program_for(code: str) -> str:
    return FINAL_ANSWER_PRELUDE + code


def format_feedback(result: ProgramRun, *, turn_index: int, max_turns: int) -> str:
    """The observation SimpleTIR appends after a code turn ("" appends nothing)."""
    run_status(result)  # a program outcome, not an infrastructure failure
    if turn_index >= max_turns - 1:
        return ""  # the last turn's code runs, its output is not appended
    obs = ""
    if result.stdout:
        obs = f"{FEEDBACK_PREFIX}{truncate_content(result.stdout)}\n"
    if result.stderr:
        last = "\n".join(result.stderr.splitlines()[-STDERR_LINES:])
        obs = f"{FEEDBACK_PREFIX}{truncate_content(last)}\n"
    if obs and turn_index == max_turns - 2:
        obs += FINAL_PROMPT
    return obs


def tool_answer(stdout: str) -> str | None:
    """``\\boxed{`` in the tool's output ends the trajectory; the answer it names."""
    return extract_answer(stdout) if ANSWER_MARK in stdout else None


def _balanced_after(text: str) -> str:
    """The content of the brace group ``text`` opens (to the end of the text if unbalanced)."""
    depth, out = 1, []
    for ch in text[1:]:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                break
        out.append(ch)
    return "".join(out)


def extract_answer(response: str) -> str:
    """The answer SimpleTIR's reward reads from a whole response ("" when none)."""
    for word in STOP_WORDS:
        if word in response:
            response = response.split(word)[0].strip()
    text = response.replace("\u043a\u0438", "")
    if "final answer is $" in text and "$. I hope" in text:
        pred = text.split("final answer is $", 1)[1].split("$. I hope", 1)[0].strip()
    elif "boxed" in text:
        tail = text.rsplit("boxed", 1)[1]
        if not tail:
            return ""
        pred = _balanced_after(tail) if tail[0] == "{" else tail.split("$")[0].strip()
    elif "he answer is" in text:
        pred = text.rsplit("he answer is", 1)[1].strip()
    elif "final answer is" in text:
        pred = text.rsplit("final answer is", 1)[1].strip()
    elif "答案是" in text:
        pred = text.split("答案是")[1].strip().split("\n\n")[0].strip()
    else:
        numbers = _NUMBER.findall(text.replace(",", ""))
        pred = numbers[-1] if numbers else ""
    pred = re.sub(r"\n\s*", "", pred)
    if pred.startswith(":"):
        pred = pred[1:]
    if pred.endswith("."):
        pred = pred[:-1]
    if pred.endswith("/"):
        pred = pred[:-1]
    return pred.strip()
