"""One node's process supervisor: ``python -m megatron_tir.launch.agent``.

Every group of a launched run runs one agent per node (one ``srun`` task per node; on this
machine one nemo-run task). The agent

- keeps **services** alive (SGLang servers, the sandbox broker and workers): a service that
  exits is started again after a back-off (1 s, doubling up to 30 s; reset once it has run
  for a minute), so a dead SGLang server or sandbox worker comes back on the same host and
  port and rejoins: the trainer's SGLang client polls ``/health`` and takes a server back
  when it answers, a sandbox worker registers with the broker again when it connects;
- optionally waits until addresses answer (``--wait-http`` for SGLang ``/health``,
  ``--wait-tcp`` for the sandbox broker) and then runs the **main** command (torchrun and the
  trainer) once: its exit ends the agent with the same exit status, after the services are
  stopped; on a failure the last lines of its output are printed again under a header, so
  the end of the group's log says why the run stopped.

SIGUSR1 (the batch script forwards Slurm's pre-timeout signal to the trainer's ``srun``): the
agent passes it to the main command's children (torchrun's workers: the trainer ranks, which
end the step in progress, write a run checkpoint and exit 0, so torchrun and the job end
cleanly); the main command itself starts with SIGUSR1 ignored (torchrun would die of it), and
its children inherit that until the trainer installs its own handler.

Without a main command the agent runs its services until it is stopped (SIGTERM from
``srun`` when the job ends). Each service's output goes to ``<log-dir>/<name>.log``
(appended across restarts, each start marked); the main command's output goes to the
agent's stdout and ``<log-dir>/main.log``.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("megatron_tir.launch.agent")


@dataclass(kw_only=True, slots=True)
class RestartPolicy:
    first_delay_s: float = 1.0
    max_delay_s: float = 30.0
    stable_s: float = 60.0  # a run at least this long resets the back-off

    def __post_init__(self) -> None:
        if not 0 < self.first_delay_s <= self.max_delay_s:
            raise ValueError(f"need 0 < first delay <= max delay, got {self.first_delay_s}, {self.max_delay_s}")


@dataclass(kw_only=True, slots=True)
class Service:
    """A command kept running: started again after it exits."""

    name: str
    argv: list[str]
    log_path: Path
    policy: RestartPolicy
    process: subprocess.Popen | None = None
    starts: int = 0
    started_at: float = 0.0
    next_start: float = 0.0
    delay_s: float = 0.0

    def start(self) -> None:
        self.starts += 1
        with self.log_path.open("a") as out:
            out.write(f"\n=== agent: start #{self.starts} of {self.name}: {shlex.join(self.argv)}\n")
            out.flush()
            self.process = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        self.started_at = time.monotonic()
        log.info("%s started (pid %d, start #%d)", self.name, self.process.pid, self.starts)

    def tend(self) -> None:
        """Start it again if it has exited and its back-off has passed."""
        now = time.monotonic()
        if self.process is not None:
            code = self.process.poll()
            if code is None:
                return
            ran = now - self.started_at
            self.delay_s = (self.policy.first_delay_s if ran >= self.policy.stable_s or not self.delay_s
                            else min(self.delay_s * 2, self.policy.max_delay_s))
            self.next_start = now + self.delay_s
            self.process = None
            log.warning("%s exited with %s after %.1f s; starting it again in %.1f s (log: %s)",
                        self.name, code, ran, self.delay_s, self.log_path)
        if now >= self.next_start:
            self.start()

    def stop(self, grace_s: float) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        _kill_group(self.process, signal.SIGTERM)
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            _kill_group(self.process, signal.SIGKILL)
            self.process.wait()


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path("/proc", entry, "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
        if int(fields[1]) == pid:
            out.append(int(entry))
    return sorted(out)


def _kill_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def parse_service(text: str) -> tuple[str, list[str]]:
    """``NAME=COMMAND`` -> (name, argv)."""
    name, sep, command = text.partition("=")
    name = name.strip()
    if not sep or not name or not name.replace("-", "_").replace(".", "_").isidentifier():
        raise ValueError(f"--service {text!r} is not NAME=COMMAND")
    argv = shlex.split(command)
    if not argv:
        raise ValueError(f"--service {name}: empty command")
    return name, argv


def _answers_http(url: str) -> bool:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=5) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _answers_tcp(address: str) -> bool:
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=5):
            return True
    except (OSError, ValueError):
        return False


@dataclass(kw_only=True, slots=True)
class Agent:
    services: list[Service]
    wait_http: list[str] = field(default_factory=list)
    wait_tcp: list[str] = field(default_factory=list)
    wait_timeout_s: float = 1800.0
    tail_lines: int = 60
    log_dir: Path = Path(".")
    grace_s: float = 20.0
    poll_s: float = 0.5
    _stop: threading.Event = field(default_factory=threading.Event)
    _signal: int = 0
    _main: subprocess.Popen | None = None

    def forward_to_workers(self, signum: int, _frame=None) -> None:
        """Pass ``signum`` to the main command's children (torchrun's workers)."""
        main = self._main
        if main is None or main.poll() is not None:
            log.info("%s with no main command running: ignored", signal.Signals(signum).name)
            return
        children = _children(main.pid)
        log.warning("%s: passed to the main command's workers %s", signal.Signals(signum).name, children)
        for pid in children:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    def request_stop(self, signum: int, _frame=None) -> None:
        self._signal = signum
        self._stop.set()

    def _tend(self) -> None:
        for service in self.services:
            service.tend()

    def _wait_ready(self) -> bool:
        """Tend the services until every awaited address answers; False on timeout or stop."""
        pending = [("http", u) for u in self.wait_http] + [("tcp", a) for a in self.wait_tcp]
        if not pending:
            return True
        log.info("waiting for %s", ", ".join(a for _, a in pending))
        deadline = time.monotonic() + self.wait_timeout_s
        while pending:
            self._tend()
            pending = [(kind, a) for kind, a in pending
                       if not (_answers_http(a) if kind == "http" else _answers_tcp(a))]
            if not pending:
                break
            if time.monotonic() > deadline:
                log.error("gave up after %.0f s waiting for %s", self.wait_timeout_s, ", ".join(a for _, a in pending))
                return False
            if self._stop.wait(2.0):
                return False
        log.info("all awaited addresses answer")
        return True

    def run(self, main: Sequence[str] | None) -> int:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._tend()
            if not self._wait_ready():
                return self._signal_code() or 1
            if not main:
                while not self._stop.wait(self.poll_s):
                    self._tend()
                return self._signal_code()
            return self._run_main(list(main))
        except OSError as exc:  # a command that cannot be started (not installed, not executable)
            log.error("cannot start %s: %s", exc.filename or "a command", exc.strerror or exc)
            return 127
        finally:
            for service in self.services:
                service.stop(self.grace_s)

    def _signal_code(self) -> int:
        return 128 + self._signal if self._signal else 0

    def _run_main(self, argv: list[str]) -> int:
        tail: collections.deque[str] = collections.deque(maxlen=self.tail_lines)
        log.info("main: %s", shlex.join(argv))
        handler = signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # inherited through exec: torchrun ignores it
        try:
            process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, start_new_session=True, text=True, errors="replace",
                                       bufsize=1)
        finally:
            signal.signal(signal.SIGUSR1, handler)
        self._main = process
        pump = threading.Thread(target=_pump, args=(process.stdout, self.log_dir / "main.log", tail), daemon=True)
        pump.start()
        while process.poll() is None:
            if self._stop.wait(self.poll_s):
                _kill_group(process, signal.SIGTERM)
                try:
                    process.wait(self.grace_s)
                except subprocess.TimeoutExpired:
                    _kill_group(process, signal.SIGKILL)
                break
            self._tend()
        code = process.wait()
        pump.join(10)
        code = 128 - code if code < 0 else code
        (self.log_dir / "main.exit").write_text(f"{code}\n")
        if code != 0 and not self._signal:
            header = f"=== {argv[0]} failed with exit status {code} on {socket.gethostname()}; its last lines:"
            sys.stderr.write("\n".join([header, *tail, "=== end"]) + "\n")
            sys.stderr.flush()
        return self._signal_code() or code


def _pump(stream, log_path: Path, tail: collections.deque[str]) -> None:
    with log_path.open("a") as out:
        for line in stream:
            sys.stdout.write(line)
            sys.stdout.flush()
            out.write(line)
            out.flush()
            tail.append(line.rstrip("\n"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_tir.launch.agent", description=__doc__.split("\n")[0],
                                usage="%(prog)s [options] [-- MAIN COMMAND ...]")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-dir", default=".", help="services' and main's log files go here")
    p.add_argument("--service", action="append", default=[], metavar="NAME=COMMAND",
                   help="a command kept running (repeatable)")
    p.add_argument("--wait-http", action="append", default=[], metavar="URL[,URL...]",
                   help="before main: wait until URL/health answers 200")
    p.add_argument("--wait-tcp", action="append", default=[], metavar="[tcp://]HOST:PORT[,...]",
                   help="before main: wait until HOST:PORT accepts connections")
    p.add_argument("--wait-timeout", type=float, default=1800.0, help="seconds; then the agent fails")
    p.add_argument("--tail", type=int, default=60, help="main's last lines printed again when it fails")
    p.add_argument("--restart-delay", type=float, default=1.0, help="first back-off before a restart, seconds")
    p.add_argument("--max-restart-delay", type=float, default=30.0)
    p.add_argument("--stable-after", type=float, default=60.0, help="a run this long resets the back-off")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    main_cmd: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, main_cmd = argv[:cut], argv[cut + 1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s agent@{socket.gethostname()} %(levelname)s %(message)s")
    try:
        policy = RestartPolicy(first_delay_s=args.restart_delay, max_delay_s=args.max_restart_delay,
                               stable_s=args.stable_after)
        log_dir = Path(args.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        services = []
        for text in args.service:
            name, cmd = parse_service(text)
            services.append(Service(name=name, argv=cmd, log_path=log_dir / f"{name}.log", policy=policy))
        if len({s.name for s in services}) != len(services):
            raise ValueError("--service names must be unique")
    except ValueError as exc:
        parser.error(str(exc))
    split = lambda items: [x.strip() for item in items for x in item.split(",") if x.strip()]  # noqa: E731
    agent = Agent(services=services, wait_http=split(args.wait_http), wait_tcp=split(args.wait_tcp),
                  wait_timeout_s=args.wait_timeout, tail_lines=args.tail, log_dir=log_dir)
    signal.signal(signal.SIGTERM, agent.request_stop)
    signal.signal(signal.SIGINT, agent.request_stop)
    signal.signal(signal.SIGUSR1, agent.forward_to_workers)
    return agent.run(main_cmd or None)


if __name__ == "__main__":
    sys.exit(main())
