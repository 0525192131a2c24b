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
