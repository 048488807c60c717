"""What every process distkeras starts shares: the exit status of a preemption, a worker that dies with its
launcher, and how a script is run. Used by ``distkeras launch`` and by the backends that start processes
themselves (PyTorch's self-launch). Part of the Python 3.6-compatible core: standard library only.
"""

import sys
from typing import List

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
