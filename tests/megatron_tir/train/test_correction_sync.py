"""The rollout correction in synchronous training (``trainer.async=off``): two-turn trajectories sampled
by the real local engine on tiny-qwen2 (the learner's weights) -- the driver alone is replaced, by
two ``generate`` calls with tool output between them -- and trained by the real ``PolicyGradient``.

The test's engine wrapper shifts the log-probs the engine reports for the second turn (after the
tool output) by +-0.7 (the perturbation lives here, not in production code): the mismatch metrics
of turn 1 show it and those of turn 0 do not, and ``tis`` weights equal slime's / verl's formula
computed in numpy from the learner's log-probs and the engine's; an engine that reports the
learner's own log-probs gets every weight exactly 1."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import numpy as np
import pytest
import torch

from megatron_tir.rollout.batch import Group
from megatron_tir.rollout.engines.base import SamplingParams
from megatron_tir.rollout.trajectory import FinishStatus, Trajectory, Turn
from megatron_tir.tir import TurnKind
from megatron_tir.train.config import apply_overrides
from megatron_tir.train.recipes import load_recipe, tiny_cpu
from megatron_tir.train.batch import StepRollouts

SHIFT = 0.7


@pytest.fixture(scope="module")
def parallel_1x1():
    from megatron_tir.policy.parallel import destroy_parallel, init_parallel

    init_parallel(1, 1)
    yield
    destroy_parallel()


FEEDBACK = "\n```output\n42\n```\n"


class Turn1ShiftedEngine:
    """The local engine; the log-probs it reports for a request that follows a tool output are shifted by
    ``-+SHIFT`` (alternating by token): another kernel's numbers for the same tokens (a test hook)."""

    def __init__(self, engine, feedback_ids) -> None:
        self.engine, self.feedback_ids = engine, list(feedback_ids)

    async def generate(self, prompt_ids, params):
        g = await self.engine.generate(prompt_ids, params)
        if list(prompt_ids[-len(self.feedback_ids):]) != self.feedback_ids:
            return g
        return dataclasses.replace(g, logprobs=[x + (SHIFT if i % 2 else -SHIFT) for i, x in enumerate(g.logprobs)])


async def _two_turn_groups(tokenizer, engine) -> list[Group]:
    """2 groups x 2 samples: turn 0, a tool output, turn 1 (rewards 1 / 0 within a group)."""
    feedback = tokenizer(FEEDBACK, add_special_tokens=False).input_ids
    prompts = [tokenizer("Compute 6 * 7 with python.").input_ids, tokenizer("What is 2 + 2?").input_ids]

    async def one(g, s):
        t = Trajectory(group_id=g, sample_index=s, prompt_ids=prompts[g])
        for k in (0, 1):
            out = await engine.generate(t.prompt_ids + t.response_ids,
                                        SamplingParams(max_new_tokens=6, seed=10 * g + 2 * s + k))
            t.turns.append(Turn(index=k, kind=TurnKind.CODE if k == 0 else TurnKind.ANSWER, reason="test",
                                code="print(42)" if k == 0 else None, finish_reason=out.finish_reason,
                                start=len(t.response_ids), model_tokens=len(out.token_ids),
                                feedback_tokens=len(feedback) if k == 0 else 0))
            t.append_model_tokens(out.token_ids, out.logprobs, out.versions)
            if k == 0:
                t.append_feedback_tokens(feedback)
        t.status, t.reward = FinishStatus.COMPLETED, float(s == 0)
        return t

    ts = [await one(g, s) for g in range(2) for s in range(2)]
    return [Group(group_id=g, problem=None, trajectories=ts[2 * g:2 * g + 2]) for g in range(2)]


@pytest.fixture(scope="module")
def sampled(parallel_1x1):
    """The learner and the groups of an unshifted and a shifted engine (the same tokens: same seeds)."""
    from megatron_tir.policy.learner import Learner
    from megatron_tir.rollout.engines.local import LocalEngine, LocalEngineConfig

    cfg = tiny_cpu()
    learner = Learner(cfg.learner)
    feedback = learner.tokenizer(FEEDBACK, add_special_tokens=False).input_ids

    async def sample():  # one event loop: the engine is bound to it
        local = LocalEngine(LocalEngineConfig(model="tiny-qwen2", eos_token_ids=(0,)))
        try:
            return (await _two_turn_groups(learner.tokenizer, local),
                    await _two_turn_groups(learner.tokenizer, Turn1ShiftedEngine(local, feedback)))
        finally:
            await local.close()

    plain, shifted = asyncio.run(sample())
    for a, b in zip(plain, shifted):  # the same tokens; the reported log-probs differ on turn 1 only
        for ta, tb in zip(a.trajectories, b.trajectories):
            assert ta.response_ids == tb.response_ids
    return learner, plain, shifted


def _prepare(learner, groups, *overrides):
    from megatron_tir.train.algorithm import build_algorithm

    cfg = apply_overrides(tiny_cpu(), ["trainer.loss.entropy_coef=0", *overrides])
    got = StepRollouts.of_groups(groups, cfg)
    algorithm = build_algorithm(cfg, learner)
    update = algorithm.prepare(1, got, {})
    return got, update, algorithm


def _metrics(algorithm, update, got, *, step: bool = False):
    """The step's metrics; ``step``: after the optimizer steps (which change the learner's weights)."""
    from megatron_tir.train.batch import mini_batches

    for mb in mini_batches(update, got.mini_batches) if step else ():
        algorithm.steps(mb)
    return algorithm.finish().metrics


def _learner_logprobs(learner, rows):
    return learner.logprobs(rows.tokens_BT, rows.attention_mask_BT, temperature=1.0).double().numpy()


def test_the_local_engines_gap_is_float_noise_and_tis_weights_are_one_within_it(sampled):
    learner, plain, _ = sampled
    got, update, algorithm = _prepare(learner, plain, "trainer.correction.mode=tis")
    on = got.rows.loss_mask_BT > 0
    w = update.batch.extras["behaviour_weights_BT"][on]
    assert (w - 1).abs().max() < 1e-4
    m = _metrics(algorithm, update, got)
    assert m["correction/log_ratio_abs_max"] < 1e-4 and m["correction/k3_kl"] < 1e-8
    assert m["correction/clipped_share"] == 0 and m["correction/rejected_share"] == 0
    assert not any(k.startswith("offpolicy/") for k in m)  # the deprecated names are the async modes' only


def test_a_shifted_engine_shows_in_the_turn_metrics_and_tis_weights_equal_the_reference(sampled):
    learner, _, shifted = sampled
    got, update, algorithm = _prepare(learner, shifted, "trainer.correction.mode=tis", "trainer.correction.high=1.5",
                                      "trainer.correction.low=0.6")
    rows = got.rows
    on = (rows.loss_mask_BT > 0).numpy()
    old = _learner_logprobs(learner, rows)  # the learner's recompute, independently of the algorithm
    engine = rows.engine_logprobs_BT.double().numpy()
    want = np.clip(np.exp(old - engine), 0.6, 1.5)  # slime vanilla_tis_function: clamp(tis, tis_clip_low, tis_clip)
    got_w = update.batch.extras["behaviour_weights_BT"].double().numpy()
    np.testing.assert_allclose(got_w[on], want[on], rtol=1e-6, atol=1e-6)
    turn = rows.turn_index_BT.numpy()
    assert ((got_w[on & (turn == 1)] == np.float32(0.6)) | (got_w[on & (turn == 1)] == np.float32(1.5))).all()
    m = _metrics(algorithm, update, got)
    k3_shift = (math.exp(-SHIFT) + SHIFT - 1 + math.exp(SHIFT) - SHIFT - 1) / 2  # the +-0.7 shift, equally often
    n1 = (on & (turn == 1)).sum()
    assert m["correction/k3_kl_turn_0"] < 1e-8 and m["correction/log_ratio_abs_mean_turn_0"] < 1e-4
    assert m["correction/log_ratio_abs_mean_turn_1"] == pytest.approx(SHIFT, abs=1e-4)
    k3_exact = ((np.exp(-SHIFT) + SHIFT - 1) * ((turn == 1) & on & (_token_parity(rows) == 1)).sum()
                + (np.exp(SHIFT) - SHIFT - 1) * ((turn == 1) & on & (_token_parity(rows) == 0)).sum()) / n1
    assert m["correction/k3_kl_turn_1"] == pytest.approx(k3_exact, abs=1e-4)
    assert abs(k3_exact - k3_shift) < 0.3  # both signs occur
    assert m["correction/clipped_share"] == pytest.approx(n1 / on.sum())  # every turn-1 token, no turn-0 one
    assert m["correction/log_ratio_abs_max"] == pytest.approx(SHIFT, abs=1e-4)
    # the step itself, on a learner of its own (the module's keeps the engine's weights)
    from megatron_tir.policy.learner import Learner

    fresh = Learner(tiny_cpu().learner)
    got, update, algorithm = _prepare(fresh, shifted, "trainer.correction.mode=tis", "trainer.correction.high=1.5",
                                      "trainer.correction.low=0.6")
    np.testing.assert_allclose(update.batch.extras["behaviour_weights_BT"].double().numpy()[on], want[on], atol=1e-6)
    stepped = _metrics(algorithm, update, got, step=True)
    assert stepped["train/optimizer_steps"] == 1 and math.isfinite(stepped["train/loss"])
    assert stepped["correction/k3_kl_turn_1"] == m["correction/k3_kl_turn_1"]


def _token_parity(rows):
    """Per token: its index within its turn's request, mod 2 (the shift's sign: - on even, + on odd)."""
    turn = rows.turn_index_BT.numpy()
    out = np.full(turn.shape, -1)
    for b in range(turn.shape[0]):
        for k in (0, 1):
            cols = np.nonzero(turn[b] == k)[0]
            out[b, cols] = np.arange(len(cols)) % 2
    return out


def test_an_engine_reporting_the_learners_logprobs_gets_every_weight_exactly_one(sampled):
    learner, plain, _ = sampled
    same = []
    for g in plain:  # the engine's log-probs := the learner's, trajectory by trajectory
        trajs = []
        for t in g.trajectories:
            ids = torch.tensor([t.prompt_ids + t.response_ids])
            lp = learner.logprobs(ids, torch.ones_like(ids, dtype=torch.bool), temperature=1.0)[0, len(t.prompt_ids):]
            trajs.append(dataclasses.replace(t, response_logprobs=[float(x) if m else math.nan
                                                                   for x, m in zip(lp, t.loss_mask)]))
        same.append(dataclasses.replace(g, trajectories=trajs))
    for mode in ("tis", "seq_tis", "mis", "seq_mis", "geo_rs"):
        got, update, algorithm = _prepare(learner, same, f"trainer.correction.mode={mode}")
        on = got.rows.loss_mask_BT > 0
        w = update.batch.extras.get("behaviour_weights_BT")
        assert w is None or torch.equal(w[on], torch.ones(int(on.sum()))), mode
        assert torch.equal(update.batch.loss_mask_BT, got.rows.loss_mask_BT), mode
        m = _metrics(algorithm, update, got)
        assert m["correction/k3_kl"] == 0 and m["correction/log_ratio_abs_max"] == 0, mode


def test_none_reports_the_gap_without_touching_the_loss(sampled):
    learner, _, shifted = sampled
    got, update, algorithm = _prepare(learner, shifted)  # auto in sync: none
    assert "behaviour_weights_BT" not in update.batch.extras
    assert torch.equal(update.batch.loss_mask_BT, got.rows.loss_mask_BT)
    m = _metrics(algorithm, update, got)
    assert m["correction/log_ratio_abs_max"] == pytest.approx(SHIFT, abs=1e-4)
    assert m["correction/weight_mean"] == 1.0 and m["correction/clipped_share"] == 0


# --------------------------------------------------------------------- the settings


def test_settings_recipes_and_the_deprecated_async_spelling():
    assert load_recipe("qwen2.5-7b-simpletir").trainer.correction.mode == "none"  # what the papers did
    assert load_recipe("qwen2.5-7b-zerotir").trainer.correction.mode == "none"
    assert load_recipe("tiny-cpu").trainer.correction.mode == "auto"
    cfg = apply_overrides(tiny_cpu(), ["trainer.correction.mode=mis", "trainer.correction.high=3",
                                       "trainer.correction.low=0.5"])
    assert (cfg.trainer.correction.mode, cfg.trainer.correction.high, cfg.trainer.correction.low) == ("mis", 3.0, 0.5)
    for overrides, message in [
        (["trainer.correction.mode=tis", "trainer.async.correction=mask"], "deprecated spelling of trainer.correction"),
        (["trainer.correction.mode=tis", "trainer.async.cap=3"], "deprecated spelling of trainer.correction"),
        (["trainer.correction.high=3"], "need an explicit correction.mode"),
        (["trainer.correction.mode=tis", "trainer.ppo.old_logprobs=engine"], "needs ppo.old_logprobs=learner"),
        (["trainer.correction.mode=sometimes"], "mode must be one of auto, none, tis"),
    ]:
        with pytest.raises(ValueError, match=message) as info:
            apply_overrides(tiny_cpu(), overrides)
        assert "\n" not in str(info.value)
    # the former async settings stay valid: auto reads them in the async modes
    cfg = apply_overrides(tiny_cpu(), ["trainer.async=one_step", "trainer.async.correction=mask", "trainer.async.cap=3"])
    a = cfg.trainer.asynchrony
    assert cfg.trainer.correction.resolved(a.mode, a.correction, a.cap).mode == "mis"
