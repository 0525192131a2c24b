"""Checksums of a checkpoint's files: written with it, verified before it is loaded.

``manifest.json`` at the top of a checkpoint lists every file below it (relative path,
size, CRC-32) except itself. A run checkpoint's step directory carries one for all of its
files (the learners' dist checkpoints included); ``tir-ckpt`` and the learner find it from a
policy checkpoint inside it (:func:`verify_checkpoint` looks in the directory and its parent).

The big files are hashed while they are written: :func:`recording` makes the in-process
dist-checkpoint writer (``dist_writer``) pass every byte of its ``*.distcp`` streams through
``zlib.crc32`` on its way to the file (no second read); the small ones (``common.pt``,
``.metadata``, JSON, RNG states) are read back once by :func:`write_manifest`. CRC-32 is a
check against damage (a flipped page, a truncated copy), not against an adversary; it runs
at ~1.6 GB/s here (blake2b 0.43, sha1 0.88).

A damaged checkpoint is one line naming the file: ``ManifestError`` (a ``ValueError``).
Verification reads every byte once (the ranks of a job can share it: ``part``); a verified
manifest is remembered for the process
(keyed by its path and mtime), so the loader and ``read_meta`` do not hash it twice.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import zlib
from pathlib import Path

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = "megatron-tir-manifest"
VERSION = 1
_CHUNK = 8 << 20

_recorded: dict[str, tuple[int, int]] | None = None  # absolute path -> (size, crc32) while recording
_verified: set[tuple[str, int]] = set()  # (manifest path, mtime_ns) verified in this process


class ManifestError(ValueError):
    """A checkpoint file is missing, truncated or damaged (the message names it)."""


@contextlib.contextmanager
def recording():
    """Within the block, streams opened by :func:`hashing_stream` record (size, crc32) by absolute path;
    yields that dict."""
    global _recorded
    previous, _recorded = _recorded, {}
    try:
        yield _recorded
    finally:
        _recorded = previous


def is_recording() -> bool:
    return _recorded is not None


class _HashingStream(io.RawIOBase):
    """A write-only file that computes the CRC-32 of what passes through it."""

    def __init__(self, path, mode: str) -> None:
        super().__init__()
        self._path = os.path.abspath(path)
        self._file = open(path, mode)
        self._crc = 0
        self._size = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        self._crc = zlib.crc32(view, self._crc)
        self._file.write(view)
        self._size += view.nbytes
        return view.nbytes

    def tell(self) -> int:
        return self._size

    def flush(self) -> None:
        if not self._file.closed:
            self._file.flush()

    def fileno(self) -> int:
        self._file.flush()
        return self._file.fileno()

    def close(self) -> None:
        if not self.closed:
            try:
                self._file.close()
            finally:
                if _recorded is not None:
                    _recorded[self._path] = (self._size, self._crc)
                super().close()


@contextlib.contextmanager
def hashing_stream(path, mode: str):
    """``open(path, mode)`` for writing, hashed on the way (a FileSystem's ``create_stream``)."""
    with _HashingStream(path, mode) as stream:
        yield stream


def file_crc32(path: Path) -> tuple[int, int]:
    crc, size = 0, 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return size, crc


def _files(root: Path) -> list[Path]:
    out = []
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            path = Path(dirpath) / name
            if path.relative_to(root).as_posix() != MANIFEST:
                out.append(path)
    return sorted(out)


def write_manifest(root: Path, recorded: dict[str, tuple[int, int]] | None = None) -> Path:
    """Write ``root/manifest.json`` for every file below ``root``: recorded (size, crc) where a file's
    size still matches what was recorded while writing it, else read and hashed now."""
    root = Path(root)
    recorded = recorded or {}
    files, reread = {}, 0
    for path in _files(root):
        size = path.stat().st_size
        got = recorded.get(os.path.abspath(path))
        if got is None or got[0] != size:
            got = file_crc32(path)
            reread += got[0]
        files[path.relative_to(root).as_posix()] = {"size": got[0], "crc32": f"{got[1]:08x}"}
    tmp = root / f".{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        json.dump({"format": FORMAT, "version": VERSION, "files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / MANIFEST)
    log.debug("manifest of %s: %d files, %d bytes read back", root, len(files), reread)
    return root / MANIFEST


def read_manifest(root: Path) -> dict | None:
    """The file table of ``root/manifest.json``; None when there is none; ManifestError when unreadable."""
    path = Path(root) / MANIFEST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}")
        files = data["files"]
        for entry in files.values():
            int(entry["size"]), int(entry["crc32"], 16)
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise ManifestError(f"checkpoint {root}: {MANIFEST} is damaged ({e})") from None
    return files


def verify(root: Path, *, under: str = "", deep: bool = True, part: tuple[int, int] = (0, 1),
           required: bool = False) -> None:
    """ManifestError naming the first file below ``root`` (or below ``root/under``) that is missing,
    has another size, or (``deep``) another checksum than the manifest records. ``part=(i, n)``: hash
    only every n-th file from the i-th (the ranks of a job share the reading; sizes are checked for
    all). A checkpoint without a manifest is refused when ``required`` (a run step whose siblings have
    one: it lost it), else (written before manifests existed, or by a converter) passes with a warning."""
    root = Path(root)
    files = read_manifest(root)
    if files is None:
        if required:
            raise ManifestError(f"checkpoint {root}: {MANIFEST} is missing (the run's other checkpoints have "
                                f"one: its files cannot be verified)")
        log.warning("checkpoint %s has no %s: its files are not verified", root, MANIFEST)
        return
    key = (str(root / MANIFEST), (root / MANIFEST).stat().st_mtime_ns)
    whole = not under and part == (0, 1)
    if deep and whole and key in _verified:
        return
    prefix = f"{under.rstrip('/')}/" if under else ""
    for index, (rel, entry) in enumerate(sorted(files.items())):
        if not rel.startswith(prefix):
            continue
        path = root / rel
        where = f"checkpoint {root}: {rel}"
        if not path.is_file():
            raise ManifestError(f"{where} is missing")
        size = path.stat().st_size
        if size != entry["size"]:
            raise ManifestError(f"{where} is truncated or damaged ({size} bytes, the manifest says {entry['size']})")
        if deep and index % part[1] == part[0]:
            _, crc = file_crc32(path)
            if crc != int(entry["crc32"], 16):
                raise ManifestError(f"{where} is damaged (CRC-32 {crc:08x}, the manifest says {entry['crc32']})")
    if deep and whole:
        _verified.add(key)


def has_manifest(root: Path) -> bool:
    return (Path(root) / MANIFEST).is_file()


def verify_checkpoint(ckpt: Path) -> None:
    """Verify a policy checkpoint against the manifest of its own directory or of the run checkpoint
    step directory that holds it (only the files below ``ckpt``). A policy checkpoint of a run step
    without a manifest is refused when another step of the run has one (it lost it); a converted
    checkpoint or a step of a run written before manifests passes with a warning."""
    from megatron_tir.policy.checkpoint.layout import STEP_PREFIX, TRAINER_STATE

    ckpt = Path(ckpt)
    step = ckpt.parent
    if has_manifest(ckpt):
        verify(ckpt)
    elif has_manifest(step):
        key = (str(step / MANIFEST), (step / MANIFEST).stat().st_mtime_ns)
        if key not in _verified:
            verify(step, under=ckpt.name)
    elif (step / TRAINER_STATE).is_file():
        siblings = any(has_manifest(p) for p in step.parent.glob(f"{STEP_PREFIX}*") if p != step)
        verify(step, required=siblings)
    else:
        verify(ckpt)
