"""The node agent: services restarted, main's exit ends it with main's status and log tail,
and a real sandbox worker killed under it comes back and serves again."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable


def _agent(*args: str, log_dir: Path, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen([PY, "-m", "megatron_tir.launch.agent", "--log-dir", str(log_dir), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie left for its parent to reap is dead too
        return f.read().split(")")[-1].split()[0] != "Z"


def test_a_dead_service_is_started_again_and_main_decides_the_exit(tmp_path):
    # The service writes its pid and dies after 0.3 s; main waits until three starts have
    # written theirs (or 60 s), prints, then fails with 7.
    pids_file = tmp_path / "pids"
    service = f"flaky={PY} -c \"import os,time; open('{pids_file}','a').write(f'{{os.getpid()}}\\n'); " \
              "time.sleep(0.3); raise SystemExit(3)\""
    main = [PY, "-c", f"import os,time\nend = time.time() + 60\n"
                      f"while time.time() < end and len(set(open('{pids_file}').read().split()) "
                      f"if os.path.exists('{pids_file}') else ()) < 3: time.sleep(0.1)\n"
                      "for i in range(30): print('step', i, flush=True)\n"
                      "print('Traceback: boom', flush=True); raise SystemExit(7)"]
    agent = _agent("--service", service, "--restart-delay", "0.2", "--tail", "3", "--", *main, log_dir=tmp_path / "logs")
    out, err = agent.communicate(timeout=120)
    assert agent.returncode == 7
    assert "step 29" in out and (tmp_path / "logs" / "main.exit").read_text() == "7\n"
    pids = pids_file.read_text().split()
    assert len(set(pids)) >= 3  # it died and was started again, more than once, while main ran
    assert re.search(r"flaky exited with 3 after [0-9.]+ s; starting it again", err)
    # The failure ends with main's last lines under a header.
    tail = err[err.index("failed with exit status 7"):].splitlines()
    assert tail[1:] == ["step 28", "step 29", "Traceback: boom", "=== end"]
    starts = (tmp_path / "logs" / "flaky.log").read_text().count("=== agent: start #")
    assert len(pids) <= starts <= len(pids) + 1  # the last start may be stopped before it wrote its pid


def test_main_success_stops_the_services(tmp_path):
    service = f"sleeper={PY} -c \"import os,time; open('{tmp_path}/pid','w').write(str(os.getpid())); time.sleep(600)\""
    wait_for_pid = f"import os,time\nend = time.time() + 60\nwhile not os.path.exists('{tmp_path}/pid') and time.time() < end: time.sleep(0.1)"
    agent = _agent("--service", service, "--", PY, "-c", wait_for_pid, log_dir=tmp_path / "logs")
    _, err = agent.communicate(timeout=60)
    assert agent.returncode == 0, err
    assert "failed" not in err
    assert not _alive(int((tmp_path / "pid").read_text()))


def test_main_waits_for_the_addresses_and_gives_up_after_the_timeout(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Nothing listens on the port: the agent never starts main.
    agent = _agent("--wait-tcp", f"tcp://127.0.0.1:{port}", "--wait-timeout", "1", "--",
                   PY, "-c", f"open('{tmp_path}/ran','w')", log_dir=tmp_path / "logs")
    _, err = agent.communicate(timeout=60)
    assert agent.returncode == 1 and "gave up after 1 s waiting for" in err
    assert not (tmp_path / "ran").exists()
    # A service that opens the port lets main run.
    listener = f"listen={PY} -c \"import socket,time; s=socket.socket(); s.bind(('127.0.0.1',{port})); s.listen(); " \
               "time.sleep(60)\""
    agent = _agent("--service", listener, "--wait-tcp", f"127.0.0.1:{port}", "--wait-timeout", "30", "--",
                   PY, "-c", f"open('{tmp_path}/ran','w')", log_dir=tmp_path / "logs2")
    _, err = agent.communicate(timeout=60)
    assert agent.returncode == 0, err
    assert (tmp_path / "ran").exists()


def test_bad_service_argument_is_a_usage_error(tmp_path):
    agent = _agent("--service", "no command here", log_dir=tmp_path)
    _, err = agent.communicate(timeout=30)
    assert agent.returncode == 2 and "is not NAME=COMMAND" in err.splitlines()[-1]


def _run_cell(address: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([PY, "-m", "sandbox_cluster.cli", "run", "-", "--connect", address, "--timeout", "20"],
                          input="print(6 * 7)", capture_output=True, text=True, timeout=120, env=env, check=False)


@pytest.mark.slow
def test_a_killed_sandbox_worker_rejoins_the_broker(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    broker = f"broker={PY} -m sandbox_cluster.cli broker --bind {address}"
    worker = f"worker={PY} -m sandbox_cluster.cli worker --connect tcp://127.0.0.1:{port + 1} --slots 1 --name w"
    agent = _agent("--service", broker, "--service", worker, "--restart-delay", "0.5", log_dir=tmp_path / "logs",
                   start_new_session=True)
    try:
        first = _run_cell(address)
        assert first.returncode == 0 and first.stdout.strip() == "42", first.stderr
        worker_log = (tmp_path / "logs" / "worker.log")
        pid = _worker_pid(agent)
        assert pid is not None
        os.killpg(pid, signal.SIGKILL)  # the worker and its zygotes (a service is its own process group)
        deadline = time.monotonic() + 60
        while worker_log.read_text().count("=== agent: start #") < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert worker_log.read_text().count("=== agent: start #") == 2
        again = _run_cell(address)
        assert again.returncode == 0 and again.stdout.strip() == "42", again.stderr
    finally:
        agent.send_signal(signal.SIGTERM)
        _, err = agent.communicate(timeout=60)
    assert agent.returncode == 128 + signal.SIGTERM, err
    assert "worker exited with -9" in err


def _worker_pid(agent: subprocess.Popen) -> int | None:
    """The sandbox worker's pid among the agent's children."""
    children = Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split()
    for child in children:
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        if b"worker" in cmdline and b"--slots" in cmdline:
            return int(child)
    return None


def test_a_command_that_cannot_start_is_one_error_line(tmp_path):
    agent = _agent("--service", "ghost=/no/such/sglang --port 1", "--", PY, "-c", "pass", log_dir=tmp_path)
    _, err = agent.communicate(timeout=30)
    assert agent.returncode == 127
    assert "cannot start /no/such/sglang: No such file or directory" in err and "Traceback" not in err
