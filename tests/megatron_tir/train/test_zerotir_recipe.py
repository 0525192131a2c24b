"""The ``qwen2.5-7b-zerotir`` recipe's resolved config equals ZeroTIR's script item by item.

Every row: the key, the script's value, and where the script says it. Sources (yyht/openrlhf_async_pipline):
* ``S``: ``examples/scripts/train_long_cot_ray_7b_ppo_tune_zero_v1_onpolicy_env_mask.sh`` at 63b6159 (line: flag);
* ``A``: ``openrlhf/cli/train_ppo_ray.py`` at 63b6159, the defaults of the flags the script leaves out;
* ``R``: README.md at e35b11b, the run block that sets the script's variables (``${LR}``, ...);
* other files at 63b6159 by name.
What the recipe cannot take from the script (and why) is the departures table of docs/recipes.md.
"""

from __future__ import annotations

import pytest

from megatron_tir.train.recipes import load_recipe

ITEMS = [
    # key, the script's value, where
    ("trainer.ppo.advantage", "gae", "S:42 --advantage_estimator 'gae'"),
    ("critic.gamma", 1.0, "S:37 --gamma 1.0"),
    ("critic.lam", 1.0, "S:36 --lambd 1.0"),
    ("critic.gae_across_feedback", "reset",
     "S:31 --use_env_mask; experience_maker.py 592-601 (values, rewards times env_mask; lastgaelam *= env_mask[:, t])"),
    ("critic.lr", 5e-6, "S:46 --critic_learning_rate 5e-6"),
    ("critic.warmup_steps", 10, "S:39 --freezing_actor_steps 10; ppo_trainer.py 581 (actor trains when steps > 10)"),
    ("critic.filter_in_warmup", False, "ppo_trainer.py 260-262 (filters in all_gather only when steps > 10)"),
    ("critic.value_clip", 0.2, "A:329 --value_clip 0.2"),
    ("critic.value_clip_high", 0.28, "A:330 --value_clip_high 0.28; loss.py 108"),
    ("critic.aggregation", "seq_mean",
     "S:19 --micro_train_batch_size 1, no --use_critic_prefetch: ValueLoss masked_mean per row (loss.py 117)"),
    ("critic.kl_reward_coef", 0.0, "S:47 --init_kl_coef ${KL}; R:58 KL=0.0"),
    ("critic.whiten", "batch", "replay_buffer.py 437-474 normalize('advantages'): mean and std over the buffer"),
    ("learner.lr", 1e-6, "S:45 --actor_learning_rate ${LR}; R:57 LR=1e-6"),
    ("learner.warmup_steps", 0, "S:44 --lr_warmup_ratio ${WARMUP}; R:56 WARMUP=0.0"),
    ("learner.adam_beta1", 0.9, "A:365 --adam_betas (0.9, 0.95)"),
    ("learner.adam_beta2", 0.95, "A:365 --adam_betas (0.9, 0.95)"),
    ("learner.weight_decay", 0.0, "A:325 --l2 0.0"),
    ("learner.grad_clip", 1.0, "A:324 --max_norm 1.0"),
    ("trainer.loss.entropy_coef", 0.0, "S:41 --entropy_loss_coef ${ENTROPY_RATIO}; R:59 ENTROPY_RATIO=0.0"),
    ("trainer.loss.kl_coef", 0.0, "A:376 --use_kl_loss off"),
    ("trainer.loss.clip_low", 0.2, "A:327 --eps_clip 0.2"),
    ("trainer.loss.clip_high", 0.28, "A:328 --eps_clip_high 0.28"),
    ("trainer.loss.dual_clip", None, "models/loss.py 75-78 PolicyLoss: -min(surr1, surr2), no dual clip"),
    ("trainer.loss.aggregation", "token_mean", "S:30 --use_prefetch: one sum over the optimizer step's rows"),
    ("trainer.loss.denominator", "response_tokens",
     "S:30 --use_prefetch; loss.py 80 masked_sum(env_mask) / length_status['response_length'] (action_mask.sum)"),
    ("trainer.sampling.prompts_per_step", 128, "S:22 --rollout_batch_size 128"),
    ("rollout.n_samples", 16, "S:40 --n_samples_per_prompt 16"),
    ("trainer.ppo.mini_batches", 1, "S:20 --train_batch_size 2048 = 128 x 16: one optimizer step per rollout"),
    ("trainer.ppo.epochs", 1, "S:24 --max_epochs 1"),
    ("trainer.filters.drop_zero_std", False, "S:32 --use_acc_filter is an accuracy band, no std rule"),
    ("trainer.filters.accuracy_lo", 1 / 16, "S:32 --use_acc_filter; replay_buffer.py 195 1 / n_samples_per_prompt"),
    ("trainer.filters.accuracy_hi", 0.8, "S:32 --use_acc_filter; replay_buffer.py 196"),
    ("trainer.filters.max_repeat_score", 0.05, "S:35 --use_eval_filter; replay_buffer.py 375 repeatness > 0.05"),
    ("trainer.filters.drop_verifier_failures", True,
     "S:35 --use_eval_filter; replay_buffer.py 372 rule_eval_fails / model_eval_fails"),
    ("trainer.filters.overlong", "keep", "A:470 --use_length_filter off: truncated rows are trained"),
    ("trainer.mode", "stop_without_filter",
     "math_tir_process_single_request.py 289-294: a turn without code ends the rollout, which is trained"),
    ("rollout.max_turns", 3,
     "R:72 ENV_ITER_NUM=2; math_tir_process_single_request.py 143, 166-171: 2 executions, then a last turn"),
    ("rollout.max_response_tokens", 16000, "S:27 --generate_max_len 16000"),
    ("rollout.max_turn_tokens", None, "math_tir_process_single_request.py 172-176: the response budget only"),
    ("rollout.temperature", 1.0, "A:337 --temperature 1.0"),
    ("rollout.top_p", 1.0, "A:336 --top_p 1.0"),
]


def _get(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


@pytest.mark.parametrize("key,value,where", ITEMS, ids=[k for k, _, _ in ITEMS])
def test_the_recipe_is_the_script(key, value, where):
    got = _get(load_recipe("qwen2.5-7b-zerotir"), key)
    if isinstance(value, float):
        assert got == pytest.approx(value), f"{key}: {got!r}, the script ({where}): {value!r}"
    else:
        assert got == value, f"{key}: {got!r}, the script ({where}): {value!r}"


def test_the_table_covers_what_the_recipe_sets_for_zerotir():
    """Every setting this issue added for ZeroTIR is in the table (a new one must say the script's value)."""
    keys = {k for k, _, _ in ITEMS}
    for key in ("critic.gae_across_feedback", "critic.value_clip_high", "critic.filter_in_warmup",
                "critic.aggregation", "trainer.loss.denominator", "trainer.filters.max_repeat_score",
                "trainer.filters.drop_verifier_failures"):
        assert key in keys
    assert len(ITEMS) >= 40
