"""Sandbox cluster: fast, isolated execution of model-written Python over ZeroMQ.

    from sandbox_cluster import LocalCluster, SandboxClient
    with LocalCluster(workers=2) as cluster, SandboxClient(cluster.address) as client:
        result = client.run("import sympy; print(sympy.solve('x**2-4'))", timeout=5)
        result.status, result.stdout          # Status.OK, '[-2, 2]\\n'

Clients talk to a broker (ROUTER); workers (ROUTER on a second endpoint) announce idle
slots; each slot is a warm zygote (numpy and sympy imported *and exercised*) that forks one
isolated child per request. Every accepted request gets exactly one ``ExecResult``.

Threat model
------------
The code is untrusted but not targeted at kernel bugs: model-written Python that may be
buggy, runaway or (accidentally or deliberately) hostile through ordinary syscalls.

Protected, per cell (each layer is probed when a zygote starts; a layer the host cannot
give is logged as MISSING at start and listed in every STATUS reply, never skipped
silently; ``require_full_isolation=True`` refuses to start instead):

- network: the zygote lives in its own empty network namespace (loopback down), and
  seccomp makes ``socket()`` fail with EPERM, so no inet, netlink or unix sockets at all
  (``socketpair`` and pipes still work inside the cell);
- other processes: each zygote is pid 1 of its own pid namespace with its own /proc, so a
  cell sees and can reach only its zygote and its own processes; the cell runs as an
  unprivileged uid reserved for its slot (flock leases, unique per host), so it cannot
  signal or ptrace its zygote either; seccomp also denies ptrace,
  process_vm_*, mount, unshare/setns/namespace clones, bpf, perf, keyctl, io_uring, module
  and reboot calls; the cell is killed if its zygote dies (PDEATHSIG);
- secrets in the environment: zygotes are exec'd with a minimal environment, so neither
  ``os.environ``, the zygote's memory (which every cell inherits) nor ``/proc/*/environ``
  hold the worker's variables;
- inherited file descriptors: everything but stdin/stdout/stderr is closed;
- resources: wall-clock timeout (``timeout``), RLIMIT_CPU, memory (cgroup memory limit +
  RLIMIT_AS above the zygote's own size: ``memory``), processes (pids cgroup + RLIMIT_NPROC:
  fork bombs), file size (RLIMIT_FSIZE), open files, no core dumps;
- the host's files: a cell runs in a root built for its slot (``rootfs``): a tmpfs holding
  read-only binds of an allowlist computed at start from the interpreter (its prefixes,
  ``sys.path``, the directories of the shared libraries it has mapped once numpy and sympy
  are imported, its ELF loader, the system library dirs and the cell's ``PATH``, plus
  ``--expose PATH``), a minimal /etc (generated passwd, group, hosts, nsswitch.conf and the
  loader cache), a minimal /dev (null, zero, full, random, urandom), a /proc of its own pid
  namespace, and nothing else: no home directories, no project checkout (hidden even where
  an exposed directory holds it), no data, runs or checkpoints, whatever their mode (the
  exposed trees are live views: what is added to them later shows too). The host's root is
  detached (``pivot_root``).
  The allowlist is logged once by each worker and shown by ``sandbox-cluster status``;
- other requests: no cell can read anything of an earlier request (its code, stdin,
  files, output or result), of its own client or of another, in any memory it can reach.
  The zygote, whose memory every cell inherits at fork, never holds what a request
  carries: the worker writes the request into a memfd, which the zygote passes on unread
  to the cell (SCM_RIGHTS); the zygote reads the cell's output into buffers of their own
  (anonymous mappings marked MADV_DONTFORK, so no cell forked meanwhile inherits them),
  sends them to the worker straight from there and unmaps them; the worker, which no cell
  can reach, names the outcome and builds the ``ExecResult``. The page a cell shares with
  its zygote (its end-of-run report) is cleared before every request, pipes are per cell,
  the scratch dirs are wiped (below). Tested by cells scanning their whole memory
  (``/proc/self/mem``), ``/proc``, their fds and the scratch dirs for markers planted by
  earlier requests of two clients;
- disk: /tmp (the working dir), /var/tmp and /dev/shm are private tmpfs mounts of the
  slot, limited in size (``tmpfs_mb``) and in inodes (``tmpfs_inodes``), wiped after every
  request (their pages count against the cell's memory limit); the wipe removes any tree a
  cell can build (any depth, special files, any modes) in bounded time: a tmpfs left with
  more than a few hundred inodes is replaced by a fresh mount (constant time), fewer are
  removed entry by entry (no recursion, constant memory); every other mount of the cells'
  root but /proc is read-only;
- host facts: ``/proc/cmdline`` is empty (a read-only empty file bound over it); the
  zygote's command line, which every cell inherits as its own, holds no host pid;
- IPC: the zygote has its own IPC namespace where SysV message queues, semaphores, shared
  memory and POSIX message queues are disabled (nothing a cell could leave behind);
- output: head and tail of stdout/stderr are kept (``*_truncated`` flags); past a hard cap
  the cell is killed (``output_limit``);
- leftovers: after each request every process of the cell's tree is killed through the
  slot's cgroup (or, without cgroups, by its uid), including ``setsid`` orphans; the zygote
  is a child subreaper and reaps them. This happens before the answer, or, for a cell that
  reported its own end and closed its output, right after it: always before the slot's
  next request starts;
- the infrastructure: a request whose worker or zygote dies is retried once on another slot,
  then answered ``sandbox_error``; a zygote that stops answering is killed by its worker.

Not protected:

- kernel or hardware exploits (no VM, no gVisor): a kernel bug reachable through the
  allowed syscalls escapes the sandbox;
- reading what the allowlist shows: the interpreter, its installed packages (any
  installed module can be imported, ctypes included), the system's libraries and
  binaries; whatever an operator puts in those trees (or exposes) is readable by cells;
- CPU contention between cells (no CPU quota beyond RLIMIT_CPU), timing side channels;
- a cell can write to its own stdout as fast as it likes up to the hard cap;
- a cell reports its own end (exit code, CPU time) through a page of memory it shares with
  the zygote, so its code can forge that report: it can only misstate its own result (the
  whole page is cleared before each request: nothing written there reaches the next cell);
- cells of one slot run one after another under the same uid; nothing survives a
  request, but a cell can observe that the previous one ran (timing, cgroup counters), and
  the numbers its zygote handled for it (its limits, exit code and times) may be left as
  freed objects in the memory a later cell inherits;
- what ``/proc`` and the kernel still tell of the host: the cell's own mount table
  (``/proc/self/mountinfo``: the exposed host paths, which it sees anyway, with their
  device numbers, file system types and mount options), the kernel version, the CPU model
  and the host's memory, load and CPU-time figures (``/proc/cpuinfo``, ``meminfo``,
  ``stat``, ``loadavg``, ``uptime``: interpreters and numpy read them), sysctls under
  ``/proc/sys``, the hostname (no UTS namespace) and the slot's cgroup path
  (``/proc/self/cgroup``); information only;
- the zygote shares its slot's memory cgroup with the cell (cells are born there: a v1
  cgroup migration per cell costs milliseconds). Cells get ``oom_score_adj=1000`` so the
  OOM killer takes them first, but a cell can lower that back to 0 and, by unmapping its
  inherited memory while filling tmpfs, make the zygote the victim (the scratch tmpfs is
  wiped right after the cell's tree is killed, but the zygote runs in between): that
  request is then retried once and answered ``sandbox_error``, and the zygote is restarted
  (a bounded DoS);
- the interpreter and libraries of the host are whatever the worker runs, within the
  limits above.
"""

from .client import ClientConfig, SandboxClient
from .cluster import LocalCluster
from .limits import SandboxLimits
from .protocol import ExecRequest, ExecResult, Status

__all__ = ["ClientConfig", "ExecRequest", "ExecResult", "LocalCluster", "SandboxClient", "SandboxLimits", "Status"]
