"""What a command that every torchrun rank runs alike (``train``, ``sft``) says, and from which rank.

* At the default level (``--log-level info``) the INFO lines are rank 0's: the other ranks log from WARNING up,
  so a line such as the learner's "ready" or a step line appears once; ``--log-level debug`` keeps every rank's.
* Bad input (``ValueError``: one line, exit 2 in :mod:`megatron_tir.cli`) fails every rank alike. Rank 0 says it
  and exits 2; torchrun then ends the other ranks at once (SIGTERM) and names rank 0, exit 2, the root cause.
  The other ranks wait for that (up to :data:`RANK0_FIRST_S`) instead of saying the same line: a rank that
  exited first would be the root cause instead, and rank 0 could be ended before its line is out. A rank still
  running after the wait failed alone, and says its own line.
* A stop that every rank meets alike once the run has started (non-finite training: exit 1,
  :func:`stopped_on_every_rank`) is said the same way: one line from rank 0, the other ranks wait.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable

RANK0_FIRST_S = 30.0  # how long a rank other than 0 keeps its bad-input error to itself


def rank() -> int:
    """This process's torchrun rank (``RANK``; 0 without torchrun)."""
    return int(os.environ.get("RANK", "0"))


def run_on_every_rank(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """``command(args)`` with the module docstring's rules: INFO from rank 0, bad input said by rank 0."""
    root = logging.getLogger()
    if rank() != 0 and root.getEffectiveLevel() == logging.INFO:
        root.setLevel(logging.WARNING)
    try:
        return command(args)
    except ValueError:
        if rank() != 0:
            time.sleep(RANK0_FIRST_S)
        raise


def stopped_on_every_rank(stop: Exception) -> int:
    """Exit status 1 for ``stop``, which every rank met alike (``NonFiniteTraining``): rank 0 says it at once in one
    line (``megatron-tir: error: ...`` on stderr); another rank waits up to :data:`RANK0_FIRST_S` for torchrun to end
    it, as for bad input, and says it only if still running."""
    if rank() != 0:
        time.sleep(RANK0_FIRST_S)
    print(f"megatron-tir: error: {stop}", file=sys.stderr)
    return 1
