"""The zygote process: ``python -m sandbox_cluster.zygote``, started by a worker.

It becomes pid 1 of its own pid namespace, sets up its layers (``layers``), prepares the
warm interpreter (``warm``), moves into the slot's cgroups, says hello (its protections and
what its cells see), and serves requests from the worker's socketpair one at a time.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import struct
import sys

from .. import hugepages, isolation
from ..limits import SandboxLimits
from ..protocol import CellOutcome, ZygoteHello, encode_msg, recv_job, send_frame
from .slot import CellRun, Zygote
from .warm import prepare_warm_interpreter

log = logging.getLogger(__name__)

RECOLLAPSE_EVERY = 256  # requests between two re-collapses of the warm heap into huge pages


def enter_pid_namespace(keep_fd: int) -> str | Exception:
    """Become pid 1 of a new pid namespace, so cells see (and can signal) only their slot.

    ``unshare(CLONE_NEWPID)`` only moves the caller's future children, so the process the
    worker started stays outside as a shim: it forks the real zygote, forwards SIGTERM, and
    exits with it (and the zygote dies with the shim: PDEATHSIG). When pid 1 of a namespace
    dies, the kernel kills everything left in it.
    """
    try:
        isolation.unshare(isolation.CLONE_NEWPID)
    except OSError as exc:
        return exc
    child = os.fork()
    if child == 0:
        isolation.prctl(isolation.PR_SET_PDEATHSIG, signal.SIGKILL)
        return "cells see only their own slot's processes (/proc remounted)"
    os.close(keep_fd)  # only the zygote holds the worker's socket: its death is the worker's EOF
    signal.signal(signal.SIGTERM, lambda *_: os.kill(child, signal.SIGTERM))
    while True:
        try:
            _, status = os.waitpid(child, 0)
        except InterruptedError:
            continue
        os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def serve(zygote: Zygote, sock: socket.socket) -> int:
    """Answer requests until the worker closes the socket. What a request carries goes from
    the worker to the cell in a memfd passed on unread, and what the cell prints back to the
    worker from buffers unmapped once sent: nothing of it stays in this process, whose memory
    every later cell inherits."""
    zygote.prepare_next()
    while True:
        try:
            job = recv_job(sock)
        except ConnectionError as exc:
            log.error("bad request from the worker: %s", exc)
            return 1
        if job is None:
            return 0
        timeout, memory_mb, request_fd = job
        try:
            run = zygote.execute(timeout, memory_mb, request_fd)
        except Exception as exc:  # noqa: BLE001 - e.g. fork() refused: answer, clean up, keep serving
            log.exception("a request failed inside the zygote")
            zygote.recover()
            run = CellRun(CellOutcome(error=f"zygote: {exc}", timeout=timeout, memory_mb=memory_mb))
        try:
            run.send(sock)
        finally:
            run.close()
        zygote.finish()
        if zygote.served % RECOLLAPSE_EVERY == 0:  # the zygote's writes since have split some
            zygote.recollapse()  # huge pages; a few ms to merge them back
        zygote.prepare_next()  # after the reply: forking the next cell is off the request's path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sandbox_cluster.zygote")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--uid", type=int, required=True)
    parser.add_argument("--limits", required=True)
    parser.add_argument("--cell-nice", type=int)
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s zygote[uid {args.uid}] %(levelname)s %(message)s")
    isolation.prctl(isolation.PR_SET_PDEATHSIG, signal.SIGKILL)
    # Started by the process that made our socketpair (its peer), or that one died before the
    # PDEATHSIG above was set. (Not a pid on the command line: every cell inherits it.)
    probe = socket.socket(fileno=args.fd)
    try:
        peer_pid = struct.unpack("3i", probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
    finally:
        probe.detach()  # (not closed)
    if os.getppid() != peer_pid:
        return 1
    del peer_pid
    os.environ.pop("PYTHONPATH", None)  # only needed to start; cells get exactly CELL_ENV
    pid_namespace = enter_pid_namespace(args.fd)  # from here on: pid 1 of a new pid namespace
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    sock = socket.socket(fileno=args.fd)
    zygote = Zygote(uid=args.uid, limits=SandboxLimits.from_json(args.limits), cell_nice=args.cell_nice)
    try:
        zygote.setup(pid_namespace)
        huge = prepare_warm_interpreter()  # before entering the cgroups: the warm heap is charged outside the slot
        log.info("warm heap: %d MiB in huge pages (%d collapsed)", hugepages.anon_huge_bytes() >> 20, huge)
        zygote.layers.enter_cgroups()
        send_frame(sock, encode_msg(ZygoteHello(protections=zygote.protections, exposed=zygote.exposed)))
        return serve(zygote, sock)
    except (ConnectionError, BrokenPipeError):
        return 0
    finally:
        zygote.close()
