"""``tir-launch``: start (or continue) a training run on this machine or on a Slurm cluster.

    tir-launch --recipe tiny-cpu --executor local
    tir-launch --recipe qwen2.5-32b-simpletir --executor slurm --cluster launch/examples/h100.yaml --dryrun
    tir-launch --resume RUN_DIR --set rollout.max_turns=10 --set rollout.max_response_tokens=24576
    tir-launch plan --recipe qwen2.5-32b-simpletir --cluster launch/examples/h100.yaml [--allow]

``plan`` prints the capacity plan (memory per trainer stage and SGLang server, the colocated
generation phase, weight sync, sandbox slots, step time, steps per allocation, time to the first
checkpoint) and exits 2 when the run does not fit; a Slurm launch runs the same checks before it
submits. ``--allow`` (both) turns the time refusals (an allocation that cannot finish one step
and one checkpoint, or writes no checkpoint) into warnings.

User errors print ``tir-launch: error: <one line>`` and exit 2; a local run exits with the
trainer's exit status.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from megatron_tir.launch.cluster import Cluster, check_layout, load_cluster
from megatron_tir.launch.layout import trainer_layout
from megatron_tir.launch.spec import LAUNCH_RECORD, LaunchRecord, RunSpec, read_record, write_record

log = logging.getLogger("megatron_tir.launch")

LOCAL_RUN_ROOT = "runs"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tir-launch", description=__doc__.split("\n")[0].replace("``", ""),
                                usage="tir-launch [options]  |  tir-launch plan --recipe R --cluster FILE [--allow]",
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.split("\n")[1:6]))
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--recipe", help="training recipe (megatron-tir train --recipe); with --resume: the run's")
    p.add_argument("--executor", choices=["local", "slurm"], help="where to run (with --resume: the run's)")
    p.add_argument("--cluster", help="cluster file (YAML, see launch/examples/h100.yaml); slurm only")
    p.add_argument("--out", help="run dir (default: runs/<recipe>-<time> here, <run_root>/<recipe>-<time> on Slurm)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue this run on the same layout")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="training config override, passed to megatron-tir train (repeatable)")
    p.add_argument("--dryrun", action="store_true", help="print what would run (slurm: the sbatch script) and exit")
    p.add_argument("--sglang-gpus", type=int, metavar="N", help="local, GPU recipes: GPUs of this node for the SGLang "
                   "servers (default: half; 0: colocated with the trainer on all of them)")
    p.add_argument("--sglang-tp", type=int, metavar="N", help="local, GPU recipes: GPUs per SGLang server (default: "
                   "the recipe's learner.tp)")
    p.add_argument("--emit-sbatch", metavar="FILE", help="write the sbatch script (and its group scripts next to "
                   "it, FILE.<group>.sh) without submitting")
    p.add_argument("--allow", action="store_true", help="launch although the allocation cannot finish one step and "
                   "one checkpoint (the capacity plan's time refusals become warnings)")
    return p


def _run_name(recipe: str) -> str:
    return f"{recipe}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"


def _plan(args) -> tuple[str, RunSpec, Cluster | None]:
    """(executor, what to run, the Slurm layout) from the arguments; ValueError on a user error."""
    if args.resume:
        record = read_record(args.resume)
        for flag, given, recorded in (("--recipe", args.recipe, record.recipe),
                                      ("--executor", args.executor, record.executor)):
            if given is not None and given != recorded:
                raise ValueError(f"{flag} {given} differs from the run's {recorded} ({args.resume}/{LAUNCH_RECORD})")
        if args.cluster:
            raise ValueError(f"--resume reuses the layout in {args.resume}/{LAUNCH_RECORD}; --cluster is not taken "
                             "with it")
        if args.out:
            raise ValueError("--resume continues in RUN_DIR; --out is not taken with it")
        executor, recipe, cluster = record.executor, record.recipe, record.cluster
        layout = trainer_layout(run_dir=args.resume, overrides=args.overrides)
        run_dir = str(Path(args.resume).absolute())
    else:
        if not args.recipe:
            raise ValueError("give --recipe NAME (or --resume RUN_DIR)")
        if not args.executor:
            raise ValueError("give --executor local|slurm")
        executor, recipe = args.executor, args.recipe
        layout = trainer_layout(recipe=recipe, overrides=args.overrides)
        cluster = None
        if executor == "slurm":
            if not args.cluster:
                raise ValueError("--executor slurm needs --cluster FILE (see launch/examples/h100.yaml)")
            cluster = load_cluster(args.cluster)
        elif args.cluster:
            raise ValueError("--cluster is for --executor slurm")
        root = cluster.run_root if cluster is not None else LOCAL_RUN_ROOT
        run_dir = str(Path(args.out or Path(root) / _run_name(recipe)).absolute())
    if cluster is not None:
        where = args.cluster or f"{args.resume}/{LAUNCH_RECORD}"
        check_layout(cluster, layout, where=where)
        _check_overlap(args, cluster, where)
        _check_capacity(args, cluster, where)
    elif args.emit_sbatch:
        raise ValueError("--emit-sbatch is for --executor slurm")
    elif layout.tp * layout.pp > 1 and not _fits_this_node(args, layout.tp * layout.pp):
        raise ValueError(f"recipe {recipe} needs TP x PP = {layout.tp * layout.pp} GPUs; run it with --executor slurm")
    spec = RunSpec(recipe=recipe, layout=layout, run_dir=run_dir, resume=bool(args.resume),
                   overrides=tuple(args.overrides))
    return executor, spec, cluster


def _fits_this_node(args, gpus: int) -> bool:
    """A GPU recipe (SGLang servers) whose TP x PP this node's GPUs hold: ``--executor local`` runs it here
    (launch/gpu_node.py checks the rest)."""
    from megatron_tir.launch.gpu_node import detect_gpus
    from megatron_tir.launch.layout import train_config
    from megatron_tir.rollout.factory import engine_kind

    cfg = train_config(recipe=None if args.resume else args.recipe, run_dir=args.resume, overrides=args.overrides)
    node = detect_gpus()
    return engine_kind(cfg.engine.kind).servers is not None and node is not None and gpus <= len(node.devices)


def _check_overlap(args, cluster: Cluster, where: str) -> None:
    """The trainer's refusal of asynchronous training with colocated engines, before the job is queued."""
    from megatron_tir.launch.layout import train_config

    cfg = train_config(recipe=None if args.resume else args.recipe, run_dir=args.resume, overrides=args.overrides)
    mode = cfg.trainer.asynchrony.mode
    if cluster.sglang.colocated and mode != "off":
        raise ValueError(f"trainer.async={mode} cannot overlap with colocated SGLang servers ({where}: sglang.nodes "
                         f"0 sets engine.colocated=true): generation and training share the GPUs (give SGLang its own "
                         f"nodes, or trainer.async=off)")


def _check_capacity(args, cluster: Cluster, where: str) -> None:
    """The capacity planner's checks (ValueError when the run does not fit); a model whose shape is
    unknown here is only warned about."""
    from megatron_tir.launch.layout import train_config
    from megatron_tir.launch.plan import check_plan, plan_run

    cfg = train_config(recipe=None if args.resume else args.recipe, run_dir=args.resume, overrides=args.overrides)
    try:
        plan = plan_run(cfg, cluster)
    except ValueError as exc:
        log.warning("capacity plan skipped: %s", exc)
        return
    check_plan(plan, where=where, allow=args.allow)


def plan_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="tir-launch plan", description="the capacity plan of a recipe on a cluster file")
    p.add_argument("--recipe", required=True)
    p.add_argument("--cluster", required=True, help="cluster file (YAML, see launch/examples/h100.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--allow", action="store_true", help="time refusals (no step and checkpoint within the "
                   "allocation) become warnings: exit 0 unless something else does not fit")
    args = p.parse_args(argv)
    from megatron_tir.launch.layout import train_config
    from megatron_tir.launch.plan import plan_run

    try:
        cfg = train_config(recipe=args.recipe, overrides=args.overrides)
        cluster = load_cluster(args.cluster)
        plan = plan_run(cfg, cluster)
    except ValueError as exc:
        p.error(str(exc))
    print(f"tir-launch plan --recipe {args.recipe} --cluster {args.cluster}"
          + "".join(f" --set {o}" for o in args.overrides) + (" --allow" if args.allow else ""))
    print(plan.table(allow=args.allow))
    return 2 if plan.refusals(allow=args.allow) else 0


def _slurm(args, spec: RunSpec, cluster: Cluster) -> int:
    from megatron_tir.launch import slurm

    if args.dryrun or args.emit_sbatch:
        rendered = slurm.render(cluster, spec)
        if args.emit_sbatch:
            path = Path(args.emit_sbatch)
            path.write_text(rendered.sbatch)
            for group, text in rendered.scripts.items():
                path.with_name(f"{path.name}.{group}.sh").write_text(text)
            print(f"wrote {path} and its group scripts {path.name}.<group>.sh "
                  f"({', '.join(rendered.scripts)})")
        if args.dryrun:
            print(rendered.sbatch)
            for group, text in rendered.scripts.items():
                print(f"# ---------- {rendered.script_names[group]} ({group} group, run by its srun line)")
                print(text)
        return 0
    write_record(spec.run_dir, LaunchRecord(executor="slurm", recipe=spec.recipe, cluster=cluster))
    exp_id = slurm.submit(cluster, spec)  # ValueError when sbatch refuses the job
    exp_dir = Path(slurm.experiments_dir(cluster), exp_id.rsplit("_", 1)[0], exp_id)
    print(f"submitted experiment {exp_id}\n  run dir: {spec.run_dir}\n  agents' logs: {spec.run_dir}/logs/"
          f"<group>-<host>/\n  sbatch script and srun logs: {exp_dir}/ (nemo experiment status {exp_id}, "
          f"with NEMORUN_HOME={cluster.job_dir})")
    return 0


def _local(args, spec: RunSpec) -> int:
    from megatron_tir.launch.local import gpu_node_script, local_script, run_local
    from megatron_tir.ports import free_port

    try:  # a GPU recipe: SGLang servers and torchrun on this node's GPUs, checked as a cluster file is
        gpu = gpu_node_script(spec, sglang_gpus=args.sglang_gpus, sglang_tp=args.sglang_tp)
    except ValueError as exc:
        print(f"tir-launch: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    if args.dryrun:
        print(gpu or local_script(spec, sandbox_port=free_port()))
        return 0
    write_record(spec.run_dir, LaunchRecord(executor="local", recipe=spec.recipe, cluster=None))
    result = run_local(spec, script=gpu)
    print(f"run dir: {result.run_dir}\nlogs: {result.run_dir}/logs/ (main.log, sandbox.log)"
          + (f"\nnemo-run task log: {result.task_log}" if result.task_log else ""))
    if result.exit_code != 0:
        main_log = Path(result.run_dir, "logs", "main.log")
        tail = main_log.read_text(errors="replace").splitlines()[-40:] if main_log.exists() else []
        print("\n".join([f"tir-launch: the trainer failed (exit status {result.exit_code}); last lines of "
                         f"{main_log}:", *tail]), file=sys.stderr)
    return result.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:
        logging.basicConfig(level="WARNING")
        return plan_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        import nemo_run  # noqa: F401
    except ImportError:
        parser.error("nemo-run is not installed: pip install 'megatron-tir[launch]'")
    try:
        executor, spec, cluster = _plan(args)
    except ValueError as exc:
        parser.error(str(exc))
    if executor == "slurm":
        assert cluster is not None
        try:
            return _slurm(args, spec, cluster)
        except ValueError as exc:
            parser.error(str(exc))
    return _local(args, spec)


if __name__ == "__main__":
    sys.exit(main())
