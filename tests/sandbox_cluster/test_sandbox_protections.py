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
from sandbox_cluster.zygote.layers import Layers


def test_a_failing_layer_is_recorded_with_its_reason(caplog):
    layers = Layers(uid=61999, limits=SandboxLimits())

    def no_cgroups():
        raise OSError(30, "Read-only file system: /sys/fs/cgroup/memory")

    with caplog.at_level(logging.WARNING):
        assert layers._protect("cgroup_memory", no_cgroups) is None
        assert layers._protect("seccomp", lambda: "compiled") == "compiled"
    assert layers.protections == [
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
first = zygote.run_request(P.ExecRequest(id="1", code="import os\nopen('left', 'w').write('x')\nprint(os.getcwd())"))
second = zygote.run_request(P.ExecRequest(id="2", code="import os\nprint(os.listdir('.'))"))
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


_EXPOSE_SCRIPT = r"""
import os, sys
from sandbox_cluster import isolation, rootfs
home, lib = sys.argv[1], sys.argv[2]
isolation.unshare(isolation.CLONE_NEWNS)
isolation.mount("none", "/", None, isolation.MS_REC | isolation.MS_PRIVATE)
exposed, masked = rootfs.exposed_paths([lib])
rootfs.build_root(exposed, masked, rootfs.literal_paths([lib]), uid=61998, gid=61998, scratch_mb=4, scratch_inodes=1024)
print("exposed", lib in exposed and os.listdir(lib) == ["mod.py"])
pid = os.fork()
if pid == 0:
    os.setgroups([]); os.setresgid(61998, 61998, 61998); os.setresuid(61998, 61998, 61998)
    print("module", open(os.path.join(lib, "mod.py")).read().strip())
    print("listing", sorted(os.listdir(home)))
    print("secret", os.path.exists(os.path.join(home, "secret.txt")))
    sys.stdout.flush()
    os._exit(0)
os.waitpid(pid, 0)
print("zygote still sees", os.path.exists(os.path.join(home, "secret.txt")) is False)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mount namespace, uid switch)")
def test_import_dirs_under_a_closed_home_are_exposed_alone(tmp_path):
    # A Python installed under a 0700 home: cells (another uid) must read its import directory,
    # and nothing else there.
    home = tmp_path / "home"
    lib = home / "py" / "lib"
    lib.mkdir(parents=True)
    (lib / "mod.py").write_text("VALUE = 42\n")
    (home / "secret.txt").write_text("private\n")
    home.chmod(0o700)
    out = subprocess.run([sys.executable, "-c", _EXPOSE_SCRIPT, str(home), str(lib)], capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["exposed True", "module VALUE = 42", "listing ['py']", "secret False",
                                       "zygote still sees True"]
    assert (home / "secret.txt").read_text() == "private\n"  # the host's files are untouched


def test_collapse_keeps_contents_and_maps_huge_pages():
    import mmap

    from sandbox_cluster import hugepages

    size = 16 << 20
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    pattern = bytes(range(256)) * 16
    for off in range(0, size, 4096):
        buf[off:off + 4096] = pattern
    before = hugepages.anon_huge_bytes()
    collapsed = hugepages.collapse()
    if collapsed == 0:
        pytest.skip("this kernel has no MADV_COLLAPSE (Linux < 6.1) or THP is disabled")
    assert hugepages.anon_huge_bytes() >= before + (4 << 20)  # at least 2 of the buffer's 7-8 aligned 2 MiB
    assert all(buf[off:off + 4096] == pattern for off in range(0, size, 4096))
    buf.close()
