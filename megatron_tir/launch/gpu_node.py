"""One GPU node without Slurm: ``tir-launch --executor local`` on a machine with GPUs.

    tir-launch --recipe qwen2.5-7b-simpletir --executor local --set model=/models/Qwen2.5-7B --dryrun
    tir-launch --recipe qwen2.5-7b-simpletir --executor local --sglang-gpus 0     # colocated

The node's GPUs (``$CUDA_VISIBLE_DEVICES`` when set, else ``nvidia-smi``) are split: the SGLang
servers take the first ``--sglang-gpus`` (default half, or all colocated on an odd count; servers of
the recipe's TP, i.e. TP 4 for the 7B recipe), ``torchrun`` the rest (``CUDA_VISIBLE_DEVICES`` narrowed to them), the sandbox
cluster runs on the CPUs beside them (broker + workers: ``sandbox-cluster serve``).
``--sglang-gpus 0`` colocates the servers on all GPUs (memory released while the trainer trains).
The node is checked the way a cluster file is: it becomes a one-node :class:`Cluster` whose
partition has the trainer's GPUs, so :func:`~megatron_tir.launch.cluster.check_layout` and the
capacity planner (:func:`~megatron_tir.launch.plan.plan_run`) run unchanged before anything starts.
One agent (:mod:`megatron_tir.launch.agent`) keeps the servers and the sandbox alive and runs
the trainer once they answer, as on a Slurm node; ``--dryrun`` prints its script.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron_tir.launch.cluster import Cluster, Partition, SandboxGroup, SGLangGroup, TrainerGroup, check_layout
from megatron_tir.launch.spec import RunSpec

SGLANG_PORT = 30000
SANDBOX_PORT = 5555
DEFAULT_GPU_MEMORY_GIB = 80.0  # an H100 when nvidia-smi cannot say (a CUDA_VISIBLE_DEVICES-only node)


@dataclass(kw_only=True, slots=True, frozen=True)
class GpuNode:
    """This machine's GPUs (device ids as CUDA names them), memory per GPU, CPUs."""
    devices: tuple[str, ...]
    memory_gib: float
    cpus: int


def detect_gpus(env: dict[str, str] | None = None) -> GpuNode | None:
    """The GPUs this process may use: ``$CUDA_VISIBLE_DEVICES`` when set (empty or ``-1``: none),
    else ``nvidia-smi``'s list; None when there are none."""
    env = os.environ if env is None else env
    memory = _nvidia_smi_memory()
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        devices = tuple(d.strip() for d in visible.split(",") if d.strip())
        if not devices or devices[0] == "-1":
            return None
    elif memory:
        devices = tuple(str(i) for i in range(len(memory)))
    else:
        return None
    return GpuNode(devices=devices, memory_gib=min(memory) if memory else DEFAULT_GPU_MEMORY_GIB,
                   cpus=os.cpu_count() or 1)


def _nvidia_smi_memory() -> list[float]:
    """Total memory of each GPU in GiB (nvidia-smi), [] without a working nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return [float(x) / 1024 for x in out.split()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return []


@dataclass(kw_only=True, slots=True, frozen=True)
class NodeLayout:
    """Which GPUs serve and which train, and the one-node cluster the checks read."""
    node: GpuNode
    sglang_devices: tuple[str, ...]  # () when colocated
    trainer_devices: tuple[str, ...]
    sglang_tp: int
    cluster: Cluster

    @property
    def colocated(self) -> bool:
        return not self.sglang_devices

    @property
    def servers(self) -> int:
        return len(self.sglang_devices or self.trainer_devices) // self.sglang_tp

    @property
    def engine_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{SGLANG_PORT + i}" for i in range(self.servers)]


def node_layout(node: GpuNode, *, tp: int, pp: int, sglang_gpus: int | None, sglang_tp: int | None,
                sandbox_workers: int) -> NodeLayout:
    """Split ``node`` between SGLang and the trainer; ValueError (one line) when it cannot hold the recipe."""
    n = len(node.devices)
    k = (n // 2 if n % 2 == 0 else 0) if sglang_gpus is None else sglang_gpus  # odd: colocated
    if k not in (0, n // 2) or (k and n % 2):
        raise ValueError(f"--sglang-gpus {k}: a node's {n} GPUs are shared (0: colocated) or split in two equal "
                         f"halves ({n // 2} if n is even)")
    trainer = node.devices[k:]
    stp = sglang_tp or min(tp, len(trainer))
    if len(trainer) % stp:
        raise ValueError(f"--sglang-tp {stp} must divide the {len(trainer)} GPUs SGLang gets")
    cluster = Cluster(
        account="local", partition="node", time="365-00:00:00", container_image=None, job_dir=".", run_root=".",
        partitions={"node": Partition(gpus_per_node=len(trainer), cpus_per_node=node.cpus,
                                      gpu_memory_gib=node.memory_gib)},
        trainer=TrainerGroup(nodes=1), sglang=SGLangGroup(nodes=1 if k else 0, tp=stp, port=SGLANG_PORT),
        sandbox=SandboxGroup(nodes=0, workers_per_node=min(sandbox_workers, node.cpus), port=SANDBOX_PORT))
    return NodeLayout(node=node, sglang_devices=node.devices[:k], trainer_devices=trainer, sglang_tp=stp,
                      cluster=cluster)


def check_node(layout: NodeLayout, cfg, *, allow: bool = False) -> None:
    """The cluster file's checks on this node: the parallel layout and the capacity plan."""
    from megatron_tir.launch.layout import TrainerLayout
    from megatron_tir.launch.plan import check_plan, plan_run

    where = (f"this node ({len(layout.node.devices)} GPUs: {len(layout.sglang_devices)} for SGLang, "
             f"{len(layout.trainer_devices)} for the trainer)")
    check_layout(layout.cluster, TrainerLayout(model=cfg.model, tp=cfg.learner.tp, pp=cfg.learner.pp,
                                               sandbox_workers=cfg.sandbox.workers), where=where)
    check_plan(plan_run(cfg, layout.cluster), where=where, allow=allow)


def gpu_script(spec: RunSpec, layout: NodeLayout, *, model_path: str, python: str = sys.executable,
               engine: str = "sglang") -> str:
    """The node's bash script: one agent keeping the SGLang servers and the sandbox alive, and torchrun.
    ``engine``: the engine kind whose servers run (``EngineKind.servers`` renders their commands)."""
    from megatron_tir.rollout.engines.base import ServerPlan
    from megatron_tir.rollout.factory import engine_kind

    sandbox_address = f"tcp://127.0.0.1:{SANDBOX_PORT}"
    visible = ",".join(layout.node.devices)
    logs = str(Path(spec.run_dir) / "logs")
    agent = [python, "-m", "megatron_tir.launch.agent", "--log-dir", logs]
    lines = ["# tir-launch: one GPU node, no Slurm", "set -euo pipefail",
             f"# GPUs {visible}: SGLang " + (f"on {','.join(layout.sglang_devices)}" if layout.sglang_devices
                                             else "colocated on all of them")
             + f" ({layout.servers} server(s) of TP {layout.sglang_tp}), the trainer on "
             f"{','.join(layout.trainer_devices)}, the sandbox on the CPUs"]
    if not Path(model_path).is_dir():
        lines.append(f"# model {model_path!r} is not a directory here: SGLang and the trainer load it by that name "
                     f"(--set model=/path/to/its/hf/dir for local weights)")
    plan = ServerPlan(model_path=model_path, host="127.0.0.1", first_port=SGLANG_PORT, count=layout.servers,
                      tp=layout.sglang_tp, mem_fraction_static=0.5 if layout.colocated else 0.85,
                      colocated=layout.colocated, python=python, routed_experts=spec.layout.routed_experts)
    env = f"CUDA_VISIBLE_DEVICES={','.join(layout.sglang_devices) or visible}"
    for name, argv in engine_kind(engine).servers(plan):
        agent += ["--service", f"{name}=env {env} " + shlex.join(argv)]
    sandbox = [python, "-m", "sandbox_cluster.cli", "serve", "--bind", sandbox_address,
               "--workers", str(layout.cluster.sandbox.workers_per_node)]
    agent += ["--service", "sandbox=" + shlex.join(sandbox), "--wait-http", ",".join(layout.engine_urls),
              "--wait-tcp", sandbox_address]
    n_train = len(layout.trainer_devices)
    source = ["--resume", spec.run_dir] if spec.resume else ["--recipe", spec.recipe, "--out", spec.run_dir]
    sets = [*spec.overrides, f"engine.kind={engine}", f"engine.urls={','.join(layout.engine_urls)}",
            f"engine.colocated={'true' if layout.colocated else 'false'}", f"sandbox.address={sandbox_address}"]
    train = ["env", f"CUDA_VISIBLE_DEVICES={','.join(layout.trainer_devices)}", python, "-m",
             "torch.distributed.run", "--standalone", f"--nproc-per-node={n_train}", "-m", "megatron_tir.cli",
             "train", *source]
    for s in sets:
        train += ["--set", s]
    lines.append(f"exec {shlex.join(agent)} \\\n    -- {shlex.join(train)}")
    return "\n".join(lines) + "\n"
