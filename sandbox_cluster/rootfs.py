"""The root a cell sees: a tmpfs holding read-only binds of an allowlist, and nothing else of the host.

The allowlist (``exposed_paths``) is computed from the running interpreter: its prefixes
(``sys.prefix``, ``sys.base_prefix``, the exec prefixes), its import path (``sys.path``),
the directories of every file it has mapped (the shared libraries of the interpreter and
of the extension modules imported so far: ``/proc/self/maps``), its ELF interpreter, the
system library dirs (``/lib``, ``/lib64``, ``/usr/lib``, ``/usr/lib64``) and the cell's
``PATH`` (``/bin``, ``/usr/bin``, ``/usr/local/bin``), plus whatever the operator adds
(``--expose``). The distribution that ships this sandbox (its checkout, or its packages
and their data when installed) is never exposed: an exposed directory that holds it gets
an empty directory mounted over it.

``build_root`` (in the zygote's private mount namespace, as root) clones every exposed tree
(``open_tree``) *before* anything is mounted, so a path under ``/tmp`` (a virtual
environment in a clone under ``/tmp``) survives the private ``/tmp``; then mounts a tmpfs,
recreates the symlinks on the way to each exposed path (``/lib -> usr/lib``), moves the
clones in at their own paths, writes a minimal ``/etc`` (passwd, group, hosts,
nsswitch.conf, ld.so.cache), a minimal ``/dev`` (null, zero, full, random, urandom, the
``/proc/self/fd`` links), a ``/proc``, size-limited private ``/tmp``, ``/var/tmp`` and
``/dev/shm``, and ``pivot_root``s into it, detaching the host's root. Every mount but
``/proc`` and the scratch tmpfs is then made read-only.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import platform
import struct
import sys
from pathlib import Path

from . import isolation
from .isolation import MS_NODEV, MS_NOEXEC, MS_NOSUID, check, libc, mount

SYSTEM_DIRS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/bin", "/usr/bin", "/usr/local/bin")
DEVICES = ("null", "zero", "full", "random", "urandom")
_DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
              "stderr": "/proc/self/fd/2"}
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
_SYS_OPEN_TREE = 428
_SYS_MOVE_MOUNT = 429
_OPEN_TREE_CLONE = 1
_AT_RECURSIVE = 0x8000
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_AT_FDCWD = -100
_MNT_DETACH = 2
_OLD_ROOT = ".old-root"


# --------------------------------------------------------------------------- the allowlist


def _elf_interpreter(path: str) -> str | None:
    """The PT_INTERP of an ELF executable (e.g. /lib64/ld-linux-x86-64.so.2), None if it has none."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if head[:4] != b"\x7fELF" or head[4] != 2:  # 64-bit only
                return None
            end = "<" if head[5] == 1 else ">"
            phoff, = struct.unpack_from(end + "Q", head, 32)
            phentsize, phnum = struct.unpack_from(end + "HH", head, 54)
            for i in range(phnum):
                f.seek(phoff + i * phentsize)
                p_type, _, p_offset, _, _, p_filesz = struct.unpack(end + "IIQQQQ", f.read(40))
                if p_type == 3:  # PT_INTERP
                    f.seek(p_offset)
                    return f.read(p_filesz).rstrip(b"\0").decode()
    except (OSError, struct.error, UnicodeDecodeError):
        return None
    return None


def _mapped_dirs() -> set[str]:
    out = set()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/") and not fields[5].rstrip().endswith("(deleted)"):
                out.add(os.path.dirname(fields[5].rstrip("\n")))
    return out


def hidden_paths() -> list[str]:
    """What the cells must never see of this project: the checkout holding this package, or,
    when it is installed into site-packages, the top-level packages (with their data) of the
    distribution that ships it."""
    here = Path(__file__).resolve().parent
    parent = here.parent
    if parent.name not in ("site-packages", "dist-packages"):
        return [str(parent)]
    import importlib.metadata
    import importlib.util

    dists = importlib.metadata.packages_distributions()
    ours = set(dists.get(here.name, []))
    out = [str(here)]
    for top, names in dists.items():
        if ours & set(names) and top != here.name:
            try:
                spec = importlib.util.find_spec(top)
            except (ImportError, ValueError):
                continue
            for loc in (spec.submodule_search_locations or []) if spec else []:
                out.append(os.path.realpath(loc))
    return sorted(set(out))


def _within(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def exposed_paths(extra: list[str] | tuple[str, ...] = ()) -> tuple[list[str], list[str]]:
    """(the allowlist as host real paths, none inside another; the hidden paths inside them)."""
    candidates = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, sys.executable,
                  *(p for p in sys.path if p), *_mapped_dirs(), *SYSTEM_DIRS, *extra}
    interp = _elf_interpreter(os.path.realpath(sys.executable))
    if interp:
        candidates.add(interp)
    hidden = hidden_paths()
    real = set()
    for p in candidates:
        if not os.path.isabs(p) or not os.path.exists(p):
            continue
        r = os.path.realpath(p)
        if r == "/" or r in hidden:  # (a venv inside the checkout stays: it holds no project files)
            continue
        real.add(r)
    kept: list[str] = []
    for r in sorted(real):
        if not any(_within(r, k) for k in kept):
            kept.append(r)
    masked = [h for h in hidden if any(_within(h, k) and h != k for k in kept)]
    return kept, masked


def literal_paths(extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The paths as a process names them (with symlinks: /lib64/ld-linux..., a venv's bin/python)."""
    out = {sys.prefix, sys.executable, *SYSTEM_DIRS, *extra}
    interp = _elf_interpreter(os.path.realpath(sys.executable))
    if interp:
        out.add(interp)
    return sorted(p for p in out if os.path.isabs(p) and os.path.lexists(p))


# --------------------------------------------------------------------------- building the root


def _syscall(number: int, *args) -> int:
    return libc.syscall(ctypes.c_long(number), *args)


def _clone_tree(path: str) -> int:
    fd = _syscall(_SYS_OPEN_TREE, ctypes.c_long(_AT_FDCWD), path.encode(),
                  ctypes.c_long(_OPEN_TREE_CLONE | _AT_RECURSIVE | os.O_CLOEXEC))
    if fd < 0:
        check(-1, f"open_tree {path}")
    return fd


def _move_into(fd: int, target: str) -> None:
    check(_syscall(_SYS_MOVE_MOUNT, ctypes.c_long(fd), b"", ctypes.c_long(_AT_FDCWD), target.encode(),
                    ctypes.c_long(_MOVE_MOUNT_F_EMPTY_PATH)), f"move_mount {target}")


def _make_mount_point(root: str, path: str, is_dir: bool) -> str:
    target = root + path
    if is_dir:
        os.makedirs(target, mode=0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        if not os.path.exists(target):
            os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
    return target


def _recreate_symlinks(root: str, path: str, kept: list[str]) -> None:
    """Recreate in ``root`` each symlink on the way to ``path`` that no exposed tree already holds."""
    current = "/"
    parts = [p for p in path.split("/") if p]
    for depth, part in enumerate(parts):
        nxt = os.path.join(current, part)
        if any(_within(nxt, k) for k in kept):
            return  # the bind shows the rest as the host has it
        if os.path.islink(nxt):
            link = root + nxt
            os.makedirs(os.path.dirname(link), mode=0o755, exist_ok=True)
            if not os.path.lexists(link):
                os.symlink(os.readlink(nxt), link)
            resolved = os.path.realpath(nxt)
            _recreate_symlinks(root, resolved, kept)
            current = resolved
        else:
            current = nxt
        if depth == len(parts) - 1:
            return


def _write(path: str, text: str | bytes, mode: int = 0o644) -> None:
    data = text.encode() if isinstance(text, str) else text
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _minimal_etc(root: str, uid: int, gid: int) -> None:
    etc = root + "/etc"
    os.makedirs(etc, mode=0o755, exist_ok=True)
    _write(etc + "/passwd", f"root:x:0:0:root:/tmp:/bin/sh\nsandbox:x:{uid}:{gid}:sandbox:/tmp:/bin/sh\n"
                            "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
    _write(etc + "/group", f"root:x:0:\nsandbox:x:{gid}:\nnogroup:x:65534:\n")
    _write(etc + "/hosts", "127.0.0.1 localhost\n::1 localhost\n")
    _write(etc + "/nsswitch.conf", "passwd: files\ngroup: files\nhosts: files\n")
    try:
        with open("/etc/ld.so.cache", "rb") as f:  # where the dynamic loader finds libraries by name
            _write(etc + "/ld.so.cache", f.read())
    except OSError:
        pass


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Root:
    scratch: list[str]  # the private size-limited tmpfs mounts (/tmp, /var/tmp, /dev/shm)
    keep: list[str]  # root's directories in the scratch that lead to an exposed tree: never wiped


def build_root(exposed: list[str], masked: list[str], literal: list[str], *, uid: int, gid: int,
               scratch_mb: int, scratch_inodes: int) -> Root:
    """Build the cell's root and pivot into it (in the caller's private mount namespace, as root;
    ``uid``/``gid``: the cells' user, owner of the scratch tmpfs). Raises OSError naming the
    step that failed, leaving the caller's view of the host as it was."""
    clones = []
    try:
        for path in exposed:  # first: the tmpfs below may hide some of them (a venv under /tmp)
            clones.append((path, os.path.isdir(path), _clone_tree(path)))
        for name in DEVICES:
            if os.path.exists(f"/dev/{name}"):
                clones.append((f"/dev/{name}", False, _clone_tree(f"/dev/{name}")))
        stage = isolation.WORKDIR  # any directory will do: the new root is mounted over it, privately
        mount("tmpfs", stage, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=0755")
        try:
            root = _populate(stage, clones, exposed, masked, literal, uid=uid, gid=gid, scratch_mb=scratch_mb,
                             scratch_inodes=scratch_inodes)
            os.makedirs(f"{stage}/{_OLD_ROOT}", mode=0o700)
            _pivot_root(stage, f"{stage}/{_OLD_ROOT}")
        except BaseException:
            libc.umount2(stage.encode(), _MNT_DETACH)  # the host's view again, as it was
            raise
    finally:
        for _, _, fd in clones:
            os.close(fd)
    os.chdir("/")
    check(libc.umount2(f"/{_OLD_ROOT}".encode(), _MNT_DETACH), "umount the host's root")
    os.rmdir(f"/{_OLD_ROOT}")
    isolation.remount_read_only(keep=root.scratch, keep_trees=("/proc",))
    return root


def _populate(stage: str, clones: list[tuple[str, bool, int]], exposed: list[str], masked: list[str],
              literal: list[str], *, uid: int, gid: int, scratch_mb: int, scratch_inodes: int) -> Root:
    os.makedirs(stage + "/dev", mode=0o755)
    mount("tmpfs", stage + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755")
    # A /tmp holding an exposed tree (a venv under /tmp) is root's and sticky, like a host's
    # /tmp: a cell writes there but cannot move or remove the directories leading to the tree.
    holders = tuple(d for d in isolation.WORLD_WRITABLE_DIRS if any(_within(e, d) for e in exposed))
    scratch = isolation.mount_private_tmpfs(scratch_mb, scratch_inodes, uid, gid, stage, holders)
    keep = sorted({d + "/" + e[len(d) + 1:].split("/")[0] for d in holders for e in exposed if _within(e, d)})
    for path in literal:
        _recreate_symlinks(stage, path, exposed)
    for path in exposed:
        _recreate_symlinks(stage, os.path.dirname(path), exposed)
    for path, is_dir, fd in clones:
        _move_into(fd, _make_mount_point(stage, path, is_dir))
    for path in masked:  # this project inside an exposed tree: an empty directory over it
        mount("tmpfs", stage + path, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=0755")
    for name, target in _DEV_LINKS.items():
        os.symlink(target, f"{stage}/dev/{name}")
    _minimal_etc(stage, uid, gid)
    os.makedirs(stage + "/proc", mode=0o555)
    mount_proc(stage + "/proc", scratch_file=stage + "/etc/.empty")
    return Root(scratch=scratch, keep=keep)


_HIDDEN_PROC_FILES = ("cmdline",)  # host facts no interpreter needs: shown empty


def mount_proc(target: str, scratch_file: str) -> None:
    """A /proc of the caller's pid namespace at ``target``, with an empty kernel command line:
    an empty root-owned file (made at ``scratch_file`` and removed once bound) read-only over
    ``/proc/cmdline``."""
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    mount("proc", target, "proc", flags)
    _write(scratch_file, b"", 0o444)
    try:
        for name in _HIDDEN_PROC_FILES:
            mount(scratch_file, f"{target}/{name}", None, isolation.MS_BIND)
            mount("none", f"{target}/{name}", None, isolation.MS_BIND | isolation.MS_REMOUNT | isolation.MS_RDONLY | flags)
    finally:
        os.unlink(scratch_file)  # (the binds keep the file)


def _pivot_root(new_root: str, put_old: str) -> None:
    number = _PIVOT_ROOT.get(platform.machine())
    if number is None:
        raise OSError(f"pivot_root: unknown syscall number on {platform.machine()}")
    check(_syscall(number, new_root.encode(), put_old.encode()), "pivot_root")
