"""``megatron-tir sft``'s typed config, its recipes, ``--set`` overrides (the train config's rules:
:mod:`megatron_tir.config_io`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from megatron_tir import config_io
from megatron_tir.finite import check_finite
from megatron_tir.observe.config import LogConfig
from megatron_tir.policy.learner_config import LearnerConfig
from megatron_tir.rl import AGGREGATIONS
from megatron_tir.rollout.driver import RolloutConfig
from megatron_tir.train.config import CheckpointConfig

DERIVED_KEYS = ("learner.model",)  # set from SFTConfig.model


@dataclass(kw_only=True, slots=True)
class SFTConfig:
    """A fine-tuning run: which model, which trajectory files, how many steps of how many rows."""
    model: str = "smollm2"  # the policy to fine-tune: a named model, an HF directory or a run checkpoint
    data: tuple[str, ...] = ()  # trajectory files (megatron_tir.sft.examples): collect output, dumps, messages
    learner: LearnerConfig = field(default_factory=LearnerConfig)  # layout (tp, pp, ep), optimizer, micro-batches
    # how rows of messages are rendered (protocol, prompt, feedback, tool limits): the RL run's rollout settings
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    steps: int = 10  # optimizer steps of the run (a resumed run continues to this step)
    rows_per_step: int = 8  # trajectories per optimizer step (the data is read in a seeded order, epoch by epoch)
    only_correct: bool = True  # of trajectory records, keep those with reward > 0 (a dump holds every sampled row)
    max_tokens: int = 2048  # prompt + response tokens of a row; longer rows are cut (their tail gets no loss)
    aggregation: str = "token_mean"  # token_mean (every model token weighs the same) | seq_mean (every row)
    seed: int = 0  # the data order and the torch seed
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)  # trackers (metrics.jsonl always)
    plots: bool = True  # RUN_DIR/plots at the end of the run (megatron-tir plot draws them any time)
    collective_timeout_s: float = 1800.0  # the process group's timeout (a checkpoint's save is the longest)

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must be set")
        if isinstance(self.data, str):
            self.data = (self.data,)
        self.data = tuple(self.data)
        for name in ("steps", "rows_per_step"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_tokens < 2:
            raise ValueError(f"max_tokens must be >= 2, got {self.max_tokens}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {', '.join(AGGREGATIONS)}, got {self.aggregation!r}")
        if not self.collective_timeout_s > 0:
            raise ValueError(f"collective_timeout_s must be > 0, got {self.collective_timeout_s}")
        check_finite(self)
        self.learner.model = self.model


def tiny_cpu_sft() -> SFTConfig:
    """A tiny random Qwen2 (SmolLM2's tokenizer): seconds per step, for tests."""
    return SFTConfig(model="tiny-qwen2", learner=LearnerConfig(lr=1e-3, max_tokens_per_microbatch=1024),
                     rollout=RolloutConfig(max_turns=2, max_response_tokens=48), steps=3, rows_per_step=4,
                     max_tokens=512)


def smollm2_cpu_sft() -> SFTConfig:
    """The cold start of ``smollm2-cpu``: SmolLM2-135M-Instruct fine-tuned on its own correct multi-turn
    trajectories of the ``tir_mix`` training prompts (``megatron-tir collect --recipe smollm2-cpu``), with
    the RL recipe's rollout settings (chat prompt, 3 turns, 5 s tools) rendering any rows of messages;
    then ``megatron-tir train --recipe smollm2-cpu --set model=RUN_DIR`` (docs/training.md, *Cold start*)."""
    from megatron_tir.train.recipes import smollm2_cpu

    rl = smollm2_cpu()
    return SFTConfig(model=rl.model, learner=LearnerConfig(lr=5e-5, max_tokens_per_microbatch=1024),
                     rollout=rl.rollout, steps=8, rows_per_step=8, max_tokens=1024,
                     checkpoint=CheckpointConfig(every=4))


SFT_RECIPES: dict[str, Callable[[], SFTConfig]] = {
    "tiny-cpu-sft": tiny_cpu_sft,
    "smollm2-cpu-sft": smollm2_cpu_sft,
}


def load_sft_recipe(name: str) -> SFTConfig:
    if name not in SFT_RECIPES:
        raise ValueError(f"unknown sft recipe {name!r} (recipes: {', '.join(SFT_RECIPES)})")
    return SFT_RECIPES[name]()


def apply_overrides(cfg: SFTConfig, overrides: Sequence[str]) -> SFTConfig:
    """``cfg`` with every ``key=value`` applied; ``learner.model`` follows the top-level ``model``."""
    for item in overrides:
        key, _, text = item.partition("=")
        if key.strip() in DERIVED_KEYS:
            raise ValueError(f"{key.strip()} follows the top-level model; set model={text.strip()} instead")
    return config_io.apply_overrides(cfg, list(overrides))


def to_dict(cfg: SFTConfig) -> dict:
    return config_io.to_dict(cfg)


def from_dict(data: dict) -> SFTConfig:
    return config_io.build(SFTConfig, data)
