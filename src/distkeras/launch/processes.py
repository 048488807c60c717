"""What every process distkeras starts shares: the exit status of a preemption, a worker that dies with its
launcher, and how a script is run. Used by ``distkeras launch`` and by the backends that start processes
themselves (PyTorch's self-launch). Part of the Python 3.6-compatible core: standard library only.
"""

import os
import signal
import sys
from typing import List, Optional

#: The exit status of a preempted worker (and job): BSD's EX_TEMPFAIL, "try again later". A worker exits with it
#: after a SIGTERM once its job's checkpoint of the step it stopped at is written; running the job again resumes.
EXIT_PREEMPTED = 75

#: Set in every worker to its launcher's pid: a worker never outlives its launcher.
LAUNCHER_ENV = "DISTKERAS_LAUNCHER_PID"

# Runs in each worker before its command: die with the launcher (Linux: the kernel sends SIGKILL), and
# don't start at all if the launcher is already gone; then become the command (exec keeps the pid and
# the death signal).
_BOOT = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    "    ctypes.CDLL(None).prctl(1, signal.SIGKILL)\n"  # 1 = PR_SET_PDEATHSIG
    "except (OSError, AttributeError):\n"
    "    pass\n"
    "if os.getppid() != int(os.environ[sys.argv[1]]):\n"
    "    os._exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def orphan_proof(command: List[str], parent_variable: str) -> List[str]:
    """``command``, started so that it dies with the process named by ``parent_variable`` in its environment."""
    return [sys.executable, "-c", _BOOT, parent_variable] + list(command)


def python_command(script_args: List[str], python: str) -> List[str]:
    """``script.py args`` and ``-m module args`` run with ``python``; anything else runs as given."""
    if script_args[0].endswith(".py") or script_args[0] == "-m":
        return [python] + list(script_args)
    return list(script_args)


#: What a worker's SIGKILL most often means when nothing says more: the kernel's OOM killer sends it, unannounced.
OOM_HINT = "often the kernel's out-of-memory killer; check `dmesg` / the job's memory limit"


def oom_counter_file(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> Optional[str]:
    """The file that counts this process' cgroup's out-of-memory kills, its subtree's included (the workers this
    process starts): cgroup v2's ``memory.events``, else cgroup v1's ``memory.oom_control`` (both have an
    ``oom_kill N`` line); None where there is neither (no memory controller, not Linux)."""
    candidates = []
    try:
        with open(proc_cgroup) as lines:
            for line in lines:
                hierarchy, _, rest = line.strip().partition(":")
                controllers, _, path = rest.partition(":")
                path = path.lstrip("/")
                if hierarchy == "0" and controllers == "":  # v2: "0::/user.slice/..."
                    candidates[:0] = [os.path.join(root, path, "memory.events"),
                                      os.path.join(root, "unified", path, "memory.events")]  # hybrid mounts
                elif "memory" in controllers.split(","):  # v1: "4:memory:/docker/..."
                    candidates.append(os.path.join(root, "memory", path, "memory.oom_control"))
    except OSError:
        return None
    return next((c for c in candidates if os.path.isfile(c)), None)


def oom_kills(events: Optional[str] = None) -> Optional[int]:
    """The ``oom_kill`` counter in ``events`` (default: :func:`oom_counter_file`, this process' cgroup's), or None
    where it can't be read. cgroup v1 counts each group's own kills only, so a ``memory.oom_control`` is summed
    with those of the groups below it (a worker may sit in a group of its own)."""
    events = events or oom_counter_file()
    if events is None:
        return None
    if os.path.basename(events) != "memory.oom_control":
        return _oom_kill_line(events)
    total = None
    for seen, (folder, _, files) in enumerate(os.walk(os.path.dirname(events))):
        if seen >= _MAX_GROUPS:
            break
        count = _oom_kill_line(os.path.join(folder, "memory.oom_control")) if "memory.oom_control" in files else None
        if count is not None:
            total = (total or 0) + count
    return total


#: cgroup v1: at most this many groups below this process' are read for their kills.
_MAX_GROUPS = 1000


def _oom_kill_line(path: str) -> Optional[int]:
    try:
        with open(path) as lines:
            for line in lines:
                key, _, value = line.partition(" ")
                if key == "oom_kill" and value.strip().isdigit():
                    return int(value)
    except OSError:
        pass
    return None


def describe_exit(code: int) -> str:
    """How a process ended, from its exit status (negative: the signal that killed it), for "rank 1 died (...)".

    Examples:
        >>> describe_exit(3)
        'exit code 3'
        >>> describe_exit(-9)
        'killed by SIGKILL'
    """
    if code >= 0:
        return "exit code {}".format(code)
    try:
        return "killed by {}".format(signal.Signals(-code).name)
    except ValueError:
        return "killed by signal {}".format(-code)


def memory_hint(code: int, oom_kills_before: Optional[int] = None, oom_kills_now: Optional[int] = None) -> Optional[str]:
    """What a worker's SIGKILL likely was, or None for any other ending.

    Nobody announces a SIGKILL, and the kernel's out-of-memory killer sends one: where the cgroup's ``oom_kill``
    counter (:func:`oom_kills`, read before the workers started and after the death) grew, the worker was likely
    killed for memory, and this says so with the counts; else it says where to look.

    Examples:
        >>> memory_hint(-9)
        "(SIGKILL: often the kernel's out-of-memory killer; check `dmesg` / the job's memory limit)"
        >>> memory_hint(1) is None
        True
    """
    if code != -signal.SIGKILL:
        return None
    if oom_kills_before is not None and oom_kills_now is not None and oom_kills_now > oom_kills_before:
        killed = oom_kills_now - oom_kills_before
        return ("(SIGKILL: likely the kernel's out-of-memory killer: this job's cgroup counted {} OOM kill{} since the "
                "launch, oom_kill {} -> {}; give the job more memory, or make the model or the "
                "per-device batch smaller)".format(killed, "" if killed == 1 else "s", oom_kills_before, oom_kills_now))
    return "({})".format("SIGKILL: " + OOM_HINT)
