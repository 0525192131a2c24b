"""Benchmark: the sandbox cluster against a fresh interpreter per call, on the same cores.

    python bench/bench_sandbox.py [--baseline-tree DIR] [--json]    (or: sandbox-cluster bench)

Three ways to run a snippet, measured in one run:

- ``fresh``: ``python -c SNIPPET`` per call (SandboxFusion's model; no isolation at all),
- ``cluster``: a LocalCluster with full isolation, through the broker, client-side latency,
- ``bare fork``: fork from a warm interpreter prepared as the zygote prepares it
  (``prepare_warm_interpreter``: warm-up, GC frozen, heap in huge pages), no isolation, no
  broker (the floor for a warm fork).

With ``--baseline-tree DIR`` (another checkout, e.g. ``git archive <rev>``), a fourth mode,
``cluster @baseline``, runs that tree's broker, workers and zygotes in the same interleaved
blocks, so the per-request cost of a change is measured under the same load.

Latencies (p50/p99) and throughput at concurrency 1 and 2 x cores, then the ratios and
the targets: >= 40x for the sympy snippet (p50 and throughput), and the trivial
snippet's p50 within 2x of a bare warm fork.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import logging
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(_REPO))

log = logging.getLogger(__name__)

SNIPPETS = {
    "trivial": "print('hello')",
    "sympy": "import sympy, numpy\nx = sympy.Symbol('x')\nprint(sympy.solve(x**2 - 4), numpy.arange(1000).sum())",
}
EXPECTED_STDOUT = {"trivial": "hello\n", "sympy": "[-2, 2] 499500\n"}
TARGET_SYMPY_SPEEDUP = 40.0
TARGET_TRIVIAL_VS_BARE_FORK = 2.0
_THREAD_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclass(kw_only=True, slots=True)
class BenchConfig:
    requests: int = 200  # cluster requests per (snippet, concurrency)
    fresh_requests: int = 16  # fresh interpreters per (snippet, concurrency)
    bare_fork_requests: int = 200
    rounds: int = 8  # the modes alternate in this many blocks each
    workers: int = 0  # cluster workers; 0: one per core
    concurrency: list[int] = field(default_factory=list)  # default: [1, 2 x cores]
    baseline_tree: str = ""  # another checkout whose cluster runs beside this one (same blocks)

    def __post_init__(self) -> None:
        cores = os.cpu_count() or 1
        if self.workers == 0:
            self.workers = cores
        if not self.concurrency:
            self.concurrency = [1, 2 * cores]
        if self.requests < 10 or self.fresh_requests < 2 or self.bare_fork_requests < 10:
            raise ValueError("need requests >= 10, fresh_requests >= 2, bare_fork_requests >= 10")
        if not 1 <= self.workers <= 256:
            raise ValueError(f"workers={self.workers} outside [1, 256]")
        if not 1 <= self.rounds <= min(self.requests, self.fresh_requests):
            raise ValueError(f"rounds={self.rounds} outside [1, min(requests, fresh_requests)]")
        if any(c < 1 for c in self.concurrency):
            raise ValueError("concurrency levels must be >= 1")
        if self.baseline_tree and not (Path(self.baseline_tree) / "sandbox_cluster" / "__init__.py").is_file():
            raise ValueError(f"baseline_tree={self.baseline_tree!r} holds no sandbox_cluster package")


def _percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default). No numpy here: importing it
    starts OpenBLAS threads in the benchmarking process, which then spin on the measured cores."""
    pos = (len(sorted_values) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _summary(latencies: list[float], wall: float) -> dict[str, float]:
    ms = sorted(t * 1000 for t in latencies)
    return {"n": len(latencies), "p50_ms": _percentile(ms, 50), "p99_ms": _percentile(ms, 99),
            "throughput_per_s": len(latencies) / wall}


# --------------------------------------------------------------------------- the three ways
#
# The machine may be shared, so the modes are measured in interleaved blocks (fresh, cluster,
# bare fork, fresh, cluster, ...): each mode sees the same background load.


class _Series:
    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.busy = 0.0

    def add(self, block: tuple[list[float], float]) -> None:
        self.latencies += block[0]
        self.busy += block[1]

    def summary(self) -> dict[str, float]:
        return _summary(self.latencies, self.busy)


def fresh_block(snippet: str, n: int, concurrency: int) -> tuple[list[float], float]:
    env = dict(os.environ, **_THREAD_ENV)

    def one(_: int) -> float:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", snippet], capture_output=True, env=env, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"fresh interpreter failed: {proc.stderr.decode()[-300:]}")
        return time.perf_counter() - t0

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        latencies = list(pool.map(one, range(n)))
    return latencies, time.perf_counter() - start


def cluster_block(client, snippet: str, expected: str, n: int, concurrency: int) -> tuple[list[float], float]:
    async def go() -> tuple[list[float], float]:
        sem = asyncio.Semaphore(concurrency)
        latencies: list[float] = []

        async def one() -> None:
            async with sem:
                t0 = time.perf_counter()
                res = await client.arun(snippet, timeout=30)
                latencies.append(time.perf_counter() - t0)
                if not res.ok or res.stdout != expected:
                    raise RuntimeError(f"cluster run failed: {res}")

        await asyncio.gather(*(client.arun(snippet) for _ in range(concurrency)))  # re-warm after a pause
        start = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        return latencies, time.perf_counter() - start

    return asyncio.run(go())


class BareForkServer:
    """A warm zygote without any isolation, in its own process (no ZeroMQ threads there); it
    gets the same scheduling boost as the cluster's zygotes, its children the same as cells."""

    def __init__(self, snippet: str, priority_boost: int = 5) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--bare-fork-server"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=dict(os.environ, **_THREAD_ENV), text=True,
        )
        self.proc.stdin.write(json.dumps({"snippet": snippet, "priority_boost": priority_boost}) + "\n")
        self.proc.stdin.flush()
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("bare fork baseline did not start")

    def block(self, n: int) -> tuple[list[float], float]:
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("bare fork baseline died")
        out = json.loads(line)
        return out["latencies"], out["wall"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> BareForkServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def bare_fork_main() -> None:
    """Fork from a warm interpreter, run the snippet with stdout on a pipe, read it, reap. Nothing else."""
    from sandbox_cluster.isolation import boost_priority
    from sandbox_cluster.zygote.warm import prepare_warm_interpreter

    args = json.loads(sys.stdin.readline())
    code = compile(args["snippet"], "<cell>", "exec")
    child_nice = boost_priority(args["priority_boost"])
    prepare_warm_interpreter()

    def one() -> float:
        t0 = time.perf_counter()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.setpriority(os.PRIO_PROCESS, 0, child_nice)
            os.close(r)
            os.dup2(w, 1)
            sys.stdout = open(1, "w", closefd=False)
            exec(code, {"__name__": "__main__"})
            sys.stdout.flush()
            os._exit(0)
        os.close(w)
        while os.read(r, 65536):
            pass
        os.close(r)
        os.waitpid(pid, 0)
        return time.perf_counter() - t0

    for _ in range(5):  # the first forks touch cold pages
        one()
    print("ready", flush=True)
    for line in sys.stdin:
        start = time.perf_counter()
        latencies = [one() for _ in range(int(line))]
        print(json.dumps({"latencies": latencies, "wall": time.perf_counter() - start}), flush=True)


# --------------------------------------------------------------------------- the run


def run_bench(config: BenchConfig, console=None) -> dict:
    """Runs the benchmark, prints the tables on ``console`` (rich; default stdout), returns the report."""
    from rich.console import Console

    from sandbox_cluster.client import SandboxClient
    from sandbox_cluster.cluster import LocalCluster

    console = console or Console()
    rows: dict[tuple[str, str, int], dict[str, float]] = {}
    cores = os.cpu_count() or 1
    console.print(f"[bold]sandbox-cluster bench[/] on {cores} cores; cluster: {config.workers} workers, "
                  f"full isolation; concurrency {config.concurrency}")

    with contextlib.ExitStack() as stack:
        with console.status("starting the cluster and the bare-fork baseline"):
            bare = stack.enter_context(BareForkServer(SNIPPETS["trivial"]))
            cluster = stack.enter_context(LocalCluster(workers=config.workers))
            client = stack.enter_context(SandboxClient(cluster.address))
            clients = {"cluster": client}
            if config.baseline_tree:
                env = {"PYTHONPATH": str(Path(config.baseline_tree).resolve())}
                # (upper-case log level: a tree from before the lower-case CLI convention knows only those)
                base = stack.enter_context(LocalCluster(workers=config.workers, env=env, log_level="WARNING"))
                clients["cluster @baseline"] = stack.enter_context(SandboxClient(base.address))
        _measure(config, console, bare, clients, rows)
        missing = cluster.status().missing_protections
    _report_tables(config, console, rows)
    return _verdict(config, console, rows, cores, missing)


def _measure(config: BenchConfig, console, bare: BareForkServer, clients: dict, rows: dict) -> None:
    rounds = config.rounds
    for name, snippet in SNIPPETS.items():
        for c in config.concurrency:
            series = {mode: _Series() for mode in ("fresh python -c", *clients)}
            with_bare = name == "trivial" and c == 1
            if with_bare:
                series["bare fork"] = _Series()
            for r in range(rounds):
                with console.status(f"{name}, concurrency {c}: round {r + 1}/{rounds}"):
                    for mode, client in clients.items():
                        series[mode].add(cluster_block(client, snippet, EXPECTED_STDOUT[name],
                                                       math.ceil(config.requests / rounds), c))
                    if with_bare:
                        series["bare fork"].add(bare.block(math.ceil(config.bare_fork_requests / rounds)))
                    series["fresh python -c"].add(
                        fresh_block(snippet, max(c, math.ceil(config.fresh_requests / rounds)), c))
            for mode, s in series.items():
                rows[(name, mode, c)] = s.summary()


def _report_tables(config: BenchConfig, console, rows: dict) -> None:
    from rich.table import Table

    table = Table(title="sandbox execution: fresh interpreter vs warm isolated cluster")
    for col in ("snippet", "mode", "conc.", "n", "p50 ms", "p99 ms", "req/s"):
        table.add_column(col, justify="right" if col not in ("snippet", "mode") else "left")
    for (name, mode, c), r in sorted(rows.items(), key=lambda kv: (kv[0][0] != "trivial", kv[0][2], kv[0][1])):
        table.add_row(name, mode, str(c), str(r["n"]), f"{r['p50_ms']:.1f}", f"{r['p99_ms']:.1f}",
                      f"{r['throughput_per_s']:.1f}")
    console.print(table)


def _verdict(config: BenchConfig, console, rows: dict, cores: int, missing: dict) -> dict:
    from rich.table import Table

    ratios = {}
    for name in SNIPPETS:
        for c in config.concurrency:
            fresh, ours = rows[(name, "fresh python -c", c)], rows[(name, "cluster", c)]
            ratios[f"{name} c={c} p50 speedup"] = fresh["p50_ms"] / ours["p50_ms"]
            ratios[f"{name} c={c} throughput speedup"] = ours["throughput_per_s"] / fresh["throughput_per_s"]
    ratios["trivial c=1 p50 cluster / bare fork"] = (rows[("trivial", "cluster", 1)]["p50_ms"]
                                                     / rows[("trivial", "bare fork", 1)]["p50_ms"])
    if config.baseline_tree:
        for name in SNIPPETS:
            for c in config.concurrency:
                ours, base = rows[(name, "cluster", c)], rows[(name, "cluster @baseline", c)]
                ratios[f"{name} c={c} p50 ms minus baseline"] = ours["p50_ms"] - base["p50_ms"]
    sympy_ok = all(v >= TARGET_SYMPY_SPEEDUP for k, v in ratios.items() if k.startswith("sympy") and "speedup" in k)
    trivial_ok = ratios["trivial c=1 p50 cluster / bare fork"] <= TARGET_TRIVIAL_VS_BARE_FORK
    ratio_table = Table(title="ratios")
    ratio_table.add_column("ratio")
    ratio_table.add_column("value", justify="right")
    ratio_table.add_column("target", justify="right")
    for k, v in ratios.items():
        target = (f">= {TARGET_SYMPY_SPEEDUP:g}" if k.startswith("sympy") and "speedup" in k
                  else f"<= {TARGET_TRIVIAL_VS_BARE_FORK:g}" if "bare fork" in k else "")
        ratio_table.add_row(k, f"{v:.1f}x" if "speedup" in k else f"{v:+.2f}" if "minus" in k else f"{v:.2f}",
                            target)
    console.print(ratio_table)
    if missing:
        console.print(f"[yellow]cluster ran WITHOUT: {missing}[/]")
    verdict = "met" if sympy_ok and trivial_ok else "NOT met"
    console.print(f"targets {verdict}: sympy speedup >= {TARGET_SYMPY_SPEEDUP:g}x ({'yes' if sympy_ok else 'no'}), "
                  f"trivial p50 <= {TARGET_TRIVIAL_VS_BARE_FORK:g}x bare fork ({'yes' if trivial_ok else 'no'})")
    return {
        "cores": cores, "workers": config.workers, "concurrency": config.concurrency,
        "rows": [{"snippet": k[0], "mode": k[1], "concurrency": k[2], **v} for k, v in rows.items()],
        "ratios": ratios, "missing_protections": missing, "targets_met": sympy_ok and trivial_ok,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="cluster requests per (snippet, concurrency)")
    parser.add_argument("--fresh-requests", type=int, default=16,
                        help="fresh-interpreter calls per (snippet, concurrency)")
    parser.add_argument("--workers", type=int, default=0, help="cluster workers (default: number of cores)")
    parser.add_argument("--rounds", type=int, default=8, help="interleaved blocks per mode (fair under load)")
    parser.add_argument("--baseline-tree", default="", metavar="DIR",
                        help="another checkout whose cluster is measured beside this one")
    parser.add_argument("--json", action="store_true", help="print the report as JSON on stdout (tables to stderr)")
    parser.add_argument("--bare-fork-server", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.bare_fork_server:
        bare_fork_main()
        return 0
    from rich.console import Console

    try:
        config = BenchConfig(requests=args.requests, fresh_requests=args.fresh_requests, workers=args.workers,
                             rounds=args.rounds, baseline_tree=args.baseline_tree)
    except ValueError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    report = run_bench(config, Console(stderr=args.json))
    if args.json:
        print(json.dumps(report, indent=2))
    return 0 if report["targets_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
