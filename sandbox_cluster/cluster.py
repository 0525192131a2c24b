"""LocalCluster: a broker and N workers as local subprocesses, supervised, for one node.

Used by ``sandbox-cluster serve``, ``sandbox-cluster run`` without ``--connect``, the
embedded default run, and tests::

    with LocalCluster(workers=2) as cluster:
        with SandboxClient(cluster.address) as client:
            print(client.run("print(1 + 1)").stdout)

A worker that dies is restarted (its in-flight request is retried by the broker); a broker
that dies is restarted on the same endpoints (workers rejoin it, clients resend what it had
not accepted; what it had accepted is answered ``sandbox_error`` at the client's deadline).
The cluster's temporary directory (its ipc sockets) is removed by ``close``, when start-up
fails, when the object is collected or the interpreter exits without ``close``, and, after a
kill, by the next ``LocalCluster`` started on the host (its name holds its owner's pid).
"""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path

from .broker import derive_worker_endpoint
from .client import SandboxClient
from .limits import SandboxLimits
from .protocol import ClusterStatus

log = logging.getLogger(__name__)

# The broker and workers run this very sandbox_cluster (not whatever the cwd or site-packages hold).
_PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)
_TMP_PREFIX = "sandbox-cluster-"


def remove_stale_dirs(parent: str | None = None) -> list[str]:
    """Remove the temporary directories of LocalClusters whose owner process is gone (killed
    before it could clean up); returns them. A directory is named ``sandbox-cluster-<pid>-*``."""
    parent = parent or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        pid = name[len(_TMP_PREFIX):].partition("-")[0]
        if not name.startswith(_TMP_PREFIX) or not pid.isdigit() or _alive(int(pid)):
            continue
        path = os.path.join(parent, name)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LocalCluster:
    def __init__(
        self,
        workers: int = 2,
        *,
        address: str | None = None,
        worker_address: str | None = None,
        slots_per_worker: int = 1,
        max_queue: int = 10_000,
        heartbeat_interval_s: float = 0.5,
        heartbeat_liveness: int = 6,
        restart_workers: bool = True,
        env: dict[str, str] | None = None,
        log_level: str = "warning",
        priority_boost: int = 5,
        start_timeout_s: float = 180.0,
        **limits,
    ) -> None:
        if not 1 <= workers <= 512:
            raise ValueError(f"workers={workers} outside [1, 512]")
        if not 1 <= slots_per_worker <= 256:
            raise ValueError(f"slots_per_worker={slots_per_worker} outside [1, 256]")
        if not 0 <= priority_boost <= 19:
            raise ValueError(f"priority_boost={priority_boost} outside [0, 19]")
        self._priority_boost = priority_boost
        if not start_timeout_s > 0:
            raise ValueError(f"start_timeout_s={start_timeout_s} must be > 0")
        if max_queue < 0:
            raise ValueError(f"max_queue={max_queue} must be >= 0")
        try:
            self.limits = SandboxLimits(**limits)
        except TypeError as exc:
            raise ValueError(f"LocalCluster: {exc}") from None
        self.n_workers = workers
        self.slots_per_worker = slots_per_worker
        self.restart_workers = restart_workers
        search = [_PACKAGE_PARENT, *filter(None, [os.environ.get("PYTHONPATH")])]
        self._env = {**os.environ, "PYTHONPATH": os.pathsep.join(search), **(env or {})}
        self._log_level = log_level
        self._hb = (heartbeat_interval_s, heartbeat_liveness)
        if address is not None:
            worker_address = worker_address or derive_worker_endpoint(address)  # validates both
        remove_stale_dirs()
        self._tmpdir = tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-")
        # Collected or left at interpreter exit without close(): the directory goes all the same.
        self._remove_tmpdir = weakref.finalize(self, shutil.rmtree, self._tmpdir, ignore_errors=True)
        address = address or f"ipc://{self._tmpdir}/client.sock"
        worker_address = worker_address or derive_worker_endpoint(address)
        self._max_queue = max_queue
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self.broker: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen | None] = [None] * workers
        self._started_at = [0.0] * workers
        self._fast_failures = [0] * workers  # consecutive exits soon after start: restart with backoff
        self._restart_at = [0.0] * workers
        self.restarts = 0
        self.broker_restarts = 0
        self._broker_failures = 0
        self._broker_restart_at = 0.0
        try:
            self._start_broker(address, worker_address, max_queue)
            for i in range(workers):
                self.workers[i] = self._spawn_worker(i)
            self._wait_registered(start_timeout_s)
        except BaseException:
            self.close()
            raise
        self._monitor = threading.Thread(target=self._supervise, name="local-cluster-monitor", daemon=True)
        self._monitor.start()

    # ---- processes

    def _cli(self, *args: str) -> list[str]:
        return [sys.executable, "-P", "-m", "sandbox_cluster.cli", "--log-level", self._log_level, *args,
                "--priority-boost", str(self._priority_boost), "--exit-with-parent", str(os.getpid())]

    def _start_broker(self, address: str, worker_address: str, max_queue: int) -> None:
        interval, liveness = self._hb
        self._broker_started_at = time.monotonic()
        self.broker = subprocess.Popen(
            self._cli("broker", "--bind", address, "--worker-bind", worker_address, "--max-queue", str(max_queue),
                      "--heartbeat-interval", str(interval), "--heartbeat-liveness", str(liveness)),
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=self._env,
        )
        ready, _, _ = select.select([self.broker.stdout], [], [], 30)
        line = self.broker.stdout.readline() if ready else b""
        try:
            endpoints = json.loads(line)
        except json.JSONDecodeError:
            raise RuntimeError(f"broker did not start (exit {self.broker.poll()}): {line[:200]!r}") from None
        self.address: str = endpoints["client"]
        self.worker_address: str = endpoints["worker"]

    def _spawn_worker(self, index: int) -> subprocess.Popen:
        interval, liveness = self._hb
        self._started_at[index] = time.monotonic()
        return subprocess.Popen(
            self._cli("worker", "--connect", self.worker_address, "--slots", str(self.slots_per_worker),
                      "--name", f"local-{index}", "--limits", self.limits.to_json(),
                      "--heartbeat-interval", str(interval), "--heartbeat-liveness", str(liveness)),
            stdin=subprocess.DEVNULL, env=self._env,
        )

    def _wait_registered(self, timeout_s: float) -> None:
        """Until the broker answers and every worker has registered all its slots (idle or already
        busy: clients may keep them busy from the first second). A worker that exits before it
        registered is an error; from then on the supervisor restarts dead workers, whatever the load."""
        names = {f"local-{i}" for i in range(self.n_workers)}
        end = time.monotonic() + timeout_s
        with SandboxClient(self.address) as client:
            while True:
                dead = [i for i, proc in enumerate(self.workers) if proc is not None and proc.poll() is not None]
                if dead:
                    raise RuntimeError(f"worker {dead[0]} exited with {self.workers[dead[0]].returncode} during "
                                       f"start (see log)")
                if self.broker.poll() is not None:
                    raise RuntimeError(f"broker exited with {self.broker.returncode} during start")
                status = client.status(timeout=max(1.0, end - time.monotonic()))
                registered = {w.name for w in status.workers if w.free + w.in_flight >= w.slots}
                if names <= registered:
                    return
                if time.monotonic() > end:
                    missing = sorted(names - registered)
                    raise RuntimeError(f"cluster not started after {timeout_s:g} s: worker(s) {', '.join(missing)} "
                                       f"not registered ({status})")
                time.sleep(0.05)

    def _wait_ready(self, timeout_s: float) -> None:
        """Until every worker process alive now has registered all its slots idle, and the broker
        lists no earlier process under a worker's name (a killed worker stays listed, its slots
        counted free, until it has been silent for the heartbeat liveness). A worker that the
        supervisor restarts is waited for (until the timeout)."""
        end = time.monotonic() + timeout_s
        with SandboxClient(self.address) as client:
            while True:
                dead = [i for i, proc in enumerate(self.workers) if proc is not None and proc.poll() is not None]
                if dead and not self.restart_workers:
                    i = dead[0]
                    raise RuntimeError(f"worker {i} exited with {self.workers[i].returncode} and is not restarted "
                                       f"(see log)")
                if self.broker.poll() is not None:
                    raise RuntimeError(f"broker exited with {self.broker.returncode}")
                status = client.status(timeout=max(1.0, end - time.monotonic()))
                if not dead and self._all_idle(status):
                    return
                if time.monotonic() > end:
                    raise RuntimeError(f"cluster not ready after {timeout_s} s: {status}")
                time.sleep(0.05)

    def _all_idle(self, status: ClusterStatus) -> bool:
        """Each worker's current process listed once, every slot free, and nothing stale under its name."""
        with self._lock:
            current = {f"local-{i}": proc.pid for i, proc in enumerate(self.workers) if proc is not None}
        listed = [w for w in status.workers if w.name in current]
        return len(listed) == len(current) and all(
            w.pid == current[w.name] and w.slots == self.slots_per_worker and w.free >= w.slots for w in listed)

    def _supervise(self) -> None:
        while not self._closing.wait(0.2):
            with self._lock:
                now = time.monotonic()
                if self.broker is not None and self.broker.poll() is not None and not self._closing.is_set():
                    self._restart_broker(now)
                for i, proc in enumerate(self.workers):
                    if proc is None or proc.poll() is None or self._closing.is_set() or not self.restart_workers:
                        continue
                    if self._restart_at[i] == 0.0:  # just noticed the exit
                        lived = now - self._started_at[i]
                        self._fast_failures[i] = self._fast_failures[i] + 1 if lived < 30 else 0
                        delay = 0.0 if self._fast_failures[i] <= 1 else min(30.0, 0.5 * 2 ** self._fast_failures[i])
                        log.warning("worker %d exited with %s after %.1f s; restarting in %.1f s",
                                    i, proc.returncode, lived, delay)
                        self._restart_at[i] = now + delay
                    if now >= self._restart_at[i]:
                        self._restart_at[i] = 0.0
                        self.workers[i] = self._spawn_worker(i)
                        self.restarts += 1

    def _restart_broker(self, now: float) -> None:
        """On the endpoints it had (as bound: a tcp port 0 keeps the port it got)."""
        if self._broker_restart_at == 0.0:  # just noticed the exit
            lived = now - self._broker_started_at
            self._broker_failures = self._broker_failures + 1 if lived < 30 else 0
            delay = 0.0 if self._broker_failures <= 1 else min(30.0, 0.5 * 2 ** self._broker_failures)
            log.warning("broker exited with %s after %.1f s; restarting in %.1f s", self.broker.returncode, lived,
                        delay)
            self._broker_restart_at = now + delay
        if now < self._broker_restart_at:
            return
        self._broker_restart_at = 0.0
        if self.broker.stdout is not None:
            self.broker.stdout.close()
        try:
            self._start_broker(self.address, self.worker_address, self._max_queue)
        except (RuntimeError, OSError) as exc:  # tried again on the next round, with backoff
            log.error("broker restart failed: %s", exc)
            return
        self.broker_restarts += 1

    # ---- public

    @property
    def broker_pid(self) -> int:
        assert self.broker is not None
        return self.broker.pid

    def kill_broker(self) -> int:
        """SIGKILL the broker (it is restarted); returns its pid."""
        with self._lock:
            assert self.broker is not None
            self.broker.kill()
            return self.broker.pid

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.workers if p is not None and p.poll() is None]

    def kill_worker(self, index: int) -> int:
        """SIGKILL one worker process (it is restarted); returns its pid once it is dead (so a
        ``wait_workers()`` right after cannot take it for the live worker it was)."""
        with self._lock:
            proc = self.workers[index]
            assert proc is not None
            proc.kill()
            proc.wait(30)
            return proc.pid

    def status(self) -> ClusterStatus:
        with SandboxClient(self.address) as client:
            return client.status()

    def wait_workers(self, timeout_s: float = 120.0) -> None:
        """Block until every slot is registered and idle again (e.g. after kill_worker: a worker
        killed a moment ago, not yet seen by the supervisor, is waited for, not an error)."""
        self._wait_ready(timeout_s)

    def close(self) -> None:
        self._closing.set()
        with self._lock:
            procs = [p for p in self.workers if p is not None] + ([self.broker] if self.broker else [])
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            end = time.monotonic() + 5.0
            for proc in procs:
                try:
                    proc.wait(max(0.1, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("pid %d ignored SIGTERM; killing", proc.pid)
                    proc.kill()
                    proc.wait()
            if self.broker is not None and self.broker.stdout is not None:
                self.broker.stdout.close()
        self._remove_tmpdir()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
