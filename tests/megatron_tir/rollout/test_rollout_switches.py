"""The rollout switches (void_turn, tools, protocol) and the turn rules shared by both protocols.

A scripted engine writes the turns, a real sandbox cluster runs the code, a real
math-verify pool scores the answers.
"""

import asyncio

import pytest

from megatron_tir.data import Problem
from megatron_tir.rollout import FinishStatus, RolloutConfig, TIRRollout, collate
from megatron_tir.tir import FEEDBACK_HEADER, FeedbackConfig, PromptConfig, TurnKind

from scripted_engine import ScriptedEngine

PROBLEM = Problem(index=0, messages=({"role": "user", "content": "What is 6 times 7?"},), ground_truth="42",
                  data_source="unit")


def by_turn(marker, *turns):
    """A script writing turns[k] when the context holds k copies of ``marker``."""
    def script(ctx):
        return turns[min(ctx.count(marker), len(turns) - 1)]
    return script


def run(tok, sandbox, script, verifier=None, **cfg):
    engine = ScriptedEngine(tok, script)
    cfg.setdefault("max_response_tokens", 512)
    groups = asyncio.run(TIRRollout(engine, tok, sandbox, RolloutConfig(**cfg), verifier=verifier).run([PROBLEM]))
    (t,) = groups[0].trajectories
    return engine, groups, t


# --------------------------------------------------------------------------- void_turn


def test_void_turn_stop_ends_the_trajectory(smollm2_tokenizer, sandbox, verifier):
    tok = smollm2_tokenizer
    _, _, t = run(tok, sandbox, by_turn(tok.eos_token, "Hmm.", "\\boxed{42}"), verifier, void_turn="stop")
    assert t.status is FinishStatus.VOID and [x.kind for x in t.turns] == [TurnKind.VOID]
    assert t.status is FinishStatus.VOID and t.has_void_turn and t.reward == 0.0


def test_void_turn_continue_goes_on_without_feedback(smollm2_tokenizer, sandbox, verifier):
    tok = smollm2_tokenizer
    engine, groups, t = run(tok, sandbox, by_turn(tok.eos_token, "Hmm.", "So it is \\boxed{42}."), verifier,
                            void_turn="continue")
    assert [x.kind for x in t.turns] == [TurnKind.VOID, TurnKind.ANSWER]
    assert t.status is FinishStatus.COMPLETED and not t.void and t.has_void_turn
    assert t.reward == 1.0 and t.final_answer == "42"
    assert t.turns[0].feedback_tokens == 0 and t.turns[0].tool is None
    # nothing between the turns: the second request's context is prompt + the void turn's tokens
    assert t.loss_mask == [1] * len(t.response_ids)
    assert engine.calls[1]["prompt_len"] == len(t.prompt_ids) + t.turns[0].model_tokens
    assert tok.decode(t.response_ids) == "Hmm." + tok.eos_token + "So it is \\boxed{42}." + tok.eos_token
    assert collate(groups, pad_id=0).void_B.tolist() == [False]


def test_void_turn_continue_counts_turns(smollm2_tokenizer, sandbox):
    tok = smollm2_tokenizer
    _, _, t = run(tok, sandbox, lambda ctx: "Hmm.", void_turn="continue", max_turns=3)
    assert [x.kind for x in t.turns] == [TurnKind.VOID] * 3 and t.status is FinishStatus.MAX_TURNS


def test_void_turn_mode_is_checked():
    with pytest.raises(ValueError, match="void_turn must be one of"):
        RolloutConfig(void_turn="skip")


# ------------------------------------------------------------------------------- tools


def test_text_only_is_one_turn_without_code_stops_or_execution(smollm2_tokenizer, verifier):
    tok = smollm2_tokenizer
    text = "Compute:\n```python\nprint(6 * 7)\n```\nIt prints 42, so \\boxed{42}."
    engine, _, t = run(tok, None, lambda ctx: text, verifier, tools=False, max_turns=5)
    assert len(engine.calls) == 1 and engine.calls[0]["stop"] == ()
    assert [x.kind for x in t.turns] == [TurnKind.ANSWER] and t.turns[0].tool is None
    assert t.status is FinishStatus.COMPLETED and t.reward == 1.0
    assert t.turns[0].text == text + tok.eos_token


def test_text_only_without_answer_is_a_wrong_answer_in_the_loss_under_every_mode(smollm2_tokenizer, verifier):
    """With no tool to call there is no void turn: the trajectory is completed with reward 0 and
    every Table-2 mode trains on it (before: status void, dropped from the loss by simpletir)."""
    from megatron_tir.rl import MODES, row_weights

    _, groups, t = run(smollm2_tokenizer, None, lambda ctx: "```python\nprint(1)\n```", verifier, tools=False)
    assert t.status is FinishStatus.COMPLETED and not t.void and t.reward == 0.0
    rb = collate(groups, pad_id=0)
    for name, spec in MODES.items():
        _, loss_B = row_weights(void_B=rb.void_B, infra_B=rb.void_B & False, truncated_B=rb.void_B & False,
                                drop_void=spec.drop_void, overlong="mask")
        assert loss_B.tolist() == [True], name


def test_text_only_prompt_has_no_tool_instruction(smollm2_tokenizer):
    from megatron_tir.tir import build_prompt_text

    text = build_prompt_text(PROBLEM.messages, PromptConfig(), tools=False)
    assert "```python" not in text and "\\boxed{answer}" in text
    assert "```python" in build_prompt_text(PROBLEM.messages, PromptConfig(), tools=True)


def test_tools_need_a_sandbox(smollm2_tokenizer):
    with pytest.raises(ValueError, match="needs a sandbox"):
        TIRRollout(ScriptedEngine(smollm2_tokenizer, lambda c: ""), smollm2_tokenizer, None, RolloutConfig())


# ------------------------------------------------------- turn rules (default protocol)


def test_code_and_boxed_in_one_turn_runs_the_code_then_ends(smollm2_tokenizer, sandbox, verifier):
    tok = smollm2_tokenizer
    turn0 = "I think it is \\boxed{42}. Check:\n```python\nprint(6 * 7)\n```"
    engine, _, t = run(tok, sandbox, by_turn(FEEDBACK_HEADER + "\n```output", turn0, "never"), verifier)
    assert [x.kind for x in t.turns] == [TurnKind.CODE] and t.turns[0].answer == "42"
    assert t.turns[0].tool.result.stdout == "42\n" and t.turns[0].feedback_tokens > 0
    assert t.status is FinishStatus.COMPLETED and t.final_answer == "42" and t.reward == 1.0
    assert all("never" not in tok.decode(c["token_ids"]) for c in engine.calls)


def test_stderr_of_a_successful_run_is_shown_after_stdout(smollm2_tokenizer, sandbox):
    turn0 = "```python\nimport sys\nprint(7)\nprint('warn 1', file=sys.stderr)\nprint('warn 2', file=sys.stderr)\n```"
    _, _, t = run(smollm2_tokenizer, sandbox, by_turn(FEEDBACK_HEADER + "\n```output", turn0, "\\boxed{7}"),
                  feedback=FeedbackConfig(stderr_lines=1))
    assert t.turns[0].tool.status == "ok"
    assert t.turns[0].tool.feedback == f"\n{FEEDBACK_HEADER}\n```output\n7\nwarn 2\n```\n"


# ------------------------------------------------------------------ simpletir protocol

SIMPLETIR_MARK = "\nCode execution result: "


def test_simpletir_prompt_feedback_and_answer_end_to_end(smollm2_tokenizer, sandbox, verifier):
    from megatron_tir.tir.simpletir import PROMPT

    tok = smollm2_tokenizer
    turn0 = "Let me compute.\n```python\nx = 6 * 7\nprint(x)\n```"
    turn1 = "The answer is \\boxed{42}."
    engine, _, t = run(tok, sandbox, by_turn(SIMPLETIR_MARK, turn0, turn1), verifier, protocol="simpletir")
    prompt = tok.decode(t.prompt_ids)
    # the instruction is in the user message, under the tokenizer's chat template
    assert f"<|im_start|>user\n{PROMPT}What is 6 times 7?<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    assert [x.kind for x in t.turns] == [TurnKind.CODE, TurnKind.ANSWER]
    # agent_utils.py, AgentHelper.execute_predictions: f"\nCode execution result: {truncated_stdout}\n"
    assert t.turns[0].tool.feedback == "\nCode execution result: 42\n\n"
    # the 4-line prelude precedes the (stripped) code: a traceback line number is off by 4
    assert t.status is FinishStatus.COMPLETED and t.final_answer == "42" and t.answer_source == "response"
    assert t.reward == 1.0


def test_simpletir_stderr_replaces_feedback_with_its_last_line(smollm2_tokenizer, sandbox):
    turn0 = "```python\nimport sys\nprint('out')\nprint('w1\\nw2', file=sys.stderr)\n```"
    _, _, t = run(smollm2_tokenizer, sandbox, by_turn(SIMPLETIR_MARK, turn0, "\\boxed{1}"), protocol="simpletir")
    assert t.turns[0].tool.feedback == "\nCode execution result: w2\n"
    turn0 = "```python\n1/0\n```"
    _, _, t = run(smollm2_tokenizer, sandbox, by_turn(SIMPLETIR_MARK, turn0, "\\boxed{1}"), protocol="simpletir")
    assert t.turns[0].tool.feedback == "\nCode execution result: ZeroDivisionError: division by zero\n"


def test_simpletir_traceback_lines_are_offset_by_the_four_line_prelude(smollm2_tokenizer, sandbox):
    turn0 = "```python\nx = 1\nraise ValueError('boom')\n```"
    _, _, t = run(smollm2_tokenizer, sandbox, by_turn(SIMPLETIR_MARK, turn0, "\\boxed{1}"), protocol="simpletir")
    assert 'line 6, in <module>' in t.turns[0].tool.result.stderr  # model's line 2 + 4 prelude lines


def test_simpletir_empty_output_appends_nothing(smollm2_tokenizer, sandbox):
    tok = smollm2_tokenizer
    turn0 = "```python\nx = 1\n```"

    def script(ctx):  # no feedback marker to count: count the closing fences instead
        return turn0 if ctx.count("x = 1\n```") == 0 else "\\boxed{1}"

    _, _, t = run(tok, sandbox, script, protocol="simpletir")
    assert t.turns[0].tool.status == "ok" and t.turns[0].tool.feedback == "" and t.turns[0].feedback_tokens == 0
    assert [x.kind for x in t.turns] == [TurnKind.CODE, TurnKind.ANSWER]


def test_simpletir_tool_boxed_ends_and_last_turn_output_is_not_appended(smollm2_tokenizer, sandbox, verifier):
    tok = smollm2_tokenizer
    _, _, t = run(tok, sandbox, lambda ctx: "```python\nfinal_answer(6 * 7)\n```", verifier, protocol="simpletir")
    assert t.status is FinishStatus.COMPLETED and len(t.turns) == 1
    assert t.turns[0].tool.feedback == "\nCode execution result: \\boxed{42}\n\n" and t.reward == 1.0
    # max_turns=2: after turn 0 (the second-to-last) the feedback gets final_prompt "\n";
    # the last turn's code runs but nothing is appended, so its printout is not scored.
    turns = ("```python\nprint(5)\n```", "```python\nfinal_answer(6 * 7)\n```")
    _, _, t = run(tok, sandbox, by_turn(SIMPLETIR_MARK, *turns), verifier, protocol="simpletir", max_turns=2)
    assert t.turns[0].tool.feedback == "\nCode execution result: 5\n\n\n"
    assert t.turns[1].tool.result.stdout == "\\boxed{42}\n" and t.turns[1].tool.feedback == ""
    # no boxed in the response: the reward reads its last number, the 7 of the code
    assert t.status is FinishStatus.COMPLETED and t.final_answer == "7" and t.reward == 0.0


def test_simpletir_partial_boxed_ends_the_trajectory(smollm2_tokenizer, sandbox):
    # agent_utils.py, execute_predictions: `if "\\boxed{" in prediction: dones[i] = 1`
    _, _, t = run(smollm2_tokenizer, sandbox, lambda ctx: "So \\boxed{4", protocol="simpletir")
    assert [x.kind for x in t.turns] == [TurnKind.ANSWER] and t.status is FinishStatus.COMPLETED
    assert t.final_answer == "4"


def test_simpletir_rejects_default_only_settings():
    with pytest.raises(ValueError, match="rollout.prompt settings apply to protocol 'default' only"):
        RolloutConfig(protocol="simpletir", prompt=PromptConfig(mode="chat"))
    with pytest.raises(ValueError, match="protocol must be one of"):
        RolloutConfig(protocol="verl")


def test_simpletir_text_only_prompt_is_the_bare_problem(smollm2_tokenizer, sandbox):
    engine, _, t = run(smollm2_tokenizer, None, lambda ctx: "\\boxed{42}", protocol="simpletir", tools=False)
    assert "Code execution result" not in smollm2_tokenizer.decode(t.prompt_ids)
    assert engine.calls[0]["stop"] == () and t.status is FinishStatus.COMPLETED


def test_default_stop_strings_are_used_with_tools(smollm2_tokenizer, sandbox):
    engine, _, _ = run(smollm2_tokenizer, sandbox, lambda ctx: "\\boxed{42}")
    assert engine.calls[0]["stop"] == ("```",)


def test_turn_token_cap_bounds_each_request(smollm2_tokenizer, sandbox):
    """SimpleTIR's release caps each turn (8000) below the whole response (16000)."""
    tok = smollm2_tokenizer
    engine, _, t = run(tok, sandbox, by_turn("Code Execution Result", "```python\nprint(6 * 7)\n```",
                                             "It is 42, so the answer is very long indeed " * 5),
                       max_turn_tokens=12, max_response_tokens=512, max_turns=3)
    assert engine.calls and all(c["max_new_tokens"] <= 12 for c in engine.calls if "max_new_tokens" in c)
    assert t.turns[-1].model_tokens == 12 and t.turns[-1].kind is TurnKind.VOID  # cut by its cap mid-prose
    with pytest.raises(ValueError, match="max_turn_tokens"):
        RolloutConfig(max_turn_tokens=0)
