"""LocalCluster supervision: a broker that dies is restarted; its temporary directory is
removed on every way out (close, failed start, no close at exit, its owner killed)."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from sandbox_cluster import LocalCluster, SandboxClient, Status
from sandbox_cluster.cluster import remove_stale_dirs


def _dirs_of(pid: int) -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), f"sandbox-cluster-{pid}-*")))


def test_a_killed_broker_is_restarted_and_the_cluster_serves_again():
    before = _dirs_of(os.getpid())
    with LocalCluster(workers=1, heartbeat_interval_s=0.2, heartbeat_liveness=5) as cluster:
        (tmpdir,) = _dirs_of(os.getpid()) - before
        with SandboxClient(cluster.address) as client:
            assert client.run("print(1)").stdout == "1\n"
            old = cluster.kill_broker()
            end = time.monotonic() + 30
            while cluster.broker_restarts == 0 and time.monotonic() < end:
                time.sleep(0.05)
            assert cluster.broker_restarts == 1 and cluster.broker_pid != old
            res = client.run("print(2)", timeout=30)  # resent until the new broker takes it; the worker rejoined
            assert (res.status, res.stdout) == (Status.OK, "2\n"), res
        assert psutil.pid_exists(cluster.broker_pid)
        assert os.path.isdir(tmpdir)
    assert not os.path.exists(tmpdir)  # close()


def test_the_directory_goes_when_the_start_fails():
    before = _dirs_of(os.getpid())
    with pytest.raises(RuntimeError, match="not started after 0.01 s: worker\(s\) local-0 not registered"):
        LocalCluster(workers=1, start_timeout_s=0.01)
    assert _dirs_of(os.getpid()) - before == set()


_OWNER = r"""
import os, signal, sys
from sandbox_cluster import LocalCluster
cluster = LocalCluster(workers=1)
print(cluster._tmpdir, flush=True)
if sys.argv[1] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
# else: the interpreter exits with the cluster never closed
"""


@pytest.mark.parametrize("way", ["exit", "kill"])
def test_the_directory_goes_when_its_owner_leaves_without_close(way):
    owner = subprocess.run([sys.executable, "-c", _OWNER, way], capture_output=True, text=True, timeout=120,
                           check=False)
    tmpdir = owner.stdout.strip()
    assert os.path.basename(tmpdir).startswith("sandbox-cluster-"), owner.stderr
    if way == "exit":
        assert owner.returncode == 0, owner.stderr
        assert not os.path.exists(tmpdir)  # at interpreter exit
        return
    assert owner.returncode == -signal.SIGKILL
    assert os.path.isdir(tmpdir)  # nothing ran in the killed process ...
    assert tmpdir in remove_stale_dirs()  # ... the next LocalCluster's start removes it
    assert not os.path.exists(tmpdir)
    mine = tempfile.mkdtemp(prefix=f"sandbox-cluster-{os.getpid()}-")  # a live owner's stays
    try:
        assert mine not in remove_stale_dirs() and os.path.isdir(mine)
    finally:
        os.rmdir(mine)


_STARTING_OWNER = """
from sandbox_cluster import LocalCluster
import time
LocalCluster(workers=2)
print("up", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_sigterm_to_the_owner_during_start_up_leaves_no_process():
    # Issue 37: a worker that started after its owner died took init for its parent and never left.
    import select

    owner = subprocess.Popen([sys.executable, "-c", _STARTING_OWNER], stdout=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 60
        while len(psutil.Process(owner.pid).children()) < 3:  # the broker and both workers, still starting
            assert time.monotonic() < end and owner.poll() is None
            time.sleep(0.01)
        procs = psutil.Process(owner.pid).children(recursive=True)
        owner.send_signal(signal.SIGTERM)
        owner.wait(10)
        assert not select.select([owner.stdout], [], [], 0)[0] or owner.stdout.read() == ""  # never came up
        _gone, alive = psutil.wait_procs(procs, timeout=30)
        assert alive == [], [p.pid for p in alive]
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
