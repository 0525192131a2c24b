"""Wire protocol of the sandbox cluster, imported by every end (client, broker, worker).

Messages are msgspec Structs encoded with msgpack. A client sends an
``ExecRequest`` and receives exactly one ``ExecResult`` with the same ``id``.
"""

from __future__ import annotations

import enum
import os
import socket
import struct

import msgspec

PROTOCOL_VERSION = 2

# Hard bounds enforced at the broker edge (a request past them is answered ``error``).
MAX_CODE_BYTES = 1 << 20  # 1 MiB of source
MAX_STDIN_BYTES = 8 << 20
MAX_FILES_BYTES = 16 << 20
MAX_TIMEOUT_S = 300.0
MAX_MEMORY_MB = 16 << 10
MAX_QUEUE_S = 86_400.0


class Status(str, enum.Enum):
    """Outcome of one execution."""

    OK = "ok"  # exited with code 0
    ERROR = "error"  # non-zero exit / uncaught exception / malformed request
    TIMEOUT = "timeout"  # wall-clock or CPU limit exceeded
    MEMORY = "memory"  # address-space / cgroup memory limit hit
    OUTPUT_LIMIT = "output_limit"  # killed past the hard output cap
    SANDBOX_ERROR = "sandbox_error"  # the infrastructure failed (worker died twice, ...)
    OVERLOADED = "overloaded"  # broker queue full; safe to retry later


class ExecRequest(msgspec.Struct, kw_only=True, frozen=True):
    id: str
    code: str
    timeout: float = 10.0  # wall-clock seconds
    memory_mb: int = 1024  # address-space / cgroup limit
    stdin: str | None = None
    files: dict[str, bytes] = msgspec.field(default_factory=dict)  # name -> content, in cwd
    # Longest wait in the broker's queue before the request is answered ``overloaded`` without
    # running (the client would have given up by then); None: wait as long as it takes.
    max_queue_s: float | None = None


class ExecResult(msgspec.Struct, kw_only=True, frozen=True):
    id: str
    status: Status
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    wall_time: float = 0.0
    cpu_time: float = 0.0
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    message: str = ""  # human-readable note from the sandbox (why it failed, ...)

    @property
    def ok(self) -> bool:
        return self.status is Status.OK


_request_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(ExecRequest)
_result_decoder = msgspec.msgpack.Decoder(ExecResult)


def encode(msg: ExecRequest | ExecResult) -> bytes:
    return _request_encoder.encode(msg)


def decode_request(data: bytes) -> ExecRequest:
    """Decode and validate a request; raises ``ValueError`` with a one-line reason."""
    try:
        req = _request_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise ValueError(f"malformed request: {exc}") from None
    if len(req.code.encode()) > MAX_CODE_BYTES:
        raise ValueError(f"code is {len(req.code.encode())} bytes, limit {MAX_CODE_BYTES}")
    if not (0 < req.timeout <= MAX_TIMEOUT_S):
        raise ValueError(f"timeout {req.timeout} outside (0, {MAX_TIMEOUT_S}]")
    if req.max_queue_s is not None and not (0 < req.max_queue_s <= MAX_QUEUE_S):
        raise ValueError(f"max_queue_s {req.max_queue_s} outside (0, {MAX_QUEUE_S}]")
    if not (16 <= req.memory_mb <= MAX_MEMORY_MB):
        raise ValueError(f"memory_mb {req.memory_mb} outside [16, {MAX_MEMORY_MB}]")
    if req.stdin is not None and len(req.stdin.encode()) > MAX_STDIN_BYTES:
        raise ValueError(f"stdin larger than {MAX_STDIN_BYTES} bytes")
    if sum(len(v) for v in req.files.values()) > MAX_FILES_BYTES:
        raise ValueError(f"files larger than {MAX_FILES_BYTES} bytes in total")
    for name in req.files:
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"file name {name!r} must be a plain name in the working dir")
    return req


def decode_result(data: bytes) -> ExecResult:
    return _result_decoder.decode(data)


# ---------------------------------------------------------------------------
# Framing and control messages (added by the sandbox cluster; the records above
# are the public contract and keep their names and fields).
#
# Every ZeroMQ message is multipart: ``[kind, payload?]``.
#   client -> broker : EXEC <ExecRequest> | STATUS
#   broker -> client : ACCEPTED <request id> | RESULT <ExecResult> | STATUS <ClusterStatus>
#
# ZeroMQ drops a message handed to a connection that is dying (a broker restarting): a
# client resends a request until the broker says ACCEPTED (or answers it); a copy that
# reaches a broker still holding that client's request id is only acknowledged again.
#   worker -> broker : READY <WorkerHello> | HEARTBEAT | RESULT <ExecResult>
#                      | FAILED <SlotFailure> | BYE
#   broker -> worker : EXEC <ExecRequest> | HEARTBEAT | RESET
# ---------------------------------------------------------------------------

KIND_EXEC = b"EXEC"
KIND_RESULT = b"RESULT"
KIND_STATUS = b"STATUS"
KIND_READY = b"READY"
KIND_HEARTBEAT = b"HEARTBEAT"
KIND_FAILED = b"FAILED"
KIND_BYE = b"BYE"
KIND_RESET = b"RESET"
KIND_ACCEPTED = b"ACCEPTED"


class Protection(msgspec.Struct, kw_only=True, frozen=True):
    """One isolation layer and whether this host gives it."""

    name: str
    active: bool
    detail: str = ""


class WorkerHello(msgspec.Struct, kw_only=True, frozen=True):
    """A worker announces itself (again after RESET) with its currently idle slots."""

    name: str
    slots: int
    free: int
    protections: list[Protection] = msgspec.field(default_factory=list)
    uids: list[int] = msgspec.field(default_factory=list)  # the per-slot users its cells run as
    instance: str = ""  # one per worker process: a reconnect replaces that process's old registration
    running: list[str] = msgspec.field(default_factory=list)  # request ids its slots are running now
    exposed: list[str] = msgspec.field(default_factory=list)  # host paths its cells' root shows (read-only)
    protocol_version: int = PROTOCOL_VERSION
    zygote_restarts: list[int] = msgspec.field(default_factory=list)  # per slot: times its zygote was replaced
    pid: int = 0  # the worker process on its host (0: not told)


class SlotFailure(msgspec.Struct, kw_only=True, frozen=True):
    """A worker could not finish a request (its zygote died); the broker decides on a retry."""

    id: str
    reason: str


class WorkerInfo(msgspec.Struct, kw_only=True, frozen=True):
    name: str
    slots: int
    free: int
    in_flight: int
    protections: list[Protection] = msgspec.field(default_factory=list)
    uids: list[int] = msgspec.field(default_factory=list)
    exposed: list[str] = msgspec.field(default_factory=list)
    zygote_restarts: list[int] = msgspec.field(default_factory=list)  # per slot, as its worker last said
    pid: int = 0  # the worker process on its host, as it said (0: not told)


class ClusterStatus(msgspec.Struct, kw_only=True, frozen=True):
    """Reply to STATUS: what the broker sees right now."""

    workers: list[WorkerInfo]
    queued: int
    in_flight: int
    max_queue: int
    served: int
    retried: int
    rejected: int
    protocol_version: int = PROTOCOL_VERSION
    broker_id: str = ""  # this broker process's own id: another one after a restart (its accepted requests are lost)

    @property
    def missing_protections(self) -> dict[str, list[str]]:
        """worker name -> protections that host could not give."""
        return {
            w.name: [p.name for p in w.protections if not p.active]
            for w in self.workers
            if any(not p.active for p in w.protections)
        }


_encoder = msgspec.msgpack.Encoder()
_hello_decoder = msgspec.msgpack.Decoder(WorkerHello)
_failure_decoder = msgspec.msgpack.Decoder(SlotFailure)
_status_decoder = msgspec.msgpack.Decoder(ClusterStatus)
_any_decoder = msgspec.msgpack.Decoder()


def encode_msg(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_hello(data: bytes) -> WorkerHello:
    return _hello_decoder.decode(data)


def decode_failure(data: bytes) -> SlotFailure:
    return _failure_decoder.decode(data)


def decode_status(data: bytes) -> ClusterStatus:
    return _status_decoder.decode(data)


def salvage_id(data: bytes) -> str:
    """Best effort: the ``id`` of a request that failed validation, so its error reply can be matched."""
    try:
        obj = _any_decoder.decode(data)
    except msgspec.DecodeError:
        return ""
    if isinstance(obj, dict) and isinstance(obj.get("id"), str):
        return obj["id"][:256]
    return ""


# ---------------------------------------------------------------------------
# Worker <-> zygote, over a socketpair. The zygote never sees what a request carries (code,
# stdin, files) nor keeps what its cell printed: whatever a zygote held, the cells it forks
# later would inherit. Its first frame is a ``ZygoteHello``; then, per request:
#   worker -> zygote : ``CELL_JOB`` (timeout, memory_mb), one fixed-size message carrying a
#                      memfd that holds the encoded ``ExecRequest`` (SCM_RIGHTS); the zygote
#                      passes the fd on to its cell unread;
#   zygote -> worker : one length-prefixed frame: the length of a ``CellOutcome``, the
#                      outcome, then the raw head and tail of the cell's stdout and stderr,
#                      read into buffers no later cell inherits and unmapped once sent.
# The worker names the status (``zygote.supervise.classify``) and builds the ``ExecResult``.
# ---------------------------------------------------------------------------

_LEN = struct.Struct("!I")
CELL_JOB = struct.Struct("!dI")  # timeout (s), memory_mb


class ZygoteHello(msgspec.Struct, kw_only=True, frozen=True):
    """A zygote is warm: the layers it could set up and what its cells see of the host."""

    protections: list[Protection]
    exposed: list[str] = msgspec.field(default_factory=list)


class CellOutcome(msgspec.Struct, kw_only=True, frozen=True):
    """How one cell ended, as its zygote saw it: numbers only, nothing the cell wrote."""

    verdict: str = ""  # a Status value when the zygote ended the cell (timeout, output_limit)
    exit_code: int = 0  # as os.waitstatus_to_exitcode gives it (negative: that signal)
    wall_time: float = 0.0
    cpu_time: float = 0.0
    cpu_limit: int = 0
    oom: bool = False  # the slot's memory cgroup killed a process during the request
    timeout: float = 0.0
    memory_mb: int = 0
    error: str = ""  # the zygote could not run the request (answered sandbox_error)
    # per stream: total bytes written, bytes of head and of tail that follow the outcome
    stdout: tuple[int, int, int] = (0, 0, 0)
    stderr: tuple[int, int, int] = (0, 0, 0)


_outcome_decoder = msgspec.msgpack.Decoder(CellOutcome)


def decode_zygote_hello(data: bytes) -> ZygoteHello:
    return msgspec.msgpack.decode(data, type=ZygoteHello)


def send_job(sock: socket.socket, timeout: float, memory_mb: int, request_fd: int) -> None:
    socket.send_fds(sock, [CELL_JOB.pack(timeout, memory_mb)], [request_fd])


def recv_job(sock: socket.socket) -> tuple[float, int, int] | None:
    """(timeout, memory_mb, request fd) of the next request; None on a clean EOF."""
    data, fds, _, _ = socket.recv_fds(sock, CELL_JOB.size, 1)
    if not data and not fds:
        return None
    while len(data) < CELL_JOB.size:  # (a stream socket may split even a small message)
        more = sock.recv(CELL_JOB.size - len(data))
        if not more:
            raise ConnectionError("peer closed mid-message")
        data += more
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise ConnectionError(f"a request came with {len(fds)} fds, not 1")
    timeout, memory_mb = CELL_JOB.unpack(data)
    return timeout, memory_mb, fds[0]


def send_outcome(sock: socket.socket, outcome: CellOutcome, output: list[memoryview]) -> None:
    """One frame: the outcome and the output buffers, gathered straight from where they lie."""
    meta = _encoder.encode(outcome)
    parts = [_LEN.pack(len(meta)), meta, *output]
    total = sum(len(p) for p in parts)
    parts.insert(0, _LEN.pack(total))
    while parts:
        sent = sock.sendmsg(parts)
        while parts and sent >= len(parts[0]):
            sent -= len(parts[0])
            parts.pop(0)
        if sent:
            parts[0] = memoryview(parts[0])[sent:]


def decode_outcome(frame: bytes) -> tuple[CellOutcome, tuple[bytes, bytes], tuple[bytes, bytes]]:
    """(outcome, (stdout head, tail), (stderr head, tail)) of a frame ``send_outcome`` sent."""
    (size,) = _LEN.unpack_from(frame)
    outcome = _outcome_decoder.decode(frame[_LEN.size:_LEN.size + size])
    pos = _LEN.size + size
    streams = []
    for _, head, tail in (outcome.stdout, outcome.stderr):
        streams.append((frame[pos:pos + head], frame[pos + head:pos + head + tail]))
        pos += head + tail
    if pos != len(frame):
        raise ValueError(f"outcome frame of {len(frame)} bytes, {pos} announced")
    return outcome, streams[0], streams[1]


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_LEN.pack(len(payload)) + payload)


def recv_frame(sock: socket.socket) -> bytes | None:
    """One frame, or None on a clean EOF."""
    header = _recv_exact(sock, _LEN.size)
    if header is None:
        return None
    (size,) = _LEN.unpack(header)
    payload = _recv_exact(sock, size)
    if payload is None:
        raise ConnectionError("peer closed mid-frame")
    return payload


def _recv_exact(sock: socket.socket, size: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < size:
        chunk = sock.recv(min(size - len(buf), 1 << 20))
        if not chunk:
            if buf:
                raise ConnectionError("peer closed mid-frame")
            return None
        buf += chunk
    return bytes(buf)
