"""Per-slot sandbox limits: the typed configuration a worker hands to each of its zygotes.

Per-request limits (wall-clock timeout, memory) travel in ``ExecRequest``; everything
else that bounds a cell lives here, with its defaults.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class SandboxLimits:
    max_processes: int = 64  # pids cgroup + RLIMIT_NPROC (per-slot uid)
    max_open_files: int = 256  # RLIMIT_NOFILE
    max_file_mb: int = 64  # RLIMIT_FSIZE: largest single file a cell may write
    tmpfs_mb: int = 64  # size of each private tmpfs (/tmp = working dir, /var/tmp, /dev/shm)
    # inodes of each private tmpfs (files, directories, links): bounds what a cell can leave
    # behind, and so the time the wipe after it takes (linear in the entries)
    tmpfs_inodes: int = 16384
    cpu_slack_s: float = 1.0  # RLIMIT_CPU = ceil(timeout) + slack (the wall clock usually fires first)
    output_head_bytes: int = 32 << 10  # per stream: kept from the start ...
    output_tail_bytes: int = 8 << 10  # ... and from the end when a stream is truncated
    output_hard_cap_bytes: int = 8 << 20  # stdout+stderr past this: the cell is killed (output_limit)
    require_full_isolation: bool = False  # refuse to start when the host cannot give a protection
    # Host paths shown read-only in the cells' root besides those the interpreter needs (--expose).
    expose: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if not 4 <= self.max_processes <= 4096:
            raise ValueError(f"max_processes={self.max_processes} outside [4, 4096]")
        if not 16 <= self.max_open_files <= 65536:
            raise ValueError(f"max_open_files={self.max_open_files} outside [16, 65536]")
        if not 1 <= self.max_file_mb <= 1 << 16:
            raise ValueError(f"max_file_mb={self.max_file_mb} outside [1, 65536]")
        if not 1 <= self.tmpfs_mb <= 1 << 16:
            raise ValueError(f"tmpfs_mb={self.tmpfs_mb} outside [1, 65536]")
        if not 64 <= self.tmpfs_inodes <= 1 << 22:
            raise ValueError(f"tmpfs_inodes={self.tmpfs_inodes} outside [64, {1 << 22}]")
        if not 0 <= self.cpu_slack_s <= 60:
            raise ValueError(f"cpu_slack_s={self.cpu_slack_s} outside [0, 60]")
        if self.output_head_bytes < 0 or self.output_tail_bytes < 0:
            raise ValueError("output_head_bytes and output_tail_bytes must be >= 0")
        for path in self.expose:
            if not isinstance(path, str) or not path.startswith("/") or path == "/":
                raise ValueError(f"expose: {path!r} is not an absolute path below /")
        if self.output_hard_cap_bytes < self.output_head_bytes + self.output_tail_bytes:
            raise ValueError(
                f"output_hard_cap_bytes={self.output_hard_cap_bytes} is smaller than head+tail "
                f"({self.output_head_bytes + self.output_tail_bytes})"
            )

    def to_json(self) -> str:
        """The fields that differ from their defaults (``from_json`` fills in the rest)."""
        default = SandboxLimits()
        return json.dumps({f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                           if getattr(self, f.name) != getattr(default, f.name)})

    @classmethod
    def from_json(cls, text: str) -> SandboxLimits:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"limits are not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError("limits must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown limit(s): {', '.join(unknown)}")
        return cls(**data)
