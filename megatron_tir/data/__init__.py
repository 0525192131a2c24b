"""Datasets of math problems (verl-schema parquet)."""

from megatron_tir.data.problems import NAMED_DATASETS, Problem, data_dir, load_problems, resolve_dataset

__all__ = ["NAMED_DATASETS", "Problem", "data_dir", "load_problems", "resolve_dataset"]
