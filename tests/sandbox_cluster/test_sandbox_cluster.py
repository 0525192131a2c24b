"""The cluster end to end: results, async fan-out, malformed input, deadlines, overload, status."""

from __future__ import annotations

import asyncio
import threading
import time

import msgspec
import pytest
import zmq

from sandbox_cluster import ClientConfig, LocalCluster, SandboxClient, Status
from sandbox_cluster import protocol as P


def test_ok_result_fields(client):
    res = client.run("import sympy, numpy\nx = sympy.Symbol('x')\nprint(sympy.solve(x**2 - 4), numpy.arange(5).sum())")
    assert res.status is Status.OK and res.ok
    assert res.stdout == "[-2, 2] 10\n"
    assert res.stderr == "" and res.exit_code == 0
    assert 0 < res.wall_time < 5 and 0 < res.cpu_time < 5
    assert not res.stdout_truncated and not res.stderr_truncated


def test_cells_import_the_standard_library(client):
    # Modules the zygote never imported for itself: they must load in a cell even where the
    # interpreter's files are unreadable for the cell's uid (a Python under a 0700 /root).
    code = ("import statistics, fractions, decimal, heapq, bisect, itertools, functools, encodings.idna\n"
            "print(statistics.median([3, 1, 2]), fractions.Fraction(1, 3) + fractions.Fraction(1, 6), "
            "decimal.Decimal('0.1') * 3, 'x'.encode('idna'))")
    res = client.run(code)
    assert res.status is Status.OK, res.stderr
    assert res.stdout == "2 1/2 0.3 b'x'\n"


def test_exception_is_an_error_with_the_cell_traceback(client):
    res = client.run("print('partial')\n1 / 0\n")
    assert res.status is Status.ERROR and res.exit_code == 1
    assert res.stdout == "partial\n"
    assert res.stderr.startswith('Traceback (most recent call last):\n  File "<cell>", line 2, in <module>\n    1 / 0')
    assert res.stderr.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "zygote" not in res.stderr  # the sandbox's own frames are not shown


def test_syntax_error_and_exit_codes(client):
    assert client.run("def f(:\n").stderr.rstrip().splitlines()[-1].startswith("SyntaxError")
    assert client.run("import sys; sys.exit(3)").exit_code == 3
    assert client.run("import sys; sys.exit(3)").status is Status.ERROR
    assert client.run("import sys; sys.exit(0)").status is Status.OK
    res = client.run("raise SystemExit('bye')")
    assert res.exit_code == 1 and res.stderr == "bye\n"


def test_stdin_and_files(client):
    res = client.run("import sys\nprint(sys.stdin.read().upper(), open('data.bin', 'rb').read())",
                     stdin="hello", files={"data.bin": b"\x00\x01", "notes.txt": "text"})
    assert res.stdout == "HELLO b'\\x00\\x01'\n", res


def test_many_async_requests_in_flight_on_one_client(client):
    async def fan_out():
        return await asyncio.gather(*(client.arun(f"print({i} * {i})", timeout=30) for i in range(200)))

    results = asyncio.run(fan_out())
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(200)]
    assert len({r.id for r in results}) == 200


def test_status_reports_every_protection(cluster, client):
    status = client.status()
    assert len(status.workers) == 2
    assert len({uid for w in status.workers for uid in w.uids}) == 2  # one unprivileged user per slot
    for worker in status.workers:
        names = {p.name for p in worker.protections}
        assert names == {"subreaper", "clean_environment", "uid_switch", "network_namespace", "private_tmpfs",
                         "cgroup_memory", "cgroup_pids", "seccomp", "rlimits", "process_tree_kill",
                         "ipc_namespace", "read_only_filesystem", "pid_namespace", "filesystem_allowlist"}
        missing = [p for p in worker.protections if not p.active]
        assert all(p.detail for p in missing)  # a missing protection always says why
    assert set(status.missing_protections) == {
        w.name for w in status.workers if any(not p.active for p in w.protections)}


# --------------------------------------------------------------------------- malformed messages on the wire


@pytest.fixture()
def raw(cluster):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(cluster.address)
    yield sock
    sock.close()


def _reply(sock: zmq.Socket, timeout_s: float = 10.0) -> P.ExecResult:
    assert sock.poll(int(timeout_s * 1000)), "no reply"
    kind, payload = sock.recv_multipart()
    if kind == P.KIND_ACCEPTED:  # taken; the result follows
        assert sock.poll(int(timeout_s * 1000)), "no result"
        kind, payload = sock.recv_multipart()
    assert kind == P.KIND_RESULT
    return P.decode_result(payload)


@pytest.mark.parametrize(
    ("frames", "reason", "rid"),
    [
        ([P.KIND_EXEC, b"\x93garbage\xff"], "malformed request", ""),
        ([P.KIND_EXEC, msgspec.msgpack.encode({"id": "t1", "code": 42})], "Expected `str`", "t1"),
        ([P.KIND_EXEC, msgspec.msgpack.encode({"id": "t2", "code": "x", "timeout": "soon"})], "Expected `float`", "t2"),
        ([P.KIND_EXEC, P.encode(P.ExecRequest(id="t3", code="#" * (2 << 20)))], "limit 1048576", "t3"),
        ([P.KIND_EXEC, P.encode(P.ExecRequest(id="t4", code="1", memory_mb=1 << 30))], "memory_mb", "t4"),
        ([P.KIND_EXEC], "bad message", ""),
        ([b"DROP TABLE", b"x"], "bad message", ""),
        ([P.KIND_EXEC, b"a", b"b"], "bad message", ""),
    ],
)
def test_malformed_message_gets_an_error_reply_and_the_broker_keeps_serving(raw, frames, reason, rid):
    raw.send_multipart(frames)
    res = _reply(raw)
    assert res.status is Status.ERROR
    assert res.id == rid
    assert reason in res.message
    raw.send_multipart([P.KIND_EXEC, P.encode(P.ExecRequest(id="after", code="print('still here')"))])
    after = _reply(raw)
    assert (after.id, after.status, after.stdout) == ("after", Status.OK, "still here\n")


# --------------------------------------------------------------------------- deadlines and overload


def test_client_deadline_when_nobody_answers(tmp_path):
    config = ClientConfig(deadline_slack_s=0.3)
    with SandboxClient(f"ipc://{tmp_path}/nobody.sock", config) as client:
        start = time.monotonic()
        res = client.run("print(1)", timeout=0.2)
        assert res.status is Status.SANDBOX_ERROR and "client deadline" in res.message
        assert 0.45 < time.monotonic() - start < 2.0

        async def both():
            return await asyncio.gather(client.arun("print(1)", timeout=0.2), client.arun("print(2)", timeout=1.0))

        start = time.monotonic()
        fast, slow = asyncio.run(both())
        assert fast.status is Status.SANDBOX_ERROR and slow.status is Status.SANDBOX_ERROR
        assert 1.2 < time.monotonic() - start < 3.0  # each call has its own deadline


def test_a_stray_reply_is_not_mistaken_for_the_next_result(client):
    # A reply nobody waits for any more (here: the error answer to a bogus message sent on the
    # client's own socket) sits on the socket; the next call must skip it.
    client._sync_socket().send_multipart([b"BOGUS"])
    time.sleep(0.2)
    res = client.run("print('mine')")
    assert (res.status, res.stdout) == (Status.OK, "mine\n")


def test_work_the_caller_gave_up_on_is_not_run(client):
    async def occupy_both_slots():
        return await asyncio.gather(*(client.arun("import time; time.sleep(2)", timeout=5) for _ in range(2)))

    served_before = client.status().served
    blocker = threading.Thread(target=lambda: asyncio.run(occupy_both_slots()))
    blocker.start()
    for _ in range(500):
        if client.status().in_flight == 2:
            break
        time.sleep(0.01)
    assert client.status().in_flight == 2
    impatient = SandboxClient(client.address, ClientConfig(deadline_slack_s=0.3, retry_overloaded=False))
    try:
        start = time.monotonic()
        res = impatient.run("print('should not run')", timeout=2)
        assert res.status is Status.OVERLOADED and "did not run" in res.message
        assert time.monotonic() - start < 1.2  # answered when its queue allowance ran out, not at the deadline
    finally:
        impatient.close()
        blocker.join()
    assert client.status().served == served_before + 2  # only the two blockers ran


@pytest.mark.slow
def test_overloaded_when_the_queue_is_full_and_retry_succeeds():
    with LocalCluster(workers=1, max_queue=1) as cluster:
        code = "import time; time.sleep(0.5); print('done')"
        no_retry = SandboxClient(cluster.address, ClientConfig(retry_overloaded=False))
        retry = SandboxClient(cluster.address)
        try:
            async def burst(client):
                return await asyncio.gather(*(client.arun(code, timeout=10) for _ in range(4)))

            statuses = sorted(r.status.value for r in asyncio.run(burst(no_retry)))
            # one running, one queued, the other two refused at once
            assert statuses == ["ok", "ok", "overloaded", "overloaded"]
            assert cluster.status().rejected == 2
            results = asyncio.run(burst(retry))
            assert [r.stdout for r in results] == ["done\n"] * 4
        finally:
            no_retry.close()
            retry.close()


@pytest.mark.slow
def test_one_worker_with_several_slots_runs_them_in_parallel():
    with LocalCluster(workers=1, slots_per_worker=2) as cluster, SandboxClient(cluster.address) as client:
        (worker,) = client.status().workers
        assert (worker.slots, worker.free, len(set(worker.uids))) == (2, 2, 2)

        async def two():
            return await asyncio.gather(*(client.arun("import os, time\nstart = time.time()\ntime.sleep(1)\n"
                                                      "print(os.getuid(), start, time.time())")
                                          for _ in range(2)))

        results = asyncio.run(two())
        (uid_a, start_a, end_a), (uid_b, start_b, end_b) = ([float(x) for x in r.stdout.split()] for r in results)
        # side by side, not one after the other: each ran while the other did (the wall clock of the whole
        # call raced a loaded machine's start-up costs)
        assert start_a < end_b and start_b < end_a, results
        assert sorted(int(u) for u in (uid_a, uid_b)) == sorted(worker.uids)  # one slot (and user) each


def test_cancelled_arun_leaves_nothing_behind(client):
    async def cancel_one():
        task = asyncio.ensure_future(client.arun("import time; time.sleep(0.5)"))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        pending = dict(client._async.pending)
        after = await client.arun("print('after')")
        return pending, after

    pending, after = asyncio.run(cancel_one())
    assert pending == {}
    assert after.stdout == "after\n"


def test_a_cell_that_closes_its_output_early_is_still_answered_by_its_exit(client):
    # A cell reports its end (exit code, CPU time) just before it exits, so the zygote can answer
    # without waiting for the exit; one that closes its output itself and ends otherwise must
    # still get the exit status of the process.
    res = client.run("import os, time\nprint('before', flush=True)\nos.close(1)\nos.close(2)\n"
                     "time.sleep(0.2)\nos._exit(5)")
    assert res.status is Status.ERROR and res.exit_code == 5 and res.stdout == "before\n", res
    assert res.wall_time >= 0.2
    res = client.run("import sys\nsum(range(10**6))\nprint('done')\nsys.exit(7)")
    assert res.status is Status.ERROR and res.exit_code == 7 and res.stdout == "done\n", res
    assert 0 < res.cpu_time < 5
