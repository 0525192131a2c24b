"""The weight-update group's rendezvous under torchrun: every torchrun worker has
``TORCHELASTIC_USE_AGENT_STORE=True``, which makes ``c10d.rendezvous("tcp://...")`` a client on every
rank (torch ``distributed/rendezvous.py`` ``_create_c10d_store``: the elastic agent is assumed to host
the store). The trainer side must host the group's store itself, or a server's join waits for ever
(the rehearsal's first run, docs/rehearsal.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from megatron_tir.ports import free_port
from megatron_tir.rollout.sync.group_join import GroupJoin

ROOT = Path(__file__).resolve().parents[4]

# the server's side as SGLang 0.5.23 builds it (init_custom_process_group): a rendezvous client, then a
# PrefixStore of the group's name; run outside torchrun
SERVER = """
import sys
from datetime import timedelta
from torch.distributed import distributed_c10d as c10d
store, rank, world = next(c10d.rendezvous(f"tcp://127.0.0.1:{sys.argv[1]}", 1, 2, timeout=timedelta(seconds=20)))
pg, _ = c10d._new_process_group_helper(world, rank, [], c10d.Backend("gloo"), c10d.PrefixStore("g", store),
                                       group_name="g", backend_options=None, timeout=timedelta(seconds=20))
print("joined", world)
"""


def test_a_trainer_rank_under_torchrun_hosts_the_groups_store(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # what torchrun sets in its workers
    port = free_port()
    joined = GroupJoin(master_address="127.0.0.1", master_port=port, world_size=2, group_name="g", backend="gloo",
                       timeout_s=20)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}  # the server: not a torchrun worker
    p = subprocess.run([sys.executable, "-c", SERVER, str(port)], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0 and "joined 2" in p.stdout, p.stderr[-1500:]
    assert joined.result(timeout=30) is not None
