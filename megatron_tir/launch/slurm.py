"""A run on a Slurm cluster: one nemo-run experiment, one allocation, one ``srun`` step per group.

The allocation asks for every group's nodes at once (``trainer + sglang + sandbox``); a
setup block at the top of the sbatch script cuts ``$SLURM_JOB_NODELIST`` into the groups'
node lists in that order and derives every address the trainer needs from the host names.
A sandbox group on another partition than the trainer's (``sandbox.partition: cpu``) is not
in that allocation: the setup block submits it as a second job there (``sandbox_job_script``),
waits until it runs (``sandbox.start_timeout_s``), reads its hosts, and cancels it when the
main job ends (a loop in the second job ends it too once the main job is gone):

    TIR_TRAINER_NODES / TIR_SGLANG_NODES / TIR_SANDBOX_NODES   each group's hosts
    TIR_MASTER_ADDR      the trainer's first host (torchrun rendezvous)
    TIR_ENGINE_URLS      http://<sglang host>:<port>, one per server (colocated: the trainer's hosts)
    TIR_SANDBOX_ADDRESS  tcp://<first sandbox host>:<port> (sandbox.nodes 0: the trainer's first host)

Each group is a nemo-run task (an inline ``Script``) with its own ``SlurmExecutor``; nemo-run
merges them into one sbatch script with one backgrounded ``srun`` per group and stops the
others when one ends. Each ``srun`` pins its group with ``--nodes/--nodelist`` and runs one
task per node: ``python -m megatron_tir.launch.agent``, which keeps the SGLang servers and
sandbox processes alive and, on trainer nodes, runs ``torchrun`` once (its exit ends the job).
The groups start sandbox first, then SGLang, then the trainer, whose agents wait until the
servers' ``/health`` and the broker answer.

nemo-run limits met here (0.11.1; see launch/README.md): its heterogeneous mode copies
partition/account/time into every component and renders ``gpus_per_node=None`` literally,
so no het job is used; a group's ``env_vars`` are ``export``-ed in the batch shell and leak
into the groups started after it, so per-group variables are set inside each group's
script; ``export KEY=value`` is written unquoted, so values are quoted here.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shlex
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from megatron_tir.launch.cluster import Cluster
from megatron_tir.launch.spec import RunSpec
from megatron_tir.rollout.engines.base import ServerPlan
from megatron_tir.rollout.factory import engine_kind

GROUPS = ("trainer", "sglang", "sandbox")  # the allocation's hosts are cut in this order
SERVER_KIND = "sglang"  # the engine kind (megatron_tir.rollout.factory.ENGINE_KINDS) whose servers the sglang group runs
TASK_NAME = "run"


def _dq(text: str) -> str:
    """``text`` escaped for use inside a bash double-quoted string (no expansion)."""
    for ch in ("\\", '"', "$", "`"):
        text = text.replace(ch, "\\" + ch)
    return text


def node_ranges(cluster: Cluster) -> dict[str, tuple[int, int]]:
    """group -> (first index, count) into the allocation's sorted host list (a sandbox in a second
    allocation counts 0 here)."""
    out, start = {}, 0
    for group in GROUPS:
        count = 0 if group == "sandbox" and cluster.sandbox_apart else getattr(cluster, group).nodes
        out[group] = (start, count)
        start += count
    return out


def setup_lines(cluster: Cluster, spec: RunSpec) -> str:
    """Bash run once in the batch script: the groups' hosts and the addresses derived from them."""
    ranges = node_ranges(cluster)
    t0 = ranges["trainer"][0]
    g0, gn = ranges["sglang"] if not cluster.sglang.colocated else ranges["trainer"]
    s0 = ranges["sandbox"][0] if cluster.sandbox.nodes else t0
    ports = " ".join(str(cluster.sglang.port + i) for i in range(cluster.servers_per_node))
    lines = [
        "# tir-launch: one allocation split among the groups (srun steps, no heterogeneous job)",
        'TIR_NODES=( $(scontrol show hostnames "$SLURM_JOB_NODELIST") )',
        f'if [ "${{#TIR_NODES[@]}}" -ne {cluster.total_nodes} ]; then',
        f'    echo "tir-launch: expected {cluster.total_nodes} nodes, got ${{#TIR_NODES[@]}}" >&2; exit 1',
        "fi",
        'tir_join() { local IFS=,; echo "$*"; }',
    ]
    for group, (first, count) in ranges.items():
        if group == "sandbox" and cluster.sandbox_apart:
            continue  # from the second allocation, below
        value = f'$(tir_join "${{TIR_NODES[@]:{first}:{count}}}")' if count else '""'
        lines.append(f"export TIR_{group.upper()}_NODES={value}")
    lines += [
        f'export TIR_MASTER_ADDR="${{TIR_NODES[{t0}]}}"',
        'TIR_ENGINE_URLS=""',
        f'for host in "${{TIR_NODES[@]:{g0}:{gn}}}"; do',
        f"    for port in {ports}; do",
        '        TIR_ENGINE_URLS="${TIR_ENGINE_URLS:+$TIR_ENGINE_URLS,}http://$host:$port"',
        "    done",
        "done",
        "export TIR_ENGINE_URLS",
        f"export TIR_RUN_DIR={shlex.quote(spec.run_dir)}",
        'mkdir -p "$TIR_RUN_DIR/logs"',
    ]
    if cluster.sandbox_apart:
        lines += sandbox_allocation_lines(cluster, spec)
    else:
        lines += [f'export TIR_SANDBOX_ADDRESS="tcp://${{TIR_NODES[{s0}]}}:{cluster.sandbox.port}"',
                  f'export TIR_SANDBOX_WORKER_ADDRESS="tcp://${{TIR_NODES[{s0}]}}:{cluster.sandbox.port + 1}"']
    lines += [
        f"# Slurm's pre-timeout signal (--signal=B:USR1@{cluster.signal_before_end_s}) reaches this shell; srun passes",
        "# it on to the trainer's agents (the last group), whose trainer ranks checkpoint and exit 0",
        """trap 'echo "tir-launch: SIGUSR1 (time limit near): passed to the trainer"; """
        """kill -USR1 "${pids[${#pids[@]}-1]}"' USR1""",
        'echo "tir-launch: trainer $TIR_TRAINER_NODES | sglang ${TIR_SGLANG_NODES:-colocated} | '
        'sandbox ${TIR_SANDBOX_NODES:-beside the trainer}"',
        'echo "tir-launch: engine $TIR_ENGINE_URLS | sandbox $TIR_SANDBOX_ADDRESS | run dir $TIR_RUN_DIR"',
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the sandbox's own allocation

SANDBOX_JOB_FILE = "sandbox-job.sbatch"  # in RUN_DIR/logs/, written by the main job's setup block
SANDBOX_GROUP_FILE = "sandbox-group.sh"
SANDBOX_JOB_ID_FILE = "sandbox-job.id"
_ALIVE = "RUNNING|COMPLETING|CONFIGURING|SUSPENDED"  # squeue states of a main job that still needs its sandbox


def sandbox_job_script(cluster: Cluster, spec: RunSpec) -> str:
    """The second allocation's batch script: the sandbox group on ``sandbox.partition``'s CPU nodes,
    one agent per node (the group's script, ``RUN_DIR/logs/sandbox-group.sh``), in the group's
    container when the cluster has images. It ends when the main job (``$TIR_MAIN_JOB``, passed in
    its environment) is no longer running: five missed checks a minute apart (a busy controller
    is not a finished job; a requeued main job is pending and submits its own)."""
    part = cluster.partitions[cluster.partition_of("sandbox")]
    nodes = cluster.sandbox.nodes
    flags = {"account": cluster.account, "partition": cluster.partition_of("sandbox"), "qos": cluster.qos,
             "time": cluster.time, "nodes": nodes, "ntasks-per-node": 1, "mem": 0,
             "job-name": f"tir-sandbox-{Path(spec.run_dir).name}",
             "output": f"{spec.run_dir}/logs/sandbox-job-%j.out"}
    srun = ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1",
            f"--cpus-per-task={part.cpus_per_node}", "--kill-on-bad-exit=1"]
    image = cluster.image_of("sandbox")
    if image:
        srun += ["--container-image", shlex.quote(image),
                 "--container-mounts", shlex.quote(",".join(_mounts(cluster, spec, "sandbox")))]
    return "\n".join([
        "#!/bin/bash",
        *(f"#SBATCH --{k}={v}" for k, v in flags.items() if v is not None),
        "#SBATCH --exclusive",
        f"# tir-launch: the sandbox group of {spec.run_dir}, in its own allocation on partition "
        f"{cluster.partition_of('sandbox')!r}; submitted by job $TIR_MAIN_JOB, which cancels it when it ends",
        "set -uo pipefail",
        'TIR_NODES=( $(scontrol show hostnames "$SLURM_JOB_NODELIST") )',
        'export TIR_SANDBOX_NODES=$(IFS=,; echo "${TIR_NODES[*]}")',
        f'export TIR_SANDBOX_WORKER_ADDRESS="tcp://${{TIR_NODES[0]}}:{cluster.sandbox.port + 1}"',
        "(",
        "    misses=0",
        '    while [ "$misses" -lt 5 ]; do',
        "        sleep 60",
        '        case "$(squeue -h -j "$TIR_MAIN_JOB" -o %T 2>/dev/null)" in',
        f"            {_ALIVE}) misses=0 ;;",
        "            *) misses=$((misses + 1)) ;;",
        "        esac",
        "    done",
        '    echo "tir-launch: job $TIR_MAIN_JOB is no longer running: ending the sandbox allocation"',
        '    scancel "$SLURM_JOB_ID"',
        ") &",
        " ".join(srun) + f' bash "$TIR_RUN_DIR/logs/{SANDBOX_GROUP_FILE}"',
    ]) + "\n"


def sandbox_allocation_lines(cluster: Cluster, spec: RunSpec) -> list[str]:
    """Setup-block lines that submit the sandbox's second allocation, wait until it runs and derive
    the broker's address from its first host; the main job cancels it when it ends (EXIT trap), and
    a requeued attempt cancels its predecessor's first. sbatch gets no ``SLURM_*`` / ``SBATCH_*``
    variables of this job (they would set the second job's options)."""
    part = cluster.partition_of("sandbox")
    wait = cluster.sandbox.start_timeout_s
    logs = "$TIR_RUN_DIR/logs"
    return [
        f"# tir-launch: the sandbox group runs in a second allocation on partition {part!r} (CPU nodes)",
        f'cat > "{logs}/{SANDBOX_JOB_FILE}" <<\'TIR_SANDBOX_JOB_EOF\'',
        sandbox_job_script(cluster, spec).rstrip("\n"),
        "TIR_SANDBOX_JOB_EOF",
        f'cat > "{logs}/{SANDBOX_GROUP_FILE}" <<\'TIR_SANDBOX_GROUP_EOF\'',
        sandbox_script(cluster, spec).rstrip("\n"),
        "TIR_SANDBOX_GROUP_EOF",
        f'if [ -s "{logs}/{SANDBOX_JOB_ID_FILE}" ]; then  # a requeued attempt: its predecessor\'s sandbox',
        f'    scancel "$(cat "{logs}/{SANDBOX_JOB_ID_FILE}")" 2>/dev/null || true',
        "fi",
        "TIR_SANDBOX_JOB=$(env $(compgen -e | grep -E '^(SLURM|SBATCH|SRUN)_' | sed 's/^/-u /') "
        f'TIR_MAIN_JOB="$SLURM_JOB_ID" sbatch --parsable "{logs}/{SANDBOX_JOB_FILE}") || {{',
        f'    echo "tir-launch: sbatch refused the sandbox allocation on partition {part}" >&2; exit 1; }}',
        'TIR_SANDBOX_JOB="${TIR_SANDBOX_JOB%%;*}"',
        f'echo "$TIR_SANDBOX_JOB" > "{logs}/{SANDBOX_JOB_ID_FILE}"',
        """trap 'scancel "$TIR_SANDBOX_JOB" 2>/dev/null' EXIT""",
        "tir_waited=0",
        "while :; do",
        '    tir_state=$(squeue -h -j "$TIR_SANDBOX_JOB" -o %T 2>/dev/null)',
        '    case "$tir_state" in',
        "        RUNNING) break ;;",
        '        ""|PENDING|CONFIGURING|REQUEUED|RESIZING) ;;  # not yet (or squeue did not answer)',
        f'        *) echo "tir-launch: the sandbox allocation (job $TIR_SANDBOX_JOB, partition {part}) is $tir_state" >&2; '
        "exit 1 ;;",
        "    esac",
        f'    if [ "$tir_waited" -ge {wait} ]; then',
        f'        echo "tir-launch: the sandbox allocation (job $TIR_SANDBOX_JOB, partition {part}) did not start '
        f'within {wait} s (sandbox.start_timeout_s)" >&2; exit 1',
        "    fi",
        "    sleep 10; tir_waited=$((tir_waited + 10))",
        "done",
        'TIR_SANDBOX_HOSTS=( $(scontrol show hostnames "$(squeue -h -j "$TIR_SANDBOX_JOB" -o %N)") )',
        'export TIR_SANDBOX_NODES=$(tir_join "${TIR_SANDBOX_HOSTS[@]}")',
        f'export TIR_SANDBOX_ADDRESS="tcp://${{TIR_SANDBOX_HOSTS[0]}}:{cluster.sandbox.port}"',
        f'echo "tir-launch: sandbox allocation $TIR_SANDBOX_JOB on $TIR_SANDBOX_NODES (partition {part})"',
    ]


# ----------------------------------------------------------------------------- commands


def trainer_argv(cluster: Cluster, spec: RunSpec) -> tuple[str, str]:
    """(bash lines run before it, the trainer's command line in bash with the setup block's variables).

    A new run's command line chooses at run time: Slurm requeues a job whose node failed
    (nemo-run submits with ``--requeue``), and the job's next attempt finds the run's
    checkpoints; it continues from the last one instead of starting over."""
    gpus = cluster.node.gpus_per_node
    world = cluster.trainer.nodes * gpus
    dp = world // (spec.layout.tp * spec.layout.pp)
    torchrun = (f"torchrun --nnodes={cluster.trainer.nodes} --nproc-per-node={gpus} --rdzv-backend=c10d "
                f'--rdzv-endpoint="$TIR_MASTER_ADDR:{cluster.master_port}" --rdzv-id="$SLURM_JOB_ID" --max-restarts=0')
    before = [f"# torchrun: {cluster.trainer.nodes} nodes x {gpus} GPUs = {world} ranks = "
              f"TP {spec.layout.tp} x PP {spec.layout.pp} x DP {dp}"]
    if spec.resume:
        before.append('source=(--resume "$TIR_RUN_DIR")')
    else:
        before += ["# a requeued attempt of this job continues from the run's last checkpoint",
                   f'source=(--recipe {shlex.quote(spec.recipe)} --out "$TIR_RUN_DIR")',
                   'if [ -e "$TIR_RUN_DIR/checkpoints/latest" ]; then source=(--resume "$TIR_RUN_DIR"); fi']
    train = 'megatron_tir.cli train "${source[@]}"'
    sets = ["--set " + shlex.quote(o) for o in spec.overrides]
    if not spec.resume and cluster.model_path(spec.layout.model) != spec.layout.model:
        sets.append("--set " + shlex.quote(f"model={cluster.model_path(spec.layout.model)}"))
    sets += [f"--set learner.tp={spec.layout.tp}", f"--set learner.pp={spec.layout.pp}", f"--set engine.kind={SERVER_KIND}",
             '--set "engine.urls=$TIR_ENGINE_URLS"',
             f"--set engine.colocated={'true' if cluster.sglang.colocated else 'false'}",
             '--set "sandbox.address=$TIR_SANDBOX_ADDRESS"']
    return "\n".join(before), " \\\n    ".join([torchrun + " -m " + train, *sets])


def sglang_services(cluster: Cluster, model: str, *, routed_experts: bool = False) -> list[str]:
    """``--service`` arguments (bash words) for this node's SGLang servers (the commands are the
    engine kind's: ``EngineKind.servers``); ``routed_experts``: the rollouts ask for them."""
    colocated = cluster.sglang.colocated
    mem = cluster.sglang.mem_fraction_static or (0.5 if colocated else 0.85)
    plan = ServerPlan(model_path=cluster.model_path(model), host="0.0.0.0", first_port=cluster.sglang.port,
                      count=cluster.servers_per_node, tp=cluster.sglang_tp, mem_fraction_static=mem,
                      colocated=colocated, python="python", extra_args=tuple(cluster.sglang.extra_args),
                      ep=cluster.sglang.ep, routed_experts=routed_experts)
    return [f'--service "{name}={_dq(shlex.join(argv))}"' for name, argv in engine_kind(SERVER_KIND).servers(plan)]


def sandbox_services(cluster: Cluster, *, head: bool) -> list[str]:
    words = []
    if head:
        words.append(f'--service "sandbox-broker=sandbox-cluster broker --bind tcp://0.0.0.0:{cluster.sandbox.port}"')
    words.append(f'--service "sandbox-worker=sandbox-cluster worker --connect $TIR_SANDBOX_WORKER_ADDRESS '
                 f'--slots {cluster.sandbox.workers_per_node} --name $(hostname -s)"')
    return words


def _script(group: str, cluster: Cluster, body: list[str]) -> str:
    env = {**cluster.env, **getattr(cluster, group).env}
    lines = [f"# tir-launch: {group} group, one agent per node", "set -euo pipefail"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    lines.append(f'agent=(python -m megatron_tir.launch.agent --log-dir "$TIR_RUN_DIR/logs/{group}-$(hostname -s)")')
    return "\n".join(lines + body) + "\n"


def trainer_script(cluster: Cluster, spec: RunSpec) -> str:
    body = []
    if cluster.sglang.colocated:
        body.append("# SGLang colocated on this node's GPUs (memory released while the trainer trains)")
        body.append("agent+=(" + " ".join(sglang_services(cluster, spec.layout.model, routed_experts=spec.layout.routed_experts)) + ")")
    if cluster.sandbox.nodes == 0:
        body += ["# the sandbox beside the trainer, on the first trainer node's CPUs",
                 'if [ "$SLURM_PROCID" = 0 ]; then agent+=(' + " ".join(sandbox_services(cluster, head=True)) + "); fi"]
    before, command = trainer_argv(cluster, spec)
    body += ['agent+=(--wait-http "$TIR_ENGINE_URLS" --wait-tcp "$TIR_SANDBOX_ADDRESS")', before,
             'exec "${agent[@]}" -- ' + command]
    return _script("trainer", cluster, body)


def sglang_script(cluster: Cluster, spec: RunSpec) -> str:
    return _script("sglang", cluster, [
        f"# {cluster.servers_per_node} server(s) of TP {cluster.sglang_tp} per node",
        "agent+=(" + " ".join(sglang_services(cluster, spec.layout.model, routed_experts=spec.layout.routed_experts)) + ")",
        'exec "${agent[@]}"'])


def sandbox_script(cluster: Cluster, spec: RunSpec) -> str:
    return _script("sandbox", cluster, [
        "# the broker on the group's first node, a worker on every node",
        'if [ "$SLURM_PROCID" = 0 ]; then agent+=(' + " ".join(sandbox_services(cluster, head=True)[:1]) + "); fi",
        "agent+=(" + " ".join(sandbox_services(cluster, head=False)) + ")",
        'exec "${agent[@]}"'])


# ----------------------------------------------------------------------------- nemo-run


def _mounts(cluster: Cluster, spec: RunSpec, group: str) -> list[str]:
    """The group's mounts, plus the run dir's parent at its own path unless a mount already
    shows it there (the run dir is a host path in every group's command line)."""
    mounts = cluster.mounts_of(group)
    run_parent = Path(spec.run_dir).parent
    same_path = [Path(src) for src, dst, *_ in (m.split(":") for m in mounts) if src == dst]
    if not any(run_parent == p or p in run_parent.parents for p in same_path):
        mounts.append(f"{run_parent}:{run_parent}")
    return mounts


def experiments_dir(cluster: Cluster) -> str:
    """Where nemo-run keeps the experiment (sbatch script, group scripts, srun logs).

    With a ``LocalTunnel`` nemo-run copies nothing: it submits the files it wrote into the
    experiment's local folder from the tunnel's folder, so the two must be the same path;
    the experiment's ``base_dir`` is ``job_dir`` and nemo-run appends ``experiments/``."""
    return os.path.join(cluster.job_dir, "experiments")


def _executor(cluster: Cluster, spec: RunSpec, group: str):
    import nemo_run as run
    from nemo_run.core.tunnel.client import LocalTunnel

    count = node_ranges(cluster)[group][1]
    srun_args = [f"--nodes={count}", f"--ntasks={count}", "--ntasks-per-node=1",
                 f"--nodelist=$TIR_{group.upper()}_NODES", f"--cpus-per-task={cluster.node.cpus_per_node}"]
    if group == "sandbox":
        srun_args.append("--gres=gpu:0")  # no GPUs for this step ("--gres=none" is refused when the job asked --gpus-per-node)
    return run.SlurmExecutor(
        account=cluster.account, partition=cluster.partition_of("trainer"), qos=cluster.qos, time=cluster.time,
        signal=f"B:USR1@{cluster.signal_before_end_s}",
        nodes=cluster.total_nodes, ntasks_per_node=1, gpus_per_node=cluster.node.gpus_per_node, exclusive=True,
        mem="0", container_image=cluster.image_of(group), container_mounts=_mounts(cluster, spec, group),
        env_vars={k: shlex.quote(v) for k, v in cluster.env.items()}, srun_args=srun_args,
        setup_lines=setup_lines(cluster, spec), job_name_prefix="tir-", tunnel=LocalTunnel(job_dir=experiments_dir(cluster)),
        packager=run.Packager(), wait_time_for_group_job=5, monitor_group_job_wait_time=30)


def add_tasks(exp, cluster: Cluster, spec: RunSpec) -> list[str]:
    """The run's groups as one nemo-run task group of ``exp``: one task per group with nodes, sandbox
    first; returns the groups in task order."""
    import nemo_run as run

    groups = [g for g in ("sandbox", "sglang") if getattr(cluster, g).nodes
              and not (g == "sandbox" and cluster.sandbox_apart)] + ["trainer"]
    scripts = {"trainer": trainer_script, "sglang": sglang_script, "sandbox": sandbox_script}
    exp.add([run.Script(inline=scripts[g](cluster, spec)) for g in groups],
            executor=[_executor(cluster, spec, g) for g in groups], name=TASK_NAME)
    return groups


def _title(spec: RunSpec) -> str:
    return f"tir-{Path(spec.run_dir).name}"


@contextlib.contextmanager
def _no_stdin():
    saved = sys.stdin
    with open(os.devnull) as sys.stdin:
        try:
            yield
        finally:
            sys.stdin = saved


@dataclass(kw_only=True, slots=True, frozen=True)
class Rendered:
    sbatch: str  # the batch script
    scripts: dict[str, str]  # group -> its inline script (nemo-run runs it as /nemo_run/scripts/<job>.sh)
    script_names: dict[str, str]  # group -> that file's name


def render(cluster: Cluster, spec: RunSpec) -> Rendered:
    """The sbatch script nemo-run would submit and the groups' scripts, rendered without a
    cluster (nemo-run's dryrun)."""
    import nemo_run as run

    # nemo-run packages through invoke, which reads stdin while its commands run: give it none.
    with tempfile.TemporaryDirectory(prefix="tir-launch-dryrun-") as tmp, _no_stdin():
        with run.Experiment(_title(spec), base_dir=tmp, log_level="WARN", clean_mode=True) as exp:
            exp._skip_status_at_exit = True
            groups = add_tasks(exp, cluster, spec)
            exp.dryrun(log=False, delete_exp_dir=False)
        (path,) = glob.glob(os.path.join(tmp, "**", "*_sbatch.sh"), recursive=True)
        sbatch = Path(path).read_text()
        scripts, names = {}, {}
        for group, script in zip(groups, sorted(glob.glob(os.path.join(tmp, "**", "scripts", "*.sh"), recursive=True),
                                                key=lambda p: int(Path(p).stem.rsplit("-", 1)[1])), strict=True):
            scripts[group] = Path(script).read_text()
            names[group] = Path(script).name
        return Rendered(sbatch=sbatch, scripts=scripts, script_names=names)


def submit(cluster: Cluster, spec: RunSpec) -> str:
    """Submit the run with sbatch (from a login node: nemo-run's LocalTunnel); returns the
    experiment id. A refused submission is a ValueError with sbatch's own last line."""
    import invoke
    import nemo_run as run

    try:
        with _no_stdin(), run.Experiment(_title(spec), base_dir=cluster.job_dir, log_level="WARN") as exp:
            add_tasks(exp, cluster, spec)
            exp.run(detach=True)
            return exp._id
    except invoke.exceptions.UnexpectedExit as exc:
        lines = (exc.result.stderr or exc.result.stdout or "").strip().splitlines()
        raise ValueError(f"sbatch refused the job: {lines[-1] if lines else f'exit status {exc.result.exited}'}") from None
