"""Request isolation: no cell can read anything of an earlier request, of its own client or of another.

Planting requests from two client connections leave unique markers in everything a request
carries (code, stdin, an input file, stdout, stderr, files written to the scratch dirs,
large and small), all on one slot; then cells on that slot scan everything they can read
(their whole memory through ``/proc/self/mem``, opened after making themselves dumpable, which holds what they inherited from the
zygote and what they share with it; ``/proc`` of every visible process, their fds, the
scratch dirs and the cwd) for any marker. A marker is ``ZQXJ`` + 16 hex digits + ``JXQZ``;
a scanner searches for the pattern, so its own code holds no marker.
"""

from __future__ import annotations

import secrets

from sandbox_cluster import SandboxClient, Status

_SCANNER = r'''
import ctypes, os, re
ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE (the uid switch cleared it): /proc/self/mem opens
pattern = re.compile(rb"ZQXJ[0-9a-f]{16}JXQZ")
found = {}

def scan(where, data):
    for m in pattern.finditer(data):
        found.setdefault(m.group().decode(), where)

mem = os.open("/proc/self/mem", os.O_RDONLY)
regions = 0
for line in open("/proc/self/maps").read().splitlines():
    fields = line.split(maxsplit=5)
    if not fields[1].startswith("r"):
        continue
    lo, hi = (int(x, 16) for x in fields[0].split("-"))
    name = fields[5] if len(fields) > 5 else "anonymous"
    offset = lo
    while offset < hi:
        size = min(hi - offset, 8 << 20)
        try:
            chunk = os.pread(mem, size + 32, offset) if offset + size < hi else os.pread(mem, size, offset)
        except OSError:  # [vvar] and the like
            break
        scan(f"memory {name}", chunk)
        del chunk
        offset += size
    regions += 1
os.close(mem)

def read(path):
    try:
        with open(path, "rb") as f:
            return f.read(64 << 20)
    except OSError:
        return b""

for pid in [p for p in os.listdir("/proc") if p.isdigit()] + ["self", "thread-self"]:
    for leaf in ("cmdline", "environ", "stat", "status", "comm", "maps", "mountinfo", "cgroup"):
        scan(f"/proc/{pid}/{leaf}", read(f"/proc/{pid}/{leaf}"))
for fd in os.listdir("/proc/self/fd"):
    scan(f"fd {fd}", read(f"/proc/self/fd/{fd}"))
files = 0
for top in {"/tmp", "/var/tmp", "/dev/shm", os.getcwd()}:
    for root, dirs, names in os.walk(top):
        for n in names:
            scan(os.path.join(root, n), read(os.path.join(root, n)))
            files += 1
print(regions > 10, sorted(found.items()))
'''


def _marker() -> str:
    return f"ZQXJ{secrets.token_hex(8)}JXQZ"


def _plant(client: SandboxClient, big: bool) -> list[str]:
    """One request carrying a distinct marker in each of its parts; the markers it planted."""
    code_m, stdin_m, file_m, out_m, err_m, disk_m = (_marker() for _ in range(6))
    pad = 40_000 if big else 1  # large objects live in malloc's heap, small ones in pymalloc's arenas
    # The output markers are built at run time (reversed in the code): the code does not hold them.
    code = (f"# {code_m}\n" + ("# filler\n" * (pad // 10)) +
            "import sys\n"
            "data = sys.stdin.read()\n"
            "assert data.count('ZQXJ') >= 1\n"
            "assert open('input.txt').read().startswith('ZQXJ')\n"
            f"print(({out_m[::-1]!r})[::-1] * {pad})\n"
            f"print(({err_m[::-1]!r})[::-1] * {pad}, file=sys.stderr)\n"
            f"open('/tmp/left.txt', 'w').write(({disk_m[::-1]!r})[::-1])\n"
            f"open('/dev/shm/left.txt', 'w').write(({disk_m[::-1]!r})[::-1])\n")
    res = client.run(code, stdin=(stdin_m + "\n") * pad, files={"input.txt": (file_m * pad).encode()}, timeout=20)
    assert res.status is Status.OK, res
    assert out_m in res.stdout and err_m in res.stderr  # it really printed them
    return [code_m, stdin_m, file_m, out_m, err_m, disk_m]


def test_no_cell_reads_an_earlier_request_of_any_client(one_slot):
    with SandboxClient(one_slot.address) as alice, SandboxClient(one_slot.address) as bob:
        planted = []
        for big in (False, True, False):
            planted += _plant(alice, big)
            planted += _plant(bob, big)
        for scanner in (alice, bob):  # the first right after the planters, the second after it
            # ~10 s alone; reading every mapping of the cell (file-backed ones from the disk when the page
            # cache was evicted, as at the end of a full CI run: 60 s ran out there with 3.9 s of CPU) can take
            # much longer: the limit is about isolation, not speed (two scans stay under pytest's 600 s)
            res = scanner.run(_SCANNER, timeout=240, memory_mb=2048)
            assert res.status is Status.OK, res
            assert res.stdout.startswith("True "), res.stdout  # it did read its memory map
            leaked = res.stdout[len("True "):].strip()
            assert leaked == "[]", f"a cell read markers of earlier requests: {leaked[:2000]}"
    assert len(set(planted)) == 36
