"""How a cell ended -> its Status, exit code and message (the zygote's pure mapping)."""

from __future__ import annotations

import signal

import pytest

from sandbox_cluster import Status
from sandbox_cluster.zygote.cell import EXIT_MEMORY, EXIT_SETUP
from sandbox_cluster.zygote.supervise import Capture, classify


def _classify(**kw):
    args = dict(verdict=None, exit_code=0, cpu_time=0.1, cpu_limit=11, oom=False, stderr="", timeout=10.0,
                memory_mb=512, output_cap=8 << 20)
    args.update(kw)
    return classify(**args)


@pytest.mark.parametrize(("kw", "expected"), [
    ({}, (Status.OK, 0, "")),
    ({"exit_code": 3}, (Status.ERROR, 3, "")),
    ({"exit_code": -signal.SIGSEGV}, (Status.ERROR, -11, "killed by signal SIGSEGV")),
    # the zygote's own verdicts win over whatever the killed cell's exit status says
    ({"verdict": Status.TIMEOUT, "exit_code": -9, "timeout": 2.5}, (Status.TIMEOUT, -9, "wall-clock timeout after 2.5 s")),
    ({"verdict": Status.OUTPUT_LIMIT, "exit_code": -9, "output_cap": 1000},
     (Status.OUTPUT_LIMIT, -9, "output passed 1000 bytes; killed")),
    # MemoryError inside the cell: reported as exit code 1, like an uncaught exception
    ({"exit_code": EXIT_MEMORY}, (Status.MEMORY, 1, "memory limit 512 MiB exceeded")),
    ({"exit_code": -9, "oom": True}, (Status.MEMORY, -9, "memory limit 512 MiB exceeded")),
    ({"exit_code": 0, "oom": True}, (Status.OK, 0, "")),  # a child was OOM-killed; the cell coped
    # RLIMIT_CPU: SIGXCPU at the soft limit, SIGKILL at the hard one; a kill well below it is not a timeout
    ({"exit_code": -signal.SIGXCPU, "cpu_time": 11.0}, (Status.TIMEOUT, -24, "CPU time limit 11 s exceeded")),
    ({"exit_code": -9, "cpu_time": 10.95}, (Status.TIMEOUT, -9, "CPU time limit 11 s exceeded")),
    ({"exit_code": -9, "cpu_time": 2.0}, (Status.ERROR, -9, "killed by signal SIGKILL")),
    ({"exit_code": EXIT_SETUP, "stderr": "x\nsandbox setup failed: seccomp: EINVAL\n"},
     (Status.SANDBOX_ERROR, EXIT_SETUP, "sandbox setup failed: seccomp: EINVAL")),
    ({"exit_code": EXIT_SETUP}, (Status.SANDBOX_ERROR, EXIT_SETUP, "setup failed")),
])
def test_how_a_cell_ended_names_its_status(kw, expected):
    assert _classify(**kw) == expected


def test_capture_keeps_head_and_tail():
    cap = Capture(head_max=4, tail_max=3)
    for chunk in (b"abc", b"defgh", b"ijklmnop"):
        cap.add(chunk)
    assert cap.render() == ("abcd\n[... 9 bytes truncated ...]\nnop", True)
    small = Capture(head_max=4, tail_max=3)
    small.add(b"abcdef")
    assert small.render() == ("abcdef", False)


def test_capture_matches_a_plain_head_and_tail_for_any_chunking():
    import random

    rng = random.Random(0)
    for _ in range(200):
        head_max, tail_max = rng.choice([0, 1, 4, 70_000]), rng.choice([0, 1, 3, 9000])
        cap, written = Capture(head_max, tail_max), b""
        for _ in range(rng.randint(0, 6)):
            chunk = rng.randbytes(rng.choice([0, 1, 2, 10, 200_000]))
            cap.add(chunk)
            written += chunk
        rest = written[head_max:]
        expected_tail = rest[len(rest) - min(len(rest), tail_max):]
        head, tail = cap.parts()
        assert (bytes(head), b"".join(bytes(t) for t in tail), cap.total) == (
            written[:head_max], expected_tail, len(written))
        head.release()
        for t in tail:
            t.release()
        cap.close()


def test_a_capture_is_not_inherited_by_a_fork():
    """The zygote forks the next cell while the current one's output is being captured: the
    child must not get the buffer (MADV_DONTFORK), so touching its address kills it."""
    import ctypes
    import os

    cap = Capture(64, 16)
    cap.add(b"the current cell's output")
    head, _ = cap.parts()
    address = ctypes.addressof(ctypes.c_char.from_buffer(head))
    assert ctypes.string_at(address, 5) == b"the c"
    pid = os.fork()
    if pid == 0:
        import faulthandler

        faulthandler.disable()  # (the crash is the point)
        ctypes.string_at(address, 5)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == -signal.SIGSEGV
    head.release()
    cap.close()
