"""A worker: one process that owns N slots (one warm zygote each) and talks to the broker.

The worker keeps the ZeroMQ DEALER socket; zygotes never touch ZeroMQ. It announces its
idle slots (READY), takes at most one request per idle slot (the broker only sends to
announced slots, so no request waits behind a slow cell), forwards results, heartbeats,
and replaces a zygote that dies (telling the broker, which retries the request once
elsewhere). When the broker goes silent the worker reconnects with a fresh identity.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import zmq

from . import protocol as P
from .isolation import UidLease
from .limits import SandboxLimits
from .protocol import decode_zygote_hello, recv_frame
from .zygote import CELL_ENV
from .zygote.supervise import exec_result

log = logging.getLogger(__name__)

_PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)


@dataclass(kw_only=True, slots=True)
class WorkerConfig:
    connect: str  # the broker's worker endpoint
    slots: int = 1
    name: str = ""
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    heartbeat_interval_s: float = 0.5
    heartbeat_liveness: int = 6  # broker silent this many intervals -> reconnect
    uid_base: int = 61000
    zygote_start_timeout_s: float = 120.0
    stuck_grace_s: float = 15.0  # a zygote silent this long past a request's timeout is killed
    cell_nice: int | None = None  # nice value of cells (None: the zygote's own)
    exit_with_parent: int | None = None  # exit once this pid is no longer our parent (it died)

    def __post_init__(self) -> None:
        if "://" not in self.connect:
            raise ValueError(f"connect={self.connect!r} is not a ZeroMQ endpoint (tcp://host:port or ipc://path)")
        if not 1 <= self.slots <= 256:
            raise ValueError(f"slots={self.slots} outside [1, 256]")
        if self.heartbeat_interval_s <= 0 or self.heartbeat_liveness < 2:
            raise ValueError("heartbeat_interval_s must be > 0 and heartbeat_liveness >= 2")
        if self.cell_nice is not None and not -20 <= self.cell_nice <= 19:
            raise ValueError(f"cell_nice={self.cell_nice} outside [-20, 19]")
        if self.stuck_grace_s <= 0:
            raise ValueError(f"stuck_grace_s={self.stuck_grace_s} must be > 0")
        if not 1000 <= self.uid_base < 2**31 - 10000:
            raise ValueError(f"uid_base={self.uid_base} outside [1000, 2**31-10000)")
        if not self.name:
            self.name = f"{socket.gethostname()}-{os.getpid()}"


class ZygoteProcess:
    """One slot: a zygote subprocess, its socketpair, and the request it is running."""

    def __init__(self, index: int, uid_lease: UidLease, limits: SandboxLimits, cell_nice: int | None = None) -> None:
        self.index = index
        self.cell_nice = cell_nice
        self.uid_lease = uid_lease
        self.limits = limits
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.ready = False
        self.busy_id: str | None = None
        self.busy_deadline = 0.0  # past this the zygote is stuck: it is killed and the request retried
        self.credit_owed = False  # died while busy: the broker gets this slot back when it is ready again
        self.restarts = 0  # times this slot's zygote was replaced
        self.protections: list[P.Protection] = []
        self.exposed: list[str] = []  # what the cells' root shows of the host

    def start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(CELL_ENV, PYTHONPATH=_PACKAGE_PARENT)
        self.proc = subprocess.Popen(
            # -P: the worker's cwd is not on the zygote's sys.path (nor in the cells' root)
            [sys.executable, "-P", "-m", "sandbox_cluster.zygote", "--fd", str(theirs.fileno()),
             "--uid", str(self.uid_lease.uid), "--limits", self.limits.to_json(),
             *(["--cell-nice", str(self.cell_nice)] if self.cell_nice is not None else []),
             "--log-level", _log_level()],
            env=env, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, close_fds=True,
        )
        theirs.close()
        self.sock = ours
        self.ready = False
        self.busy_id = None

    def fileno(self) -> int:
        assert self.sock is not None
        return self.sock.fileno()

    def send(self, req: P.ExecRequest, payload: bytes) -> None:
        """Hand ``req`` (``payload`` encoded) to the zygote: its limits as numbers, the request
        itself in a memfd the zygote passes on to its cell unread."""
        assert self.sock is not None
        fd = os.memfd_create("request", os.MFD_CLOEXEC)
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view):]
            P.send_job(self.sock, req.timeout, req.memory_mb, fd)
        finally:
            os.close(fd)

    def recv(self) -> bytes | None:
        assert self.sock is not None
        return recv_frame(self.sock)

    def stop(self, grace_s: float = 0.0) -> None:
        """Close the socket (an idle zygote then exits by itself, removing its cgroups); kill
        it if it is still there after ``grace_s``."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        self.ready = False


def _log_level() -> str:
    """This process's logging level as a CLI choice: the zygote logs at the worker's level."""
    level = logging.getLogger().getEffectiveLevel()
    return "debug" if level <= logging.DEBUG else "info" if level <= logging.INFO else \
        "warning" if level <= logging.WARNING else "error"


class Worker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.ctx = zmq.Context.instance()
        self.socket: zmq.Socket | None = None
        self.slots: list[ZygoteProcess] = []
        self.leases: list[UidLease] = []
        self._stop = False
        self._last_broker_msg = 0.0
        self._silent_reconnects = 0  # reconnects since the broker last answered
        self.instance = uuid.uuid4().hex

    # ---- lifecycle

    def _connect(self) -> None:
        if self.socket is not None:
            self.socket.close(linger=0)
        self.socket = self.ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, f"{self.config.name}/{uuid.uuid4().hex[:8]}".encode())
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(self.config.connect)
        self._last_broker_msg = time.monotonic()
        self._announce(self._idle_slots())

    def _idle_slots(self) -> int:
        return sum(1 for s in self.slots if s.ready and s.busy_id is None)

    def _announce(self, free: int) -> None:
        assert self.socket is not None
        hello = P.WorkerHello(name=self.config.name, slots=self.config.slots, free=free,
                              protections=self.protections(), uids=self._uids(), instance=self.instance,
                              exposed=self.exposed(),
                              running=[s.busy_id for s in self.slots if s.busy_id is not None],
                              zygote_restarts=[s.restarts for s in self.slots], pid=os.getpid())
        self.socket.send_multipart([P.KIND_READY, P.encode_msg(hello)])

    def _uids(self) -> list[int]:
        return [lease.uid for lease in self.leases]

    def protections(self) -> list[P.Protection]:
        """Per protection: active only if every ready slot has it."""
        merged: dict[str, P.Protection] = {}
        for slot in self.slots:
            for p in slot.protections:
                if p.name not in merged or (merged[p.name].active and not p.active):
                    merged[p.name] = p
        return list(merged.values())

    def exposed(self) -> list[str]:
        """The host paths the cells' root shows (the same on every slot)."""
        return sorted({p for slot in self.slots for p in slot.exposed})

    def stop(self) -> None:
        self._stop = True

    def run(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.stop())
        signal.signal(signal.SIGINT, lambda *_: self.stop())
        try:
            for i in range(self.config.slots):
                lease = UidLease.acquire(self.config.uid_base)
                self.leases.append(lease)
                self.slots.append(ZygoteProcess(i, lease, self.config.limits, self.config.cell_nice))
            for slot in self.slots:
                slot.start()
            self._wait_zygotes_ready()
            self._log_protections()
            self._connect()
            self._loop()
        finally:
            if self.socket is not None:
                try:
                    self.socket.send_multipart([P.KIND_BYE], flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
                self.socket.close(linger=0)
            for slot in self.slots:  # EOF first, so idle zygotes all exit (and clean up) together
                if slot.sock is not None:
                    slot.sock.close()
                    slot.sock = None
            deadline = time.monotonic() + 2.0
            for slot in self.slots:
                slot.stop(grace_s=max(0.0, deadline - time.monotonic()))
            for lease in self.leases:
                lease.release()

    def _wait_zygotes_ready(self) -> None:
        end = time.monotonic() + self.config.zygote_start_timeout_s
        for slot in self.slots:
            slot.sock.settimeout(max(0.1, end - time.monotonic()))
            try:
                frame = slot.recv()
            except (TimeoutError, ConnectionError, OSError) as exc:
                raise RuntimeError(f"zygote {slot.index} did not start: {exc}") from None
            if frame is None:
                raise RuntimeError(f"zygote {slot.index} exited during start (see its log above)")
            slot.sock.settimeout(None)
            hello = decode_zygote_hello(frame)
            slot.protections, slot.exposed = hello.protections, hello.exposed
            slot.ready = True

    def _log_protections(self) -> None:
        missing = [p for p in self.protections() if not p.active]
        for p in self.protections():
            log.info("protection %-18s %s %s", p.name, "active" if p.active else "MISSING", p.detail)
        if missing and self.config.limits.require_full_isolation:
            raise RuntimeError(f"host cannot give: {', '.join(p.name for p in missing)} (require_full_isolation)")
        if missing:
            log.warning("running WITHOUT: %s", ", ".join(f"{p.name} ({p.detail})" for p in missing))
        if self.exposed():
            log.info("cells see these host paths (read-only): %s", ", ".join(self.exposed()))

    # ---- main loop

    def _loop(self) -> None:
        interval = self.config.heartbeat_interval_s
        next_heartbeat = time.monotonic()
        pending: collections.deque[bytes] = collections.deque()  # requests that arrived while no slot was idle
        while not self._stop:
            poller = zmq.Poller()
            poller.register(self.socket, zmq.POLLIN)
            for slot in self.slots:
                if slot.sock is not None:
                    poller.register(slot.sock, zmq.POLLIN)
            timeout_ms = max(0, int((next_heartbeat - time.monotonic()) * 1000))
            events = dict(poller.poll(timeout_ms))
            if self.socket in events:
                self._on_broker(pending)
            for slot in self.slots:
                if slot.sock is not None and slot.sock.fileno() in events:
                    self._on_zygote(slot)
            self._dispatch_pending(pending)
            now = time.monotonic()
            for slot in self.slots:
                if slot.busy_id is not None and now > slot.busy_deadline:
                    self._zygote_died(slot, "no result long past the request's timeout (killed)")
            if now >= next_heartbeat:
                if self.config.exit_with_parent is not None and os.getppid() != self.config.exit_with_parent:
                    log.warning("the process that started this worker is gone; exiting")
                    return
                self.socket.send_multipart([P.KIND_HEARTBEAT])
                next_heartbeat = now + interval
                if now - self._last_broker_msg > interval * self.config.heartbeat_liveness:
                    # a loaded machine's load noise at INFO; WARNING once it persists (3 in a row)
                    self._silent_reconnects += 1
                    log.log(logging.WARNING if self._silent_reconnects >= 3 else logging.INFO,
                            "broker silent for %.1f s; reconnecting (%d in a row)", now - self._last_broker_msg,
                            self._silent_reconnects)
                    pending.clear()
                    self._connect()

    def _on_broker(self, pending: collections.deque[bytes]) -> None:
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._last_broker_msg = time.monotonic()
            self._silent_reconnects = 0
            kind = frames[0]
            if kind == P.KIND_EXEC and len(frames) == 2:
                pending.append(frames[1])
            elif kind == P.KIND_RESET:
                log.info("broker does not know us; announcing again")
                pending.clear()  # the broker has requeued or forgotten them
                self._announce(self._idle_slots())
            elif kind != P.KIND_HEARTBEAT:
                log.warning("unexpected message from broker: %r", kind[:32])

    def _dispatch_pending(self, pending: collections.deque[bytes]) -> None:
        while pending:
            slot = next((s for s in self.slots if s.ready and s.busy_id is None), None)
            if slot is None:
                return
            payload = pending.popleft()
            try:
                req = P.decode_request(payload)
            except ValueError as exc:  # the broker validated it; this is a bug, but answer anyway
                self.socket.send_multipart([P.KIND_RESULT, P.encode(
                    P.ExecResult(id=P.salvage_id(payload), status=P.Status.SANDBOX_ERROR, message=str(exc)))])
                continue
            slot.busy_id = req.id
            slot.busy_deadline = time.monotonic() + req.timeout + self.config.stuck_grace_s
            try:
                slot.send(req, payload)
            except OSError as exc:
                self._zygote_died(slot, f"send failed: {exc}")

    def _on_zygote(self, slot: ZygoteProcess) -> None:
        try:
            frame = slot.recv()
        except (ConnectionError, OSError) as exc:
            frame, reason = None, str(exc)
        else:
            reason = "zygote exited"
        if frame is None:
            self._zygote_died(slot, reason)
            return
        if not slot.ready:  # a restarted zygote finished warming up
            hello = decode_zygote_hello(frame)
            slot.protections, slot.exposed = hello.protections, hello.exposed
            slot.ready = True
            if not slot.credit_owed:
                return
            slot.credit_owed = False
            self._announce(1)  # a known worker's READY adds its slots to the idle count
            return
        busy, slot.busy_id = slot.busy_id, None
        try:
            result = exec_result(busy or "", *P.decode_outcome(frame), self.config.limits.output_hard_cap_bytes)
        except (ValueError, msgspec.DecodeError) as exc:  # a bug: answer anyway
            result = P.ExecResult(id=busy or "", status=P.Status.SANDBOX_ERROR, message=f"zygote reply: {exc}")
        self.socket.send_multipart([P.KIND_RESULT, P.encode(result)])

    def _zygote_died(self, slot: ZygoteProcess, reason: str) -> None:
        code = slot.proc.poll() if slot.proc is not None else None
        log.error("zygote %d died (%s, exit %s); restarting", slot.index, reason, code)
        busy, was_ready = slot.busy_id, slot.ready
        slot.stop()
        slot.credit_owed = busy is not None
        if busy is not None:
            self.socket.send_multipart([P.KIND_FAILED, P.encode_msg(P.SlotFailure(id=busy, reason=reason))])
        if not was_ready:  # it died while warming up: something is wrong with this host, not with a cell
            raise RuntimeError(f"zygote {slot.index} failed to start again ({reason}); worker exits")
        slot.start()
        slot.restarts += 1
        self._announce(0)  # no new idle slot; it tells the broker (and STATUS) of the restart
