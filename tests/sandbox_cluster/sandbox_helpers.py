"""Helpers shared by the sandbox cluster tests."""

from __future__ import annotations

import asyncio
import time

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


# Run as the next request: the processes of the slot uid this cell can see (its pid namespace
# is its slot's), other than itself. Anything left by the previous request would be listed.
_PROBE = ("import os, sympy\nme = os.getpid()\n"
          "left = [p for p in os.listdir('/proc') if p.isdigit() and int(p) not in (1, me)\n"
          "        and os.stat(f'/proc/{p}').st_uid == os.getuid()]\n"
          "print(sympy.Integer(6) * 7, left)")


def assert_no_cell_processes(client: SandboxClient, within_s: float = 10.0) -> None:
    """No process of a slot uid is left on the host: a cell answered on its own end-of-run report
    is reaped, and its tree killed, right after the answer (not before it). ``within_s`` leaves a loaded
    machine time for the kill, and stays below what the hostile cells would live (sleeps of 30 s and more)."""
    end = time.monotonic() + within_s
    while (left := cell_processes(slot_uids(client))) and time.monotonic() < end:
        time.sleep(0.01)
    assert left == [], f"a cell process outlived its request: {left}"


def assert_next_ok(client: SandboxClient) -> None:
    """The slot that just ran a hostile cell serves the very next request normally, and nothing
    the hostile cell started is alive when it does."""
    async def two():  # concurrently: every idle slot (two here) gets one, so the hostile cell's slot too
        return await asyncio.gather(*(client.arun(_PROBE, timeout=10) for _ in range(2)))

    for res in asyncio.run(two()):
        assert res.status is Status.OK, res
        assert res.stdout == "42 []\n", res
    assert_no_cell_processes(client)
