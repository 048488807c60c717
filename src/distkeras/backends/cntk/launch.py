"""How ``distkeras launch`` starts a CNTK job: CNTK's distributed learners run over MPI, so the workers are MPI
ranks that ``mpiexec`` starts. Framework-free; Python 3.6 compatible.
"""

import shutil
import sys
from typing import Dict, List, Optional, Tuple

from ...errors import LaunchError
from ...launch.processes import python_command


def mpiexec_command(script_args: List[str], nproc: int, python: Optional[str] = None) -> List[str]:
    """The ``mpiexec`` command line that starts ``nproc`` MPI ranks running ``script_args``."""
    return ["mpiexec", "-n", str(nproc)] + python_command(script_args, python or sys.executable)


def launch_command(script_args: List[str],
                   nproc_per_node: int,
                   nnodes: int,
                   environ: Dict[str, str]) -> Tuple[List[List[str]], List[Dict[str, str]], List[object]]:
    """One ``mpiexec`` that starts the job's ranks on this host (see :meth:`CNTKAdapter.launch_command`).

    Raises:
        LaunchError: no ``mpiexec`` on PATH, or a job of several hosts (which takes the user's MPI host file).
    """
    if shutil.which("mpiexec", path=environ.get("PATH")) is None:
        raise LaunchError("The cntk backend runs its workers as MPI ranks, and mpiexec is not on PATH. "
                          "Install Open MPI (Debian/Ubuntu: openmpi-bin libopenmpi3; CNTK 2.7 then needs two links to "
                          "its 1.10 sonames, which scripts/cntk-env.sh makes) or run mpiexec yourself.")
    if nnodes > 1:
        raise LaunchError("For CNTK across hosts, run mpiexec with your host file: "
                          "mpiexec -n N --hostfile hosts python script.py")
    if nproc_per_node == 1:
        sys.stderr.write("distkeras launch: warning: one MPI rank; CNTK trains it as a local learner\n")
    env = dict(environ, KERAS_BACKEND="cntk", PYTHONUNBUFFERED="1")
    return [mpiexec_command(script_args, nproc_per_node)], [env], ["mpi"]
