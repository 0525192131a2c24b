"""The tool boundary: a small ``Sandbox`` Protocol and its adapter for the sandbox cluster."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from sandbox_cluster.protocol import ExecResult


@runtime_checkable
class Sandbox(Protocol):
    """Runs one program with limits; returns an ``ExecResult`` (never raises for bad code)."""

    async def execute(self, code: str, *, timeout: float, memory_mb: int) -> ExecResult: ...


class ClusterSandbox:
    """``Sandbox`` over :class:`sandbox_cluster.SandboxClient` (asyncio, many in flight)."""

    def __init__(self, client) -> None:
        self.client = client

    @classmethod
    def connect(cls, address: str) -> ClusterSandbox:
        from sandbox_cluster import SandboxClient

        return cls(SandboxClient(address))

    async def execute(self, code: str, *, timeout: float, memory_mb: int) -> ExecResult:
        return await self.client.arun(code, timeout=timeout, memory_mb=memory_mb)

    def close(self) -> None:
        self.client.close()
