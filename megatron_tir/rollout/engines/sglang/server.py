"""Launch and stop SGLang server processes (``python -m sglang.launch_server ...``).

Flag names follow SGLang 0.5.x ``ServerArgs`` (``sglang/srt/arg_groups/fields``): the
CLI name of a field is ``--`` + its name in kebab case (``tp_size`` -> ``--tp-size``).
The tests check every flag built here against the installed SGLang's declared fields.

A colocated server (it shares its GPUs with trainer ranks and gives its memory back during
training) runs with ``--enable-memory-saver``: without it ``/release_memory_occupation``
frees nothing. ``health_generation_probe=False`` launches with
``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0`` (``srt/environ.py``): ``/health`` then
answers 200 at once instead of running a one-token generation (which sleeps ~1 s and
waits while generation is paused).

MoE (0.5.23, ``srt/arg_groups/fields/parallel.py:281`` ``ep_size``, ``exec_.py:158``
``enable_return_routed_experts``): ``ep_size`` splits the experts over that many of the server's
TP ranks (``moe_tp_size = tp_size // ep_size``, ``srt/runtime_context.py:154``
``derive_parallel_widths``; so it divides ``tp_size``); ``enable_return_routed_experts`` lets a
``/generate`` request ask for each token's routed experts (``return_routed_experts``; without the
flag the server has no capturer and answers without them, ``state_capturer/routed_experts.py:50``).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")


@dataclass(kw_only=True, slots=True)
class SGLangServerConfig:
    """One SGLang server: model, placement, memory; ``argv()`` is its command line."""

    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    tp_size: int = 1
    base_gpu_id: int = 0  # first GPU of this server on its node
    mem_fraction_static: float | None = 0.8  # weights + KV cache share of GPU memory
    dtype: str = "auto"
    context_length: int | None = None
    random_seed: int | None = None
    colocated: bool = False  # shares GPUs with the trainer: turns the memory saver on
    enable_memory_saver: bool | None = None  # needed by release/resume_memory_occupation; None: = colocated
    health_generation_probe: bool = True  # False: SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0
    enable_deterministic_inference: bool = False  # needed for SamplingParams.seed (sampling_seed) to take effect
    skip_server_warmup: bool = False
    ep_size: int = 1  # MoE: expert parallelism inside the server (--ep-size; divides tp_size)
    enable_return_routed_experts: bool = False  # MoE: /generate may return each token's routed experts
    log_level: str = "info"
    extra_args: tuple[str, ...] = ()  # passed through verbatim
    launcher: tuple[str, ...] = (sys.executable, "-m", "sglang.launch_server")
    log_file: str | None = None  # server stdout+stderr; None: inherit

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("model_path is empty")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.ep_size < 1 or self.tp_size % self.ep_size:
            raise ValueError(f"ep_size must divide tp_size={self.tp_size} (SGLang carves expert parallelism out of "
                             f"the server's TP ranks), got {self.ep_size}")
        if self.base_gpu_id < 0:
            raise ValueError(f"base_gpu_id must be >= 0, got {self.base_gpu_id}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.context_length is not None and self.context_length < 1:
            raise ValueError(f"context_length must be >= 1, got {self.context_length}")
        if not self.launcher:
            raise ValueError("launcher is empty")
        if self.colocated and self.enable_memory_saver is False:
            raise ValueError("a colocated server needs enable_memory_saver (release would free nothing)")
        if self.enable_memory_saver is None:
            self.enable_memory_saver = self.colocated

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"

    def argv(self) -> list[str]:
        args = [*self.launcher, "--model-path", str(self.model_path), "--host", self.host, "--port", str(self.port),
                "--tp-size", str(self.tp_size), "--base-gpu-id", str(self.base_gpu_id), "--dtype", self.dtype,
                "--log-level", self.log_level]
        if self.mem_fraction_static is not None:
            args += ["--mem-fraction-static", str(self.mem_fraction_static)]
        if self.context_length is not None:
            args += ["--context-length", str(self.context_length)]
        if self.random_seed is not None:
            args += ["--random-seed", str(self.random_seed)]
        if self.enable_memory_saver:
            args.append("--enable-memory-saver")
        if self.enable_deterministic_inference:
            args.append("--enable-deterministic-inference")
        if self.skip_server_warmup:
            args.append("--skip-server-warmup")
        if self.ep_size > 1:
            args += ["--ep-size", str(self.ep_size)]
        if self.enable_return_routed_experts:
            args.append("--enable-return-routed-experts")
        return args + list(self.extra_args)

    def env(self) -> dict[str, str]:
        """The server's environment: this process's, plus the health-probe switch."""
        env = dict(os.environ)
        if not self.health_generation_probe:
            env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] = "0"
        return env


class SGLangServer:
    """A server process: ``start()``, ``wait_healthy()``, ``stop()`` (also a context manager)."""

    def __init__(self, config: SGLangServerConfig) -> None:
        self.config = config
        self.process: subprocess.Popen | None = None
        self._log = None

    @property
    def url(self) -> str:
        return self.config.url

    def start(self) -> SGLangServer:
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError(f"SGLang server on port {self.config.port} is already running")
        argv = self.config.argv()
        log.info("starting SGLang: %s", " ".join(argv))
        out = None
        if self.config.log_file:
            Path(self.config.log_file).parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.config.log_file, "ab")  # noqa: SIM115 - closed in stop()
            out = self._log
        # Own session: stop() signals the server and every worker process it spawned.
        self.process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT if out else None,
                                        env=self.config.env(), start_new_session=True)
        return self

    def wait_healthy(self, timeout_s: float = 900.0, poll_s: float = 1.0, probe_timeout_s: float = 30.0) -> None:
        """Poll ``GET /health`` until 200; RuntimeError if the process exits or time runs out.

        One probe may take ``probe_timeout_s``: SGLang's ``/health`` sleeps ~1 s before it
        answers (up to 20 s, ``SGLANG_HEALTH_CHECK_TIMEOUT``, when the server is stuck).
        """
        if self.process is None:
            raise RuntimeError("start() the server first")
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise RuntimeError(f"SGLang server exited with code {code} before it was healthy{self._log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=probe_timeout_s) as response:
                    if response.status == 200:
                        log.info("SGLang server %s is healthy", self.url)
                        return
                    last = f"/health answered {response.status}"
            except urllib.error.HTTPError as exc:
                last = f"/health answered {exc.code}"
            except (urllib.error.URLError, OSError) as exc:
                last = repr(exc)
            time.sleep(poll_s)
        raise RuntimeError(f"SGLang server {self.url} not healthy after {timeout_s:.0f}s ({last}){self._log_tail()}")

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM the server's process group, SIGKILL after ``grace_s``; returns the exit code."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                log.warning("SGLang server %s ignored SIGTERM for %.0fs; killing it", self.url, grace_s)
                self._signal(signal.SIGKILL)
                self.process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.process.returncode

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass

    def _log_tail(self, lines: int = 20) -> str:
        if not self.config.log_file or not Path(self.config.log_file).is_file():
            return ""
        tail = Path(self.config.log_file).read_text(errors="replace").splitlines()[-lines:]
        return "; log tail:\n" + "\n".join(tail)

    def __enter__(self) -> SGLangServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
