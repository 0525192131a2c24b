"""Wire protocol of the sandbox cluster, imported by every end (client, broker, worker).

Messages are msgspec Structs encoded with msgpack. A client sends an
``ExecRequest`` and receives exactly one ``ExecResult`` with the same ``id``.
"""

from __future__ import annotations

import enum
import msgspec

PROTOCOL_VERSION = 1

# Hard bounds enforced at the broker edge (a request past them is answered ``error``).
MAX_CODE_BYTES = 1 << 20  # 1 MiB of source
MAX_STDIN_BYTES = 8 << 20
MAX_FILES_BYTES = 16 << 20
MAX_TIMEOUT_S = 300.0
MAX_MEMORY_MB = 16 << 10


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
