"""The cell: the body of the process a zygote forks for one request.

Forked ahead of its request (``Zygote.prepare_next``), it starts a new session, gets its
stdio pipes, closes every other fd, sets the request-independent rlimits and waits, still root but having run no foreign code, for its
request on fd 0 (a socket: a header, and the memfd the worker wrote the request into, which
the zygote passes on unread). Then it sets the CPU and address-space limits, drops to the slot's
uid/gid, loads seccomp and runs the code in-process with the warm modules. At its end it
writes (request number, exit code, CPU time) into the page it shares with the zygote, closes
its output and stops itself (SIGSTOP), so the zygote can answer before the exit itself.

The page is within the cell's reach (its code runs in this process: frames, the heap, its own
memory), so the report is a claim, not a proof: the zygote takes it only from a cell the kernel
says has stopped (``waitid(WSTOPPED)``: none of its threads runs any more), kills it before
answering, and takes the CPU time from the kernel's clock of the process when that is more. A
cell that writes a report and runs on is never believed (it is answered at its exit or its
deadline); one that writes it and stops itself has ended there, as ``os._exit`` would have ended
it -- its exit code is its own to choose either way.
"""

from __future__ import annotations

import builtins
import dataclasses
import io
import mmap
import os
import resource
import signal
import socket
import struct
import sys
from typing import NoReturn

from .. import isolation
from ..limits import SandboxLimits
from ..protocol import decode_request

EXIT_MEMORY = 252  # the cell raised MemoryError
EXIT_SETUP = 253  # the sandbox could not set the cell up (reported as sandbox_error)

CELL_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": isolation.WORKDIR,
    "TMPDIR": isolation.WORKDIR,
    "LANG": "C.UTF-8",
    "PYTHONIOENCODING": "utf-8",
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}

HEADER = struct.Struct("!QIQ")  # address-space limit (bytes), CPU limit (s), request number; with the request's memfd
REPORT = struct.Struct("=Qid")  # request number, exit code, CPU seconds: what a cell reports at its end


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class CellSetup:
    """What every cell of one zygote gets; fixed once the zygote's layers are set up."""

    uid: int
    gid: int
    switch_uid: bool  # drop to uid/gid (the zygote is root)
    nice: int | None  # the worker's own priority (the zygote may run ahead of it)
    workdir: str
    limits: SandboxLimits
    in_memory_cgroup: bool  # the running cell volunteers as the OOM victim
    seccomp: isolation.CompiledSeccomp | None
    report_page: mmap.mmap  # shared with the zygote: the cell's end-of-run report
    stdio: tuple[io.TextIOWrapper, io.TextIOWrapper, io.TextIOWrapper]  # built before any fork


def stdio_wrappers() -> tuple[io.TextIOWrapper, io.TextIOWrapper, io.TextIOWrapper]:
    """Text streams on fds 0/1/2, built once in the zygote: a cell only dup2()s its pipes under them."""
    return (
        io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8", errors="replace"),
        io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="backslashreplace"),
        io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                         line_buffering=True),
    )


def cell_main(cell: CellSetup, ctrl_r: int, out_w: int, err_w: int) -> NoReturn:
    """Runs in the forked cell; never returns. Everything up to reading the request is done
    ahead of time; the request's code runs only after the privilege drop."""
    try:
        signal.set_wakeup_fd(-1)  # the zygote's SIGCHLD wake-ups (supervise.child_wakeups) are not the cell's
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        if cell.nice is not None:
            os.setpriority(os.PRIO_PROCESS, 0, cell.nice)
        os.dup2(ctrl_r, 0)  # the request comes in on fd 0; the cell's stdin replaces it below
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        lim = cell.limits
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_FSIZE, (lim.max_file_mb << 20, lim.max_file_mb << 20))
        resource.setrlimit(resource.RLIMIT_NPROC, (lim.max_processes, lim.max_processes))
        resource.setrlimit(resource.RLIMIT_NOFILE, (lim.max_open_files, lim.max_open_files))
        isolation.prctl(isolation.PR_SET_PDEATHSIG, signal.SIGKILL)
        sys.stdin, sys.stdout, sys.stderr = cell.stdio
        sys.argv = ["<cell>"]
        handed = _receive(0)  # ------------------------------------ waits here for its request
        if handed is None:
            os._exit(0)  # the zygote shut down before a request came
        (as_limit, cpu_limit, seq), request = handed
        req = decode_request(request)
        del handed, request
        os.chdir(cell.workdir)  # (only now: the zygote may have replaced the scratch tmpfs meanwhile)
        stdin_fd = os.memfd_create("stdin") if req.stdin else os.open(os.devnull, os.O_RDONLY)
        if req.stdin:
            os.write(stdin_fd, req.stdin.encode())
            os.lseek(stdin_fd, 0, os.SEEK_SET)
        os.dup2(stdin_fd, 0)
        os.close(stdin_fd)
        if cell.in_memory_cgroup:  # in the zygote's memory cgroup the running cell is the OOM
            fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)  # victim (not the next one, waiting)
            os.write(fd, b"1000")
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_limit, cpu_limit + 1))
        resource.setrlimit(resource.RLIMIT_AS, (as_limit, as_limit))
        if cell.switch_uid:
            os.setgroups([])
            os.setresgid(cell.gid, cell.gid, cell.gid)
            os.setresuid(cell.uid, cell.uid, cell.uid)
        isolation.prctl(isolation.PR_SET_PDEATHSIG, signal.SIGKILL)  # a uid change cleared it
        if os.environ.keys() != CELL_ENV.keys():  # the zygote's is already exactly CELL_ENV
            os.environ.clear()
            os.environ.update(CELL_ENV)
    except BaseException as exc:  # noqa: BLE001
        os.write(2, f"sandbox setup failed: {type(exc).__name__}: {exc}\n".encode())
        os._exit(EXIT_SETUP)
    for name, content in req.files.items():
        try:
            with open(name, "wb") as f:
                f.write(content)
        except OSError as exc:
            os.write(2, f"could not write input file {name!r}: {exc}\n".encode())
            os._exit(1)
    if cell.seccomp is not None:
        try:
            cell.seccomp.load()
        except BaseException as exc:  # noqa: BLE001
            os.write(2, f"sandbox setup failed: seccomp: {exc}\n".encode())
            os._exit(EXIT_SETUP)
    code = run_cell(req.code)
    try:  # report the end, close the output, stop: the zygote answers on the three (see the module docstring)
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
        cell.report_page[:REPORT.size] = REPORT.pack(seq, code, cpu)
        os.close(1)
        os.close(2)
        os.kill(os.getpid(), signal.SIGSTOP)  # the zygote kills it once it has seen the stop
    except BaseException:  # noqa: BLE001 - the cell's code broke something: the exit still tells
        pass
    os._exit(code)


def _receive(fd: int) -> tuple[tuple[int, int, int], bytes] | None:
    """The header the zygote sent on ``fd`` (a socket) and the request in the memfd that came
    with it (read here, closed); None when the zygote hung up without one."""
    sock = socket.socket(fileno=fd)
    try:
        data, fds, _, _ = socket.recv_fds(sock, HEADER.size, 1)
        while data and len(data) < HEADER.size:
            more = sock.recv(HEADER.size - len(data))
            if not more:
                break
            data += more
    finally:
        sock.detach()
    if len(data) < HEADER.size or len(fds) != 1:
        return None
    request_fd = fds[0]
    size, chunks, offset = os.fstat(request_fd).st_size, [], 0
    while offset < size:
        chunk = os.pread(request_fd, size - offset, offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    os.close(request_fd)
    return HEADER.unpack(data), b"".join(chunks)


def run_cell(code: str) -> int:
    """Run ``code`` as ``__main__`` with the warm modules; the exit code ``python file.py`` would give."""
    import linecache

    linecache.cache["<cell>"] = (len(code), None, code.splitlines(True), "<cell>")
    exit_code = 0
    try:
        exec(compile(code, "<cell>", "exec"), {"__name__": "__main__", "__builtins__": builtins})
    except SystemExit as exc:
        if exc.code is None:
            exit_code = 0
        elif isinstance(exc.code, int):
            exit_code = exc.code & 0xFF
        else:
            print(exc.code, file=sys.stderr)
            exit_code = 1
    except MemoryError as exc:
        try:
            _print_cell_traceback(exc)
        except MemoryError:
            os.write(2, b"MemoryError\n")
        exit_code = EXIT_MEMORY
    except BaseException as exc:  # noqa: BLE001 - the cell's own error, reported in stderr
        _print_cell_traceback(exc)
        exit_code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - closed / broken by the cell
            pass
    return exit_code


def _print_cell_traceback(exc: BaseException) -> None:
    """The traceback as a plain ``python file.py`` would print it: without the sandbox's own frame."""
    import traceback

    tb = exc.__traceback__
    if tb is not None and tb.tb_frame.f_code is run_cell.__code__:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb, file=sys.stderr)
