"""Cells see only an allowlist of the host's files: no checkout, no data, no home, nothing made later."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import sandbox_cluster
from sandbox_cluster import LocalCluster, SandboxClient, Status, rootfs

CHECKOUT = Path(sandbox_cluster.__file__).resolve().parents[1]
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the cells' root needs root (mount namespace)")

_PROBE = r"""
import json, os
out = {}
for path in json.loads(PATHS):
    seen = {"exists": os.path.exists(path)}
    try:
        seen["listed"] = os.path.basename(path) in os.listdir(os.path.dirname(path))
    except OSError:
        seen["listed"] = False
    try:
        with open(path, "rb") as f:
            f.read(1)
        seen["read"] = True
    except OSError:
        seen["read"] = False
    out[path] = seen
print(json.dumps(out))
"""


def _probe(client, paths: list[str]) -> dict:
    code = f"PATHS = {json.dumps(paths)!r}\n" + _PROBE
    res = client.run(code, timeout=20)
    assert res.status is Status.OK, res
    return json.loads(res.stdout)


@needs_root
def test_a_cell_cannot_see_files_outside_the_exposed_set(client):
    fresh = Path(tempfile.mkdtemp(prefix="sandbox-outside-", dir="/"))  # made after the cluster started
    try:
        fresh.chmod(0o755)
        secret = fresh / "answers.txt"
        secret.write_text("42\n")
        secret.chmod(0o644)
        data = CHECKOUT / "megatron_tir" / "data" / "aime24.parquet"
        assert data.is_file()
        hidden = [str(secret), str(CHECKOUT / "setup.cfg"), str(data), str(Path.home() / ".bashrc"),
                  *(str(p) for p in Path("/work/shared/data").glob("*.parquet"))]
        shown = [os.path.realpath(sys.executable), "/usr/lib/os-release"]  # the probe can see
        seen = _probe(client, hidden + [p for p in shown if os.path.exists(p)])
        for path in hidden:
            assert seen[path] == {"exists": False, "listed": False, "read": False}, path
        for path in shown:
            if os.path.exists(path):
                assert seen[path] == {"exists": True, "listed": True, "read": True}, path
        # The home directory shows at most the way to an exposed tree (a Python installed there).
        home = str(Path.home())
        ways = {p[len(home) + 1:].split("/")[0] for p in client.status().workers[0].exposed if p.startswith(home + "/")}
        listing = client.run(f"import os\ntry:\n    print(sorted(os.listdir({home!r})))\nexcept OSError:\n    print([])")
        assert set(ast.literal_eval(listing.stdout)) <= ways, listing.stdout
    finally:
        shutil.rmtree(fresh)


_WALK = r"""
import json, os
allowed = json.loads(ALLOWED)
found, outside = 0, []
for top, dirs, files in os.walk("/"):
    if top == "/":
        dirs.remove("proc")  # the cell's own pid namespace
    for name in files + [d for d in dirs if os.path.islink(os.path.join(top, d))]:
        path = os.path.join(top, name)
        found += 1
        if not any(path == a or path.startswith(a.rstrip("/") + "/") for a in allowed):
            outside.append(path)
print(json.dumps({"found": found, "outside": outside[:50]}))
"""


@needs_root
def test_walking_the_root_finds_only_the_exposed_set(client):
    (worker, *_) = client.status().workers
    assert worker.exposed, "the worker reports no allowlist"
    assert not any(str(CHECKOUT).startswith(p.rstrip("/") + "/") or str(CHECKOUT) == p for p in worker.exposed)
    # the exposed set, the minimal /etc and /dev, the scratch tmpfs, and the symlinks leading to the set
    skeleton = ["/etc", "/dev", "/tmp", "/var/tmp", "/bin", "/lib", "/lib64", "/sbin"]
    code = _WALK.replace("ALLOWED", repr(json.dumps([*worker.exposed, *skeleton])))
    res = client.run(code, timeout=120)
    assert res.status is Status.OK, res
    report = json.loads(res.stdout)
    assert report["outside"] == []
    assert report["found"] > 1000  # it did walk the interpreter's trees
    etc = client.run("import os; print(sorted(os.listdir('/etc')))").stdout
    assert etc == "['group', 'hosts', 'ld.so.cache', 'nsswitch.conf', 'passwd']\n"


def test_the_allowlist_leaves_out_this_project_and_takes_extra_paths(tmp_path):
    exposed, _ = rootfs.exposed_paths([str(tmp_path)])
    assert str(tmp_path.resolve()) in exposed
    assert not any(str(CHECKOUT) == p or str(CHECKOUT).startswith(p + "/") for p in exposed)
    assert os.path.realpath(sys.base_prefix) in exposed or any(
        os.path.realpath(sys.base_prefix).startswith(p + "/") for p in exposed)
    assert str(CHECKOUT) in rootfs.hidden_paths()


# --------------------------------------------------------------------------- a project and venv under /tmp

_PACKAGES = ("numpy", "numpy.libs", "sympy", "mpmath", "msgspec", "zmq", "pyzmq.libs", "pyseccomp.py")

_SERVE = r"""
import json, sys
from sandbox_cluster import LocalCluster, SandboxClient
with LocalCluster(workers=1) as cluster, SandboxClient(cluster.address) as client:
    first = client.run("import os, numpy\nprint(numpy.__file__)\ntop = '/'.join(numpy.__file__.split('/')[:3])\n"
                       "try:\n    os.rename(top, '/tmp/moved')\nexcept OSError as exc:\n    print(type(exc).__name__)\n"
                       "open('/tmp/left', 'w').write('x')\n", timeout=60)
    second = client.run("import os, numpy\nprint(int(numpy.arange(4).sum()), sorted(os.listdir('/tmp')))", timeout=60)
    missing = cluster.status().missing_protections
print(json.dumps({"first": [first.status.value, first.stdout, first.stderr],
                  "second": [second.status.value, second.stdout, second.stderr], "missing": missing}))
"""


def _link_tree(src: Path, dst: Path) -> None:
    def link(a, b):
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    if src.is_dir():
        shutil.copytree(src, dst, copy_function=link, ignore=shutil.ignore_patterns("__pycache__", "tests"))
    else:
        link(src, dst)


@needs_root
@pytest.mark.slow
def test_a_cluster_run_from_a_venv_under_tmp_serves_numpy():
    site = Path(next(p for p in sys.path if p.endswith("site-packages") and Path(p, "numpy").is_dir()))
    top = Path(tempfile.mkdtemp(prefix="sandbox-clone-", dir="/tmp"))
    try:
        shutil.copytree(CHECKOUT / "sandbox_cluster", top / "sandbox_cluster",
                        ignore=shutil.ignore_patterns("__pycache__"))
        venv = top / ".venv"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        (new_site,) = venv.glob("lib/python*/site-packages")
        for name in _PACKAGES:
            if (site / name).exists():
                _link_tree(site / name, new_site / name)
        out = subprocess.run([str(venv / "bin" / "python"), "-c", _SERVE], cwd=top, capture_output=True,
                             text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(top)), check=False)
        assert out.returncode == 0, out.stderr[-3000:]
        report = json.loads(out.stdout.splitlines()[-1])
        status, stdout, stderr = report["first"]
        assert status == "ok", stderr
        assert stdout.splitlines() == [f"{new_site}/numpy/__init__.py", "PermissionError"]
        assert report["second"][:2] == ["ok", f"6 ['{top.name}']\n"]  # the tree is still there; the rest wiped
        assert "filesystem_allowlist" not in str(report["missing"])
    finally:
        shutil.rmtree(top)


@needs_root
@pytest.mark.slow
def test_an_exposed_path_is_shown_read_only(tmp_path_factory):
    extra = Path(tempfile.mkdtemp(prefix="sandbox-exposed-", dir="/"))
    try:
        extra.chmod(0o755)
        (extra / "table.txt").write_text("7\n")
        with LocalCluster(workers=1, expose=[str(extra)]) as cluster, SandboxClient(cluster.address) as client:
            assert str(extra) in client.status().workers[0].exposed
            res = client.run(f"import os\nprint(open({str(extra / 'table.txt')!r}).read().strip())\n"
                             f"try:\n    open({str(extra / 'new')!r}, 'w')\nexcept OSError as exc:\n"
                             "    print(exc.strerror)\n")
        assert (res.status, res.stdout) == (Status.OK, "7\nRead-only file system\n")
    finally:
        shutil.rmtree(extra)
