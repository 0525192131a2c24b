"""Make glibc's malloc hand freed tensor memory back to the system: a fixed mmap threshold.

torch's CPU tensors come from ``malloc`` (``posix_memalign``). glibc serves a block of at
least ``M_MMAP_THRESHOLD`` bytes (128 KiB at start) with its own ``mmap``, unmapped on
``free``; smaller ones from its heaps, which give memory back only from their top. But the
threshold is dynamic: each freed mmapped block raises it to that block's size, up to 32 MiB.
After the first few tensors of a train step are freed, every later tensor under ~32 MiB (a
micro-batch's activations, the engine's per-step logits) lands in a heap, and a heap whose
top is held by one live block keeps all the freed memory below it resident. The process's
RSS then ratchets up to the high-water mark of every phase at once.

Measured on the embedded CPU run (``megatron-tir train --recipe smollm2-cpu --set
trainer.steps=5 --set trainer.eval_every=0``, 2 cores, glibc 2.36, 2026-12-05): with the
dynamic threshold the resident size at the end of each step climbed 3.9 -> 5.3 -> 6.5 -> 7.5
GiB over the three steps that train (the learner's Adam state is ~1.1 GiB of that; nothing else
lives across steps), and the peak, step 5's largest micro-batch on top, was 7.92 GiB (8.15 in an
earlier run). With the threshold fixed at 128 KiB (what :func:`tune_malloc` sets) it stayed at
3.6-4.7 GiB between steps and peaked at 6.65 GiB (step 4's largest micro-batch); losses,
gradient norms and rewards were bit-identical.

Setting the threshold turns glibc's dynamic adjustment off (for the trim threshold too,
which stays at its 128 KiB default). The price is one ``mmap``/``munmap`` and fresh zeroed
pages for every block of 128 KiB or more: in the runs above the phases took ~15-25% longer
(train 41 vs 32 s at step 5, rollouts 33-42 vs 26-37 s; two tuned runs against one untuned one
on a shared machine, so noisy).

The environment variables are read when malloc starts, before Python runs; ``mallopt`` sets
the same thing from inside the process. Where malloc is not glibc's, or the user set the
threshold already (``MALLOC_MMAP_THRESHOLD_``, ``GLIBC_TUNABLES`` with
``glibc.malloc.mmap_threshold``), nothing is changed.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 128 << 10  # glibc's own initial value, kept fixed


def _glibc_mallopt():
    """glibc's ``mallopt`` of this process, or None where malloc is not glibc's."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)  # the symbols the process already has
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    if not hasattr(libc, "gnu_get_libc_version"):  # glibc only (musl's mallopt does nothing)
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def _threshold_set_by_user() -> bool:
    return "MALLOC_MMAP_THRESHOLD_" in os.environ or "glibc.malloc.mmap_threshold" in os.environ.get("GLIBC_TUNABLES", "")


def tune_malloc(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes (see the module docstring); True if set.

    Call it once, early, in a process that trains (before the big allocations): what the heaps
    already hold stays there. A no-op (False) without glibc or when the user set the threshold."""
    if _threshold_set_by_user():
        log.debug("malloc: the mmap threshold is the environment's")
        return False
    mallopt = _glibc_mallopt()
    if mallopt is None:
        return False
    ok = mallopt(M_MMAP_THRESHOLD, threshold) == 1
    if not ok:
        log.warning("malloc: mallopt(M_MMAP_THRESHOLD, %d) failed; freed memory may stay resident", threshold)
    return ok
