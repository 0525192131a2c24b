"""``sandbox-cluster``: serve, broker, worker, run, status, bench.

    sandbox-cluster serve --bind tcp://0.0.0.0:5555 --workers 8      # broker + local workers
    sandbox-cluster serve --bind tcp://0.0.0.0:5555 --expose /opt/tables  # cells also see /opt/tables
    sandbox-cluster broker --bind tcp://0.0.0.0:5555                 # broker only (workers at port+1)
    sandbox-cluster worker --connect tcp://broker-host:5556 --slots 8  # workers on another node
    sandbox-cluster run cell.py --connect tcp://broker-host:5555      # or no --connect: throwaway cluster
    sandbox-cluster status --connect tcp://broker-host:5555
    sandbox-cluster bench                                            # runs bench/bench_sandbox.py
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import threading

import msgspec
import zmq

log = logging.getLogger("sandbox_cluster")


def _limits(text: str | None, expose: list[str] | None = None):
    from .limits import SandboxLimits

    limits = SandboxLimits.from_json(text) if text else SandboxLimits()
    if expose:
        for path in expose:
            if not os.path.exists(path):
                raise ValueError(f"--expose {path}: no such file or directory")
        limits = dataclasses.replace(limits, expose=[*limits.expose, *(os.path.abspath(p) for p in expose)])
    return limits


def cmd_broker(args: argparse.Namespace) -> int:
    from .broker import Broker, BrokerConfig
    from .isolation import boost_priority

    boost_priority(args.priority_boost)  # before the ZeroMQ threads start: they inherit it
    broker = Broker(BrokerConfig(bind=args.bind, worker_bind=args.worker_bind or "", max_queue=args.max_queue,
                                 heartbeat_interval_s=args.heartbeat_interval,
                                 heartbeat_liveness=args.heartbeat_liveness))
    # First stdout line: the bound endpoints (LocalCluster reads it; useful with tcp://host:*).
    print(json.dumps({"client": broker.client_endpoint, "worker": broker.worker_endpoint}), flush=True)
    broker.run(install_signal_handlers=True, exit_with_parent=_owner(args))
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from .isolation import boost_priority
    from .worker import Worker, WorkerConfig

    limits = _limits(args.limits, args.expose)
    cell_nice = boost_priority(args.priority_boost)  # the zygotes inherit the boost; cells get the old value
    config = WorkerConfig(connect=args.connect, slots=args.slots, name=args.name or "", limits=limits,
                          heartbeat_interval_s=args.heartbeat_interval, heartbeat_liveness=args.heartbeat_liveness,
                          uid_base=args.uid_base, cell_nice=cell_nice,
                          exit_with_parent=_owner(args))
    Worker(config).run()
    return 0


def _owner(args: argparse.Namespace) -> int | None:
    """The pid whose death ends this process: ``--exit-with-parent PID``, or the parent at start (bare flag)."""
    if args.exit_with_parent is None:
        return None
    return args.exit_with_parent or os.getppid()


def cmd_serve(args: argparse.Namespace) -> int:
    from .cluster import LocalCluster

    limits = dataclasses.asdict(_limits(args.limits, args.expose))  # validated here, at the edge
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with LocalCluster(workers=args.workers, address=args.bind, worker_address=args.worker_bind,
                      slots_per_worker=args.slots_per_worker, max_queue=args.max_queue,
                      log_level=args.log_level, start_timeout_s=args.start_timeout, **limits) as cluster:
        status = cluster.status()
        print(f"serving clients at {cluster.address}; workers connect to {cluster.worker_address}", flush=True)
        for name, missing in status.missing_protections.items():
            print(f"WARNING: worker {name} runs without: {', '.join(missing)}", flush=True)
        stop.wait()
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from .client import SandboxClient

    code = sys.stdin.read() if args.file == "-" else _read_file(args.file)
    files = {}
    for spec in args.file_input or []:
        files[spec.rsplit("/", 1)[-1]] = _read_bytes(spec)

    def execute(address: str):
        with SandboxClient(address) as client:
            return client.run(code, timeout=args.timeout, memory_mb=args.memory_mb, files=files,
                              stdin=_read_file(args.stdin) if args.stdin else None)

    if args.connect:
        result = execute(args.connect)
    else:
        from .cluster import LocalCluster

        quiet = "warning" if args.log_level == "info" else args.log_level
        with LocalCluster(workers=1, log_level=quiet) as cluster:  # only problems from a throwaway cluster
            result = execute(cluster.address)
    if args.json:
        print(msgspec.json.encode(result).decode())
    else:
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
        note = f" ({result.message})" if result.message else ""
        trunc = " [stdout truncated]" if result.stdout_truncated else ""
        trunc += " [stderr truncated]" if result.stderr_truncated else ""
        print(f"-- status={result.status.value} exit_code={result.exit_code} wall={result.wall_time * 1000:.1f}ms "
              f"cpu={result.cpu_time * 1000:.1f}ms{trunc}{note}", file=sys.stderr)
    return 0 if result.ok else 1


def cmd_status(args: argparse.Namespace) -> int:
    from .client import SandboxClient

    with SandboxClient(args.connect) as client:
        status = client.status(timeout=args.timeout)
    if args.json:
        print(msgspec.json.encode(status).decode())
        return 0
    print(f"queued={status.queued} in_flight={status.in_flight} max_queue={status.max_queue} "
          f"served={status.served} retried={status.retried} rejected={status.rejected}")
    for w in status.workers:
        missing = [p.name for p in w.protections if not p.active]
        seen = f"only {', '.join(w.exposed)} (read-only)" if w.exposed else "the host's whole tree"
        print(f"  {w.name}: {w.slots} slot(s), {w.free} idle, {w.in_flight} running"
              + (f"; MISSING: {', '.join(missing)}" if missing else "; full isolation") + f"; cells see {seen}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib.util
    from pathlib import Path

    from rich.console import Console

    script = Path(__file__).resolve().parents[1] / "bench" / "bench_sandbox.py"
    if not script.is_file():
        raise ValueError(f"the benchmark is bench/bench_sandbox.py of a checkout; not found at {script}")
    spec = importlib.util.spec_from_file_location("bench_sandbox", script)
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_sandbox"] = bench  # (its dataclasses look their module up)
    spec.loader.exec_module(bench)
    config = bench.BenchConfig(requests=args.requests, workers=args.workers, fresh_requests=args.fresh_requests,
                               rounds=args.rounds, baseline_tree=args.baseline_tree or "")
    report = bench.run_bench(config, Console(stderr=args.json))  # with --json, stdout is only the JSON
    if args.json:
        print(json.dumps(report, indent=2))
    return 0 if report["targets_met"] else 1


def _read_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None


def _read_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sandbox-cluster", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Isolated, warm execution of model-written Python over ZeroMQ.",
        epilog="examples:\n" + __doc__.split("\n\n", 1)[1])
    parser.add_argument("--log-level", default="info", type=str.lower, choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True)

    def heartbeat(p: argparse.ArgumentParser) -> None:
        p.add_argument("--heartbeat-interval", type=float, default=0.5, help="seconds between heartbeats")
        p.add_argument("--heartbeat-liveness", type=int, default=6, help="missed heartbeats before a peer is dead")
        p.add_argument("--exit-with-parent", nargs="?", type=int, const=0, default=None, metavar="PID",
                       help="exit when the starting process (or PID: the owner's pid, named by the owner, so one "
                            "that died before this process looked is noticed too) is no longer the parent")
        p.add_argument("--priority-boost", type=int, default=5, choices=range(0, 20), metavar="0..19",
                       help="run this process (not the cells) this much nicer-than-nice (needs CAP_SYS_NICE)")

    p = sub.add_parser("serve", help="broker + local workers")
    p.add_argument("--bind", required=True, help="client endpoint, e.g. tcp://127.0.0.1:5555")
    p.add_argument("--worker-bind", help="worker endpoint (default: tcp port+1 / ipc path + .workers)")
    p.add_argument("--workers", type=int, default=2, help="worker processes (one warm zygote per slot)")
    p.add_argument("--slots-per-worker", type=int, default=1)
    p.add_argument("--max-queue", type=int, default=10_000)
    p.add_argument("--start-timeout", type=float, default=180.0,
                   help="seconds for the broker and every worker to register (then the cluster serves, busy or not)")
    p.add_argument("--limits", help='JSON of SandboxLimits fields, e.g. \'{"max_processes": 32}\'')
    p.add_argument("--expose", action="append", metavar="PATH",
                   help="also show this host path, read-only, to the cells (repeatable)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("broker", help="broker only; workers connect from other nodes")
    p.add_argument("--bind", required=True)
    p.add_argument("--worker-bind")
    p.add_argument("--max-queue", type=int, default=10_000)
    heartbeat(p)
    p.set_defaults(func=cmd_broker)

    p = sub.add_parser("worker", help="a worker with N slots, connected to a broker's worker endpoint")
    p.add_argument("--connect", required=True, help="the broker's worker endpoint, e.g. tcp://broker:5556")
    p.add_argument("--slots", type=int, default=1)
    p.add_argument("--name")
    p.add_argument("--limits", help="JSON of SandboxLimits fields")
    p.add_argument("--expose", action="append", metavar="PATH",
                   help="also show this host path, read-only, to the cells (repeatable)")
    p.add_argument("--uid-base", type=int, default=61000, help="first uid tried for the per-slot users")
    heartbeat(p)
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("run", help="run one file (or - for stdin) and print its result")
    p.add_argument("file")
    p.add_argument("--connect", help="client endpoint; default: a throwaway local cluster")
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--memory-mb", type=int, default=1024)
    p.add_argument("--stdin", help="file whose text is the cell's stdin")
    p.add_argument("--file-input", action="append", help="file copied into the cell's working dir (repeatable)")
    p.add_argument("--json", action="store_true", help="print the whole result as JSON")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("status", help="workers, their protections, queue")
    p.add_argument("--connect", required=True)
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("bench", help="fresh python -c per call vs the cluster (and a bare warm fork)")
    p.add_argument("--requests", type=int, default=200, help="cluster requests per (snippet, concurrency)")
    p.add_argument("--fresh-requests", type=int, default=16, help="fresh-interpreter calls per (snippet, concurrency)")
    p.add_argument("--workers", type=int, default=0, help="cluster workers (default: number of cores)")
    p.add_argument("--rounds", type=int, default=8, help="interleaved blocks per mode (fair under background load)")
    p.add_argument("--baseline-tree", metavar="DIR", help="another checkout whose cluster is measured beside this one")
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout (tables go to stderr)")
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s")
    try:
        return args.func(args)
    except (ValueError, TimeoutError, RuntimeError, zmq.ZMQError) as exc:
        print(f"sandbox-cluster: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
