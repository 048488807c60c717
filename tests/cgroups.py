"""Per-process memory caps made with the cgroup v1 memory controller, for tests that show a model not fitting.

    with MemoryCaps(4, 1200 * 2**20) as caps:    # four groups under this process' own memory cgroup
        env = dict(os.environ, **caps.environment())
        ...                                       # each process of the job calls join_from_env(rank) first
        caps.stats(0)                             # {"max_usage_bytes", "failcnt", "oom_kills", "limit_bytes"}

Each process of a job puts itself into the group of its rank (:func:`join_from_env`, first thing in the
script, before any framework is imported) instead of the job being capped as a whole: a child process inherits
its parent's cgroup, so a cap on the launching process would cap all of them together, and "each process
under the cap" is the claim to test. The groups are made under this process' own memory cgroup (read from
/proc/self/cgroup), never at the hierarchy's root, so whatever limits the machine already sets still apply.
An OOM kill in a group is a SIGKILL (exit status 137), counted in its ``memory.oom_control``.

:meth:`MemoryCaps.close` (also on an exception, and at exit) moves any process still in a group back to this
process' group and removes the groups. Needs root and a writable /sys/fs/cgroup/memory; :func:`unavailable`
says why not, for a skip reason.
"""

import atexit
import os
import time

MOUNT = "/sys/fs/cgroup/memory"
#: The environment variable that tells a job's processes their groups: ``cgroup.procs`` paths, os.pathsep-joined.
ENV = "DKTEST_MEMORY_CAPS"
_open = []


def own_group():
    """This process' memory cgroup directory (cgroup v1), or None where it has none."""
    try:
        with open("/proc/self/cgroup") as handle:
            for line in handle:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if "memory" in controllers.split(","):
                    return os.path.join(MOUNT, path.lstrip("/"))
    except (OSError, ValueError):
        pass
    return None


def unavailable():
    """Why per-process memory caps can't be made here, or None when they can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "memory caps need root (cgroup v1 memory controller); this runs as uid {}".format(
            os.geteuid() if hasattr(os, "geteuid") else "?")
    parent = own_group()
    if parent is None or not os.path.isfile(os.path.join(parent, "memory.limit_in_bytes")):
        return "no cgroup v1 memory controller at {} for this process (cgroup v2 only, or not mounted)".format(MOUNT)
    probe = os.path.join(parent, "dk{}probe".format(os.getpid()))
    try:
        os.mkdir(probe)
        os.rmdir(probe)
    except OSError as exc:
        return "can't make a memory cgroup under {}: {}".format(parent, exc)
    return None


def _write(path, value):
    with open(path, "w") as handle:
        handle.write(str(value))


def _read(path):
    with open(path) as handle:
        return handle.read()


def join_from_env(rank):
    """In a job's process: move this process into the group of ``rank`` named by :data:`ENV` (nothing when unset)."""
    groups = os.environ.get(ENV)
    if groups:
        _write(groups.split(os.pathsep)[rank], os.getpid())


class MemoryCaps(object):
    """``count`` memory cgroups, each limited to ``limit_bytes``; see the module docstring."""

    def __init__(self, count, limit_bytes):
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        self.parent = own_group()
        self.limit_bytes = int(limit_bytes)
        self.paths = []
        _open.append(self)
        try:
            for index in range(count):
                path = os.path.join(self.parent, "dk{}cap{}".format(os.getpid(), index))
                os.mkdir(path)
                self.paths.append(path)
                _write(os.path.join(path, "memory.limit_in_bytes"), self.limit_bytes)
        except BaseException:
            self.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def environment(self):
        """The environment variable that :func:`join_from_env` reads, for the job's processes."""
        return {ENV: os.pathsep.join(os.path.join(p, "cgroup.procs") for p in self.paths)}

    def stats(self, index):
        """Group ``index``: its peak charge, how often it hit the limit, and how many processes the OOM killer
        ended in it."""
        path = self.paths[index]
        control = dict(line.split() for line in _read(os.path.join(path, "memory.oom_control")).splitlines())
        return {"limit_bytes": int(_read(os.path.join(path, "memory.limit_in_bytes"))),
                "max_usage_bytes": int(_read(os.path.join(path, "memory.max_usage_in_bytes"))),
                "failcnt": int(_read(os.path.join(path, "memory.failcnt"))),
                "oom_kills": int(control.get("oom_kill", 0))}

    def close(self):
        """Move every process still in a group to this process' group, then remove the groups. Safe twice."""
        for path in reversed(self.paths):
            for _ in range(50):  # a process exiting can hold the group for a moment
                try:
                    for pid in _read(os.path.join(path, "cgroup.procs")).split():
                        try:
                            _write(os.path.join(self.parent, "cgroup.procs"), pid)
                        except OSError:  # it exited in between
                            pass
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)
        self.paths = []
        if self in _open:
            _open.remove(self)


@atexit.register
def _close_all():
    for caps in list(_open):
        caps.close()
