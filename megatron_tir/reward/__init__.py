"""Outcome rewards: math-verify equivalence of the final answer, with a per-check time limit."""

from megatron_tir.reward.math_verify_reward import MathVerifier, RewardConfig, Verdict, verify_answer

__all__ = ["MathVerifier", "RewardConfig", "Verdict", "verify_answer"]
