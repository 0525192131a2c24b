"""Real rollouts: the local torch engine (tiny random Llama, SmolLM2-135M) and a real sandbox cluster."""

import asyncio
import math

import pytest

from megatron_tir.data import Problem
from megatron_tir.reward import MathVerifier
from megatron_tir.rollout import ClusterSandbox, FinishStatus, RolloutConfig, TIRRollout, collate, flatten
from megatron_tir.rollout.engines.local import LocalEngine, LocalEngineConfig
from megatron_tir.rollout.instrument import InstrumentedEngine
from megatron_tir.tir import FEEDBACK_HEADER, PromptConfig, TurnKind

PROBLEMS = [
    Problem(index=0, messages=({"role": "user", "content": "What is 6 times 7?"},), ground_truth="42"),
    Problem(index=1, messages=({"role": "user", "content": "What is 2 + 2?"},), ground_truth="4"),
]


def assert_exactly_sampled(traj, calls):
    """The trajectory's model tokens are, in order, the outputs of engine requests whose
    prompts were exactly the prompt + response so far; feedback tokens sit between them."""
    full = traj.prompt_ids + traj.response_ids
    p = len(traj.prompt_ids)
    k = 0
    used = 0
    while k < len(traj.response_ids):
        if traj.loss_mask[k] == 0:
            k += 1
            continue
        matches = [c for c in calls if list(c.prompt_ids) == full[:p + k] and c.token_ids
                   and list(c.token_ids) == traj.response_ids[k:k + len(c.token_ids)]]
        assert len(matches) >= 1, f"no engine request produced the tokens at response offset {k}"
        # Two samples of one prompt may sample the same tokens with log-probs a rounding apart
        # (one prefilled afresh, one reusing cached K/V): the trajectory's are exactly one call's.
        exact = [c for c in matches if traj.response_logprobs[k:k + len(c.token_ids)] == list(c.logprobs)]
        assert exact, f"no request with these tokens has the trajectory's log-probs at response offset {k}"
        n = len(exact[0].token_ids)
        assert traj.loss_mask[k:k + n] == [1] * n
        k += n
        used += 1
    assert used == traj.engine_requests


async def _run(engine, tokenizer, sandbox, config, problems, verifier=None):
    inst = InstrumentedEngine(engine)
    groups = await TIRRollout(inst, tokenizer, sandbox, config, verifier=verifier).run(problems)
    await engine.close()
    return inst, groups


@pytest.fixture(scope="module")
def tiny_dir(make_tiny_hf):
    return make_tiny_hf("llama")


def test_tiny_model_rollout_is_exact_and_void_rule_applies(tiny_dir, sandbox_cluster):
    engine = LocalEngine(LocalEngineConfig(model=str(tiny_dir), max_batch_size=4, seed=0))
    sandbox = ClusterSandbox.connect(sandbox_cluster.address)
    cfg = RolloutConfig(n_samples=2, max_turns=3, max_response_tokens=24, seed=1)
    with MathVerifier() as v:
        inst, groups = asyncio.run(_run(engine, engine.tokenizer, sandbox, cfg, PROBLEMS, v))
    sandbox.close()
    trajs = flatten(groups)
    assert [(t.group_id, t.sample_index) for t in trajs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert inst.generated_tokens == sum(t.num_model_tokens for t in trajs)  # nothing sampled is dropped
    for t in trajs:
        assert_exactly_sampled(t, inst.calls)
        assert all(math.isfinite(x) and x <= 0 for x in t.response_logprobs)
        # A random model writes neither code nor \boxed{}: the turn is void and the trajectory stops.
        assert t.status is FinishStatus.VOID and len(t.turns) == 1 and t.turns[0].kind is TurnKind.VOID
        assert t.void_reason in ("length cut without code or answer", "EOS without code or answer")
        assert (len(t.response_ids) == 24) == (t.void_reason.startswith("length"))
        assert t.reward == 0.0
    batch = collate(groups, pad_id=engine.tokenizer.pad_token_id or 0)
    assert batch.void_B.all()
    # different samples of one prompt differ (per-request seeds)
    assert trajs[0].response_ids != trajs[1].response_ids


def test_tiny_model_partial_code_from_an_opened_block_is_void(tiny_dir, sandbox_cluster):
    engine = LocalEngine(LocalEngineConfig(model=str(tiny_dir), max_batch_size=2, seed=0))
    sandbox = ClusterSandbox.connect(sandbox_cluster.address)
    cfg = RolloutConfig(max_turns=2, max_response_tokens=16, seed=3,
                        prompt=PromptConfig(response_prefix="```python\nx = "))
    inst, groups = asyncio.run(_run(engine, engine.tokenizer, sandbox, cfg, PROBLEMS[:1]))
    sandbox.close()
    (t,) = flatten(groups)
    assert t.status is FinishStatus.VOID
    assert t.void_reason == "length cut inside a code block (partial code)"
    # inside a block, mid-line, the engine was asked to pause only on a line-start fence
    assert inst.calls[0].params.stop[0] == "\n```"
    assert_exactly_sampled(t, inst.calls)


@pytest.mark.slow
def test_smollm2_writes_and_runs_code(smollm2_dir, sandbox_cluster):
    """SmolLM2-135M-Instruct in chat mode, asked for Python code, writes ```python blocks:
    they run in the sandbox and their output comes back as masked feedback tokens."""
    engine = LocalEngine(LocalEngineConfig(model=str(smollm2_dir), max_batch_size=4, seed=0))
    sandbox = ClusterSandbox.connect(sandbox_cluster.address)
    prompt = PromptConfig(mode="chat", instruction=(
        "You are a Python programmer. Answer with a ```python code block that prints the result."))
    problem = Problem(index=0, messages=({"role": "user", "content": "Write Python code that prints 6*7."},),
                      ground_truth="42")
    cfg = RolloutConfig(n_samples=2, max_turns=2, max_response_tokens=150, temperature=0.7, seed=0, prompt=prompt)
    inst, groups = asyncio.run(_run(engine, engine.tokenizer, sandbox, cfg, [problem]))
    sandbox.close()
    trajs = flatten(groups)
    executed = [(t, turn) for t in trajs for turn in t.turns if turn.tool is not None]
    assert executed, [turn.text for t in trajs for turn in t.turns]
    for t in trajs:
        assert_exactly_sampled(t, inst.calls)
    t, turn = executed[0]
    assert turn.kind is TurnKind.CODE and turn.text.rstrip().endswith("```")
    assert turn.tool.status in ("ok", "error", "timeout")
    assert turn.tool.feedback.startswith(("\n" + FEEDBACK_HEADER, FEEDBACK_HEADER))
    fb = slice(turn.start + turn.model_tokens, turn.start + turn.model_tokens + turn.feedback_tokens)
    assert turn.feedback_tokens > 0 and t.loss_mask[fb] == [0] * turn.feedback_tokens
    assert engine.tokenizer.decode(t.response_ids[fb]) == turn.tool.feedback
    if len(t.turns) > 1:  # the model continued after reading the feedback
        assert t.loss_mask[fb.stop] == 1
    assert inst.generated_tokens == sum(x.num_model_tokens for x in trajs)


def test_a_prompt_longer_than_the_engines_context_is_a_data_error_not_infrastructure(tiny_dir, sandbox_cluster,
                                                                                   caplog):
    from megatron_tir.rollout.trajectory import INFRA_STATUSES
    from megatron_tir.train.metrics import rollout_metrics

    long = Problem(index=7, messages=({"role": "user", "content": "What is 2 + 2? " * 40},), ground_truth="4",
                   data_source="unit")
    problems = [PROBLEMS[0], long]
    cfg = RolloutConfig(n_samples=2, max_turns=2, max_response_tokens=8, seed=1)
    tokenizer = LocalEngine(LocalEngineConfig(model=str(tiny_dir))).tokenizer
    lengths = [len(cfg.make_protocol().prompt_ids(p.messages, tokenizer)) for p in problems]
    assert lengths[0] + 40 < lengths[1]
    # the real engine's own limit: the short prompt and its response fit, the long prompt does not
    engine = LocalEngine(LocalEngineConfig(model=str(tiny_dir), max_batch_size=4, seed=0, max_seq_len=lengths[0] + 20))
    sandbox = ClusterSandbox.connect(sandbox_cluster.address)
    with caplog.at_level("WARNING", logger="megatron_tir.rollout.driver"):
        groups = asyncio.run(TIRRollout(engine, engine.tokenizer, sandbox, cfg).run(problems))
    sandbox.close()
    asyncio.run(engine.close())
    short, refused = groups
    assert all(t.status is FinishStatus.VOID for t in short.trajectories)  # a random model: void, as above
    for t in refused.trajectories:  # before: ABORTED, an infrastructure failure (dropped from the update silently)
        assert t.status is FinishStatus.PROMPT_TOO_LONG and t.status not in INFRA_STATUSES
        assert t.response_ids == [] and "max_seq_len" in t.turns[0].reason
    warnings = [r.getMessage() for r in caplog.records if "data error" in r.getMessage()]
    assert len(warnings) == 1, warnings  # once per prompt, not per sample
    assert f"row 7 of unit ({lengths[1]} tokens)" in warnings[0]
    metrics = rollout_metrics(groups)
    assert metrics["rollout/status_prompt_too_long"] == 2.0 and "rollout/status_aborted" not in metrics
