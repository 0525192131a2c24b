"""tune_malloc against the process's resident size: with glibc's dynamic mmap threshold a freed
block that sits below a live one stays resident; with the threshold fixed it goes back to the
system. Each case runs in a fresh interpreter (malloc's state is per process)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap

import pytest
from megatron_tir import malloc
from megatron_tir.malloc import tune_malloc

# In a fresh process: free one 24 MiB block (with the dynamic threshold, that raises it to 24 MiB),
# then take a 16 MiB block and touch it, pin the heap top with a small block, free the 16 MiB one.
# Prints whether tune_malloc took and the resident size (KiB) with the block, and after its free.
PROBE = textwrap.dedent("""
    import ctypes, json, sys
    from megatron_tir.malloc import tune_malloc

    def rss_kib():
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))

    tuned = tune_malloc() if sys.argv[1] == "tune" else None
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.free(libc.malloc(24 << 20))
    block = libc.malloc(16 << 20)
    ctypes.memset(block, 1, 16 << 20)
    pin = libc.malloc(64)
    held = rss_kib()
    libc.free(block)
    print(json.dumps({"tuned": tuned, "held": held, "after": rss_kib()}))
    libc.free(pin)
""")

glibc_only = pytest.mark.skipif(malloc._glibc_mallopt() is None, reason="malloc is not glibc's")


def probe(mode: str, env_extra: dict[str, str] | None = None) -> dict:
    import os

    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_" and k != "GLIBC_TUNABLES"}
    env.update(env_extra or {})
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout)


@glibc_only
def test_a_freed_block_below_a_live_one_goes_back_once_tuned():
    untuned = probe("plain")
    assert untuned["held"] - untuned["after"] < 4 << 10, \
        f"glibc's dynamic threshold no longer keeps a freed 16 MiB heap block: {untuned}"
    tuned = probe("tune")
    assert tuned["tuned"] is True
    assert tuned["held"] - tuned["after"] >= 15 << 10, f"the freed 16 MiB stayed resident: {tuned}"


@glibc_only
def test_a_threshold_from_the_environment_is_left_alone():
    assert probe("tune", {"MALLOC_MMAP_THRESHOLD_": "131072"})["tuned"] is False
    assert probe("tune", {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"})["tuned"] is False


def test_no_glibc_is_a_no_op(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setattr(malloc.sys, "platform", "darwin")
    assert tune_malloc() is False

    class NoGlibc:  # a libc with mallopt (musl's stub) but none of glibc's own symbols
        mallopt = staticmethod(lambda option, value: pytest.fail("mallopt called without glibc"))

    monkeypatch.setattr(malloc.sys, "platform", "linux")
    monkeypatch.setattr(malloc.ctypes, "CDLL", lambda name: NoGlibc())
    assert tune_malloc() is False


def test_the_train_command_tunes_malloc_before_it_prepares_the_run(monkeypatch):
    from megatron_tir.train import cli

    calls = []
    monkeypatch.setattr(malloc, "tune_malloc", lambda: calls.append("tune_malloc"))

    def prepare(args):
        calls.append("prepare")
        raise ValueError("stop here")

    monkeypatch.setattr(cli, "prepare", prepare)
    with pytest.raises(ValueError, match="stop here"):
        cli.run_train_command(argparse.Namespace(resume=None))
    assert calls == ["tune_malloc", "prepare"]
