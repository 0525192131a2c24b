"""The zygote: a warm, root-owned interpreter per slot that forks one isolated child per cell.

A worker starts it with ``python -P -m sandbox_cluster.zygote`` and a *clean* environment
(so neither its memory nor ``/proc/<pid>/environ`` holds the worker's secrets), hands it one
end of a socketpair: a hello, then per request its limits and a memfd holding it (passed on
to the cell unread) in, the outcome and the cell's raw output out (``protocol``): the zygote
never holds what a request carries, since every later cell would inherit it. The zygote
holds no ZeroMQ state (ZeroMQ's threads do not survive ``fork``).

- ``serve``: the process: its own pid namespace, set-up, warm-up, the serving loop;
- ``layers``: isolation set-up and probing (namespaces, cgroups, seccomp, the cells' root);
- ``warm``: the warm interpreter (numpy, sympy exercised; GC frozen; heap in huge pages);
- ``slot``: the ``Zygote``: forks the next cell ahead, runs a request, cleans up after it;
- ``supervise``: watching a running cell (wall clock, output cap) and naming its outcome;
- ``cell``: the forked cell's body (limits, privilege drop, seccomp, the code).
"""

from .cell import CELL_ENV
from .slot import Zygote

__all__ = ["CELL_ENV", "Zygote"]
