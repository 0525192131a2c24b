"""Helpers shared by the sandbox cluster tests."""

from __future__ import annotations

import asyncio

import psutil

from sandbox_cluster import SandboxClient, Status

SECRET_NAME = "SANDBOX_TEST_SECRET"
SECRET_VALUE = "s3cr3t-7f1d0c9a"
CELL_UIDS = range(61000, 63000)  # UidLease.acquire's default range


def cell_processes() -> list[psutil.Process]:
    """Every live process owned by a sandbox slot uid."""
    out = []
    for proc in psutil.process_iter(["uids", "status"]):
        try:
            if proc.info["uids"].real in CELL_UIDS and proc.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except (psutil.NoSuchProcess, TypeError, AttributeError):
            pass
    return out


def assert_next_ok(client: SandboxClient) -> None:
    """The slot that just ran a hostile cell serves the very next request normally."""
    async def two():  # concurrently: every idle slot (two here) gets one, so the hostile cell's slot too
        return await asyncio.gather(*(client.arun("import sympy; print(sympy.Integer(6) * 7)", timeout=10)
                                      for _ in range(2)))

    for res in asyncio.run(two()):
        assert res.status is Status.OK, res
        assert res.stdout == "42\n"
    assert cell_processes() == [], "a cell process outlived its request"
