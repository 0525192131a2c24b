"""Client of the sandbox cluster: ``run`` (blocking) and ``arun`` (asyncio, many in flight).

Every call returns an ``ExecResult``; infrastructure trouble is a result too, never an
exception: no reply before the client deadline (cell timeout + ``deadline_slack_s``) is
``sandbox_error``. Each request tells the broker how long it may wait in the queue (what
is left of the slack), so work the caller gave up on is answered ``overloaded`` instead of
run. A request is sent again until the broker says ACCEPTED (ZeroMQ drops a message handed
to a connection that is dying, e.g. while the broker restarts; a copy that reaches a broker
still holding the request is not taken again, and ACCEPTED comes within milliseconds, long
before a copy is sent). Only ``overloaded`` is retried (the broker did not accept
the request, so retrying cannot run it twice); arguments that would not pass the broker's
validation raise ``ValueError`` before anything is sent.

A dead broker is noticed within seconds, not at the deadline: the client's first request is
preceded by a STATUS (which broker it talks to); while requests wait and the broker has said
nothing for ``heartbeat_s``, the client asks for its STATUS again; silent for
``broker_silence_s``, every waiting request is answered ``sandbox_error`` ("silent"). A STATUS
reply from another broker process (a restart, ``ClusterStatus.broker_id``) answers the requests
the old one had accepted at once (lost with it); those it had not accepted are sent to the new one.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from . import protocol as P

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class ClientConfig:
    deadline_slack_s: float = 60.0  # beyond the cell timeout: queueing, transfer, one retry
    retry_overloaded: bool = True
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 2.0
    resend_after_s: float = 1.0  # no ACCEPTED by then: send the request again (doubling, up to 8 s)
    heartbeat_s: float = 1.0  # requests waiting and the broker quiet this long: ask for its STATUS
    broker_silence_s: float = 5.0  # requests waiting and the broker silent this long: it is down (sandbox_error)

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_s < self.broker_silence_s:
            raise ValueError(f"need 0 < heartbeat_s < broker_silence_s, got {self.heartbeat_s}, "
                             f"{self.broker_silence_s}")
        if not 0 < self.deadline_slack_s <= P.MAX_QUEUE_S:
            raise ValueError(f"deadline_slack_s={self.deadline_slack_s} outside (0, {P.MAX_QUEUE_S:g}]")
        if not 0 < self.backoff_initial_s <= self.backoff_max_s:
            raise ValueError("need 0 < backoff_initial_s <= backoff_max_s")
        if not 0 < self.resend_after_s <= 60:
            raise ValueError(f"resend_after_s={self.resend_after_s} outside (0, 60]")


def _lost(rid: str, message: str) -> P.ExecResult:
    return P.ExecResult(id=rid, status=P.Status.SANDBOX_ERROR, message=message)


class _BrokerWatch:
    """When the broker last said anything, and which broker process it is (from its STATUS replies)."""

    def __init__(self) -> None:
        self.last_heard = time.monotonic()
        self.broker_id = ""
        self.lost: str | None = None  # why the last requests were answered without the broker, until it speaks

    def heard(self) -> None:
        self.last_heard = time.monotonic()
        self.lost = None

    def restarted(self, status_body: bytes) -> bool:
        """Whether this STATUS reply comes from another broker process than the one seen before."""
        try:
            bid = P.decode_status(status_body).broker_id
        except Exception:  # noqa: BLE001 - an undecodable reply says nothing about a restart
            return False
        changed = bool(self.broker_id and bid and bid != self.broker_id)
        self.broker_id = bid or self.broker_id
        return changed


class _AsyncState:
    """The asyncio socket, its reply router and its broker watch, bound to one event loop."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, config: ClientConfig) -> None:
        self.loop = asyncio.get_running_loop()
        self.address, self.config = address, config
        self.socket = ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        self.pending: dict[str, asyncio.Future] = {}
        self.accepted: set[str] = set()  # ids of pending requests the broker has taken
        self.status_waiters: list[asyncio.Future] = []
        self.watch = _BrokerWatch()
        self.receiver = self.loop.create_task(self._receive())
        self.heartbeat = self.loop.create_task(self._heartbeat())

    def _answer(self, message: str, *, accepted_only: bool) -> None:
        for rid, fut in list(self.pending.items()):
            if not fut.done() and (rid in self.accepted or not accepted_only):
                fut.set_result(_lost(rid, message))

    async def _heartbeat(self) -> None:
        beat, silence = self.config.heartbeat_s, self.config.broker_silence_s
        while True:
            await asyncio.sleep(beat / 2)
            now = time.monotonic()
            if not self.pending:  # nothing waits: silence means nothing
                self.watch.last_heard = now
                continue
            quiet = now - self.watch.last_heard
            if quiet >= silence:
                log.error("sandbox broker at %s silent for %.1f s: answering %d waiting request(s) sandbox_error",
                          self.address, quiet, len(self.pending))
                why = f"broker at {self.address} silent for {quiet:.1f} s (no reply to heartbeats): down or unreachable"
                self._answer(why, accepted_only=False)
                self.watch.last_heard, self.watch.lost = now, why  # the next requests get a window of their own
            elif quiet >= beat:
                await self.socket.send_multipart([P.KIND_STATUS])

    async def _receive(self) -> None:
        while True:
            frames = await self.socket.recv_multipart()
            self.watch.heard()
            if len(frames) == 2 and frames[0] == P.KIND_STATUS and self.watch.restarted(frames[1]):
                log.error("sandbox broker at %s restarted: the requests it had accepted are lost", self.address)
                self._answer(f"broker at {self.address} restarted: the request it had accepted is lost",
                             accepted_only=True)  # (it answers: not counted as lost)
            if len(frames) == 2 and frames[0] == P.KIND_RESULT:
                try:
                    result = P.decode_result(frames[1])
                except Exception as exc:  # noqa: BLE001 - a broken reply must not kill the router
                    log.error("undecodable reply from broker: %s", exc)
                    continue
                fut = self.pending.pop(result.id, None)
                if fut is not None and not fut.done():
                    fut.set_result(result)
            elif len(frames) == 2 and frames[0] == P.KIND_ACCEPTED:
                rid = frames[1].decode(errors="replace")
                if rid in self.pending:
                    self.accepted.add(rid)
            elif len(frames) == 2 and frames[0] == P.KIND_STATUS:
                while self.status_waiters:
                    fut = self.status_waiters.pop(0)
                    if not fut.done():
                        fut.set_result(frames[1])
                        break

    def close(self) -> None:
        if not self.loop.is_closed():
            self.receiver.cancel()
            self.heartbeat.cancel()
        for fut in self.pending.values():
            if not fut.done() and not self.loop.is_closed():
                fut.cancel()
        self.socket.close(linger=0)


class SandboxClient:
    """Talks to a broker at ``address`` (``tcp://host:port`` or ``ipc://path``)."""

    def __init__(self, address: str, config: ClientConfig | None = None) -> None:
        if not isinstance(address, str) or not address.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"address {address!r} must start with tcp://, ipc:// or inproc://")
        self.address = address
        self.config = config or ClientConfig()
        self._lock = threading.Lock()
        self._sync: zmq.Socket | None = None
        self._async: _AsyncState | None = None
        self._sync_watch = _BrokerWatch()
        self._closed = False

    # ---- requests

    def _build(self, code, timeout, memory_mb, stdin, files) -> P.ExecRequest:
        if self._closed:
            raise ValueError("client is closed")
        if not isinstance(code, str):
            raise ValueError(f"code must be str, got {type(code).__name__}")
        if files is not None and not isinstance(files, dict):
            raise ValueError(f"files must be a dict of name -> bytes, got {type(files).__name__}")
        files = {k: v.encode() if isinstance(v, str) else v for k, v in (files or {}).items()}
        req = P.ExecRequest(id=uuid.uuid4().hex, code=code, timeout=timeout, memory_mb=memory_mb,
                            stdin=stdin, files=files, max_queue_s=self.config.deadline_slack_s)
        try:
            P.decode_request(P.encode(req))  # the broker's own check, at the caller's edge
        except TypeError as exc:
            raise ValueError(f"bad request: {exc}") from None
        return req

    @staticmethod
    def _payload(req: P.ExecRequest, deadline: float) -> bytes:
        """The request as sent now: it may wait in the queue only as long as the caller still waits."""
        wait = max(0.001, deadline - time.monotonic() - req.timeout)
        return P.encode(msgspec.structs.replace(req, max_queue_s=wait))

    def _deadline_result(self, rid: str, waited: float) -> P.ExecResult:
        return P.ExecResult(id=rid, status=P.Status.SANDBOX_ERROR,
                            message=f"no reply from {self.address} within {waited:.1f} s (client deadline)")

    def run(self, code: str, *, timeout: float = 10.0, memory_mb: int = 1024,
            stdin: str | None = None, files: dict[str, bytes] | None = None) -> P.ExecResult:
        req = self._build(code, timeout, memory_mb, stdin, files)
        rid = req.id
        start = time.monotonic()
        deadline = start + timeout + self.config.deadline_slack_s
        backoff = self.config.backoff_initial_s
        with self._lock:
            sock = self._sync_socket()
            while True:
                result = self._send_and_wait_sync(sock, req, deadline)
                if result is None:
                    return self._deadline_result(rid, time.monotonic() - start)
                if (result.status is not P.Status.OVERLOADED or not self.config.retry_overloaded
                        or time.monotonic() + backoff >= deadline):
                    return result
                time.sleep(backoff)
                backoff = min(backoff * 2, self.config.backoff_max_s)

    def _sync_socket(self) -> zmq.Socket:
        if self._sync is None:
            self._sync = zmq.Context.instance().socket(zmq.DEALER)
            self._sync.setsockopt(zmq.LINGER, 0)
            self._sync.connect(self.address)
        return self._sync

    def _send_and_wait_sync(self, sock: zmq.Socket, req: P.ExecRequest, deadline: float) -> P.ExecResult | None:
        """Send ``req`` (again, until ACCEPTED) and wait for its result; None past the deadline."""
        accepted = False
        resend_after = self.config.resend_after_s
        beat, silence = self.config.heartbeat_s, self.config.broker_silence_s
        watch = self._sync_watch
        next_send = next_beat = time.monotonic()
        watch.last_heard = next_send
        if not watch.broker_id:  # which broker takes it (replies come in order): to see a restart
            sock.send_multipart([P.KIND_STATUS])
            next_beat = next_send + beat
        while True:
            now = time.monotonic()
            quiet = now - watch.last_heard
            if quiet >= silence:
                watch.lost = f"broker at {self.address} silent for {quiet:.1f} s (no reply to heartbeats): down or unreachable"
                return _lost(req.id, watch.lost)
            if quiet >= beat and now >= next_beat:
                sock.send_multipart([P.KIND_STATUS])
                next_beat = now + beat
            if not accepted and now >= next_send:
                sock.send_multipart([P.KIND_EXEC, self._payload(req, deadline)])
                next_send, resend_after = now + resend_after, min(2 * resend_after, 8.0)
            until = min(deadline if accepted else min(deadline, next_send), now + beat / 2)
            remaining = until - time.monotonic()
            if remaining <= 0 or not sock.poll(max(1, int(remaining * 1000))):
                if time.monotonic() >= deadline:
                    return None
                continue
            frames = sock.recv_multipart()
            watch.heard()
            if len(frames) == 2 and frames[0] == P.KIND_STATUS and watch.restarted(frames[1]) and accepted:
                return _lost(req.id, f"broker at {self.address} restarted: the request it had accepted is lost")
            if len(frames) == 2 and frames[0] == P.KIND_RESULT:
                result = P.decode_result(frames[1])
                if result.id == req.id:
                    return result
            elif len(frames) == 2 and frames[0] == P.KIND_ACCEPTED and frames[1] == req.id.encode():
                accepted = True
            # anything else is a late reply to an earlier, abandoned call: drop it

    async def arun(self, code: str, *, timeout: float = 10.0, memory_mb: int = 1024,
                   stdin: str | None = None, files: dict[str, bytes] | None = None) -> P.ExecResult:
        req = self._build(code, timeout, memory_mb, stdin, files)
        rid = req.id
        state = self._async_state()
        start = time.monotonic()
        deadline = start + timeout + self.config.deadline_slack_s
        backoff = self.config.backoff_initial_s
        while True:
            fut = state.loop.create_future()
            state.pending[rid] = fut
            try:
                if not state.watch.broker_id:  # which broker takes it (replies come in order): to see a restart
                    await state.socket.send_multipart([P.KIND_STATUS])
                resend_after = self.config.resend_after_s
                while True:  # sent again until the broker has taken it
                    await state.socket.send_multipart([P.KIND_EXEC, self._payload(req, deadline)])
                    wait = deadline - time.monotonic()
                    try:
                        result = await asyncio.wait_for(asyncio.shield(fut), max(0.0, min(wait, resend_after)))
                        break
                    except TimeoutError:
                        if time.monotonic() >= deadline:
                            return self._deadline_result(rid, time.monotonic() - start)
                        if rid in state.accepted:
                            try:
                                result = await asyncio.wait_for(fut, max(0.0, deadline - time.monotonic()))
                            except TimeoutError:
                                return self._deadline_result(rid, time.monotonic() - start)
                            break
                        resend_after = min(2 * resend_after, 8.0)
            finally:  # answered, timed out or cancelled by the caller: nothing waits for this id now
                state.pending.pop(rid, None)
                state.accepted.discard(rid)
            if (result.status is not P.Status.OVERLOADED or not self.config.retry_overloaded
                    or time.monotonic() + backoff >= deadline):
                return result
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.config.backoff_max_s)

    @property
    def broker_lost(self) -> str | None:
        """Why the last requests were answered without the broker (silent past ``broker_silence_s``), until it
        speaks again; None while it answers."""
        watches = [self._sync_watch] + ([self._async.watch] if self._async is not None else [])
        return next((w.lost for w in watches if w.lost), None)

    def _async_state(self) -> _AsyncState:
        loop = asyncio.get_running_loop()
        if self._async is None or self._async.loop is not loop:
            if self._async is not None:
                self._async.close()
            self._async = _AsyncState(zmq.asyncio.Context.instance(), self.address, self.config)
        return self._async

    # ---- status

    def status(self, timeout: float = 5.0) -> P.ClusterStatus:
        """What the broker sees (workers, their protections, queue); raises TimeoutError if it does not answer."""
        with self._lock:
            sock = self._sync_socket()
            sock.send_multipart([P.KIND_STATUS])
            deadline = time.monotonic() + timeout
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not sock.poll(max(1, int(remaining * 1000))):
                    raise TimeoutError(f"broker at {self.address} did not answer STATUS within {timeout} s")
                frames = sock.recv_multipart()
                if len(frames) == 2 and frames[0] == P.KIND_STATUS:
                    self._sync_watch.restarted(frames[1])  # (remembers the broker's id)
                    return P.decode_status(frames[1])

    # ---- lifecycle

    def close(self) -> None:
        self._closed = True
        with self._lock:
            if self._sync is not None:
                self._sync.close(linger=0)
                self._sync = None
        if self._async is not None:
            self._async.close()
            self._async = None

    def __enter__(self) -> SandboxClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
