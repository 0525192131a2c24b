"""A protection the host cannot give is reported (and refused under require_full_isolation), never skipped."""

from __future__ import annotations

import logging

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
