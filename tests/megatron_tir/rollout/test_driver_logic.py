"""Driver logic with a real sandbox cluster and a scripted engine (see scripted_engine.py).

Each test scripts what the "model" writes and checks the trajectory record against what
the TIR protocol says must happen: where turns end, what the model is told, the loss
mask, the void rule, the budgets, and that tool failures are recorded outcomes.
"""

import asyncio
import math
import time

import pytest

from megatron_tir.data import Problem
from megatron_tir.rollout import ClusterSandbox, FinishStatus, RolloutConfig, TIRRollout, collate
from megatron_tir.tir import FEEDBACK_HEADER, PromptConfig, TurnKind

from scripted_engine import SCRIPTED_LOGPROB, ScriptedEngine


FEEDBACK_MARK = FEEDBACK_HEADER + "\n```output"  # the instruction in the prompt also names the header


def per_turn(*turns):
    """A script that writes turns[k] in the k-th model turn."""
    def script(context_text):
        k = context_text.count(FEEDBACK_MARK)
        return turns[min(k, len(turns) - 1)]
    return script


PROBLEM = Problem(index=3, messages=({"role": "user", "content": "What is 6 times 7?"},), ground_truth="42",
                  data_source="unit")


def rollout(tok, sandbox, script, verifier=None, problems=(PROBLEM,), seconds_per_token=0.0, engine_kw=None, **cfg):
    engine = ScriptedEngine(tok, script, seconds_per_token=seconds_per_token, **(engine_kw or {}))
    cfg.setdefault("max_response_tokens", 512)
    driver = TIRRollout(engine, tok, sandbox, RolloutConfig(**cfg), verifier=verifier)
    groups = asyncio.run(driver.run(list(problems)))
    return engine, groups


def test_code_feedback_answer(smollm2_tokenizer, sandbox, verifier):
    tok = smollm2_tokenizer
    turn0 = "Let me compute.\n```python\nx = 6 * 7\nprint(x)\n```\nThis text is never generated."
    turn1 = "The product is \\boxed{42}."
    engine, groups = rollout(tok, sandbox, per_turn(turn0, turn1), verifier)
    (t,) = groups[0].trajectories
    assert t.status is FinishStatus.COMPLETED and not t.void
    assert [x.kind for x in t.turns] == [TurnKind.CODE, TurnKind.ANSWER]
    assert t.final_answer == "42" and t.answer_source == "model" and t.reward == 1.0
    assert t.problem_index == 3 and t.ground_truth == "42"

    code_turn = t.turns[0]
    # The engine stopped exactly at the closing fence; the rest of the script was never sampled.
    assert code_turn.text == "Let me compute.\n```python\nx = 6 * 7\nprint(x)\n```"
    assert code_turn.code == "x = 6 * 7\nprint(x)"
    assert code_turn.requests == 2  # paused on the opening fence, then on the closing one
    assert code_turn.tool.status == "ok" and code_turn.tool.result.stdout == "42\n"
    assert code_turn.tool.feedback == f"\n{FEEDBACK_HEADER}\n```output\n42\n```\n"

    # Exactly the sampled ids, in order, with mask 1 and their log-probs; feedback masked.
    sampled = [i for c in engine.calls for i in c["token_ids"]]
    assert [i for i, m in zip(t.response_ids, t.loss_mask) if m] == sampled
    fb_ids = tok.encode(code_turn.tool.feedback, add_special_tokens=False)
    s, n = code_turn.start, code_turn.model_tokens
    assert t.response_ids[s + n:s + n + len(fb_ids)] == fb_ids
    assert t.loss_mask == [1] * n + [0] * len(fb_ids) + [1] * t.turns[1].model_tokens
    assert all(math.isnan(x) for x in t.response_logprobs[n:n + len(fb_ids)])
    assert all(x == SCRIPTED_LOGPROB for x, m in zip(t.response_logprobs, t.loss_mask) if m)
    assert tok.decode(t.response_ids) == code_turn.text + code_turn.tool.feedback + turn1 + tok.eos_token
    # The second turn's request saw prompt + turn 0 + feedback as its context.
    assert engine.calls[-1]["prompt_len"] == len(t.prompt_ids) + n + len(fb_ids)


def test_final_answer_from_tool_completes(smollm2_tokenizer, sandbox, verifier):
    turn0 = "```python\nfrom math import comb\nfinal_answer(comb(7, 2) * 2)\n```"
    _, groups = rollout(smollm2_tokenizer, sandbox, per_turn(turn0, "unreachable"), verifier)
    (t,) = groups[0].trajectories
    assert t.status is FinishStatus.COMPLETED and len(t.turns) == 1
    assert t.turns[0].tool.result.stdout == "\\boxed{42}\n"
    assert t.final_answer == "42" and t.answer_source == "tool" and t.reward == 1.0


def test_wrong_answer_scores_zero(smollm2_tokenizer, sandbox, verifier):
    _, groups = rollout(smollm2_tokenizer, sandbox, per_turn("It is \\boxed{41}."), verifier)
    (t,) = groups[0].trajectories
    assert t.status is FinishStatus.COMPLETED and t.reward == 0.0 and t.final_answer == "41"


def test_void_partial_code_at_length_limit(smollm2_tokenizer, sandbox, verifier):
    turn0 = "```python\n" + "".join(f"x{i} = {i}\n" for i in range(200))
    _, groups = rollout(smollm2_tokenizer, sandbox, per_turn(turn0), verifier, max_response_tokens=40)
    (t,) = groups[0].trajectories
    assert t.status is FinishStatus.VOID and t.void
    assert t.void_reason == "length cut inside a code block (partial code)"
    assert len(t.response_ids) == 40 and t.loss_mask == [1] * 40 and t.reward == 0.0


def test_void_eos_without_code_or_answer_after_a_code_turn(smollm2_tokenizer, sandbox):
    turn0 = "```python\nprint(1 + 1)\n```"
    _, groups = rollout(smollm2_tokenizer, sandbox, per_turn(turn0, "I am not sure what to do next."))
    (t,) = groups[0].trajectories
    assert [x.kind for x in t.turns] == [TurnKind.CODE, TurnKind.VOID]
    assert t.status is FinishStatus.VOID and t.void_reason == "EOS without code or answer"
    assert t.reward is None  # no verifier given


def test_errors_and_timeouts_are_feedback(smollm2_tokenizer, sandbox):
    turns = ("```python\nprint('start')\n1 / 0\n```", "```python\nwhile True:\n    pass\n```", "Done: \\boxed{0}")
    _, groups = rollout(smollm2_tokenizer, sandbox, per_turn(*turns), tool_timeout_s=1.0)
    (t,) = groups[0].trajectories
    assert t.status is FinishStatus.COMPLETED and len(t.turns) == 3
    err, loop = t.turns[0].tool, t.turns[1].tool
    assert err.status == "error" and "start" in err.feedback and "ZeroDivisionError: division by zero" in err.feedback
    assert loop.status == "timeout" and "TimeoutError: the program did not finish within the 1 s time limit" in loop.feedback


def test_max_turns(smollm2_tokenizer, sandbox):
    _, groups = rollout(smollm2_tokenizer, sandbox, per_turn("```python\nprint(2)\n```"), max_turns=2)
    (t,) = groups[0].trajectories
    assert t.status is FinishStatus.MAX_TURNS and len(t.turns) == 2
    assert all(x.kind is TurnKind.CODE and x.tool.result.stdout == "2\n" for x in t.turns)


def test_feedback_that_does_not_fit_truncates(smollm2_tokenizer, sandbox):
    tok = smollm2_tokenizer
    turn0 = "```python\nprint('ab' * 300)\n```"
    n0 = len(tok.encode(turn0, add_special_tokens=False))
    _, groups = rollout(tok, sandbox, per_turn(turn0, "x"), max_response_tokens=n0 + 20)
    (t,) = groups[0].trajectories
    assert t.status is FinishStatus.TRUNCATED
    assert len(t.response_ids) == n0 and t.turns[0].feedback_tokens == 0 and t.turns[0].tool.feedback == ""


def test_sandbox_infrastructure_failure_is_recorded(smollm2_tokenizer, tmp_path):
    from sandbox_cluster import ClientConfig, SandboxClient

    dead = ClusterSandbox(SandboxClient(f"ipc://{tmp_path}/nobody.sock", ClientConfig(deadline_slack_s=0.5)))
    _, groups = rollout(smollm2_tokenizer, dead, per_turn("```python\nprint(1)\n```"), tool_timeout_s=0.5)
    dead.close()
    (t,) = groups[0].trajectories
    assert t.status is FinishStatus.TOOL_FAILED and not t.void
    assert t.turns[0].tool.status == "sandbox_error" and "no reply" in t.turns[0].tool.result.message


def test_no_per_turn_barrier(smollm2_tokenizer, sandbox):
    """While one trajectory's code runs (3 s), another keeps generating turn after turn."""
    slow = Problem(index=0, messages=({"role": "user", "content": "slow"},), ground_truth="1")
    fast = Problem(index=1, messages=({"role": "user", "content": "fast"},), ground_truth="1")

    def script(ctx):
        k = ctx.count(FEEDBACK_MARK)
        if "slow" in ctx:
            return "```python\nimport time\ntime.sleep(3)\nprint(1)\n```" if k == 0 else "\\boxed{1}"
        return "```python\nprint(1)\n```" if k < 3 else "\\boxed{1}"

    class Timed:  # the sandbox, with when each slow call came back
        def __init__(self) -> None:
            self.slow_returned: list[float] = []

        async def execute(self, code, **kwargs):
            res = await sandbox.execute(code, **kwargs)
            if "time.sleep(3)" in code:
                self.slow_returned.append(time.perf_counter() - t0)
            return res

    done: dict[int, float] = {}
    engine = ScriptedEngine(smollm2_tokenizer, script, seconds_per_token=0.01)
    timed = Timed()
    driver = TIRRollout(engine, smollm2_tokenizer, timed, RolloutConfig(max_turns=5, max_response_tokens=512))
    t0 = time.perf_counter()
    asyncio.run(driver.run([slow, fast], on_done=lambda tr: done.setdefault(tr.group_id, time.perf_counter() - t0)))
    # the fast trajectory (4 turns, 3 tool calls) finished while the slow one was in its sandbox call (by the
    # call's own return: a fixed 1.5 s margin raced a loaded machine's slower sandbox calls)
    (slow_returned,) = timed.slow_returned
    assert done[1] < slow_returned < done[0], (done, slow_returned)
    assert done[0] < 3.0 + 3.0  # the slow one is not delayed by the fast one's turns either


def test_collate_layout(smollm2_tokenizer, sandbox, verifier):
    turn0 = "```python\nprint(6 * 7)\n```"
    _, groups = rollout(smollm2_tokenizer, sandbox, per_turn(turn0, "\\boxed{42}"), verifier, n_samples=2,
                        problems=(PROBLEM, Problem(index=4, messages=({"role": "user", "content": "Another?"},),
                                                   ground_truth="7")))
    batch = collate(groups, pad_id=0)
    assert batch.batch_size == 4
    assert batch.group_index_B.tolist() == [0, 0, 1, 1] and batch.sample_index_B.tolist() == [0, 1, 0, 1]
    assert batch.rewards_B.tolist() == [1.0, 1.0, 0.0, 0.0]
    for b, t in enumerate(t for g in groups for t in g.trajectories):
        p, r = len(t.prompt_ids), len(t.response_ids)
        assert batch.response_start_B[b] == p and batch.lengths_B[b] == p + r
        assert batch.tokens_BT[b, :p + r].tolist() == t.prompt_ids + t.response_ids
        assert batch.tokens_BT[b, p + r:].eq(0).all() and not batch.attention_mask_BT[b, p + r:].any()
        assert batch.loss_mask_BT[b, :p].eq(0).all()
        assert batch.loss_mask_BT[b, p:p + r].tolist() == [float(m) for m in t.loss_mask]
        lp = batch.engine_logprobs_BT[b]
        assert lp[p:p + r][batch.loss_mask_BT[b, p:p + r] > 0].eq(SCRIPTED_LOGPROB).all()
        assert lp[batch.loss_mask_BT[b] == 0].eq(0).all()  # feedback NaNs do not leak
    assert not batch.void_B.any()


def test_rollout_config_validation():
    with pytest.raises(ValueError, match="max_turns"):
        RolloutConfig(max_turns=0)
    with pytest.raises(ValueError, match="tool_memory_mb"):
        RolloutConfig(tool_memory_mb=1)
    with pytest.raises(ValueError, match="response_prefix"):
        PromptConfig(response_prefix="```python\nprint(1)\n```\n")


def test_engine_running_past_the_fence_is_trimmed_to_the_block(smollm2_tokenizer, sandbox, caplog):
    turn0 = "```python\nprint(5)\n```\nand then the engine kept going without stopping"
    engine, groups = rollout(smollm2_tokenizer, sandbox, per_turn(turn0, "\\boxed{5}"),
                             engine_kw={"honor_stops": False})
    (t,) = groups[0].trajectories
    assert t.turns[0].text == "```python\nprint(5)\n```"  # trimmed at the token closing the block
    assert t.turns[0].tool.result.stdout == "5\n" and t.status is FinishStatus.COMPLETED
    assert "past a closing code fence" in caplog.text
    assert t.turns[0].discarded_tokens == len(engine.calls[0]["token_ids"]) - t.turns[0].model_tokens > 0
    # the kept model tokens are a prefix of what the engine returned for that turn
    first = engine.calls[0]["token_ids"]
    assert t.response_ids[:t.turns[0].model_tokens] == first[:t.turns[0].model_tokens]


def test_engine_error_is_a_recorded_abort(smollm2_tokenizer, sandbox):
    turn0 = "```python\nprint(5)\n```"
    _, groups = rollout(smollm2_tokenizer, sandbox, per_turn(turn0, "\\boxed{5}"), engine_kw={"fail_on_call": 2})
    (t,) = groups[0].trajectories
    assert t.status is FinishStatus.ABORTED and not t.void
    assert t.turns[-1].reason == "engine error: RuntimeError: scripted server error"
    assert t.turns[0].tool.result.stdout == "5\n"
