"""Helpers shared by the sandbox cluster tests."""

from __future__ import annotations

import asyncio

import psutil

from sandbox_cluster import SandboxClient, Status

SECRET_NAME = "SANDBOX_TEST_SECRET"
SECRET_VALUE = "s3cr3t-7f1d0c9a"


def cell_processes(uids: set[int]) -> list[psutil.Process]:
    """Every live process owned by one of these slot uids (other clusters on the host have their own)."""
    out = []
    for proc in psutil.process_iter(["uids", "status"]):
        try:
            if proc.info["uids"].real in uids and proc.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except (psutil.NoSuchProcess, TypeError, AttributeError):
            pass
    return out


def slot_uids(client: SandboxClient) -> set[int]:
    uids = {uid for worker in client.status().workers for uid in worker.uids}
    assert uids, "the broker reports no slot uids"
    return uids


def assert_next_ok(client: SandboxClient) -> None:
    """The slot that just ran a hostile cell serves the very next request normally."""
    async def two():  # concurrently: every idle slot (two here) gets one, so the hostile cell's slot too
        return await asyncio.gather(*(client.arun("import sympy; print(sympy.Integer(6) * 7)", timeout=10)
                                      for _ in range(2)))

    for res in asyncio.run(two()):
        assert res.status is Status.OK, res
        assert res.stdout == "42\n"
    assert cell_processes(slot_uids(client)) == [], "a cell process outlived its request"
