"""The cluster's shape, rehearsed on this CPU (``make rehearsal``; docs/rehearsal.md).

What runs, each as its own process, the way a Slurm job runs them:

* a sandbox cluster (``sandbox-cluster serve``: broker + worker, ZeroMQ over TCP);
* two SGLang-protocol servers: the 0.5.23 stand-in of the tests
  (``tests/megatron_tir/rollout/engines/fake_sglang.py``: a LocalEngine behind SGLang's HTTP API,
  joining weight-update groups with SGLang's own code), each answering a ``/generate`` only after
  ``--delay-s`` (a large model's latency: it makes the held-out evaluation longer than the watchdog);
* the real trainer, ``torchrun`` with two ranks at PP 2, under the node agent
  (``megatron_tir.launch.agent``: it passes SIGUSR1 to torchrun's workers, as in the sbatch),
  with the default process group's timeout (and megatron-core's groups') forced to ``--timeout-s``:
  any rank-0-only phase that left the other rank inside a collective would end the run.

Then, on the running job: server 1 is killed (SIGKILL) after step 2 and started again on its port
(training goes on; the restarted server must hold the current weights before it serves); SIGUSR1 is
sent in the middle of step 4 (the step ends, a checkpoint is written, exit 0); and the same
command runs again, as a requeued job would: it finds ``checkpoints/latest`` and resumes (the
sbatch's rule, ``megatron_tir.launch.slurm.trainer_argv``) to the last step.

One summary line per check (``rehearsal: PASS|FAIL <check>: <figures>``); exit 1 on any failure.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FAKE_SERVER = ROOT / "tests" / "megatron_tir" / "rollout" / "engines" / "fake_sglang.py"
KILL_AFTER, SIGNAL_IN = 2, 4  # server 1 dies after step 2's line; SIGUSR1 arrives during step 4


def _log(msg: str) -> None:
    print(f"rehearsal [{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _fake_state(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/fake_state", timeout=30) as r:
        return json.loads(r.read())


def _latest_step(run: Path) -> int | None:
    latest = run / "checkpoints" / "latest"
    if not latest.exists():
        return None
    name = os.readlink(latest) if latest.is_symlink() else latest.read_text().strip()
    return int(Path(name).name.removeprefix("step_"))


class Rehearsal:
    def __init__(self, args) -> None:
        self.args = args
        self.out = Path(args.out).resolve()
        self.run = self.out / "run"
        self.logs = self.out / "logs"
        self.checks: list[tuple[str, bool, str]] = []
        self.procs: list[subprocess.Popen] = []
        self.servers = []

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.checks.append((name, bool(ok), detail))

    # ------------------------------------------------------------------ the processes

    def start_sandbox(self) -> str:
        from megatron_tir.ports import free_port

        port = free_port()
        address = f"tcp://127.0.0.1:{port}"
        log = open(self.logs / "sandbox.log", "ab")  # noqa: SIM115 - closed with the process
        self.procs.append(subprocess.Popen([sys.executable, "-m", "sandbox_cluster.cli", "serve", "--bind", address,
                                            "--workers", "1"], stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True, env=self.env()))
        return address

    def start_servers(self) -> list[str]:
        from megatron_tir.model_sources import resolve_model
        from megatron_tir.ports import free_port
        from megatron_tir.rollout.engines.sglang import SGLangServer, SGLangServerConfig

        os.environ["FAKE_SGLANG_GENERATE_DELAY_S"] = str(self.args.delay_s)  # the servers' environment
        os.environ["OMP_NUM_THREADS"] = "1"
        model = str(resolve_model("tiny-qwen2"))
        for i in range(2):
            self.servers.append(SGLangServer(SGLangServerConfig(
                model_path=model, port=free_port(), random_seed=i, launcher=(sys.executable, str(FAKE_SERVER)),
                log_file=str(self.logs / f"server{i}.log"))).start())
        for s in self.servers:
            s.wait_healthy(timeout_s=300, poll_s=0.5)
        return [s.url for s in self.servers]

    def env(self) -> dict:
        return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

    def trainer_command(self, urls: list[str], sandbox: str) -> str:
        """The sbatch's trainer line in miniature: a new run, or the run's latest checkpoint when there is one."""
        a = self.args
        run = shlex.quote(str(self.run))
        sets = [f"trainer.steps={a.steps}", "trainer.eval_every=3", "data.eval_size=2", "trainer.checkpoint.every=1",
                f"trainer.collective_timeout_s={a.timeout_s}", "trainer.progress=false", "learner.pp=2",
                "engine.kind=sglang", f"engine.urls={','.join(urls)}", f"sandbox.address={sandbox}"]
        torchrun = (f"{shlex.quote(sys.executable)} -m megatron_tir.launch.agent --log-dir {shlex.quote(str(self.logs))}"
                    f" -- {shlex.quote(sys.executable)} -m torch.distributed.run --standalone --nproc-per-node=2"
                    f" --max-restarts=0 -m megatron_tir.cli train")
        return "\n".join([
            f"source=(--recipe tiny-cpu --out {run})",
            f'if [ -e {run}/checkpoints/latest ]; then source=(--resume {run}); fi',
            f'exec {torchrun} "${{source[@]}}" ' + " ".join(f"--set {shlex.quote(s)}" for s in sets)])

    def attempt(self, n: int, command: str, on_step=None) -> tuple[int, float]:
        t0 = time.monotonic()
        with open(self.logs / f"attempt{n}.log", "wb") as log:
            p = subprocess.Popen(["bash", "-c", command], stdout=log, stderr=subprocess.STDOUT, env=self.env(),
                                 cwd=ROOT, start_new_session=True)
            self.procs.append(p)
            seen = -1
            deadline = t0 + self.args.attempt_timeout_s
            while p.poll() is None:
                if time.monotonic() > deadline:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
                    return -9, time.monotonic() - t0
                steps = [m["step"] for m in _metrics(self.run)]
                if steps and steps[-1] != seen:
                    seen = steps[-1]
                    _log(f"attempt {n}: step {seen} logged")
                    if on_step is not None:
                        on_step(seen, p)
                time.sleep(0.5)
        return p.returncode, time.monotonic() - t0

    # ------------------------------------------------------------------ the events

    def kill_and_restart_server(self) -> None:
        s = self.servers[1]
        before = _fake_state(s.url)
        self.generated_before_kill = [sum(1 for path in _fake_state(x.url)["paths"] if path == "/generate")
                                      for x in self.servers]
        os.killpg(s.process.pid, signal.SIGKILL)
        s.process.wait()
        self.killed_at, self.version_at_kill = time.monotonic(), before["weight_version"]
        _log(f"server 1 killed (weight version {before['weight_version']}); starting it again on its port")
        s.start()

    def on_step(self, step: int, proc) -> None:
        if step == KILL_AFTER and not hasattr(self, "killed_at"):
            self.kill_and_restart_server()
        if step == SIGNAL_IN - 1 and not hasattr(self, "signalled_at"):
            time.sleep(self.args.delay_s / 2)  # step SIGNAL_IN's rollouts are under way
            proc.send_signal(signal.SIGUSR1)  # bash exec'd the agent: this is the agent
            self.signalled_at = time.monotonic()
            _log(f"SIGUSR1 sent to the agent during step {SIGNAL_IN}")

    # ------------------------------------------------------------------ the run

    def main(self) -> int:
        a = self.args
        if self.out.exists():
            shutil.rmtree(self.out)
        self.logs.mkdir(parents=True)
        t0 = time.monotonic()
        try:
            sandbox = self.start_sandbox()
            urls = self.start_servers()
            _log(f"sandbox {sandbox}; servers {', '.join(urls)} (each /generate waits {a.delay_s:g} s); "
                 f"watchdog {a.timeout_s:g} s")
            command = self.trainer_command(urls, sandbox)
            rc1, t1 = self.attempt(1, command, self.on_step)
            stopped_at = _latest_step(self.run)
            _log(f"attempt 1 exited {rc1} after {t1:.0f} s; latest checkpoint: step {stopped_at}")
            rc2, t2 = self.attempt(2, command) if rc1 == 0 else (None, 0.0)
            _log(f"attempt 2 (requeue) exited {rc2} after {t2:.0f} s")
            self.judge(rc1, rc2, stopped_at)
        finally:
            self.stop_all()
        for name, ok, detail in self.checks:
            print(f"rehearsal: {'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
        failed = [name for name, ok, _ in self.checks if not ok]
        print(f"rehearsal: {'FAILED (' + ', '.join(failed) + ')' if failed else 'passed'} in "
              f"{time.monotonic() - t0:.0f} s; logs in {self.logs}", flush=True)
        return 1 if failed or not self.checks else 0

    def judge(self, rc1, rc2, stopped_at) -> None:
        a = self.args
        rows = _metrics(self.run)
        steps = [r["step"] for r in rows]
        evals = {r["step"]: r["time/eval"] for r in rows if "time/eval" in r}
        main1 = (self.logs / "attempt1.log").read_text(errors="replace")
        main2 = (self.logs / "attempt2.log").read_text(errors="replace") if rc2 is not None else ""
        self.check("rank-0 phases under the watchdog", rc1 == 0 and rc2 == 0 and evals
                   and min(evals.values()) > a.timeout_s,
                   f"held-out evaluations at steps {sorted(evals)} took {', '.join(f'{v:.1f}' for v in evals.values())}"
                   f" s against a {a.timeout_s:g} s process-group timeout; exits {rc1}, {rc2}")
        generated = getattr(self, "generated_before_kill", [0, 0])
        self.check("two servers", all(g > 0 for g in generated),
                   f"/generate requests served before the kill: {generated}")
        restarted = _fake_state(self.servers[1].url) if self.servers[1].process.poll() is None else None
        served_after = sum(1 for p in (restarted or {}).get("paths", []) if p == "/generate")
        versions = [_fake_state(s.url)["weight_version"] for s in self.servers if s.process.poll() is None]
        rejoined = "rejoined with the current weights" in main1 + main2  # the pool's word: no work before it
        self.check("server restart", hasattr(self, "killed_at") and restarted is not None and served_after > 0
                   and rejoined and len(set(versions)) == 1 and KILL_AFTER + 1 in steps,
                   f"killed after step {KILL_AFTER} at weight version {getattr(self, 'version_at_kill', '?')}; "
                   f"the new process served {served_after} /generate; servers end at weight versions {versions}")
        self.check("SIGUSR1 mid-step", rc1 == 0 and stopped_at is not None and stopped_at < a.steps
                   and "on a signal" in main1,
                   f"attempt 1 exited {rc1} with a checkpoint at step {stopped_at} of {a.steps}")
        contiguous = steps == list(range(0, a.steps + 1))
        self.check("requeue resume", rc2 == 0 and contiguous and f"at step {stopped_at}" in main2,
                   f"attempt 2 resumed at step {stopped_at} and exited {rc2}; metrics steps {steps}")

    def stop_all(self) -> None:
        for s in self.servers:
            try:
                s.stop(grace_s=10)
            except Exception as exc:  # noqa: BLE001 - stopping what is left
                _log(f"stopping a server: {exc}")
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                    p.wait(20)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    os.killpg(p.pid, signal.SIGKILL)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "runs" / "rehearsal"))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--timeout-s", type=float, default=10.0, help="the process groups' timeout (default and megatron-core's)")
    p.add_argument("--delay-s", type=float, default=15.0, help="each server's latency per /generate")
    p.add_argument("--attempt-timeout-s", type=float, default=900.0)
    sys.path.insert(0, str(ROOT))
    return Rehearsal(p.parse_args()).main()


if __name__ == "__main__":
    sys.exit(main())
