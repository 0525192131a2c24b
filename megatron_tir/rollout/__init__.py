"""Multi-turn TIR rollouts: the async driver, the trajectory record, collation, the sandbox edge."""

from megatron_tir.rollout.batch import Group, RolloutBatch, collate, flatten
from megatron_tir.rollout.driver import RolloutConfig, TIRRollout
from megatron_tir.rollout.sandbox import ClusterSandbox, Sandbox
from megatron_tir.rollout.trajectory import FinishStatus, Timings, ToolCall, Trajectory, Turn

__all__ = ["ClusterSandbox", "FinishStatus", "Group", "RolloutBatch", "RolloutConfig", "Sandbox", "TIRRollout",
           "Timings", "ToolCall", "Trajectory", "Turn", "collate", "flatten"]
