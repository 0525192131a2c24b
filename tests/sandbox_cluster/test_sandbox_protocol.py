"""Protocol round trips, edge validation and the typed configs (no processes)."""

from __future__ import annotations

import msgspec
import pytest

from sandbox_cluster import protocol as P
from sandbox_cluster.broker import BrokerConfig, derive_worker_endpoint
from sandbox_cluster.client import ClientConfig, SandboxClient
from sandbox_cluster.limits import SandboxLimits
from sandbox_cluster.worker import WorkerConfig


def test_request_round_trip_keeps_every_field():
    req = P.ExecRequest(id="r1", code="print(1)", timeout=2.5, memory_mb=300, stdin="in",
                        files={"a.txt": b"\x00\xffdata"}, max_queue_s=3.5)
    assert P.decode_request(P.encode(req)) == req


def test_result_round_trip_keeps_every_field():
    res = P.ExecResult(id="r1", status=P.Status.OUTPUT_LIMIT, stdout="o", stderr="e", exit_code=-9,
                       wall_time=1.25, cpu_time=0.5, stdout_truncated=True, stderr_truncated=False, message="m")
    back = P.decode_result(P.encode(res))
    assert back == res and back.status is P.Status.OUTPUT_LIMIT and not back.ok


def test_every_status_value_round_trips():
    assert {s.value for s in P.Status} == {"ok", "error", "timeout", "memory", "output_limit", "sandbox_error",
                                           "overloaded"}
    for status in P.Status:
        assert P.decode_result(P.encode(P.ExecResult(id="x", status=status))).status is status


def test_control_messages_round_trip():
    prot = [P.Protection(name="seccomp", active=True), P.Protection(name="cgroup_memory", active=False, detail="no")]
    hello = P.WorkerHello(name="w", slots=4, free=3, protections=prot)
    assert P.decode_hello(P.encode_msg(hello)) == hello
    failure = P.SlotFailure(id="k", reason="zygote exited")
    assert P.decode_failure(P.encode_msg(failure)) == failure
    status = P.ClusterStatus(workers=[P.WorkerInfo(name="w", slots=4, free=3, in_flight=1, protections=prot)],
                             queued=2, in_flight=1, max_queue=10, served=5, retried=1, rejected=0)
    back = P.decode_status(P.encode_msg(status))
    assert back == status
    assert back.missing_protections == {"w": ["cgroup_memory"]}


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"timeout": 0}, "timeout 0"),
        ({"timeout": 10_000}, "timeout 10000"),
        ({"memory_mb": 1}, "memory_mb 1"),
        ({"code": "x" * (P.MAX_CODE_BYTES + 1)}, "limit 1048576"),
        ({"files": {"../etc/passwd": b"x"}}, "plain name"),
        ({"files": {"": b"x"}}, "plain name"),
        ({"max_queue_s": 0}, "max_queue_s 0"),
    ],
)
def test_invalid_requests_are_rejected_with_a_reason(fields, reason):
    req = P.ExecRequest(**{"id": "bad", "code": "pass", **fields})
    with pytest.raises(ValueError, match=reason):
        P.decode_request(P.encode(req))


@pytest.mark.parametrize(
    "payload",
    [b"\xff\x00garbage", msgspec.msgpack.encode({"id": "x"}), msgspec.msgpack.encode([1, 2, 3]),
     msgspec.msgpack.encode({"id": "x", "code": 5}), msgspec.msgpack.encode({"id": "x", "code": "", "timeout": "1"})],
)
def test_malformed_payloads_raise_value_error(payload):
    with pytest.raises(ValueError, match="malformed request"):
        P.decode_request(payload)


def test_salvage_id():
    assert P.salvage_id(msgspec.msgpack.encode({"id": "abc", "code": 5})) == "abc"
    assert P.salvage_id(b"\xff\xfe") == ""
    assert P.salvage_id(msgspec.msgpack.encode({"id": 7})) == ""


def test_limits_validate_and_round_trip_json():
    limits = SandboxLimits(max_processes=32, tmpfs_mb=16)
    assert SandboxLimits.from_json(limits.to_json()) == limits
    with pytest.raises(ValueError, match="max_processes"):
        SandboxLimits(max_processes=1)
    with pytest.raises(ValueError, match="output_hard_cap_bytes"):
        SandboxLimits(output_hard_cap_bytes=10)
    with pytest.raises(ValueError, match="unknown limit"):
        SandboxLimits.from_json('{"max_procs": 3}')
    with pytest.raises(ValueError, match="not JSON"):
        SandboxLimits.from_json("{")


def test_configs_validate():
    assert derive_worker_endpoint("tcp://127.0.0.1:5555") == "tcp://127.0.0.1:5556"
    assert derive_worker_endpoint("ipc:///run/s.sock") == "ipc:///run/s.sock.workers"
    assert BrokerConfig(bind="tcp://127.0.0.1:7000").worker_bind == "tcp://127.0.0.1:7001"
    with pytest.raises(ValueError, match="must start with"):
        BrokerConfig(bind="http://x:1")
    with pytest.raises(ValueError, match="max_queue"):
        BrokerConfig(bind="tcp://127.0.0.1:7000", max_queue=-1)
    with pytest.raises(ValueError, match="must differ"):
        BrokerConfig(bind="tcp://127.0.0.1:7000", worker_bind="tcp://127.0.0.1:7000")
    with pytest.raises(ValueError, match="ZeroMQ endpoint"):
        WorkerConfig(connect="localhost:5556")
    with pytest.raises(ValueError, match="slots"):
        WorkerConfig(connect="tcp://h:1", slots=0)
    with pytest.raises(ValueError, match="deadline_slack_s"):
        ClientConfig(deadline_slack_s=0)
    with pytest.raises(ValueError, match="address"):
        SandboxClient("localhost:5555")


def test_client_rejects_bad_arguments_before_sending():
    with SandboxClient("tcp://127.0.0.1:1") as client:  # nothing listens: nothing may be sent
        with pytest.raises(ValueError, match="timeout"):
            client.run("pass", timeout=-1)
        with pytest.raises(ValueError, match="code must be str"):
            client.run(b"print(1)")
        with pytest.raises(ValueError, match="malformed request"):
            client.run("pass", memory_mb="lots")
        with pytest.raises(ValueError, match="plain name"):
            client.run("pass", files={"a/b": b""})
