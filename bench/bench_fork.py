"""Benchmark: forking the warm sandbox interpreter with 4 KiB pages vs its heap in huge pages.

Two fresh processes, each warmed as a zygote is (``prepare_warm_interpreter``: warm-up, GC
frozen), one of them with its heap collapsed into 2 MiB pages (the zygote's own step), the
other left in 4 KiB pages.
Each forks children back to back: an empty child (fork + exit) and a child running the
sympy snippet of ``bench/bench_sandbox.py``. Printed: p50 wall per fork, the children's CPU
and minor (copy-on-write) faults per fork, and the ratios. No isolation, no broker: this
is the floor the zygote works from.

    python bench/bench_fork.py [--forks 200]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout


def _measure(huge: bool, forks: int) -> dict:
    from bench_sandbox import SNIPPETS

    from sandbox_cluster import hugepages
    from sandbox_cluster.zygote.warm import prepare_warm_interpreter

    prepare_warm_interpreter(huge_pages=huge)
    code = compile(SNIPPETS["sympy"], "<cell>", "exec")
    out = {"huge_mib": hugepages.anon_huge_bytes() >> 20}
    for name, body in (("empty", None), ("sympy", code)):
        times = []
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        for _ in range(forks):
            t0 = time.perf_counter()
            pid = os.fork()
            if pid == 0:
                if body is not None:
                    sys.stdout = open(os.devnull, "w")
                    exec(body, {"__name__": "__main__"})
                os._exit(0)
            os.waitpid(pid, 0)
            times.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        out[name] = {"p50_ms": statistics.median(times) * 1000, "child_cpu_ms": cpu / forks * 1000,
                     "child_minflt": (after.ru_minflt - before.ru_minflt) / forks}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--forks", type=int, default=200)
    parser.add_argument("--side", choices=["4k", "huge"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.forks < 10:
        parser.error("--forks must be at least 10")
    if args.side:
        print(json.dumps(_measure(args.side == "huge", args.forks)))
        return 0
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    res = {}
    for side in ("4k", "huge"):
        proc = subprocess.run([sys.executable, __file__, "--side", side, "--forks", str(args.forks)],
                              capture_output=True, text=True, env=env, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"side {side} failed:\n{proc.stderr[-2000:]}")
        res[side] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"warm interpreter, {args.forks} forks per row; heap in huge pages: "
          f"{res['4k']['huge_mib']} MiB (4 KiB side) vs {res['huge']['huge_mib']} MiB (huge side)\n")
    print("| child | pages | p50 fork+wait | child CPU | child minor faults |")
    print("| --- | --- | --- | --- | --- |")
    for name in ("empty", "sympy"):
        for side in ("4k", "huge"):
            r = res[side][name]
            print(f"| {name} | {side} | {r['p50_ms']:.2f} ms | {r['child_cpu_ms']:.2f} ms | {r['child_minflt']:.0f} |")
    for name in ("empty", "sympy"):
        print(f"{name}: p50 4 KiB / huge = {res['4k'][name]['p50_ms'] / res['huge'][name]['p50_ms']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
