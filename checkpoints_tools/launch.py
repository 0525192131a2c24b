"""Run a function on ``world_size`` local ranks (torch.multiprocessing spawn, gloo on CPU).

Each rank gets RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT and a share of the CPU threads;
``init_parallel`` then joins the group. A failure on any rank becomes one ValueError
carrying that rank's last error line, and all ranks are stopped.
"""

from __future__ import annotations

import logging
import os
import warnings

import torch

log = logging.getLogger(__name__)


def _entry(rank: int, world_size: int, port: int, threads: int, quiet: bool, fn, args: tuple) -> None:
    if quiet:  # megatron-core warns about missing TE/apex and deprecations on every rank
        warnings.filterwarnings("ignore")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads))
    torch.set_num_threads(threads)
    logging.basicConfig(level=logging.WARNING)
    try:
        fn(rank, world_size, *args)
    finally:
        from megatron_tir.policy.build import destroy_parallel

        destroy_parallel()


def run_ranks(fn, world_size: int, *args) -> None:
    """``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; returns when all finish."""
    import torch.multiprocessing as mp

    from megatron_tir.policy.build import free_port

    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    threads = max(1, (os.cpu_count() or 1) // world_size)
    if os.environ.get("OMP_NUM_THREADS"):
        threads = min(threads, int(os.environ["OMP_NUM_THREADS"]))
    log.info("launching %d ranks (gloo, %d thread(s) each)", world_size, threads)
    try:
        quiet = not logging.getLogger().isEnabledFor(logging.DEBUG)
        mp.start_processes(_entry, args=(world_size, free_port(), threads, quiet, fn, args), nprocs=world_size,
                           join=True, start_method="spawn")
    except mp.ProcessRaisedException as e:
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        raise ValueError(f"rank {e.error_index} failed: {lines[-1] if lines else e}") from None
    except mp.ProcessExitedException as e:
        raise ValueError(f"rank {e.error_index} exited with code {e.exit_code}") from None
