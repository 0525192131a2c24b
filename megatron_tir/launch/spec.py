"""What is launched: a recipe or a run to continue, its layout, run dir and the user's overrides.

A launch writes ``RUN_DIR/launch.json`` (executor, recipe, cluster file contents, overrides);
``--resume RUN_DIR`` reads it back, so the continuation runs on the same layout without the
cluster file being given again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from megatron_tir.launch.cluster import Cluster, cluster_from_dict, cluster_to_dict
from megatron_tir.launch.layout import TrainerLayout

LAUNCH_RECORD = "launch.json"


@dataclass(kw_only=True, slots=True, frozen=True)
class RunSpec:
    recipe: str
    layout: TrainerLayout
    run_dir: str  # absolute; on Slurm a path on the cluster's shared file system
    resume: bool = False  # continue the run in run_dir (megatron-tir train --resume)
    overrides: tuple[str, ...] = ()  # the user's --set key=value, passed to the trainer as given

    def __post_init__(self) -> None:
        assert Path(self.run_dir).is_absolute(), self.run_dir


@dataclass(kw_only=True, slots=True, frozen=True)
class LaunchRecord:
    executor: str  # "local" | "slurm"
    recipe: str
    cluster: Cluster | None  # the Slurm layout; None for local runs


def write_record(run_dir: str | Path, record: LaunchRecord) -> Path:
    path = Path(run_dir) / LAUNCH_RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"executor": record.executor, "recipe": record.recipe,
            "cluster": cluster_to_dict(record.cluster) if record.cluster is not None else None}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
    return path


def read_record(run_dir: str | Path) -> LaunchRecord:
    path = Path(run_dir) / LAUNCH_RECORD
    where = f"--resume {run_dir}"
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"{where}: cannot read {LAUNCH_RECORD} ({exc.strerror}); was the run started by "
                         "tir-launch?") from None
    except json.JSONDecodeError:
        raise ValueError(f"{where}: {LAUNCH_RECORD} is not valid JSON") from None
    if not isinstance(data, dict) or data.get("executor") not in ("local", "slurm") or not data.get("recipe"):
        raise ValueError(f"{where}: {LAUNCH_RECORD} lacks executor/recipe")
    cluster = data.get("cluster")
    if data["executor"] == "slurm" and not isinstance(cluster, dict):
        raise ValueError(f"{where}: {LAUNCH_RECORD} has no cluster layout")
    return LaunchRecord(executor=data["executor"], recipe=str(data["recipe"]),
                        cluster=cluster_from_dict(cluster, where=f"{where}: {LAUNCH_RECORD}") if cluster else None)
