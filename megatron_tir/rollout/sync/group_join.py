"""This trainer rank's side of a weight-update group with the SGLang servers (its rank 0, hosting the
rendezvous store), joined in a daemon thread that can be given up -- and that then really ends.

The join runs beside the servers' ``/init_weights_update_group`` and is given up when they refuse or
do not answer. A thread merely abandoned inside c10d is not harmless: when it comes back from the
c10d call (its own timeout) while the interpreter is finalizing, CPython 3.11 ends it from inside
the GIL take (``take_gil`` -> ``PyThread_exit_thread``, i.e. ``pthread_exit``, whose forced unwind
crosses pybind11's noexcept ``gil_scoped_release`` destructor), and the process aborts: "terminate
called without an active exception", exit code 134 instead of the run's own (reproduced with a
daemon thread in ``TCPStore(..., is_master=True, world_size=2)`` and ``sys.exit(1)`` at about its
timeout). So giving up ends the thread and waits for it (:meth:`GroupJoin.cancel`):

* the wait for the servers is the master store's own: ``TCPStore(is_master=True, world_size=n)``
  returns once ``n`` store users counted themselves in (torch ``TCPStore`` docstring: ``world_size``
  is "the total number of store users (number of clients + 1 for the server)", ``wait_for_workers``;
  pytorch ``torch/csrc/distributed/c10d/TCPStore.cpp`` ``TCPStore::waitForWorkers``: every user with
  a ``world_size`` adds one to the count, only the master then waits for it). The store is hosted by
  a first, non-waiting master (``wait_for_workers=False``), and the waiting one shares its server
  (``multi_tenant=True``: "all TCPStore instances in the current process with the same host/port
  will use the same underlying TCPServer"), so the store surely listens before anyone is counted in
  for the servers that will not come: each giving-up count is a client store that adds itself and
  returns (only the master waits); the wait then ends at once and the thread stops before the group.
* the group itself (``distributed_c10d._new_process_group_helper``): NCCL connects lazily (its
  communicator at the first collective; ``eager_connect_single_device`` only with a ``device_id``,
  none here), so past the store nothing blocks; gloo connects in ``ProcessGroupGloo``'s constructor,
  which waits (at most ``timeout_s``) only for servers that joined the store but not the group.

A given-up join keeps its store listening until the join's own deadline (``timeout_s`` after it
began), as a merely abandoned master store would: a server whose ``/init_weights_update_group`` was
cancelled may still be connecting, and a store that vanished would leave its client retrying
(SGLang's ``init_custom_process_group`` uses c10d's default 30-minute timeout) with its scheduler blocked.
The store is held by a timer thread (it sleeps in Python, never inside c10d).

A collective that waits out its group's timeout is the same hazard: gloo's ``Work.wait()`` returns when
the operation completed, and a broadcast the servers do not receive waits ``timeout_s`` (``pg.abort()``,
``pg.shutdown()``, the backend's ``abort()`` and ``destroy_process_group`` do not end it on gloo: tried on
torch 2.13, the broadcast went on to its timeout). So such a thread waits in Python (:func:`wait_outside_c10d`).

Under torchrun the store is built here rather than by ``c10d.rendezvous("tcp://...")``, which would
make this rank a client of the elastic agent's store (see :func:`megatron_tir.rollout.sync.sglang.join_process_group`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from datetime import timedelta
from typing import Any

log = logging.getLogger(__name__)

CHECK_IN_S = 10.0  # bound of one giving-up count (the store is local and listening: milliseconds)


def group_from_store(store: Any, *, world_size: int, rank: int, group_name: str, backend: str,
                     timeout_s: float) -> Any:
    """The group as SGLang's servers build theirs (``init_custom_process_group``): a
    ``PrefixStore(group_name, store)`` and ``_new_process_group_helper``, outside the default world."""
    from torch.distributed import distributed_c10d as c10d

    pg, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend),
                                           c10d.PrefixStore(group_name, store), group_name=group_name,
                                           backend_options=None, timeout=timedelta(seconds=timeout_s))
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


class GroupJoin:
    """Rank 0 of a weight-update group, joining in a daemon thread (see the module docstring).

    ``future`` holds the process group (or the join's error); :meth:`result` waits for it;
    :meth:`cancel` gives the join up and returns once its thread ended."""

    def __init__(self, *, master_address: str, master_port: int, world_size: int, group_name: str,
                 backend: str, timeout_s: float) -> None:
        self.address, self.port, self.world_size = master_address, master_port, world_size
        self.group_name, self.backend, self.timeout_s = group_name, backend, timeout_s
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.deadline = time.monotonic() + timeout_s  # the join's own: a given-up store listens until then
        self._lock = threading.Lock()
        self._given_up = False
        self._waiting = False  # inside the master store's wait for the servers (a live store to count in)
        self._thread = threading.Thread(target=self._run, name="weight-sync-group", daemon=True)
        self._thread.start()

    def result(self, timeout: float | None = None) -> Any:
        return self.future.result(timeout)

    def _store(self, **kwargs: Any) -> Any:
        import torch.distributed as dist

        return dist.TCPStore(host_name=self.address, port=self.port, world_size=self.world_size, is_master=True,
                             timeout=timedelta(seconds=self.timeout_s), multi_tenant=True, use_libuv=True, **kwargs)

    def _run(self) -> None:
        host = store = None
        try:
            host = self._store(wait_for_workers=False)  # listens; counts no one
            with self._lock:
                if self._given_up:
                    raise concurrent.futures.CancelledError()
                self._waiting = True
            try:
                store = self._store()  # host's server; returns once world_size users counted in (itself too)
            finally:
                with self._lock:
                    self._waiting = False
            if self._given_up:
                raise concurrent.futures.CancelledError()
            host = None  # (store holds the server)
            group = group_from_store(store, world_size=self.world_size, rank=0, group_name=self.group_name,
                                     backend=self.backend, timeout_s=self.timeout_s)
        except BaseException as exc:  # handed to the waiting caller
            _keep_listening(store if store is not None else host, self.deadline)
            with self._lock:
                if not self.future.cancelled():
                    self.future.set_exception(exc)
                    return
            log.debug("weight-update group join %s given up: %r", self.group_name, exc)
            return
        with self._lock:
            if not self.future.cancelled():
                self.future.set_result(group)
                return
        _leave(group)  # given up while it completed

    def give_up(self) -> None:
        """Stop the join without waiting for its thread: the servers that did not count themselves in
        are counted in, so the master store's wait ends (a group already built is left)."""
        with self._lock:
            self._given_up = True
            count_in = self._waiting
            built = None
            if not self.future.cancel() and self.future.exception() is None:
                built = self.future.result()
        if built is not None:
            _leave(built)
        if not count_in:
            return
        import torch.distributed as dist

        for _ in range(self.world_size - 1):  # at most that many missing; a count past world_size ends it too
            try:  # world_size=1: no stagger (a client sleeps up to world_size ms before it connects)
                dist.TCPStore(host_name=self.address, port=self.port, world_size=1, is_master=False,
                              timeout=timedelta(seconds=min(self.timeout_s, CHECK_IN_S)), use_libuv=True)
            except Exception as exc:  # noqa: BLE001 - the join ended meanwhile (its store is gone)
                log.debug("counting in for the abandoned join %s: %r", self.group_name, exc)
                break

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for the thread (None: as long as a gloo group can still take, ``timeout_s`` and a few
        seconds); True when it ended."""
        self._thread.join(self.timeout_s + 5.0 if timeout_s is None else timeout_s)
        if self._thread.is_alive():
            log.warning("the given-up join of weight-update group %s is still in c10d", self.group_name)
        return not self._thread.is_alive()

    def cancel(self) -> bool:
        """Give the join up and wait for its thread (:meth:`give_up`, :meth:`wait`)."""
        self.give_up()
        return self.wait()


POLL_S = 0.01  # the longest sleep between two looks at a collective in flight


def wait_outside_c10d(work: Any) -> None:
    """``work.wait()`` for a collective that may block until its group's timeout (gloo's), waited for in
    Python: ``work.is_completed()`` between sleeps, and ``wait()`` (its error raised) once it completed. A
    thread left waiting is then in ``time.sleep``, which a finalizing interpreter ends cleanly, never in
    c10d's ``wait`` (see the module docstring; the process aborted when one came back during finalization)."""
    poll_s = 0.0005
    while not work.is_completed():
        time.sleep(poll_s)
        poll_s = min(2 * poll_s, POLL_S)
    work.wait()


def _keep_listening(store: Any, deadline: float) -> None:
    """Hold ``store`` (its server listening) until ``deadline``, in a timer thread that sleeps in Python."""
    if store is not None and (left := deadline - time.monotonic()) > 0:
        timer = threading.Timer(left, lambda held: None, args=(store,))
        timer.daemon = True
        timer.start()


def _leave(group: Any) -> None:
    import torch.distributed as dist

    try:
        dist.destroy_process_group(group)
    except Exception as exc:  # noqa: BLE001 - leaving a group nobody uses
        log.debug("leaving a given-up weight-update group: %r", exc)
