"""Where step metrics go besides ``RUN_DIR/metrics.jsonl``: TensorBoard, W&B, MLflow (``trainer.log.loggers``).

Every tracker takes the same three calls on rank 0: ``log_metrics(step, {name: number})``,
``log_samples(step, name, rows)`` (a few rendered trajectories: TensorBoard's text tab, a
W&B table, an MLflow text artifact) and ``close()``. The resolved config is logged once as
hyper-parameters (W&B ``config``, MLflow params flattened to dotted keys, TensorBoard text).
W&B and MLflow are optional extras (``pip install megatron-tir[trackers]``), imported only
when named.

Offline use: ``trainer.log.wandb_mode=offline`` writes ``RUN_DIR/wandb`` (upload later with
``wandb sync``); MLflow without ``mlflow_tracking_uri`` uses a file store in
``RUN_DIR/mlruns`` (MLflow 3 keeps that backend in maintenance mode and refuses it unless
``MLFLOW_ALLOW_FILE_STORE=true``, which this module sets for that default only). A resumed
run continues the same W&B / MLflow run (its id is kept in the run directory).
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from megatron_tir.observe.config import LogConfig

log = logging.getLogger(__name__)

SAMPLE_COLUMNS = ("split", "group", "sample", "status", "reward", "in_loss", "dropped_by", "text")


class Tracker(Protocol):
    def log_metrics(self, step: int, metrics: dict[str, float]) -> None: ...

    def log_samples(self, step: int, name: str, rows: Sequence[dict]) -> None: ...

    def close(self) -> None: ...


def finite_numbers(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def flatten(config: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out |= flatten(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if isinstance(v, (list, tuple)) else str(v)
    return out


def samples_markdown(rows: Sequence[dict]) -> str:
    parts = []
    for r in rows:
        head = " · ".join(f"{k} {r[k]}" for k in SAMPLE_COLUMNS[:-1] if r.get(k) is not None)
        body = "\n".join("    " + line for line in str(r.get("text", "")).splitlines())
        parts.append(f"**{head}**\n\n{body}\n")
    return "\n".join(parts)


class TensorBoardTracker:
    def __init__(self, run_dir: Path, config: dict | None, purge_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: TensorBoard drops the events of earlier sessions at steps >= it (a resume re-runs them)
        self._tb = SummaryWriter(str(run_dir / "tb"), purge_step=purge_step)
        if config is not None:
            self._tb.add_text("config", "    " + json.dumps(config, indent=1).replace("\n", "\n    "), 0)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in finite_numbers(metrics).items():
            self._tb.add_scalar(k, v, step)
        self._tb.flush()

    def log_samples(self, step: int, name: str, rows: Sequence[dict]) -> None:
        if rows:
            self._tb.add_text(name, samples_markdown(rows), step)
            self._tb.flush()

    def close(self) -> None:
        self._tb.close()


class WandbTracker:
    ID_FILE = "wandb_run_id"

    def __init__(self, run_dir: Path, cfg: LogConfig, config: dict | None) -> None:
        import wandb

        id_path = run_dir / self.ID_FILE
        run_id = id_path.read_text().strip() if id_path.is_file() else secrets.token_hex(4)  # W&B ids: [a-z0-9]
        id_path.write_text(run_id)
        self._wandb = wandb
        self._run = wandb.init(project=cfg.project, name=cfg.run_name or run_dir.name, id=run_id, resume="allow",
                               dir=str(run_dir), mode=cfg.wandb_mode, config=config)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(finite_numbers(metrics), step=step)

    def log_samples(self, step: int, name: str, rows: Sequence[dict]) -> None:
        if rows:
            table = self._wandb.Table(columns=list(SAMPLE_COLUMNS),
                                      data=[[r.get(c) for c in SAMPLE_COLUMNS] for r in rows])
            self._run.log({name: table}, step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowTracker:
    ID_FILE = "mlflow_run_id"
    MAX_PARAM_CHARS = 500

    def __init__(self, run_dir: Path, cfg: LogConfig, config: dict | None) -> None:
        uri = cfg.mlflow_tracking_uri
        if uri is None:
            uri = (run_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self._client = MlflowClient(tracking_uri=uri)
        id_path = run_dir / self.ID_FILE
        if id_path.is_file():
            self.run_id = id_path.read_text().strip()
        else:
            exp = self._client.get_experiment_by_name(cfg.project)
            exp_id = exp.experiment_id if exp is not None else self._client.create_experiment(cfg.project)
            self.run_id = self._client.create_run(exp_id, run_name=cfg.run_name or run_dir.name).info.run_id
            id_path.write_text(self.run_id)
            if config is not None:
                params = [Param(k, v[:self.MAX_PARAM_CHARS]) for k, v in flatten(config).items()]
                for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                    self._client.log_batch(self.run_id, params=params[i:i + 100])
        self.tracking_uri = uri

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(_mlflow_key(k), v, now, step) for k, v in finite_numbers(metrics).items()]
        for i in range(0, len(items), 1000):
            self._client.log_batch(self.run_id, metrics=items[i:i + 1000])

    def log_samples(self, step: int, name: str, rows: Sequence[dict]) -> None:
        if rows:
            self._client.log_text(self.run_id, samples_markdown(rows), f"{name}/step_{step}.md")

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


def _mlflow_key(key: str) -> str:
    """MLflow keys allow alphanumerics, ``_ - . space : /``; anything else becomes ``_``."""
    return "".join(c if c.isalnum() or c in "_-. :/" else "_" for c in key)


def open_trackers(cfg: LogConfig, run_dir: str | os.PathLike, config: dict | None = None, *,
                  purge_step: int | None = None) -> list[Tracker]:
    """The trackers ``cfg.loggers`` names besides jsonl (which :class:`~megatron_tir.train.metrics.MetricsSink`
    writes itself), in that order. ``purge_step``: TensorBoard hides earlier events at steps >= it."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    out: list[Tracker] = []
    try:
        for name in cfg.loggers:
            if name == "tensorboard":
                out.append(TensorBoardTracker(run_dir, config, purge_step))
            elif name in ("wandb", "mlflow"):
                try:
                    out.append((WandbTracker if name == "wandb" else MlflowTracker)(run_dir, cfg, config))
                except ImportError:
                    raise ValueError(f"trainer.log.loggers names {name}, which is not installed "
                                     f"(pip install 'megatron-tir[trackers]')") from None
    except BaseException:
        for t in out:
            t.close()
        raise
    return out
