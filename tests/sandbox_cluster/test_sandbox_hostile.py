"""One hostile property per test: the specific status, and the very next request is answered ``ok``."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import psutil
import pytest
from sandbox_helpers import (SECRET_NAME, SECRET_VALUE, assert_next_ok, assert_no_cell_processes, cell_processes,
                             slot_uids)

from sandbox_cluster import Status


def test_fork_bomb_is_contained_and_cleaned_up(client):
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    res = client.run(code, timeout=3)
    assert res.status is Status.TIMEOUT, res
    assert 3 <= res.wall_time < 5  # killed at its deadline (plus scheduling delay on a loaded box)
    assert_next_ok(client)


def test_fork_limit_is_enforced(client):
    code = (
        "import os, time\nkids = 0\n"
        "try:\n    for _ in range(500):\n        if os.fork() == 0:\n"
        "            time.sleep(30)\n            os._exit(0)\n"
        "        kids += 1\nexcept OSError as exc:\n    print('refused after', kids, type(exc).__name__)\n"
    )
    res = client.run(code, timeout=10)
    assert res.status is Status.OK, res
    refused_after = int(res.stdout.split()[2])
    assert refused_after < 64  # SandboxLimits.max_processes
    assert res.wall_time < 5  # the sleeping children did not keep the request open
    assert_next_ok(client)


def test_busy_loop_times_out(client):
    res = client.run("while True:\n    pass\n", timeout=1.5)
    assert res.status is Status.TIMEOUT
    assert 1.5 <= res.wall_time < 3
    assert res.cpu_time > 0.05  # it was burning CPU (how much depends on the machine's load)
    assert_next_ok(client)


def test_sleep_past_timeout(client):
    res = client.run("import time\nprint('before', flush=True)\ntime.sleep(60)\nprint('after')", timeout=1)
    assert res.status is Status.TIMEOUT
    assert res.stdout == "before\n"  # output produced before the kill is kept
    assert res.cpu_time < 0.5
    assert_next_ok(client)


def test_huge_allocation_is_a_memory_error(client):
    res = client.run("x = bytearray(4 << 30)\nprint('allocated')", timeout=10, memory_mb=256)
    assert res.status is Status.MEMORY, res
    assert "MemoryError" in res.stderr
    assert "allocated" not in res.stdout
    assert_next_ok(client)


def test_gradual_memory_growth_hits_the_limit(client):
    code = "import numpy as np\nchunks = []\nwhile True:\n    chunks.append(np.ones(1 << 20))  # 8 MiB, touched\n"
    res = client.run(code, timeout=20, memory_mb=200)
    assert res.status is Status.MEMORY, res
    assert_next_ok(client)


def test_huge_output_is_killed_and_truncated(client):
    res = client.run("while True:\n    print('spam' * 256)\n", timeout=20)
    assert res.status is Status.OUTPUT_LIMIT, res
    assert res.stdout_truncated
    assert res.stdout.startswith("spam" * 256 + "\n")
    assert "bytes truncated" in res.stdout
    assert len(res.stdout) < 64 << 10
    assert_next_ok(client)


def test_large_output_under_the_cap_keeps_head_and_tail(client):
    code = "for i in range(100_000):\n    print(f'line {i}')\n"
    res = client.run(code, timeout=20)
    assert res.status is Status.OK
    assert res.stdout_truncated and not res.stderr_truncated
    assert res.stdout.startswith("line 0\nline 1\n")
    assert res.stdout.endswith("line 99998\nline 99999\n")
    assert "bytes truncated" in res.stdout
    assert_next_ok(client)


def test_disk_fill_hits_the_tmpfs_and_is_wiped(client):
    code = (
        "import os\nprint(os.getcwd())\n"
        "with open('fill', 'wb') as f:\n    while True:\n        f.write(b'x' * (1 << 20))\n        f.flush()\n"
    )
    listing = "import os\nprint(sorted(os.listdir('.')), sorted(os.listdir('/dev/shm')))"
    # A fresh cell's /tmp holds only the path to an exposed tree that lives under /tmp (a venv
    # of a clone under /tmp), else nothing; after the fill it must hold the same.
    before = client.run(listing)
    assert before.status is Status.OK and before.stdout.endswith(" []\n"), before
    res = client.run(code, timeout=20)
    assert res.status is Status.ERROR, res
    assert res.stdout == "/tmp\n"
    assert "No space left on device" in res.stderr or "File too large" in res.stderr
    assert_next_ok(client)
    after = client.run(listing)
    assert after.stdout == before.stdout


def test_files_left_behind_are_gone_next_time(client):
    res = client.run("open('/tmp/leftover', 'w').write('x')\nopen('/dev/shm/leftover', 'w').write('x')")
    assert res.status is Status.OK
    checks = [client.run("import os\nprint(os.path.exists('/tmp/leftover'), os.path.exists('/dev/shm/leftover'))")
              for _ in range(4)]
    assert {c.stdout for c in checks} == {"False False\n"}


def test_cannot_kill_parent_broker_or_workers(client, cluster):
    targets = {"zygote": "os.getppid()", "broker": str(cluster.broker_pid),
               **{f"worker{i}": str(pid) for i, pid in enumerate(cluster.worker_pids)}}
    code = "import os, signal\n" + "".join(
        f"try:\n    os.kill({pid}, signal.SIGKILL)\n    print('{name}: killed')\n"
        f"except PermissionError:\n    print('{name}: denied')\n"
        f"except ProcessLookupError:\n    print('{name}: invisible')\n"
        for name, pid in targets.items()
    ) + "try:\n    os.kill(-1, signal.SIGKILL)\nexcept ProcessLookupError:\n    pass\nprint('kill -1 done')\n"
    res = client.run(code, timeout=10)
    assert res.status is Status.OK, res
    # The zygote is the cell's parent but another user; the rest live outside its pid namespace.
    assert res.stdout.splitlines() == (["zygote: denied"] + [f"{name}: invisible" for name in list(targets)[1:]]
                                       + ["kill -1 done"])
    time.sleep(0.2)
    assert psutil.pid_exists(cluster.broker_pid)
    assert all(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in cluster.worker_pids)
    assert len(cluster.worker_pids) == 2 and cluster.restarts == 0
    assert_next_ok(client)


def test_cell_sees_only_its_own_slot_processes(client):
    code = ("import os\n"
            "me = os.getpid()\n"
            "others = [int(p) for p in os.listdir('/proc') if p.isdigit() and int(p) not in (1, me)]\n"
            "uids = [os.stat(f'/proc/{p}').st_uid for p in others]\n"
            "print(1 in [int(p) for p in os.listdir('/proc') if p.isdigit()], len(others), uids)")
    res = client.run(code)
    assert res.status is Status.OK, res
    # the zygote (pid 1 of the namespace), itself, and at most the slot's next cell, forked
    # ahead and still root-owned (it has not dropped privileges: it has run no code yet)
    assert res.stdout in ("True 0 []\n", "True 1 [0]\n"), res.stdout
    assert_next_ok(client)


def test_worker_secret_is_not_visible(client, cluster):
    code = (
        "import os\n"
        f"print('environ', {SECRET_NAME!r} in os.environ)\n"
        "hits = []\n"
        "for pid in os.listdir('/proc'):\n"
        "    if pid.isdigit():\n"
        "        try:\n"
        "            data = open(f'/proc/{pid}/environ', 'rb').read()\n"
        "        except OSError:\n"
        "            continue\n"
        f"        if {SECRET_VALUE.encode()!r} in data:\n"
        "            hits.append(pid)\n"
        "print('proc', hits)\n"
    )
    res = client.run(code, timeout=20)
    assert res.status is Status.OK, res
    assert res.stdout == "environ False\nproc []\n"
    # The secret really is in the workers' environment: the cell just cannot see it.
    assert psutil.Process(cluster.worker_pids[0]).environ()[SECRET_NAME] == SECRET_VALUE
    assert_next_ok(client)


@pytest.mark.parametrize("family", ["AF_INET", "AF_INET6", "AF_UNIX", "AF_NETLINK", "AF_PACKET"])
def test_no_sockets(client, family):
    code = (
        "import socket\n"
        f"try:\n    socket.socket(socket.{family}, socket.SOCK_DGRAM if '{family}' == 'AF_NETLINK' else "
        "socket.SOCK_STREAM)\n    print('created')\nexcept PermissionError:\n    print('denied')\n"
    )
    res = client.run(code)
    assert res.status is Status.OK, res
    assert res.stdout == "denied\n"
    assert_next_ok(client)


def test_unix_socket_to_the_broker_is_refused(client, cluster):
    path = cluster.address.removeprefix("ipc://")
    assert os.path.exists(path)
    code = (
        "import socket\n"
        "try:\n    s = socket.socket(socket.AF_UNIX)\n"
        f"    s.connect({path!r})\n    print('connected')\nexcept OSError as exc:\n    print(type(exc).__name__)\n"
    )
    res = client.run(code)
    assert res.stdout == "PermissionError\n", res
    assert_next_ok(client)


def test_network_namespace_has_only_a_down_loopback(client):
    res = client.run("print(sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]))")
    assert res.stdout == "['lo']\n", res
    host = sorted(line.split(":")[0].strip() for line in open("/proc/net/dev").readlines()[2:])
    assert host != ["lo"]  # the host itself has more than loopback, so this checks the namespace
    assert_next_ok(client)


def test_setsid_orphan_dies_with_the_request(client):
    code = "import subprocess, time\nsubprocess.Popen(['setsid', 'sleep', '313'])\ntime.sleep(1.0)\nprint('done')\n"
    uids = slot_uids(client)

    def orphans() -> list[psutil.Process]:
        return [p for p in cell_processes(uids) if p.cmdline()[:2] == ["sleep", "313"]]

    async def scenario():
        task = asyncio.ensure_future(client.arun(code, timeout=10))
        seen = False
        while not task.done() and not seen:
            await asyncio.sleep(0.02)
            seen = bool(orphans())
        return seen, await task

    seen_running, res = asyncio.run(scenario())
    assert seen_running  # the orphan really ran (in its own session) during the request ...
    assert (res.status, res.stdout) == (Status.OK, "done\n")
    end = time.monotonic() + 10  # ... and is gone once the request is answered (its tree is killed before the
    while orphans() and time.monotonic() < end:  # answer, or right after it; 10 s for a loaded machine, not 313)
        time.sleep(0.01)
    assert orphans() == []
    assert_next_ok(client)


def test_double_fork_daemon_holding_stdout_is_killed(client):
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        while True:\n            print('daemon', flush=True)\n            time.sleep(0.01)\n"
        "    os._exit(0)\n"
        "time.sleep(0.1)\nprint('main done', flush=True)\n"
    )
    res = client.run(code, timeout=10)
    assert res.status is Status.OK, res
    assert res.wall_time < 2  # the daemon kept stdout open, but the request ended with the cell
    assert "main done" in res.stdout
    assert_next_ok(client)


def test_no_inherited_fds(client):
    code = (
        "import os\nopen_fds = []\n"
        "for fd in range(1024):\n    try:\n        os.fstat(fd)\n        open_fds.append(fd)\n"
        "    except OSError:\n        pass\nprint(open_fds)\n"
    )
    res = client.run(code)
    assert res.stdout == "[0, 1, 2]\n", res
    assert_next_ok(client)


def test_runs_unprivileged(client):
    code = (
        "import os\nprint(os.getuid() != 0, os.getgid() != 0, os.getgroups())\n"
        "try:\n    os.setuid(0)\n    print('became root')\nexcept PermissionError:\n    print('setuid denied')\n"
    )
    res = client.run(code)
    assert res.stdout == "True True []\nsetuid denied\n", res
    assert_next_ok(client)


def test_seccomp_denies_ptrace_unshare_and_mount(client):
    code = (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.ptrace(0, 0, 0, 0), ctypes.get_errno())\n"  # PTRACE_TRACEME
        "print(libc.unshare(0x10000000), ctypes.get_errno())\n"  # CLONE_NEWUSER
        "print(libc.mount(b'none', b'/tmp', b'tmpfs', 0, None), ctypes.get_errno())\n"
    )
    res = client.run(code)
    assert res.status is Status.OK, res
    assert res.stdout == "-1 1\n-1 1\n-1 1\n"  # EPERM each
    assert_next_ok(client)


def test_cells_do_not_outlive_a_crash_of_their_own(client):
    res = client.run("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)")
    assert res.status is Status.ERROR
    assert res.exit_code == -11
    assert "SIGSEGV" in res.message
    assert_no_cell_processes(client)
    assert_next_ok(client)


def test_tmpfs_files_count_against_the_memory_limit(client):
    code = "".join(f"open('{d}/f', 'wb').write(b'x' * (50 << 20))\nprint('{d}', flush=True)\n"
                   for d in ("/tmp", "/var/tmp", "/dev/shm"))
    res = client.run(code, timeout=20, memory_mb=96)
    assert res.status is Status.MEMORY, res
    assert res.exit_code == -9  # the cgroup OOM killer, not a MemoryError
    assert "/dev/shm" not in res.stdout
    assert_next_ok(client)


def test_the_host_filesystem_is_read_only(client):
    # Everything in the cells' root outside the scratch tmpfs is read-only; the host's own
    # writable spots (/run/lock, this checkout) are not in it at all.
    targets = ["/probe", "/etc/probe", "/dev/probe", "/usr/lib/probe", sys.prefix + "/probe",
               "/run/lock/probe", __file__ + ".probe"]
    code = (
        "import errno\n"
        f"for path in {targets!r}:\n"
        "    try:\n        open(path, 'w').write('x')\n        print('written')\n"
        "    except OSError as exc:\n        print(errno.errorcode[exc.errno])\n"
    )
    res = client.run(code)
    assert res.status is Status.OK, res
    assert res.stdout.split() == ["EROFS"] * 5 + ["ENOENT"] * 2
    assert_next_ok(client)


def test_no_sysv_or_posix_ipc_objects(client):
    code = (
        "import ctypes, errno, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "rt = ctypes.CDLL('librt.so.1', use_errno=True)\n"
        "calls = [lambda: libc.shmget(0, 4096, 0o1600), lambda: libc.msgget(0, 0o1600),\n"
        "         lambda: libc.semget(0, 1, 0o1600), lambda: rt.mq_open(b'/q', os.O_CREAT | os.O_RDWR, 0o600, None)]\n"
        "for call in calls:\n    print(call(), errno.errorcode[ctypes.get_errno()])\n"
    )
    res = client.run(code)
    assert res.status is Status.OK, res
    assert res.stdout.splitlines() == ["-1 ENOSPC"] * 4
    assert_next_ok(client)


def test_cells_do_not_inherit_the_zygotes_priority_boost(client, cluster):
    res = client.run("import os\nprint(os.getpriority(os.PRIO_PROCESS, 0))")
    assert res.status is Status.OK, res
    assert int(res.stdout) == os.getpriority(os.PRIO_PROCESS, 0)  # the nice value the workers started with
    worker = psutil.Process(cluster.worker_pids[0])
    assert worker.nice() == max(-20, int(res.stdout) - 5)  # LocalCluster's default priority_boost
    assert_next_ok(client)


_STATUS_PAGE = (
    "import ctypes\n"
    "for line in open('/proc/self/maps'):\n"
    "    addr, perms = line.split()[:2]\n"
    "    start, end = (int(x, 16) for x in addr.split('-'))\n"
    "    if perms == 'rw-s' and end - start == 4096:\n"
    "        break\n"
    "else:\n"
    "    raise SystemExit('no shared page')\n"
)


def test_the_shared_status_page_carries_nothing_to_the_next_cell(client):
    # Cells report their end through a page of memory shared with the zygote (and so with the
    # slot's next cell): whatever a cell writes there must be gone before the next one runs.
    res = client.run(_STATUS_PAGE + "ctypes.memmove(start + 512, b'LEAKED!!', 8)\nprint('written')")
    assert res.status is Status.OK and res.stdout == "written\n", res

    async def both_slots():
        code = _STATUS_PAGE + "print(ctypes.string_at(start + 512, 8))"
        return await asyncio.gather(*(client.arun(code, timeout=10) for _ in range(2)))

    for res in asyncio.run(both_slots()):
        assert res.status is Status.OK and res.stdout == "b'\\x00\\x00\\x00\\x00\\x00\\x00\\x00\\x00'\n", res
    assert_next_ok(client)


# Walks the frames (and, failing that, the heap) for the zygote's end-of-run report page and the request
# number, writes an "exit 0, no CPU" report, closes its output and keeps running: a cell claiming its own
# end. Prints what it found to stderr before closing it, for the test's message.
_CLAIM_OK = r"""
import gc, mmap, os, signal, struct, sys, time
STOP = False
t0 = time.process_time()
while time.process_time() - t0 < 0.3:  # CPU to hide
    pass
page = seq = None
f = sys._getframe()
while f is not None and page is None:
    for value in list(f.f_locals.values()):
        if isinstance(getattr(value, "report_page", None), mmap.mmap):
            page, seq = value.report_page, f.f_locals.get("seq")
    f = f.f_back
if page is None:
    pages = [o for o in gc.get_objects() if isinstance(getattr(o, "report_page", None), mmap.mmap)]
    page = pages[0].report_page if pages else None
print("found", page is not None, seq, file=sys.stderr, flush=True)
if page is not None and seq is not None:
    page[:20] = struct.pack("=Qid", seq, 0, 0.0)
os.close(1)
os.close(2)
if STOP:
    time.sleep(STOP)  # (the zygote saw the output close long before: the stop itself must wake it)
    os.kill(os.getpid(), signal.SIGSTOP)
time.sleep(60)
"""


def test_a_cell_that_claims_its_own_end_while_running_is_not_believed(client):
    """Before: the zygote answered ``ok`` (exit 0, CPU 0.0) from the forged report while the cell slept on.
    The zygote takes the report only from a cell the kernel says has stopped: this one runs on to its
    deadline and is reported as it ended, a timeout."""
    res = client.run(_CLAIM_OK, timeout=2)
    assert res.stderr.startswith("found True"), res  # the report page was within reach: the attack is real
    assert res.status is Status.TIMEOUT, res
    assert res.wall_time >= 2
    assert_next_ok(client)


def test_a_cell_that_claims_its_end_and_stops_itself_ends_there_with_the_kernels_cpu_time(client):
    """Stopping itself after the claim is ending itself (as ``os._exit(0)`` would): answered then, and
    killed before the answer; the CPU time is the kernel's, not the claimed 0."""
    res = client.run(_CLAIM_OK.replace("STOP = False", "STOP = 0.5"), timeout=5)
    assert res.status is Status.OK and res.wall_time < 4, res
    assert res.cpu_time >= 0.25, res  # it burnt 0.3 s and claimed none
    assert_next_ok(client)
