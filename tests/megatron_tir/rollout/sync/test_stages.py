"""Per-stage weight sync (megatron_tir.rollout.sync.stages) at PP=2 over gloo, into two fake
SGLang server processes (tests/megatron_tir/rollout/engines/fake_sglang.py: they join every
group with SGLang's own ``init_custom_process_group``, receive flattened buckets with SGLang's
own ``FlattenedTensorBucket`` and handle one group request at a time, as the real scheduler).

The traffic is recorded on both sides: every broadcast and point-to-point call each trainer
rank makes during the sync (torch.distributed wrapped in the spawned ranks), and what each
server received on which group. The servers' weights are compared by sha256 with the learner's
weights as the relay export (``Learner.hf_weights``, every tensor at rank 0) gives them.
"""

from __future__ import annotations

import hashlib
import json
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

FAKE_SERVER = Path(__file__).parents[1] / "engines" / "fake_sglang.py"
BUCKET_BYTES = 4 << 20  # several buckets per stage


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def fake_state(url: str, weights: bool = False) -> dict:
    with urllib.request.urlopen(f"{url}/fake_state{'?weights=1' if weights else ''}", timeout=30) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from megatron_tir.model_sources import resolve_model
    from megatron_tir.ports import free_port
    from megatron_tir.rollout.engines.sglang import SGLangServer, SGLangServerConfig

    logs = tmp_path_factory.mktemp("fake-sglang")
    configs = [SGLangServerConfig(model_path=str(resolve_model("tiny-qwen2")), port=free_port(), random_seed=0,
                                  launcher=(sys.executable, str(FAKE_SERVER)), log_file=str(logs / f"server{i}.log"))
               for i in range(2)]
    launched = [SGLangServer(c).start() for c in configs]
    try:
        for server in launched:
            server.wait_healthy(timeout_s=120, poll_s=0.2)
        yield launched
    finally:
        for server in launched:
            server.stop()


def _record_traffic(log: list):
    """Wrap torch.distributed's tensor calls in this process: (op, group, bytes) per call; returns
    the function that unwraps them."""
    import torch.distributed as dist

    ops = ("broadcast", "send", "recv", "isend", "irecv")
    reals = {op: getattr(dist, op) for op in ops}
    for op in ops:
        def wrapped(tensor, *args, _real=reals[op], _op=op, **kwargs):
            log.append((_op, kwargs.get("group"), tensor.numel() * tensor.element_size()))
            return _real(tensor, *args, **kwargs)

        setattr(dist, op, wrapped)
    return lambda: [setattr(dist, op, real) for op, real in reals.items()]


def stage_sync_run(rank: int, world: int, urls: list[str], out: str) -> None:
    """PP=2: perturb the weights, sync them per stage, record the traffic; rank 0 also saves the
    relay export's hashes."""
    from megatron_tir.policy.learner import Learner
    from megatron_tir.policy.learner_config import LearnerConfig
    from megatron_tir.policy.parallel import init_parallel
    from megatron_tir.rollout.engines.sglang import SGLangEngine, SGLangEngineConfig
    from megatron_tir.rollout.event_loop import EventLoopThread
    from megatron_tir.rollout.sync.stages import StageWeightSync, StageWeightSyncConfig

    init_parallel(1, 2)
    learner = Learner(LearnerConfig(model="tiny-qwen2", pp=2))
    with torch.no_grad():  # weights the servers do not have
        g = torch.Generator().manual_seed(10 + rank)
        for p in learner.module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    config = StageWeightSyncConfig(backend="gloo", timeout_s=60, bucket_bytes=BUCKET_BYTES, address="127.0.0.1")
    loop = EventLoopThread() if rank == 0 else None
    engine = None
    if rank == 0:
        engine = SGLangEngine(SGLangEngineConfig(server_urls=tuple(urls), eos_token_ids=(0,),
                                                 health_check_interval_s=0))
        loop.run(engine.start())
    sync = StageWeightSync(config, engine=engine, submit=None if loop is None else loop.submit)
    sync.start()
    traffic: list = []
    unwrap = _record_traffic(traffic)
    version = sync.update(learner)
    unwrap()
    calls = [(op, "own" if group is sync.sender.group else "other", n) for op, group, n in traffic]
    result = {"version": version, "calls": calls, "sent": sync.sender.sent, "groups": sync.group_names,
              "layout": learner.bucket_layout(BUCKET_BYTES)}
    reference = {n: sha(t) for bucket in learner.hf_weights(1 << 30) for n, t in bucket}
    sync.close()
    if rank == 0:
        result["reference"] = reference
        loop.run(engine.close())
        loop.close()
    torch.save(result, f"{out}.{rank}")


def test_each_stage_sends_its_own_weights_and_the_servers_end_bit_exact(servers, tmp_path):
    from megatron_tir.policy.parallel import run_ranks

    out = tmp_path / "result"
    launch = [fake_state(s.url, weights=True)["weights"] for s in servers]
    run_ranks(stage_sync_run, 2, [s.url for s in servers], str(out))
    r0, r1 = torch.load(f"{out}.0", weights_only=False), torch.load(f"{out}.1", weights_only=False)
    assert r0["version"] == r1["version"] == 1
    layout = r0["layout"]
    stage_names = [[n for bucket in stage for n, _ in bucket] for stage in layout]
    assert all(stage_names) and not set(stage_names[0]) & set(stage_names[1])

    # trainer side: each stage's sender broadcast its own stage's buckets on its own group, nothing else
    for stage, result in enumerate((r0, r1)):
        group = r0["groups"][stage]
        assert [g for g, _, _ in result["sent"]] == [group] * len(layout[stage])
        assert [n for _, names, _ in result["sent"] for n in names] == stage_names[stage]
        assert [names for _, names, _ in result["sent"]] == [[n for n, _ in b] for b in layout[stage]]
        own = [c for c in result["calls"] if c[1] == "own"]
        assert [c[0] for c in own] == ["broadcast"] * len(layout[stage])  # one broadcast per bucket (flattened)
        assert sum(c[2] for c in own) == sum(4 * torch.Size(s).numel() for b in layout[stage] for _, s in b)
        assert not [c for c in result["calls"] if c[0] != "broadcast"]  # no point-to-point: no hop to rank 0

    # server side: every bucket came on its stage's group, flattened, in the stages' turn
    for server, before in zip(servers, launch):
        state = fake_state(server.url, weights=True)
        got = [(u["group"], u["names"]) for u in state["received"]]
        want = [(r0["groups"][s], [n for n, _ in b]) for i in range(max(map(len, layout)))
                for s in range(2) for b in layout[s][i:i + 1]]
        assert got == want
        assert {u["load_format"] for u in state["received"]} == {"flattened_bucket"}
        assert state["weight_version"] == "1" and not state["contract_errors"]
        served = state["weights"]
        assert set(r0["reference"]) == set(served)  # untied tiny-qwen2: every served tensor is exported
        assert {n: served[n] for n in r0["reference"]} == r0["reference"]  # bit-exact
        assert all(served[n] != before[n] for n in served)  # and new


def restart_run(rank: int, world: int, configs: list, out: str) -> None:
    """PP=2, rank 0 owning two fake servers: sync, restart server 1 (launch weights, in no group),
    perturb the weights, sync again; rank 0 saves what the servers hold."""
    from megatron_tir.policy.learner import Learner
    from megatron_tir.policy.learner_config import LearnerConfig
    from megatron_tir.policy.parallel import init_parallel
    from megatron_tir.rollout.engines.sglang import SGLangEngine, SGLangEngineConfig, SGLangServer
    from megatron_tir.rollout.event_loop import EventLoopThread
    from megatron_tir.rollout.sync.stages import StageWeightSync, StageWeightSyncConfig

    init_parallel(1, 2)
    learner = Learner(LearnerConfig(model="tiny-qwen2", pp=2))

    def perturb(seed: int) -> None:
        with torch.no_grad():
            g = torch.Generator().manual_seed(seed + rank)
            for p in learner.module.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))

    servers, loop, engine = [], None, None
    if rank == 0:
        servers = [SGLangServer(c).start() for c in configs]
        for s in servers:
            s.wait_healthy(timeout_s=120, poll_s=0.2)
        loop = EventLoopThread()
        engine = SGLangEngine(SGLangEngineConfig(server_urls=tuple(s.url for s in servers), eos_token_ids=(0,),
                                                 health_check_interval_s=0))
        loop.run(engine.start())
    try:
        sync = StageWeightSync(StageWeightSyncConfig(backend="gloo", timeout_s=60, rejoin_timeout_s=60,
                                                     bucket_bytes=BUCKET_BYTES, address="127.0.0.1"),
                               engine=engine, submit=None if loop is None else loop.submit)
        sync.start()
        perturb(10)
        first = sync.update(learner)
        if rank == 0:  # the agent restarts server 1
            servers[1].stop()
            servers[1] = SGLangServer(configs[1]).start()
            servers[1].wait_healthy(timeout_s=120, poll_s=0.2)
        perturb(20)
        second = sync.update(learner)
        reference = {n: sha(t) for bucket in learner.hf_weights(1 << 30) for n, t in bucket}
        result = {"versions": (first, second), "rebuilds": sync.rebuilds, "groups": sync.group_names,
                  "reference": reference}
        if rank == 0:
            result["states"] = [fake_state(s.url, weights=True) for s in servers]
        sync.close()
    finally:
        if rank == 0:
            loop.run(engine.close())
            loop.close()
            for s in servers:
                s.stop()
    if rank == 0:
        torch.save(result, out)


def _two_servers(tmp_path) -> list:
    """Two stand-in servers' configs (tiny-qwen2, free ports, logs in ``tmp_path``): the process tests start them."""
    from megatron_tir.model_sources import resolve_model
    from megatron_tir.ports import free_port
    from megatron_tir.rollout.engines.sglang import SGLangServerConfig

    return [SGLangServerConfig(model_path=str(resolve_model("tiny-qwen2")), port=free_port(), random_seed=0,
                               launcher=(sys.executable, str(FAKE_SERVER)), log_file=str(tmp_path / f"s{i}.log"))
            for i in range(2)]


def test_a_server_that_restarted_gets_new_groups_from_every_stage(tmp_path):
    from megatron_tir.policy.parallel import run_ranks

    configs = _two_servers(tmp_path)
    run_ranks(restart_run, 2, configs, str(tmp_path / "result.pt"))
    r = torch.load(tmp_path / "result.pt", weights_only=False)
    assert r["versions"] == (1, 2) and r["rebuilds"] == 1
    assert r["groups"] == ["megatron_tir_weights-1-pp0", "megatron_tir_weights-1-pp1"]  # generation 1
    kept, fresh = r["states"]
    assert {u["group"] for u in fresh["received"]} == set(r["groups"])  # the new process: only the new groups
    assert {u["group"] for u in kept["received"]} == set(r["groups"]) | {"megatron_tir_weights-0-pp0",
                                                                            "megatron_tir_weights-0-pp1"}
    for state in (kept, fresh):
        assert state["weight_version"] == "2" and not state["contract_errors"]
        assert {n: state["weights"][n] for n in r["reference"]} == r["reference"]  # bit-exact, both servers


def late_run(rank: int, world: int, configs: list, out: str) -> None:
    """PP=2, rank 0 owning two fake servers: sync; server 1 goes down and is not back within the
    sync's wait (0.5 s here; the old rule waited 120 s and then failed the run): the sync goes on with
    server 0; server 1 comes back (launch weights); the next sync brings both. Rank 0 saves the states."""
    from megatron_tir.policy.learner import Learner
    from megatron_tir.policy.learner_config import LearnerConfig
    from megatron_tir.policy.parallel import init_parallel
    from megatron_tir.rollout.engines.sglang import SGLangEngine, SGLangEngineConfig, SGLangServer
    from megatron_tir.rollout.event_loop import EventLoopThread
    from megatron_tir.rollout.sync.stages import StageWeightSync, StageWeightSyncConfig

    init_parallel(1, 2)
    learner = Learner(LearnerConfig(model="tiny-qwen2", pp=2))
    servers, loop, engine = [], None, None
    if rank == 0:
        servers = [SGLangServer(c).start() for c in configs]
        for s in servers:
            s.wait_healthy(timeout_s=120, poll_s=0.2)
        loop = EventLoopThread()
        engine = SGLangEngine(SGLangEngineConfig(server_urls=tuple(s.url for s in servers), eos_token_ids=(0,),
                                                 health_check_interval_s=0, rejoin_timeout_s=0.5))
        loop.run(engine.start())
    try:
        sync = StageWeightSync(StageWeightSyncConfig(backend="gloo", timeout_s=60, bucket_bytes=BUCKET_BYTES,
                                                     address="127.0.0.1"),
                               engine=engine, submit=None if loop is None else loop.submit)
        sync.start()
        versions = [sync.update(learner)]
        if rank == 0:
            servers[1].stop()  # down; not back before the next sync
        versions.append(sync.update(learner))
        members_while_down = sync.members
        if rank == 0:
            servers[1] = SGLangServer(configs[1]).start()
            servers[1].wait_healthy(timeout_s=120, poll_s=0.2)
        with torch.no_grad():
            for p in learner.module.parameters():
                p.add_(0.01)
        versions.append(sync.update(learner))
        reference = {n: sha(t) for bucket in learner.hf_weights(1 << 30) for n, t in bucket}
        result = {"versions": versions, "rebuilds": sync.rebuilds, "groups": sync.group_names,
                  "members_while_down": members_while_down, "members": sync.members, "reference": reference}
        if rank == 0:
            result["urls"] = [s.url for s in servers]
            result["states"] = [fake_state(s.url, weights=True) for s in servers]
        sync.close()
    finally:
        if rank == 0:
            loop.run(engine.close())
            loop.close()
            for s in servers:
                s.stop()
    if rank == 0:
        torch.save(result, out)


def test_a_server_later_than_the_wait_is_left_out_of_every_stage_and_rejoins_the_next_sync(tmp_path):
    from megatron_tir.policy.parallel import run_ranks

    configs = _two_servers(tmp_path)
    run_ranks(late_run, 2, configs, str(tmp_path / "result.pt"))
    r = torch.load(tmp_path / "result.pt", weights_only=False)
    assert r["versions"] == [1, 2, 3] and r["rebuilds"] == 2
    assert r["members_while_down"] == (r["urls"][0],) and r["members"] == tuple(r["urls"])
    assert r["groups"] == ["megatron_tir_weights-2-pp0", "megatron_tir_weights-2-pp1"]
    kept, back = r["states"]
    assert {u["group"] for u in back["received"]} == set(r["groups"])  # the new process: only the newest groups
    assert {u["group"] for u in kept["received"]} == {f"megatron_tir_weights-{g}-pp{s}" for g in range(3)
                                                      for s in range(2)}
    for state in (kept, back):
        assert state["weight_version"] == "3" and not state["contract_errors"]
        assert {n: state["weights"][n] for n in r["reference"]} == r["reference"]  # bit-exact, both servers
