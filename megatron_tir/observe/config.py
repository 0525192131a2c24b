"""``trainer.log``: what a run shows and where its metrics go (trackers, dumps, the step line)."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

LOGGERS = ("jsonl", "tensorboard", "wandb", "mlflow")
WANDB_MODES = ("online", "offline", "disabled")


@dataclass(kw_only=True, slots=True)
class LogConfig:
    # Trackers: "jsonl" (RUN_DIR/metrics.jsonl; resume, plots and the end-of-run summary read it, so it is
    # always on), "tensorboard" (RUN_DIR/tb), "wandb", "mlflow" (optional extras, imported only when named).
    loggers: tuple[str, ...] = ("jsonl", "tensorboard")
    project: str = "megatron-tir"  # W&B project / MLflow experiment
    run_name: str | None = None  # None: the run directory's name
    wandb_mode: str = "online"  # online | offline (W&B writes RUN_DIR/wandb, `wandb sync` uploads) | disabled
    mlflow_tracking_uri: str | None = None  # None: a file store in RUN_DIR/mlruns
    dump_every: int = 10  # rollout dumps (RUN_DIR/rollouts/step_N.jsonl.gz) at step 1 and every N steps; 0: never
    dump_tokens: bool = False  # dumps carry token ids, loss mask and log-probs
    text_samples: int = 4  # trajectories of each dump shown in TensorBoard's text tab / tracker tables
    moving_average: int = 10  # steps of the moving average (grad-norm spike flag)
    spike_factor: float = 3.0  # grad norm above this times its moving average: a spike

    def __post_init__(self) -> None:
        unknown = [x for x in self.loggers if x not in LOGGERS]
        if unknown:
            raise ValueError(f"loggers: unknown {', '.join(unknown)} (choose from {', '.join(LOGGERS)})")
        if "jsonl" not in self.loggers:
            raise ValueError("loggers must include jsonl (resume, plots and the run summary read metrics.jsonl)")
        if len(set(self.loggers)) != len(self.loggers):
            raise ValueError(f"loggers lists one twice: {', '.join(self.loggers)}")
        for name in ("wandb", "mlflow"):
            if name in self.loggers and importlib.util.find_spec(name) is None:
                raise ValueError(f"loggers names {name}, which is not installed (pip install 'megatron-tir[trackers]')")
        if self.wandb_mode not in WANDB_MODES:
            raise ValueError(f"wandb_mode must be one of {', '.join(WANDB_MODES)}, got {self.wandb_mode!r}")
        if self.dump_every < 0 or self.text_samples < 0:
            raise ValueError("dump_every and text_samples must be >= 0")
        if self.moving_average < 1:
            raise ValueError(f"moving_average must be >= 1, got {self.moving_average}")
        if not (math.isfinite(self.spike_factor) and self.spike_factor > 1):
            raise ValueError(f"spike_factor must be > 1, got {self.spike_factor}")
        if not self.project:
            raise ValueError("project must be set")

    def dump_due(self, step: int) -> bool:
        return bool(self.dump_every) and (step == 1 or step % self.dump_every == 0)
