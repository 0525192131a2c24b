"""Run ``test_worker_rejoins_a_restarted_broker`` N times in a row; print how many passed.

Not part of CI (it takes a few minutes): the check that a worker always rejoins a restarted
broker and a request sent right after the restart is served.

    python bench/loop_broker_restart.py [--runs 100]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

TEST = "tests/sandbox_cluster/test_sandbox_failures.py::test_worker_rejoins_a_restarted_broker"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100)
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", TEST]
    passed, failures = 0, []
    start = time.monotonic()
    for i in range(args.runs):
        t0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, check=False)
        if proc.returncode == 0:
            passed += 1
        else:
            failures.append(i)
            print(f"run {i + 1} FAILED after {time.monotonic() - t0:.0f} s:\n{proc.stdout[-3000:]}", flush=True)
    print(f"{passed}/{args.runs} passed in a row of {args.runs} runs ({time.monotonic() - start:.0f} s)"
          + (f"; failed: {failures}" if failures else ""))
    return 0 if passed == args.runs else 1

if __name__ == "__main__":
    sys.exit(main())
