"""A protection the host cannot give is reported (and refused under require_full_isolation), never skipped."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile

import pytest

from sandbox_cluster import protocol as P
from sandbox_cluster.limits import SandboxLimits
from sandbox_cluster.worker import Worker, WorkerConfig, ZygoteProcess
from sandbox_cluster.zygote import Zygote


def test_a_failing_layer_is_recorded_with_its_reason(caplog):
    zygote = Zygote(uid=61999, limits=SandboxLimits())

    def no_cgroups():
        raise OSError(30, "Read-only file system: /sys/fs/cgroup/memory")

    with caplog.at_level(logging.WARNING):
        assert zygote._protect("cgroup_memory", no_cgroups) is None
        assert zygote._protect("seccomp", lambda: "compiled") == "compiled"
    assert zygote.protections == [
        P.Protection(name="cgroup_memory", active=False, detail="OSError: [Errno 30] Read-only file system: "
                                                                 "/sys/fs/cgroup/memory"),
        P.Protection(name="seccomp", active=True, detail="compiled"),
    ]
    assert "protection cgroup_memory NOT active" in caplog.text


def _worker_with(protections_per_slot: list[list[P.Protection]], strict: bool) -> Worker:
    worker = Worker(WorkerConfig(connect="tcp://127.0.0.1:1", limits=SandboxLimits(require_full_isolation=strict)))
    for i, prots in enumerate(protections_per_slot):
        slot = ZygoteProcess(i, uid_lease=None, limits=worker.config.limits)  # never started
        slot.protections = prots
        worker.slots.append(slot)
    return worker


def test_worker_reports_a_layer_missing_on_any_slot(caplog):
    on, off = P.Protection(name="seccomp", active=True), P.Protection(name="seccomp", active=False, detail="old kernel")
    worker = _worker_with([[on], [off]], strict=False)
    assert worker.protections() == [off]
    with caplog.at_level(logging.WARNING):
        worker._log_protections()
    assert "running WITHOUT: seccomp (old kernel)" in caplog.text


def test_require_full_isolation_refuses_to_start():
    off = P.Protection(name="network_namespace", active=False, detail="EPERM")
    worker = _worker_with([[off]], strict=True)
    with pytest.raises(RuntimeError, match="host cannot give: network_namespace"):
        worker._log_protections()


_DEGRADED_ZYGOTE = r"""
import json, sys
from sandbox_cluster import isolation, protocol as P
from sandbox_cluster.isolation import UidLease
from sandbox_cluster.limits import SandboxLimits
from sandbox_cluster.zygote import Zygote

def no_tmpfs(*args):
    raise OSError(1, "tmpfs refused (test)")

isolation.mount_private_tmpfs = no_tmpfs
lease = UidLease.acquire()
zygote = Zygote(uid=lease.uid, limits=SandboxLimits())
zygote.setup()
first = zygote.execute(P.ExecRequest(id="1", code="import os\nopen('left', 'w').write('x')\nprint(os.getcwd())"))
second = zygote.execute(P.ExecRequest(id="2", code="import os\nprint(os.listdir('.'))"))
workdir = zygote.workdir
zygote.close()
print(json.dumps({"protections": {p.name: p.active for p in zygote.protections}, "first": first.stdout,
                  "second": second.stdout, "workdir": workdir}))
"""


def test_without_a_private_tmpfs_only_the_zygotes_own_dir_is_wiped(tmp_path):
    """Degraded mode must never wipe a shared directory such as the host's /tmp."""
    sentinel = tempfile.NamedTemporaryFile(dir="/tmp", prefix="sandbox-sentinel-", delete=False)
    sentinel.close()
    try:
        out = subprocess.run([sys.executable, "-c", _DEGRADED_ZYGOTE], capture_output=True, text=True, timeout=60,
                             check=False)
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout.splitlines()[-1])
        assert report["protections"]["private_tmpfs"] is False
        assert report["protections"]["read_only_filesystem"] is False  # reported, not silently skipped
        workdir = report["workdir"]
        assert workdir.startswith("/tmp/sandbox-cell-") and report["first"] == workdir + "\n"
        assert report["second"] == "[]\n"  # wiped between cells ...
        assert os.path.exists(sentinel.name)  # ... and nothing else in /tmp was touched
        assert not os.path.exists(workdir)  # removed when the zygote closed
    finally:
        os.unlink(sentinel.name)
