"""The cluster file: where a run goes (account, partition, image, mounts, node counts per group).

It is separate from the recipe (what is trained): the same recipe runs on any cluster file,
and a cluster file serves every recipe. ``load_cluster(path)`` reads and checks the YAML;
``check_layout(cluster, layout)`` checks it against a recipe's parallel layout. Every
problem is a ``ValueError`` with one line that names the file and the key.

One allocation holds the trainer and SGLang groups (no heterogeneous job; see
launch/README.md), from one partition. The sandbox group joins that allocation when it names
the same partition, or runs in a second allocation on its own partition (``sandbox.partition:
cpu``: CPU nodes, no idle GPUs), which the main job submits when it starts and cancels when it
ends. ``sglang.nodes: 0`` colocates the SGLang servers on the trainer's GPUs;
``sandbox.nodes: 0`` runs the sandbox beside the trainer on its first node's CPUs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from megatron_tir.config_io import build, to_dict
from megatron_tir.launch.layout import TrainerLayout


@dataclass(kw_only=True, slots=True)
class Partition:
    """A Slurm partition as far as placement needs it."""

    gpus_per_node: int
    cpus_per_node: int
    gpu_only: bool = False  # the site rejects jobs or nodes that leave its GPUs idle
    gpu_memory_gib: float | None = None  # per GPU (the capacity planner's memory checks need it)
    gpu_tflops: float | None = None  # dense bf16 peak per GPU (the planner's step-time estimate)

    def __post_init__(self) -> None:
        if self.gpus_per_node < 0:
            raise ValueError(f"gpus_per_node must be >= 0, got {self.gpus_per_node}")
        if self.cpus_per_node < 1:
            raise ValueError(f"cpus_per_node must be >= 1, got {self.cpus_per_node}")
        for key in ("gpu_memory_gib", "gpu_tflops"):
            if getattr(self, key) is not None and not getattr(self, key) > 0:
                raise ValueError(f"{key} must be > 0, got {getattr(self, key)}")
        if self.gpu_only and self.gpus_per_node == 0:
            raise ValueError("gpu_only is set on a partition without GPUs")


@dataclass(kw_only=True, slots=True)
class TrainerGroup:
    nodes: int
    partition: str | None = None  # None: the cluster's partition
    container_image: str | None = None  # None: the cluster's image
    mounts: list[str] = field(default_factory=list)  # added to the cluster's mounts for this group
    env: dict[str, str] = field(default_factory=dict)  # added to the cluster's env for this group

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {self.nodes}")


@dataclass(kw_only=True, slots=True)
class SGLangGroup:
    nodes: int  # 0: colocated on the trainer's GPUs (memory released while the trainer trains)
    partition: str | None = None
    tp: int | None = None  # GPUs per server; None: a whole node per server
    ep: int = 1  # MoE: expert-parallel size inside each server (SGLang --ep-size); divides the server's tp
    port: int = 30000  # first server's port on a node; the next server of the node takes port + 1 ...
    mem_fraction_static: float | None = None  # None: SGLang's default (colocated: 0.5)
    extra_args: list[str] = field(default_factory=list)  # passed to sglang.launch_server verbatim
    container_image: str | None = None
    mounts: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.nodes < 0:
            raise ValueError(f"nodes must be >= 0, got {self.nodes}")
        if self.tp is not None and self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        if self.ep < 1 or (self.tp is not None and self.tp % self.ep):
            raise ValueError(f"ep must be >= 1 and divide tp ({self.tp}), got {self.ep}")
        if not 1024 <= self.port < 65000:
            raise ValueError(f"port must be in 1024..64999, got {self.port}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")

    @property
    def colocated(self) -> bool:
        return self.nodes == 0


@dataclass(kw_only=True, slots=True)
class SandboxGroup:
    nodes: int  # 0: beside the trainer, on its first node's CPUs
    partition: str | None = None  # another partition than the trainer's: a second allocation there
    workers_per_node: int = 32  # sandbox worker processes (one warm zygote each) per node
    port: int = 5555  # broker's client endpoint; workers connect to port + 1
    start_timeout_s: int = 1800  # a second allocation: how long the main job waits for it to start, then fails
    container_image: str | None = None
    mounts: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.nodes < 0:
            raise ValueError(f"nodes must be >= 0, got {self.nodes}")
        if self.workers_per_node < 1:
            raise ValueError(f"workers_per_node must be >= 1, got {self.workers_per_node}")
        if not 1024 <= self.port < 65000:
            raise ValueError(f"port must be in 1024..64999, got {self.port}")
        if self.start_timeout_s < 60:
            raise ValueError(f"start_timeout_s must be >= 60, got {self.start_timeout_s}")


@dataclass(kw_only=True, slots=True)
class Cluster:
    account: str
    partition: str  # the allocation's partition (every group's unless it names its own)
    partitions: dict[str, Partition]
    time: str  # Slurm time limit of the allocation, e.g. "04:00:00"
    container_image: str | None  # pyxis/enroot image with megatron-tir installed (each group may name its own);
    # null: no container, the nodes run the commands from their own environment (env: PATH, PYTHONPATH)
    job_dir: str  # shared folder for nemo-run's sbatch scripts and the groups' logs
    run_root: str  # shared folder for run dirs (<run_root>/<recipe>-<time>)
    trainer: TrainerGroup
    sglang: SGLangGroup
    sandbox: SandboxGroup
    mounts: list[str] = field(default_factory=list)  # pyxis container mounts, "src:dst"
    env: dict[str, str] = field(default_factory=dict)  # every group's environment
    models: dict[str, str] = field(default_factory=dict)  # recipe model name -> path on the cluster
    qos: str | None = None
    master_port: int = 29500  # torchrun rendezvous port on the trainer's first node
    signal_before_end_s: int = 900  # Slurm sends SIGUSR1 this long before the time limit: the trainer ends
    # its step, writes a run checkpoint and exits 0 (a step longer than this is lost; see trainer.checkpoint.minutes)

    def __post_init__(self) -> None:
        for key in ("account", "partition", "time", "job_dir", "run_root"):
            if not str(getattr(self, key)).strip():
                raise ValueError(f"{key} is empty")
        if not self.partitions:
            raise ValueError("partitions is empty")
        if not 0 < self.signal_before_end_s <= 65535:  # sbatch --signal's @N limit
            raise ValueError(f"signal_before_end_s must be in 1..65535, got {self.signal_before_end_s}")
        if self.container_image is None:
            for group in ("trainer", "sglang", "sandbox"):
                if getattr(self, group).container_image:
                    raise ValueError(f"{group}.container_image needs a cluster container_image (nemo-run runs "
                                     "all groups in containers or none)")
        for where, mounts in (("mounts", self.mounts), ("trainer.mounts", self.trainer.mounts),
                              ("sglang.mounts", self.sglang.mounts), ("sandbox.mounts", self.sandbox.mounts)):
            for mount in mounts:
                if ":" not in mount:
                    raise ValueError(f"{where}: {mount!r} is not src:dst")
        for key in list(self.env) + list(self.trainer.env) + list(self.sglang.env) + list(self.sandbox.env):
            if not key.replace("_", "a").isalnum() or key[0].isdigit():
                raise ValueError(f"env: {key!r} is not a variable name")
        self._check_partitions()

    def _check_partitions(self) -> None:
        for group in ("trainer", "sglang", "sandbox"):
            name = self.partition_of(group)
            if name not in self.partitions:
                raise ValueError(f"{group}.partition: {name!r} is not in partitions ({', '.join(self.partitions)})")
        gpu_part = self.partitions[self.partition_of("trainer")]
        if gpu_part.gpus_per_node == 0:
            raise ValueError(f"trainer.partition: {self.partition_of('trainer')!r} has no GPUs")
        if self.sglang.nodes and self.partitions[self.partition_of("sglang")].gpus_per_node == 0:
            raise ValueError(f"sglang.partition: {self.partition_of('sglang')!r} has no GPUs")
        if self.sandbox.nodes and self.partitions[self.partition_of("sandbox")].gpu_only:
            raise ValueError(f"sandbox.partition: {self.partition_of('sandbox')!r} is GPU-only (gpu_only: true); "
                             "the CPU sandbox cannot take nodes there (sandbox.nodes: 0 runs it beside the trainer)")
        if self.sglang.nodes and self.partition_of("sglang") != self.partition_of("trainer"):
            raise ValueError(f"sglang.partition: {self.partition_of('sglang')!r} differs from the trainer's "
                             f"{self.partition_of('trainer')!r}; the trainer and SGLang share one allocation from one "
                             "partition (only the sandbox may run in a second allocation on another partition)")

    def partition_of(self, group: str) -> str:
        return getattr(self, group).partition or self.partition

    def image_of(self, group: str) -> str | None:
        return getattr(self, group).container_image or self.container_image

    def mounts_of(self, group: str) -> list[str]:
        return [*self.mounts, *getattr(self, group).mounts]

    @property
    def node(self) -> Partition:
        """The allocation's node type."""
        return self.partitions[self.partition_of("trainer")]

    @property
    def sandbox_apart(self) -> bool:
        """The sandbox runs in a second allocation on its own partition (not the trainer's)."""
        return bool(self.sandbox.nodes) and self.partition_of("sandbox") != self.partition_of("trainer")

    @property
    def total_nodes(self) -> int:
        """The main allocation's nodes (the sandbox's only when it shares the trainer's partition)."""
        return self.trainer.nodes + self.sglang.nodes + (0 if self.sandbox_apart else self.sandbox.nodes)

    @property
    def sglang_tp(self) -> int:
        return self.sglang.tp or self.node.gpus_per_node

    @property
    def servers_per_node(self) -> int:
        return self.node.gpus_per_node // self.sglang_tp

    def model_path(self, model: str) -> str:
        return self.models.get(model, model)


def colocated_problem(cluster: Cluster) -> str | None:
    """What start-up refuses of a colocated layout: the colocated weight sync runs from the rank
    holding the engine (rank 0) through CUDA IPC, and ``rollout.sync.sglang.check_node_local``
    refuses every server that is not on that rank's node; ``tir-launch`` starts servers on every
    trainer node, so more than one trainer node is refused."""
    if not cluster.sglang.colocated or cluster.trainer.nodes == 1:
        return None
    return (f"colocated SGLang servers (sglang.nodes 0) on {cluster.trainer.nodes} trainer nodes: the colocated weight "
            f"sync (CUDA IPC from rank 0) refuses servers off rank 0's node at start-up; use trainer.nodes 1, or give "
            f"SGLang nodes of its own")


def check_layout(cluster: Cluster, layout: TrainerLayout, *, where: str = "cluster file") -> None:
    """The recipe's parallel layout against the trainer's GPUs and the SGLang servers' split, and
    what start-up would refuse of a colocated layout (also when the planner does not know the model)."""
    gpus = cluster.node.gpus_per_node
    world = cluster.trainer.nodes * gpus
    tp, pp = layout.tp, layout.pp
    if world % (tp * pp):
        raise ValueError(f"{where}: TP x PP = {tp} x {pp} = {tp * pp} does not divide the trainer's "
                         f"{cluster.trainer.nodes} nodes x {gpus} GPUs = {world}")
    if gpus % tp:
        raise ValueError(f"{where}: TP = {tp} must divide the {gpus} GPUs of a node (tensor parallelism stays "
                         "inside a node)")
    if gpus % cluster.sglang_tp:
        raise ValueError(f"{where}: sglang.tp = {cluster.sglang_tp} must divide the {gpus} GPUs of a node")
    if cluster.sglang_tp % cluster.sglang.ep:
        raise ValueError(f"{where}: sglang.ep = {cluster.sglang.ep} must divide the servers' TP ({cluster.sglang_tp})")
    problem = colocated_problem(cluster)
    if problem:
        raise ValueError(f"{where}: {problem}")
    cpus = cluster.partitions[cluster.partition_of("sandbox")].cpus_per_node if cluster.sandbox.nodes \
        else cluster.node.cpus_per_node
    if cluster.sandbox.workers_per_node > cpus:
        raise ValueError(f"{where}: sandbox.workers_per_node = {cluster.sandbox.workers_per_node} exceeds the "
                         f"{cpus} CPUs of a node")


# ----------------------------------------------------------------------------- reading YAML


def load_cluster(path: str | Path) -> Cluster:
    """The cluster file at ``path``; any problem is one ``ValueError`` line naming the file and key."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ValueError(f"cluster file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" (line {mark.line + 1})" if mark is not None else ""
        raise ValueError(f"cluster file {path}: not valid YAML{at}") from None
    try:
        return build(Cluster, data if data is not None else {})
    except ValueError as exc:
        raise ValueError(f"cluster file {path}: {exc}") from None


def cluster_to_dict(cluster: Cluster) -> dict:
    """A YAML/JSON-ready dict that :func:`load_cluster` reads back into the same ``Cluster``."""
    return to_dict(cluster)


def cluster_from_dict(data: dict, *, where: str) -> Cluster:
    try:
        return build(Cluster, data)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
