"""Back the zygote's warm heap with transparent huge pages, so forking it is cheap.

``fork()`` copies one page-table entry per 4 KiB page of private memory and the child's exit
tears them down again: for a zygote holding ~80 MiB of numpy/sympy state that is most of the
cost of a cell on a virtual machine (``python bench/bench_fork.py`` measures both page sizes).
``MADV_COLLAPSE`` (Linux >= 6.1) rewrites an
already-populated range into huge pages synchronously, whatever the host's THP mode short of
``never``. A write after fork splits only the 2 MiB entry it lands in, and the child copies
4 KiB as before, so cells see the same memory. The zygote's own writes between forks split
the 2 MiB entries they land in (for good: a split anonymous huge page is not collapsed again
while it is shared), so the gain is largest for the cold part of the heap, which is most of
it. Hosts without MADV_COLLAPSE keep 4 KiB pages (slower, identical behaviour).
"""

from __future__ import annotations

import ctypes
import ctypes.util

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
MADV_COLLAPSE = 25
HUGE_PAGE = 2 << 20


def _private_anonymous_ranges() -> list[tuple[int, int]]:
    """The 2 MiB-aligned parts of the writable private anonymous mappings (and the brk heap)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            perms = fields[1]
            path = fields[5] if len(fields) > 5 else ""
            if not perms.startswith("rw") or perms[3] != "p" or (path and path != "[heap]"):
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            start = (start + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
            end &= ~(HUGE_PAGE - 1)
            if end > start:
                out.append((start, end))
    return out


def anon_huge_bytes() -> int:
    """How much of this process's anonymous memory sits in huge pages now."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) << 10
    return 0


def collapse() -> int:
    """Collapse this process's populated private memory into huge pages; returns how many
    2 MiB pages were collapsed (0 where the kernel cannot: nothing changes then)."""
    collapsed = 0
    for start, end in _private_anonymous_ranges():
        for addr in range(start, end, HUGE_PAGE):
            # fails (EINVAL) for an empty or partly unmapped range, EAGAIN for pages in use: both harmless
            if _libc.madvise(addr, HUGE_PAGE, MADV_COLLAPSE) == 0:
                collapsed += 1
    return collapsed
