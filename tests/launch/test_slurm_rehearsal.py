"""The rehearsal (docs/rehearsal.md) through a real Slurm (opt-in: ``pytest -m slurm tests/launch``).

``tests/rehearsal/rehearse.py`` runs the cluster's shape by hand; this runs it the way a user
does: ``tir-launch --executor slurm`` renders and submits the sbatch, Slurm splits three nodes
among the groups, the node agents start the sandbox and two SGLang servers, and the real
``torchrun`` starts the real trainer (two ranks at PP 2, CPU and gloo: the local Slurm's GPUs
are empty files). The only stand-in is the SGLang server: ``sglang.launch_server`` on the
groups' ``PYTHONPATH`` execs the tests' 0.5.23 stand-in (``fake_sglang.py``: SGLang's HTTP API
and weight-update groups over a LocalEngine), each ``/generate`` waiting
``FAKE_SGLANG_GENERATE_DELAY_S`` so that the held-out evaluation outlasts the process groups'
timeout (20 s, not the rehearsal's 5 s: the timeout also bounds a pipeline stage's wait for the
other stage's compute and the default group's creation, where one rank waits for the other's
start-up; at a load average of 15 on a shared 2-core host, one stage waited > 5 s for the other's
backward and one rank's start-up lagged the other's by > 10 s).
Then, on the running job:

1. after step 2 the second server's process is killed (SIGKILL); its node agent starts it
   again on its port and training goes on (the server serves again once it holds the current
   weights);
2. after step 3, ``scancel --signal=USR1 --batch``: the batch shell's trap (the sbatch's
   ``--signal=B:USR1@N`` path; it runs once the monitor loop's ``sleep 30`` ends) passes it to
   the trainer's ``srun``, the agent to the ranks, which end their step, write a checkpoint and
   exit 0; the job completes with exit code 0 before the last step;
3. ``scontrol requeue``: the job's next attempt finds ``checkpoints/latest`` and resumes to the
   last step.

Needs a partition of three nodes on this host's file system (``tests/launch/local_slurm.sh``);
prints one ``slurm rehearsal: PASS|FAIL <check>: <figures>`` line per check. Takes minutes.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from megatron_tir.launch.cli import main

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
FAKE_SERVER = REPO / "tests" / "megatron_tir" / "rollout" / "engines" / "fake_sglang.py"
PARTITION = os.environ.get("TIR_SLURM_PARTITION", "batch")
CPUS = int(os.environ.get("TIR_SLURM_CPUS_PER_NODE", "2"))
STEPS, KILL_AFTER, SIGNAL_AFTER = 7, 2, 3  # server 2 dies after step 2's line; SIGUSR1 is sent after step 3's
# (the batch shell runs its trap when the monitor loop's `sleep 30` ends: the trainer gets it up to 30 s later)
TIMEOUT_S, DELAY_S = 20, 25.0  # the process groups' timeout; each /generate's latency
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL")

# `python -m sglang.launch_server ARGS` -> the stand-in server with the same ARGS; the stand-in reads
# the installed SGLang's sources, so this package leaves PYTHONPATH before the exec
LAUNCH_SERVER = '''import os, sys
stubs = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                           if p and os.path.abspath(p) != stubs)
os.execv(sys.executable, [sys.executable, {fake!r}, *sys.argv[1:]])
'''


def _free_ports(n: int) -> int:
    """A port p with p .. p+n-1 free."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("", 0))
            first = s.getsockname()[1]
        if first + n < 65000 and all(_port_free(first + i) for i in range(n)):
            return first
    raise RuntimeError("no run of free ports")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
        return True


def _slurm_nodes() -> int:
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return 0
    out = subprocess.run(["sinfo", "-h", "-p", PARTITION, "-o", "%D"], capture_output=True, text=True, check=False)
    return sum(int(x) for x in out.stdout.split() if x.isdigit()) if out.returncode == 0 else 0


def _slurm(*argv: str) -> str:
    return subprocess.run(list(argv), capture_output=True, text=True, check=True, timeout=60).stdout


def _job(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, check=False)
    return dict(kv.split("=", 1) for kv in out.stdout.split() if "=" in kv)


def _steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def _latest_step(run_dir: Path) -> int | None:
    latest = run_dir / "checkpoints" / "latest"
    if not latest.exists():
        return None
    name = os.readlink(latest) if latest.is_symlink() else latest.read_text().strip()
    return int(Path(name).name.removeprefix("step_"))


def _fake_state(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(f"{url}/fake_state", timeout=10) as r:
            return json.loads(r.read())
    except OSError:
        return None


def _server_pid(port: int) -> int | None:
    """The stand-in server process listening on ``port`` (found by its command line)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                argv = Path("/proc", entry, "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if any(a.endswith("fake_sglang.py") for a in argv) and "--port" in argv \
                    and argv[argv.index("--port") + 1] == str(port):
                return int(entry)
    return None


class Job:
    """The submitted job, watched until it ends; ``on_step`` sees each new metrics line."""

    def __init__(self, job_id: str, run_dir: Path, urls: list[str]) -> None:
        self.id, self.run_dir, self.urls = job_id, run_dir, urls
        self.states: dict[str, dict] = {}  # url -> its last /fake_state

    def wait(self, timeout_s: float, on_step=None) -> dict[str, str]:
        deadline, seen = time.monotonic() + timeout_s, -1
        while time.monotonic() < deadline:
            info = _job(self.id)
            if info.get("JobState") in ENDED:
                return info
            rows = _steps(self.run_dir)
            if rows and rows[-1]["step"] != seen:
                seen = rows[-1]["step"]
                _log(f"job {self.id}: step {seen} logged")
                if on_step is not None:
                    on_step(seen)
            for url in self.urls:
                state = _fake_state(url)
                if state is not None:
                    self.states[url] = state
            time.sleep(3)
        subprocess.run(["scancel", self.id], check=False)
        pytest.fail(f"job {self.id} still {_job(self.id).get('JobState')} after {timeout_s:.0f} s")


def _log(msg: str) -> None:
    sys.__stderr__.write(f"slurm rehearsal [{time.strftime('%H:%M:%S')}] {msg}\n")
    sys.__stderr__.flush()


@pytest.mark.timeout(3000)
@pytest.mark.skipif(_slurm_nodes() < 3, reason=f"needs a Slurm with a partition {PARTITION!r} of >= 3 nodes "
                                                "(tests/launch/local_slurm.sh starts one)")
def test_the_rehearsal_through_the_rendered_sbatch(tmp_path, monkeypatch, capsys):
    import importlib

    from megatron_tir.model_sources import resolve_model

    stubs = tmp_path / "stubs"
    (stubs / "sglang").mkdir(parents=True)
    (stubs / "sglang" / "__init__.py").write_text("")
    (stubs / "sglang" / "launch_server.py").write_text(LAUNCH_SERVER.format(fake=str(FAKE_SERVER)))
    sglang_port, sandbox_port, master_port = _free_ports(2), _free_ports(2), _free_ports(1)
    cluster = {
        "account": "test", "partition": PARTITION, "time": "01:00:00", "container_image": None,
        "signal_before_end_s": 60, "master_port": master_port,
        "partitions": {PARTITION: {"gpus_per_node": 2, "cpus_per_node": CPUS}},
        "job_dir": str(tmp_path / "nemo-run"), "run_root": str(tmp_path / "runs"),
        "models": {"tiny-qwen2": str(resolve_model("tiny-qwen2"))},
        "env": {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHONPATH": f"{stubs}:{REPO}",
                "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
        "trainer": {"nodes": 1},
        "sglang": {"nodes": 1, "tp": 1, "port": sglang_port, "env": {"FAKE_SGLANG_GENERATE_DELAY_S": str(DELAY_S)}},
        "sandbox": {"nodes": 1, "workers_per_node": 1, "port": sandbox_port},
    }
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cluster))
    nemo_slurm = importlib.import_module("nemo_run.run.torchx_backend.schedulers.slurm")
    monkeypatch.setattr(nemo_slurm, "SLURM_JOB_DIRS", str(tmp_path / "slurm_jobs"))
    run_dir = tmp_path / "runs" / "r1"
    sets = [f"trainer.steps={STEPS}", "trainer.eval_every=3", "data.eval_size=2", "trainer.checkpoint.every=1",
            f"trainer.collective_timeout_s={TIMEOUT_S}", "trainer.progress=false", "learner.pp=2"]

    t0 = time.monotonic()
    assert main(["--recipe", "tiny-cpu", "--executor", "slurm", "--cluster", str(path), "--out", str(run_dir),
                 *(w for s in sets for w in ("--set", s))]) == 0
    capsys.readouterr()
    (job_id,) = [line.split()[0] for line in _slurm("squeue", "-h", "-o", "%i %o").splitlines()
                 if str(tmp_path) in line]
    hosts = {}
    while not hosts and time.monotonic() - t0 < 600:
        hosts = _job_hosts(tmp_path)
        time.sleep(2)
    assert hosts, f"job {job_id} wrote no setup lines: {_job(job_id)}"
    urls = [f"http://{hosts['sglang']}:{sglang_port + i}" for i in range(2)]
    _log(f"job {job_id}: trainer {hosts['trainer']}, servers {', '.join(urls)}, sandbox {hosts['sandbox']}")
    job = Job(job_id, run_dir, urls)
    events: dict = {}

    def on_step(step: int) -> None:
        if step == KILL_AFTER and "killed" not in events:
            events["generated_before_kill"] = [sum(p == "/generate" for p in (job.states.get(u) or {}).get("paths", []))
                                               for u in urls]
            pid = _server_pid(sglang_port + 1)
            assert pid is not None, "the second server's process is not on this host"
            events["version_at_kill"] = (job.states.get(urls[1]) or {}).get("weight_version")
            os.kill(pid, signal.SIGKILL)
            job.states.pop(urls[1], None)  # what the restarted process serves is counted afresh
            events["killed"] = pid
            _log(f"server 2 (pid {pid}) killed after step {step}")
        if step == SIGNAL_AFTER and "signalled" not in events:
            _slurm("scancel", "--signal=USR1", "--batch", job_id)
            events["signalled"] = time.monotonic()
            _log(f"scancel --signal=USR1 --batch {job_id} after step {step}")

    first = job.wait(1800, on_step)
    batch1 = _batch_log(tmp_path)
    main_log = _agent_log(run_dir, "trainer", "main.log")
    agent_log = _agent_log(run_dir, "sglang", f"sglang-{sglang_port + 1}.log")
    main1, restarts = main_log.read_text(errors="replace"), agent_log.read_text(errors="replace").count("=== agent: start #")
    stopped_at, states = _latest_step(run_dir), dict(job.states)  # the servers as attempt 1 left them
    _log(f"attempt 1 ended {first.get('JobState')} {first.get('ExitCode')}; latest checkpoint: step {stopped_at}")

    second: dict[str, str] = {}
    if first.get("JobState") == "COMPLETED":
        _slurm("scontrol", "requeue", job_id)
        _slurm("scontrol", "update", f"JobId={job_id}", "StartTime=now")  # a requeued job waits 2 min otherwise
        deadline = time.monotonic() + 300
        while _job(job_id).get("JobState") not in ("RUNNING", "CONFIGURING") and time.monotonic() < deadline:
            time.sleep(1)
        second = Job(job_id, run_dir, []).wait(1200)
        _log(f"attempt 2 ended {second.get('JobState')} {second.get('ExitCode')}")
    main2 = main_log.read_text(errors="replace")[len(main1):]
    batch2 = _batch_log(tmp_path) if second else ""

    rows = _steps(run_dir)
    steps = [r["step"] for r in rows]
    evals = {r["step"]: r["time/eval"] for r in rows if "time/eval" in r}
    ok1 = first.get("JobState") == "COMPLETED" and first.get("ExitCode") == "0:0"
    ok2 = second.get("JobState") == "COMPLETED" and second.get("ExitCode") == "0:0"
    checks = []
    checks.append(("rank-0 phases under the watchdog", ok1 and ok2 and bool(evals) and min(evals.values()) > TIMEOUT_S,
                   f"held-out evaluations at steps {sorted(evals)} took {', '.join(f'{v:.1f}' for v in evals.values())}"
                   f" s against a {TIMEOUT_S} s process-group timeout; job {job_id} attempts ended "
                   f"{first.get('JobState')} {first.get('ExitCode')}, {second.get('JobState')} {second.get('ExitCode')}"))
    generated = events.get("generated_before_kill", [0, 0])
    checks.append(("two servers", all(g > 0 for g in generated), f"/generate served before the kill: {generated}"))
    restarted = states.get(urls[1]) or {}
    served_after = sum(p == "/generate" for p in restarted.get("paths", []))
    versions = [(states.get(u) or {}).get("weight_version") for u in urls]
    checks.append(("server restart", "killed" in events and restarts == 2 and served_after > 0 and len(set(versions)) == 1
                   and "rejoined with the current weights" in main1 and KILL_AFTER + 1 in steps,
                   f"killed after step {KILL_AFTER} at weight version {events.get('version_at_kill')}; its agent "
                   f"started it {restarts} times; the new process served {served_after} /generate; servers at "
                   f"weight versions {versions} at the end of attempt 1"))
    checks.append(("SIGUSR1 mid-step", ok1 and stopped_at is not None and stopped_at < STEPS and "on a signal" in main1
                   and "tir-launch: SIGUSR1" in batch1 and "job exited with code 0" in batch1,
                   f"the batch shell trapped it and the job ended {first.get('JobState')} {first.get('ExitCode')} with "
                   f"a checkpoint at step {stopped_at} of {STEPS}"))
    checks.append(("requeue resume", ok2 and second.get("Restarts") == "1" and f"at step {stopped_at}" in main2
                   and steps == list(range(STEPS + 1)) and "job exited with code 0" in batch2,
                   f"attempt 2 (Restarts={second.get('Restarts')}) resumed at step {stopped_at} and ended "
                   f"{second.get('JobState')} {second.get('ExitCode')}; metrics steps {steps}"))
    lines = [f"slurm rehearsal: {'PASS' if ok else 'FAIL'} {name}: {detail}" for name, ok, detail in checks]
    lines.append(f"slurm rehearsal: {time.monotonic() - t0:.0f} s in all; logs in {run_dir / 'logs'}")
    with capsys.disabled():
        print("\n" + "\n".join(lines), flush=True)
    assert all(ok for _, ok, _ in checks), "\n".join(lines + ["--- batch log, attempt 1:", batch1[-2000:],
                                                               "--- trainer, attempt 1:", main1[-3000:],
                                                               "--- trainer, attempt 2:", main2[-3000:]])


def _batch_log(tmp_path: Path) -> str:
    (path,) = glob.glob(str(tmp_path / "nemo-run" / "**" / "sbatch_*.out"), recursive=True) or [None]
    return Path(path).read_text(errors="replace") if path else ""


def _agent_log(run_dir: Path, group: str, name: str) -> Path:
    """A node agent's log file (its folder is named by ``hostname -s``, which need not be the Slurm node's name)."""
    found = glob.glob(str(run_dir / "logs" / f"{group}-*" / name))
    assert len(found) == 1, f"one {group} agent log {name} expected under {run_dir / 'logs'}, found {found}"
    return Path(found[0])


def _job_hosts(tmp_path: Path) -> dict[str, str]:
    """group -> host, from the setup block's first echo line (empty until the job has started)."""
    line = next((x for x in _batch_log(tmp_path).splitlines() if x.startswith("tir-launch: trainer ")), None)
    if line is None:
        return {}
    parts = [p.strip() for p in line.removeprefix("tir-launch: ").split("|")]
    return {p.split()[0]: p.split()[1] for p in parts}
