"""STAND-IN (trainer branch) for the learner helper's module: only ``LearnerConfig`` and
``TrainBatch``, with the fields of the team contract, so the trainer's config can be built and tested before the
``learner`` branch is merged. The merge replaces this file with the real one."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = ("float32", "bfloat16")
FP8 = ("e4m3", "hybrid")


@dataclass(kw_only=True, slots=True)
class LearnerConfig:
    model: str = "smollm2"
    tp: int = 1
    pp: int = 1
    dtype: str = "float32"
    lr: float = 1e-6
    min_lr: float = 0.0
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    distributed_optimizer: bool = False
    max_tokens_per_microbatch: int = 4096
    fp8: str | None = None
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"tp and pp must be >= 1, got tp={self.tp}, pp={self.pp}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.fp8 is not None and self.fp8 not in FP8:
            raise ValueError(f"fp8 must be one of {', '.join(FP8)} or null, got {self.fp8!r}")


@dataclass(kw_only=True, slots=True)
class TrainBatch:
    tokens_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    loss_mask_BT: torch.Tensor
    extras: dict[str, torch.Tensor]
