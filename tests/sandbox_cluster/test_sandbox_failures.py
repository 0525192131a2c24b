"""Workers that fail: retried once elsewhere or answered sandbox_error; never dropped, never answered twice.

The first tests drive a real broker (in a thread) with scripted workers on real ZeroMQ
sockets, to make the failure order deterministic; the last ones kill real worker
processes of a LocalCluster.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import subprocess
import sys
import threading
import time

import psutil
import pytest
import zmq

from sandbox_cluster import ClientConfig, LocalCluster, SandboxClient, Status
from sandbox_cluster import protocol as P
from sandbox_cluster.broker import Broker, BrokerConfig
from sandbox_helpers import assert_next_ok


@contextlib.contextmanager
def running_broker(tmp_path, **config):
    b = Broker(BrokerConfig(bind=f"ipc://{tmp_path}/c.sock", **config))
    thread = threading.Thread(target=b.run, daemon=True)
    thread.start()
    try:
        yield b
    finally:
        b.stop()
        thread.join(5)


@pytest.fixture()
def broker(tmp_path):
    with running_broker(tmp_path, heartbeat_interval_s=0.05, heartbeat_liveness=4) as b:
        yield b


class ScriptedWorker:
    def __init__(self, endpoint: str, name: str, *, instance: str = "", free: int = 1,
                 running: list[str] | None = None) -> None:
        self.name = name
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        hello = P.WorkerHello(name=name, slots=1, free=free, instance=instance, running=running or [])
        self.sock.send_multipart([P.KIND_READY, P.encode_msg(hello)])

    def next_request(self, timeout_s: float = 30.0) -> P.ExecRequest:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.sock.poll(50):
                frames = self.sock.recv_multipart()
                if frames[0] == P.KIND_EXEC:
                    return P.decode_request(frames[1])
            self.sock.send_multipart([P.KIND_HEARTBEAT])
        raise AssertionError(f"{self.name} got no request")

    def result(self, req: P.ExecRequest, stdout: str) -> None:
        self.sock.send_multipart([P.KIND_RESULT, P.encode(P.ExecResult(id=req.id, status=Status.OK, stdout=stdout))])

    def fail(self, req: P.ExecRequest) -> None:
        self.sock.send_multipart([P.KIND_FAILED, P.encode_msg(P.SlotFailure(id=req.id, reason="zygote exited"))])

    def close(self) -> None:
        self.sock.close()


def _client(broker: Broker) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(broker.client_endpoint)
    return sock


def _status(broker: Broker) -> P.ClusterStatus:
    """Over the wire (the broker runs in another thread; its state is not ours to read)."""
    with SandboxClient(broker.client_endpoint) as client:
        return client.status()


def _replies(sock: zmq.Socket, expected: int, quiet_s: float = 0.3, timeout_s: float = 30) -> list[P.ExecResult]:
    """The results on ``sock``: waited for until ``expected`` came (at most ``timeout_s``: the broker thread
    may be slow to answer on a loaded machine), then ``quiet_s`` more for any extra (one answered twice)."""
    out, end = [], time.monotonic() + timeout_s
    while time.monotonic() < end:
        if len(out) >= expected:
            end = min(end, time.monotonic() + quiet_s)
            expected = float("inf")
        if sock.poll(20):
            kind, payload = sock.recv_multipart()
            if kind != P.KIND_ACCEPTED:
                out.append(P.decode_result(payload))
    return out


def _first_exec(workers: list[ScriptedWorker], timeout_s: float = 30.0) -> tuple[ScriptedWorker, P.ExecRequest]:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for w in workers:
            if w.sock.poll(10):
                frames = w.sock.recv_multipart()
                if frames[0] == P.KIND_EXEC:
                    return w, P.decode_request(frames[1])
            w.sock.send_multipart([P.KIND_HEARTBEAT])
    raise AssertionError("no worker got the request")


def test_failed_twice_is_sandbox_error_exactly_once(broker):
    a, b = ScriptedWorker(broker.worker_endpoint, "a"), ScriptedWorker(broker.worker_endpoint, "b")
    client = _client(broker)
    try:
        client.send_multipart([P.KIND_EXEC, P.encode(P.ExecRequest(id="r", code="print(1)"))])
        holder, first = _first_exec([a, b])
        holder.fail(first)
        other, second = _first_exec([a, b])
        assert other is not holder  # the failed slot is not announced again, so the retry goes elsewhere
        assert second.id == first.id and second.code == "print(1)"
        other.fail(second)
        replies = _replies(client, 1)
        assert [(r.id, r.status) for r in replies] == [("r", Status.SANDBOX_ERROR)]
        assert "failed 2 times" in replies[0].message
        holder.result(first, "late")  # a late result for an answered request is dropped
        assert _replies(client, 0) == []
    finally:
        for s in (a, b):
            s.close()
        client.close()


def test_silent_worker_request_is_retried_and_its_late_result_dropped(broker):
    a = ScriptedWorker(broker.worker_endpoint, "a")
    client = _client(broker)
    try:
        client.send_multipart([P.KIND_EXEC, P.encode(P.ExecRequest(id="r", code="print(2)"))])
        req = a.next_request()
        b = ScriptedWorker(broker.worker_endpoint, "b")  # joins while a is busy; a is silent from now on
        retried = b.next_request(timeout_s=30)  # a missed 4 heartbeats: declared dead
        assert retried.id == req.id
        b.result(retried, "from b\n")
        a.result(req, "from a (late)\n")  # a comes back: unknown now, told to RESET
        replies = _replies(client, 1)
        assert [(r.id, r.stdout) for r in replies] == [("r", "from b\n")]
        kinds, end = [], time.monotonic() + 30
        while P.KIND_RESET not in kinds and time.monotonic() < end:
            if a.sock.poll(50):
                kinds.append(a.sock.recv_multipart()[0])
        assert P.KIND_RESET in kinds
        assert _status(broker).retried == 1
        b.close()
    finally:
        a.close()
        client.close()


def test_max_queue_s_answers_overloaded_without_running(broker):
    client = _client(broker)
    try:
        client.send_multipart([P.KIND_EXEC, P.encode(P.ExecRequest(id="impatient", code="1", max_queue_s=0.2))])
        client.send_multipart([P.KIND_EXEC, P.encode(P.ExecRequest(id="patient", code="2"))])
        start = time.monotonic()
        (reply,) = _replies(client, 1)  # no worker: only the impatient one is answered
        assert (reply.id, reply.status) == ("impatient", Status.OVERLOADED)
        assert 0.2 <= time.monotonic() - start
        w = ScriptedWorker(broker.worker_endpoint, "w")
        req = w.next_request()
        assert req.code == "2"  # the expired one is never handed to a worker
        w.result(req, "ran\n")
        assert [(r.id, r.stdout) for r in _replies(client, 1)] == [("patient", "ran\n")]
        w.close()
    finally:
        client.close()


@pytest.mark.parametrize("still_running", [True, False])
def test_reconnected_worker_keeps_what_it_still_runs(tmp_path, still_running):
    with running_broker(tmp_path, heartbeat_interval_s=0.5, heartbeat_liveness=20) as broker:
        _reconnect_scenario(broker, still_running)


def _reconnect_scenario(broker: Broker, still_running: bool) -> None:
    old = ScriptedWorker(broker.worker_endpoint, "w", instance="proc-1")
    client = _client(broker)
    try:
        client.send_multipart([P.KIND_EXEC, P.encode(P.ExecRequest(id="r", code="pass"))])
        req = old.next_request()
        old.close()  # the worker process reconnects under a new identity
        new = ScriptedWorker(broker.worker_endpoint, "w", instance="proc-1", free=0 if still_running else 1,
                             running=[req.id] if still_running else [])
        if still_running:  # adopted: the result from the new identity is the answer, nothing retried
            time.sleep(0.1)  # (the old identity is 10 s from being declared silent)
            new.result(req, "kept\n")
            assert _status(broker).retried == 0
        else:  # not running there any more (lost in the switch): retried at once, not after a timeout
            again = new.next_request(timeout_s=5.0)  # below the 10 s silence limit
            assert again.id == req.id
            new.result(again, "retried\n")
            assert _status(broker).retried == 1
        assert [(r.id, r.stdout) for r in _replies(client, 1)] == [("r", "kept\n" if still_running else "retried\n")]
        assert [w.name for w in _status(broker).workers] == ["w"]
        new.close()
    finally:
        client.close()


def test_queue_bound_answers_overloaded(tmp_path):
    with running_broker(tmp_path, max_queue=2) as b:
        _overload_scenario(b)


def _overload_scenario(b: Broker) -> None:
    w = ScriptedWorker(b.worker_endpoint, "w")
    client = _client(b)
    try:
        end = time.monotonic() + 30  # the worker's slot is offered before the requests come (a 0.1 s sleep raced)
        while [(w.name, w.free) for w in _status(b).workers] != [("w", 1)]:
            assert time.monotonic() < end, "the scripted worker was not listed"
            time.sleep(0.01)
        for i in range(5):
            client.send_multipart([P.KIND_EXEC, P.encode(P.ExecRequest(id=f"r{i}", code="pass"))])
        replies = _replies(client, 2)
        # r0 runs, r1 and r2 wait, r3 and r4 are refused at once
        assert [(r.id, r.status) for r in replies] == [("r3", Status.OVERLOADED), ("r4", Status.OVERLOADED)]
        first = w.next_request()
        w.result(first, "")
        assert [r.status for r in _replies(client, 1)] == [Status.OK]
        assert _status(b).queued == 1 and _status(b).rejected == 2
    finally:
        w.close()
        client.close()


# --------------------------------------------------------------------------- real workers killed


@pytest.fixture(scope="module")
def killable():
    with LocalCluster(workers=3, heartbeat_interval_s=0.2, heartbeat_liveness=5) as c:
        yield c


async def _busy_workers(cluster):
    """The workers with a request in flight, polled for up to 30 s (a loaded machine dispatches late)."""
    busy, end = [], time.monotonic() + 30
    while not busy and time.monotonic() < end:
        await asyncio.sleep(0.02)
        busy = [w for w in cluster.status().workers if w.in_flight]
    return busy


@pytest.mark.slow
def test_worker_killed_mid_request_is_retried_elsewhere(killable):
    with SandboxClient(killable.address) as client:
        async def scenario():
            task = asyncio.ensure_future(client.arun("import time; time.sleep(1.0); print('done')", timeout=10))
            busy = await _busy_workers(killable)
            assert len(busy) == 1
            killable.kill_worker(int(busy[0].name.split("-")[1]))
            return await task

        before = killable.status().retried
        res = asyncio.run(scenario())
        assert res.status is Status.OK and res.stdout == "done\n"
        assert killable.status().retried == before + 1
    killable.wait_workers()


def test_waiting_for_the_workers_right_after_a_kill_waits_for_the_restart(killable):
    """wait_workers() just after kill_worker(), before the supervisor (every 0.2 s) has seen the exit:
    the dead worker is waited for until its replacement offers its slots, not reported as an error
    (the burst test below once failed in CI on that race)."""
    killable.wait_workers()
    old = killable.workers[1].pid
    killable.kill_worker(1)
    assert killable.workers[1].poll() is not None  # kill_worker returns once it is dead
    killable.wait_workers()
    new = killable.workers[1].pid
    assert new != old and killable.workers[1].poll() is None
    # the dead process is no longer listed with its slots counted free (CI: a request sent to that
    # stale entry, a zygote killed in the replacement while it was still starting)
    listed = [w for w in killable.status().workers if w.name == "local-1"]
    assert [(w.pid, w.free) for w in listed] == [(new, killable.slots_per_worker)]
    assert sum(w.free for w in killable.status().workers) == 3 * killable.slots_per_worker


@pytest.mark.slow
def test_zygote_killed_mid_request_is_retried_and_replaced(killable):
    killable.wait_workers()
    with SandboxClient(killable.address) as client:
        async def scenario():
            task = asyncio.ensure_future(client.arun("import time; time.sleep(1.0); print('done')", timeout=10))
            busy = await _busy_workers(killable)
            worker_pid = killable.workers[int(busy[0].name.split("-")[1])].pid
            deadline = time.monotonic() + 10  # a worker's zygote may be a moment from being listed (CI: none yet)
            while not (children := psutil.Process(worker_pid).children()) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            (zygote,) = children
            zygote.kill()  # as root, from outside: what no cell can do
            return await task, worker_pid, zygote.pid

        before = killable.status().retried
        res, worker_pid, zygote_pid = asyncio.run(scenario())
        assert res.status is Status.OK and res.stdout == "done\n"
        assert killable.status().retried == before + 1
        killable.wait_workers()  # the worker replaced its zygote and offered the slot again
        assert psutil.pid_exists(worker_pid)
        (new_zygote,) = psutil.Process(worker_pid).children()
        assert new_zygote.pid != zygote_pid


@pytest.mark.slow
def test_burst_of_1000_while_workers_are_killed_gets_exactly_one_reply_each(killable):
    killable.wait_workers()
    n_clients, per_client = 4, 250
    sockets = []
    for _ in range(n_clients):
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(killable.address)
        sockets.append(s)
    replies: dict[str, list[P.ExecResult]] = collections.defaultdict(list)
    try:
        for c, sock in enumerate(sockets):
            for i in range(per_client):
                rid = f"c{c}-{i}"
                sock.send_multipart([P.KIND_EXEC, P.encode(P.ExecRequest(id=rid, code=f"print('{rid}')", timeout=10))])
        kills, next_kill = 0, time.monotonic() + 0.5
        poller = zmq.Poller()
        for sock in sockets:
            poller.register(sock, zmq.POLLIN)
        end = time.monotonic() + 150
        while sum(len(v) > 0 for v in replies.values()) < n_clients * per_client and time.monotonic() < end:
            for sock, _ in poller.poll(50):
                kind, payload = sock.recv_multipart()
                if kind == P.KIND_ACCEPTED:
                    continue
                res = P.decode_result(payload)
                replies[res.id].append(res)
            if kills < 3 and time.monotonic() >= next_kill:
                killable.kill_worker(kills % 3)
                kills, next_kill = kills + 1, time.monotonic() + 1.0
        for sock, _ in poller.poll(1000):  # anything answered twice would show up now
            kind, payload = sock.recv_multipart()
            if kind != P.KIND_ACCEPTED:
                replies[P.decode_result(payload).id].append(None)
    finally:
        for sock in sockets:
            sock.close()
    assert kills == 3
    expected = {f"c{c}-{i}" for c in range(n_clients) for i in range(per_client)}
    assert set(replies) == expected, f"missing: {sorted(expected - set(replies))[:5]}"
    assert all(len(v) == 1 for v in replies.values()), [k for k, v in replies.items() if len(v) != 1][:5]
    statuses = collections.Counter(v[0].status for v in replies.values())
    assert set(statuses) <= {Status.OK, Status.SANDBOX_ERROR}, statuses
    assert statuses[Status.OK] >= 990, statuses
    assert all(v[0].stdout == f"{k}\n" for k, v in replies.items() if v[0].status is Status.OK)
    assert killable.status().retried >= 1
    killable.wait_workers()


@pytest.mark.slow
def test_worker_rejoins_a_restarted_broker(tmp_path):
    config = BrokerConfig(bind=f"ipc://{tmp_path}/c.sock", heartbeat_interval_s=0.2, heartbeat_liveness=5)

    def start_broker() -> tuple[Broker, threading.Thread]:
        b = Broker(config)
        t = threading.Thread(target=b.run, daemon=True)
        t.start()
        return b, t

    broker, thread = start_broker()
    worker = subprocess.Popen([sys.executable, "-m", "sandbox_cluster.cli", "--log-level", "WARNING", "worker",
                               "--connect", config.worker_bind, "--heartbeat-interval", "0.2",
                               "--heartbeat-liveness", "5"])
    try:
        with SandboxClient(config.bind) as client:
            first = client.run("print('first')", timeout=60)  # waits in the queue while the zygote warms up
            assert (first.status, first.stdout) == (Status.OK, "first\n")
            broker.stop()
            thread.join(5)
            broker, thread = start_broker()  # same endpoints, no memory of the worker
            again = client.run("print('again')", timeout=30)
            assert (again.status, again.stdout) == (Status.OK, "again\n")
            assert len({w.name for w in client.status().workers}) == 1  # the one worker, registered again
    finally:
        worker.terminate()
        assert worker.wait(10) == 0
        broker.stop()
        thread.join(5)


_OWNER = r"""
import json, sys, time
from sandbox_cluster import LocalCluster
cluster = LocalCluster(workers=1)
print(json.dumps([cluster.broker_pid, *cluster.worker_pids]), flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_cluster_processes_exit_when_their_owner_is_killed():
    owner = subprocess.Popen([sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(owner.stdout.readline())
        procs = [psutil.Process(pid) for pid in pids]
        procs += [child for p in procs for child in p.children(recursive=True)]  # the zygotes (and their cells)
        assert len(procs) >= 3
        owner.kill()  # no __exit__, no SIGTERM to the cluster: it must notice by itself
        owner.wait()
        gone, alive = psutil.wait_procs(procs, timeout=60)
        assert alive == [], [p.cmdline()[:4] for p in alive]
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


def test_a_cell_forked_ahead_that_dies_is_replaced(cluster, client):
    # Each idle zygote holds the next cell, forked ahead; if it dies (here: SIGKILL as root
    # from outside), the next request must not inherit its death.
    assert_next_ok(client)
    spares = []
    for worker_pid in cluster.worker_pids:
        for shim in psutil.Process(worker_pid).children():
            for zygote in shim.children():
                spares += zygote.children()
    assert spares, "no cell forked ahead"
    for proc in spares:
        proc.kill()
    psutil.wait_procs(spares, timeout=5)
    for _ in range(4):  # both slots, twice
        res = client.run("print('ok')")
        assert res.status is Status.OK and res.stdout == "ok\n", res


def test_a_request_lost_on_the_way_is_sent_again_and_runs_once(tmp_path):
    # ZeroMQ drops what it hands to a connection that is dying (a broker restarting): a fake
    # broker that drops the first copy gets a second; copies of a request the broker holds
    # are acknowledged, not queued twice.
    ctx = zmq.Context.instance()
    fake = ctx.socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    fake.bind(f"ipc://{tmp_path}/fake.sock")
    seen: list[float] = []

    def serve() -> None:
        while len(seen) < 2:
            if not fake.poll(5000):
                return
            frames = fake.recv_multipart()
            if frames[1] == P.KIND_STATUS:  # which broker this is: a real one answers; the client copes without
                continue
            client, kind, body = frames
            seen.append(time.monotonic())
            if len(seen) == 2:
                req = P.decode_request(body)
                fake.send_multipart([client, P.KIND_ACCEPTED, req.id.encode()])
                fake.send_multipart([client, P.KIND_RESULT, P.encode(P.ExecResult(id=req.id, status=Status.OK,
                                                                                   stdout="second\n"))])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    with SandboxClient(f"ipc://{tmp_path}/fake.sock", ClientConfig(resend_after_s=0.2)) as client:
        res = client.run("print('x')", timeout=5)
    thread.join(5)
    fake.close()
    assert (res.status, res.stdout) == (Status.OK, "second\n")
    assert len(seen) == 2 and 0.15 <= seen[1] - seen[0] < 2.0


def test_the_broker_takes_a_copy_of_a_request_it_holds_only_once(broker):
    sock = _client(broker)
    req = P.ExecRequest(id="same", code="print(1)")
    for _ in range(3):
        sock.send_multipart([P.KIND_EXEC, P.encode(req)])
    replies = [sock.recv_multipart() for _ in range(3)]
    assert replies == [[P.KIND_ACCEPTED, b"same"]] * 3
    worker = ScriptedWorker(broker.worker_endpoint, "w")
    got = worker.next_request()
    worker.result(got, "1\n")
    (kind, body) = sock.recv_multipart()
    assert kind == P.KIND_RESULT and P.decode_result(body).id == "same"
    assert broker.status().served == 1 and broker.status().queued == 0
    with pytest.raises(AssertionError, match="got no request"):
        worker.next_request(timeout_s=0.5)  # nothing else was queued
    worker.close()
    sock.close()
