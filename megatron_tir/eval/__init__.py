"""Evaluation: TIR rollouts over a dataset, avg@k / pass@k and the TIR behaviour metrics."""

from megatron_tir.eval.metrics import EvalMetrics, compute_metrics, pass_at_k

__all__ = ["EvalMetrics", "compute_metrics", "pass_at_k"]
