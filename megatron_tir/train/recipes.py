"""The recipes: complete, validated ``TrainConfig`` s by name (``--recipe``), from the tiny CPU ones to the
papers' 7B / 32B runs on H100s; ``load_recipe(name)``. A recipe is a function and one line in ``RECIPES``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from megatron_tir.policy.learner_config import LearnerConfig
from megatron_tir.reward import RewardConfig
from megatron_tir.rl import LossConfig
from megatron_tir.rl.correction import CorrectionConfig
from megatron_tir.rollout.driver import RolloutConfig
from megatron_tir.rollout.factory import EngineConfig, SandboxConfig
from megatron_tir.tir import PromptConfig
from megatron_tir.train.config import (
    CheckpointConfig,
    DataConfig,
    FilterConfig,
    PPOConfig,
    SamplingConfig,
    TrainConfig,
    TrainerConfig,
)
from megatron_tir.train.critic_update import CriticConfig
from megatron_tir.train.turn_schedule import TurnScheduleConfig

def tiny_cpu() -> TrainConfig:
    """A tiny random Qwen2 (SmolLM2's tokenizer): seconds per step, for tests."""
    return TrainConfig(
        model="tiny-qwen2",
        learner=LearnerConfig(lr=1e-4, max_tokens_per_microbatch=1024),
        rollout=RolloutConfig(n_samples=2, max_turns=2, max_response_tokens=48, max_in_flight=8),
        engine=EngineConfig(max_batch_size=8),
        sandbox=SandboxConfig(workers=1),
        reward=RewardConfig(workers=1),
        data=DataConfig(eval_size=2),
        # A random model earns no reward and every trajectory is void: void rows stay in the loss and a
        # small entropy bonus gives the update a gradient, so every stage of a step runs.
        trainer=TrainerConfig(steps=2, mode="stop_without_filter", sampling=SamplingConfig(prompts_per_step=2),
                              filters=FilterConfig(drop_zero_std=False, overlong="keep"),
                              checkpoint=CheckpointConfig(every=1), progress=False,
                              loss=LossConfig(entropy_coef=1e-3)),
    )


def smollm2_cpu() -> TrainConfig:
    """The embedded default: SmolLM2-135M-Instruct learns to solve the generated task family with code
    (``tir_mix``: six training families at graded difficulty, level 1 naming the code; held out:
    other seeds and a seventh family, evaluated every 2 steps; chat template; the answer is what
    final_answer() prints or a boxed number)."""
    return TrainConfig(
        model="smollm2",
        learner=LearnerConfig(lr=2e-5, max_tokens_per_microbatch=1024),
        rollout=RolloutConfig(n_samples=4, max_turns=3, max_response_tokens=256, temperature=0.8, max_in_flight=32,
                              tool_timeout_s=5.0, prompt=PromptConfig(mode="chat")),
        engine=EngineConfig(max_batch_size=16),
        sandbox=SandboxConfig(workers=2),
        data=DataConfig(train="tir_mix", eval="tir_mix", eval_size=28, eval_samples=1),
        trainer=TrainerConfig(steps=10, sampling=SamplingConfig(prompts_per_step=8), ppo=PPOConfig(epochs=2),
                              filters=FilterConfig(overlong="keep"), checkpoint=CheckpointConfig(every=5),
                              eval_every=2),
    )


def _simpletir(model: str, *, tp: int, pp: int, **memory) -> TrainConfig:
    """SimpleTIR as released (ltzheng/SimpleTIR ``train.sh`` + README at e7b5b44; docs/recipes.md's recipe
    table lists every value beside the paper's): T=1, n=16, train batch 512 prompts in 4
    mini-batches of 128, one pass (each sample used once), over-sampling 3x once with a random
    pick and repeats for a short batch, accuracy filter 0.1-0.9, truncated rows removed from the
    statistics (groups with < 4 rows left dropped), AdamW wd 0.01 / betas (0.9, 0.99), lr 1e-6,
    clip 0.2/0.28 and c=3, grad clip 1, no KL or entropy, the released protocol, 8000 tokens per
    turn and 16000 per response with 5 turns (then 24K / 10 on a plateau, the paper's schedule);
    held-out AIME24 at n=16, top-p 0.7.
    ``memory``: the learner's sequence parallelism / recomputation, as ``tir-launch plan`` sized them
    for 80 GiB H100s (launch/README.md); a run checkpoint every hour as well as every 20 steps, so a
    4-hour job writes one."""
    return TrainConfig(
        model=model,
        learner=LearnerConfig(tp=tp, pp=pp, dtype="bfloat16", lr=1e-6, grad_clip=1.0, distributed_optimizer=True,
                              weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.99,
                              max_tokens_per_microbatch=32768, **memory),
        rollout=RolloutConfig(n_samples=16, max_turns=5, max_response_tokens=16000, max_turn_tokens=8000,
                              temperature=1.0, max_in_flight=1024, protocol="simpletir"),
        engine=EngineConfig(kind="sglang", urls=("http://localhost:30000",)),
        sandbox=SandboxConfig(workers=64),
        # ~20K answers per sampling round, checked on rank 0's node while the sandbox runs elsewhere
        reward=RewardConfig(workers=16),
        data=DataConfig(train="math_train", eval="aime24", eval_size=30, eval_samples=16, eval_top_p=0.7),
        trainer=TrainerConfig(steps=500,
                              sampling=SamplingConfig(prompts_per_step=512, sample_prompts=1536, max_rounds=1,
                                                      strategy="oversample"),
                              filters=FilterConfig(accuracy_lo=0.1, accuracy_hi=0.9, overlong="drop",
                                                   min_group_rows=4),
                              ppo=PPOConfig(epochs=1, mini_batches=4),
                              checkpoint=CheckpointConfig(every=20, minutes=60.0, keep_last=3), eval_every=20,
                              correction=CorrectionConfig(mode="none"),  # verl, synchronous: no rollout correction
                              turn_schedule=TurnScheduleConfig(on_plateau=True, max_turns=10,
                                                               max_response_tokens=24576)),
    )


def qwen25_7b_simpletir() -> TrainConfig:
    """Qwen2.5-7B: TP=4 (one H100 node holds 2 learner replicas; 24K-token rows need the split) with
    sequence parallelism: ~61 GiB per GPU at 32K-token micro-batches (~80 without)."""
    return _simpletir("Qwen2.5-7B", tp=4, pp=1, sequence_parallel=True)


def qwen25_32b_simpletir() -> TrainConfig:
    """Qwen2.5-32B: TP=8 within a node x PP=2 across two H100 nodes per replica, sequence parallelism
    and full recomputation of every layer: ~26 / 32 GiB on stages 0 / 1 (149 / 94 without)."""
    return _simpletir("Qwen2.5-32B", tp=8, pp=2, sequence_parallel=True, recompute_granularity="full",
                      recompute_method="uniform", recompute_num_layers=1)


def qwen3_8b_simpletir() -> TrainConfig:
    """Qwen3-8B (dense, QK-norm; set model= to the Qwen3-8B-Base directory for zero RL, the same
    shapes): TP=4 with sequence parallelism, as the 7B (32 heads and 8 KV heads split 4 ways)."""
    return _simpletir("Qwen3-8B", tp=4, pp=1, sequence_parallel=True)


def qwen3_30b_a3b_simpletir() -> TrainConfig:
    """Qwen3-30B-A3B (MoE: 128 experts, 8 active; set model= to the -Base directory for zero RL): TP=2
    with sequence parallelism (megatron-core's MoE layer trains under TP only with it), the experts
    over EP=8 (16 per GPU), full recomputation of every layer for 32K-token micro-batches."""
    return _simpletir("Qwen3-30B-A3B", tp=2, pp=1, ep=8, sequence_parallel=True, recompute_granularity="full",
                      recompute_method="uniform", recompute_num_layers=1)


def qwen25_7b_textonly() -> TrainConfig:
    """The paper's Table 1 zero-RL baseline: the 7B SimpleTIR recipe with no tool (one turn, no code
    executed; a response without an answer is a wrong answer, not a void turn)."""
    cfg = qwen25_7b_simpletir()
    cfg.rollout.tools, cfg.rollout.max_turns, cfg.rollout.max_turn_tokens = False, 1, None
    cfg.trainer.turn_schedule.on_plateau = False
    return TrainConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})  # re-validated


def qwen25_7b_zerotir() -> TrainConfig:
    """ZeroTIR's PPO on Qwen2.5-7B: GAE with a critic trained on the model's tokens. From arXiv 2505.07773
    and yyht/openrlhf_async_pipline at 63b6159
    ``examples/scripts/train_long_cot_ray_7b_ppo_tune_zero_v1_onpolicy_env_mask.sh``, its variables as
    the repository's README run block sets them (e35b11b: ``WARMUP=0.0 LR=1e-6 KL=0.0
    ENTROPY_RATIO=0.0 ENV_ITER_NUM=2``) and ``openrlhf/cli/train_ppo_ray.py``'s defaults for the flags
    it leaves out. Item by item, with the script's line or flag:
    ``tests/megatron_tir/train/test_zerotir_recipe.py``; what still departs and why: docs/recipes.md.

    GAE with gamma = lambda = 1 restarting at every tool-output token (``lastgaelam *= env_mask``),
    the critic on the model's tokens only (``--use_env_mask``), its loss each row's mean (micro-batch
    1), critic lr 5e-6, 10 critic-only steps without the filters (``--freezing_actor_steps 10``),
    value clip -0.2 / +0.28; 128 prompts x 16 samples and one update on all of them; groups with
    accuracy in [1/16, 0.8] (``--use_acc_filter``), rows whose check failed or that repeat (> 0.05)
    out of the loss (``--use_eval_filter``); truncated rows trained; 2 tool calls then a last turn;
    clip 0.2 / 0.28 and no dual clip, the loss over every response token (``--use_prefetch``); Adam
    (0.9, 0.95), no weight decay, no warm-up, lr 1e-6, no KL, no entropy."""
    cfg = qwen25_7b_simpletir()
    return TrainConfig(
        model=cfg.model, learner=dataclasses.replace(cfg.learner, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95,
                                                    lr=1e-6, warmup_steps=0, grad_clip=1.0),
        rollout=dataclasses.replace(cfg.rollout, protocol="default", max_turn_tokens=None, max_response_tokens=16000,
                                    max_turns=3, temperature=1.0, top_p=1.0),
        engine=cfg.engine, sandbox=cfg.sandbox, reward=cfg.reward,
        data=dataclasses.replace(cfg.data, eval_top_p=None),
        trainer=TrainerConfig(steps=500, mode="stop_without_filter", sampling=SamplingConfig(prompts_per_step=128),
                              filters=FilterConfig(drop_zero_std=False, accuracy_lo=1 / 16, accuracy_hi=0.8,
                                                   overlong="keep", max_repeat_score=0.05,
                                                   drop_verifier_failures=True),
                              ppo=PPOConfig(advantage="gae", epochs=1, mini_batches=1),
                              loss=LossConfig(clip_low=0.2, clip_high=0.28, dual_clip=None, kl_coef=0.0,
                                              entropy_coef=0.0, denominator="response_tokens"),
                              checkpoint=cfg.trainer.checkpoint, eval_every=20,
                              correction=CorrectionConfig(mode="none")),  # OpenRLHF's PPO: no rollout correction
        critic=CriticConfig(lr=5e-6, warmup_steps=10, value_clip=0.2, value_clip_high=0.28, gamma=1.0, lam=1.0,
                            gae_across_feedback="reset", aggregation="seq_mean", filter_in_warmup=False,
                            kl_reward_coef=0.0, whiten="batch"),
    )


RECIPES: dict[str, Callable[[], TrainConfig]] = {
    "tiny-cpu": tiny_cpu,
    "smollm2-cpu": smollm2_cpu,
    "qwen2.5-7b-simpletir": qwen25_7b_simpletir,
    "qwen2.5-32b-simpletir": qwen25_32b_simpletir,
    "qwen2.5-7b-zerotir": qwen25_7b_zerotir,
    "qwen2.5-7b-textonly": qwen25_7b_textonly,
    "qwen3-8b-simpletir": qwen3_8b_simpletir,
    "qwen3-30b-a3b-simpletir": qwen3_30b_a3b_simpletir,
}


def load_recipe(name: str) -> TrainConfig:
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r} (recipes: {', '.join(RECIPES)})")
    return RECIPES[name]()


# ----------------------------------------------------------------------------- overrides and JSON
