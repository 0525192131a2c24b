"""The tool boundary: a small ``Sandbox`` Protocol and its adapter for the sandbox cluster.

A dead broker is noticed by the client within seconds (``ClientConfig.broker_silence_s``: every
waiting call is answered ``sandbox_error``); :class:`ClusterSandbox` counts such calls, and after
``max_lost_calls`` in a row it says so once (ERROR) and sets :attr:`ClusterSandbox.unavailable` --
the one line a trainer stops with -- until a call is answered by a broker again.
"""

from __future__ import annotations

import logging
from typing import Protocol, runtime_checkable

from sandbox_cluster.protocol import ExecResult, Status

log = logging.getLogger(__name__)

MAX_LOST_CALLS = 8  # calls in a row answered without the broker before the sandbox counts as unavailable


@runtime_checkable
class Sandbox(Protocol):
    """Runs one program with limits; returns an ``ExecResult`` (never raises for bad code)."""

    async def execute(self, code: str, *, timeout: float, memory_mb: int) -> ExecResult: ...


class ClusterSandbox:
    """``Sandbox`` over :class:`sandbox_cluster.SandboxClient` (asyncio, many in flight)."""

    def __init__(self, client, *, max_lost_calls: int = MAX_LOST_CALLS) -> None:
        if max_lost_calls < 1:
            raise ValueError(f"max_lost_calls must be >= 1, got {max_lost_calls}")
        self.client = client
        self.max_lost_calls = max_lost_calls
        self.lost_calls = 0  # in a row, answered without the broker (it was silent)
        self.unavailable: str | None = None

    @classmethod
    def connect(cls, address: str) -> ClusterSandbox:
        from sandbox_cluster import SandboxClient

        return cls(SandboxClient(address))

    async def execute(self, code: str, *, timeout: float, memory_mb: int) -> ExecResult:
        result = await self.client.arun(code, timeout=timeout, memory_mb=memory_mb)
        lost = getattr(self.client, "broker_lost", None)
        if result.status is Status.SANDBOX_ERROR and lost:
            self.lost_calls += 1
            if self.lost_calls >= self.max_lost_calls and self.unavailable is None:
                self.unavailable = (f"the sandbox is unavailable: {self.lost_calls} calls in a row failed "
                                    f"({lost})")
                log.error("%s", self.unavailable)
        elif result.status is not Status.SANDBOX_ERROR:
            self.lost_calls, self.unavailable = 0, None
        return result

    def close(self) -> None:
        self.client.close()
