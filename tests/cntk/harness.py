"""Runs test jobs for the CNTK suite on the real runtime: worker scripts in fresh processes of a CPython 3.6
with CNTK 2.7 and Keras 2.3.1 (``DISTKERAS_CNTK_PYTHON``, else ``.venv-cntk`` made by scripts/cntk-env.sh),
one process, or N MPI ranks under Open MPI's ``mpiexec``, with distkeras' ``src`` on ``PYTHONPATH``.

Jobs talk over loopback only, are bounded in time, and a job that runs out of time is killed with its whole
process group (mpiexec and its ranks).
"""

import json
import os
import shutil
import signal
import subprocess
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SRC = os.path.join(ROOT, "src")
PYTHON = os.environ.get("DISTKERAS_CNTK_PYTHON") or os.path.join(ROOT, ".venv-cntk", "bin", "python")
MPIEXEC = shutil.which("mpiexec")

#: Open MPI: run as root where CI does, more ranks than cores (2 here), and loopback only: shared memory
#: between the ranks, the launcher's own channel on 127.0.0.1.
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_rmaps_base_oversubscribe": "1",
           "OMPI_MCA_btl": "self,vader", "OMPI_MCA_oob_tcp_if_include": "lo", "OMPI_MCA_btl_vader_single_copy_mechanism": "none"}


def _why_no_runtime():
    """None where the real runtime runs here, else why not (shown in pytest's summary as the skip reason)."""
    if not os.path.exists(PYTHON):
        return ("no CNTK runtime: {} does not exist (scripts/cntk-env.sh makes .venv-cntk where a CPython 3.6 is "
                "found; DISTKERAS_CNTK_PYTHON names another)".format(PYTHON))
    if MPIEXEC is None:
        return "no CNTK runtime: mpiexec (Open MPI) is not on PATH; scripts/cntk-env.sh installs it as root"
    check = "import cntk, keras, sys; sys.exit(0 if (cntk.__version__, keras.__version__) == ('2.7', '2.3.1') else 3)"
    try:
        done = subprocess.run([PYTHON, "-c", check], env=dict(os.environ, KERAS_BACKEND="cntk"), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, universal_newlines=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return "no CNTK runtime: {} failed to start: {}".format(PYTHON, exc)
    if done.returncode:
        return "no CNTK runtime: {} lacks cntk 2.7 with Keras 2.3.1: {}".format(PYTHON, done.stdout.strip()[-500:])
    return None


WHY_NOT = _why_no_runtime()
#: Marks the tests that need the real runtime.
needs_runtime = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")


class Job(object):
    def __init__(self, returncode, stdout, stderr, folder):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr
        self.results = {}
        for name in sorted(os.listdir(folder)):
            if name.startswith("result.") and name.endswith(".json"):
                with open(os.path.join(folder, name)) as handle:
                    self.results[int(name.split(".")[1])] = json.load(handle)

    def __repr__(self):
        return "Job(returncode={}, stdout=...{}, stderr=...{})".format(self.returncode, self.stdout[-2000:], self.stderr[-4000:])


def environment(tmp_path, **extra):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, ROOT]), KERAS_BACKEND="cntk", KERAS_HOME=str(tmp_path),
               RESULTS_DIR=str(tmp_path), PYTHONDONTWRITEBYTECODE="1", PYTHONWARNINGS="ignore", **MPI_ENV)
    env["PATH"] = os.pathsep.join([os.path.dirname(PYTHON), env.get("PATH", "")])
    for name in ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "RANK", "WORLD_SIZE",
                 "TF_CONFIG", "DISTKERAS_CPU_DEVICES", "VIRTUAL_ENV"):
        env.pop(name, None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def mpiexec(workers):
    """Open MPI's command line for ``workers`` ranks."""
    return [MPIEXEC, "-n", str(workers)]


def run(tmp_path, body, workers=None, command=None, args=(), timeout=180, **extra):
    """Run ``body`` (a script) as one process (``workers=None``), or as ``workers`` ranks under mpiexec, or
    through ``command`` (a list, the script's path, unless ``body`` is None, and ``args`` appended); returns a
    :class:`Job`."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "worker.py"
    if body is not None:
        script.write_text(textwrap.dedent(body))
    if command is not None:
        argv = list(command) + ([str(script)] if body is not None else [])
    elif workers is None:
        argv = [PYTHON, str(script)]
    else:
        argv = mpiexec(workers) + [PYTHON, str(script)]
    process = subprocess.Popen(argv + list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True,
                               env=environment(tmp_path, **extra), cwd=str(tmp_path), start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise AssertionError("the job ran past {} s and was killed: {}".format(
            timeout, Job(process.returncode, stdout, stderr, str(tmp_path))))
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # anything the job left behind
        except ProcessLookupError:
            pass
    return Job(process.returncode, stdout, stderr, str(tmp_path))
