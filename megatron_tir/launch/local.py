"""A run on this machine through nemo-run's LocalExecutor (the embedded default, or one GPU node).

A recipe that generates with SGLang servers (the GPU recipes) runs on this node's GPUs instead:
:func:`gpu_node_script` (:mod:`megatron_tir.launch.gpu_node`) splits them between the servers and
``torchrun``, with the same checks as a Slurm launch.

One nemo-run task runs the node agent: the sandbox cluster (``sandbox-cluster serve`` on a
free loopback port) as a restarted service, and the trainer (``megatron-tir train`` with
its in-process engine) as the main command once the broker answers. The trainer's exit
ends the task; the sandbox is stopped with it.

Where things are: the run dir (``config.json``, ``metrics.jsonl``, ``checkpoints/``), the
agent's logs in ``RUN_DIR/logs/`` (``main.log``, ``sandbox.log``, ``main.exit``), and
nemo-run's copy of the task's output under ``$NEMORUN_HOME/experiments/`` (printed).
"""

from __future__ import annotations

import glob
import logging
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron_tir.launch.spec import RunSpec
from megatron_tir.ports import free_port

log = logging.getLogger(__name__)



def local_script(spec: RunSpec, *, sandbox_port: int, python: str = sys.executable) -> str:
    """The task's bash script: the agent with the sandbox as a service and the trainer as main."""
    address = f"tcp://127.0.0.1:{sandbox_port}"
    sandbox = [python, "-m", "sandbox_cluster.cli", "serve", "--bind", address,
               "--workers", str(spec.layout.sandbox_workers)]
    if spec.resume:
        train = [python, "-m", "megatron_tir.cli", "train", "--resume", spec.run_dir]
    else:
        train = [python, "-m", "megatron_tir.cli", "train", "--recipe", spec.recipe, "--out", spec.run_dir]
    for override in [*spec.overrides, f"sandbox.address={address}"]:
        train += ["--set", override]
    agent = [python, "-m", "megatron_tir.launch.agent", "--log-dir", str(Path(spec.run_dir) / "logs"),
             "--service", "sandbox=" + shlex.join(sandbox), "--wait-tcp", address, "--wait-timeout", "300"]
    return "\n".join(["# tir-launch: the sandbox cluster and the trainer on this machine", "set -euo pipefail",
                      f"exec {shlex.join(agent)} \\\n    -- {shlex.join(train)}", ""])


@dataclass(kw_only=True, slots=True, frozen=True)
class LocalResult:
    exit_code: int
    run_dir: str
    task_log: str | None  # nemo-run's log of the task


def gpu_node_script(spec: RunSpec, *, sglang_gpus: int | None = None, sglang_tp: int | None = None,
                    allow: bool = False) -> str | None:
    """The one-GPU-node script of ``spec`` (:mod:`megatron_tir.launch.gpu_node`) when its recipe generates
    with SGLang servers (``engine.kind=sglang``: the GPU recipes), after the cluster file's checks on this
    node; None for a recipe of the in-process engine (the CPU path). ValueError (one line) when such a
    recipe meets a machine without GPUs, or a node that cannot hold it."""
    from megatron_tir.launch.gpu_node import check_node, detect_gpus, gpu_script, node_layout
    from megatron_tir.launch.layout import train_config
    from megatron_tir.rollout.factory import engine_kind

    cfg = train_config(recipe=None if spec.resume else spec.recipe, run_dir=spec.run_dir if spec.resume else None,
                       overrides=spec.overrides)
    if engine_kind(cfg.engine.kind).servers is None:  # the engine runs inside the trainer
        if sglang_gpus is not None or sglang_tp is not None:
            raise ValueError(f"--sglang-gpus / --sglang-tp: recipe {spec.recipe} uses the in-process engine "
                             "(engine.kind=local), no SGLang server")
        return None
    node = detect_gpus()
    if node is None:
        raise ValueError(f"recipe {spec.recipe} generates with SGLang servers on GPUs and this machine has none "
                         "(no CUDA_VISIBLE_DEVICES, no nvidia-smi): run it on a GPU node or with --executor slurm")
    layout = node_layout(node, tp=cfg.learner.tp, pp=cfg.learner.pp, sglang_gpus=sglang_gpus, sglang_tp=sglang_tp,
                         sandbox_workers=cfg.sandbox.workers)
    from megatron_tir.train.config import apply_overrides

    # what the trainer will be told (megatron_tir.launch.gpu_node.gpu_script), validated here: e.g.
    # trainer.async with colocated servers is refused before anything starts
    cfg = apply_overrides(cfg, [f"engine.colocated={'true' if layout.colocated else 'false'}"])
    check_node(layout, cfg, allow=allow)
    return gpu_script(spec, layout, model_path=cfg.model, engine=cfg.engine.kind)


def run_local(spec: RunSpec, *, tail_logs: bool = True, base_dir: str | None = None,
              script: str | None = None) -> LocalResult:
    """Run ``spec`` to completion through nemo-run's LocalExecutor (experiment files under
    ``base_dir``, default ``$NEMORUN_HOME/experiments``); ``script``: the one-GPU-node script
    (:func:`gpu_node_script`) instead of the CPU path's."""
    import nemo_run as run

    Path(spec.run_dir, "logs").mkdir(parents=True, exist_ok=True)
    exit_file = Path(spec.run_dir, "logs", "main.exit")
    exit_file.unlink(missing_ok=True)
    env = {k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ}
    executor = run.LocalExecutor(ntasks_per_node=1, env_vars=env)
    script = run.Script(inline=script or local_script(spec, sandbox_port=free_port()))
    with run.Experiment(f"tir-{Path(spec.run_dir).name}", executor=executor, base_dir=base_dir,
                        log_level="WARN") as exp:
        exp._skip_status_at_exit = True
        exp.add(script, name="trainer")
        exp.run(sequential=True, tail_logs=tail_logs)
        exp_dir = exp._exp_dir
    logs = sorted(glob.glob(os.path.join(exp_dir, "**", "combined.log"), recursive=True))  # stdout + stderr
    try:
        code = int(exit_file.read_text())
    except (OSError, ValueError):
        code = 1  # the agent did not get to run the trainer (it logged why)
    return LocalResult(exit_code=code, run_dir=spec.run_dir, task_log=logs[-1] if logs else None)
