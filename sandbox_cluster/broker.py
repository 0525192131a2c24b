"""The broker: a ROUTER for clients, a ROUTER for workers, a bounded queue between them.

Workers announce idle slots (READY) and the broker sends each request only to an idle
slot, so no request waits behind a slow cell. The broker tells the client ACCEPTED when it
takes a request; a copy of a request it holds (same client, same id: a client resends
until ACCEPTED comes, since ZeroMQ drops what it hands to a dying connection) is not taken
again. Every request the broker accepts gets exactly one reply:

- its result (the first one from the worker it is assigned to; late or duplicate results
  from a worker that was given up on are dropped),
- or, when its worker dies (heartbeats stop, BYE, or its zygote crashes), a retry on
  another slot, once; a second failure is answered ``sandbox_error``,
- or, if the queue is full when it arrives, or it waited past its ``max_queue_s`` without
  starting (its caller has given up), ``overloaded``: it did not run, so a retry is safe,
- or, if it does not validate, ``error`` with a one-line reason.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import signal
import time
import uuid
from dataclasses import dataclass, field

import msgspec
import zmq

from . import protocol as P

log = logging.getLogger(__name__)


def derive_worker_endpoint(client_endpoint: str) -> str:
    """Default worker endpoint next to a client endpoint: tcp port + 1, or ``<ipc path>.workers``."""
    if client_endpoint.startswith("tcp://"):
        host, _, port = client_endpoint[len("tcp://"):].rpartition(":")
        if port == "*":
            return client_endpoint
        if not port.isdigit() or not host:
            raise ValueError(f"cannot derive a worker endpoint from {client_endpoint!r}; pass one")
        return f"tcp://{host}:{int(port) + 1}"
    if client_endpoint.startswith("ipc://"):
        return client_endpoint + ".workers"
    raise ValueError(f"endpoint {client_endpoint!r} must start with tcp:// or ipc://")


@dataclass(kw_only=True, slots=True)
class BrokerConfig:
    bind: str  # client endpoint, e.g. tcp://0.0.0.0:5555 or ipc:///run/sandbox.sock
    worker_bind: str = ""  # default: derive_worker_endpoint(bind)
    max_queue: int = 10_000  # queued (not yet running) requests; past it: overloaded
    heartbeat_interval_s: float = 0.5
    heartbeat_liveness: int = 6  # a worker silent this many intervals is dead
    max_attempts: int = 2  # a request whose worker dies is tried this many times in all
    max_message_bytes: int = 64 << 20  # larger ZeroMQ messages drop the sender's connection

    def __post_init__(self) -> None:
        if not self.worker_bind:
            self.worker_bind = derive_worker_endpoint(self.bind)
        for ep in (self.bind, self.worker_bind):
            if not ep.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"endpoint {ep!r} must start with tcp://, ipc:// or inproc://")
        if self.bind == self.worker_bind and not self.bind.endswith(":*"):
            raise ValueError("client and worker endpoints must differ")
        if self.max_queue < 0:
            raise ValueError(f"max_queue={self.max_queue} must be >= 0")
        if self.heartbeat_interval_s <= 0 or self.heartbeat_liveness < 2:
            raise ValueError("heartbeat_interval_s must be > 0 and heartbeat_liveness >= 2")
        if not 1 <= self.max_attempts <= 5:
            raise ValueError(f"max_attempts={self.max_attempts} outside [1, 5]")
        if self.max_message_bytes < P.MAX_CODE_BYTES + P.MAX_STDIN_BYTES + P.MAX_FILES_BYTES:
            raise ValueError("max_message_bytes must hold the largest valid request")


@dataclass(slots=True)
class _Task:
    key: str  # broker-internal id, also the id the worker sees
    client: bytes  # ROUTER identity of the client
    client_id: str  # the id the client chose
    payload: bytes  # the request as sent to workers (id = key)
    expires: float = math.inf  # monotonic time past which it is not started (max_queue_s)
    attempts: int = 0
    worker: bytes | None = None


@dataclass(slots=True)
class _Worker:
    identity: bytes
    name: str
    slots: int
    free: int
    last_seen: float
    protections: list[P.Protection]
    uids: list[int]
    instance: str
    exposed: list[str] = field(default_factory=list)
    zygote_restarts: list[int] = field(default_factory=list)
    pid: int = 0
    in_flight: set[str] = field(default_factory=set)
    last_dispatch: int = 0  # ties on idle slots go to the least recently used worker


class Broker:
    def __init__(self, config: BrokerConfig, ctx: zmq.Context | None = None) -> None:
        self.config = config
        self.ctx = ctx or zmq.Context.instance()
        self.frontend = self.ctx.socket(zmq.ROUTER)
        self.backend = self.ctx.socket(zmq.ROUTER)
        for sock in (self.frontend, self.backend):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
        self.frontend.bind(config.bind)
        self.backend.bind(config.worker_bind)
        self.client_endpoint = self.frontend.getsockopt_string(zmq.LAST_ENDPOINT)
        self.worker_endpoint = self.backend.getsockopt_string(zmq.LAST_ENDPOINT)
        self.queue: collections.deque[_Task] = collections.deque()
        self.tasks: dict[str, _Task] = {}
        self._accepted: dict[tuple[bytes, str], str] = {}  # (client, its request id) -> key, until answered
        self.workers: dict[bytes, _Worker] = {}
        self.served = self.retried = self.rejected = 0
        self._prefix = uuid.uuid4().hex[:8]
        self._instance = uuid.uuid4().hex  # told in every STATUS reply: clients see a restart
        self._seq = 0
        self._dispatches = 0
        self._stop = False

    # ---- lifecycle

    def stop(self) -> None:
        self._stop = True

    def close(self) -> None:
        self.frontend.close(linger=0)
        self.backend.close(linger=0)

    def run(self, install_signal_handlers: bool = False, exit_with_parent: int | None = None) -> None:
        """Serve until ``stop()`` (or SIGTERM/SIGINT when ``install_signal_handlers``); with
        ``exit_with_parent=PID``, also once that process is no longer our parent (it died)."""
        if install_signal_handlers:
            signal.signal(signal.SIGTERM, lambda *_: self.stop())
            signal.signal(signal.SIGINT, lambda *_: self.stop())
        log.info("broker: clients at %s, workers at %s, queue bound %d",
                 self.client_endpoint, self.worker_endpoint, self.config.max_queue)
        poller = zmq.Poller()
        poller.register(self.frontend, zmq.POLLIN)
        poller.register(self.backend, zmq.POLLIN)
        interval = self.config.heartbeat_interval_s
        next_tick = time.monotonic() + interval
        try:
            while not self._stop:
                timeout_ms = max(0, int((next_tick - time.monotonic()) * 1000))
                events = dict(poller.poll(timeout_ms))
                if self.backend in events:
                    self._drain(self.backend, self._on_worker)
                if self.frontend in events:
                    self._drain(self.frontend, self._on_client)
                self._dispatch()
                if time.monotonic() >= next_tick:
                    if exit_with_parent is not None and os.getppid() != exit_with_parent:
                        log.warning("the process that started this broker is gone; exiting")
                        break
                    self._tick()
                    next_tick = time.monotonic() + interval
        finally:
            self.close()

    @staticmethod
    def _drain(sock: zmq.Socket, handler, budget: int = 1000) -> None:
        for _ in range(budget):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            handler(frames)

    # ---- clients

    def _reply(self, client: bytes, result: P.ExecResult) -> None:
        self.frontend.send_multipart([client, P.KIND_RESULT, P.encode(result)])

    def _on_client(self, frames: list[bytes]) -> None:
        client, kind, body = frames[0], frames[1] if len(frames) > 1 else b"", frames[2:]
        if kind == P.KIND_STATUS and not body:
            self.frontend.send_multipart([client, P.KIND_STATUS, P.encode_msg(self.status())])
            return
        if kind != P.KIND_EXEC or len(body) != 1:
            self._reply(client, P.ExecResult(
                id="", status=P.Status.ERROR,
                message=f"bad message: expected [EXEC, request] or [STATUS], got kind {kind[:16]!r} "
                        f"with {len(body)} payload frame(s)"))
            return
        try:
            req = P.decode_request(body[0])
        except ValueError as exc:
            self._reply(client, P.ExecResult(id=P.salvage_id(body[0]), status=P.Status.ERROR, message=str(exc)))
            return
        if (client, req.id) in self._accepted:  # a resend whose first copy got here: say so again
            self.frontend.send_multipart([client, P.KIND_ACCEPTED, req.id.encode()])
            return
        self._dispatch()
        if len(self.queue) >= self.config.max_queue and not self._has_free_slot():
            self.rejected += 1
            self._reply(client, P.ExecResult(
                id=req.id, status=P.Status.OVERLOADED,
                message=f"queue full ({len(self.queue)} waiting); retry later"))
            return
        self._seq += 1
        key = f"{self._prefix}-{self._seq}"
        task = _Task(key=key, client=client, client_id=req.id,
                     payload=P.encode(msgspec.structs.replace(req, id=key)),
                     expires=time.monotonic() + req.max_queue_s if req.max_queue_s is not None else math.inf)
        self.tasks[key] = task
        self._accepted[(client, req.id)] = key
        self.queue.append(task)
        self.frontend.send_multipart([client, P.KIND_ACCEPTED, req.id.encode()])
        self._dispatch()

    def _forget(self, task: _Task) -> None:
        """The task is answered: drop it (a later copy of its request would be a new one)."""
        del self.tasks[task.key]
        self._accepted.pop((task.client, task.client_id), None)

    def _has_free_slot(self) -> bool:
        return any(w.free > 0 for w in self.workers.values())

    # ---- workers

    def _on_worker(self, frames: list[bytes]) -> None:
        identity, kind, body = frames[0], frames[1] if len(frames) > 1 else b"", frames[2:]
        worker = self.workers.get(identity)
        if worker is not None:
            worker.last_seen = time.monotonic()
        try:
            if kind == P.KIND_READY and len(body) == 1:
                self._on_ready(identity, P.decode_hello(body[0]))
            elif worker is None:
                if kind != P.KIND_BYE:
                    self.backend.send_multipart([identity, P.KIND_RESET])
            elif kind == P.KIND_HEARTBEAT:
                pass
            elif kind == P.KIND_RESULT and len(body) == 1:
                worker.free += 1
                self._on_result(worker, P.decode_result(body[0]))
            elif kind == P.KIND_FAILED and len(body) == 1:
                failure = P.decode_failure(body[0])
                task = self.tasks.get(failure.id)
                if task is not None and task.worker == identity:
                    worker.in_flight.discard(task.key)
                    self._retry_or_fail(task, f"worker {worker.name}: {failure.reason}")
            elif kind == P.KIND_BYE:
                self._drop_worker(worker, "said goodbye")
            else:
                log.warning("worker %s sent an unexpected message %r", worker.name, kind[:16])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("undecodable %r from worker %r: %s", kind[:16], identity[:64], exc)

    def _on_ready(self, identity: bytes, hello: P.WorkerHello) -> None:
        worker = self.workers.get(identity)
        adopted: set[str] = set()
        if worker is None and hello.instance:
            # The same worker process reconnected: what it still runs moves over, the rest is retried.
            for old in [w for w in self.workers.values() if w.instance == hello.instance]:
                adopted |= old.in_flight & set(hello.running)
                old.in_flight -= adopted
                self._drop_worker(old, "reconnected under a new identity")
        if worker is None:
            worker = _Worker(identity=identity, name=hello.name, slots=hello.slots, free=0,
                             last_seen=time.monotonic(), protections=list(hello.protections),
                             uids=list(hello.uids), instance=hello.instance, exposed=list(hello.exposed),
                             pid=hello.pid)
            for key in adopted:
                self.tasks[key].worker = identity
            worker.in_flight |= adopted
            self.workers[identity] = worker
            missing = [p.name for p in hello.protections if not p.active]
            log.info("worker %s joined: %d slot(s), %d idle%s", hello.name, hello.slots, hello.free,
                     f"; MISSING protections: {', '.join(missing)}" if missing else "")
        worker.free += hello.free
        worker.protections = list(hello.protections)
        worker.zygote_restarts = list(hello.zygote_restarts)

    def _on_result(self, worker: _Worker, result: P.ExecResult) -> None:
        task = self.tasks.get(result.id)
        if task is None or task.worker != worker.identity:
            log.info("dropping a late result for %s from %s", result.id, worker.name)
            return
        worker.in_flight.discard(task.key)
        self._forget(task)
        self.served += 1
        self._reply(task.client, msgspec.structs.replace(result, id=task.client_id))

    def _retry_or_fail(self, task: _Task, reason: str) -> None:
        task.worker = None
        if task.attempts >= self.config.max_attempts:
            self._forget(task)
            log.error("request %s failed %d times; answering sandbox_error (%s)", task.key, task.attempts, reason)
            self._reply(task.client, P.ExecResult(
                id=task.client_id, status=P.Status.SANDBOX_ERROR,
                message=f"sandbox failed {task.attempts} times; last: {reason}"))
            return
        log.warning("retrying request %s on another slot (%s)", task.key, reason)
        self.retried += 1
        self.queue.appendleft(task)

    def _drop_worker(self, worker: _Worker, why: str) -> None:
        # a goodbye, or a reconnect under load that left nothing to retry, is not a problem
        quiet = why == "said goodbye" or why.startswith("reconnected")
        level = logging.INFO if quiet and not worker.in_flight else logging.WARNING
        log.log(level, "worker %s %s; %d request(s) to retry", worker.name, why, len(worker.in_flight))
        del self.workers[worker.identity]
        for key in sorted(worker.in_flight):
            task = self.tasks.get(key)
            if task is not None and task.worker == worker.identity:
                self._retry_or_fail(task, f"worker {worker.name} {why}")

    def _expire(self, task: _Task, now: float) -> bool:
        """Answer a task that waited past its max_queue_s without ever running; True if it did."""
        if task.attempts or now < task.expires:
            return False
        self._forget(task)
        self.rejected += 1
        self._reply(task.client, P.ExecResult(
            id=task.client_id, status=P.Status.OVERLOADED,
            message="not started within its max_queue_s; it did not run (safe to retry)"))
        return True

    def _dispatch(self) -> None:
        while self.queue:
            worker = max(self.workers.values(), key=lambda w: (w.free, -w.last_dispatch), default=None)
            if worker is None or worker.free <= 0:
                return
            task = self.queue.popleft()
            if self._expire(task, time.monotonic()):
                continue
            task.attempts += 1
            task.worker = worker.identity
            worker.free -= 1
            worker.in_flight.add(task.key)
            self._dispatches += 1
            worker.last_dispatch = self._dispatches
            self.backend.send_multipart([worker.identity, P.KIND_EXEC, task.payload])

    def _tick(self) -> None:
        now = time.monotonic()
        if any(now >= t.expires for t in self.queue):
            self.queue = collections.deque(t for t in self.queue if not self._expire(t, now))
        limit = self.config.heartbeat_interval_s * self.config.heartbeat_liveness
        for worker in list(self.workers.values()):
            if now - worker.last_seen > limit:
                self._drop_worker(worker, f"silent for {now - worker.last_seen:.1f} s")
            else:
                self.backend.send_multipart([worker.identity, P.KIND_HEARTBEAT])

    def status(self) -> P.ClusterStatus:
        return P.ClusterStatus(
            workers=[P.WorkerInfo(name=w.name, slots=w.slots, free=w.free, in_flight=len(w.in_flight),
                                  protections=w.protections, uids=w.uids, exposed=w.exposed,
                                  zygote_restarts=w.zygote_restarts, pid=w.pid)
                     for w in self.workers.values()],
            queued=len(self.queue),
            in_flight=sum(len(w.in_flight) for w in self.workers.values()),
            max_queue=self.config.max_queue,
            served=self.served, retried=self.retried, rejected=self.rejected, broker_id=self._instance,
        )
