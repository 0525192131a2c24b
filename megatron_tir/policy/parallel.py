"""Process groups for the policy: torch.distributed + megatron's model-parallel state.

``init_parallel(tp, pp)`` sets up torch.distributed (gloo without a GPU, nccl with one)
and megatron's TP/PP/DP groups (the CPU redirections of ``cpu_compat`` are applied here,
so callers never think about them); ``destroy_parallel()`` tears both down.
``run_ranks(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` on that many
spawned local processes (gloo on CPU): each rank gets RANK/WORLD_SIZE/MASTER_ADDR/
MASTER_PORT and a share of the CPU threads; ``init_parallel`` then joins the group. A
failure on any rank becomes one ValueError carrying that rank's last error line.
"""

from __future__ import annotations

import datetime
import logging
import os
import warnings

import torch

from megatron_tir.policy import cpu_compat
from megatron_tir.ports import free_port

log = logging.getLogger(__name__)


def collective_device(group=None) -> torch.device:
    """The device ``group``'s operands must be on: this rank's GPU under NCCL, the CPU under gloo."""
    if torch.distributed.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

START_TIMEOUT_S = 600.0  # the default group's rendezvous: every rank has to have started


def init_parallel(tp: int = 1, pp: int = 1, *, seed: int = 1234, backend: str | None = None,
                  timeout_s: float = 600.0, ep: int = 1, etp: int | None = None,
                  model_parallel_timeout_s: float = 1800.0) -> None:
    """torch.distributed + megatron model-parallel groups for ``tp`` x ``pp`` (x data parallel);
    MoE experts over ``ep`` expert-parallel ranks, each expert split ``etp``-way (megatron-core's
    expert tensor parallelism; None: ``tp``), carved out of the tp x dp ranks of a stage.

    Uses the usual env (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); without it, a
    single-process group on a free local port. Idempotent for the same sizes; ValueError
    if groups of other sizes exist (checkpoint conversion, which builds a TP=1 meta model,
    therefore runs in its own process, not inside a parallel job).
    """
    from megatron.core import parallel_state, tensor_parallel

    cpu_compat.apply()
    if not torch.distributed.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        timeout = datetime.timedelta(seconds=timeout_s)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "RANK" in os.environ:
            # the rendezvous waits for every rank to start (imports alone take tens of seconds on a loaded
            # node): at least START_TIMEOUT_S; the group's collectives then get ``timeout_s``
            start = datetime.timedelta(seconds=max(timeout_s, START_TIMEOUT_S))
            torch.distributed.init_process_group(backend=backend, timeout=start)
            if start != timeout:
                from torch.distributed.distributed_c10d import _set_pg_timeout

                _set_pg_timeout(timeout)
        else:
            # One process: a store on a port the kernel picks (no free-port race), and no
            # RANK / MASTER_PORT left in os.environ for child processes to inherit.
            store = torch.distributed.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=timeout)
            torch.distributed.init_process_group(backend=backend, store=store, rank=0, world_size=1,
                                                 timeout=timeout)
    world = torch.distributed.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not a multiple of tp*pp = {tp * pp}")
    etp = tp if etp is None else etp
    if (world // pp) % (ep * etp):
        raise ValueError(f"ep*etp = {ep * etp} does not divide the {world // pp} ranks of a pipeline stage")
    if parallel_state.model_parallel_is_initialized():
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size(),
                parallel_state.get_expert_model_parallel_world_size(),
                parallel_state.get_expert_tensor_parallel_world_size())
        if have == (tp, pp, ep, etp):
            return
        raise ValueError(f"model parallelism is already initialized with tp={have[0]} pp={have[1]} ep={have[2]} "
                         f"etp={have[3]}, not tp={tp} pp={pp} ep={ep} etp={etp} (call destroy_parallel() first)")
    # megatron-core's own groups (TP, PP, DP, EP, ...): model_parallel_timeout_s (megatron-core's default, 30 min;
    # the trainer passes trainer.collective_timeout_s for both these and the default group)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                                             distributed_timeout_minutes=model_parallel_timeout_s / 60)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_parallel() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


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
        destroy_parallel()


def run_ranks(fn, world_size: int, *args) -> None:
    """``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; returns when all finish."""
    import torch.multiprocessing as mp

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
