"""Hand a thread's idle OpenMP worker threads back to the system (GNU libgomp's
``omp_pause_resource_all``), so that the thread doing the work keeps spinning between its
parallel regions instead of waking its team through the kernel each time.

Why: torch's CPU kernels run on libgomp teams, one team per thread that starts parallel work.
The local engine steps its model on its own worker thread, while the thread that built it (the
trainer's main thread, which also runs the learner; a benchmark's main thread) has run parallel
ops too and keeps its own idle team. Once libgomp manages more threads than there are CPUs it
throttles the busy-wait of *every* team (GOMP_SPINCOUNT's throttled count, 100 spins): each of a
decode step's ~150 parallel regions then sleeps and is woken through a futex. On the 2-core
machine this project is developed on, SmolLM2-135M decoded at 20.4 tokens/s at batch 1 with the
building thread's team kept and 33.5 with it released (1.64x; 1.42x at batch 4, 1.23x at 16:
``python bench/bench_engine.py``, its ``slot-keep`` and ``slot`` runs, 2026-12-02). A thread that is about to wait for
another one's work calls :func:`release_idle_threads`; its team is re-created by its next
parallel op (a few tens of microseconds).

On anything but Linux with a loaded libgomp (macOS, Intel OpenMP builds) it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch  # noqa: F401  (torch loads libgomp: imported first, the library is mapped when it is looked up)

log = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: keep the runtime, drop the threads


@functools.cache
def _pause_functions() -> tuple:
    """``omp_pause_resource_all`` of every libgomp mapped into this process (normally torch's)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libgomp" in line.rsplit("/", 1)[-1]})
    except OSError:
        return ()
    functions = []
    for path in paths:
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all  # the mapped library's own handle
        except (OSError, AttributeError):  # a libgomp older than OpenMP 5.0 has no pause
            log.debug("no omp_pause_resource_all in %s", path)
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        functions.append(pause)
    return tuple(functions)


def release_idle_threads() -> bool:
    """Release the calling thread's idle libgomp team; True if a libgomp took the call.

    Call it from a thread that has finished its parallel work for a while (it must not be inside a
    parallel region, which a Python caller never is)."""
    functions = _pause_functions()
    for pause in functions:
        pause(OMP_PAUSE_SOFT)
    return bool(functions)
