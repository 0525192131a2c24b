"""Are the carried wheels complete? Each carried wheel's own requirements, as they apply on the device
(CPython 3.12 on x86_64 Linux, no extras), must be carried too or preinstalled on the device: the device
installs the carry with ``--no-deps --no-index``, so a missing one shows only as an ImportError there.

    python tests/gpu/carry_requirements.py CARRY_WHEELS_DIR NAME_ON_THE_DEVICE...
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

DEVICE_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
              "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}


def wheel_requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    return [Requirement(line.split(":", 1)[1].strip()) for line in lines if line.startswith("Requires-Dist:")]


def missing_requirements(wheels_dir: Path, on_device: list[str]) -> list[str]:
    """``"<wheel> needs <requirement>"`` for each requirement neither carried nor on the device."""
    wheels = sorted(Path(wheels_dir).glob("*.whl"))
    if not wheels:
        raise ValueError(f"no wheels in {wheels_dir}")
    have = {canonicalize_name(parse_wheel_filename(w.name)[0]) for w in wheels}
    have |= {canonicalize_name(n) for n in on_device}
    return [f"{w.name} needs {req}" for w in wheels for req in wheel_requirements(w)
            if (req.marker is None or req.marker.evaluate(DEVICE_ENV)) and canonicalize_name(req.name) not in have]


def main(argv: list[str]) -> int:
    missing = missing_requirements(Path(argv[0]), argv[1:])
    if missing:
        print("not carried and not on the device:\n  " + "\n  ".join(missing), file=sys.stderr)
        return 1
    print(f"{len(list(Path(argv[0]).glob('*.whl')))} wheels; every requirement carried or on the device")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
